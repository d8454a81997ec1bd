"""A multi-turn tool-use environment of the cookbook's `tool_use` library (`@tool`,
`build_agent_tool_env`) trained with `rl.train`, unchanged. A random model never writes a tool call,
so `supervised.train` first teaches it the call's form; the RL step then parses the calls it
samples, runs the tool and feeds its result back as the next turn. (Further RL steps do not keep
the habit on this tiny model: its reply after the tool's answer is noise, so only the protocol is
asserted, not learning.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import chz
import pytest
from recipes import RENDERER, TINY, common, metrics, series, write_jsonl
from tinker_cookbook import checkpoint_utils, renderers
from tinker_cookbook.renderers import get_text_content
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.supervised import train as sft
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer
from tinker_cookbook.tool_use import build_agent_tool_env, simple_tool_result, tool
from tinker_cookbook.tool_use.types import ToolResult

ANSWER = "blue"
QUESTIONS = ["What is the secret colour?", "Tell me the secret colour.", "Which colour is secret?",
             "Find the secret colour.", "I need the secret colour.", "Look up the secret colour."]
CALL = '<tool_call>\n{"name": "secret", "arguments": {}}\n</tool_call>'


@tool
async def secret() -> ToolResult:
    """The secret colour."""
    return simple_tool_result(ANSWER)


def _prefix(renderer) -> list:
    return renderer.create_conversation_prefix_with_tools([secret.to_spec()])


async def _reward(history) -> tuple[float, dict[str, float]]:
    """Half for calling the tool, half for then replying with its answer."""
    called = any(m["role"] == "tool" for m in history)
    final = history[-1]
    said = called and final["role"] == "assistant" and ANSWER in get_text_content(final)
    return 0.5 * called + 0.5 * said, {"called_tool": float(called)}


@dataclass(frozen=True)
class SecretGroup(EnvGroupBuilder):
    question: str
    group_size: int

    async def make_envs(self) -> Sequence[Env]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(TINY))
        messages = [*_prefix(renderer), {"role": "user", "content": self.question}]
        return [build_agent_tool_env(renderer, [secret], messages, _reward, max_turns=2, failed_parse_reward=0.0)
                for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["secret"]


class SecretDataset(RLDataset):
    def __init__(self, batches: int, groups: int, group_size: int) -> None:
        self.batches, self.groups, self.group_size = batches, groups, group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [SecretGroup(QUESTIONS[(index * self.groups + i) % len(QUESTIONS)], self.group_size)
                for i in range(self.groups)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class SecretDatasetBuilder(RLDatasetBuilder):
    batches: int

    async def __call__(self):
        return SecretDataset(self.batches, groups=4, group_size=4), None


@pytest.mark.extended
def test_tool_use_environment_runs_the_tools_the_policy_calls(cookbook, tmp_path):
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(TINY))
    # The lesson ends at the call: what follows the tool's answer is left to the RL run.
    lessons = [{"messages": [*_prefix(renderer), {"role": "user", "content": q},
                             {"role": "assistant", "content": CALL}]} for q in QUESTIONS]
    warmup = sft.Config(log_path=str(tmp_path / "sft"), model_name=TINY, recipe_name="quilt_tool_sft",
                        renderer_name=RENDERER,
                        dataset_builder=FromConversationFileBuilder(
                            file_path=write_jsonl(tmp_path / "tools.jsonl", lessons * 4),
                            common_config=common(6, max_length=1024)),
                        learning_rate=1e-2, num_epochs=12, lora_rank=16, save_every=0, eval_every=0,
                        base_url=cookbook)
    asyncio.run(sft.main(warmup))
    start = checkpoint_utils.get_last_checkpoint(str(tmp_path / "sft")).state_path

    config = train.Config(model_name=TINY, recipe_name="quilt_tool_use", renderer_name=RENDERER,
                          log_path=str(tmp_path / "rl"), dataset_builder=SecretDatasetBuilder(batches=1),
                          learning_rate=1e-3, max_tokens=64, lora_rank=16, load_checkpoint_path=start,
                          eval_every=0, save_every=0, base_url=cookbook)
    asyncio.run(train.main(config))
    rows = metrics(tmp_path / "rl")
    turns = series(rows, "env/all/turns_per_episode")
    v1 = max(abs(v) for v in series(rows, "optim/kl_sample_train_v1"))
    print(f"tool_use: {turns[0]:.2f} turns per episode, kl_sample_train_v1 {v1:.1e}")
    # Sampled calls were parsed, the tool ran, and its answer came back as a second turn that the
    # policy sampled and the trainer trained on (in some of the 16 episodes: the warmed-up model
    # still garbles some calls at temperature 1).
    assert turns[0] > 1.0 and v1 < 1e-3
