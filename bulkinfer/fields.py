"""The request fields: one table (:data:`FIELDS`) of every field that shapes
a completion, with its name (OpenAI's, which is vLLM's too), its JSON type,
its valid range and where that range comes from, where it goes in vLLM, and
the input paths that accept it. Row parsing (:mod:`bulkinfer.prep.rows`),
the ``[sampling]`` checks (:func:`bulkinfer.checks.validate`), the columns a
Parquet reader reads and the OpenAI body fields accepted all read it, so a
field cannot be known in one path and dropped in another.

Importing this module imports nothing of bulkinfer's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

# The input paths a field may arrive by: a bulkinfer row (JSONL or Parquet),
# the body of an OpenAI batch line for /v1/chat/completions or
# /v1/completions, the ``[sampling]`` table of a config file (the Python
# API's overrides too), and a ``bulkinfer run`` flag (:attr:`RequestField.flags`).
InputPath = Literal["row", "chat", "completions", "config", "flag"]
ROW: InputPath = "row"
CHAT: InputPath = "chat"
COMPLETIONS: InputPath = "completions"
CONFIG: InputPath = "config"
FLAG: InputPath = "flag"

# Where a field goes: an argument of vLLM's ``SamplingParams`` (named by
# :attr:`RequestField.vllm`), vLLM's ``StructuredOutputsParams`` (the
# ``structured_outputs`` argument of ``SamplingParams``), or the request's
# priority (``LLMEngine.add_request(priority=...)``).
Target = Literal["sampling", "structured", "priority"]


# transformers' apply_chat_template's own parameters (checked against its
# signature in tests/prep/test_chat_template_fields.py), but those the
# template reads (tools, documents, add_generation_prompt, continue_final_message):
# a chat_template_kwargs key may not be one (bulkinfer.prep.chat_template).
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def is_int(value: Any) -> bool:
    """An integer and not a bool (TOML and JSON ``true`` are ints to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def integral(value: Any) -> Any:
    """``value`` as an int when it is a float with no fraction (``8.0`` -> 8),
    as vLLM's OpenAI server reads an integer field (pydantic's lax mode; pandas
    writes a nullable integer column as float64); anything else unchanged."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def is_number(value: Any) -> bool:
    """An int or float and not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


# vLLM's bound on a request's n (the environment variable its SamplingParams
# reads; the engine's processes inherit it), read once.
MAX_N_SEQUENCES = int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))


def int_in(value: Any, bounds: tuple[int, int], optional: bool = False) -> bool:
    """An integer (not a bool) with ``low <= value < high``, or None when ``optional``."""
    if value is None:
        return optional
    return is_int(value) and bounds[0] <= value < bounds[1]


def int_ge_1(value: Any, optional: bool = False) -> bool:
    """An integer (not a bool) >= 1, or None when ``optional``."""
    if value is None:
        return optional
    return is_int(value) and value >= 1


def shown(value: Any) -> str:
    """``value`` for an error message: lists as lists, cut to 80 characters."""
    text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def _number_in(low: float, high: float) -> Callable[[Any], bool]:
    return lambda v: is_number(v) and low <= v <= high


def _stop(value: Any) -> bool:
    strings = (value,) if isinstance(value, str) else value
    return isinstance(strings, list | tuple) and all(isinstance(s, str) and s for s in strings)


def _token_ids(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(is_int(t) and t >= 0 for t in value)


def _logit_bias(value: Any) -> bool:
    """OpenAI's ``logit_bias``: token id (a JSON object key, so a string of
    digits, read by ``int``: ``isdecimal``, not ``isdigit``, which "²" passes;
    an int from Python) -> a bias in [-100, 100]."""
    return isinstance(value, Mapping) and all(
        (is_int(k) and k >= 0 or isinstance(k, str) and k.isdecimal()) and is_number(v) and -100 <= v <= 100
        for k, v in value.items()
    )


# Seeds, as half-open ranges [low, high).
#
# sampling.seed (per request): vLLM 0.32 declares ``SamplingParams.seed: int |
# None`` and checks nothing in ``_verify_args``; the request then crosses to the
# engine core as an ``EngineCoreRequest`` (vllm/v1/engine/__init__.py,
# ``msgspec.Struct, array_like=True``) through ``MsgpackEncoder``/``Decoder``
# (vllm/v1/serial_utils.py). A float or bool seed is refused only there, by the
# decoder in the engine core's input thread ("Expected `int | null`, got
# `float` - at `$[3].seed`"), which kills the engine; msgpack carries ints in
# [-2**63, 2**64). ``SamplingParams.__post_init__`` turns -1 into None ("no
# seed", sampling_params.py: ``if self.seed == -1: self.seed = None``), and
# vLLM's own OpenAI front end allows ``Field(None, ge=_INT64_MIN,
# le=_INT64_MAX)`` (entrypoints/openai/completion/protocol.py). We take the
# part every path accepts and that means what it says: 0 <= seed < 2**63.
SEED_RANGE: tuple[int, int] = (0, 2**63)


# The most alternatives a token's ``top_logprobs`` may list: OpenAI's limit
# (chat ``top_logprobs`` 0..20) and vLLM's default ``max_logprobs`` (20).
MAX_TOP_LOGPROBS = 20


# vLLM's StructuredOutputsParams: exactly one constraint.
STRUCTURED_KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar", "json_object")


# StructuredOutputsParams fields vLLM 0.32 accepts per request and then does
# not read: its grammar backends take disable_any_whitespace and
# disable_additional_properties from the engine-wide StructuredOutputsConfig
# only, and none reads whitespace_pattern. A request naming one is refused.
ENGINE_WIDE_STRUCTURED: tuple[str, ...] = (
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)


def schema_problem(schema: Any) -> str | None:
    """What makes ``schema`` no JSON schema (the ``jsonschema`` library's
    meta-schema check, of the draft its ``$schema`` names, else the latest),
    or None when it is one."""
    if not isinstance(schema, Mapping):
        return f"a JSON schema must be an object, got {type(schema).__name__}"
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"not a valid JSON schema: {exc.message}" + (f" (at {where})" if where else "")
    return None


def structured_problem(value: Any) -> str | None:
    """What is wrong with a ``structured_outputs`` value (the arguments of
    vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON
    schema, or its JSON text), ``regex``, ``choice`` (a list of strings),
    ``grammar`` (EBNF/GBNF text), ``json_object: true``), or None when it
    is right. The fields vLLM takes only engine-wide
    (:data:`ENGINE_WIDE_STRUCTURED`) are refused, pointing to the engine setting."""
    kinds = ", ".join(STRUCTURED_KINDS)
    if not isinstance(value, Mapping):
        return f"expected an object with one of {kinds}, got {shown(value)}"
    engine_wide = [k for k in ENGINE_WIDE_STRUCTURED if k in value]
    if engine_wide:
        key = engine_wide[0]
        return (
            f"{key} is engine-wide in vLLM, not per request: set it for the run with "
            f"--engine-arg 'structured_outputs_config={{backend = \"xgrammar\", {key} = ...}}' "
            "([engine] structured_outputs_config)"
        )
    unknown = sorted(set(value) - set(STRUCTURED_KINDS))
    if unknown:
        return f"unknown key(s) {', '.join(map(str, unknown))}; known: {kinds}"
    given = [k for k in STRUCTURED_KINDS if value.get(k) is not None]
    if len(given) != 1:
        return f"expected exactly one of {kinds}, got {len(given)}"
    kind, spec = given[0], value[given[0]]
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as exc:
                return f"json: not valid JSON text: {exc}"
        problem = schema_problem(spec)
        return f"json: {problem}" if problem else None
    if kind == "choice":
        if not isinstance(spec, list | tuple) or not spec or not all(isinstance(c, str) and c for c in spec):
            return f"choice: expected a non-empty list of non-empty strings, got {shown(spec)}"
        return None
    if kind == "json_object":
        return None if spec is True else f"json_object: expected true, got {shown(spec)}"
    if not isinstance(spec, str) or not spec:
        return f"{kind}: expected a non-empty string, got {shown(spec)}"
    return None


def _logprobs_count(value: Any) -> bool:
    """How many top log-probabilities per token: 0 to :data:`MAX_TOP_LOGPROBS`."""
    return int_in(value, (0, MAX_TOP_LOGPROBS + 1))


def _response_format(value: Any) -> bool:
    """OpenAI's ``response_format`` object; its ``json_schema`` is checked
    where it becomes ``StructuredOutputsParams`` (bulkinfer.prep.rows)."""
    return isinstance(value, Mapping) and value.get("type") in ("text", "json_object", "json_schema")


@dataclass(frozen=True, slots=True)
class RequestField:
    """One request field.

    - ``name``: OpenAI's name (vLLM's ``SamplingParams`` argument has it too,
      but for :attr:`vllm`).
    - ``type``: its JSON type, as the OpenAI API reference writes it.
    - ``valid``: whether a value is in range; ``expected``: what it must be,
      in error messages (``field 'top_p': expected a number in (0, 1]``;
      ``sampling.top_p must be a number in (0, 1]``). ``problem``, when set,
      says what is wrong with a value in its own words (None: nothing).
    - ``source``: where the range comes from.
    - ``target``, ``vllm``: where it goes (see :data:`Target`): the
      ``SamplingParams`` argument it sets, ``structured_outputs`` or ``priority``.
    - ``paths``: the input paths that accept it; a path that does not refuses
      it (an ``unsupported_field`` error record in an OpenAI body, an unknown
      setting in ``[sampling]``, no such flag).
    - ``flags``: the ``bulkinfer run`` options that set its ``[sampling]``
      default, without ``--`` (the ``FLAG`` path: :meth:`accepts`).
    - ``nullable``: None is a valid ``[sampling]`` value (none, no seed).
    """

    name: str
    type: str
    valid: Callable[[Any], bool]
    expected: str
    source: str
    target: Target
    vllm: str
    paths: frozenset[InputPath]
    flags: tuple[str, ...] = ()
    problem: Callable[[Any], str | None] | None = None
    nullable: bool = False

    def accepts(self, path: InputPath) -> bool:
        """Whether ``path`` reads this field (a flag path: it has :attr:`flags`)."""
        return path in self.paths or (path == FLAG and bool(self.flags))


_BODIES: frozenset[InputPath] = frozenset({ROW, CHAT, COMPLETIONS})
_EVERYWHERE: frozenset[InputPath] = _BODIES | {CONFIG}
_VERIFY_ARGS = "vLLM 0.32 SamplingParams._verify_args"
# OpenAI's chat API's fields that its completions API has not (a row takes them too).
_ROW_AND_CHAT: dict[str, Any] = {"paths": frozenset({ROW, CHAT}), "flags": ()}


def _field(name: str, type_: str, valid: Callable[[Any], bool], expected: str, source: str, **kw: Any) -> RequestField:
    """A :class:`RequestField` that goes to ``SamplingParams(name=...)`` from
    every body and ``[sampling]``, with the flag ``--name``, unless ``kw`` says otherwise."""
    kw = {"target": "sampling", "vllm": name, "paths": _EVERYWHERE, "flags": (name,), **kw}
    return RequestField(name, type_, valid, expected, source, **kw)


# Every request field bulkinfer reads, by name (see RequestField).
FIELDS: dict[str, RequestField] = {
    f.name: f
    for f in (
        _field("max_tokens", "integer", int_ge_1, "an integer >= 1", f"{_VERIFY_ARGS}: max_tokens >= 1"),
        _field(
            "max_completion_tokens",
            "integer",
            int_ge_1,
            "an integer >= 1",
            "OpenAI chat API: the newer name of max_tokens; vLLM's ChatCompletionRequest reads it first",
            vllm="max_tokens",
            **_ROW_AND_CHAT,
        ),
        _field(
            "temperature",
            "number",
            _number_in(0, 2),
            "a number in [0, 2]",
            f"OpenAI API reference (0 to 2); {_VERIFY_ARGS}: 0 <= temperature <= 2",
        ),
        _field(
            "top_p",
            "number",
            lambda v: is_number(v) and 0 < v <= 1,
            "a number in (0, 1]",
            f"{_VERIFY_ARGS}: 0 < top_p <= 1",
        ),
        _field(
            "seed",
            "integer",
            lambda v: int_in(v, SEED_RANGE),
            "an integer in [0, 2**63)",
            "vLLM 0.32: EngineCoreRequest's msgpack int; -1 means no seed (see SEED_RANGE)",
            flags=(),  # --seed is the engine's seed
            nullable=True,
        ),
        _field(
            "stop",
            "string | array of strings",
            _stop,
            "a non-empty string or a list of non-empty strings",
            f'OpenAI API reference; {_VERIFY_ARGS}: "stop cannot contain an empty string."',
        ),
        _field(
            "ignore_eos",
            "boolean",
            lambda v: isinstance(v, bool),
            "true or false",
            "vLLM SamplingParams.ignore_eos (vLLM's extension of the OpenAI API)",
        ),
        _field(
            "n",
            "integer",
            lambda v: int_in(v, (1, MAX_N_SEQUENCES + 1)),
            f"an integer in [1, {MAX_N_SEQUENCES}]",
            "OpenAI API reference; vLLM 0.32 _verify_num_sequences: 1 <= n <= VLLM_MAX_N_SEQUENCES (default 16384)",
        ),
        *(
            _field(
                name,
                "number",
                _number_in(-2, 2),
                "a number in [-2, 2]",
                f"OpenAI API reference (-2.0 to 2.0); {_VERIFY_ARGS}: -2 <= {name} <= 2",
            )
            for name in ("presence_penalty", "frequency_penalty")
        ),
        _field(
            "repetition_penalty",
            "number",
            lambda v: is_number(v) and 0 < v < float("inf"),
            "a number > 0",
            f"{_VERIFY_ARGS}: finite, > 0",
        ),
        _field(
            "top_k",
            "integer",
            lambda v: is_int(v) and v >= -1,
            "an integer >= 1, or 0 or -1 (no limit)",
            f"{_VERIFY_ARGS}: top_k >= -1 (0 and -1: no limit)",
        ),
        _field("min_p", "number", _number_in(0, 1), "a number in [0, 1]", f"{_VERIFY_ARGS}: 0 <= min_p <= 1"),
        _field(
            "min_tokens",
            "integer",
            lambda v: is_int(v) and v >= 0,
            "an integer >= 0",
            f"{_VERIFY_ARGS}: 0 <= min_tokens <= max_tokens",
        ),
        _field(
            "stop_token_ids",
            "array of integers",
            _token_ids,
            "a list of token ids (integers >= 0)",
            "vLLM SamplingParams.stop_token_ids (token ids)",
        ),
        _field(
            "logit_bias",
            "object (token id -> number)",
            _logit_bias,
            "an object of token id -> number in [-100, 100]",
            "OpenAI API reference: a bias in -100 to 100 per token id",
            nullable=True,
        ),
        _field(
            "logprobs",
            "boolean (chat) | integer (completions, [sampling])",
            _logprobs_count,
            f"the top log-probabilities to return per token, an integer in [0, {MAX_TOP_LOGPROBS}]",
            "OpenAI API reference (completions: logprobs at most 5, chat: top_logprobs 0 to 20); "
            "vLLM's default max_logprobs (20)",
            nullable=True,
        ),
        _field(
            "top_logprobs",
            "integer",
            _logprobs_count,
            f"an integer in [0, {MAX_TOP_LOGPROBS}]",
            "OpenAI chat API reference: 0 to 20, with logprobs: true",
            vllm="logprobs",
            **_ROW_AND_CHAT,
        ),
        _field(
            "priority",
            "integer",
            lambda v: int_in(v, (-(2**63), 2**63)),
            "an integer (lower runs first)",
            "vLLM 0.32 LLMEngine.add_request(priority=...), an int64; lower runs first (scheduling_policy = priority)",
            target="priority",
            vllm="priority",
        ),
        _field(
            "response_format",
            "object",
            _response_format,
            "{type: text | json_object | json_schema}",
            "OpenAI API reference (response_format); vLLM's OpenAI server turns it into StructuredOutputsParams",
            target="structured",
            vllm="structured_outputs",
            paths=_BODIES,
            flags=(),
        ),
        _field(
            "structured_outputs",
            "object",
            lambda v: structured_problem(v) is None,
            f"an object with one of {', '.join(STRUCTURED_KINDS)}",
            "vLLM 0.32 StructuredOutputsParams: exactly one constraint",
            target="structured",
            vllm="structured_outputs",
            flags=("json_schema", "choice", "regex"),
            problem=structured_problem,
            nullable=True,
        ),
    )
}


def fields_of(path: InputPath) -> frozenset[str]:
    """The names of the fields ``path`` accepts."""
    return frozenset(name for name, f in FIELDS.items() if f.accepts(path))
