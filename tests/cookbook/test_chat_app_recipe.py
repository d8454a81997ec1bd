"""The cookbook's chat app (`chat_app/tinker_chat_cli.py`, its `main`) against the stack: a user
types, the tiny base answers through Quilt's sampler, the history grows and is cleared.

Replaced: the keyboard (the test types the lines through `input`), and the cookbook's table of hub
models (`model_info`), which does not know a self-hosted base: the app asks it for the base's
renderer, and the test answers the suite's renderer for the tiny base.
"""

from __future__ import annotations

import asyncio

import tinker
from recipes import RENDERER, TINY


def test_chat_app_chats_with_the_tiny_base(cookbook, monkeypatch, capsys):
    from tinker_cookbook.chat_app import tinker_chat_cli as chat

    typed = iter(["Say amber twice.", "And birch?", "n", "Say cedar twice.", "quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(typed))
    monkeypatch.setattr(chat, "get_recommended_renderer_name", lambda name: RENDERER if name == TINY else None)
    sampled: list[int] = []
    original = tinker.SamplingClient.sample

    def counted(self, prompt, *args, **kwargs):
        sampled.append(prompt.length)
        return original(self, prompt, *args, **kwargs)

    # Watched, not changed: each prompt's size, on its way to the SDK's own `sample`.
    monkeypatch.setattr(tinker.SamplingClient, "sample", counted)
    asyncio.run(chat.main(chat.Config(base_model=TINY, max_tokens=12, base_url=cookbook)))
    out = capsys.readouterr().out
    replies = [line for line in out.splitlines() if line.startswith("Assistant: ")]
    print(f"chat_app: {len(replies)} replies, prompt lengths {sampled}")
    assert len(replies) == 3 and "Error" not in out and "Goodbye" in out
    # The second turn carries the first (the history), and "n" clears it: the third prompt is as
    # short as a first turn.
    assert sampled[1] > sampled[0] + 8 and abs(sampled[2] - sampled[0]) <= 2
