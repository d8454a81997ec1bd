"""Conversations to token ids and back, for the text environments' adapters."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..env import Outcome

__all__ = ["ChatCodec", "ended", "numeric"]


class ChatCodec:
    """Encodes a conversation as the prompt the model reads, and decodes what it sampled.

    With a tokenizer that has a chat template (``tokenizer.chat_template``), the template lays the
    conversation out (``add_generation_prompt=True``); without one, a plain layout: each message as
    ``"<role>: <content>\\n"`` and ``"assistant: "`` to answer. ``tokenizer`` is a Hugging Face
    tokenizer (anything with ``encode``/``decode``, and ``apply_chat_template`` for templates).
    """

    def __init__(self, tokenizer: Any, *, use_template: bool | None = None) -> None:
        self.tokenizer = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.use_template = has_template if use_template is None else use_template
        if self.use_template and not has_template:
            raise ValueError("use_template=True but the tokenizer has no chat_template")

    def prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The token ids of ``messages`` laid out for the model to answer next."""
        messages = [{"role": str(m.get("role", "user")), "content": _content(m.get("content"))} for m in messages]
        if self.use_template:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, Mapping):  # a BatchEncoding
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def text(self, tokens: Sequence[int]) -> str:
        """What the model said: its tokens decoded, special tokens (the stop token) left out."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # OpenAI content parts: keep the text ones
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def numeric(values: Mapping[str, Any] | None) -> dict[str, float]:
    """The finite numbers of a metrics mapping (frameworks mix in strings and lists)."""
    out = {}
    for key, value in (values or {}).items():
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[str(key)] = float(value)
    return out


def ended(total_reward: float) -> Outcome:
    """The outcome of an episode a foreign environment ended: ``success`` when it earned anything."""
    return "success" if total_reward > 0 else "model_failure"
