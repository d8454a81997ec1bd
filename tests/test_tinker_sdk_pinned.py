"""The official-SDK tests (tests/test_tinker_sdk.py, tests/test_checkpoint_downloads.py) again,
unchanged, with an older tinker SDK that users still pin (requirements/tinker-pinned.txt, which
scripts/install.sh puts in .venv/sdk-pins/): a pytest run in a child process, with that SDK first
on its path, against this run's stack."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from stackutil import SHARED_STACK_ENV

ROOT = Path(__file__).resolve().parents[1]
PIN = next(line for line in (ROOT / "requirements" / "tinker-pinned.txt").read_text().splitlines()
           if line.startswith("tinker=="))
VERSION = PIN.removeprefix("tinker==")
PIN_DIR = ROOT / ".venv" / "sdk-pins" / f"tinker-{VERSION}"


def test_official_sdk_tests_pass_with_the_pinned_release(stack, tmp_path):
    if not (PIN_DIR / "tinker").is_dir():
        pytest.fail(f"{PIN_DIR} is missing: scripts/install.sh installs {PIN} there")
    shared = {k: str(v) for k, v in dataclasses.asdict(stack).items()}
    env = {**os.environ, SHARED_STACK_ENV: json.dumps(shared), "QUILT_EXPECT_TINKER": VERSION,
           "PYTHONPATH": os.pathsep.join([str(PIN_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/test_tinker_sdk.py", "tests/test_checkpoint_downloads.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail, tail
