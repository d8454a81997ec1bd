"""The trainer's host memory: large freed blocks stay in the process's heap.

glibc serves every allocation above its mmap threshold (32 MiB at most) with a fresh mapping and
unmaps it on free, so each pass's large tensors (the logits, the vocabulary-wide lm_head's inputs
and gradients) come back as untouched pages, faulted in one at a time, pass after pass. On the
fusion bench's 64-tenant pass that was about a fifth of the trainer's CPU time, and most of the
pass-to-pass noise (bench/trainer_fusion.py runs with and without it). Keeping freed memory in the
heap makes the process hold its peak, which the memory plan (bases.memory_plan) already budgets.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_ABOVE = 2**31 - 1  # mallopt takes an int: free memory at the heap's top is returned past 2 GiB


def keep_freed_memory() -> bool:
    """Serve every host allocation from the heap and keep what is freed there (glibc only).

    Returns whether the C library took it; elsewhere (macOS, musl) nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    kept = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE))
    if not kept:
        log.warning("the C library refused mallopt: large tensors are page-faulted in again every pass")
    return kept
