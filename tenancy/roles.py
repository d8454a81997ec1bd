"""Who may do what inside a tenant: pure functions over a role and a request, tested as tables.

A person (a member account) and an API key each hold one role:

- `owner`: everything in the tenant, including its budgets, members, the keys of others and the
  payment method; an owner of an operator tenant also holds operator power;
- `member`: trains, samples and reads; creates keys up to its own role and revokes the keys it
  made; may lower (never raise or clear) the budget of the key it calls with;
- `read_only`: reads (runs, checkpoints, futures, spend) and nothing that changes state or spends.

A key never holds more than the person (or key) that made it: its role is capped at creation, and
removing a member revokes every key they made.
"""

from __future__ import annotations

from core.errors import Forbidden, InvalidInput

ROLES = ("owner", "member", "read_only")  # most power first
_RANK = {"read_only": 0, "member": 1, "owner": 2}

# Calls a read-only caller may make besides GET and HEAD: they read results, describe models and
# prices, or configure the SDK, and neither change state nor spend.
READ_CALLS = frozenset({
    "/api/v1/retrieve_future", "/api/v1/retrieve_futures", "/api/v1/get_info", "/api/v1/weights_info",
    "/api/v1/quilt/estimate", "/api/v1/client/config", "/api/v1/client/dynamic_config", "/api/v1/telemetry",
})


# Calls on the caller's own credential, open to every role: exchanging the key for a token that
# holds no more than the key, and revoking the key itself (logging out only ever removes power).
SELF_CALLS = frozenset({("POST", "/api/v1/auth/token"), ("DELETE", "/api/v1/auth/apikey/me")})


def check_role(role: str, field: str = "role") -> str:
    if role not in _RANK:
        raise InvalidInput(f"{field}: one of {list(ROLES)}, got {role[:40]!r}", field=field)
    return role


def at_most(role: str, ceiling: str) -> bool:
    """Whether `role` holds no more power than `ceiling`."""
    return _RANK[role] <= _RANK[ceiling]


def key_role(asked: str, creator_role: str) -> str:
    """The role of a new key made by a caller with `creator_role` (Forbidden past the caller's own)."""
    check_role(asked)
    if not at_most(asked, creator_role):
        raise Forbidden(f"role: a key holds at most its maker's role ({creator_role}), asked {asked}", field="role")
    return asked


def may_call(role: str, method: str, path: str) -> bool:
    """Whether a caller with `role` may make this API call (`path` is the route's template)."""
    return role != "read_only" or method in ("GET", "HEAD") or path in READ_CALLS or (method, path) in SELF_CALLS


def may_revoke(role: str, caller_member_id: str | None, key_member_id: str | None) -> bool:
    """Owners revoke any key of their tenant; others only the keys their own account made."""
    return role == "owner" or (caller_member_id is not None and caller_member_id == key_member_id)


def budget_refusal(role: str, own_key: bool, current: int | None, new: int | None) -> str | None:
    """Why this budget change is refused, or None. `own_key`: the budget is that of the key making
    the call, which may only lower it whatever its role (a key handed to a script cannot lift the
    limit it was handed with); other budgets are the owners'. Amounts in micro-USD, None = none."""
    if own_key:
        if new is None:
            return "a key cannot clear its own budget; ask an owner"
        if current is not None and new > current:
            return "a key may lower its own budget, not raise it; ask an owner"
        return None
    if role != "owner":
        return "only an owner of this tenant may change its budgets"
    return None
