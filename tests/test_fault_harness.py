"""The quick run of the fault-injection harness (`bench/faults.py --quick`): one kill each of the
generation worker, Celery and the API, two of the trainer, a restart each of Redis and Postgres,
at seeded random moments while four tenants train and sample on both SDKs. Nothing acknowledged
is lost, no request fails, every ledger row is right, and the killed generation worker's
shared memory is unlinked. The full run is a benchmark (docs/benchmarks/journals/faults.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from stackutil import ROOT

pytestmark = pytest.mark.stack


@pytest.mark.extended  # minutes of killed and restarted processes: CI runs it with --extended
@pytest.mark.timeout(1800)
def test_the_quick_fault_run_loses_nothing():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "faults.py"), "--quick"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout[-2500:])
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["faults"] == 7
    assert (figures["acknowledged_steps_lost"], figures["requests_failed"], figures["ledger_mismatches"],
            figures["shared_memory_left"]) == (0, 0, 0, 0), proc.stdout[-3000:]
