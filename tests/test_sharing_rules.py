"""tenancy.sharing's rules as tables: who may copy another tenant's checkpoint, and what a copy
adds to the caller's storage quota."""

from __future__ import annotations

import pytest

from tenancy import sharing


@pytest.mark.parametrize(("owner", "published", "token", "access"), [
    ("A", False, False, "owner"),
    ("A", True, True, "owner"),       # the owner's own, whatever else holds
    ("B", True, False, "published"),
    ("B", True, True, "published"),
    ("B", False, True, "token"),
    ("B", False, False, None),        # another tenant's private checkpoint: a 404
])
def test_copy_access(owner, published, token, access):
    assert sharing.copy_access(owner_tenant=owner, caller_tenant="A", published=published,
                               token_grants_it=token) == access


@pytest.mark.parametrize(("stored", "adds", "limit", "refused"), [
    (0, 10, 10, False),
    (5, 5, 10, False),
    (5, 6, 10, True),
    (10, 0, 10, False),   # files the tenant already holds add nothing
    (50, 0, 10, False),
    (10, 1, 10, True),
])
def test_copy_quota(stored, adds, limit, refused):
    why = sharing.copy_quota_refusal(stored_bytes=stored, adds_bytes=adds, limit=limit)
    assert (why is not None) == refused
    if why:
        assert "max_checkpoint_bytes" in why and f"{limit:,}" in why


def test_a_token_is_kept_as_its_hash_only():
    assert sharing.token_hash("qwt-a") != sharing.token_hash("qwt-b")
    assert len(sharing.token_hash("qwt-a")) == 32 and b"qwt" not in sharing.token_hash("qwt-a")


@pytest.mark.parametrize(("owner", "holder", "refused"), [
    (None, None, None),
    ("payment", None, None),
    (None, "payment", None),
    ("operator", None, "owner"),
    (None, "operator", "your tenant"),  # a link minted before the holder was suspended
    ("operator", "operator", "your tenant"),
])
def test_a_download_link_stops_when_owner_or_holder_is_suspended_by_an_operator(owner, holder, refused):
    got = sharing.download_link_refusal(owner_suspended=owner, holder_suspended=holder)
    assert (got is None) if refused is None else (refused in got)


@pytest.mark.parametrize(("held", "most", "refused"), [(0, 1, False), (4, 5, False), (5, 5, True), (9, 5, True),
                                                       (0, 0, True)])
def test_copies_and_tokens_are_capped_naming_the_setting(held, most, refused):
    got = sharing.cap_refusal(what="copies", held=held, most=most, setting="QUILT_TENANT_MAX_COPIES")
    assert (got is not None) is refused
    if got:
        assert f"QUILT_TENANT_MAX_COPIES={most}" in got and str(held) in got
