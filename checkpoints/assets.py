"""A tenant's own files in the object store (images an `ImageAssetPointerChunk` names), read bounded.

Each tenant has one prefix in the store it may point at, and no other:

- the S3 store (QUILT_CHECKPOINT_STORE=s3): `s3://<QUILT_S3_BUCKET>/<QUILT_S3_ASSET_PREFIX>/<tenant id>/<name>`;
- the local store: `<data dir>/assets/<tenant id>/<name>` (a volume the operator lets tenants fill).

`asset_name` is the whole policy, a pure function: it returns the `<name>` a location names inside
the caller's own prefix, or refuses it (400 naming the field and the rule). Nothing is fetched from
another host (http, https, file: and every other scheme), another bucket, another tenant's prefix,
or a name that could climb out of the prefix (`..`, `.`, empty parts, percent-encoding, backslashes,
control characters). `read_asset` then reads that one object, its size checked before its bytes
are read and the read itself cut at the limit (an object replaced between the check and the read
cannot bring more).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from core.errors import InvalidInput, NotFound
from core.settings import CoreSettings

MAX_NAME_CHARS = 1024  # S3's own limit on a whole key
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class AssetPlace:
    """Where tenants' assets live: `kind` "s3" (bucket, key prefix) or "local" (a directory, `root`)."""

    kind: str
    bucket: str = ""
    prefix: str = ""
    root: str = ""

    @classmethod
    def of(cls, settings: CoreSettings) -> AssetPlace:
        if settings.checkpoint_store == "s3":
            return cls("s3", bucket=settings.s3_bucket, prefix=settings.s3_asset_prefix.strip("/"))
        return cls("local", root=str(settings.data_dir / "assets"))

    def tenant_prefix(self, tenant_id: str) -> str:
        """The location every asset of `tenant_id` starts with (what a refusal shows the caller)."""
        if self.kind == "s3":
            return f"s3://{self.bucket}/" + "/".join(p for p in (self.prefix, tenant_id) if p) + "/"
        return f"{self.root.rstrip('/')}/{tenant_id}/"


def asset_name(field: str, location: str, tenant_id: str, place: AssetPlace) -> str:
    """The name under `tenant_id`'s own asset prefix that `location` points at; InvalidInput (naming
    `field` and the rule) for any location outside it."""
    own = place.tenant_prefix(tenant_id)
    shown = location[:80] + ("..." if len(location) > 80 else "")
    if any(ord(c) < 32 or ord(c) == 127 for c in location):
        raise InvalidInput(f"{field}: a location may not hold NUL or other control characters", field=field)
    scheme = _SCHEME.match(location)
    if scheme and scheme.group(1).lower() in ("http", "https"):
        raise InvalidInput(f"{field}: {shown!r} is not read: this server fetches nothing from another host; put the "
                           f"image under your asset prefix {own} or send its bytes", field=field)
    if not location.startswith(own):
        raise InvalidInput(f"{field}: {shown!r} is outside your asset prefix: an image pointer names a data: URL or "
                           f"an object under {own} (nothing else is read)", field=field)
    name = location[len(own):]
    if len(name) > MAX_NAME_CHARS:
        raise InvalidInput(f"{field}: the object's name is {len(name)} characters, over the limit of "
                           f"{MAX_NAME_CHARS}", field=field)
    if "%" in name or "\\" in name:
        raise InvalidInput(f"{field}: {shown!r}: percent-encoding and backslashes are not accepted in an asset's "
                           "name (write the name as stored)", field=field)
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise InvalidInput(f"{field}: {shown!r}: an asset's name may not have empty, '.' or '..' parts "
                           f"(it must stay under {own})", field=field)
    return name


def read_asset(field: str, place: AssetPlace, tenant_id: str, name: str, max_bytes: int, *,
               client=None) -> bytes:
    """The bytes of `tenant_id`'s asset `name` (from `asset_name`): a 404 naming `field` if it is not
    there, a 400 naming the limit if it holds more than `max_bytes`. `client` is the S3 client
    (made from the settings when not given)."""
    if place.kind == "s3":
        return _read_s3(field, place, tenant_id, name, max_bytes, client)
    return _read_local(field, place, tenant_id, name, max_bytes)


def _too_big(field: str, size: int, max_bytes: int) -> InvalidInput:
    return InvalidInput(f"{field}: the object holds {size} bytes, over the limit of {max_bytes} bytes an image "
                        "(QUILT_MAX_IMAGE_BYTES)", field=field)


def _missing(field: str) -> NotFound:
    return NotFound(f"{field}: no such object under your asset prefix", field=field)


def _read_s3(field: str, place: AssetPlace, tenant_id: str, name: str, max_bytes: int, client) -> bytes:
    from botocore.exceptions import ClientError

    key = "/".join(p for p in (place.prefix, tenant_id, name) if p)
    try:
        size = int(client.head_object(Bucket=place.bucket, Key=key)["ContentLength"])
        if size > max_bytes:
            raise _too_big(field, size, max_bytes)
        body = client.get_object(Bucket=place.bucket, Key=key, Range=f"bytes=0-{max_bytes}")["Body"]
        data: bytes = body.read(max_bytes + 1)
        body.close()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound", "InvalidRange"):
            raise _missing(field) from None
        raise
    if len(data) > max_bytes:
        raise _too_big(field, len(data), max_bytes)
    return data


def _read_local(field: str, place: AssetPlace, tenant_id: str, name: str, max_bytes: int) -> bytes:
    base = Path(place.root) / tenant_id
    path = base / name
    try:
        # A link inside the prefix could point anywhere: the resolved path must stay under it, and
        # the file itself is opened without following a link.
        if not path.resolve().is_relative_to(base.resolve()):
            raise _missing(field)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO would block an open
    except OSError:
        raise _missing(field) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # a directory, a FIFO, a device
        os.close(fd)
        raise _missing(field)
    with os.fdopen(fd, "rb") as f:
        size = info.st_size
        if size > max_bytes:
            raise _too_big(field, size, max_bytes)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _too_big(field, len(data), max_bytes)
    return data


def s3_client(settings: CoreSettings):
    """A client for the store's bucket (the same settings as checkpoints.storage's S3Store)."""
    import boto3

    return boto3.client("s3", endpoint_url=settings.s3_endpoint_url or None, region_name=settings.s3_region or None)
