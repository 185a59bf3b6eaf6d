"""Files that expire, as OpenAI's do: an upload's ``expires_after``, a
batch's ``output_expires_after`` (its output and error files), and uploads
of purpose ``batch`` after 30 days when they name none (OpenAI's default;
``bulkinfer serve --batch-file-expiry``). :class:`FileSweeper` deletes the
files past their ``expires_at``.

The policy is OpenAI's object ``{"anchor": "created_at", "seconds": N}``
with 3600 <= N <= 2592000 (``openai.types.file_create_params.ExpiresAfter``,
``openai.types.batch_create_params.OutputExpiresAfter``); an upload sends it
as the form fields ``expires_after[anchor]`` and ``expires_after[seconds]``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import FormData

from bulkinfer.errors import write_reason
from bulkinfer.serve.access import ACCESS_LOGGER, iso_now
from bulkinfer.serve.http import ApiError
from bulkinfer.serve.store import Store, now

MIN_SECONDS = 3600
MAX_SECONDS = 30 * 24 * 3600
BATCH_UPLOAD_SECONDS = MAX_SECONDS  # OpenAI: "files with purpose=batch expire after 30 days" unless told
SWEEP_EVERY_S = 60.0
UPLOAD_FIELDS = ("file", "purpose", "expires_after[anchor]", "expires_after[seconds]")

log = logging.getLogger(ACCESS_LOGGER)


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy: ``seconds`` after the file's creation."""

    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_SECONDS, le=MAX_SECONDS)


def upload_expiry(form: FormData, default: int | None) -> int | None:
    """The seconds after its creation an upload expires: its form's
    ``expires_after[anchor]`` and ``expires_after[seconds]``, else ``default``
    (None: kept until deleted).

    Raises:
        ApiError: 400 naming the field: one of the two without the other, an
            anchor other than ``created_at``, seconds not an integer from
            3600 to 2592000, or a form field OpenAI's upload does not have.
    """
    unknown = sorted(set(form.keys()) - set(UPLOAD_FIELDS))
    if unknown:
        raise ApiError(
            400, f"unknown field {unknown[0]!r}: an upload takes {', '.join(UPLOAD_FIELDS)}", param=unknown[0]
        )
    given = {key: form[f"expires_after[{key}]"] for key in ("anchor", "seconds") if f"expires_after[{key}]" in form}
    if not given:
        return default
    try:
        return ExpiresAfter.model_validate(given).seconds
    except ValidationError as exc:
        error = exc.errors()[0]
        param = f"expires_after[{error['loc'][0]}]"
        raise ApiError(400, f"{param}: {error['msg']}", param=param) from None


class FileSweeper(threading.Thread):
    """Deletes expired files (:meth:`Store.expire_files`) at the start and
    every ``every_s`` seconds in a daemon thread; each deletion is a JSON
    line on the access log (``file_expired``, ``tenant``, ``bytes``,
    ``error`` where the bytes stayed, ``batch_dir_removed`` where its batch's
    directory went with it), and so is a sweep that failed
    (``file_expiry_failed``: the next one tries again)."""

    def __init__(self, store: Store, every_s: float = SWEEP_EVERY_S, clock: Callable[[], int] = now):
        super().__init__(name="bulkinfer-file-expiry", daemon=True)
        self.store, self.every_s, self.clock = store, every_s, clock
        self._closing = threading.Event()

    def sweep(self) -> list[str]:
        """Delete the files expired by now; returns their ids."""
        rows = self.store.expire_files(self.clock())
        for row in rows:
            line = {"time": iso_now(), "file_expired": row["id"], "tenant": row["tenant"], "bytes": row["bytes"]}
            if "unlink_error" in row:
                line["error"] = row["unlink_error"]
            if row.get("batch_dir_removed"):
                line["batch_dir_removed"] = row["batch_dir_removed"]
            if "batch_dir_error" in row:
                line["batch_dir_error"] = row["batch_dir_error"]
            log.info(orjson.dumps(line).decode())
        return [row["id"] for row in rows]

    def run(self) -> None:
        while True:
            try:
                self.sweep()
            except Exception as exc:  # noqa: BLE001 (a locked or full disk: logged, and the next sweep tries again)
                log.info(orjson.dumps({"time": iso_now(), "file_expiry_failed": write_reason(exc)}).decode())
            if self._closing.wait(self.every_s):
                return

    def close(self, timeout: float | None = 5.0) -> None:
        self._closing.set()
        if self.is_alive():
            self.join(timeout)
