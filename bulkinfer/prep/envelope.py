"""The envelope of an OpenAI Batch API request line
(https://platform.openai.com/docs/api-reference/batch/request-input):
``custom_id``, ``method``, ``url`` and ``body``, shared by the rows of
``run`` (:mod:`bulkinfer.prep.rows`), ``embed``
(:mod:`bulkinfer.prep.embeddings`) and ``score``
(:mod:`bulkinfer.prep.scores`), each with its endpoints' body fields.

A body field an endpoint does not read is an ``unsupported_field`` error,
never ignored, unless it is harmless metadata
(:data:`bulkinfer.prep.unapplied.HARMLESS`) or asks for nothing (null, or
what bulkinfer does anyway: :func:`bulkinfer.prep.unapplied.not_asked`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bulkinfer.fields import shown
from bulkinfer.prep.unapplied import HARMLESS, not_asked
from bulkinfer.schema import CHAT_URL, RowInvalid


def field_error(name: str, expected: str, value: Any, row_id: str | None, openai: bool) -> RowInvalid:
    """An ``invalid_field`` error: field ``name`` was ``value``, not ``expected``."""
    return RowInvalid("invalid_field", f"field '{name}': expected {expected}, got {shown(value)}", row_id, openai)


def is_openai_line(data: dict[str, Any], content: tuple[str, ...]) -> bool:
    """Whether the object ``data`` is an OpenAI batch line: ``custom_id`` with
    a ``body``, or with a ``url`` and none of the job's bulkinfer row fields
    ``content`` (a line whose ``body`` is missing is then told so, rather than
    asked for a ``prompt``; a dataset row with ``custom_id`` and ``url``
    columns and a prompt stays a row)."""
    if "custom_id" not in data:
        return False
    return "body" in data or ("url" in data and not any(data.get(name) is not None for name in content))


def openai_line(
    data: dict[str, Any], endpoints: Mapping[str, frozenset[str]], elsewhere: Mapping[str, str]
) -> tuple[str, str, dict[str, Any]]:
    """The ``custom_id``, ``url`` and ``body`` of an OpenAI batch line, its
    envelope checked: ``url`` one of ``endpoints`` (url -> the body fields
    read), ``method`` POST, every body field read or harmless. A ``url`` of
    ``elsewhere`` (url -> the bulkinfer command that runs it) is an error
    that names that command.

    Raises:
        RowInvalid: the message names the field.
    """
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise field_error("custom_id", "a non-empty string", custom_id, None, True)
    url = data.get("url", CHAT_URL)
    if not isinstance(url, str):
        raise field_error("url", " or ".join(endpoints), url, custom_id, True)
    if url in elsewhere:
        raise RowInvalid(
            "invalid_field",
            f"field 'url': {url} lines are run by `{elsewhere[url]}`, not here ({', '.join(endpoints)}); "
            "the row was not run",
            custom_id,
            True,
        )
    if url not in endpoints:
        raise field_error("url", " or ".join(endpoints), url, custom_id, True)
    method = data.get("method", "POST")
    if method != "POST":
        raise field_error("method", "POST", method, custom_id, True)
    body = data.get("body")
    if body is None:
        message = "field 'body' is required: an OpenAI batch line carries its request there; the row was not run"
        raise RowInvalid("missing_field", message, custom_id, True)
    if not isinstance(body, dict):
        raise field_error("body", "an object", body, custom_id, True)
    for name, value in body.items():
        if name in endpoints[url] or name in HARMLESS or not_asked(name, value):
            continue
        elsewhere_read = [other for other, names in endpoints.items() if name in names]
        if name == "stream":
            why = "streaming is not supported: each line gets one whole response"
        elif elsewhere_read:
            why = f"it is read in {' and '.join(elsewhere_read)} lines, and this line's url is {url}"
        else:
            why = "bulkinfer does not implement it, and it would change the output"
        raise RowInvalid(
            "unsupported_field", f"field 'body.{name}' is not supported: {why}; the row was not run", custom_id, True
        )
    return custom_id, url, body
