"""`quilt models add | list | plan | remove` as an operator runs them, in a fresh data directory,
and the trainer refusing at start a base its device cannot hold."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from stack.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.stack

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env():
    data_dir = Path(tempfile.mkdtemp(prefix="qm-", dir="/tmp"))  # short: Postgres' socket lives here
    e = {**os.environ, "QUILT_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1"}
    e.pop("QUILT_DATABASE_URL", None)
    e.pop("QUILT_REDIS_URL", None)
    yield e  # each command starts the embedded servers and stops them when it exits
    shutil.rmtree(data_dir, ignore_errors=True)


def quilt(env, *args, expect: int = 0) -> str:
    done = subprocess.run([sys.executable, "-m", "stack.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == expect, f"quilt {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _plan_json(out: str) -> dict:
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith('{"model"')))


def test_add_list_plan_remove(env, tmp_path):
    llama = build_tiny_model(tmp_path / "llama", spec=TinyModelSpec(architecture="llama")).path
    out = quilt(env, "models", "list")  # a new installation serves the tiny Qwen3
    assert "quilt/tiny-qwen3" in out and "qwen3" in out

    out = quilt(env, "models", "add", "acme/llama-mini", "--path", llama, "--renderer", "llama3",
                "--max-context", "1024", "--max-lora-rank", "16", "--no-sample")
    assert "added acme/llama-mini: llama" in out and "3.67M parameters" in out and "price per million" in out
    out = quilt(env, "models", "list")
    row = next(line for line in out.splitlines() if line.startswith("acme/llama-mini"))
    assert row.split()[1:8] == ["llama", "3.67M", "3.67M", "auto", "1024", "yes", "no"], row

    # Refusals name the problem and leave the catalogue as it was.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in quilt(env, "models", "add", "x", "--path", str(empty), expect=2)
    assert "chat template" in quilt(env, "models", "add", "x", "--path", llama, expect=2)
    assert "not allowed with argument" in quilt(env, "models", "add", "x", "--path", llama, "--hub", "a/b", expect=2)
    assert "HF_HUB_OFFLINE" in quilt(env, "models", "add", "x", "--hub", "nobody/nothing", expect=2)
    assert "acme/llama-mini" in quilt(env, "prices", "list")

    fits = quilt(env, "models", "plan", "acme/llama-mini", "--gpu-memory", "80GiB")
    assert _plan_json(fits)["fits"] is True and "KV cache" in fits
    assert (_plan_json(fits)["trainer_gpus"], _plan_json(fits)["sampler_gpus"]) == (1, 1)
    assert "GPUs needed: the trainer 1 GPU" in fits
    tight = quilt(env, "models", "plan", "acme/llama-mini", "--gpu-memory", "8MiB", expect=2)
    assert "does not fit: device" in tight and _plan_json(tight)["fits"] is False
    assert _plan_json(tight)["trainer_gpus"] is None and "more GPUs than its heads can be split over" in tight
    # A gang of the size asked is what the plan is made for.
    ganged = quilt(env, "models", "plan", "acme/llama-mini", "--gpu-memory", "80GiB", "--trainer-ranks", "2",
                   "--sampler-ranks", "2")
    assert "trainer memory per rank (2 ranks)" in ganged and "per GPU (tensor parallel 2)" in ganged
    assert "is not in the catalogue" in quilt(env, "models", "plan", "nobody", expect=2)

    # The trainer checks the plan before loading: a device that cannot hold the base is refused.
    refused = subprocess.run([sys.executable, "-m", "batcher.main"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env={**env, "QUILT_TRAINER_BASE_MODEL": "acme/llama-mini",
                                               "QUILT_TRAINER_GPU_MEMORY": "8MiB"})
    assert refused.returncode != 0 and "does not fit this trainer" in refused.stderr, refused.stderr[-2000:]

    quilt(env, "models", "remove", "acme/llama-mini")
    assert "acme/llama-mini" not in quilt(env, "models", "list")
    assert "is not in the catalogue" in quilt(env, "models", "remove", "acme/llama-mini", expect=2)


def test_create_tiny_for_training_only(env):
    """`create-tiny --no-sample`: the tiny base serves training without a generation worker (a machine
    without a generation engine, bench/api_load.py --no-sampling); the default brings sampling back."""
    def tiny_row() -> list[str]:
        out = quilt(env, "models", "list")
        return next(line for line in out.splitlines() if line.startswith("quilt/tiny-qwen3")).split()

    quilt(env, "models", "create-tiny", "--no-sample")
    assert tiny_row()[6:8] == ["yes", "no"], tiny_row()  # train, sample
    quilt(env, "models", "create-tiny")
    assert tiny_row()[6:8] == ["yes", "yes"], tiny_row()
