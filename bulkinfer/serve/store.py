"""The server's state: files and batches in one SQLite database (WAL mode),
the bytes of files under ``DATA/files/``, each batch's run under
``DATA/batches/BATCH_ID/``.

Layout of ``DATA`` (the ``--data-dir``)::

    state.sqlite3            tables ``files``, ``batches`` and ``webhook_events``
                             (below; tables and columns that came later are added
                             to an older database at open)
    files/FILE_ID.jsonl      an uploaded file, written atomically
    batches/BATCH_ID/        the run's output, errors, report, spools, journal

One connection, guarded by a lock, serves the API's threads and the worker
thread. Every status change is a conditional update (:meth:`Store.move`), so
a cancel and the worker never both win. With a webhook URL, the change to a
final status writes its event (``webhook_events``, an outbox) in the same
transaction, so no restart loses one; :mod:`bulkinfer.serve.webhooks`
delivers it and records the delivery.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bulkinfer.serve.tables import (
    ADDED_COLUMNS,
    EVENT_TYPES,
    JSON_COLUMNS,
    LATEST_THROUGHPUT_SQL,
    SCHEMA,
    STATUSES,
    TIMESTAMPS,
    TOTALS_SQL,
    UNFINISHED,
    WINDOWS_S,
)


@dataclass(frozen=True, slots=True)
class Totals:
    """Every tenant's batches summed (see :meth:`Store.totals`): ``batches``:
    status -> how many; requests (rows) ``completed`` and ``failed`` (running
    batches' live counts included); ``prompt_tokens`` and
    ``completion_tokens`` of the batches with a ``usage`` (completed or
    cancelled); ``completion_tokens_per_s``: the running batch's (live), else
    the last completed one's (its report), else 0; ``files``: purpose ->
    (files, bytes) stored, every tenant's."""

    batches: dict[str, int]
    completed: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    completion_tokens_per_s: float
    files: dict[str, tuple[int, int]]


class FileTooLarge(Exception):
    """An upload passed ``max_bytes``; nothing was kept."""


def now() -> int:
    """Unix time, whole seconds (OpenAI's ``*_at`` fields)."""
    return int(time.time())


class Store:
    """Files and batches of every tenant under ``data_dir`` (created)."""

    def __init__(self, data_dir: Path, webhook_url: str | None = None):
        """``webhook_url``: where the events of batches that end from now on
        go (recorded with each event); None records none."""
        self.data_dir = data_dir
        self.webhook_url = webhook_url
        self.event_added = threading.Event()  # set after an event is recorded (the sender waits on it)
        self.files_dir = data_dir / "files"
        self.batches_dir = data_dir / "batches"
        for path in (self.files_dir, self.batches_dir):
            path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(data_dir / "state.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        self._add_columns()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _add_columns(self) -> None:
        """``ALTER TABLE ... ADD COLUMN`` each of :data:`ADDED_COLUMNS` a table lacks (NULL in existing rows)."""
        with self._tx() as db:
            for table, columns in ADDED_COLUMNS.items():
                have = {row["name"] for row in db.execute(f"PRAGMA table_info({table})")}
                for column, type_ in columns.items():
                    if column not in have:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {type_}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # files

    def save_file(
        self,
        tenant: str,
        filename: str,
        purpose: str,
        chunks: Iterable[bytes],
        max_bytes: int,
        expires_after: int | None = None,
    ) -> dict[str, Any]:
        """Write ``chunks`` to a new file (a temporary beside it, then
        ``os.replace``) and register it, to expire ``expires_after`` seconds
        after its creation (None: kept until deleted); returns its row.

        Raises:
            FileTooLarge: more than ``max_bytes`` bytes came (the temporary is removed).
        """
        file_id = f"file-{secrets.token_hex(12)}"
        path = self.files_dir / f"{file_id}.jsonl"
        tmp = path.with_name(f".{path.name}.tmp")
        size = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise FileTooLarge(f"the file is over the limit of {max_bytes} bytes")
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return self.register_file(tenant, filename, purpose, path, file_id, expires_after)

    def register_file(
        self,
        tenant: str,
        filename: str,
        purpose: str,
        path: Path,
        file_id: str | None = None,
        expires_after: int | None = None,
    ) -> dict[str, Any]:
        """Register an existing file ``path`` (a batch's output) as ``tenant``'s,
        to expire ``expires_after`` seconds after now (None: kept until
        deleted); returns its row (the row it has already, when ``path`` is
        registered: a server killed while finalizing registers its outputs again)."""
        with self._lock:
            known = self._db.execute("SELECT * FROM files WHERE path = ?", (str(path),)).fetchone()
        if known is not None:
            return dict(known)
        created = now()
        row = {
            "id": file_id or f"file-{secrets.token_hex(12)}",
            "tenant": tenant,
            "bytes": path.stat().st_size,
            "created_at": created,
            "filename": filename,
            "purpose": purpose,
            "path": str(path),
            "expires_at": None if expires_after is None else created + expires_after,
        }
        with self._tx() as db:
            db.execute(f"INSERT INTO files ({', '.join(row)}) VALUES ({', '.join(':' + c for c in row)})", row)
        return row

    def file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        """``tenant``'s file ``file_id``, or None (another tenant's too)."""
        with self._lock:
            found = self._db.execute("SELECT * FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).fetchone()
        return dict(found) if found else None

    def files(
        self,
        tenant: str,
        purpose: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        newest_first: bool = True,
    ) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` (None: all) of ``tenant``'s files of ``purpose``
        (None: any), newest first unless ``newest_first`` is False, those
        listed after the file ``after`` (an id: OpenAI's cursor) when given;
        and whether more follow."""
        sql, args = "SELECT * FROM files WHERE tenant = ?", [tenant]
        if purpose is not None:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        if after is not None:
            beyond = "<" if newest_first else ">"
            sql += f" AND (created_at, rowid) {beyond} (SELECT created_at, rowid FROM files WHERE id = ?)"
            args.append(after)
        order = "DESC" if newest_first else "ASC"
        sql += f" ORDER BY created_at {order}, rowid {order} LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, [*args, -1 if limit is None else limit + 1]).fetchall()
        return [dict(r) for r in rows[:limit]], limit is not None and len(rows) > limit

    def expire_files(self, at: int) -> list[dict[str, Any]]:
        """Delete (rows, then bytes) every tenant's files whose ``expires_at``
        is ``at`` (Unix s) or earlier, but for the input files of batches
        still :data:`UNFINISHED` (they go once the batch ends), and the
        directories of batches left with no file (:meth:`drop_batch_dir`);
        returns their rows, with ``unlink_error`` where the bytes could not be
        removed, ``batch_dir_removed`` (a batch id or None) and
        ``batch_dir_error``."""
        marks = ", ".join("?" for _ in UNFINISHED)
        due = (
            "FROM files WHERE expires_at IS NOT NULL AND expires_at <= ? AND id NOT IN "
            f"(SELECT input_file_id FROM batches WHERE status IN ({marks}))"
        )
        with self._tx() as db:
            rows = [dict(r) for r in db.execute(f"SELECT * {due} ORDER BY expires_at", [at, *UNFINISHED])]
            db.execute(f"DELETE {due}", [at, *UNFINISHED])
        for row in rows:
            try:
                Path(row["path"]).unlink(missing_ok=True)
            except OSError as exc:  # the row is gone: the bytes stay, and the caller says so
                row["unlink_error"] = str(exc)
        for row in rows:
            try:
                row["batch_dir_removed"] = self.drop_batch_dir(Path(row["path"]))
            except OSError as exc:
                row["batch_dir_error"] = str(exc)
        return rows

    def drop_batch_dir(self, path: Path) -> str | None:
        """Remove the directory of the batch whose output or errors file was
        ``path`` (its report, log and journal, ~150 KB a batch) once that
        batch has ended and no file of it is left (expired or deleted), so a
        server kept running does not fill its disk; returns the batch id
        removed (None: ``path`` is no batch's, or it stays).

        Raises:
            OSError: the directory could not be removed.
        """
        directory = path.parent
        if directory.parent != self.batches_dir or not directory.is_dir():
            return None
        prefix = f"{directory}{os.sep}"
        with self._lock:
            status = self._db.execute("SELECT status FROM batches WHERE id = ?", (directory.name,)).fetchone()
            left = self._db.execute(
                "SELECT COUNT(*) FROM files WHERE substr(path, 1, ?) = ?", (len(prefix), prefix)
            ).fetchone()[0]
        if status is None or status[0] in UNFINISHED or left:
            return None
        shutil.rmtree(directory)
        return directory.name

    def delete_file(self, tenant: str, file_id: str) -> bool:
        """Remove ``tenant``'s file (row and bytes); False when it has none by that id."""
        found = self.file(tenant, file_id)
        if found is None:
            return False
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        Path(found["path"]).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # its batch's report stays; the sweeper's next expiry tries no more
            self.drop_batch_dir(Path(found["path"]))
        return True

    # batches

    def add_batch(
        self,
        tenant: str,
        input_file_id: str,
        endpoint: str,
        window: str,
        metadata: dict[str, str] | None,
        model: str | None = None,
        output_expires_after: int | None = None,
    ) -> dict[str, Any]:
        """A new batch, ``validating``, to run on ``model`` (the served model's
        id), its output and error files to expire ``output_expires_after``
        seconds after their creation (None: kept until deleted); returns its row."""
        created = now()
        row: dict[str, Any] = {
            "id": f"batch_{secrets.token_hex(12)}",
            "tenant": tenant,
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": window,
            "metadata": json.dumps(metadata) if metadata is not None else None,
            "status": "validating",
            "request_counts": json.dumps({"total": 0, "completed": 0, "failed": 0}),
            "created_at": created,
            "expires_at": created + WINDOWS_S[window],
            "model": model or None,
            "output_expires_after": output_expires_after,
        }
        columns = ", ".join(row)
        with self._tx() as db:
            db.execute(f"INSERT INTO batches ({columns}) VALUES ({', '.join(':' + c for c in row)})", row)
        found = self.batch(tenant, row["id"])
        assert found is not None
        return found

    def batch(self, tenant: str | None, batch_id: str) -> dict[str, Any] | None:
        """The batch ``batch_id`` of ``tenant`` (any tenant's for None), JSON columns decoded."""
        sql, args = "SELECT * FROM batches WHERE id = ?", [batch_id]
        if tenant is not None:
            sql, args = sql + " AND tenant = ?", [*args, tenant]
        with self._lock:
            found = self._db.execute(sql, args).fetchone()
        return _decoded(found) if found else None

    def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` of ``tenant``'s batches, newest first, those
        created before ``after`` (a batch id) when given; and whether more follow."""
        sql, args = "SELECT * FROM batches WHERE tenant = ?", [tenant]
        if after is not None:
            sql, args = sql + " AND seq < (SELECT seq FROM batches WHERE id = ?)", [*args, after]
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY seq DESC LIMIT ?", [*args, limit + 1]).fetchall()
        return [_decoded(r) for r in rows[:limit]], len(rows) > limit

    def by_status(self, *statuses: str) -> list[dict[str, Any]]:
        """Every tenant's batches in one of ``statuses``, oldest first (FIFO)."""
        marks = ", ".join("?" for _ in statuses)
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq", statuses)
            return [_decoded(r) for r in rows]

    def move(self, batch_id: str, from_statuses: tuple[str, ...], status: str, **fields: Any) -> bool:
        """Set ``status`` (and its ``STATUS_at`` timestamp, and ``fields``:
        JSON columns given as data) when the batch is in one of
        ``from_statuses``; False when it is not (someone else moved it)."""
        stamp = {f"{status}_at": now()} if f"{status}_at" in TIMESTAMPS else {}
        return self._set(batch_id, from_statuses, {"status": status, **stamp, **fields})

    def _set(self, batch_id: str, from_statuses: tuple[str, ...], fields: dict[str, Any]) -> bool:
        values = {k: json.dumps(v) if k in JSON_COLUMNS else v for k, v in fields.items()}
        sets = ", ".join(f"{k} = ?" for k in values)
        marks = ", ".join("?" for _ in from_statuses)
        event = EVENT_TYPES.get(fields.get("status", "")) if self.webhook_url else None
        with self._tx() as db:
            cursor = db.execute(
                f"UPDATE batches SET {sets} WHERE id = ? AND status IN ({marks})",
                [*values.values(), batch_id, *from_statuses],
            )
            moved = cursor.rowcount == 1
            if moved and event is not None:
                db.execute(
                    "INSERT OR IGNORE INTO webhook_events (id, batch_id, type, url, created_at, next_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (f"evt_{secrets.token_hex(12)}", batch_id, event, self.webhook_url, now(), time.time()),
                )
        if moved and event is not None:
            self.event_added.set()
        return moved

    def update(self, batch_id: str, **fields: Any) -> None:
        """Set ``fields`` whatever the status (live ``request_counts``)."""
        self._set(batch_id, STATUSES, fields)

    def totals(self) -> Totals:
        """Every tenant's batches and files summed in SQL (one scan of ``batches``, one of ``files``)."""
        with self._lock:
            batches = dict(self._db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall())
            sums = self._db.execute(TOTALS_SQL).fetchone()
            latest = self._db.execute(LATEST_THROUGHPUT_SQL).fetchone()
            files = self._db.execute("SELECT purpose, COUNT(*), SUM(bytes) FROM files GROUP BY purpose").fetchall()
        completed, failed, prompt_tokens, completion_tokens = (int(n) for n in sums)
        rate = float(json.loads(latest[0])["completion_tokens_per_s"]) if latest else 0.0
        stored = {purpose: (int(count), int(size)) for purpose, count, size in files}
        return Totals(batches, completed, failed, prompt_tokens, completion_tokens, rate, stored)

    # webhook events

    def due_events(self, at: float) -> list[dict[str, Any]]:
        """Events neither delivered nor given up whose next attempt is due at ``at`` (Unix s), oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM webhook_events WHERE delivered_at IS NULL AND gave_up_at IS NULL AND next_at <= ? "
                "ORDER BY next_at, created_at",
                (at,),
            )
            return [dict(r) for r in rows]

    def next_event_at(self) -> float | None:
        """When the next pending event is due (Unix s), or None."""
        with self._lock:
            row = self._db.execute(
                "SELECT MIN(next_at) FROM webhook_events WHERE delivered_at IS NULL AND gave_up_at IS NULL"
            ).fetchone()
        return row[0]

    def event(self, event_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM webhook_events WHERE id = ?", (event_id,)).fetchone()
        return dict(row) if row is not None else None

    def event_attempted(self, event_id: str, delivered: bool, error: str | None, next_at: float | None) -> None:
        """Record one delivery attempt: ``delivered`` (a 2xx answer), else
        ``error`` and the next attempt's time (None: no more attempts)."""
        with self._tx() as db:
            db.execute(
                "UPDATE webhook_events SET attempts = attempts + 1, last_error = ?, next_at = COALESCE(?, next_at), "
                "delivered_at = CASE WHEN ? THEN ? END, gave_up_at = CASE WHEN ? THEN ? END WHERE id = ?",
                (error, next_at, delivered, now(), not delivered and next_at is None, now(), event_id),
            )

    def batch_dir(self, batch_id: str) -> Path:
        """Where the run of ``batch_id`` writes."""
        return self.batches_dir / batch_id


def _decoded(row: sqlite3.Row) -> dict[str, Any]:
    data = dict(row)
    for key in JSON_COLUMNS:
        if data[key] is not None:
            data[key] = json.loads(data[key])
    return data
