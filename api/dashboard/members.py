"""The dashboard's accounts: sign-up (open, or by an owner's invitation), password login beside the
API-key login, password reset, and the members page where owners invite and remove people
(tenancy.members). Forms without a session use the login page's double-submit CSRF cookie."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse

from api import links
from api.caller_cache import changing
from api.dashboard import sessions
from api.dashboard.deps import LoggedIn, OwnerChanging, page_context
from api.dashboard.pages import braked_login, client_address, login_page, safe_next
from api.dashboard.render import PageRoute, page
from api.deps import Callers, Pool, RedisDep
from billing.customers import request_customer
from core.errors import Forbidden, InvalidInput, QuiltError
from core.settings import get_api_settings
from tenancy import accounts, login_limit, members

router = APIRouter(prefix="/dashboard", route_class=PageRoute, include_in_schema=False)

HOME = "/dashboard/runs"


def _form_page(request: Request, template: str, status_code: int = 200, **context):
    """A page with a form and no session yet: a fresh double-submit CSRF token."""
    token = sessions.new_csrf_token()
    response = page(request, template, {"csrf_token": token, "signup": get_api_settings().signup, **context},
                    status_code=status_code)
    sessions.set_cookie(response, request, sessions.LOGIN_CSRF_COOKIE, token)
    return response


def _check_csrf(request: Request, given: str) -> None:
    if not sessions.tokens_match(request.cookies.get(sessions.LOGIN_CSRF_COOKIE), given):
        raise Forbidden("missing or wrong CSRF token: reload the page and try again", field="csrf_token")


async def _start_session(request: Request, redis, member_id: str, target: str = HOME) -> RedirectResponse:
    token, _ = await sessions.create(redis, account_id=member_id)  # a fresh token: no session fixation
    response = RedirectResponse(target, status_code=303)
    sessions.set_cookie(response, request, sessions.COOKIE, token)
    sessions.clear_cookie(response, request, sessions.LOGIN_CSRF_COOKIE)
    return response


# ------------------------------------------------------------------------------ sign-up and log in

@router.get("/signup")
async def signup_form(request: Request, invite: str | None = Query(None, max_length=100)):
    """Create an account: with an invitation, in the inviting tenant; without, a new tenant (open sign-up only)."""
    if invite is None and get_api_settings().signup != "open":
        return _form_page(request, "signup.html", status_code=403, invite=None,
                          error="Sign-up is by invitation on this server: ask an owner of your tenant for a link.")
    return _form_page(request, "signup.html", invite=invite)


@router.post("/signup")
async def signup(request: Request, pool: Pool, redis: RedisDep,
                 password: Annotated[str, Form(max_length=members.MAX_PASSWORD)] = "",
                 email: Annotated[str, Form(max_length=254)] = "",
                 tenant: Annotated[str, Form(max_length=64)] = "",
                 invite: Annotated[str, Form(max_length=100)] = "",
                 csrf_token: Annotated[str, Form(max_length=200)] = ""):
    """Create the account and log in. Braked per client address (tenancy.login_limit)."""
    _check_csrf(request, csrf_token)
    try:
        await login_limit.take(redis, "signup", account=None, address=client_address(request))
        password_hash = await members.argon2(members.hash_password, password)
        async with pool.connection() as conn:
            if invite:
                member = await members.accept_invite(conn, invite, password_hash)
            elif get_api_settings().signup == "open":
                if not tenant.strip():
                    raise InvalidInput("tenant: name your tenant (your team or project)", field="tenant")
                member = await members.sign_up(conn, members.check_email(email), password_hash, tenant.strip())
            else:
                raise Forbidden("sign-up is by invitation on this server", field="invite")
            await accounts.record_async(conn, member["tenant_id"], f"account:{member['email']}", "member.joined",
                                        role=member["role"])
    except QuiltError as exc:
        return _form_page(request, "signup.html", status_code=exc.status_code, invite=invite or None,
                          error=exc.message, email=email, tenant=tenant)
    if not invite:
        request_customer(member["tenant_id"])  # a billed tenant's Stripe customer (Celery), after the commit
    return await _start_session(request, redis, member["id"])


@router.post("/login/password")
async def login_password(request: Request, pool: Pool, redis: RedisDep,
                         email: Annotated[str, Form(max_length=254)] = "",
                         password: Annotated[str, Form(max_length=members.MAX_PASSWORD)] = "",
                         csrf_token: Annotated[str, Form(max_length=200)] = "",
                         next: Annotated[str, Form(max_length=2000)] = HOME):
    """Log in with an email and a password. Failures are counted per email and per client address
    (tenancy.login_limit); past the limit the answer is 429 with Retry-After, whatever the password."""
    _check_csrf(request, csrf_token)
    account, address = email.strip().lower(), client_address(request)
    if braked := await braked_login(request, redis, safe_next(next), account=account, address=address):
        return braked
    async with pool.connection() as conn:
        try:
            member = await members.log_in(conn, account, password)
        except QuiltError as exc:  # the attempt stays counted
            return login_page(request, safe_next(next), error=exc.message, status_code=exc.status_code)
    await login_limit.succeeded(redis, account=account, address=address)
    return await _start_session(request, redis, member["id"], safe_next(next))


@router.get("/forgot")
async def forgot_form(request: Request):
    """Ask for a password-reset link."""
    return _form_page(request, "forgot.html")


@router.post("/forgot")
async def forgot(request: Request, pool: Pool, redis: RedisDep, email: Annotated[str, Form(max_length=254)] = "",
                 csrf_token: Annotated[str, Form(max_length=200)] = ""):
    """Send the link (or log it without a mail server); the answer is the same whether or not the address has an account.
    Requests are braked per address and per account (no inbox flooding), apart from logins: they
    never lock an account's owner out."""
    _check_csrf(request, csrf_token)
    account, address = email.strip().lower(), client_address(request)
    await login_limit.take(redis, "reset", account=account, address=address)
    async with pool.connection() as conn:
        token = await members.start_reset(conn, account)
    if token:
        settings = get_api_settings()
        await run_in_threadpool(members.deliver, settings.smtp_url.get_secret_value(), settings.mail_from, account,
                                "Reset your Quilt password", links.link(request, f"/dashboard/reset?token={token}"))
    return _form_page(request, "forgot.html", sent=True)


@router.get("/reset")
async def reset_form(request: Request, token: str = Query("", max_length=100)):
    """Choose a new password."""
    return _form_page(request, "reset.html", token=token)


@router.post("/reset")
async def reset(request: Request, pool: Pool, redis: RedisDep, token: Annotated[str, Form(max_length=100)] = "",
                password: Annotated[str, Form(max_length=members.MAX_PASSWORD)] = "",
                csrf_token: Annotated[str, Form(max_length=200)] = ""):
    """Set the new password (once per link), then log in with it. Every session of the account ends
    and its other reset links stop working. Attempts are braked per client address and per link
    (tenancy.login_limit), before any Argon2 time is spent: past the limit the answer is 429 with
    Retry-After, whatever the token."""
    _check_csrf(request, csrf_token)
    await login_limit.take(redis, "reset-link", account=login_limit.link_prefix(token),
                           address=client_address(request))
    try:
        password_hash = await members.argon2(members.hash_password, password)
        async with pool.connection() as conn:
            accounts_reset = await members.finish_reset(conn, token, password_hash)
    except QuiltError as exc:
        return _form_page(request, "reset.html", status_code=exc.status_code, token=token, error=exc.message)
    for account_id in accounts_reset:
        await sessions.end_account(redis, account_id)
    return RedirectResponse("/dashboard/login?reset=done", status_code=303)


# ------------------------------------------------------------------------------ members

@router.get("/members")
async def members_page(request: Request, viewer: LoggedIn, pool: Pool):
    """Who can log in to this tenant, and (owners) the invitations still open."""
    return await _members_page(request, viewer, pool)


async def _members_page(request: Request, viewer, pool, **extra):
    async with pool.connection() as conn:
        rows = await members.list_members(conn, viewer.who.tenant_id)
        invitations = await members.list_invitations(conn, viewer.who.tenant_id) if viewer.who.is_owner else []
    return page(request, "members.html", page_context(viewer, "members", members=rows, invitations=invitations,
                                                      **extra))


@router.post("/members/invite")
async def invite(request: Request, viewer: OwnerChanging, pool: Pool, redis: RedisDep,
                 email: Annotated[str, Form(max_length=254)] = "",
                 role: Annotated[Literal["owner", "member", "read_only"], Form()] = "member"):
    """Invite someone: the link is mailed (or logged) and shown here once. Braked per inviter and
    per client address (tenancy.login_limit): an owner's session cannot mail-bomb strangers."""
    address = members.check_email(email)
    await login_limit.take(redis, "invite", account=viewer.who.actor, address=client_address(request))
    async with pool.connection() as conn:
        token = await members.new_token(conn, "invite", viewer.who.tenant_id, address, role, viewer.who.actor)
        await accounts.record_async(conn, viewer.who.tenant_id, viewer.who.actor, "member.invited", email=address,
                                    role=role)
    link = links.link(request, f"/dashboard/signup?invite={token}")
    settings = get_api_settings()
    await run_in_threadpool(members.deliver, settings.smtp_url.get_secret_value(), settings.mail_from, address,
                            f"You are invited to {viewer.who.tenant_name} on Quilt", link)
    return await _members_page(request, viewer, pool, invite_link=link, invited=address)


@router.post("/members/invitations/revoke")
async def revoke_invitation(viewer: OwnerChanging, pool: Pool,
                            invitation_id: Annotated[int, Form(ge=1, le=2**63 - 1)] = 0):
    """Revoke an open invitation: its link stops working."""
    async with pool.connection() as conn:
        gone = await members.revoke_invitation(conn, viewer.who.tenant_id, invitation_id)
        await accounts.record_async(conn, viewer.who.tenant_id, viewer.who.actor, "member.invitation_revoked",
                                    email=gone["email"])
    return RedirectResponse("/dashboard/members", status_code=303)


@router.post("/members/remove")
async def remove(viewer: OwnerChanging, pool: Pool, redis: RedisDep, callers: Callers,
                 member_id: Annotated[str, Form(max_length=64)] = ""):
    """Remove a member: the keys they made are revoked and their dashboard sessions end now."""
    async with changing(pool, callers) as conn:
        gone = await members.remove(conn, viewer.who.tenant_id, member_id)
        await accounts.record_async(conn, viewer.who.tenant_id, viewer.who.actor, "member.removed", email=gone["email"],
                                    revoked_keys=gone["revoked_keys"])
    await sessions.end_account(redis, member_id)
    return RedirectResponse("/dashboard/members", status_code=303)
