"""A batch's run published as its files: the output and errors files
registered (purpose ``batch_output``) as its tenant's, and the batch moved
to its final status; a cancelled or expired batch's spools finished first,
then an error for each request not finished (``batch_expired``, as
OpenAI's; ``batch_cancelled``), so every ``custom_id`` is in the output or
the errors file exactly once. :class:`~bulkinfer.serve.worker.BatchWorker`
and the API's cancel both publish: one batch at a time."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from bulkinfer.io.output_files import OutputFiles, RunPaths
from bulkinfer.io.unfinished import add_unfinished_errors
from bulkinfer.serve.objects import published_columns
from bulkinfer.serve.store import Store
from bulkinfer.serve.validate import custom_ids
from bulkinfer.settings import OutputOrder

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."  # OpenAI's
CANCELLED_MESSAGE = "This request was not executed: the batch was cancelled."
# status -> (code, message) of the error of each request a stopped batch did not finish
UNFINISHED = {"expired": ("batch_expired", EXPIRED_MESSAGE), "cancelled": ("batch_cancelled", CANCELLED_MESSAGE)}


class Publisher:
    """Publishes the batches of ``store``; ``output_order``: the order a
    partial output's spools are finished in (``[plan] output_order``)."""

    def __init__(self, store: Store, output_order: OutputOrder):
        self.store, self.output_order = store, output_order
        self._lock = threading.Lock()  # the API's cancel and the worker may both publish one batch

    def input_path(self, batch: dict[str, Any]) -> Path:
        """The batch's input file (a path that does not exist when it was deleted)."""
        row = self.store.file(batch["tenant"], batch["input_file_id"])
        return Path(row["path"]) if row is not None else self.store.files_dir / f"{batch['input_file_id']}.missing"

    def partial(self, batch_id: str, status: str, from_: tuple[str, ...]) -> None:
        """When the batch is in one of ``from_``: publish the spools of its run
        (under the output's lock), and for ``expired`` or ``cancelled`` an
        error for each request of the input not finished (:data:`UNFINISHED`;
        none when the input was deleted); count the lines and tokens
        (``request_counts``: ``completed`` + ``failed`` == ``total`` while the
        input is there), register the files, move it to ``status``.

        Raises:
            OSError: a file cannot be read or written (the batch keeps its status).
        """
        with self._lock:  # the API's cancel and the worker may both publish one batch
            batch = self.store.batch(None, batch_id)
            if batch is None or batch["status"] not in from_:
                return
            out = self.store.batch_dir(batch_id) / "output.jsonl"
            files = OutputFiles(out)
            if status in UNFINISHED:
                out.parent.mkdir(parents=True, exist_ok=True)
            if not out.parent.exists():
                self.store.move(batch_id, from_, status)
                return
            with files.locked():
                if not files.is_complete():
                    for spool in (files.spool, files.errors_spool):
                        spool.touch()
                    files.finish(self.output_order)
                if status in UNFINISHED and self.input_path(batch).exists():
                    requests = custom_ids(self.input_path(batch))
                    add_unfinished_errors(files.out, files.errors, requests, *UNFINISHED[status])
            total = batch["request_counts"]["total"] if batch["request_counts"] else 0
            published = files.published()
            self.store.update(batch_id, **published_columns(published, total or published.completed + published.failed))
            self.register_outputs(batch, RunPaths(out, out), status, from_)

    def register_outputs(self, batch: dict[str, Any], paths: RunPaths, status: str, from_: tuple[str, ...]) -> None:
        """Register the output and errors files (purpose ``batch_output``, to
        expire as the batch's ``output_expires_after`` says) as the batch's
        tenant's files, then move it to ``status``."""
        ids: dict[str, Any] = {}
        for key, path in (("output_file_id", paths.output), ("error_file_id", paths.errors)):
            if path.exists() and path.stat().st_size > 0:
                name = f"{batch['id']}_{'output' if key == 'output_file_id' else 'error'}.jsonl"
                expiry = batch["output_expires_after"]
                ids[key] = self.store.register_file(batch["tenant"], name, "batch_output", path, None, expiry)["id"]
        self.store.move(batch["id"], from_, status, **ids)
