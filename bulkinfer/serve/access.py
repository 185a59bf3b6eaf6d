"""Access logs: one JSON line per request on the logger ``bulkinfer.serve.access``
(``bulkinfer serve`` writes it to stderr; uvicorn's own access log is off).

A line: ``{"time", "method", "path", "status", "duration_ms", "tenant",
"client"}``: ``time`` ISO 8601 UTC at the response's end, ``path`` without
the query string, ``duration_ms`` from the request's arrival to the
response's last byte, ``tenant`` the tenant's name (a hash of its key in
``bulkinfer serve``, see :func:`bulkinfer.cli.serve_command.tenant_of`; the
key itself never) or null when the request named none, ``client`` the peer's
address. A request that raised logs status 500.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ACCESS_LOGGER = "bulkinfer.serve.access"
TENANT_KEY = "bulkinfer_tenant"  # where the auth dependencies leave the tenant in the request's scope["state"]

log = logging.getLogger(ACCESS_LOGGER)


class AccessLog:
    """ASGI middleware logging each HTTP request of ``app`` (see the module)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state = scope.setdefault("state", {})
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if log.isEnabledFor(logging.INFO):
                line = access_line(scope, status, time.perf_counter() - started, state.get(TENANT_KEY))
                log.info(orjson.dumps(line).decode())


def noted(request: Request, tenant: str) -> str:
    """``tenant``, noted as the request's for its access log line."""
    setattr(request.state, TENANT_KEY, tenant)
    return tenant


def access_line(scope: Scope, status: int, seconds: float, tenant: str | None) -> dict[str, Any]:
    """The access log's record of one request (``scope``: its ASGI scope; ``seconds``: its duration)."""
    client = scope.get("client")
    return {
        "time": iso_now(),
        "method": scope["method"],
        "path": scope["path"],
        "status": status,
        "duration_ms": round(seconds * 1000, 3),
        "tenant": tenant,
        "client": client[0] if client else None,
    }


def iso_now() -> str:
    """Now, ISO 8601 UTC to the millisecond (the ``time`` of every log line)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")
