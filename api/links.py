"""Where links point and which hosts are answered: from configuration (QUILT_PUBLIC_URL), never
from what a request claims.

A reset or invitation link built from the request's Host header lets an anonymous caller with a
forged Host have a victim mailed a working link to the caller's server; a signed download URL or a
Stripe return URL built the same way leaks or redirects likewise. With a public URL configured
every link is built from it, a request naming another host is refused (health probes excepted:
kubelets address pods by IP), cookies are Secure and responses carry HSTS when it is https.
Without one (embedded mode, a developer's machine) links follow the request, as before.

Forwarded headers (X-Forwarded-For, X-Forwarded-Proto) are believed only from QUILT_TRUSTED_PROXIES
(api.app installs uvicorn's proxy-headers middleware with that list; the servers start with
--no-proxy-headers so no other list applies).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import PlainTextResponse

from core.settings import get_api_settings

# Answered whatever the Host: probes and scrapers address a pod by its IP, and these build no link.
_ANY_HOST_PATHS = ("/api/v1/livez", "/api/v1/readyz", "/api/v1/healthz", "/metrics")
HSTS = "max-age=31536000; includeSubDomains"


def public_base(request: Request) -> str:
    """The URL links start with (no trailing slash)."""
    configured = get_api_settings().public_url
    return configured.rstrip("/") if configured else str(request.base_url).rstrip("/")


def link(request: Request, path: str) -> str:
    """An absolute link to `path` (which starts with '/')."""
    return public_base(request) + path


def secure(request: Request) -> bool:
    """Whether cookies must be Secure: the public URL is https, or the request came over https
    (directly, or through a trusted proxy)."""
    configured = get_api_settings().public_url
    return configured.startswith("https://") or request.url.scheme == "https"


def trusted_proxies() -> list[str]:
    return [p.strip() for p in get_api_settings().trusted_proxies.split(",") if p.strip()]


class PublicHostMiddleware:
    """With a public URL: refuse (421) a request for another host, and add HSTS under https."""

    def __init__(self, app) -> None:
        self.app = app
        public = get_api_settings().public_url
        self.host = urlsplit(public).netloc.lower() if public else None
        self.hsts = public.startswith("https://")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.host is None:
            return await self.app(scope, receive, send)
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
        if host != self.host and not scope["path"].startswith(_ANY_HOST_PATHS):
            response = PlainTextResponse(f"this server answers for {self.host} only", status_code=421)
            return await response(scope, receive, send)
        if not self.hsts:
            return await self.app(scope, receive, send)

        async def with_hsts(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"strict-transport-security", HSTS.encode()))
            await send(message)
        await self.app(scope, receive, with_hsts)
