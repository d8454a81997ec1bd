"""Checkpoint version directories on a disk: removing one safely, finding those no row names.

`checkpoints.storage` calls these for its local root; `checkpoints.retention` decides what goes.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

log = logging.getLogger("quilt.retention")


def remove(checkpoint_dir: Path, path: str) -> bool:
    """Delete one version directory, and its name directory once that is empty. Refuses anything
    outside the checkpoint root (a bad row must never delete elsewhere)."""
    target, root = Path(path).resolve(), checkpoint_dir.resolve()
    if root not in target.parents:
        log.error("refusing to delete %s: not under the checkpoint root %s", target, root)
        return False
    shutil.rmtree(target, ignore_errors=True)
    try:
        target.parent.rmdir()  # the checkpoint name's directory, if no other version is left
    except OSError:
        pass
    return True


def orphans(checkpoint_dir: Path, live: set[Path], queued: set[Path], *, older_than: float) -> list[Path]:
    """Version directories under `checkpoint_dir` (`<tenant>/<model>/<kind>/<name>/<version>`, and
    the `.tmp-*` of a save that crashed) that no checkpoint names and none is queued for deletion,
    untouched since the timestamp `older_than`: what a worker that died between writing the files
    and recording them leaves behind. Paths in `live`/`queued` must be resolved."""
    out = []
    for name_dir in checkpoint_dir.resolve().glob("*/*/*/*"):
        if not name_dir.is_dir() or name_dir in live:  # a checkpoint saved before per-save directories
            continue
        for version in name_dir.iterdir():
            if (version.is_dir() and version not in live and version not in queued
                    and version.stat().st_mtime < older_than):
                out.append(version)
    return sorted(out)
