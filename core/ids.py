"""Identifier formats. Model ids follow Tinker: `{session_id}:train:{n}` (the SDK computes them)."""

from __future__ import annotations

import re
import secrets
import uuid

# Tenant and checkpoint names: they go into paths, URLs and forms, so one pattern for both, with no
# '/', '?', '%' or space, and a first character that is a letter or a digit (so never '.' or '..').
# Use fullmatch: `$` would let a trailing newline in.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NAME_RULE = "1-128 characters of letters, digits, '.', '_' or '-', starting with a letter or a digit"


def check_name(value: str, what: str) -> str:
    """`value` if it is a valid name; ValueError saying the rule otherwise."""
    if not NAME_RE.fullmatch(value):
        raise ValueError(f"{what} must be {NAME_RULE}")
    return value


def new_tenant_id() -> str:
    return "ten-" + uuid.uuid4().hex[:16]


def new_session_id() -> str:
    return "sess-" + uuid.uuid4().hex[:16]


def new_request_id() -> str:
    return "req-" + uuid.uuid4().hex


def new_key_id() -> str:
    return "key-" + uuid.uuid4().hex[:16]


def new_member_id() -> str:
    return "mem-" + uuid.uuid4().hex[:16]


def new_project_id() -> str:
    return "proj-" + uuid.uuid4().hex[:16]


def new_weights_token_id() -> str:
    return "wat-" + uuid.uuid4().hex[:16]


def new_weights_token() -> str:
    """A weights access token (copy_weights' `weights_access_token`): a bearer secret, kept hashed."""
    return "qwt-" + secrets.token_urlsafe(32)


def new_api_key() -> str:
    # The tinker SDK refuses keys that do not start with "tml-".
    return "tml-" + secrets.token_urlsafe(32)


def training_model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """`tinker://<run>/<kind>/<name>` -> (run, kind, name); ValueError if malformed."""
    prefix = "tinker://"
    if not path.startswith(prefix):
        raise ValueError(f"path must start with {prefix!r}, got {path!r}")
    parts = path[len(prefix) :].split("/")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"path must look like tinker://<run>/<kind>/<name>, got {path!r}")
    return parts[0], parts[1], parts[2]
