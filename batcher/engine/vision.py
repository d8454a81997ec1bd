"""Images in a fused pass (a vision base, Qwen3-VL): pixels on the host, features on the device.

A row's image tokens (the base's <|image_pad|>, `core.work.ImageInput`) lie where the API put them.
On the host, each image's bytes become pixel patches through the base's own image processor, in
the order their tokens lie in the micro-batch's token grid (stream by stream, left to right), which
is the order `masked_scatter` fills them; each row gets its multimodal rotary positions, counted
from 0 like its text positions (`mrope_positions`, Qwen3-VL's rule). On the device the frozen
vision tower turns the patches into one embedding per image token, which replaces that token's
embedding, and its deepstack features join the first decoder layers' hidden states. Rows without
images get text positions on all three axes, so text rows of other tenants pack beside image rows
and compute exactly what they compute alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from bases.vision import ImageProcessor as ImageProcessor  # where the plan and backend name it
from core.work import ImageInput


@dataclass
class VisionTensors:
    """A micro-batch's images: patches [patches, C*T*P*P], each image's grid [images, 3], which grid
    positions are image tokens [tokens], and the rotary positions of each axis [3, tokens]."""

    pixels: torch.Tensor
    grid: torch.Tensor
    mask: torch.Tensor
    mrope: torch.Tensor


pytree.register_dataclass(VisionTensors)


def mrope_positions(n: int, images: Sequence[tuple[int, tuple[int, int, int]]], merge: int) -> torch.Tensor:
    """A row's rotary positions on the (time, height, width) axes [3, n]: text advances all three
    by one a token; an image of `grid` (frames, rows, columns of patches) at `offset` spans its merged
    rows and columns from the position it starts at, and the text after it goes on from there plus
    the longer of its sides."""
    out = torch.empty(3, n, dtype=torch.long)
    at, pos = 0, 0
    for offset, (_, rows, cols) in images:
        out[:, at:offset] = torch.arange(offset - at) + pos
        pos += offset - at
        h, w = rows // merge, cols // merge
        out[0, offset:offset + h * w] = pos
        out[1, offset:offset + h * w] = (torch.arange(h) + pos).repeat_interleave(w)
        out[2, offset:offset + h * w] = (torch.arange(w) + pos).repeat(h)
        at, pos = offset + h * w, pos + max(h, w)
    out[:, at:] = torch.arange(n - at) + pos
    return out


def host_inputs(processor: ImageProcessor, rows: Sequence[tuple[int, int, Sequence[ImageInput]]], tokens: int
                ) -> VisionTensors:
    """A micro-batch's images: `rows` are (where the row starts in the flat grid, its tokens, its
    images); every row's positions, image rows' from their images."""
    merge = processor.geometry.merge_size
    mask = torch.zeros(tokens, dtype=torch.bool)
    mrope = torch.zeros(3, tokens, dtype=torch.long)
    placed: list[tuple[int, torch.Tensor, tuple[int, int, int]]] = []
    for start, n, images in rows:
        made = [(image.offset, *processor.pixels(image)) for image in images]
        mrope[:, start:start + n] = mrope_positions(n, [(offset, grid) for offset, _, grid in made], merge)
        for (offset, pixels, grid), image in zip(made, images):
            mask[start + offset:start + offset + image.tokens] = True
            placed.append((start + offset, pixels, grid))
    placed.sort(key=lambda p: p[0])  # grid order: the order masked_scatter fills the image tokens
    return VisionTensors(torch.cat([p for _, p, _ in placed]), torch.tensor([g for _, _, g in placed]), mask, mrope)


def decoder_inputs(base: Any, ids: torch.Tensor, positions: torch.Tensor, v: VisionTensors) -> dict[str, Any]:
    """The decoder's keyword inputs for a micro-batch with images: its embeddings with the image
    tokens' replaced by the frozen vision tower's features, its deepstack features and mask, and
    positions [4, streams, width] (each row's own, then the three rotary axes)."""
    shape = ids.shape
    mask = v.mask.view(shape)
    with torch.no_grad():  # the vision tower is frozen: LoRA is on the language model only
        features = base.model.get_image_features(v.pixels, v.grid, return_dict=True)
    embeds = base.get_input_embeddings()(ids)
    image = torch.cat(features.pooler_output).to(embeds.dtype)
    embeds = embeds.masked_scatter(mask.unsqueeze(-1), image)
    deepstack = [torch.cat(f).to(embeds.dtype) for f in features.deepstack_features]
    four = torch.cat([positions.unsqueeze(0), v.mrope.view(3, *shape)])
    return {"inputs_embeds": embeds, "position_ids": four, "visual_pos_masks": mask, "deepstack_visual_embeds": deepstack}
