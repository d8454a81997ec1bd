"""One size limit for every request body, however it is sent.

A pure ASGI middleware: it refuses a declared Content-Length over the limit at once, reads a body
sent in chunks only up to the limit, and decompresses a `Content-Encoding: zstd` or `gzip` body
(the tinker SDK zstd-compresses its forward_backward protobufs) while counting the output, so a
small compressed body that expands past the limit is refused after at most `max_bytes` of output.
Every refusal is a 413 naming the limit. The app downstream sees the plain body and no
Content-Encoding.
"""

from __future__ import annotations

import io
import json
import zlib

import zstandard
from starlette.types import Receive, Scope, Send

_CHUNK = 1 << 16


class _TooLarge(Exception):
    pass


class _BadEncoding(Exception):
    pass


def _zstd(body: bytes, limit: int) -> bytes:
    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True)
        while chunk := reader.read(_CHUNK):
            out += chunk
            if len(out) > limit:
                raise _TooLarge()
    except zstandard.ZstdError as exc:
        raise _BadEncoding(f"not valid zstd ({exc})") from None
    return bytes(out)


def _gzip(body: bytes, limit: int) -> bytes:
    out = bytearray()
    inflater = zlib.decompressobj(wbits=47)  # gzip or zlib header, detected
    data = body
    try:
        while data:
            out += inflater.decompress(data, _CHUNK)
            if len(out) > limit:
                raise _TooLarge()
            data = inflater.unconsumed_tail
        out += inflater.flush()
    except zlib.error as exc:
        raise _BadEncoding(f"not valid gzip ({exc})") from None
    if len(out) > limit:
        raise _TooLarge()
    return bytes(out)


_DECODERS = {"zstd": _zstd, "gzip": _gzip, "x-gzip": _gzip, "deflate": _gzip, "identity": None}


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _answer(self, send, status: int, msg: str, field: str) -> None:
        body = json.dumps({"error": msg, "detail": msg, "category": "user", "field": field}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _too_large(self, what: str) -> str:
        return f"request body {what}exceeds the limit of {self.max_bytes} bytes; split the request"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        encodings: list[str] = []
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await self._answer(send, 413, self._too_large(f"of {int(value)} bytes "), "body")
            if name == b"content-encoding":
                encodings += [e.strip().lower() for e in value.decode("latin-1").split(",") if e.strip()]
        unknown = [e for e in encodings if e not in _DECODERS]
        if unknown:
            return await self._answer(send, 415, f"Content-Encoding {unknown[0]!r} is not supported; send zstd, "
                                      "gzip or an uncompressed body", "content-encoding")

        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._answer(send, 413, self._too_large(""), "body")
            more = message.get("more_body", False)
        plain = bytes(body)
        try:
            for encoding in reversed(encodings):  # the last one listed was applied last
                decoder = _DECODERS[encoding]
                if decoder is not None:
                    plain = decoder(plain, self.max_bytes)
        except _TooLarge:
            return await self._answer(send, 413, self._too_large("once decompressed "), "body")
        except _BadEncoding as exc:
            return await self._answer(send, 400, f"body: {exc}", "body")

        if encodings:
            headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(plain)).encode())]}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": plain, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        return await self.app(scope, replay, send)
