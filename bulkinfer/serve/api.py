"""OpenAI's Files and Batch API as a FastAPI app over a :class:`Store` and
a :class:`Runner` (the worker), and the online ``/v1/chat/completions`` and
``/v1/completions`` (or, for an embedding model, ``/v1/embeddings``) on the
worker's engine (:mod:`bulkinfer.serve.online`).

Every ``/v1`` route wants ``Authorization: Bearer KEY``; the key names the
tenant, who sees only its own files and batches (another tenant's id is a
404, as an unknown one). With no keys configured, any bearer is the tenant
``"default"`` (``bulkinfer serve`` allows that on 127.0.0.1 only). Errors are
OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Outside ``/v1``, without a key: ``GET /health``, and ``GET /metrics``
(Prometheus, :mod:`bulkinfer.serve.prometheus`: no tenant or id in it).
The status page for people, ``GET /``, and the files it links to take a
key by HTTP Basic too (:mod:`bulkinfer.serve.pages`). Each request is
logged as a JSON line (:mod:`bulkinfer.serve.access`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, BinaryIO

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.routing import Match, Route

from bulkinfer.errors import disk_full, os_reason
from bulkinfer.jobs.online import GENERATION_URLS
from bulkinfer.serve.access import AccessLog
from bulkinfer.serve.http import ApiError, Tenant, found, not_found, not_json
from bulkinfer.serve.objects import batch_object, error_body, file_object, list_object
from bulkinfer.serve.online import online_router
from bulkinfer.serve.pages import pages_router
from bulkinfer.serve.prometheus import OnlineMetrics, metrics_registry
from bulkinfer.serve.retention import BATCH_UPLOAD_SECONDS, ExpiresAfter, upload_expiry
from bulkinfer.serve.store import FileTooLarge, Store
from bulkinfer.serve.tables import WINDOWS_S
from bulkinfer.serve.worker import Runner

ENDPOINTS = GENERATION_URLS  # a generative model's batch endpoints (the default)
# OpenAI's metadata limits (the openai SDK's BatchCreateParams.metadata): pairs, key and value characters
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
CHUNK_BYTES = 1 << 20
MULTIPART_SLACK_BYTES = 64 * 1024  # boundaries and part headers around the file in a multipart body


@dataclass(frozen=True, slots=True)
class Limits:
    """``max_file_bytes``: the largest upload (OpenAI's 200 MB for batch input);
    ``max_online``: online requests in flight at once (one more gets 429);
    ``batch_beside_online`` / ``prefill_beside_online``: batch rows the
    engine runs while an online request is in flight (the others sit out its
    steps, see :mod:`bulkinfer.engine.online_first`), and prompt tokens of
    those admitted waiting for prefill (None: no bound; see
    :class:`~bulkinfer.engine.mux.EngineMux`); ``batch_file_expiry``: the
    seconds after which an upload that names no ``expires_after`` expires
    (OpenAI's 30 days; None: kept until deleted)."""

    max_file_bytes: int = 200 * 1024 * 1024
    max_online: int = 64
    batch_beside_online: int | None = None
    prefill_beside_online: int | None = None
    batch_file_expiry: int | None = BATCH_UPLOAD_SECONDS


class BatchCreate(BaseModel):
    """The body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None


def create_app(
    store: Store,
    keys: Mapping[str, str],
    runner: Runner,
    limits: Limits | None = None,
    model: str = "",
    endpoints: tuple[str, ...] = ENDPOINTS,
) -> FastAPI:
    """The app. ``keys``: API key -> tenant (empty: any bearer is
    ``"default"``); ``runner`` gets each new batch and each cancel;
    ``model``: the id ``GET /v1/models`` lists; ``endpoints``: the batch
    endpoints its model serves (an embedding model's: ``/v1/embeddings``)."""
    app = FastAPI(title="bulkinfer serve", docs_url=None, redoc_url=None)
    app.state.keys = dict(keys)
    app.add_middleware(AccessLog)
    limits = limits or Limits()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(OSError)
    @app.exception_handler(sqlite3.Error)
    async def _unstored(request: Request, exc: Exception) -> JSONResponse:
        """The data directory cannot be written (a full disk: 507, else 500), in OpenAI's error shape."""
        reason = os_reason(exc) if isinstance(exc, OSError) else f"{exc} ({type(exc).__name__})"
        full = disk_full(exc)
        return JSONResponse(
            error_body(f"the server could not store its data: {reason}", "server_error",
                       "insufficient_storage" if full else None),
            status_code=507 if full else 500,
        )  # fmt: skip

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            why = first.get("ctx", {}).get("error", first.get("msg", ""))
            return JSONResponse(error_body(not_json(why), "invalid_request_error"), status_code=400)
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(
            error_body(f"{param}: {first.get('msg', 'invalid request')}", "invalid_request_error", None, param),
            status_code=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's errors (an unknown route: 404, as OpenAI's ``Invalid URL (GET /path)``;
        a wrong method: 405, with ``Allow``; a page's own) in OpenAI's error shape."""
        headers = exc.headers
        if exc.status_code == 405:  # Starlette's Allow names only the first route of the path
            headers = {**(exc.headers or {}), "Allow": ", ".join(_allowed(request))}
        return JSONResponse(error_body(_http_message(request, exc), "invalid_request_error"), exc.status_code, headers)

    @app.get("/health")
    def health() -> JSONResponse:
        """``{"status": "ready"}`` (200), or ``starting`` / ``failed`` (503): the engine's state."""
        status = runner.health
        return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)

    registry = metrics_registry(store)
    app.include_router(pages_router(store, model))
    app.include_router(online_router(runner, limits.max_online, OnlineMetrics(registry, model)))

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    served_model = {"id": model, "object": "model", "created": 0, "owned_by": "bulkinfer"}

    @app.get("/v1/models")
    def models(who: Tenant) -> dict[str, Any]:
        return {"object": "list", "data": [served_model]}

    @app.get("/v1/models/{model_id}")
    def get_model(model_id: str, who: Tenant) -> dict[str, Any]:
        if model_id != model:
            raise ApiError(404, f"The model '{model_id}' does not exist: this server serves '{model}'",
                           code="model_not_found", param="model")  # fmt: skip
        return served_model

    @app.post("/v1/files")
    async def create_file(request: Request, who: Tenant) -> dict[str, Any]:
        form = await _upload_form(request, limits.max_file_bytes)
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "a multipart field 'file' is required", param="file")
            if purpose != "batch":
                raise ApiError(400, "purpose must be 'batch'", param="purpose")
            expiry = upload_expiry(form, limits.batch_file_expiry)
            name, chunks = upload.filename or "upload.jsonl", _chunks(upload.file)
            row = await run_in_threadpool(store.save_file, who, name, purpose, chunks, limits.max_file_bytes, expiry)
        except FileTooLarge:
            raise _too_large(limits.max_file_bytes) from None
        finally:
            await form.close()
        return file_object(row)

    @app.get("/v1/files")
    def list_files(
        who: Tenant, purpose: str | None = None, after: str | None = None, limit: int = 10000, order: str = "desc"
    ) -> dict[str, Any]:
        if not 1 <= limit <= 10000:
            raise ApiError(400, "limit must be between 1 and 10000", param="limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, "order must be 'asc' or 'desc'", param="order")
        rows, has_more = store.files(who, purpose, after, limit, newest_first=order == "desc")
        return list_object([file_object(r) for r in rows], has_more)

    lookups: dict[str, Callable[[str, str], dict[str, Any] | None]] = {"file": store.file, "batch": store.batch}

    def own(what: str, who: str, id_: str) -> dict[str, Any]:
        """Tenant ``who``'s ``what`` (file, batch) ``id_``; ApiError 404 when it is none of theirs."""
        return found(lookups[what](who, id_), what, id_)

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str, who: Tenant) -> dict[str, Any]:
        return file_object(own("file", who, file_id))

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, who: Tenant) -> FileResponse:
        return FileResponse(own("file", who, file_id)["path"], media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, who: Tenant) -> dict[str, Any]:
        if not store.delete_file(who, file_id):
            raise not_found("file", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    def create_batch(body: BatchCreate, who: Tenant) -> dict[str, Any]:
        if body.endpoint not in endpoints:
            served = ", ".join(endpoints)
            raise ApiError(400, f"endpoint must be one of {served}: what this server's model serves", param="endpoint")
        if body.completion_window not in WINDOWS_S:
            raise ApiError(400, "completion_window must be '24h'", param="completion_window")
        _check_metadata(body.metadata)
        file = store.file(who, body.input_file_id)
        if file is None:
            raise ApiError(404, f"No such file: '{body.input_file_id}'", code="not_found", param="input_file_id")
        if file["purpose"] != "batch":
            raise ApiError(400, "the input file's purpose must be 'batch'", param="input_file_id")
        expiry = body.output_expires_after.seconds if body.output_expires_after else None
        window, metadata = body.completion_window, body.metadata
        row = store.add_batch(who, body.input_file_id, body.endpoint, window, metadata, model, expiry)
        runner.submit(row["id"])
        return batch_object(row)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str, who: Tenant) -> dict[str, Any]:
        return batch_object(own("batch", who, batch_id))

    @app.get("/v1/batches")
    def list_batches(who: Tenant, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit must be between 1 and 100", param="limit")
        rows, has_more = store.batches(who, after, limit)
        return list_object([batch_object(r) for r in rows], has_more)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, who: Tenant) -> dict[str, Any]:
        row = own("batch", who, batch_id)
        if row["status"] not in ("cancelling", "cancelled"):
            if not store.move(batch_id, ("validating", "in_progress"), "cancelling"):
                raise ApiError(400, f"Cannot cancel a batch with status '{row['status']}'", param="batch_id")
            runner.cancel(batch_id)
        return batch_object(own("batch", who, batch_id))

    return app


async def _upload_form(request: Request, max_bytes: int) -> FormData:
    """The multipart form of an upload, parsed as its bytes arrive (a file
    part goes to a temporary file: memory holds at most 1 MB of it).

    Raises:
        ApiError: 413 once the body passes ``max_bytes`` plus the multipart
            framing (declared by ``Content-Length`` or counted while
            streaming: the rest is not read); 400 when it is not multipart.
    """
    if int(request.headers.get("content-length") or 0) > max_bytes + MULTIPART_SLACK_BYTES:
        raise _too_large(max_bytes)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, "the upload must be multipart/form-data with a 'file' and a 'purpose'", param="file")

    async def counted() -> AsyncGenerator[bytes, None]:
        seen = 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > max_bytes + MULTIPART_SLACK_BYTES:
                raise FileTooLarge(f"the upload passed {max_bytes} bytes")
            yield chunk

    try:
        return await MultiPartParser(request.headers, counted(), max_files=1, max_fields=8).parse()
    except FileTooLarge:
        raise _too_large(max_bytes) from None
    except MultiPartException as exc:
        raise ApiError(400, exc.message, param="file") from None


def _allowed(request: Request) -> list[str]:
    """Every method some route of ``request``'s path takes (a path may have a
    route per method: ``GET`` and ``POST /v1/batches``)."""
    methods: set[str] = set()
    for route in request.app.routes:
        if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods
    return sorted(methods)


def _http_message(request: Request, exc: StarletteHTTPException) -> str:
    """The message of a Starlette error: its own detail, or for routing's bare
    404 and 405 what was asked (OpenAI's words for a 404)."""
    if exc.detail != HTTPStatus(exc.status_code).phrase:
        return str(exc.detail)
    asked = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return f"Invalid URL ({asked})"
    if exc.status_code == 405:
        return f"Method not allowed ({asked}); the Allow header names the methods this URL takes"
    return str(exc.detail)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """Raises ApiError 400 (``param`` ``metadata``) when ``metadata`` passes
    OpenAI's limits: :data:`METADATA_PAIRS` pairs, keys of at most
    :data:`METADATA_KEY_CHARS` characters, values of at most :data:`METADATA_VALUE_CHARS`."""
    if metadata is None:
        return
    if len(metadata) > METADATA_PAIRS:
        raise ApiError(400, f"metadata holds at most {METADATA_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise ApiError(400, f"metadata keys are at most {METADATA_KEY_CHARS} characters: "
                           f"'{key[:20]}...' has {len(key)}", param="metadata")  # fmt: skip
        if len(value) > METADATA_VALUE_CHARS:
            raise ApiError(400, f"metadata values are at most {METADATA_VALUE_CHARS} characters: "
                           f"the value of '{key}' has {len(value)}", param="metadata")  # fmt: skip


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(CHUNK_BYTES):
        yield chunk


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the file is larger than the limit of {max_bytes} bytes", code="file_too_large", param="file")
