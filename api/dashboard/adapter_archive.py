"""A checkpoint's PEFT adapter as a .tar.gz, streamed: built chunk by chunk while it is sent, so a
large adapter never sits in memory or in a temporary file.

The tar is written here rather than with `tarfile.open(mode="w|gz")` because `tarfile` copies a
whole member in one call; writing the (standard, POSIX pax) headers ourselves lets every megabyte
of a file be compressed and sent before the next is read.
"""

from __future__ import annotations

import os
import re
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from core.checkpoint_files import adapter_files

CHUNK = 1 << 20
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE


def archive_name(model_id: str, name: str) -> str:
    """A download file name without characters that need quoting (`:` in model ids, spaces)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{model_id}-{name}") + ".tar.gz"


def stream_tar_gz(directory: Path, top: str) -> Iterator[bytes]:
    """Yield a gzip'd tar of `adapter_files(directory)` under the folder `top`. Synchronous on
    purpose: Starlette runs sync iterators in a thread, so file reads never block the event loop."""
    gz = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # +16: a gzip header and trailer
    written = 0

    def out(data: bytes) -> bytes:
        nonlocal written
        written += len(data)
        return gz.compress(data)

    for path in adapter_files(directory):
        with path.open("rb") as f:
            st = os.fstat(f.fileno())  # the size of what we read, even if the name is replaced meanwhile
            info = tarfile.TarInfo(f"{top}/{path.name}")
            info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o644
            yield out(info.tobuf(tarfile.PAX_FORMAT))
            remaining = st.st_size
            while remaining > 0:
                chunk = f.read(min(CHUNK, remaining))
                if not chunk:
                    raise OSError(f"{path} shrank while it was being sent")
                remaining -= len(chunk)
                yield out(chunk)
        yield out(b"\0" * (-st.st_size % _BLOCK))
    end = 2 * _BLOCK  # two zero blocks end the archive; the record is padded as tar(1) does
    yield out(b"\0" * (end + (-(written + end) % _RECORD)))
    yield gz.flush()
