"""Activation checkpointing per decoder layer: a long micro-batch keeps each layer's input only, and
the backward runs the layer's forward again to get the rest.

A frozen-base LoRA backward otherwise keeps every layer's intermediates (norms, projections, the
MLP's widths, attention's outputs) for the whole micro-batch: about 21 MiB a token on Qwen3-32B, so
a 131,072-token row needs terabytes. Checkpointed, a layer keeps its input hidden states (and what
the model passes it alongside), and one layer's intermediates are live at a time in the backward.
The price is one more forward of the decoder per micro-batch that checkpoints (`Planner.checkpoint_tokens`
decides which: `QUILT_TRAINER_CHECKPOINT_TOKENS`).

torch's non-reentrant checkpoint: the backward replays the layer's forward and hands its saved
tensors to the original graph's nodes, so the gradients are the ones the uncheckpointed pass gets
wherever the forward is deterministic (the CPU; float64 tests hold it to that). The replay happens
in the backward, after the pass has moved on (the head's chunks set their own routes; a packed
pass's attention setting is gone), so each layer runs inside `enter()`, which puts the micro-batch's
state back: its decoder routes and its packed rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

Enter = Callable[[], contextlib.AbstractContextManager[Any]]


def _replayable(forward: Callable[..., Any], enter: Enter) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with enter():
            return forward(*args, **kwargs)

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        # (nothing random in a layer of a training pass: no RNG state to keep, which would read the device's)
        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return checkpointed


@contextlib.contextmanager
def checkpointed(layers: Iterable[nn.Module], enter: Enter) -> Iterator[None]:
    """Within the block, each of `layers` runs checkpointed (its forward replaced on the instance,
    put back after): its forward, and its replay in the backward, inside `enter()`."""
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for layer in layers:
            patched.append((layer, layer.__dict__.get("forward")))
            layer.__dict__["forward"] = _replayable(layer.forward, enter)  # the instance's, before the class's
        yield
    finally:
        for layer, own in patched:
            if own is None:
                del layer.__dict__["forward"]
            else:
                layer.__dict__["forward"] = own
