"""The OpenAI objects the API returns, built from the store's rows: field
names exactly as OpenAI's (``openai.types.FileObject``, ``openai.types.Batch``)."""

from __future__ import annotations

from typing import Any

from bulkinfer.io.output_files import Published
from bulkinfer.report.model import as_run_report
from bulkinfer.serve.progress import report_throughput
from bulkinfer.serve.tables import TIMESTAMPS


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``File`` object of a ``files`` row."""
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": row.get("expires_at"),
    }


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``Batch`` object of a ``batches`` row (``errors`` as a list object or null;
    ``usage`` null until the batch is completed or cancelled, ``model`` null for
    a batch an earlier bulkinfer created)."""
    errors = row["errors"]
    return {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        **{key: row[key] for key in TIMESTAMPS},
        "request_counts": row["request_counts"],
        "metadata": row["metadata"],
        "model": row["model"],
        "usage": row["usage"],
    }


def usage_object(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """OpenAI's ``BatchUsage`` of a batch whose completed requests took
    ``prompt_tokens`` (input) and ``completion_tokens`` (output). Cached
    prompt tokens and reasoning tokens are not counted by bulkinfer's runs: 0."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: ``data``, ``first_id``, ``last_id``, ``has_more``."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error response body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def finished_columns(report: dict[str, Any]) -> dict[str, Any]:
    """The columns a finished run's report gives its batch: OpenAI's
    ``request_counts`` (``total``: the requests, ``completed`` + ``failed``;
    the report's ``total`` also counts the blank lines skipped) and ``usage``
    (the report's ``tokens``: the completed rows', resumed ones included),
    and ``throughput``.

    Raises:
        InputFileError: ``report`` is no run report (the batch fails).
    """
    typed = as_run_report(report)
    counts, tokens = typed.request_counts, typed.tokens
    completed, failed = counts.completed, counts.failed
    return {
        "request_counts": {"total": completed + failed, "completed": completed, "failed": failed},
        "usage": usage_object(tokens.prompt, tokens.completion),
        "throughput": report_throughput(typed),
    }


def published_columns(published: Published, total: int) -> dict[str, Any]:
    """``request_counts`` and ``usage`` of a published output and errors
    (a cancelled batch's: its run wrote no report)."""
    return {
        "request_counts": {"total": total, "completed": published.completed, "failed": published.failed},
        "usage": usage_object(published.prompt_tokens, published.completion_tokens),
    }
