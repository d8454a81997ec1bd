"""The SFT example, run as a user would, against the real stack: its loss falls by 30% or more."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sft_example_loss_falls(stack, tenant):
    env = {**os.environ, "QUILT_API_KEY": tenant.key, "QUILT_BASE_URL": stack.base_url}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "sft_tiny.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 30
    assert summary["loss_last"] <= 0.7 * summary["loss_first"], summary
