"""Images on a vision base (Qwen3-VL), on a tiny random-weight one built here with its own image processor.

The API's token count and the trainer's multimodal positions agree with transformers' processor and
model; the trainer's logprobs of a row with images equal transformers' own forward; image rows pack
beside other tenants' text rows and train exactly as alone (float64); hostile and over-limit images
are 400s naming the field and the limit; a text base refuses images by name; audio is refused by name.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from api import images, tinker_proto
from api.datums import RawDatum, RawImage
from api.schemas import DatumIn
from bases import architectures, model_sources
from bases.vision import ImageGeometry, ImageLimits, check_image
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from batcher.engine.vision import mrope_positions
from core.errors import InvalidInput
from core.loss_spec import LossConfig
from core.work import AdamParams, Datum, ImageInput, LoraShape, PassWork
from stack.tiny_model import TinyModelSpec, build_tiny_model

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0}
LIMITS = ImageLimits(max_bytes=200_000, max_pixels=1_000_000)


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("vl") / "base",
                            spec=TinyModelSpec(architecture="qwen3_vl", num_layers=2)).path


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def each_vl(request, vl, tmp_path_factory) -> str:
    if request.param == "qwen3_vl":
        return vl
    return build_tiny_model(tmp_path_factory.mktemp("vlmoe") / "base",
                            spec=TinyModelSpec(architecture=request.param, num_layers=2)).path


def _png(w: int, h: int, color=(200, 30, 30), fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    img = Image.new("RGB", (w, h), color)
    img.paste((20, 20, 220), (w // 4, h // 4, w // 2, h // 2))  # a shape: pixels that differ
    img.save(out, fmt)
    return out.getvalue()


def _declared_png(w: int, h: int) -> bytes:
    """A PNG whose header declares w x h pixels, with a few bytes of data: a decompression bomb's shape."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_a_vision_base_enters_the_catalogue(vl):
    # Sampleable: the trainer-side sampler serves it (gen_pool.hf_engine; vLLM's model needs torchvision).
    base = model_sources.describe("tiny-vl", vl, model_sources.locate(path=vl)[1], renderer="chatml")
    assert base.sampleable
    assert base.architecture == "qwen3_vl" and base.vocab_size == json.loads(
        (Path(vl) / "config.json").read_text())["text_config"]["vocab_size"]
    arch = architectures.of_config(base.config)
    assert arch.vision and "lm_head" in arch.targets(tied=False)
    (Path(vl) / "preprocessor_config.json").rename(Path(vl) / "kept.json")
    try:
        with pytest.raises(InvalidInput) as exc:
            model_sources.describe("tiny-vl", vl, model_sources.locate(path=vl)[1], renderer="chatml",
                                   sampleable=False)
        assert exc.value.field == "processor"
    finally:
        (Path(vl) / "kept.json").rename(Path(vl) / "preprocessor_config.json")


@pytest.mark.parametrize("size", [(70, 50), (32, 32), (10, 10), (500, 40), (129, 257), (1000, 1000)])
def test_token_count_is_the_processors(vl, size):
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(vl)
    geo = ImageGeometry.of_directory(vl)
    w, h = size
    out = processor(images=[Image.new("RGB", (w, h))], return_tensors="pt")
    assert tuple(out["image_grid_thw"][0].tolist()) == geo.grid(h, w)
    assert out["image_grid_thw"][0].prod().item() // geo.merge_size ** 2 == geo.tokens(h, w)


def test_positions_are_the_models(vl):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vl)
    geo = ImageGeometry.of_directory(vl)
    grids = [geo.grid(50, 70), geo.grid(128, 32)]
    counts = [g[1] * g[2] // 4 for g in grids]
    ids = [5, 6] + [geo.image_token_id] * counts[0] + [7, 8, 9] + [geo.image_token_id] * counts[1] + [10]
    t = torch.tensor([ids])
    want, _ = model.model.get_rope_index(t, (t == geo.image_token_id).int(), image_grid_thw=torch.tensor(grids))
    got = mrope_positions(len(ids), [(2, grids[0]), (2 + counts[0] + 3, grids[1])], geo.merge_size)
    assert torch.equal(want[:, 0], got)


def _image_datum(geo: ImageGeometry, pics: list[bytes], text: int = 3) -> Datum:
    tokens: list[int] = [5, 6]
    inputs = []
    for pic in pics:
        h, w = check_image("x", pic, "png", LIMITS)
        tokens.append(geo.vision_start_id)
        inputs.append(ImageInput(len(tokens), geo.tokens(h, w), "png", pic))
        tokens += [geo.image_token_id] * geo.tokens(h, w) + [geo.vision_end_id]
    tokens += list(range(40, 40 + text + 1))
    return Datum(tuple(tokens[:-1]), {"target_tokens": tuple(tokens[1:]), "weights": (1.0,) * (len(tokens) - 1)},
                 images=tuple(inputs))


def _text_datum(start: int, n: int) -> Datum:
    toks = tuple(range(start, start + n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * n})


def _req(model_id: str, data) -> PassRequest:
    return PassRequest(model_id, model_id, PassWork("cross_entropy", LossConfig(), tuple(data)), False)


def test_trainer_logprobs_with_images_equal_transformers(each_vl):
    from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    vl = each_vl

    geo = ImageGeometry.of_directory(vl)
    pics = [_png(70, 50), _png(40, 100, (10, 200, 10))]
    datum = _image_datum(geo, pics)
    backend = LoraBackend(vl, dtype=torch.float64)
    backend.create("a", LoraShape(rank=4, seed=1))  # B is zero: the adapter changes nothing yet
    out = backend.run_pass([PassRequest("r", "a", PassWork("cross_entropy", LossConfig(), (datum,)), True)])
    got = torch.tensor(out[0]["loss_fn_outputs"][0]["logprobs"]["data"], dtype=torch.float64)
    moe = {"experts_implementation": "eager"} if "moe" in json.loads((Path(vl) / "config.json").read_text())["model_type"] \
        else {}  # grouped_mm has no float64 kernel
    model = AutoModelForImageTextToText.from_pretrained(vl, dtype=torch.float64, **moe).eval()
    pixels = Qwen2VLImageProcessorPil.from_pretrained(vl)(
        images=[Image.open(io.BytesIO(p)).convert("RGB") for p in pics], return_tensors="pt")
    ids = torch.tensor([datum.tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                       mm_token_type_ids=(ids == geo.image_token_id).int(), use_cache=False).logits
    want = torch.log_softmax(logits[0], -1).gather(-1, torch.tensor(datum.inputs["target_tokens"])[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)  # results travel as float32


def test_image_rows_pack_beside_text_rows_and_train_as_alone(vl):
    geo = ImageGeometry.of_directory(vl)
    specs = {
        "a": (LoraShape(rank=8, seed=1), [_image_datum(geo, [_png(70, 50), _png(40, 100, (10, 200, 10))])]),
        "b": (LoraShape(rank=4, seed=2, train_mlp=False), [_text_datum(40, 7), _text_datum(90, 20)]),
        "c": (LoraShape(rank=2, seed=3), [_image_datum(geo, [_png(128, 96, (0, 0, 0))], text=6), _text_datum(300, 5)]),
    }
    fused, alone = LoraBackend(vl, dtype=torch.float64), LoraBackend(vl, dtype=torch.float64)
    for backend in (fused, alone):
        for model_id, (lora, _) in specs.items():
            backend.create(model_id, lora)
    for _ in range(2):
        outs = fused.run_pass([_req(m, data) for m, (_, data) in specs.items()])
        assert all(isinstance(o, dict) for o in outs), outs
        assert fused.last_pass.models == 3
        for model_id, (_, data) in specs.items():
            fused.optim_step(model_id, AdamParams(**ADAM))
            alone.run_pass([_req(model_id, data)])
            alone.optim_step(model_id, AdamParams(**ADAM))
    for model_id in specs:
        a, b = fused.adapter_state(model_id), alone.adapter_state(model_id)
        assert a and not any(".visual." in k for k in a), sorted(a)[:3]  # the vision tower carries no LoRA
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-9, atol=1e-10, msg=f"{model_id} {key}")


def _raw(pics: list[RawImage], text: int = 4) -> RawDatum:
    return RawDatum(list(range(5, 5 + text)), {}, raw_images=tuple(pics))


def test_images_become_image_tokens_and_expected_tokens_is_checked(vl):
    geo = ImageGeometry.of_directory(vl)
    pic = _png(70, 50)
    [d] = images.expand([_raw([RawImage(2, "png", pic, expected_tokens=geo.tokens(50, 70))])], geo, LIMITS, 4)
    n = geo.tokens(50, 70)
    assert d.tokens == [5, 6] + [geo.image_token_id] * n + [7, 8] and d.images == (ImageInput(2, n, "png", pic),)
    with pytest.raises(InvalidInput) as exc:
        images.expand([_raw([RawImage(2, "png", pic, expected_tokens=n + 3)])], geo, LIMITS, 4)
    assert exc.value.field == "data[0].model_input.images[0].expected_tokens"
    assert f"expects {n + 3} tokens" in str(exc.value) and f"takes {n}" in str(exc.value)
    url = "data:image/png;base64," + base64.b64encode(pic).decode()
    [p] = images.expand([_raw([RawImage(0, "png", None, location=url)])], geo, LIMITS, 4)
    assert p.images[0].data == pic


def _refusal(geo, raw: RawImage, limits: ImageLimits = LIMITS, max_images: int = 4, count: int = 1) -> InvalidInput:
    with pytest.raises(InvalidInput) as exc:
        images.expand([_raw([raw] * count)], geo, limits, max_images)
    return exc.value


@pytest.mark.parametrize("case,raw,words", [
    ("truncated png", RawImage(0, "png", _png(70, 50)[:60]), "not a readable png"),
    ("jpeg claimed as png", RawImage(0, "png", _png(70, 50, fmt="JPEG")), "not a readable png"),
    ("not an image", RawImage(0, "jpeg", b"\0" * 100), "not a readable jpeg"),
    ("bomb over the limit", RawImage(0, "png", _declared_png(5000, 5000)), "1000000 pixels"),
    ("bomb past PIL's own", RawImage(0, "png", _declared_png(100_000, 100_000)), "1000000 pixels"),
    ("too many bytes", RawImage(0, "png", b"\x89PNG" + b"\0" * 200_001), "200000 bytes"),
    ("unknown format", RawImage(0, "gif", _png(8, 8)), "format"),
    ("aspect", RawImage(0, "png", _png(3000, 10)), "aspect ratio"),
    ("another host", RawImage(0, "png", None, location="https://example.com/cat.png"), "data: URLs"),
    ("another tenant", RawImage(0, "png", None, location="s3://quilt/tenant-b/images/cat.png"), "another account"),
    ("a local file", RawImage(0, "png", None, location="file:///etc/passwd"), "data: URLs"),
    ("bad base64 url", RawImage(0, "png", None, location="data:image/png;base64,@@@"), "base64"),
])
def test_hostile_images_are_refused_naming_the_limit(vl, case, raw, words):
    error = _refusal(ImageGeometry.of_directory(vl), raw)
    assert words in str(error), (case, str(error))
    assert error.field.startswith("data[0].model_input.images[0]"), (case, error.field)


def test_image_count_limit_and_text_base(vl):
    geo = ImageGeometry.of_directory(vl)
    error = _refusal(geo, RawImage(0, "png", _png(8, 8)), max_images=2, count=3)
    assert "3 images exceed the limit of 2" in str(error) and error.field == "data"
    with pytest.raises(InvalidInput) as exc:
        images.refuse_images([_raw([RawImage(0, "png", _png(8, 8))])], "quilt/tiny-qwen3", "Qwen3")
    assert "images are not accepted by base model 'quilt/tiny-qwen3'" in str(exc.value)


def test_wire_forms_carry_images_and_refuse_audio():
    pic = _png(8, 8)
    datum = DatumIn.model_validate({"model_input": {"chunks": [
        {"type": "encoded_text", "tokens": [1, 2]}, {"type": "image", "data": base64.b64encode(pic).decode(),
                                                     "format": "png", "expected_tokens": 1}]},
        "loss_fn_inputs": {}}).raw("data[0].model_input")
    assert datum.tokens == [1, 2] and datum.raw_images == (RawImage(2, "png", pic, expected_tokens=1),)
    bad = DatumIn.model_validate({"model_input": {"chunks": [{"type": "image", "data": "%%%", "format": "png"}]},
                                  "loss_fn_inputs": {}})
    with pytest.raises(InvalidInput) as exc:
        bad.raw("data[0].model_input")
    assert exc.value.field == "data[0].model_input.chunks[0].data"
    with pytest.raises(ValueError, match="audio \\(dmel\\) chunks are not supported"):
        DatumIn.model_validate({"model_input": {"chunks": [{"type": "dmel", "dmel": "AAAA"}]}, "loss_fn_inputs": {}})
    # protobuf, as the tinker SDK sends training data
    pb = tinker_proto._pb()
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = struct.pack("<2i", 1, 2)
    d.model_input.add().image.CopyFrom(pb.ImageChunk(data=pic, format="png", expected_tokens=1))
    parsed = tinker_proto.decode_forward_backward(msg.SerializeToString(), max_sparse_values=10).data[0]
    assert parsed.tokens == [1, 2] and parsed.raw_images == (RawImage(2, "png", pic, expected_tokens=1),)
    d.model_input.add().dmel.dmel = b"x"
    with pytest.raises(InvalidInput, match="audio \\(dmel\\)"):
        tinker_proto.decode_forward_backward(msg.SerializeToString(), max_sparse_values=10)


def test_sampling_prompts_take_images_on_a_vision_base_only(vl):
    from types import SimpleNamespace

    from api.schemas import ModelInputIn
    from core.settings import ApiSettings

    geo = ImageGeometry.of_directory(vl)
    pic = _png(64, 32)
    url = "data:image/png;base64," + base64.b64encode(pic).decode()
    n = geo.tokens(32, 64)

    def prompt(expected: int | None = None, count: int = 1) -> ModelInputIn:
        chunk = {"type": "image_asset_pointer", "location": url, "format": "png", "expected_tokens": expected}
        return ModelInputIn.model_validate({"chunks": [{"type": "encoded_text", "tokens": [1, geo.vision_start_id]},
                                                       *[chunk] * count, {"type": "encoded_text", "tokens": [2]}]})

    settings = ApiSettings(max_images_per_request=2)
    vision = SimpleNamespace(name="v", path=vl, config=json.loads((Path(vl) / "config.json").read_text()))
    tokens, made = images.sample_prompt(prompt(n), vision, settings, "t1")
    assert tokens == [1, geo.vision_start_id, *[geo.image_token_id] * n, 2]
    assert made == (ImageInput(2, n, "png", pic),)
    with pytest.raises(InvalidInput, match=f"expects {n + 1} tokens but this 64x32 image takes {n}") as exc:
        images.sample_prompt(prompt(n + 1), vision, settings, "t1")
    assert exc.value.field == "prompt.images[0].expected_tokens"
    with pytest.raises(InvalidInput, match="3 images exceed the limit of 2") as exc:
        images.sample_prompt(prompt(count=3), vision, settings, "t1")
    assert exc.value.field == "prompt"
    text = SimpleNamespace(name="t", path=vl, config={"model_type": "qwen3"})
    with pytest.raises(InvalidInput, match="images are not accepted by base model 't'") as exc:
        images.sample_prompt(prompt(), text, settings, "t1")
    assert exc.value.field == "prompt"
    assert images.sample_prompt(ModelInputIn.model_validate({"chunks": [{"type": "encoded_text", "tokens": [3]}]}),
                                text, settings, "t1") == ([3], ())


def test_the_parameter_count_and_the_plan_hold_the_vision_tower(each_vl):
    """The trainer loads the vision tower beside the decoder (and vLLM serves it): config.json alone
    counts what the weights hold, and the memory plan's base weights are all of them."""
    from bases import memory_plan

    config = json.loads((Path(each_vl) / "config.json").read_text())
    total = model_sources.weights_parameters(each_vl)
    assert architectures.parameter_counts(config)[0] == total
    assert architectures.vision_parameters(config) == sum(
        p.numel() for n, p in LoraBackend(each_vl).base.named_parameters() if ".visual." in f".{n}")
    plan = memory_plan.plan_memory(config, memory_plan.PlanInputs(device_bytes=8 * memory_plan.GiB, dtype="float32"))
    assert plan.base_bytes == plan.sampler_base_bytes == total * 4
