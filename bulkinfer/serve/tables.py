"""The server's SQLite tables (:class:`bulkinfer.serve.store.Store` keeps
them): their schema, the columns added since the first release, the batch
statuses, and the queries the store runs over them."""

from __future__ import annotations

# The tables as the first release created them; columns added since are ADDED_COLUMNS.
SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,
    filename TEXT NOT NULL, purpose TEXT NOT NULL, path TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, status TEXT NOT NULL, errors TEXT,
    output_file_id TEXT, error_file_id TEXT, request_counts TEXT NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER, in_progress_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER
);
CREATE TABLE IF NOT EXISTS webhook_events (
    id TEXT PRIMARY KEY, batch_id TEXT NOT NULL, type TEXT NOT NULL, url TEXT NOT NULL, created_at INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, next_at REAL NOT NULL, delivered_at INTEGER, gave_up_at INTEGER,
    last_error TEXT, UNIQUE (batch_id, type)
);
"""

# Columns that came after the first release, by table, with their types: the store
# adds each one a database lacks (one an earlier bulkinfer wrote) when it opens.
# ``files.expires_at``: Unix s, or NULL (kept until deleted); ``batches.output_expires_after``:
# seconds after their creation the batch's output and error files expire, or NULL.
ADDED_COLUMNS = {
    "batches": {"model": "TEXT", "usage": "TEXT", "throughput": "TEXT", "output_expires_after": "INTEGER"},
    "files": {"expires_at": "INTEGER"},
}
# A batch in one of these still reads its input file (the expiry of that file waits for it).
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
# Columns of ``batches`` holding JSON text.
# ``throughput``: {"completion_tokens_per_s", "measured": "live" | "report"} (see serve.progress).
JSON_COLUMNS = ("metadata", "errors", "request_counts", "usage", "throughput")
TIMESTAMPS = (
    "created_at",
    "expires_at",
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
TOTALS_SQL = """
SELECT COALESCE(SUM(json_extract(request_counts, '$.completed')), 0),
       COALESCE(SUM(json_extract(request_counts, '$.failed')), 0),
       COALESCE(SUM(json_extract(usage, '$.input_tokens')), 0),
       COALESCE(SUM(json_extract(usage, '$.output_tokens')), 0)
FROM batches
"""
# The running batch's throughput, else the last completed batch's.
LATEST_THROUGHPUT_SQL = """
SELECT throughput FROM batches
WHERE throughput IS NOT NULL AND status IN ('in_progress', 'completed')
ORDER BY status = 'in_progress' DESC, completed_at DESC, seq DESC LIMIT 1
"""
# A batch's final statuses -> the type of its webhook event (OpenAI's batch event types).
EVENT_TYPES = {
    "completed": "batch.completed",
    "failed": "batch.failed",
    "expired": "batch.expired",
    "cancelled": "batch.cancelled",
}
WINDOWS_S = {"24h": 24 * 3600}  # completion_window -> seconds (OpenAI accepts only "24h")
STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
