"""Input rows -> validated :class:`Request` objects, or :class:`RowError` records.

Two row shapes are accepted (both may appear in one file):

- bulkinfer rows: ``id`` (optional; kept as a string, default the 1-based line
  or row number), ``prompt`` (text sent as is) or ``messages`` (an OpenAI chat,
  rendered with the model's chat template), and optionally every field that
  shapes a completion (:data:`SAMPLING_FIELDS`: ``max_tokens``,
  ``temperature``, ``top_p``, ``seed``, ``stop``, ``ignore_eos``, ``n``,
  the penalties, ``top_k``, ``min_p``, ``min_tokens``, ``stop_token_ids``,
  ``logit_bias``, ``logprobs``/``top_logprobs``, ``priority``,
  ``response_format``, ``structured_outputs``); every other field passes
  through to the output untouched (and is counted: :func:`passthrough_fields`).
- OpenAI Batch API request lines (https://platform.openai.com/docs/api-reference/batch/request-input):
  ``custom_id``, ``method``, ``url`` (``/v1/chat/completions`` or
  ``/v1/completions``; a ``/v1/embeddings`` line is an error record that
  says to run it with ``bulkinfer embed``) and ``body`` with ``messages`` or ``prompt`` and the
  same fields (``max_completion_tokens`` is read as ``max_tokens``;
  completions take ``logprobs: k``). A body field outside these and the
  harmless metadata (:data:`HARMLESS_BODY_FIELDS`) is an
  ``unsupported_field`` error: never ignored.

Ranges follow OpenAI's API reference and vLLM's ``SamplingParams``
(:data:`bulkinfer.checks.REQUEST_FIELDS`); an out-of-range value is an
``invalid_field`` error naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bulkinfer.checks import MAX_TOP_LOGPROBS, REQUEST_FIELDS, SEED_RANGE, schema_problem, structured_problem
from bulkinfer.config import SamplingDefaults, Settings
from bulkinfer.schema import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, Request, RowInvalid

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# The fields of a request that shape its completion (rows, OpenAI bodies).
SAMPLING_FIELDS = frozenset(
    {"max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos", "logprobs", "response_format"}
    | {"structured_outputs"}
    | set(REQUEST_FIELDS)
)
CONSUMED_FIELDS = frozenset({"id", "prompt", "messages"} | SAMPLING_FIELDS)
# OpenAI body fields read (besides the sampling ones), by endpoint; and fields
# that do not change the output, accepted and not used (``stream`` only when false).
BODY_FIELDS = {
    CHAT_URL: frozenset({"messages", "max_completion_tokens"} | SAMPLING_FIELDS),
    COMPLETIONS_URL: frozenset({"prompt"} | SAMPLING_FIELDS) - {"top_logprobs"},
}
HARMLESS_BODY_FIELDS = frozenset(
    {"model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "stream"}
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def field_error(name: str, expected: str, value: Any, row_id: str | None, openai: bool) -> RowInvalid:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return RowInvalid("invalid_field", f"field '{name}': expected {expected}, got {shown}", row_id, openai)


def _text_content(content: Any) -> str | None:
    """A message's content as text: a string, or OpenAI text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def _parse_messages(value: Any, row_id: str | None, openai: bool) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise field_error("messages", "a non-empty list of {role, content} objects", value, row_id, openai)
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise field_error(f"messages[{i}]", "an object with role and content", message, row_id, openai)
        role = message.get("role")
        if role not in ROLES:
            raise field_error(f"messages[{i}].role", f"one of {', '.join(sorted(ROLES))}", role, row_id, openai)
        text = _text_content(message.get("content"))
        if text is None:
            raise field_error(
                f"messages[{i}].content", "a string or a list of text parts", message.get("content"), row_id, openai
            )
        messages.append({**message, "content": text})
    return messages


def _sampling(source: dict[str, Any], defaults: SamplingDefaults, row_id: str | None, kind: str) -> dict[str, Any]:
    """The request's sampling fields (Request keyword arguments), defaults
    filled in; ``kind``: ``"row"`` (a bulkinfer row) or the OpenAI line's ``url``."""
    openai = kind != "row"
    max_tokens_field = "max_tokens"
    max_tokens = source.get("max_tokens")
    if max_tokens is None and openai and source.get("max_completion_tokens") is not None:
        max_tokens_field, max_tokens = "max_completion_tokens", source["max_completion_tokens"]
    if max_tokens is None:
        max_tokens = defaults.max_tokens
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise field_error(max_tokens_field, "an integer >= 1", max_tokens, row_id, openai)
    temperature = source.get("temperature")
    if temperature is None:
        temperature = defaults.temperature
    elif not _is_number(temperature) or not 0 <= temperature <= 2:
        raise field_error("temperature", "a number in [0, 2]", temperature, row_id, openai)
    top_p = source.get("top_p")
    if top_p is None:
        top_p = defaults.top_p
    elif not _is_number(top_p) or not 0 < top_p <= 1:
        raise field_error("top_p", "a number in (0, 1]", top_p, row_id, openai)
    seed = source.get("seed")
    if seed is None:
        seed = defaults.seed
    elif not _is_int(seed) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise field_error("seed", "an integer in [0, 2**63)", seed, row_id, openai)
    stop = source.get("stop")
    if stop is None:
        stop_t = defaults.stop
    elif isinstance(stop, str):
        stop_t = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop_t = tuple(stop)
    else:
        raise field_error("stop", "a string or a list of strings", stop, row_id, openai)
    ignore_eos = source.get("ignore_eos")
    if ignore_eos is None:
        ignore_eos = defaults.ignore_eos
    elif not isinstance(ignore_eos, bool):
        raise field_error("ignore_eos", "true or false", ignore_eos, row_id, openai)
    options: dict[str, Any] = {}
    for name, (ok, expected) in REQUEST_FIELDS.items():
        if name in ("top_logprobs", "priority"):
            continue
        value = source.get(name)
        if value is None:
            value = getattr(defaults, name)
        elif not ok(value):
            raise field_error(name, expected, value, row_id, openai)
        options[name] = value
    if options["min_tokens"] > max_tokens:
        raise field_error(
            "min_tokens", f"an integer <= max_tokens ({max_tokens})", options["min_tokens"], row_id, openai
        )
    options["stop_token_ids"] = list(options["stop_token_ids"]) or None
    bias = options.pop("logit_bias")
    options["logit_bias"] = {int(k): float(v) for k, v in bias.items()} if bias else None
    options["logprobs"] = _logprobs(source, defaults, kind, row_id)
    priority = source.get("priority")
    if priority is None:
        priority = defaults.priority
    elif not REQUEST_FIELDS["priority"][0](priority):
        raise field_error("priority", REQUEST_FIELDS["priority"][1], priority, row_id, openai)
    return {
        "max_tokens": max_tokens,
        "temperature": float(temperature),
        "top_p": float(top_p),
        "seed": seed,
        "stop": stop_t,
        "ignore_eos": ignore_eos,
        "options": options,
        "structured": _structured(source, defaults, row_id, openai),
        "priority": priority,
    }


def _logprobs(source: dict[str, Any], defaults: SamplingDefaults, kind: str, row_id: str | None) -> int | None:
    """The top alternatives to return per completion token (vLLM's
    ``SamplingParams.logprobs``), or None for no log-probabilities.

    OpenAI chat (and bulkinfer rows): ``logprobs: true`` with an optional
    ``top_logprobs: k`` (0 when absent); OpenAI completions: ``logprobs: k``.
    A bulkinfer row may also give ``logprobs: k`` directly."""
    openai = kind != "row"
    logprobs, top = source.get("logprobs"), source.get("top_logprobs")
    ok, expected = REQUEST_FIELDS["top_logprobs"]
    if kind == COMPLETIONS_URL or (kind == "row" and _is_int(logprobs)):
        if logprobs is None:
            return defaults.logprobs
        if not ok(logprobs):
            raise field_error("logprobs", expected, logprobs, row_id, openai)
        return int(logprobs)
    if top is not None and logprobs is not True:
        raise field_error("top_logprobs", "used with logprobs: true", top, row_id, openai)
    if logprobs is None:
        return defaults.logprobs
    if logprobs is False:
        return None
    if logprobs is not True:
        expected_lp = "true or false" if openai else f"true, false or an integer in [0, {MAX_TOP_LOGPROBS}]"
        raise field_error("logprobs", expected_lp, logprobs, row_id, openai)
    if top is None:
        return 0
    if not ok(top):
        raise field_error("top_logprobs", expected, top, row_id, openai)
    return int(top)


def _structured(
    source: dict[str, Any], defaults: SamplingDefaults, row_id: str | None, openai: bool
) -> dict[str, Any] | None:
    """vLLM ``StructuredOutputsParams`` arguments from OpenAI's
    ``response_format`` (``text``: none; ``json_object``; ``json_schema``:
    its ``schema``, enforced by the grammar whether ``strict`` or not) or
    vLLM's own ``structured_outputs`` object; else the ``[sampling]`` default."""
    response_format, structured = source.get("response_format"), source.get("structured_outputs")
    if response_format is not None and structured is not None:
        raise RowInvalid("invalid_row", "give 'response_format' or 'structured_outputs', not both", row_id, openai)
    if structured is not None:
        problem = structured_problem(structured)
        if problem:
            raise RowInvalid("invalid_field", f"field 'structured_outputs': {problem}", row_id, openai)
        return dict(structured)
    if response_format is None:
        return dict(defaults.structured_outputs) if defaults.structured_outputs else None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise field_error(
            "response_format", "{type: text | json_object | json_schema}", response_format, row_id, openai
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise field_error("response_format.json_schema", "an object with a schema", spec, row_id, openai)
    if not isinstance(spec.get("strict", False), bool | None):
        raise field_error("response_format.json_schema.strict", "true or false", spec["strict"], row_id, openai)
    schema = spec.get("schema")
    if schema is None:  # OpenAI: the schema is optional; none is any JSON object
        return {"json_object": True}
    problem = schema_problem(schema)
    if problem:
        raise RowInvalid("invalid_field", f"field 'response_format.json_schema.schema': {problem}", row_id, openai)
    return {"json": schema}


def row_id_of(data: dict[str, Any], line: int) -> str:
    """A bulkinfer row's ``id`` as a string: the field (a non-empty string or
    an integer), else the 1-based line or row number ``line``.

    Raises:
        RowInvalid: ``id`` of another type.
    """
    raw_id = data.get("id")
    if raw_id is None:
        return str(line)
    if isinstance(raw_id, str) and raw_id:
        return raw_id
    if _is_int(raw_id):
        return str(raw_id)
    raise field_error("id", "a non-empty string or an integer", raw_id, None, False)


def parse_row(data: Any, seq: int, line: int, defaults: SamplingDefaults) -> Request:
    """Validate one decoded row and build its :class:`Request`.

    Args:
        data: the decoded JSON value or Parquet row (a dict when valid).
        seq: 0-based arrival position; line: 1-based line or row number.
        defaults: sampling values for fields the row does not set.

    Raises:
        RowInvalid: the row is not an object, lacks ``prompt``/``messages``, or
            a field has the wrong type or range; the message names the field.
    """
    if not isinstance(data, dict):
        raise RowInvalid("invalid_row", f"expected a JSON object, got {type(data).__name__}")
    openai = "custom_id" in data and "body" in data
    if openai:
        return _parse_openai(data, seq, line, defaults)
    row_id = row_id_of(data, line)
    prompt, messages = data.get("prompt"), data.get("messages")
    if prompt is not None and messages is not None:
        raise RowInvalid("invalid_row", "row has both 'prompt' and 'messages'; give one", row_id)
    if prompt is None and messages is None:
        raise RowInvalid("missing_field", "row needs a 'prompt' (string) or 'messages' (chat) field", row_id)
    if messages is not None:
        messages = _parse_messages(messages, row_id, False)
    elif not isinstance(prompt, str) or not prompt:
        raise field_error("prompt", "a non-empty string", prompt, row_id, False)
    passthrough = {k: v for k, v in data.items() if k not in CONSUMED_FIELDS}
    return Request(
        seq=seq,
        line=line,
        id=row_id,
        prompt=prompt,
        messages=messages,
        passthrough=passthrough,
        **_sampling(data, defaults, row_id, "row"),
    )


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
    if not isinstance(body, dict):
        raise field_error("body", "an object", body, custom_id, True)
    for name in body:
        if name in endpoints[url] or (
            name in HARMLESS_BODY_FIELDS and (name != "stream" or body[name] in (None, False))
        ):
            continue
        why = (
            "streaming is not supported: each line gets one whole response"
            if name == "stream"
            else ("bulkinfer does not implement it, and it would change the output")
        )
        raise RowInvalid(
            "unsupported_field", f"field 'body.{name}' is not supported: {why}; the row was not run", custom_id, True
        )
    return custom_id, url, body


def _parse_openai(data: dict[str, Any], seq: int, line: int, defaults: SamplingDefaults) -> Request:
    custom_id, url, body = openai_line(data, BODY_FIELDS, {EMBEDDINGS_URL: "bulkinfer embed"})
    prompt, messages = None, None
    if url == CHAT_URL:
        if body.get("messages") is None:
            raise RowInvalid(
                "missing_field", "field 'body.messages' is required for /v1/chat/completions", custom_id, True
            )
        messages = _parse_messages(body["messages"], custom_id, True)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise field_error("body.prompt", "a non-empty string", prompt, custom_id, True)
    return Request(
        seq=seq,
        line=line,
        id=custom_id,
        prompt=prompt,
        messages=messages,
        openai_url=url,
        **_sampling(body, defaults, custom_id, url),
        passthrough={"model": body["model"]} if isinstance(body.get("model"), str) else {},
    )


def to_request(data: Any, seq: int, line: int, settings: Settings) -> Request:
    """:func:`~bulkinfer.prep.rows.parse_row` with the run's settings applied: with
    ``apply_chat_template`` a ``prompt`` becomes a one-message user chat
    (except on OpenAI ``/v1/completions`` lines).

    Raises:
        RowInvalid: as parse_row.
    """
    if not isinstance(settings.apply_chat_template, bool):
        raise ValueError('apply_chat_template "auto" must be resolved first (Settings.resolve_chat_template)')
    request = parse_row(data, seq, line, settings.sampling)
    if settings.apply_chat_template and request.prompt is not None and request.openai_url != COMPLETIONS_URL:
        request.messages, request.prompt = [{"role": "user", "content": request.prompt}], None
    return request


def passthrough_fields(counts: Mapping[str, int]) -> list[dict[str, Any]]:
    """The pass-through fields of bulkinfer rows, most common first: each
    ``name``, the ``rows`` that carry it, and ``did_you_mean``: the field
    bulkinfer reads that the name nearly spells (``max_token`` ->
    ``max_tokens``; :func:`difflib.get_close_matches`, cutoff 0.8), else None.
    A near miss changes nothing in the output: the field is copied, not read."""
    import difflib

    known = sorted(CONSUMED_FIELDS)
    return [
        {"name": name, "rows": rows, "did_you_mean": next(iter(difflib.get_close_matches(name, known, 1, 0.8)), None)}
        for name, rows in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    ]
