"""The forecasting family against the stack, each through its own entry point: `recipes.decisions`
(its `forecasting` script's `main` and its `demo` script's `main`) and `recipes.forecasting.train`
(`Config` -> `cli_main`). The Prophet Arena CSV from the hub is replaced by a local one in the same
columns (`data_path`, the recipes' own option), written by `prophet_csv`."""

from __future__ import annotations

import asyncio
import csv
import io
import json
from contextlib import redirect_stdout
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from recipes import RENDERER, TINY, know_the_tiny_base, metrics, series

COLUMNS = ["submission_id", "event_ticker", "title", "snapshot_time", "close_time", "market_outcome", "category",
           "markets", "sources"]
SPLIT = datetime(2025, 10, 20, tzinfo=UTC)
PLACES = ["Oslo", "Lima", "Perth", "Accra", "Quito", "Hanoi", "Tunis", "Riga", "Cork", "Bern", "Split", "Nice"]


def prophet_csv(path: Path, train: int, validation: int) -> str:
    """One market per event; it resolves YES exactly when the market asks about rain (the learnable
    rule), train events close before the recipes' default split date and validation events open after."""
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=COLUMNS)
        writer.writeheader()
        for i in range(train + validation):
            start = SPLIT + (timedelta(days=-30 + i) if i < train else timedelta(days=2 + i))
            rain = i % 2 == 0
            market = f"It rains in {PLACES[i % len(PLACES)]}" if rain else f"The sun shines in {PLACES[i % len(PLACES)]}"
            writer.writerow({
                "submission_id": f"s{i}", "event_ticker": f"EV{i}", "title": f"Weather in {PLACES[i % len(PLACES)]}",
                "snapshot_time": start.isoformat(), "close_time": (start + timedelta(days=1)).isoformat(),
                "market_outcome": json.dumps({market: int(rain)}), "category": "weather",
                "markets": json.dumps([market]),
                "sources": json.dumps([{"title": "Forecast", "summary": f"Clouds over {PLACES[i % len(PLACES)]}."}]),
            })
    return str(path)


@pytest.mark.extended
def test_decisions_forecasting_learns_the_local_markets(cookbook, tmp_path):
    """`recipes.decisions.forecasting.main`: Brier-loss training on the yes/no choice distribution
    (`forward_backward_custom` over (N, K) targets) and scoring through `target_prompt_logprobs`.
    One batch holds all eight train markets, so every step's loss (taken before its update) is on
    the same data and the curve is comparable step to step. The learning rate is 1e-3: at 5e-3 the
    first Adam step drives the random model's P(yes), one value for every market, to 0 or 1 (Brier
    loss 0.918 -> 1.000, accuracy 0.5), where the loss is flat: 0.984, 0.978 after 4 steps."""
    from tinker_cookbook.recipes.decisions import forecasting as decide

    cfg = decide.Config(model_name=TINY, renderer_name=RENDERER, lora_rank=8,
                        data_path=prophet_csv(tmp_path / "markets.csv", train=8, validation=2),
                        max_train_questions=8, max_validation_questions=2, batch_size=8, learning_rate=1e-3,
                        epochs=4, max_steps=4, eval_every=0, log_path=str(tmp_path / "run"), base_url=cookbook)
    asyncio.run(decide.main(cfg))
    rows = metrics(tmp_path / "run")
    loss = series(rows, "train/loss")
    brier = series(rows, "test/brier_reward")
    print(f"decisions.forecasting: Brier loss {[round(v, 3) for v in loss]}, test Brier reward {brier}, "
          f"train accuracy {series(rows, 'train/accuracy')}, target prob {series(rows, 'train/target_prob:mean')}")
    assert len(loss) == 4 and len(brier) == 2
    assert loss[-1] < loss[0]
    assert brier[-1] > brier[0]  # the rain rule carries to the validation markets


@pytest.mark.extended
def test_decisions_demo_routes_questions(cookbook, monkeypatch):
    """`recipes.decisions.demo.main` with the tiny base as the decision model (RENDERER named for it in
    the cookbook's model registry) and its questions typed on stdin by the test."""
    from tinker_cookbook.recipes.decisions import demo

    know_the_tiny_base(monkeypatch)
    questions = iter(["How do I pick a learning rate for LoRA?", "Why was my card charged twice?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(questions))
    printed = io.StringIO()
    with redirect_stdout(printed):
        asyncio.run(demo.main(demo.Config(model_name=TINY)))
    answers = json.loads("[" + printed.getvalue().replace("}\n{", "},\n{") + "]")
    print(f"decisions demo: {answers}")
    assert len(answers) == 2
    for answer in answers:
        assert list(answer) == [team for team, _ in demo.TEAMS]
        assert sum(answer.values()) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.extended
def test_forecasting_rl_runs_the_protocol(cookbook, tmp_path):
    """`recipes.forecasting.train.cli_main`: RL with the Brier reward on parsed probabilities and
    the recipe's ForecastEvaluator on the validation split. The random tiny model writes no
    probability, so this runs the protocol (steps done, evaluation logged, kl_sample_train small)."""
    from tinker_cookbook.recipes.forecasting import train as forecast

    cfg = forecast.Config(model_name=TINY, renderer_name=RENDERER, lora_rank=8,
                          data_path=prophet_csv(tmp_path / "markets.csv", train=8, validation=2),
                          max_train_questions=8, max_validation_questions=2, train_epochs=1, group_size=2,
                          groups_per_batch=2, validation_group_size=1, max_tokens=16, max_steps=2, eval_every=2,
                          save_every=0, log_path=str(tmp_path / "run"), base_url=cookbook)
    asyncio.run(forecast.cli_main(cfg))
    rows = metrics(tmp_path / "run")
    kl = max(abs(v) for v in series(rows, "optim/kl_sample_train_v1"))
    evaluated = [row for row in rows if "test/env/all/brier_reward" in row]
    print(f"forecasting RL: {len(series(rows, 'optim/kl_sample_train_v1'))} steps, "
          f"{len(evaluated)} evaluations, kl_sample_train_v1 {kl:.1e}")
    assert len(series(rows, "optim/kl_sample_train_v1")) == 2
    assert evaluated
    assert kl < 1e-3
