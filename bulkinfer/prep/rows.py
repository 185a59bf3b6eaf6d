"""Input rows -> validated :class:`Request` objects in windows, or :class:`RowError` records.

Two row shapes are accepted (both may appear in one file):

- bulkinfer rows: ``id`` (optional; kept as a string, default the 1-based line
  or row number), ``prompt`` (text, or token ids sent as they are) or ``messages`` (an OpenAI chat,
  rendered with the model's chat template), and optionally every field that
  shapes a completion (:data:`SAMPLING_FIELDS`); every other field passes
  through to the output untouched (and is counted:
  :meth:`bulkinfer.prep.planner.Planner.passthrough_fields`), except a
  request parameter of OpenAI's or vLLM's that bulkinfer does not apply
  (:data:`bulkinfer.prep.unapplied.GENERATION`): an ``unsupported_field`` error.
- OpenAI Batch API request lines (https://platform.openai.com/docs/api-reference/batch/request-input):
  ``custom_id``, ``method``, ``url`` (``/v1/chat/completions`` or
  ``/v1/completions``; a ``/v1/embeddings`` line is an error record that
  says to run it with ``bulkinfer embed``) and ``body`` with ``messages`` or ``prompt`` and the
  same fields (but ``top_logprobs`` and ``max_completion_tokens`` on
  ``/v1/completions``; completions take ``logprobs: k``). A body field outside these and the
  harmless metadata (:data:`bulkinfer.prep.unapplied.HARMLESS`) is an
  ``unsupported_field`` error: never ignored.

Which fields each shape reads, their ranges (OpenAI's API reference and
vLLM's ``SamplingParams``) and where they go in vLLM are one table,
:data:`bulkinfer.fields.FIELDS`; an out-of-range value is an
``invalid_field`` error naming the field. ``max_completion_tokens`` (OpenAI's
newer name) is read as ``max_tokens``; given both, they must agree.

:func:`bulkinfer.prep.windows.iter_windows` cuts a file's rows into windows
of valid requests, parsed here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bulkinfer.checks import pair_problem
from bulkinfer.config import SamplingDefaults, Settings
from bulkinfer.fields import (
    CHAT,
    COMPLETIONS,
    CONFIG,
    FIELDS,
    MAX_TOP_LOGPROBS,
    ROW,
    InputPath,
    RequestField,
    fields_of,
    integral,
    is_int,
    schema_problem,
)
from bulkinfer.prep.chat_template import TEMPLATE_FIELDS, needs_template, template_kwargs
from bulkinfer.prep.envelope import field_error, is_openai_line, openai_line
from bulkinfer.prep.unapplied import GENERATION, check_unapplied
from bulkinfer.schema import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, Request, RowInvalid

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# The fields of a bulkinfer row that shape its completion (bulkinfer.fields.FIELDS).
SAMPLING_FIELDS = fields_of(ROW)
CONSUMED_FIELDS = frozenset({"id", "prompt", "messages", *TEMPLATE_FIELDS} | SAMPLING_FIELDS)
# The fields of a bulkinfer row that parse_row reads: those it uses and those it refuses.
ROW_FIELDS_READ = CONSUMED_FIELDS | set(GENERATION)
# OpenAI body fields read, by endpoint (bulkinfer.fields.FIELDS); the others
# but the harmless ones (bulkinfer.prep.unapplied.HARMLESS) are refused.
BODY_FIELDS = {
    CHAT_URL: frozenset({"messages", *TEMPLATE_FIELDS} | fields_of(CHAT)),
    COMPLETIONS_URL: frozenset({"prompt"} | fields_of(COMPLETIONS)),
}
# The fields that are Request attributes of their own; the other SamplingParams
# arguments go to Request.options.
_REQUEST_ATTRIBUTES = frozenset(f.name for f in dataclasses.fields(Request)) & set(FIELDS)
# The fields taken as they are: the row's value, checked, else the [sampling]
# default. max_tokens, logprobs and the structured outputs have rules of their own.
_PLAIN = tuple(
    name
    for name, f in FIELDS.items()
    if f.accepts(CONFIG) and f.target != "structured" and name not in ("max_tokens", "logprobs")
)


def checked(field: RequestField, value: Any, row_id: str | None, openai: bool, name: str | None = None) -> Any:
    """``value``, when it is valid as ``field`` (its range in the table of
    request fields); an integer field's integral float as the int (``8.0`` -> 8,
    :func:`bulkinfer.fields.integral`).

    Raises:
        RowInvalid: ``invalid_field``, naming the field (as ``name``, when given).
    """
    name = name or field.name
    if field.type == "integer":
        value = integral(value)
    elif field.type == "array of integers" and isinstance(value, list | tuple):
        value = [integral(v) for v in value]
    problem = field.problem(value) if field.problem is not None else None
    if problem:
        raise RowInvalid("invalid_field", f"field '{name}': {problem}", row_id, openai)
    if not field.valid(value):
        raise field_error(name, field.expected, value, row_id, openai)
    return value


# The content parts vLLM 0.32 reads as text (vllm/renderers/chat_utils.py,
# TEXT_PART_TYPES and MM_PARSER_MAP): type -> the key that holds the text.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
_CONTENT = "a string or a list of text parts (" + ", ".join(TEXT_PARTS) + "; text models: no media)"


def _text_content(content: Any, role: str) -> str | None:
    """A message's content as text, as vLLM's chat API reads it for a
    template that takes string content (``_parse_chat_message_content``):
    a string; content parts (strings, or parts of :data:`TEXT_PARTS`) joined
    with ``"\n"``; an assistant's null content (its ``tool_calls`` carry the
    turn) ``""``. None when the content is none of these."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        text = part if isinstance(part, str) else part.get(key) if key is not None else None
        if not isinstance(text, str):
            return None
        texts.append(text)
    return "\n".join(texts)


def _parse_messages(value: Any, row_id: str | None, openai: bool) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise field_error("messages", "a non-empty list of {role, content} objects", value, row_id, openai)
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise field_error(f"messages[{i}]", "an object with role and content", message, row_id, openai)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise field_error(f"messages[{i}].role", f"one of {', '.join(sorted(ROLES))}", role, row_id, openai)
        text = _text_content(message.get("content"), role)
        if text is None:
            raise field_error(f"messages[{i}].content", _CONTENT, message.get("content"), row_id, openai)
        messages.append({**message, "content": text})
    return messages


def _sampling(
    source: dict[str, Any], defaults: SamplingDefaults, row_id: str | None, path: InputPath
) -> dict[str, Any]:
    """The request's sampling fields (Request keyword arguments), defaults
    filled in; ``path``: ``ROW`` (a bulkinfer row), ``CHAT`` or ``COMPLETIONS``
    (an OpenAI line's body, which :func:`openai_line` has limited to the
    fields its endpoint takes).

    Raises:
        RowInvalid: a field out of its range (:data:`bulkinfer.fields.FIELDS`), naming it."""
    openai = path != ROW
    values = {}
    for name in _PLAIN:
        value = source.get(name)
        values[name] = getattr(defaults, name) if value is None else checked(FIELDS[name], value, row_id, openai)
    max_tokens = _max_tokens(source, defaults, row_id, openai)
    stop = values.pop("stop")
    values["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    values["temperature"], values["top_p"] = float(values["temperature"]), float(values["top_p"])
    refused = pair_problem(values, max_tokens, source)
    if refused:
        raise field_error(*refused, row_id, openai)
    values["stop_token_ids"] = list(values["stop_token_ids"]) or None
    bias = values["logit_bias"]
    values["logit_bias"] = {int(k): float(v) for k, v in bias.items()} if bias else None
    options = {name: values.pop(name) for name in list(values) if name not in _REQUEST_ATTRIBUTES}
    options["logprobs"] = _logprobs(source, defaults, path, row_id)
    return {
        **values,
        "max_tokens": max_tokens,
        "options": options,
        "structured": _structured(source, defaults, row_id, openai),
    }


def _max_tokens(source: dict[str, Any], defaults: SamplingDefaults, row_id: str | None, openai: bool) -> int:
    """``max_tokens``, or OpenAI's newer name ``max_completion_tokens`` (which
    vLLM's chat server reads first); both given must agree; else the default.

    Raises:
        RowInvalid: not an integer >= 1, or two values that differ."""
    given = [(name, source[name]) for name in ("max_completion_tokens", "max_tokens") if source.get(name) is not None]
    if not given:
        return defaults.max_tokens
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise RowInvalid(
            "invalid_row",
            "give 'max_tokens' or 'max_completion_tokens', not both with different values",
            row_id,
            openai,
        )
    name, value = given[0]
    return int(checked(FIELDS[name], value, row_id, openai))


def _logprobs(source: dict[str, Any], defaults: SamplingDefaults, path: InputPath, row_id: str | None) -> int | None:
    """The top alternatives to return per completion token (vLLM's
    ``SamplingParams.logprobs``), or None for no log-probabilities.

    OpenAI chat (and bulkinfer rows): ``logprobs: true`` with an optional
    ``top_logprobs: k`` (0 when absent); OpenAI completions: ``logprobs: k``.
    A bulkinfer row may also give ``logprobs: k`` directly."""
    openai = path != ROW
    logprobs, top = source.get("logprobs"), source.get("top_logprobs")
    if path == ROW and is_int(logprobs) and top is not None:  # two counts of alternatives: which?
        expected = "used with logprobs: true (an integer logprobs is the count)"
        raise field_error("top_logprobs", expected, top, row_id, False)
    if path == COMPLETIONS or (path == ROW and is_int(logprobs)):
        return defaults.logprobs if logprobs is None else int(checked(FIELDS["logprobs"], logprobs, row_id, openai))
    if top is not None and logprobs is not True:
        raise field_error("top_logprobs", "used with logprobs: true", top, row_id, openai)
    if logprobs is None:
        return defaults.logprobs
    if logprobs is False:
        return None
    if logprobs is not True:
        expected_lp = "true or false" if openai else f"true, false or an integer in [0, {MAX_TOP_LOGPROBS}]"
        raise field_error("logprobs", expected_lp, logprobs, row_id, openai)
    return 0 if top is None else int(checked(FIELDS["top_logprobs"], top, row_id, openai))


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
        return dict(checked(FIELDS["structured_outputs"], structured, row_id, openai))
    if response_format is None:
        return dict(defaults.structured_outputs) if defaults.structured_outputs else None
    kind = checked(FIELDS["response_format"], response_format, row_id, openai)["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
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
    if is_int(raw_id):
        return str(raw_id)
    raise field_error("id", "a non-empty string or an integer", raw_id, None, False)


def parse_row(data: Any, seq: int, line: int, defaults: SamplingDefaults) -> Request:
    """Validate one decoded row and build its :class:`Request`.

    Args:
        data: the decoded JSON value or Parquet row (a dict when valid).
        seq: 0-based arrival position; line: 1-based line or row number.
        defaults: sampling values for fields the row does not set.

    Raises:
        RowInvalid: the row is not an object, lacks ``prompt``/``messages``,
            a field has the wrong type or range, or a bulkinfer row names a
            request parameter bulkinfer does not apply
            (:data:`~bulkinfer.prep.unapplied.GENERATION`); the message names the field.
    """
    if not isinstance(data, dict):
        raise RowInvalid("invalid_row", f"expected a JSON object, got {type(data).__name__}")
    if is_openai_line(data, ("prompt", "messages")):
        row_id, url, body = openai_line(data, BODY_FIELDS, {EMBEDDINGS_URL: "bulkinfer embed"})
        prompt, messages = _openai_content(url, body, row_id)
        source, path = body, CHAT if url == CHAT_URL else COMPLETIONS
        passthrough = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
    else:
        row_id, url, source, path = row_id_of(data, line), None, data, ROW
        check_unapplied(data, GENERATION, row_id)
        prompt, messages = _row_content(data, row_id)
        passthrough = {k: v for k, v in data.items() if k not in CONSUMED_FIELDS}
    return Request(
        seq=seq,
        line=line,
        id=row_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=prompt if isinstance(prompt, list) else None,
        prompts=list(prompt) if isinstance(prompt, tuple) else None,
        messages=messages,
        openai_url=url,
        passthrough=passthrough,
        row_sampling=tuple(name for name in FIELDS if source.get(name) is not None),
        template_kwargs=template_kwargs(source, row_id, path != ROW),
        **_sampling(source, defaults, row_id, path),
    )


Prompt = str | list[int] | tuple[str | list[int], ...]  # text, token ids, or several prompts (see _prompt)


def _row_content(data: dict[str, Any], row_id: str) -> tuple[Prompt | None, list[dict[str, Any]] | None]:
    """A bulkinfer row's ``prompt`` (see :func:`_prompt`) or ``messages`` (exactly one), checked.

    Raises:
        RowInvalid: both or neither given, or the one given is invalid.
    """
    prompt, messages = data.get("prompt"), data.get("messages")
    if prompt is not None and messages is not None:
        raise RowInvalid("invalid_row", "row has both 'prompt' and 'messages'; give one", row_id)
    if prompt is None and messages is None:
        raise RowInvalid("missing_field", "row needs a 'prompt' (text or token ids) or 'messages' (chat) field", row_id)
    if messages is not None:
        return None, _parse_messages(messages, row_id, False)
    return _prompt(prompt, "prompt", row_id, False), None


def _prompt(value: Any, name: str, row_id: str | None, openai: bool, several: bool = False) -> Prompt:
    """A ``prompt``: text, or token ids (OpenAI's and vLLM's other form,
    sent as they are: no chat template, no special tokens added); OpenAI's
    list of prompts holding one is that one; with ``several`` (an OpenAI
    ``/v1/completions`` body, whose record holds every prompt's choices, as
    OpenAI's and vLLM's) a list of several, as a tuple.

    Raises:
        RowInvalid: empty, not text nor integers >= 0, or several prompts
            where one record holds one prompt's (a bulkinfer row: each prompt its own row).
    """
    if isinstance(value, str) and value:
        return value
    if token_ids(value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        if len(value) > 1 and not several:
            raise RowInvalid(
                "invalid_field",
                f"field '{name}': a list of {len(value)} prompts; a row is one prompt with its own "
                "record: give each prompt its own row (an OpenAI /v1/completions line may hold several)",
                row_id,
                openai,
            )
        prompts = []
        for index, one in enumerate(value):
            if not ((isinstance(one, str) and one) or token_ids(one)):
                expected = "a non-empty string or a list of token ids (integers >= 0)"
                raise field_error(f"{name}[{index}]", expected, one, row_id, openai)
            prompts.append(one if isinstance(one, str) else list(one))
        return prompts[0] if len(prompts) == 1 else tuple(prompts)
    raise field_error(name, "a non-empty string or a list of token ids (integers >= 0)", value, row_id, openai)


def token_ids(value: Any) -> bool:
    """Whether ``value`` is token ids: a non-empty list of integers >= 0."""
    return isinstance(value, list) and bool(value) and all(is_int(t) and t >= 0 for t in value)


def _openai_content(
    url: str, body: dict[str, Any], custom_id: str
) -> tuple[Prompt | None, list[dict[str, Any]] | None]:
    """An OpenAI body's ``messages`` (chat) or ``prompt`` (completions: see :func:`_prompt`), checked.

    Raises:
        RowInvalid: the one its endpoint needs is missing or invalid.
    """
    if url == CHAT_URL:
        if body.get("messages") is None:
            raise RowInvalid(
                "missing_field", "field 'body.messages' is required for /v1/chat/completions", custom_id, True
            )
        return None, _parse_messages(body["messages"], custom_id, True)
    return _prompt(body.get("prompt"), "body.prompt", custom_id, True, several=True), None


def to_request(data: Any, seq: int, line: int, settings: Settings) -> Request:
    """:func:`~bulkinfer.prep.rows.parse_row` with the run's settings applied: with
    ``apply_chat_template`` a ``prompt`` becomes a one-message user chat
    (except on OpenAI ``/v1/completions`` lines); a chat gets the settings'
    ``chat_template_kwargs`` under its own.

    Raises:
        RowInvalid: as parse_row; or a prompt sent raw with a chat template
            field (:func:`~bulkinfer.prep.chat_template.needs_template`).
    """
    if not isinstance(settings.apply_chat_template, bool):
        raise ValueError('apply_chat_template "auto" must be resolved first (Settings.resolve_chat_template)')
    request = parse_row(data, seq, line, settings.sampling)
    if settings.apply_chat_template and request.prompt is not None and request.openai_url != COMPLETIONS_URL:
        request.messages, request.prompt = [{"role": "user", "content": request.prompt}], None
    if request.messages is None:
        needs_template(request.template_kwargs, request.id, request.openai_url is not None)
    elif settings.chat_template_kwargs:
        request.template_kwargs = {**settings.chat_template_kwargs, **request.template_kwargs}
    return request


# A row parser: (decoded row, seq, line, settings) -> Request, raising RowInvalid.
RowParser = Callable[[Any, int, int, Settings], Request]
