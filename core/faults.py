"""Named crash points, for fault injection (tests and `bench/faults.py`).

`crash_point("api.after_commit")` ends the process at once, as SIGKILL would (no clean-up, no
flush), when QUILT_CRASH_AT names that point. QUILT_CRASH_AT is a comma-separated list of
`name` (crash the first time the point is reached) or `name:N` (the Nth time, counted per
process). Each point fires once per data directory (a marker under `<data dir>/crash-points`),
so the process the launcher restarts with the same environment goes on past it. Unset, a crash
point costs one dict lookup.

Points: `api.after_commit` (request row committed, stream entry not appended); in the trainer
`trainer.after_read` (entries read, not queued), `trainer.after_pass` (a fused pass computed,
nothing answered), `trainer.after_optim` (an optimizer step applied, not answered),
`trainer.after_snapshot` (a snapshot written, its entries not acknowledged); in a trainer gang's
other ranks `gang.rank_in_pass` (rank 0 has begun a pass and waits on this rank) and
`gang.rank_in_snapshot` (the gang is writing a snapshot's shares); in either worker's
finishing `<group>.after_settle` (the request's row finished, its future not published) and
`<group>.after_publish` (answered, not acknowledged), group `trainers` or `samplers`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections import Counter

from core.settings import get_core_settings

log = logging.getLogger("quilt.faults")

CRASH_EXIT_CODE = 137  # what a shell reports for SIGKILL, so supervisors treat both alike


def _armed(spec: str) -> dict[str, int]:
    points: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, nth = part.partition(":")
        points[name] = int(nth) if nth.isdigit() and int(nth) > 0 else 1
    return points


@functools.cache
def armed() -> dict[str, int]:
    return _armed(get_core_settings().crash_at)


_reached: Counter[str] = Counter()


def crash_point(name: str) -> None:
    """End the process here if QUILT_CRASH_AT names `name` (see the module docstring)."""
    points = armed()
    if name not in points:
        return
    _reached[name] += 1
    if _reached[name] != points[name]:
        return
    marker = get_core_settings().data_dir / "crash-points" / name
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(os.getpid()))
    log.warning("crash point %s reached (pass %d): exiting as if killed", name, _reached[name])
    sys.stderr.flush()
    os._exit(CRASH_EXIT_CODE)
