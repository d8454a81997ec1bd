"""`recipes.chat_sl` through its own entry point (`CLIConfig` -> `cli_main`), on its chat datasets
(`chat_datasets.NoRobotsBuilder`, `Tulu3Builder`) read from local files."""

from __future__ import annotations

import pytest
from recipes import CHAT, RENDERER, TINY, first_last, local_hub, metrics, series
from tinker_cookbook.recipes.chat_sl import train as chat_sl


def _rows(copies: int) -> list[dict]:
    return [{"messages": m, "category": "repeat"} for m in CHAT * copies]


@pytest.mark.extended
def test_chat_sl_no_robots_lowers_the_nll(cookbook, tmp_path, monkeypatch):
    """Replaced: the hub's HuggingFaceH4/no_robots by JSONL files of the same columns written here
    (`datasets.load_dataset` reads them)."""
    local_hub(monkeypatch, tmp_path, {"HuggingFaceH4/no_robots": {"train": _rows(2), "test": _rows(1)}})
    chat_sl.cli_main(chat_sl.CLIConfig(
        log_path=str(tmp_path / "run"), model_name=TINY, renderer_name=RENDERER, dataset="no_robots",
        learning_rate=5e-3, num_epochs=3, lora_rank=16, batch_size=8, max_length=256, save_every=0, eval_every=3,
        base_url=cookbook))
    rows = metrics(tmp_path / "run")
    first, last = first_last(series(rows, "train_mean_nll"), k=2)
    key = next(k for row in rows for k in row if k.startswith("test/") and k.endswith("/nll"))
    tests = series(rows, key)
    print(f"chat_sl no_robots: train nll {first:.3f} -> {last:.3f}, test nll {tests}")
    assert len(series(rows, "train_mean_nll")) == 6
    assert last < 0.7 * first
    assert tests and tests[-1] < tests[0]


@pytest.mark.extended
def test_chat_sl_tulu3_holds_out_its_test_split(cookbook, tmp_path, monkeypatch):
    """Replaced: the hub's allenai/tulu-3-sft-mixture by a JSONL file written here. The builder holds
    its first 1,024 shuffled rows out as the test set, so the file has 1,024 + 16 rows; two steps
    train on the 16 (protocol: the split, the builder's last-message training, two steps done)."""
    local_hub(monkeypatch, tmp_path, {"allenai/tulu-3-sft-mixture": {"train": _rows(130)}})
    chat_sl.cli_main(chat_sl.CLIConfig(
        log_path=str(tmp_path / "run"), model_name=TINY, renderer_name=RENDERER, dataset="tulu3",
        learning_rate=5e-3, lora_rank=8, batch_size=8, max_length=256, save_every=0, eval_every=0,
        base_url=cookbook))
    nll = series(metrics(tmp_path / "run"), "train_mean_nll")
    print(f"chat_sl tulu3: train nll {nll}")
    assert len(nll) == 2
