"""A vision base's images: how many tokens an image becomes, and the checks its bytes pass first.

Qwen3-VL's image processor resizes an image so both sides are multiples of patch x merge pixels
and its area lies in [min_pixels, max_pixels] (aspect kept as near as it can), cuts it into
patch x patch squares and merges merge x merge of them into one token. So the token count follows
from the image's size alone: the API counts it without pixels (`ImageGeometry.tokens`), and the
trainer's processor makes the same grid from the same bytes (tests/test_vision.py checks both
against transformers' processor).

Bytes are checked before anything decodes them fully: their length, the format they claim, the
size their header declares (a decompression bomb declares a huge one in a few bytes), then the
decode itself (a truncated file fails here, not in the trainer).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import InvalidInput
from core.work import ImageInput

if TYPE_CHECKING:
    import torch

FORMATS = {"png": "PNG", "jpeg": "JPEG"}
MAX_ASPECT = 200  # the processor refuses a longer side over 200 times the shorter


@dataclass(frozen=True)
class ImageGeometry:
    """A vision base's image processor and image tokens, from its preprocessor_config.json and config.json."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_token_id: int
    vision_start_id: int
    vision_end_id: int

    @classmethod
    def of(cls, processor: Mapping, config: Mapping) -> ImageGeometry:
        size = processor.get("size") or {}
        return cls(int(processor["patch_size"]), int(processor["merge_size"]),
                   int(size.get("shortest_edge", processor.get("min_pixels", 0))),
                   int(size.get("longest_edge", processor.get("max_pixels", 0))),
                   int(config["image_token_id"]), int(config["vision_start_token_id"]), int(config["vision_end_token_id"]))

    @classmethod
    def of_directory(cls, directory: str | Path) -> ImageGeometry:
        directory = Path(directory)
        return cls.of(json.loads((directory / "preprocessor_config.json").read_text()),
                      json.loads((directory / "config.json").read_text()))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the processor resizes an image to (transformers' smart_resize)."""
        factor = self.patch_size * self.merge_size
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid (frames, rows, columns) of an image of this size."""
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def tokens(self, height: int, width: int) -> int:
        """The image tokens (<|image_pad|>) an image of this size becomes."""
        _, rows, cols = self.grid(height, width)
        return rows * cols // self.merge_size ** 2


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int  # width x height as the file declares it, before any resize


def check_image(field: str, data: bytes, fmt: str, limits: ImageLimits) -> tuple[int, int]:
    """Decode an image's bytes under the limits; returns its (height, width). InvalidInput names the
    field and the limit or the fault."""
    from PIL import Image

    if fmt not in FORMATS:
        raise InvalidInput(f"{field}.format: {fmt!r} is not one of {sorted(FORMATS)}", field=f"{field}.format")
    if len(data) > limits.max_bytes:
        raise InvalidInput(f"{field}: {len(data)} bytes exceed the limit of {limits.max_bytes} bytes an image "
                           "(QUILT_MAX_IMAGE_BYTES)", field=field)
    try:
        # formats=: a file is decoded only as what it claims to be; no other decoder sees the bytes.
        with Image.open(io.BytesIO(data), formats=[FORMATS[fmt]]) as img:
            width, height = img.size
            if width * height > limits.max_pixels:
                raise InvalidInput(f"{field}: {width}x{height} = {width * height} pixels exceed the limit of "
                                   f"{limits.max_pixels} pixels an image (QUILT_MAX_IMAGE_PIXELS)", field=field)
            img.load()
    except InvalidInput:
        raise
    except Image.DecompressionBombError:  # declares more pixels than PIL itself will ever decode
        raise InvalidInput(f"{field}: the image declares more pixels than the limit of {limits.max_pixels} pixels "
                           "an image (QUILT_MAX_IMAGE_PIXELS)", field=field) from None
    except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for bytes that are not a whole image
        raise InvalidInput(f"{field}: not a readable {fmt} image ({type(exc).__name__}: {_short(exc)})",
                           field=field) from None
    if width < 1 or height < 1 or max(width, height) > MAX_ASPECT * min(width, height):
        raise InvalidInput(f"{field}: {width}x{height} is outside the aspect ratio the processor takes "
                           f"(at most {MAX_ASPECT}:1)", field=field)
    return height, width


def _short(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 120 else text[:117] + "..."


def pretrained_class(vision: bool) -> Any:
    """The transformers class a base loads with: a vision base with its vision tower (the trainer
    keeps it frozen; the trainer-side sampler runs it), any other as a causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


class ImageProcessor:
    """A vision base's image processor (its preprocessor_config.json) and token geometry: what the
    trainer and the trainer-side sampler make an image's pixels with."""

    def __init__(self, base_path: str | Path):
        from transformers import Qwen2VLImageProcessorPil

        # The PIL processor: torchvision is not a dependency, and its pixels are the same.
        self.processor: Any = Qwen2VLImageProcessorPil.from_pretrained(str(base_path))
        self.geometry = ImageGeometry.of_directory(base_path)

    def pixels(self, image: ImageInput) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One image's patches and grid, as the base's processor makes them."""
        from PIL import Image

        with Image.open(io.BytesIO(image.data)) as img:
            out = self.processor(images=[img.convert("RGB")], return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return out["pixel_values"].float(), (grid[0], grid[1], grid[2])
