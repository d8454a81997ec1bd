"""Refuse request bodies over the configured size before they are read into memory."""

from __future__ import annotations

import json


class BodyLimitMiddleware:
    """Pure ASGI middleware: checks Content-Length, and counts streamed bytes for chunked bodies."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send, size_hint: str) -> None:
        msg = f"request body {size_hint}exceeds the limit of {self.max_bytes} bytes; split the request"
        body = json.dumps({"error": msg, "detail": msg, "category": "user", "field": "body"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await self._reject(send, f"of {int(value)} bytes ")
        seen = 0
        too_big = False

        async def counting_receive():
            nonlocal seen, too_big
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    too_big = True
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await self._reject(send, "")


class _BodyTooLarge(Exception):
    pass
