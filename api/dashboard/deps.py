"""Who is looking at the dashboard: the session cookie resolved to a tenant, the CSRF check that
every change passes, and the operator gate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from api.dashboard import sessions
from api.deps import Pool, RedisDep
from core.errors import Forbidden, Unauthenticated
from tenancy.auth import Principal, principal_for_account, principal_for_key_id


@dataclass(frozen=True)
class Viewer:
    """A logged-in dashboard user: the tenant (as for an API key) and their session."""

    who: Principal
    session: sessions.DashSession
    token: str


def page_context(viewer: Viewer, nav: str, **extra) -> dict:
    """What every logged-in page's template gets: the viewer, its CSRF token, the menu entry."""
    return {"viewer": viewer, "who": viewer.who, "csrf_token": viewer.session.csrf_token, "nav": nav, **extra}


async def _viewer(request: Request, pool: Pool, redis: RedisDep) -> Viewer:
    token = request.cookies.get(sessions.COOKIE)
    session = await sessions.load(redis, token)
    if session is None or token is None:
        raise Unauthenticated("log in to the dashboard with an API key", field="session")
    async with pool.connection() as conn:
        try:
            if session.account_id:
                who = await principal_for_account(conn, session.account_id)
            else:
                who = await principal_for_key_id(conn, session.key_id)
        except Unauthenticated:  # the key was revoked: the session ends with it
            await sessions.end(redis, token)
            raise
    request.state.tenant_id = who.tenant_id
    return Viewer(who, session, token)


async def _csrf_checked(request: Request, viewer: Annotated[Viewer, Depends(_viewer)]) -> Viewer:
    given = request.headers.get("X-CSRF-Token")
    if given is None and request.headers.get("content-type", "").startswith(
            ("application/x-www-form-urlencoded", "multipart/form-data")):
        sent = (await request.form()).get("csrf_token")
        given = sent if isinstance(sent, str) else None  # a file under that name is no token
    if not sessions.tokens_match(viewer.session.csrf_token, given):
        raise Forbidden("missing or wrong CSRF token: reload the page and try again", field="csrf_token")
    return viewer


async def _operator(viewer: Annotated[Viewer, Depends(_viewer)]) -> Viewer:
    if not viewer.who.is_operator:
        raise Forbidden("this page is for operators (tenants created with `quilt tenants create --operator`)",
                        field="role")
    return viewer


async def _owner_changing(viewer: Annotated[Viewer, Depends(_csrf_checked)]) -> Viewer:
    if not viewer.who.is_owner:
        raise Forbidden("only an owner of this tenant may do this", field="role")
    return viewer


async def _operator_changing(viewer: Annotated[Viewer, Depends(_csrf_checked)]) -> Viewer:
    return await _operator(viewer)


LoggedIn = Annotated[Viewer, Depends(_viewer)]
Changing = Annotated[Viewer, Depends(_csrf_checked)]  # any state-changing request
OperatorOnly = Annotated[Viewer, Depends(_operator)]
OperatorChanging = Annotated[Viewer, Depends(_operator_changing)]  # an operator's state-changing request
OwnerChanging = Annotated[Viewer, Depends(_owner_changing)]  # a tenant owner's state-changing request
