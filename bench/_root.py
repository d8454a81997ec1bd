"""Imported first by every benchmark (`import _root`), so that `python bench/<name>.py`, run from a
checkout, imports that checkout's packages (api, batcher, core, ..., the SDK's `quilt`, and
`bench.*` itself) with no PYTHONPATH to set.

Running a script puts its own folder (bench/) first on sys.path, not the repository root: without
this the project's packages came from whatever is installed, which may be another checkout (an
editable install points at the tree it was made from) or nothing at all.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pythonpath_entries() -> int:
    """How many entries after the script's folder Python took from PYTHONPATH (an empty entry is
    the working directory, so it counts)."""
    value = "" if sys.flags.ignore_environment else os.environ.get("PYTHONPATH", "")
    return len(value.split(os.pathsep)) if value else 0


# After the script's folder and any PYTHONPATH entries, so an explicit PYTHONPATH still wins
# (api_call_cpu's children import another revision's tree that way), and before the standard
# library and site-packages, so this checkout wins over an installed copy. Inserted at one place
# in reverse order: the root, then the SDK.
_AT = min(1 + _pythonpath_entries(), len(sys.path))
for _path in (str(ROOT / "sdk"), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(_AT, _path)
