"""The trainer-side sampler (gen_pool.hf_engine) on a tiny Qwen3-VL built here: a prompt with an image
samples with a trained adapter, and the trainer scores the sampled tokens (with the same image) within
the mismatch bounds tests/test_architectures.py holds vLLM to; tenants' adapters never leak into each
other's sequences, and the base comes back exactly once an adapter leaves the weights. On a tiny
Qwen3-VL-MoE the same holds for an adapter on the experts alone (train_mlp=True). A group queued
behind more distinct adapters than max_cpu_loras still runs: its adapter stays while it is unfinished.
(Text bases it serves, Qwen3.5 among them, are in tests/test_architectures.py's matrix.)"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from genutil import Loop
from PIL import Image
from safetensors.torch import load_file, save_file

from bases.vision import ImageGeometry
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from checkpoints.adapter_merge import Factors, fused_experts
from core.errors import QuiltError
from core.loss_spec import LossConfig
from core.settings import GenPoolSettings
from core.work import AdamParams, AdapterRef, Datum, ImageInput, LoraShape, PassWork, SamplingSpec
from gen_pool import wire
from gen_pool.engine import SeqRequest
from gen_pool.hf_engine import HFEngine
from gen_pool.scheduler import Group, Scheduler
from stack.tiny_model import TinyModelSpec, build_tiny_model

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0}
LOGPROB_DIFF_TOL, MISMATCH_KL_TOL = 1e-4, 1e-6  # tests/test_architectures.py's


def _png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    img = Image.new("RGB", (64, 64), (255, 255, 255))
    img.paste(color, (16, 16, 48, 48))
    img.save(out, "PNG")
    return out.getvalue()


def _image_prompt(path: str) -> tuple[tuple[int, ...], ImageInput]:
    geo = ImageGeometry.of_directory(path)
    n = geo.tokens(64, 64)
    return (5, 6, geo.vision_start_id, *[geo.image_token_id] * n, geo.vision_end_id, 7), ImageInput(3, n, "png",
                                                                                                    _png((200, 20, 20)))


def _trained(be: LoraBackend, name: str, lora: LoraShape, prompt, image, out) -> AdapterRef:
    """`lora` trained three steps on the image prompt, then exported to `out / name`."""
    be.create(name, lora)
    for step in range(3):
        target = prompt[1:] + (30 + 9 * (lora.seed or 0) + step,)
        be.run_pass([PassRequest("t", name, PassWork("cross_entropy", LossConfig(), (Datum(
            prompt, {"target_tokens": target, "weights": (1.0,) * len(prompt)}, images=(image,)),)), False)])
        be.optim_step(name, AdamParams(**ADAM))
    be.save(name, str(out / name), overwrite=False, with_optimizer=False)
    return AdapterRef(key=str(out / name), path=str(out / name), model_id=name, name=name)


def _vision_base(tmp_path_factory, architecture: str):
    """A tiny vision base of `architecture`: its path, an image prompt, its trainer and an adapters directory."""
    path = build_tiny_model(tmp_path_factory.mktemp(architecture) / "base",
                            spec=TinyModelSpec(architecture=architecture, num_layers=2)).path
    prompt, image = _image_prompt(path)
    return path, prompt, image, LoraBackend(path), tmp_path_factory.mktemp(f"{architecture}-adapters")


def _within_mismatch_bounds(be, name: str, prompt, image, results, what: str) -> None:
    """The trainer scores the sampled tokens with adapter `name` within the mismatch bounds, and an
    untrained adapter (the base) far outside them: the adapter was applied."""
    trained, fresh = _score(be, name, prompt, image, results), _score(be, "fresh", prompt, image, results)
    diff, kl = trained["metrics"]["logprob_diff_abs:mean"], trained["metrics"]["mismatch_kl:mean"]
    print(f"\n{what}: logprob_diff_abs:mean={diff:.2e} mismatch_kl:mean={kl:.2e} "
          f"adapter effect={fresh['metrics']['logprob_diff_abs:mean']:.3f} nats")
    assert diff <= LOGPROB_DIFF_TOL and kl <= MISMATCH_KL_TOL, (diff, kl)
    assert fresh["metrics"]["logprob_diff_abs:mean"] > 100 * LOGPROB_DIFF_TOL, fresh["metrics"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path, prompt, image, be, out = _vision_base(tmp_path_factory, "qwen3_vl")
    refs = {name: _trained(be, name, LoraShape(rank=8, seed=seed), prompt, image, out) for name, seed in (("a", 1), ("b", 2))}
    be.create("fresh", LoraShape(rank=8, seed=3))  # B = 0: the base's logprobs
    loop = Loop()
    settings = GenPoolSettings(max_cpu_loras=4, max_lora_rank=16)
    engine = loop.run(HFEngine.start(path, settings, out))
    for ref in refs.values():
        loop.run(engine.load(ref))
    yield be, engine, loop, refs, prompt, image
    engine.shutdown()
    loop.stop()


def _score(be: LoraBackend, model: str, prompt, image, results) -> dict:
    data = []
    for r in results:
        tokens, k = prompt + r.tokens, len(prompt) - 1
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "logprobs": (0.0,) * k + tuple(r.logprobs),
                                        "advantages": (0.0,) * (len(tokens) - 1),
                                        "weights": (0.0,) * k + (1.0,) * len(r.tokens)}, images=(image,)))
    return be.run_pass([PassRequest("f", model, PassWork("importance_sampling", LossConfig(), tuple(data)), True)])[0]


def test_a_prompt_with_an_image_samples_as_the_trainer_scores_it(setup):
    be, engine, loop, refs, prompt, image = setup
    spec = SamplingSpec(max_tokens=12, temperature=1.0, eos_stops=False)
    results = [loop.run(engine.generate(SeqRequest(f"s{seed}", prompt, spec, seed, refs["a"], prompt_logprobs=True,
                                                   sample_topk=3, images=(image,)))) for seed in (1, 2)]
    for r in results:
        assert r.stop_reason == "length" and len(r.tokens) == 12 and r.cached_tokens == 0
        assert r.prompt_logprobs is not None and r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(prompt)
        assert r.sample_topk is not None and all(t is not None and len(t) == 3 for t in r.sample_topk)
    # the same seed draws the same tokens; another seed other ones
    again = loop.run(engine.generate(SeqRequest("again", prompt, spec, 1, refs["a"], images=(image,))))
    assert again.tokens == results[0].tokens and results[0].tokens != results[1].tokens
    _within_mismatch_bounds(be, "a", prompt, image, results, "qwen3_vl with an image")


def test_each_tenant_samples_its_own_adapter_and_the_base_comes_back(setup):
    be, engine, loop, refs, prompt, image = setup
    greedy = SamplingSpec(max_tokens=6, temperature=0.0, eos_stops=False)

    def run(ref):
        return loop.run(engine.generate(SeqRequest("g", prompt, greedy, None, ref, prompt_logprobs=True,
                                                   images=(image,))))

    base = run(None)
    pristine = {k: v.clone() for k, v in engine.params.items()}
    a, b, a_again, base_again = run(refs["a"]), run(refs["b"]), run(refs["a"]), run(None)
    assert a.prompt_logprobs == a_again.prompt_logprobs and a.tokens == a_again.tokens
    assert a.prompt_logprobs != b.prompt_logprobs != base.prompt_logprobs
    assert base_again.prompt_logprobs == base.prompt_logprobs and base_again.tokens == base.tokens
    assert all(torch.equal(v, pristine[k]) for k, v in engine.params.items())  # nothing of a or b stayed


def test_a_sequence_aborted_before_it_runs_ends_as_aborted(setup):
    _, engine, loop, refs, prompt, image = setup
    loop.run(engine.abort(["gone"]))
    r = loop.run(engine.generate(SeqRequest("gone", prompt, SamplingSpec(max_tokens=4), 1, refs["a"],
                                            images=(image,))))
    assert r.stop_reason == "abort" and r.tokens == ()


def test_factors_kept_are_bounded_and_a_queued_groups_version_stays(setup):
    """Through three times QUILT_GEN_MAX_CPU_LORAS new versions: the factors kept are the newest
    that many and the version an unfinished group names (gen_pool.adapters.versions_to_forget);
    a version dropped meanwhile, asked for without a load, is read again and samples as before."""
    be, engine, loop, refs, prompt, image = setup
    greedy = SamplingSpec(max_tokens=6, temperature=0.0, eos_stops=False)

    def run(ref):
        return loop.run(engine.generate(SeqRequest("h", prompt, greedy, None, ref, images=(image,))))

    cap = engine.settings.max_cpu_loras
    for ref in refs.values():
        loop.run(engine.load(ref))
    before = run(refs["b"])
    sizes = []
    for i in range(3 * cap):
        name = f"filler-{i}"
        be.create(name, LoraShape(rank=4, seed=100 + i))
        path = str(Path(refs["a"].path).parent / name)
        be.save(name, path, overwrite=False, with_optimizer=False)
        be.delete(name)
        loop.run(engine.load(AdapterRef(key=path, path=path, model_id=name, name=name),
                             in_use=lambda: {refs["a"].key}))
        sizes.append(engine.tracked_adapters())
    assert max(sizes) <= cap + 1, sizes
    assert refs["a"].key in engine.resident_adapters() and refs["b"].key not in engine.resident_adapters()
    again = run(refs["b"])
    assert again.tokens == before.tokens and again.logprobs == before.logprobs
    assert run(refs["a"]).tokens
# ------------------------------------------------------------------ LoRA on a MoE base's experts

def test_each_expert_s_lora_lands_in_its_rows_of_the_fused_experts_weights():
    gen = torch.Generator().manual_seed(0)
    E, inter, hidden = 3, 2, 4
    shapes = {"m.experts.gate_up_proj": (E, 2 * inter, hidden), "m.experts.down_proj": (E, hidden, inter),
              "m.q_proj.weight": (hidden, hidden)}

    def f(rows, width, rank, scaling):
        return Factors(torch.randn(rows, rank, generator=gen), torch.randn(rank, width, generator=gen), scaling)

    per = {"m.experts.0.gate_proj.weight": f(inter, hidden, 2, 0.5), "m.experts.2.gate_proj.weight": f(inter, hidden, 1, 2.0),
           "m.experts.1.up_proj.weight": f(inter, hidden, 2, 1.0), "m.experts.2.down_proj.weight": f(hidden, inter, 2, 3.0)}
    dense = f(hidden, hidden, 2, 1.0)
    out = fused_experts({**per, "m.q_proj.weight": dense}, shapes)
    assert out["m.q_proj.weight"] is dense and set(out) == set(shapes)
    want = {"m.experts.gate_up_proj": torch.zeros(shapes["m.experts.gate_up_proj"]),
            "m.experts.down_proj": torch.zeros(shapes["m.experts.down_proj"])}
    for name, factors in per.items():  # expert 1's gate, expert 0's up, ... : none (zeros)
        _, _, e, proj, _ = name.split(".")
        weight = want["m.experts.down_proj" if proj == "down_proj" else "m.experts.gate_up_proj"]
        rows = slice(inter, None) if proj == "up_proj" else slice(0, inter) if proj == "gate_proj" else slice(None)
        weight[int(e), rows] = factors.delta()
    for name, delta in want.items():
        assert tuple(out[name].shape) == shapes[name]
        torch.testing.assert_close(out[name].delta(torch.float32), delta, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="expert 3's LoRA"):  # the base has 3 experts
        fused_experts({"m.experts.3.gate_proj.weight": f(inter, hidden, 1, 1.0)}, shapes)
    with pytest.raises(ValueError, match="does not fit 'm.experts.down_proj'"):
        fused_experts({"m.experts.0.down_proj.weight": f(inter, hidden, 1, 1.0)}, shapes)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path, prompt, image, be, out = _vision_base(tmp_path_factory, "qwen3_vl_moe")
    experts_only = LoraShape(rank=8, seed=4, train_attn=False, train_mlp=True, train_unembed=False)
    ref = _trained(be, "experts", experts_only, prompt, image, out)
    be.create("fresh", LoraShape(rank=8, seed=5, train_attn=False, train_mlp=True, train_unembed=False))
    loop = Loop()
    engine = loop.run(HFEngine.start(path, GenPoolSettings(max_cpu_loras=4, max_lora_rank=16), out))
    yield be, engine, loop, ref, prompt, image
    engine.shutdown()
    loop.stop()


def test_lora_on_the_experts_samples_as_the_trainer_scores_it_and_leaves_the_base_as_it_was(moe):
    be, engine, loop, ref, prompt, image = moe
    tensors = load_file(f"{ref.path}/adapter_model.safetensors")  # the experts', each under its own name, alone
    assert tensors and all(".mlp.experts." in k for k in tensors) and any(v.abs().sum() > 0 for k, v in tensors.items()
                                                                          if ".lora_B." in k)
    spec = SamplingSpec(max_tokens=12, temperature=1.0, eos_stops=False)

    def run(adapter, seed):
        return loop.run(engine.generate(SeqRequest(f"x{seed}", prompt, spec, seed, adapter, prompt_logprobs=True,
                                                   images=(image,))))

    base = run(None, 1)
    pristine = {k: v.clone() for k, v in engine.params.items()}
    loop.run(engine.load(ref))
    results = [run(ref, seed) for seed in (1, 2)]
    merged = [k for k in engine.params if not torch.equal(engine.params[k], pristine[k])]
    assert merged and all(k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) for k in merged), merged
    _within_mismatch_bounds(be, "experts", prompt, image, results, "qwen3_vl_moe, LoRA on the experts alone")
    again = run(None, 1)  # the experts' own weights back, bit for bit
    assert all(torch.equal(v, pristine[k]) for k, v in engine.params.items())
    assert again.tokens == base.tokens and again.prompt_logprobs == base.prompt_logprobs


# ------------------------------------------------------------------ held adapters

def test_groups_queued_behind_more_adapters_than_the_cache_holds_all_run(setup, tmp_path):
    """Four groups, four adapters, a cache of two: each group's adapter stays while the group is
    unfinished (the scheduler names it to `load`). (Before, the two loaded first were evicted by the
    next two, and their groups failed with "adapter ... was not loaded before use".)"""
    be, _, loop, refs, prompt, image = setup
    refs_by_scale = []
    for i, scale in enumerate((0.5, 1.0, 1.5, 2.0)):  # a's adapter with its B scaled: four distinct adapters
        dest = tmp_path / f"a{i}"
        shutil.copytree(refs["a"].path, dest)
        tensors = load_file(str(dest / "adapter_model.safetensors"))
        save_file({k: v * scale if ".lora_B." in k else v for k, v in tensors.items()}, str(dest / "adapter_model.safetensors"))
        refs_by_scale.append(AdapterRef(key=str(dest), path=str(dest), model_id=f"a{i}", name=f"a{i}"))
    engine = loop.run(HFEngine.start(be.base_path, GenPoolSettings(max_cpu_loras=2, max_lora_rank=16), tmp_path))
    spec = SamplingSpec(max_tokens=4, temperature=0.0, eos_stops=False)
    outcomes: dict[str, wire.SampleOutcome | QuiltError] = {}

    async def drive() -> list[str]:
        sched = Scheduler(engine, target=2, on_finish=lambda g, out: outcomes.__setitem__(g.request_id, out))
        for i, ref in enumerate(refs_by_scale):
            sched.add(Group(f"g{i}", f"t{i}", prompt, spec, 2, ref, model_id=ref.model_id, images=(image,)))
        while any(not g.ready for g in sched.groups.values()):  # every group's adapter loaded before any runs
            await sched.wait(0.2)
        queued = engine.resident_adapters()
        while len(outcomes) < len(refs_by_scale):
            sched.step()
            await sched.wait(0.2)
        return queued

    try:
        queued = loop.run(drive())
        assert all(isinstance(out, wire.SampleOutcome) for out in outcomes.values()), outcomes
        assert len(queued) == 4  # over the cap while all four wait
        tokens = {}
        for i, ref in enumerate(refs_by_scale):
            out = outcomes[f"g{i}"]
            assert isinstance(out, wire.SampleOutcome)
            tokens[i] = {s.tokens for s in out.sequences}
            loop.run(engine.load(ref))  # the group's adapter, sampled directly, gives the same tokens
            alone = loop.run(engine.generate(SeqRequest(f"d{i}", prompt, spec, None, ref, images=(image,))))
            assert tokens[i] == {alone.tokens}, (i, tokens[i], alone.tokens)
        assert len({frozenset(t) for t in tokens.values()}) > 1  # the adapters differ, and so did what they sampled
    finally:
        engine.shutdown()
