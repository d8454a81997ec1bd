"""A checkpoint's PEFT adapter as a .tar.gz (or a merged model as a .tar), streamed: built chunk by
chunk while it is sent, so a large file never sits in memory or in a temporary file.

The tar is written here rather than with `tarfile.open(mode="w|gz")` because `tarfile` copies a
whole member in one call; writing the (standard, POSIX pax) headers ourselves lets every megabyte
of a file be compressed and sent before the next is read.
"""

from __future__ import annotations

import mimetypes
import os
import re
import tarfile
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from fastapi.responses import StreamingResponse

from checkpoints.adapter_merge import Member
from checkpoints.layout import adapter_files
from core.errors import QuotaExceeded
from core.settings import get_api_settings

CHUNK = 1 << 20
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE


def archive_name(model_id: str, name: str, suffix: str = ".tar.gz") -> str:
    """A download file name without characters that need quoting (`:` in model ids, spaces)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{model_id}-{name}") + suffix


def adapter_response(model_id: str, name: str, directory: Path) -> StreamingResponse:
    """A download of the checkpoint's adapter as `<model>-<name>.tar.gz`. Its files are opened
    now (FileNotFoundError when they are already gone), so a delete while it is sent cuts nothing."""
    filename = archive_name(model_id, name)
    members = [_file_member(p) for p in adapter_files(directory)]
    return _download(stream_tar(members, top=filename.removesuffix(".tar.gz"), gzip=True), filename,
                     "application/gzip")


def file_response(path: Path) -> StreamingResponse:
    """One file of a checkpoint as a download, opened now like `adapter_response`'s."""
    member = _file_member(path)
    response = _download(member.chunks(), path.name, mimetypes.guess_type(path.name)[0] or "application/octet-stream")
    response.headers["Content-Length"] = str(member.size)
    return response


_merges_running = 0
_merges_lock = threading.Lock()


def merged_response(model_id: str, name: str, members: list[Member]) -> StreamingResponse:
    """A download of the merged model (checkpoints.adapter_merge) as `<model>-<name>-merged.tar`.
    Its chunks are made in Starlette's thread pool (a sync iterator), off the event loop; each
    running merge holds about one weight's float32 copies, so at most QUILT_MERGED_DOWNLOADS_AT_ONCE
    run in one API process (429 with Retry-After past it)."""
    global _merges_running
    with _merges_lock:
        if _merges_running >= get_api_settings().merged_downloads_at_once:
            raise QuotaExceeded(f"{_merges_running} merged downloads are running on this server, the most at once; "
                                "try again in a minute (or download the adapter and merge it yourself)",
                                field="merged", retry_after_s=60)
        _merges_running += 1
    filename = archive_name(model_id, name, "-merged.tar")
    return _download(_Counted(stream_tar(members, top=filename.removesuffix(".tar"), gzip=False)), filename,
                     "application/x-tar")


class _Counted:
    """The merge's chunks, giving its place back once: when they end or fail, or when the response
    is dropped unsent or half sent (the client left) and this is collected."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks, self._held = chunks, True

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._chunks)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        global _merges_running
        with _merges_lock:
            if self._held:
                self._held = False
                _merges_running -= 1

    def __del__(self):
        self._release()


def _download(chunks: Iterator[bytes], filename: str, media_type: str) -> StreamingResponse:
    return StreamingResponse(chunks, media_type=media_type,
                             headers={"Content-Disposition": f'attachment; filename="{filename}"',
                                      "Cache-Control": "no-store"})


def _file_member(path: Path) -> Member:
    """A file as a tar member, opened here: an open file outlives its name (POSIX), so a checkpoint
    deleted after this call still sends whole, and one deleted before raises FileNotFoundError
    while the handler can still answer 404."""
    f = path.open("rb")
    size = os.fstat(f.fileno()).st_size

    def chunks() -> Iterator[bytes]:
        with f:
            remaining = size
            while remaining > 0:
                chunk = f.read(min(CHUNK, remaining))
                if not chunk:
                    raise OSError(f"{path} shrank while it was being sent")
                remaining -= len(chunk)
                yield chunk
    return Member(path.name, size, chunks)


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
