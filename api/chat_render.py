"""Chat messages as the prompt text a base model was trained on, for tokenizers without a chat
template of their own (the catalogue's `renderer`: bases.model_sources.RENDERERS). Pure.

A tokenizer that has a template uses it (transformers' apply_chat_template); these are the
formats of the model families named, for bases that ship without one (the tiny test model
speaks ChatML).
"""

from __future__ import annotations

from core.errors import InvalidInput

ROLES = ("system", "user", "assistant")


def render(messages: list[tuple[str, str]], renderer: str) -> str:
    """(role, text) pairs -> the prompt, ending where the assistant's reply begins."""
    if renderer == "chatml":
        turns = [f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in messages]
        return "".join(turns) + "<|im_start|>assistant\n"
    if renderer == "llama3":
        turns = [f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>" for role, text in messages]
        return "<|begin_of_text|>" + "".join(turns) + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    if renderer == "gemma":
        # Gemma has no system turn: a system message is put before the first user message.
        system = "\n\n".join(text for role, text in messages if role == "system")
        turns, pending = [], system
        for role, text in messages:
            if role == "system":
                continue
            if pending and role == "user":
                text, pending = f"{pending}\n\n{text}", ""
            turns.append(f"<start_of_turn>{'model' if role == 'assistant' else 'user'}\n{text}<end_of_turn>\n")
        return "<bos>" + "".join(turns) + "<start_of_turn>model\n"
    raise InvalidInput("this base model has no chat template (its tokenizer has none and its catalogue renderer "
                       f"is {renderer or 'unset'!r}); use /v1/completions with your own prompt text", field="model")
