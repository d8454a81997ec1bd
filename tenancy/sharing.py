"""Who may read another tenant's checkpoint, and what a copy may add to storage: pure rules over
plain data, tested as tables (tests/test_sharing_rules.py).

A checkpoint is its owner's alone unless the owner publishes it (every tenant may then sample,
copy and download it through its tinker path, until it is unpublished) or hands out a weights
access token for it (whoever holds the token may copy it, until it is revoked or expires).
"""

from __future__ import annotations

import hashlib
from typing import Literal

Access = Literal["owner", "published", "token"]


def token_hash(token: str) -> bytes:
    """What is stored of a weights access token: its SHA-256 (the token itself is shown once)."""
    return hashlib.sha256(token.encode()).digest()


def copy_access(*, owner_tenant: str, caller_tenant: str, published: bool, token_grants_it: bool) -> Access | None:
    """Why the caller may copy this checkpoint, or None (then it reads as missing, a 404)."""
    if owner_tenant == caller_tenant:
        return "owner"
    if published:
        return "published"
    if token_grants_it:
        return "token"
    return None


def copy_quota_refusal(*, stored_bytes: int, adds_bytes: int, limit: int) -> str | None:
    """Why a copy would pass the caller's `max_checkpoint_bytes`, or None. A copy of files the
    tenant already holds adds nothing (`adds_bytes` 0): the tenant's storage counts each stored
    directory once, the owner's included while another tenant holds a copy of it."""
    if adds_bytes and stored_bytes + adds_bytes > limit:
        return (f"max_checkpoint_bytes: the copy adds {adds_bytes:,} bytes to the {stored_bytes:,} your live "
                f"checkpoints hold, past your limit of {limit:,}; delete checkpoints you no longer need")
    return None


def download_link_refusal(*, owner_suspended: str | None, holder_suspended: str | None) -> str | None:
    """Why a download link no longer works given the suspension kinds (None, 'operator', 'payment')
    of the checkpoint's owner and of the link's own tenant, or None if it works. An operator's
    suspension of either stops it (a holder suspended for abuse must not keep pulling a published
    checkpoint with a link minted before); a payment suspension stops neither."""
    if holder_suspended == "operator":
        return "your tenant is suspended by an operator: its download links do not work"
    if owner_suspended == "operator":
        return "this checkpoint's owner is suspended by an operator: its download links do not work"
    return None


def cap_refusal(*, what: str, held: int, most: int, setting: str) -> str | None:
    """Why one more `what` is refused when the tenant holds `held` of at most `most` (the setting
    `setting` names), or None."""
    if held >= most:
        return f"{what}: your tenant holds {held}, the most it may ({setting}={most}); delete or revoke some first"
    return None
