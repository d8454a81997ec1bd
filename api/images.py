"""Image chunks of a request, checked and turned into image tokens (a vision base; bases.vision).

Each image is decoded once here under the limits (bytes, declared pixels, images per request), its
token count computed from its size by the base's processor geometry, compared with the client's
`expected_tokens` (a mismatch is a 400 naming both), and replaced among the datum's tokens by that
many image tokens, so the loss inputs, metering and pricing count them as prompt tokens. The
trainer makes the pixels from the same bytes.

An `ImageAssetPointerChunk` is read from a `data:` URL or from the caller's own asset prefix in the
object store (checkpoints.assets: the location policy and the bounded read); any other location
(another host, another bucket, another tenant's objects, a name that climbs out) is a 400 naming it.
`prepare` is the one entry for every route that takes images (forward, forward_backward, sample).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import re
from pathlib import Path

from api.datums import RawDatum, RawImage
from api.schemas import ModelInputIn
from bases import architectures
from bases.vision import ImageGeometry, ImageLimits, check_image
from checkpoints import assets
from core.errors import InvalidInput
from core.settings import ApiSettings, get_core_settings
from core.work import ImageInput

_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg);base64,(.*)", re.DOTALL)


def limits_of(settings: ApiSettings) -> ImageLimits:
    return ImageLimits(settings.max_image_bytes, settings.max_image_pixels)


@functools.lru_cache(maxsize=32)
def geometry(base_path: str) -> ImageGeometry:
    """A vision base's image geometry, read once per process from its directory."""
    return ImageGeometry.of_directory(Path(base_path))


def refuse_images(data: list[RawDatum], base_name: str, family: str) -> None:
    """A text-only base: any image is a 400 naming images and the base."""
    for i, datum in enumerate(data):
        if datum.raw_images:
            raise InvalidInput(f"data[{i}].model_input: images are not accepted by base model {base_name!r} "
                               f"({family} takes text only); use a vision base such as Qwen3-VL",
                               field=f"data[{i}].model_input")


@dataclasses.dataclass
class AssetReader:
    """Reads the caller's own assets (checkpoints.assets) for image pointers that are not data: URLs."""

    tenant_id: str
    place: assets.AssetPlace
    client: object = None  # the S3 client, made on the first read

    def read(self, field: str, location: str, max_bytes: int) -> bytes:
        name = assets.asset_name(field, location, self.tenant_id, self.place)
        if self.place.kind == "s3" and self.client is None:
            self.client = assets.s3_client(get_core_settings())
        return assets.read_asset(field, self.place, self.tenant_id, name, max_bytes, client=self.client)


def expand(data: list[RawDatum], geo: ImageGeometry, limits: ImageLimits, max_images: int,
           reader: AssetReader | None = None) -> list[RawDatum]:
    """Each datum with its images checked and in place as image tokens (datums without images
    unchanged); `reader` reads pointers to the caller's assets (None: data: URLs only)."""
    count = sum(len(d.raw_images) for d in data)
    if count > max_images:
        raise InvalidInput(f"data: {count} images exceed the limit of {max_images} images a request "
                           "(QUILT_MAX_IMAGES_PER_REQUEST)", field="data")
    return [_expand(f"data[{i}].model_input", d, geo, limits, reader) if d.raw_images else d
            for i, d in enumerate(data)]


def _expand(where: str, datum: RawDatum, geo: ImageGeometry, limits: ImageLimits, reader: AssetReader | None) -> RawDatum:
    tokens: list[int | float] = []
    images: list[ImageInput] = []
    at = 0
    for k, raw in enumerate(datum.raw_images):
        field = f"{where}.images[{k}]"
        fmt, data = _bytes(field, raw, limits, reader)
        height, width = check_image(field, data, fmt, limits)
        n = geo.tokens(height, width)
        if raw.expected_tokens is not None and raw.expected_tokens != n:
            raise InvalidInput(f"{field}.expected_tokens: the client expects {raw.expected_tokens} tokens but this "
                               f"{width}x{height} image takes {n} on this base", field=f"{field}.expected_tokens")
        tokens += datum.tokens[at:raw.at]
        at = raw.at
        images.append(ImageInput(len(tokens), n, fmt, data))
        tokens += [geo.image_token_id] * n
    tokens += datum.tokens[at:]
    return dataclasses.replace(datum, tokens=tokens, raw_images=(), images=tuple(images))


def _bytes(field: str, raw: RawImage, limits: ImageLimits, reader: AssetReader | None) -> tuple[str, bytes]:
    """An image's format and bytes: sent inline, a pointer's `data:` URL, or an object under the
    caller's own asset prefix (read by `reader`, bounded by the image byte limit)."""
    if raw.data is not None:
        return raw.format, raw.data
    location = raw.location or ""
    match = _DATA_URL.fullmatch(location)
    if match is None and not location.lower().startswith("data:") and reader is not None:
        return raw.format, reader.read(f"{field}.location", location, limits.max_bytes)
    if match is None:
        shown = location[:60] + ("..." if len(location) > 60 else "")
        raise InvalidInput(f"{field}.location: {shown!r} is not read: image pointers name data: URLs "
                           "(data:image/png;base64,...) or objects under your own asset prefix; this server fetches "
                           "nothing from another host or another account's storage", field=f"{field}.location")
    fmt = "jpeg" if match.group(1) in ("jpeg", "jpg") else "png"
    if fmt != raw.format:
        raise InvalidInput(f"{field}.format: the chunk says {raw.format!r} but its data: URL holds {fmt}",
                           field=f"{field}.format")
    try:
        return fmt, base64.b64decode(match.group(2), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{field}.location: the data: URL's base64 is not valid", field=f"{field}.location") from None


def prepare(data: list[RawDatum], base, settings: ApiSettings, tenant_id: str) -> list[RawDatum]:
    """A request's datums on `base` (a catalogue entry) from tenant `tenant_id`: images in place as
    image tokens on a vision base (pointers read from a data: URL or that tenant's own asset prefix),
    refused on any other. Blocking (it may read the object store): call it off the event loop."""
    if not any(d.raw_images for d in data):
        return data
    arch = architectures.of_config(base.config)
    if not arch.vision:
        refuse_images(data, base.name, arch.family)
    reader = AssetReader(tenant_id, assets.AssetPlace.of(get_core_settings()))
    return expand(data, geometry(base.path), limits_of(settings), settings.max_images_per_request, reader)


def sample_prompt(prompt: ModelInputIn, base, settings: ApiSettings,
                  tenant_id: str) -> tuple[list[int | float], tuple[ImageInput, ...]]:
    """A sampling prompt on `base` from tenant `tenant_id`: its tokens with any images in place as
    image tokens (a vision base, sampled by the trainer-side sampler, gen_pool.hf_engine), and those
    images. Blocking, as `prepare` (pointers may be read from the object store)."""
    tokens, raw = prompt.parts("prompt")
    if not raw:
        return tokens, ()
    arch = architectures.of_config(base.config)
    if not arch.vision:
        raise InvalidInput(f"prompt: images are not accepted by base model {base.name!r} ({arch.family} takes text "
                           "only); use a vision base such as Qwen3-VL", field="prompt")
    if len(raw) > settings.max_images_per_request:
        raise InvalidInput(f"prompt: {len(raw)} images exceed the limit of {settings.max_images_per_request} images a "
                           "request (QUILT_MAX_IMAGES_PER_REQUEST)", field="prompt")
    reader = AssetReader(tenant_id, assets.AssetPlace.of(get_core_settings()))
    expanded = _expand("prompt", RawDatum(tokens, {}, None, raw), geometry(base.path), limits_of(settings), reader)
    return list(expanded.tokens), expanded.images
