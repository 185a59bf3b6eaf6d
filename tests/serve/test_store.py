"""The store: a database an earlier bulkinfer wrote opens with the columns that came since."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import openai

from bulkinfer.serve.objects import batch_object, file_object, usage_object
from bulkinfer.serve.store import Store
from bulkinfer.serve.tables import ADDED_COLUMNS, SCHEMA

# A batch as the first release of ``bulkinfer serve`` stored it.
OLD_BATCH = """
INSERT INTO batches (id, tenant, input_file_id, endpoint, completion_window, status, request_counts, created_at)
VALUES ('batch_old', 'alice', 'file-x', '/v1/chat/completions', '24h', 'completed',
        '{"total": 2, "completed": 2, "failed": 0}', 1700000000);
INSERT INTO files VALUES ('file-x', 'alice', 3, 1700000000, 'in.jsonl', 'batch', '/gone/file-x.jsonl');
"""


def test_a_database_of_the_first_release_gains_the_columns_since_and_keeps_its_rows(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "state.sqlite3")
    db.executescript(SCHEMA + OLD_BATCH)  # SCHEMA is the first release's; columns since are ADDED_COLUMNS
    for table, added in ADDED_COLUMNS.items():
        assert not {row[1] for row in db.execute(f"PRAGMA table_info({table})")} & set(added)
    db.close()
    store = Store(tmp_path)
    old = store.batch("alice", "batch_old")
    assert old is not None and (old["model"], old["usage"], old["output_expires_after"]) == (None, None, None)
    old_file = store.file("alice", "file-x")
    assert old_file is not None and old_file["expires_at"] is None  # kept until deleted, as it was
    assert openai.types.FileObject.model_validate(file_object(old_file)).expires_at is None
    assert openai.types.Batch.model_validate(batch_object(old)).request_counts.completed == 2  # type: ignore[union-attr]
    new = store.add_batch("alice", "file-x", "/v1/completions", "24h", None, "tiny")
    store.update(new["id"], usage=usage_object(3, 4))
    found = store.batch("alice", new["id"])
    assert found is not None
    batch = openai.types.Batch.model_validate(batch_object(found))
    assert batch.model == "tiny" and batch.usage is not None and batch.usage.total_tokens == 7
    store.close()
    again = Store(tmp_path)  # opening again adds nothing twice
    assert again.batch("alice", new["id"]) == found
    again.close()


def test_totals_sum_every_tenants_batches_and_prefer_the_running_batchs_throughput(tmp_path: Path) -> None:
    store = Store(tmp_path)
    ids = [store.add_batch(t, "file-x", "/v1/completions", "24h", None, "tiny")["id"] for t in ("a", "b", "a", "b")]
    for batch_id, rate, at in ((ids[0], 10.0, 200), (ids[1], 20.0, 100)):
        store.move(batch_id, ("validating",), "completed", completed_at=at, usage=usage_object(5, 7))
        store.update(batch_id, request_counts={"total": 3, "completed": 2, "failed": 1})
        store.update(batch_id, throughput={"completion_tokens_per_s": rate, "measured": "report"})
    assert store.totals().completion_tokens_per_s == 10.0  # the last completed (completed_at 200)
    store.move(ids[2], ("validating",), "in_progress", request_counts={"total": 9, "completed": 4, "failed": 0})
    store.update(ids[2], throughput={"completion_tokens_per_s": 3.5, "measured": "live"})
    totals = store.totals()
    assert totals.batches == {"completed": 2, "in_progress": 1, "validating": 1}
    assert (totals.completed, totals.failed, totals.prompt_tokens, totals.completion_tokens) == (8, 2, 10, 14)
    assert totals.completion_tokens_per_s == 3.5
    store.close()
