"""The trainer keeps freed host memory in its heap (batcher.heap): a large tensor freed after a pass
is not handed back to the kernel, so the next pass does not fault its pages in again."""

import subprocess
import sys

import pytest

PROBE = """
import sys, torch
from batcher import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed_memory()
def rss_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
before = rss_kib()
t = torch.ones(64 * 2**20 // 4)  # 64 MiB, past glibc's largest mmap threshold
del t
print(rss_kib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_tensor_stays_in_the_heap_only_when_asked():
    def held_kib(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    assert held_kib("keep") > 60 * 1024  # the 64 MiB stay resident after the free
    assert held_kib("system") < 16 * 1024  # glibc's default unmaps them at once
