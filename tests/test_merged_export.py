"""Merged exports: the adapter merged into its base (checkpoints.adapter_merge) is a Hugging Face model
that transformers loads and the vLLM engine serves, scoring tokens as base + adapter does; `quilt
export` writes it (--merge) or the adapter alone (--peft) from a running stack, for its owner only;
the dashboard offers the same download."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import quilt
import torch
from dashutil import login, run_url
from genutil import Loop, Reference, make_adapter
from stackutil import ROOT, TINY

from bases import catalog
from checkpoints import adapter_merge
from core import db

TOKENS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
TOL = 1e-4  # float32 on both sides


def _logprobs(model_dir: Path, tokens: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    return [lp[i - 1, tokens[i]].item() for i in range(1, len(tokens))]


def _close(a: list[float], b: list[float], tol: float = TOL) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) < tol


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from stack.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("merge") / "tiny").path


def test_merged_weights_score_as_base_plus_adapter(tiny, tmp_path):
    adapter = make_adapter(tiny, tmp_path / "adapter", rank=8, seed=3, scale=0.2)
    names = adapter_merge.write_merged(Path(tiny), Path(adapter), tmp_path / "merged")
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names)
    assert {p.name: p.stat().st_size for p in (tmp_path / "merged").glob("*.safetensors")} == \
        {p.name: p.stat().st_size for p in Path(tiny).glob("*.safetensors")}
    with_adapter = Reference(tiny).token_logprobs(adapter, TOKENS)
    merged = _logprobs(tmp_path / "merged", TOKENS)
    assert _close(merged, with_adapter)
    assert not _close(merged, Reference(tiny).token_logprobs(None, TOKENS), 0.1)  # the adapter matters


def test_an_adapter_for_another_base_is_refused(tiny, tmp_path):
    adapter = Path(make_adapter(tiny, tmp_path / "adapter", rank=4, seed=1))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    a_key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[a_key.replace("layers.0.", "layers.99.")] = tensors[a_key].clone()
    tensors[a_key.replace("layers.0.", "layers.99.").replace("lora_A", "lora_B")] = \
        tensors[a_key.replace("lora_A", "lora_B")].clone()
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="layers.99"):
        adapter_merge.merged_members(Path(tiny), adapter)


def _quilt(*args: str, key: str, stack) -> subprocess.CompletedProcess:
    env = {**os.environ, "QUILT_API_KEY": key, "QUILT_BASE_URL": stack.base_url}
    return subprocess.run([sys.executable, "-m", "stack.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(stack):
    owner = stack.create_tenant("mx")
    with stack.sdk(owner.key) as client:
        tc = client.create_training_client(TINY, rank=8, seed=5)
        datum = quilt.datum_for_next_token(TOKENS)
        for _ in range(3):
            tc.train_step([datum], adam=quilt.AdamParams(learning_rate=2e-2))
        path = tc.save_weights_for_sampler("to-merge").result()
        expected = tc.forward([datum]).result().loss_fn_outputs[0]["logprobs"].data
    with db.connect(stack.database_url) as conn:
        base = catalog.get_model_sync(conn, TINY).path
    return owner, tc.model_id, path, list(expected), base


def test_quilt_export_merge_and_peft(stack, trained, tmp_path):
    owner, model_id, path, expected, base = trained
    done = _quilt("export", path, "--merge", "--out", str(tmp_path / "merged"), key=owner.key, stack=stack)
    assert done.returncode == 0, done.stderr
    assert _close(_logprobs(tmp_path / "merged", TOKENS), expected)
    assert json.loads((tmp_path / "merged" / "config.json").read_text()) == \
        json.loads((Path(base) / "config.json").read_text())
    done = _quilt("export", path, "--peft", "--out", str(tmp_path / "peft"), key=owner.key, stack=stack)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in (tmp_path / "peft").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert _close(Reference(base).token_logprobs(str(tmp_path / "peft"), TOKENS), expected)
    # Not overwritten unless asked; another tenant's checkpoint is a 404 like a missing one.
    again = _quilt("export", path, "--peft", "--out", str(tmp_path / "peft"), key=owner.key, stack=stack)
    assert again.returncode == 2 and "--force" in again.stderr
    other = stack.create_tenant("mx-other")
    theirs = _quilt("export", path, "--merge", "--out", str(tmp_path / "x"), key=other.key, stack=stack)
    assert theirs.returncode != 0 and "404" in theirs.stderr and not (tmp_path / "x").exists()


@pytest.mark.engine
def test_the_merged_model_is_served_by_the_vllm_engine(stack, trained, tmp_path):
    from core.settings import GenPoolSettings
    from core.work import SamplingSpec
    from gen_pool.engine import GenEngine, SeqRequest

    owner, _, path, expected, _ = trained
    assert _quilt("export", path, "--merge", "--out", str(tmp_path / "m"), key=owner.key, stack=stack).returncode == 0
    loop = Loop()
    engine = loop.run(GenEngine.start(str(tmp_path / "m"), GenPoolSettings(concurrency_target=4, kv_cache_gib=1),
                                      tmp_path / "work"))
    try:
        out = loop.run(engine.generate(SeqRequest("merged-0", tuple(TOKENS), SamplingSpec(max_tokens=1),
                                                  prompt_logprobs=True)))
    finally:
        engine.shutdown()
        loop.stop()
    assert _close(list(out.prompt_logprobs[1:]), expected, 1e-3)  # vLLM vs torch, fp32 (test_gen_engine)


def test_the_dashboard_offers_the_merged_model(stack, trained):
    owner, model_id, _, expected, _ = trained
    client = login(stack, owner.key)
    page = client.get(f"{run_url(model_id)}")
    assert "merged.tar" in page.text
    r = client.get(f"{run_url(model_id)}/checkpoints/sampler_weights/to-merge/merged.tar")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:") as tar:
        names = {m.name.split("/")[-1] for m in tar.getmembers()}
    assert {"config.json", "model.safetensors"} <= names


def test_merged_downloads_at_once_are_bounded_and_give_their_place_back():
    """Each running merge holds about one weight in float32: past QUILT_MERGED_DOWNLOADS_AT_ONCE
    (2) a third is a 429 with Retry-After; a finished, failed or abandoned one frees its place."""
    import gc

    from api.dashboard import adapter_archive
    from checkpoints.adapter_merge import Member
    from core.errors import QuotaExceeded

    def drain(response) -> bytes:
        async def read() -> bytes:
            return b"".join([chunk async for chunk in response.body_iterator])
        return asyncio.run(read())

    members = [Member("x", 3, lambda: iter([b"abc"]))]
    first = adapter_archive.merged_response("m", "n", members)
    second = adapter_archive.merged_response("m", "n", members)
    with pytest.raises(QuotaExceeded) as refused:
        adapter_archive.merged_response("m", "n", members)
    assert refused.value.field == "merged" and refused.value.retry_after_s == 60
    assert len(drain(first)) == 10240  # sent whole: its place is back
    del second  # never sent (the client left before the first byte)
    gc.collect()
    assert adapter_archive._merges_running == 0
    third = adapter_archive.merged_response("m", "n", [Member("x", 5, lambda: iter([b"abc"]))])
    with pytest.raises(OSError):  # a member shorter than its header said
        drain(third)
    assert adapter_archive._merges_running == 0


def test_a_merge_keeps_only_the_low_rank_factors(tmp_path):
    """What a merge holds before it writes: each wrapped weight's B and A, not its dense delta."""
    import torch
    from safetensors.torch import save_file

    from checkpoints import adapter_merge

    save_file({"base_model.model.layer.q.lora_A.weight": torch.ones(4, 1024),
               "base_model.model.layer.q.lora_B.weight": torch.ones(2048, 4)},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    factors = adapter_merge.lora_factors(tmp_path)
    f = factors["layer.q.weight"]
    assert f.shape == (2048, 1024) and f.a.numel() + f.b.numel() == 4 * (1024 + 2048)
    assert torch.equal(f.delta(), torch.full((2048, 1024), 8.0))  # scaling 8/4 times rank 4 of ones


def _transposed_experts(src: Path, dest: Path) -> None:
    """`src` with its fused experts stored [E, in, out], as published Qwen3-VL-MoE checkpoints are."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    for shard in dest.glob("*.safetensors"):
        tensors = load_file(str(shard))
        save_file({k: v.transpose(1, 2).contiguous() if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))
                   else v for k, v in tensors.items()}, str(shard), metadata={"format": "pt"})


def test_expert_lora_merges_into_a_base_that_fuses_its_experts(tmp_path):
    """The trainer exports expert LoRA per expert (`….experts.{e}.gate_proj`); Qwen3-VL-MoE fuses a
    block's experts (`gate_up_proj`, gate rows then up rows; `down_proj`), in memory [E, out, in] and
    in published checkpoints [E, in, out]. The merge puts each expert's delta in its rows in either
    layout, and transformers loads both merged models to the same logits."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from batcher.engine.backend import LoraBackend
    from core.work import LoraShape
    from stack.tiny_model import TinyModelSpec, build_tiny_model

    base = build_tiny_model(tmp_path / "base", spec=TinyModelSpec(architecture="qwen3_vl_moe", num_layers=1)).path
    be = LoraBackend(base)
    be.create("x", LoraShape(rank=4, seed=1, train_attn=False, train_mlp=True, train_unembed=False))
    adapter = tmp_path / "adapter"
    be.save("x", str(adapter), overwrite=False, with_optimizer=False)
    weights = adapter / "adapter_model.safetensors"
    gen = torch.Generator().manual_seed(0)  # a fresh adapter's B is zero: give it some
    save_file({k: torch.randn(v.shape, generator=gen, dtype=v.dtype) if ".lora_B." in k else v
               for k, v in load_file(str(weights)).items()}, str(weights))

    factors = adapter_merge.lora_factors(adapter)
    assert any(".experts.0.gate_proj" in k for k in factors)
    adapter_merge.write_merged(Path(base), adapter, tmp_path / "merged")
    merged, pristine = load_file(str(tmp_path / "merged" / "model.safetensors")), load_file(f"{base}/model.safetensors")
    prefix = "model.language_model.layers.0.mlp.experts"
    inter = factors[f"{prefix}.0.gate_proj.weight"].shape[0]
    for e in range(pristine[f"{prefix}.gate_up_proj"].shape[0]):  # each expert's rows, by hand
        want = {"gate_up_proj": torch.cat([factors[f"{prefix}.{e}.{p}.weight"].delta() for p in ("gate_proj", "up_proj")]),
                "down_proj": factors[f"{prefix}.{e}.down_proj.weight"].delta()}
        for name, delta in want.items():
            got = merged[f"{prefix}.{name}"][e] - pristine[f"{prefix}.{name}"][e]
            torch.testing.assert_close(got, delta, rtol=1e-5, atol=1e-6)
    assert merged[f"{prefix}.gate_up_proj"].shape[1] == 2 * inter

    _transposed_experts(Path(base), tmp_path / "published")
    adapter_merge.write_merged(tmp_path / "published", adapter, tmp_path / "merged-published")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    logits = []
    for d in ("merged", "merged-published"):
        model = AutoModelForImageTextToText.from_pretrained(str(tmp_path / d), dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    plain = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - logits[0]).abs().max() > 1e-3  # the adapter did change them
