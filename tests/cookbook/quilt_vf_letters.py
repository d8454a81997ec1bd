"""A small verifiers environment for the verifiers bridge test (`vf.load_environment("quilt-vf-letters")`
imports this module): single-turn chat, scored by a rubric on the share of the reply's characters
that are the letter "e", a signal the random tiny model starts low on and can raise token by token."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

PROMPTS = ["Write a line.", "Say something.", "Reply briefly.", "Give me words.",
           "Answer now.", "Tell me a thing.", "Speak.", "Write anything."]


def share_of_e(completion, **kwargs) -> float:
    text = "".join(m.get("content") or "" for m in completion if m.get("role") == "assistant") \
        if isinstance(completion, list) else str(completion)
    return text.count("e") / len(text) if text else 0.0


def load_environment(copies: int = 8) -> vf.Environment:
    rows = [{"question": p, "answer": ""} for p in PROMPTS * copies]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[share_of_e], weights=[1.0]))
