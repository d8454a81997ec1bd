"""bench/gpu_dryrun.py: Quilt's fused pass on the meta device, at a tiny shape, alone and as rank 0 of
a tensor-parallel gang of 2 over a fake process group, as rank 0 of a data-parallel FSDP pair, and
LoRA on a tiny MoE's experts as rank 0 of
an expert-parallel pair: no host sync, nothing on the wrong device or
converted unasked, every grouped-GEMM operand on 16 bytes, FLOPs counted. And its detectors, each shown
catching what it is there to catch, so a zero above means none rather than a blind eye."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dryrun():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_dryrun

        yield gpu_dryrun
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_the_tiny_pass_has_no_sync_no_misplaced_tensor_and_no_misaligned_operand():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "bench/gpu_dryrun.py", "--shapes", "tiny,tiny-tp2,tiny-moe-ep2,tiny-fsdp2",
                           "--tenants", "2", "--tokens", "16"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    shapes = json.loads(done.stdout.strip().splitlines()[-1])["shapes"]
    for name, r in shapes.items():
        assert (r["host_syncs"], r["misplaced"], r["misaligned"]) == (0, 0, 0), (name, r)
        assert r["flops_per_pass"] > 0 and r["ops_eager"] > 0, (name, r)
        assert r["tracked_peak_gib_per_rank"] > 0 and r["plan_peak_gib_per_rank"] > 0, (name, r)
        assert r["step"]["syncs"] == {"device-to-host copy": 1}, r  # the step's one read-back of the norms
    assert shapes["tiny"]["ops_captured"] > 0 and shapes["tiny"]["captured"].startswith("captured")
    assert shapes["tiny"]["grouped_gemm_calls"]["bucketed"] > 0  # the alignment check had operands to check
    assert shapes["tiny-tp2"]["ranks"] == 2 and shapes["tiny-tp2"]["captured"].startswith("eager: a trainer gang")
    assert shapes["tiny-moe-ep2"]["grouped_gemm_calls"]["eager"] > 0  # the experts' grouped GEMM, checked
    # rank 0 of a tensor-parallel pair does about half the base's work (the unembedding's LoRA stays whole)
    assert shapes["tiny-tp2"]["flops_per_pass"] < 0.8 * shapes["tiny"]["flops_per_pass"]
    # rank 0 of a data-parallel FSDP pair computes one of the two tenants' rows: half the pass's work
    fsdp, tiny = shapes["tiny-fsdp2"], shapes["tiny"]
    assert 0.4 * tiny["flops_per_pass"] < fsdp["flops_per_pass"] < 0.6 * tiny["flops_per_pass"], (fsdp, tiny)


def test_the_watch_counts_syncs_mixed_devices_and_misaligned_grouped_operands(dryrun):
    meta = torch.device("meta")
    watch = dryrun.Watch(meta)
    with watch:
        x = torch.empty(8, device=meta)
        assert x.sum().item() == 1  # served: a meta tensor has no value to read
        x.nonzero()
        x.cpu()
        torch.empty(8, device=meta) + torch.empty(8)  # a host tensor in a device operator
    assert watch.syncs == {"_local_scalar_dense": 1, "nonzero": 1, "device-to-host copy": 1}
    assert watch.mixed == {"add": 1}
    watch.reset()
    a = torch.empty(65, 64, dtype=torch.bfloat16, device=meta)
    w = torch.empty(2, 64, 32, dtype=torch.bfloat16, device=meta)
    offs = torch.empty(2, dtype=torch.int32, device=meta)
    with watch:
        torch._grouped_mm(a[:64], w, offs=offs)
        assert not watch.misaligned
        torch._grouped_mm(a[1:], w, offs=offs)  # starts 128 bytes in: fine; one row in is 2 bytes off
        torch._grouped_mm(a.view(-1)[1:4097].view(64, 64), w, offs=offs)
    assert sum(watch.misaligned.values()) == 1, watch.misaligned


def test_the_watch_flags_a_conversion_in_the_layers_that_the_plan_did_not_ask_for(dryrun):
    """An adapter computing in float32 on a bfloat16 base (what the CPU's compute dtype does) converts
    every layer's input: outside gpu_like() the tiny pass shows it."""
    meta = torch.device("meta")
    watch = dryrun.Watch(meta)
    from batcher.engine import multilora

    x = torch.empty(4, 8, dtype=torch.bfloat16, device=meta)
    a = torch.empty(2, 8, dtype=torch.float32, device=meta)

    def shrink() -> torch.Tensor:  # run from a frame of the engine's layer code, as Shrink.forward is
        return x.to(a.dtype) @ a.T

    shrink.__code__ = shrink.__code__.replace(co_filename=multilora.__file__, co_name="forward")
    with watch:
        shrink()
    assert watch.unasked == {"bfloat16->float32 in multilora.forward": 1}, watch.conversions
