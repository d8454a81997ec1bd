"""Where checkpoint files live: a local directory (the default) or an S3-compatible object store.

A checkpoint version is named by its `storage_path` (checkpoints.layout.new_version_dir), whose
last five parts, `<tenant>/<model>/<kind>/<name>/<version>`, are its key in either store. Each
process keeps its files in a local directory, `local_dir(storage_path)`:

- writers (the trainer) write the version there, then `publish` it; only after that is the save
  recorded and answered, so an acknowledged checkpoint is in the store;
- readers (the trainer loading state, the generation pool, the API's downloads, `quilt export`)
  call `fetch`, which returns that directory, downloading the version first when this machine
  has not got it. A version is never rewritten, so a local copy is a cache that never goes
  stale: each replica fetches a version once;
- retention calls `remove`.

With the local store the directory is the store, and `publish` and `fetch` only check it. With
S3 the local directory is `<data dir>/checkpoints` as well (the writer's copy, or a cache on
other machines); the objects are `s3://<bucket>/<prefix>/<key>/<file>`. A download lands in a
temporary directory renamed into place, so a reader never sees half a version. Those copies are
held under QUILT_S3_CACHE_MAX_GIB, least recently used first out (checkpoints.cache).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from checkpoints import version_dirs
from checkpoints.cache import SizeLimit
from core.errors import NotFound
from core.settings import CoreSettings, get_core_settings

log = logging.getLogger("quilt.checkpoint_store")

KEY_PARTS = 5  # <tenant>/<model>/<kind>/<name>/<version>


def key_of(storage_path: str | Path, parts: int = KEY_PARTS) -> str:
    """A version's key (its last `parts` path parts), the same on every machine whatever its
    checkpoint directory."""
    names = Path(storage_path).parts
    if len(names) < parts or any(p in ("", ".", "..") for p in names[-parts:]):
        raise ValueError(f"not a checkpoint version path: {storage_path!r}")
    return "/".join(names[-parts:])


class LocalStore:
    """The checkpoint directory on this machine's disk (or a volume every process mounts at the
    same place): a version's files are where its storage_path says."""

    def __init__(self, root: Path):
        self.root = root

    def local_dir(self, storage_path: str | Path) -> Path:
        return Path(storage_path)

    def publish(self, storage_path: str | Path) -> None:
        if not self.local_dir(storage_path).is_dir():
            raise FileNotFoundError(f"checkpoint {storage_path} was not written")

    def fetch(self, storage_path: str | Path) -> Path:
        directory = self.local_dir(storage_path)
        if not directory.is_dir():
            raise _gone(storage_path)
        return directory

    def remove(self, storage_path: str | Path) -> bool:
        """Delete a version (retention); False for a path outside the store (a bad row never
        deletes elsewhere)."""
        return version_dirs.remove(self.root, str(self.local_dir(storage_path)))

    def children(self, parent: str | Path) -> list[str]:
        """The names of the versions under `parent`, a version's parent directory (a trainer's
        snapshots of one model: batcher.snapshots)."""
        parent = Path(parent)
        return sorted(p.name for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []

    def orphans(self, named: set[str], older_than: float) -> list[str]:
        """Versions in the store that no storage path in `named` (live or queued for deletion)
        names, untouched since the timestamp `older_than` (checkpoints.retention.sweep_orphans)."""
        dirs = {self.local_dir(p).resolve() for p in named if _key_or_none(p)}
        return [str(p) for p in version_dirs.orphans(self.root, dirs, set(), older_than=older_than)]


class S3Store(LocalStore):
    """Versions as objects in a bucket; `root` holds this machine's copies, by key."""

    def __init__(self, root: Path, *, bucket: str, prefix: str, endpoint_url: str | None, region: str | None,
                 key_parts: int = KEY_PARTS, cache_max_bytes: int | None = None, cache_min_idle_s: float = 600.0):
        super().__init__(root)
        import boto3  # only deployments that use S3 pay its import

        self.bucket, self.prefix, self.key_parts = bucket, prefix.strip("/"), key_parts
        self.client = boto3.client("s3", endpoint_url=endpoint_url or None, region_name=region or None)
        self.limit = None if cache_max_bytes is None else SizeLimit(root, key_parts, max_bytes=cache_max_bytes,
                                                                    min_idle_s=cache_min_idle_s)

    def _added(self, directory: Path) -> None:
        if self.limit is not None:
            self.limit.added(sum(f.stat().st_size for f in directory.iterdir() if f.is_file()))

    def local_dir(self, storage_path: str | Path) -> Path:
        return self.root / key_of(storage_path, self.key_parts)

    def _under_prefix(self, key: str) -> str:
        """The object-key prefix of `key`'s objects ("" for the whole store)."""
        return "/".join(p for p in (self.prefix, key) if p) + "/" if self.prefix or key else ""

    def _object_prefix(self, storage_path: str | Path) -> str:
        return self._under_prefix(key_of(storage_path, self.key_parts))

    def children(self, parent: str | Path) -> list[str]:
        """This machine's versions under `parent` and the bucket's."""
        parent_key = key_of(parent, self.key_parts - 1)
        prefix = self._under_prefix(parent_key)
        remote = {common["Prefix"][len(prefix):].rstrip("/")
                  for page in self.client.get_paginator("list_objects_v2").paginate(
                      Bucket=self.bucket, Prefix=prefix, Delimiter="/")
                  for common in page.get("CommonPrefixes", [])}
        return sorted(remote | set(super().children(self.root / parent_key)))

    def publish(self, storage_path: str | Path) -> None:
        directory = self.local_dir(storage_path)
        super().publish(storage_path)
        prefix = self._object_prefix(storage_path)
        for file in sorted(p for p in directory.iterdir() if p.is_file() and not p.is_symlink()):
            self.client.upload_file(str(file), self.bucket, prefix + file.name)
        self._added(directory)  # the writer's copy is a cached copy from now on

    def fetch(self, storage_path: str | Path) -> Path:
        directory = self.local_dir(storage_path)
        try:
            os.utime(directory)  # a use: the size limit removes least recently used copies first
            return directory
        except FileNotFoundError:
            pass
        except OSError:  # a copy this process may not touch (a read-only mount) is a copy all the same
            return directory
        from botocore.exceptions import ClientError

        prefix = self._object_prefix(storage_path)
        names = [obj["Key"][len(prefix):] for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix) for obj in page.get("Contents", [])]
        names = [n for n in names if n and "/" not in n]
        if not names:
            raise _gone(storage_path)
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=directory.parent))
        try:
            for name in names:
                try:
                    self.client.download_file(self.bucket, prefix + name, str(staging / name))
                except ClientError as exc:  # deleted between the listing and this download
                    if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                        raise _gone(storage_path) from None
                    raise
            try:
                os.rename(staging, directory)
            except OSError:
                if not directory.is_dir():  # not another fetch of the same version winning the race
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("fetched %s (%d files) from s3://%s", key_of(storage_path, self.key_parts), len(names), self.bucket)
        self._added(directory)
        return directory

    def remove(self, storage_path: str | Path) -> bool:
        try:
            prefix = self._object_prefix(storage_path)
        except ValueError:
            log.error("refusing to delete %s: not a checkpoint version path", storage_path)
            return False
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
        super().remove(storage_path)  # this machine's copy
        return True

    def orphans(self, named: set[str], older_than: float) -> list[str]:
        """This machine's orphaned directories, and the bucket's: versions whose objects no row
        names, the newest of them written before `older_than` (a trainer that uploaded a save
        and died before recording it)."""
        local = super().orphans(named, older_than)
        known = {_key_or_none(p) for p in named} | {_key_or_none(p) for p in local}
        prefix = self._under_prefix("")
        newest: dict[str, float] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                parts = obj["Key"][len(prefix):].split("/")
                if len(parts) != KEY_PARTS + 1:  # not <tenant>/<model>/<kind>/<name>/<version>/<file>
                    continue
                key = "/".join(parts[:KEY_PARTS])
                newest[key] = max(newest.get(key, 0.0), obj["LastModified"].timestamp())
        return local + sorted(k for k, at in newest.items() if k not in known and at < older_than)


def _key_or_none(storage_path: str | Path) -> str | None:
    try:
        return key_of(storage_path)
    except ValueError:  # a row no version path could be: it names nothing in the store
        return None


def _gone(storage_path: str | Path) -> NotFound:
    name = "/".join(Path(storage_path).parts[-KEY_PARTS + 2:])  # <kind>/<name>/<version>: nothing of the host
    return NotFound(f"the files of checkpoint {name} are gone from the checkpoint store", field="checkpoint_id")


def snapshot_store_for(settings: CoreSettings, root: Path, *, in_checkpoint_store: bool) -> LocalStore:
    """Where a trainer's snapshots (batcher.snapshots: `<root>/<model>/<seq>`) live: `root` on this
    machine's disk, or, `in_checkpoint_store` with the S3 checkpoint store, also the bucket under
    QUILT_S3_SNAPSHOT_PREFIX, so another machine can restore the models."""
    if in_checkpoint_store and settings.checkpoint_store == "s3":
        return S3Store(root, bucket=settings.s3_bucket, prefix=settings.s3_snapshot_prefix,
                       endpoint_url=settings.s3_endpoint_url, region=settings.s3_region, key_parts=2)
    return LocalStore(root)


def store_for(settings: CoreSettings) -> LocalStore:
    if settings.checkpoint_store == "s3":
        return S3Store(settings.checkpoint_dir, bucket=settings.s3_bucket, prefix=settings.s3_prefix,
                       endpoint_url=settings.s3_endpoint_url, region=settings.s3_region,
                       cache_max_bytes=int(settings.s3_cache_max_gib * 2**30),
                       cache_min_idle_s=settings.s3_cache_min_idle_s)
    return LocalStore(settings.checkpoint_dir)


_current: tuple[CoreSettings, LocalStore] | None = None


def get_store() -> LocalStore:
    """This process's store, from its settings (QUILT_CHECKPOINT_STORE and the QUILT_S3_* ones);
    a new one when the settings are read again (core.settings.clear_settings_cache)."""
    global _current
    settings = get_core_settings()
    if _current is None or _current[0] is not settings:
        _current = (settings, store_for(settings))
    return _current[1]
