"""bench/gpu_suite.sh on a machine without a CUDA GPU: it says so, measures nothing and exits 0 with
its one JSON line, so scripts reading it can tell 'no GPU' from a failed run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the suite would measure it")
def test_without_a_gpu_it_says_so_and_exits_0():
    done = subprocess.run(["bash", "bench/gpu_suite.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "no CUDA GPU here" in lines[0]
    assert json.loads(lines[-1]) == {"gpu": False}
