"""An account of engine starts, for whoever runs many of them (a test suite, a
benchmark): with ``BULKINFER_ENGINE_STARTS=FILE`` set, every vLLM engine
start appends two JSON lines to ``FILE``: ``{"event": "begin", "id", "pid",
"model", "kind", "at", "for"}`` when it begins and ``{"event": "end", "id",
"seconds", "ok"}`` when it is ready or has failed (a start killed with its
process writes no end). ``for`` is ``$BULKINFER_ENGINE_STARTS_FOR`` (who
asked: the test suite sets the current test's id), else null. Unset (the
normal case), nothing is written.

``make test`` prints the number of model starts and their seconds at the end
(:func:`summary`). Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

ENV = "BULKINFER_ENGINE_STARTS"
FOR_ENV = "BULKINFER_ENGINE_STARTS_FOR"


def _append(path: str, line: dict[str, Any]) -> None:
    # one write of a short line in append mode: lines from several processes do not interleave
    with open(path, "ab") as f:
        f.write(orjson.dumps(line) + b"\n")


@contextmanager
def engine_start(model: str, kind: str) -> Iterator[None]:
    """Records the start of one engine of ``model`` (``kind``: ``"generate"``,
    ``"embed"``, ``"raw vLLM"``...) around the ``with`` body, when
    ``$BULKINFER_ENGINE_STARTS`` is set. Never raises for the account itself
    (an unwritable file is ignored)."""
    path = os.environ.get(ENV)
    if not path:
        yield
        return
    start_id, started = uuid.uuid4().hex, time.monotonic()
    try:
        _append(path, {"event": "begin", "id": start_id, "pid": os.getpid(), "model": model, "kind": kind,
                       "at": time.time(), "for": os.environ.get(FOR_ENV)})  # fmt: skip
    except OSError:
        path = ""
    ok = False
    try:
        yield
        ok = True
    finally:
        if path:
            try:
                _append(path, {"event": "end", "id": start_id, "seconds": time.monotonic() - started, "ok": ok})
            except OSError:
                pass


def summary(path: Path) -> dict[str, Any]:
    """The account in ``path``: ``{"starts": begun, "ready": ended ok, "failed":
    ended not ok, "unfinished": begun and never ended (killed), "seconds": the
    ended starts' seconds summed, "by_kind": {kind: starts}, "by_for": {for:
    starts}}`` (``for`` as recorded; null for a start nobody named)."""
    begins: dict[str, dict[str, Any]] = {}
    ends: dict[str, dict[str, Any]] = {}
    if path.exists():
        for raw in path.read_bytes().splitlines():
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            (begins if line.get("event") == "begin" else ends)[line["id"]] = line
    by_kind: dict[str, int] = {}
    by_for: dict[str | None, int] = {}
    for begin in begins.values():
        by_kind[begin["kind"]] = by_kind.get(begin["kind"], 0) + 1
        by_for[begin.get("for")] = by_for.get(begin.get("for"), 0) + 1
    ended = [ends[i] for i in begins if i in ends]
    return {
        "starts": len(begins),
        "ready": sum(1 for e in ended if e["ok"]),
        "failed": sum(1 for e in ended if not e["ok"]),
        "unfinished": len(begins) - len(ended),
        "seconds": sum(e["seconds"] for e in ended),
        "by_kind": by_kind,
        "by_for": by_for,
    }
