"""Checkpoint downloads by signed URL (api.signed_urls): what the tinker SDK's
`get_checkpoint_archive_url` (0.34; gone from 0.38) and `get_external_weights_urls` (with
`save_weights_external`, 0.34 and 0.38) hand their callers, and what `tinker checkpoint download`
fetches.

    GET training_runs/{run}/checkpoints/{kind}/{name}/archive               302 to the adapter as a .tar.gz
    GET training_runs/{run}/checkpoints/{kind}/{name}/external_weights_urls  {"urls": {file: url}, "expires"}
    GET training_runs/{run}/checkpoints/{kind}/{name}/merged                302 to the adapter merged into its
                                                                             base, a Hugging Face model (.tar)
    GET sessions/{session}/trace_export                                     {"status": "ready", "url"} of the
                                                                             session's trace (api.session_trace)
    GET downloads/{token}/{file name}                                         the bytes; no API key

Every kind of checkpoint can be fetched, the caller's own or another tenant's published one (a link
stops working the moment it is unpublished); what is sent is the PEFT adapter directory
(adapter_config.json, adapter_model.safetensors) and Quilt's metadata, never optimizer state, or
for `merged` the base's files with the adapter merged into its weights (checkpoints.adapter_merge), which
needs the base's files on this API's machine.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import time
from datetime import UTC, datetime
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse, Response, StreamingResponse

from api import links, session_trace, signed_urls, signing
from api.dashboard import adapter_archive
from api.deps import Pool, Settings, Who
from api.input_guard import GuardedRoute
from api.routes.runs import split_checkpoint_id
from bases import catalog
from checkpoints import adapter_merge, encryption, storage
from checkpoints.layout import adapter_files
from core import db
from core.errors import InvalidInput, NotFound
from tenancy import scoped

router = APIRouter(route_class=GuardedRoute, tags=["downloads"])


async def _key(request: Request, pool, settings) -> signed_urls.SigningKeys:
    return await signing.server_keys(request.app.state, pool, settings)


def _gone(ckpt: dict) -> NotFound:
    return NotFound(f"the files of checkpoint {ckpt['kind']}/{ckpt['name']} are gone from the checkpoint store",
                    field="checkpoint_id")


@contextlib.contextmanager
def _while_its_files_last(ckpt: dict):
    """A checkpoint deleted after its row was read loses its files under the reader: a 404, as if
    the delete had come first."""
    try:
        yield
    except FileNotFoundError:
        raise _gone(ckpt) from None


async def checkpoint_directory(ckpt: dict) -> Path:
    """A checkpoint's files on this machine (fetched from the checkpoint store when it is not a
    local directory and this API replica has not got them yet), or a 404 saying they are gone."""
    try:
        return await run_in_threadpool(storage.get_store().fetch, ckpt["storage_path"])
    except NotFound:
        raise _gone(ckpt) from None


async def _adapter_files(ckpt: dict) -> list[Path]:
    """The files of the checkpoint's adapter (checkpoints.layout.adapter_files), or a 404."""
    directory = await checkpoint_directory(ckpt)
    with _while_its_files_last(ckpt):
        return adapter_files(directory)


async def adapter_download(ckpt: dict) -> StreamingResponse:
    """The checkpoint's adapter as a streamed .tar.gz (api.dashboard.adapter_archive), or a 404."""
    directory = await checkpoint_directory(ckpt)
    with _while_its_files_last(ckpt):
        return await run_in_threadpool(adapter_archive.adapter_response, ckpt["model_id"], ckpt["name"], directory)


async def _checkpoint(pool, who, run_id: str, checkpoint_id: str) -> dict:
    kind, name = split_checkpoint_id(checkpoint_id)
    async with pool.connection() as conn:
        return await scoped.readable_checkpoint(conn, who, run_id, kind, name, field="checkpoint_id")


def _url(request: Request, key: signed_urls.SigningKeys, grant: signed_urls.Grant, filename: str) -> str:
    return links.link(request, f"/api/v1/downloads/{signed_urls.sign(key, grant)}/{filename}")


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/archive")
async def checkpoint_archive(run_id: str, checkpoint_id: str, request: Request, who: Who, pool: Pool,
                             settings: Settings) -> RedirectResponse:
    """302 to a signed URL of the checkpoint's adapter as a .tar.gz; `Expires` says until when it works."""
    ckpt = await _checkpoint(pool, who, run_id, checkpoint_id)
    await _adapter_files(ckpt)  # refuse now, not when the link is followed
    expires = int(time.time()) + settings.download_url_ttl_s
    grant = signed_urls.Grant(who.tenant_id, ckpt["id"], signed_urls.ARCHIVE, expires, who.key_id)
    url = _url(request, await _key(request, pool, settings), grant, adapter_archive.archive_name(run_id, ckpt["name"]))
    return RedirectResponse(url, status_code=302, headers={"Expires": email.utils.formatdate(expires, usegmt=True),
                                                           "Cache-Control": "no-store"})


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/merged")
async def merged_model(run_id: str, checkpoint_id: str, request: Request, who: Who, pool: Pool,
                       settings: Settings) -> RedirectResponse:
    """302 to a signed URL of a Hugging Face model directory (a .tar): the checkpoint's adapter
    merged into its base's weights, with the base's config and tokenizer. transformers and vLLM
    load it as they load the base."""
    ckpt = await _checkpoint(pool, who, run_id, checkpoint_id)
    await merge_members(pool, ckpt)  # refuse now, not halfway through the download
    expires = int(time.time()) + settings.download_url_ttl_s
    grant = signed_urls.Grant(who.tenant_id, ckpt["id"], signed_urls.MERGED, expires, who.key_id)
    url = _url(request, await _key(request, pool, settings), grant,
               adapter_archive.archive_name(run_id, ckpt["name"], "-merged.tar"))
    return RedirectResponse(url, status_code=302, headers={"Expires": email.utils.formatdate(expires, usegmt=True),
                                                           "Cache-Control": "no-store"})


async def merge_members(pool, ckpt: dict) -> list[adapter_merge.Member]:
    """The merged model's files for a checkpoint of yours (4xx when it cannot be merged)."""
    async with db.autocommit(pool) as conn:
        base = await catalog.get_model(conn, await scoped.model_base(conn, ckpt["tenant_id"], ckpt["model_id"]))
    if base is None or not Path(base.path).is_dir():  # noqa: ASYNC240 - one stat of a local directory
        raise NotFound("this checkpoint's base model is not served here any more; it cannot be merged",
                       field="checkpoint_id")
    directory = await checkpoint_directory(ckpt)
    with _while_its_files_last(ckpt):
        encrypted = encryption.is_encrypted(adapter_files(directory))
    if encrypted:
        raise InvalidInput("this export is encrypted to its recipients: only they can read it, so it cannot be merged "
                           "here; merge it where you decrypt it", field="checkpoint_id")
    try:
        with _while_its_files_last(ckpt):
            return await run_in_threadpool(adapter_merge.merged_members, Path(base.path), directory)
    except ValueError as exc:
        raise InvalidInput(f"this checkpoint cannot be merged into its base: {exc}", field="checkpoint_id") from None


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def external_weights_urls(run_id: str, checkpoint_id: str, request: Request, who: Who, pool: Pool,
                                settings: Settings) -> dict:
    """One signed URL per file of the checkpoint's adapter, keyed by file name, and when they expire."""
    ckpt = await _checkpoint(pool, who, run_id, checkpoint_id)
    files = await _adapter_files(ckpt)
    expires = int(time.time()) + settings.download_url_ttl_s
    key = await _key(request, pool, settings)
    urls = {p.name: _url(request, key, signed_urls.Grant(who.tenant_id, ckpt["id"], p.name, expires, who.key_id), p.name)
            for p in files}
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}


@router.get("/downloads/{token}/{filename}", include_in_schema=False)
async def download(token: str, filename: str, request: Request, pool: Pool, settings: Settings):
    """The file (or archive) a signed URL names, while it is unexpired, its checkpoint lives, the
    key that minted it is not revoked and its tenant is not suspended by an operator."""
    grant = signed_urls.verify(await _key(request, pool, settings), token)
    if grant.file.startswith(signed_urls.TRACE):
        return await _trace_response(pool, grant)
    async with db.autocommit(pool) as conn:
        ckpt = await scoped.download_checkpoint(conn, grant.tenant_id, grant.checkpoint_id, grant.api_key_id)
    if grant.file == signed_urls.MERGED:
        return adapter_archive.merged_response(ckpt["model_id"], ckpt["name"], await merge_members(pool, ckpt))
    if grant.file == signed_urls.ARCHIVE:
        return await adapter_download(ckpt)
    path = next((p for p in await _adapter_files(ckpt) if p.name == grant.file), None)
    if path is None:
        raise NotFound(f"file {grant.file!r} is not part of this checkpoint", field="token")
    with _while_its_files_last(ckpt):
        return await run_in_threadpool(adapter_archive.file_response, path)


@router.get("/sessions/{session_id}/trace_export")
async def trace_export(session_id: str, request: Request, who: Who, pool: Pool, settings: Settings) -> dict:
    """The tinker SDK's `export_session_trace`: a signed URL of your session's trace (Chrome
    trace-event JSON, which Perfetto opens; api.session_trace), built when the link is followed, so
    it shows the session as it is then. At most MAX_TRACE_REQUESTS requests, the latest; the trace
    says when it holds fewer. Only the session's own tenant can export it (404 otherwise)."""
    if len(session_id) > 128 or not session_id.isprintable():
        raise InvalidInput("session_id is at most 128 printable characters", field="session_id")
    async with pool.connection() as conn:
        await scoped.session_requests(conn, who.tenant_id, session_id, 0)  # 404 now, not at the download
    expires = int(time.time()) + settings.download_url_ttl_s
    grant = signed_urls.Grant(who.tenant_id, 0, signed_urls.TRACE + session_id, expires, who.key_id)
    return {"status": "ready", "url": _url(request, await _key(request, pool, settings), grant, f"{session_id}.pftrace"),
            "error": None}


async def _trace_response(pool, grant: signed_urls.Grant) -> Response:
    session_id = grant.file.removeprefix(signed_urls.TRACE)
    async with db.autocommit(pool) as conn:
        await scoped.trace_link_holds(conn, grant.tenant_id, grant.api_key_id)
        rows, more = await scoped.session_requests(conn, grant.tenant_id, session_id, session_trace.MAX_TRACE_REQUESTS)
        now = db.one(await (await conn.execute("SELECT now() AS now")).fetchone())["now"]
    body = json.dumps(session_trace.build_trace(session_id, rows, truncated=more, now=now), separators=(",", ":"))
    return Response(body, media_type="application/json",
                    headers={"Content-Disposition": f'attachment; filename="{session_id}.pftrace"',
                             "Cache-Control": "no-store"})
