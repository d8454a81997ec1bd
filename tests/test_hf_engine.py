"""The trainer-side sampler (gen_pool.hf_engine) on a tiny Qwen3-VL built here: a prompt with an image
samples with a trained adapter, and the trainer scores the sampled tokens (with the same image) within
the mismatch bounds tests/test_architectures.py holds vLLM to; tenants' adapters never leak into each
other's sequences, and the base comes back exactly once an adapter leaves the weights.
(Text bases it serves, Qwen3.5 among them, are in tests/test_architectures.py's matrix.)"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from genutil import Loop
from PIL import Image

from bases.vision import ImageGeometry
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from core.loss_spec import LossConfig
from core.settings import GenPoolSettings
from core.work import AdamParams, AdapterRef, Datum, ImageInput, LoraShape, PassWork, SamplingSpec
from gen_pool.engine import SeqRequest
from gen_pool.hf_engine import HFEngine
from stack.tiny_model import TinyModelSpec, build_tiny_model

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0}
LOGPROB_DIFF_TOL, MISMATCH_KL_TOL = 1e-4, 1e-6  # tests/test_architectures.py's


def _png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    img = Image.new("RGB", (64, 64), (255, 255, 255))
    img.paste(color, (16, 16, 48, 48))
    img.save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("vl") / "base",
                            spec=TinyModelSpec(architecture="qwen3_vl", num_layers=2)).path
    geo = ImageGeometry.of_directory(path)
    pic = _png((200, 20, 20))
    n = geo.tokens(64, 64)
    prompt = (5, 6, geo.vision_start_id, *[geo.image_token_id] * n, geo.vision_end_id, 7)
    image = ImageInput(3, n, "png", pic)
    be = LoraBackend(path)
    out = tmp_path_factory.mktemp("adapters")
    refs = {}
    for name, seed in (("a", 1), ("b", 2)):
        be.create(name, LoraShape(rank=8, seed=seed))
        for step in range(3):
            target = prompt[1:] + (30 + 9 * seed + step,)
            be.run_pass([PassRequest("t", name, PassWork("cross_entropy", LossConfig(), (Datum(
                prompt, {"target_tokens": target, "weights": (1.0,) * len(prompt)}, images=(image,)),)), False)])
            be.optim_step(name, AdamParams(**ADAM))
        be.save(name, str(out / name), overwrite=False, with_optimizer=False)
        refs[name] = AdapterRef(key=str(out / name), path=str(out / name), model_id=name, name=name)
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
    trained, fresh = _score(be, "a", prompt, image, results), _score(be, "fresh", prompt, image, results)
    diff, kl = trained["metrics"]["logprob_diff_abs:mean"], trained["metrics"]["mismatch_kl:mean"]
    print(f"\nqwen3_vl with an image: logprob_diff_abs:mean={diff:.2e} mismatch_kl:mean={kl:.2e} "
          f"adapter effect={fresh['metrics']['logprob_diff_abs:mean']:.3f} nats")
    assert diff <= LOGPROB_DIFF_TOL and kl <= MISMATCH_KL_TOL, (diff, kl)
    assert fresh["metrics"]["logprob_diff_abs:mean"] > 100 * LOGPROB_DIFF_TOL, fresh["metrics"]


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
