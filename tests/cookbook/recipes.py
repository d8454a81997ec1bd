"""What the recipe tests share: local environments and datasets in the cookbook's own types (the
pieces that replace hub data), and reading a run's metrics.jsonl."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import chz
import datasets
import tinker
from stackutil import TINY
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

RENDERER = "qwen3_disable_thinking"
WORDS = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor"]
# The supervised data, and the distillation teacher's lesson: repeat the word.
CHAT = [[{"role": "user", "content": f"Say {w} twice."}, {"role": "assistant", "content": f"{w} {w}"}]
        for w in WORDS]
# One band of 96 token ids: the reward is the fraction of sampled tokens inside it. The random tiny
# model scores about 0.1 and nothing but the reward teaches it (examples/rl_tiny.py's task).
BAND = (256, 352)
INSTRUCTION = [11, 87, 140, 201, 33]
# The real loader, captured before any test replaces it (local_hub).
_HUB_LOAD = datasets.load_dataset


def common(batch_size: int, max_length: int = 256, train_on_what=None) -> ChatDatasetBuilderCommonConfig:
    return ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=TINY, renderer_name=RENDERER,
                                          max_length=max_length, batch_size=batch_size, train_on_what=train_on_what)


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def chat_builder(path: Path, copies: int = 4, batch_size: int = 8) -> FromConversationFileBuilder:
    """The cookbook's JSONL conversation dataset over CHAT (`copies` times)."""
    return FromConversationFileBuilder(file_path=write_jsonl(path, [{"messages": m} for m in CHAT * copies]),
                                       common_config=common(batch_size))


def metrics(log_path: Path | str) -> list[dict]:
    """The run's logged rows, in order."""
    return [json.loads(line) for line in (Path(log_path) / "metrics.jsonl").read_text().splitlines() if line]


def series(rows: list[dict], key: str) -> list[float]:
    return [row[key] for row in rows if key in row]


def first_last(values: list[float], k: int = 3) -> tuple[float, float]:
    """Means of the first and the last `k` values."""
    assert len(values) >= k, values
    return sum(values[:k]) / k, sum(values[-k:]) / k


class BandEnv(Env):
    def __init__(self, answer_tokens: int) -> None:
        self.answer_tokens = answer_tokens

    async def initial_observation(self):
        return tinker.ModelInput.from_ints(INSTRUCTION), []

    async def step(self, action, *, extra=None) -> StepResult:
        inside = sum(BAND[0] <= t < BAND[1] for t in action)
        return StepResult(reward=inside / self.answer_tokens, episode_done=True,
                          next_observation=tinker.ModelInput.empty(), next_stop_condition=[])


@dataclass(frozen=True)
class BandGroup(EnvGroupBuilder):
    group_size: int
    answer_tokens: int

    async def make_envs(self) -> Sequence[Env]:
        return [BandEnv(self.answer_tokens) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["band"]


class BandDataset(RLDataset):
    def __init__(self, batches: int, groups: int, group_size: int, answer_tokens: int) -> None:
        self.batches, self.groups = batches, groups
        self.group = BandGroup(group_size, answer_tokens)

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [self.group] * self.groups

    def __len__(self) -> int:
        return self.batches


@chz.chz
class BandDatasetBuilder(RLDatasetBuilder):
    batches: int
    groups: int = 4
    group_size: int = 4
    answer_tokens: int = 8

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return BandDataset(self.batches, self.groups, self.group_size, self.answer_tokens), None


def know_the_tiny_base(monkeypatch, renderer: str = RENDERER) -> None:
    """Tell the cookbook's model table (`model_info`) which renderer the tiny base takes, for the
    scripts that ask the table instead of taking a `renderer_name` (the tokenizer is named the same
    way, by the cookbook fixture's `register_tokenizer`)."""
    from tinker_cookbook import model_info

    known = model_info.get_model_attributes

    def attributes(model_name: str) -> model_info.ModelAttributes:
        if model_name.split(":", 1)[0] == TINY:
            return model_info.ModelAttributes(organization="quilt", version_str="3", size_str="tiny", is_chat=True,
                                              recommended_renderers=(renderer,))
        return known(model_name)

    monkeypatch.setattr(model_info, "get_model_attributes", attributes)


def local_hub(monkeypatch, root: Path, hub: dict[str, dict[str, list[dict]]], *modules) -> None:
    """Serve hub datasets from JSONL files written here: `hub` maps a hub id to its splits' rows, and
    `datasets.load_dataset(id, ...)` (and the same name in `modules`, which import it by name) loads
    those files with the `json` builder instead. Later calls add to earlier ones; a hub id no call
    gave fails loudly instead of reaching for the network."""
    import datasets

    earlier = datasets.load_dataset
    files = {repo: {split: write_jsonl(root / f"{repo.replace('/', '--')}.{split}.jsonl", rows)
                    for split, rows in splits.items()} for repo, splits in hub.items()}

    def from_files(path, name=None, split=None, **kwargs):
        if path in files:
            return _HUB_LOAD("json", data_files=files[path], split=split, cache_dir=str(root / "datasets-cache"))
        assert earlier is not _HUB_LOAD, f"the test gave no local rows for the hub dataset {path!r}"
        return earlier(path, name=name, split=split, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", from_files)
    for module in modules:
        monkeypatch.setattr(module, "load_dataset", from_files)
