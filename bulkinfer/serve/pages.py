"""The status page for people, at ``/``: the tenant's latest batches with
their status, a progress bar, request counts, completion tokens/s and links
to each batch's output, errors and HTML report (the routes below). It
reloads itself every :data:`REFRESH_S` seconds; no JavaScript.

A browser cannot send a bearer key, so these routes take HTTP Basic too:
any user name, the API key as password (a request without a known key gets
401 and ``WWW-Authenticate: Basic realm="bulkinfer"``, so the browser asks).
``Authorization: Bearer KEY`` works as for the API. With no key configured
(127.0.0.1 only) nothing is asked and the tenant is ``"default"``. Another
tenant's batch is a 404, as an unknown one.

- ``GET /``: the page (:data:`PAGE_BATCHES` newest batches);
- ``GET /batches/{id}/output``, ``GET /batches/{id}/errors``: the batch's
  output and errors files (JSONL, shown as text);
- ``GET /batches/{id}/report``: the run's HTML report (``output.report.html``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse
from jinja2 import Environment, PackageLoader

from bulkinfer.serve.access import noted
from bulkinfer.serve.auth import DEFAULT_TENANT, header_key, key_tenant
from bulkinfer.serve.store import Store

PAGE_BATCHES = 100
REFRESH_S = 5
REALM = "bulkinfer"
TEXT = "text/plain; charset=utf-8"
# How a batch's completion tokens/s was measured (see bulkinfer.serve.progress), as the page says it.
MEASURED = {
    "running": "live: completion tokens of the rows finished since the engine was ready, over the seconds since",
    "report": "the run's report: completion tokens over the generation seconds",
    "ran": "measured live while it ran",
}

templates = Environment(loader=PackageLoader("bulkinfer.serve", "templates"), autoescape=True)


@dataclass(frozen=True, slots=True)
class BatchView:
    """One batch as the page shows it: request counts, completion tokens/s
    (None when never measured) and how (a key of :data:`MEASURED`), and
    ``links``: (label, relative URL) of the files it has."""

    id: str
    endpoint: str
    status: str
    created: str
    total: int
    completed: int
    failed: int
    tokens_per_s: float | None
    measured: str
    links: tuple[tuple[str, str], ...]

    @property
    def finished(self) -> int:
        return self.completed + self.failed


def batch_view(row: dict[str, Any], has_report: bool, kept: Callable[[str], bool]) -> BatchView:
    """The :class:`BatchView` of a ``batches`` row (``has_report``: its run's
    HTML report exists; ``kept``: whether a file id is still there, neither
    deleted nor expired: only those are linked)."""
    counts, throughput = row["request_counts"], row["throughput"] or {}
    measured = throughput.get("measured", "")
    if measured == "live":
        measured = "running" if row["status"] == "in_progress" else "ran"
    output, errors = (row[key] is not None and kept(row[key]) for key in ("output_file_id", "error_file_id"))
    files = (("output", output), ("errors", errors), ("report", has_report))
    return BatchView(
        id=row["id"],
        endpoint=row["endpoint"],
        status=row["status"],
        created=datetime.fromtimestamp(row["created_at"], UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        total=counts["total"],
        completed=counts["completed"],
        failed=counts["failed"],
        tokens_per_s=throughput.get("completion_tokens_per_s"),
        measured=measured,
        links=tuple((label, f"batches/{row['id']}/{label}") for label, there in files if there),
    )


def viewer(request: Request) -> str:
    """The tenant of a page request: its key by HTTP Basic (the password) or
    Bearer; ``"default"`` when no key is configured.

    Raises:
        HTTPException: 401 with ``WWW-Authenticate: Basic realm="bulkinfer"``,
            no key or an unknown one.
    """
    keys: dict[str, str] = request.app.state.keys
    if not keys:
        return noted(request, DEFAULT_TENANT)
    key = header_key(request.headers.get("authorization", ""), ("basic", "bearer"))
    found = key_tenant(keys, key) if key is not None else None
    if found is None:
        raise HTTPException(
            401, "an API key is needed: as the password (any user name)", {"WWW-Authenticate": f'Basic realm="{REALM}"'}
        )
    return noted(request, found)


Viewer = Annotated[str, Depends(viewer)]


def pages_router(store: Store, model: str) -> APIRouter:
    """The page's routes over ``store``; ``model``: the served model's id, shown on the page."""
    router = APIRouter()

    def own_batch(who: str, batch_id: str) -> dict[str, Any]:
        row = store.batch(who, batch_id)
        if row is None:
            raise HTTPException(404, f"No such batch: '{batch_id}'")
        return row

    def report_html(batch_id: str) -> Path:
        return store.batch_dir(batch_id) / "output.report.html"

    def batch_file(who: str, batch_id: str, column: str) -> FileResponse:
        file_id = own_batch(who, batch_id)[column]
        row = store.file(who, file_id) if file_id else None
        if row is None:
            raise HTTPException(404, f"batch '{batch_id}' has no such file (yet)")
        return FileResponse(row["path"], media_type=TEXT)

    @router.get("/", response_class=HTMLResponse)
    def status_page(who: Viewer) -> HTMLResponse:
        rows, more = store.batches(who, None, PAGE_BATCHES)

        def kept(file_id: str) -> bool:
            return store.file(who, file_id) is not None

        views = [batch_view(row, report_html(row["id"]).exists(), kept) for row in rows]
        page = templates.get_template("status.html").render(
            tenant=who, model=model, batches=views, more=more, refresh_s=REFRESH_S, measured=MEASURED
        )
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @router.get("/batches/{batch_id}/output")
    def batch_output(batch_id: str, who: Viewer) -> FileResponse:
        return batch_file(who, batch_id, "output_file_id")

    @router.get("/batches/{batch_id}/errors")
    def batch_errors(batch_id: str, who: Viewer) -> FileResponse:
        return batch_file(who, batch_id, "error_file_id")

    @router.get("/batches/{batch_id}/report")
    def batch_report(batch_id: str, who: Viewer) -> FileResponse:
        path = report_html(own_batch(who, batch_id)["id"])
        if not path.exists():
            raise HTTPException(404, f"batch '{batch_id}' has no report (yet)")
        return FileResponse(path, media_type="text/html; charset=utf-8")

    return router
