"""A checkpoint's PEFT adapter as a .tar.gz (or a merged model as a .tar), streamed: built chunk by
chunk while it is sent, so a large file never sits in memory or in a temporary file.

The tar is written here rather than with `tarfile.open(mode="w|gz")` because `tarfile` copies a
whole member in one call; writing the (standard, POSIX pax) headers ourselves lets every megabyte
of a file be compressed and sent before the next is read.
"""

from __future__ import annotations

import os
import re
import tarfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from fastapi.responses import StreamingResponse

from core.adapter_merge import Member
from core.checkpoint_files import adapter_files

CHUNK = 1 << 20
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE


def archive_name(model_id: str, name: str, suffix: str = ".tar.gz") -> str:
    """A download file name without characters that need quoting (`:` in model ids, spaces)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{model_id}-{name}") + suffix


def adapter_response(model_id: str, name: str, directory: Path) -> StreamingResponse:
    """A download of the checkpoint's adapter as `<model>-<name>.tar.gz`."""
    filename = archive_name(model_id, name)
    return _download(stream_tar_gz(directory, top=filename.removesuffix(".tar.gz")), filename, "application/gzip")


def merged_response(model_id: str, name: str, members: list[Member]) -> StreamingResponse:
    """A download of the merged model (core.adapter_merge) as `<model>-<name>-merged.tar`."""
    filename = archive_name(model_id, name, "-merged.tar")
    return _download(stream_tar(members, top=filename.removesuffix(".tar"), gzip=False), filename,
                     "application/x-tar")


def _download(chunks: Iterator[bytes], filename: str, media_type: str) -> StreamingResponse:
    return StreamingResponse(chunks, media_type=media_type,
                             headers={"Content-Disposition": f'attachment; filename="{filename}"',
                                      "Cache-Control": "no-store"})


def stream_tar_gz(directory: Path, top: str) -> Iterator[bytes]:
    """Yield a gzip'd tar of `adapter_files(directory)` under the folder `top`. Synchronous on
    purpose: Starlette runs sync iterators in a thread, so file reads never block the event loop."""
    return stream_tar([_file_member(p) for p in adapter_files(directory)], top, gzip=True)


def _file_member(path: Path) -> Member:
    def chunks() -> Iterator[bytes]:
        with path.open("rb") as f:
            st = os.fstat(f.fileno())  # the size of what we read, even if the name is replaced meanwhile
            remaining = st.st_size
            while remaining > 0:
                chunk = f.read(min(CHUNK, remaining))
                if not chunk:
                    raise OSError(f"{path} shrank while it was being sent")
                remaining -= len(chunk)
                yield chunk
    return Member(path.name, path.stat().st_size, chunks)


def stream_tar(members: list[Member], top: str, *, gzip: bool) -> Iterator[bytes]:
    """Yield a tar of `members` (each of the exact size it states) under the folder `top`,
    gzip'd or not (weights do not compress: a merged model goes out as a plain tar)."""
    gz = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS) if gzip else None  # +16: gzip framing
    written = 0
    mtime = int(time.time())

    def out(data: bytes) -> bytes:
        nonlocal written
        written += len(data)
        return gz.compress(data) if gz else data

    for m in members:
        info = tarfile.TarInfo(f"{top}/{m.name}")
        info.size, info.mtime, info.mode = m.size, mtime, 0o644
        yield out(info.tobuf(tarfile.PAX_FORMAT))
        sent = 0
        for chunk in m.chunks():
            sent += len(chunk)
            yield out(chunk)
        if sent != m.size:
            raise OSError(f"{m.name}: sent {sent} bytes, its header said {m.size}")
        yield out(b"\0" * (-m.size % _BLOCK))
    end = 2 * _BLOCK  # two zero blocks end the archive; the record is padded as tar(1) does
    yield out(b"\0" * (end + (-(written + end) % _RECORD)))
    if gz:
        yield gz.flush()
