"""`quilt export TINKER_PATH --out DIR (--merge | --peft)`: a checkpoint of yours as a directory.

A client of the API like the SDK (QUILT_API_KEY, QUILT_BASE_URL): it asks for the signed download
(api.routes.downloads: `archive` for --peft, `merged` for --merge), follows it without the key,
and unpacks the stream into DIR as it arrives. --peft gives the PEFT adapter directory, --merge a
Hugging Face model directory with the adapter merged into the base (checkpoints.adapter_merge).
"""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

import httpx

from core import ids
from core.errors import InvalidInput, QuiltError

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


class _Stream:
    """httpx's byte iterator as the file object tarfile's stream mode reads."""

    def __init__(self, chunks):
        self._chunks, self._buf = chunks, b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self._buf) < n:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._buf += chunk
        out, self._buf = (self._buf, b"") if n < 0 else (self._buf[:n], self._buf[n:])
        return out


def export(tinker_path: str, out: Path, *, merge: bool, api_key: str, base_url: str, force: bool = False) -> list[str]:
    """Write the checkpoint's adapter (or the merged model) into `out`; returns the file names."""
    try:
        run, kind, name = ids.parse_tinker_path(tinker_path)
    except ValueError as exc:
        raise InvalidInput(str(exc), field="tinker_path") from None
    if out.exists() and any(out.iterdir()):
        if not force:
            raise InvalidInput(f"{out} exists and is not empty; pass --force to replace it", field="out")
        shutil.rmtree(out)
    what = "merged" if merge else "archive"
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(60, read=600)) as client:
        r = client.get(f"/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/{what}",
                       headers={"X-API-Key": api_key})
        if r.status_code != 302:
            detail = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else r.text
            raise QuiltError(f"{tinker_path}: {r.status_code} {detail}")
        names: list[str] = []
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with client.stream("GET", r.headers["location"]) as download:  # signed: no key sent
            if download.status_code != 200:
                raise QuiltError(f"{tinker_path}: download answered {download.status_code}")
            mode = "r|" if merge else "r|gz"
            with tarfile.open(fileobj=_Stream(download.iter_bytes()), mode=mode) as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    member.name = os.path.basename(member.name)  # the archive's top folder becomes `out`
                    tar.extract(member, tmp, filter="data")
                    names.append(member.name)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    return names


def cmd_export(args) -> int:
    api_key = args.api_key or os.environ.get("QUILT_API_KEY", "")
    if not api_key:
        raise InvalidInput("no API key: pass --api-key or set QUILT_API_KEY", field="api_key")
    names = export(args.tinker_path, args.out, merge=args.merge, api_key=api_key, force=args.force,
                   base_url=args.base_url or os.environ.get("QUILT_BASE_URL") or DEFAULT_BASE_URL)
    print(f"wrote {len(names)} files to {args.out}: {', '.join(sorted(names))}")
    return 0


def add_command(sub) -> None:
    p = sub.add_parser("export", help="download a checkpoint of yours: the PEFT adapter (--peft) or the adapter "
                                      "merged into its base as a Hugging Face model (--merge)")
    p.add_argument("tinker_path", help="tinker://<run>/<kind>/<name>")
    p.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--merge", action="store_true", help="a Hugging Face model: the base with the adapter merged in")
    how.add_argument("--peft", action="store_true", help="the PEFT adapter directory alone")
    p.add_argument("--force", action="store_true", help="replace --out if it holds files")
    p.add_argument("--api-key", default=None, help="default: $QUILT_API_KEY")
    p.add_argument("--base-url", default=None, help=f"default: $QUILT_BASE_URL or {DEFAULT_BASE_URL}")
    p.set_defaults(func=cmd_export)
