"""The checks of every setting's type and range, run once where settings are
built (:func:`bulkinfer.config.load_settings`), and the ranges that come
from vLLM's own limits (with where in vLLM each comes from)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from bulkinfer.errors import ConfigError
from bulkinfer.settings import Settings

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


# engine.seed: vLLM's workers call ``set_random_seed(model_config.seed)``
# (v1/worker/cpu_worker.py, gpu_worker.py), which runs ``np.random.seed(seed)``
# (vllm/utils/torch_utils.py); NumPy takes only 0 <= seed <= 2**32 - 1.
ENGINE_SEED_RANGE: tuple[int, int] = (0, 2**32)


def _int(value: Any) -> bool:
    """An integer and not a bool (TOML and JSON ``true`` are ints to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(value: Any, bounds: tuple[int, int], optional: bool = False) -> bool:
    """An integer (not a bool) with ``low <= value < high``, or None when ``optional``."""
    if value is None:
        return optional
    return _int(value) and bounds[0] <= value < bounds[1]


def _shown(value: Any) -> str:
    """``value`` for an error message: lists as lists, cut to 80 characters."""
    shown = repr(list(value) if isinstance(value, tuple) else value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _int_ge_1(value: Any, optional: bool = False) -> bool:
    """An integer (not a bool) >= 1, or None when ``optional``."""
    if value is None:
        return optional
    return _int(value) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number_in(low: float, high: float) -> Callable[[Any], bool]:
    return lambda v: _number(v) and low <= v <= high


def _token_ids(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(_int(t) and t >= 0 for t in value)


def _logit_bias(value: Any) -> bool:
    """OpenAI's ``logit_bias``: token id (a JSON object key, so a string of
    digits; an int from Python) -> a bias in [-100, 100]."""
    return isinstance(value, Mapping) and all(
        (_int(k) and k >= 0 or isinstance(k, str) and k.isdigit()) and _number(v) and -100 <= v <= 100
        for k, v in value.items()
    )


# The most alternatives a token's ``top_logprobs`` may list: OpenAI's limit
# (chat ``top_logprobs`` 0..20) and vLLM's default ``max_logprobs`` (20).
MAX_TOP_LOGPROBS = 20


# Request fields that shape a completion besides max_tokens, temperature,
# top_p, seed and stop: name (OpenAI's, which is vLLM's ``SamplingParams``
# argument too) -> (valid?, what it must be). Ranges: OpenAI's API reference
# (penalties in [-2, 2], logit_bias in [-100, 100], top_logprobs 0..20) and
# vLLM 0.32's ``SamplingParams._verify_args`` (repetition_penalty > 0, top_k
# 0 or -1 = no limit else >= 1, min_p in [0, 1], min_tokens >= 0). One table
# for a row's own values (bulkinfer.prep.rows) and the ``[sampling]`` defaults.
REQUEST_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_int_ge_1, "an integer >= 1"),
    "presence_penalty": (_number_in(-2, 2), "a number in [-2, 2]"),
    "frequency_penalty": (_number_in(-2, 2), "a number in [-2, 2]"),
    "repetition_penalty": (lambda v: _number(v) and 0 < v < float("inf"), "a number > 0"),
    "top_k": (lambda v: _int(v) and v >= -1, "an integer >= 1, or 0 or -1 (no limit)"),
    "min_p": (_number_in(0, 1), "a number in [0, 1]"),
    "min_tokens": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "stop_token_ids": (_token_ids, "a list of token ids (integers >= 0)"),
    "logit_bias": (_logit_bias, "an object of token id -> number in [-100, 100]"),
    "top_logprobs": (
        lambda v: _int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
        f"an integer in [0, {MAX_TOP_LOGPROBS}]",
    ),
    "priority": (lambda v: _int(v) and -(2**63) <= v < 2**63, "an integer (lower runs first)"),
}


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
        return f"expected an object with one of {kinds}, got {_shown(value)}"
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
            import json

            try:
                spec = json.loads(spec)
            except ValueError as exc:
                return f"json: not valid JSON text: {exc}"
        problem = schema_problem(spec)
        return f"json: {problem}" if problem else None
    if kind == "choice":
        if not isinstance(spec, list | tuple) or not spec or not all(isinstance(c, str) and c for c in spec):
            return f"choice: expected a non-empty list of non-empty strings, got {_shown(spec)}"
        return None
    if kind == "json_object":
        return None if spec is True else f"json_object: expected true, got {_shown(spec)}"
    if not isinstance(spec, str) or not spec:
        return f"{kind}: expected a non-empty string, got {_shown(spec)}"
    return None


def validate(settings: Settings, names: Mapping[str, str] | None = None) -> None:
    """Check types and ranges once, where settings are built.

    ``names`` maps a dotted key to what the user typed for it (``--max-tokens``,
    ``sampling.max_tokens in c.toml``); other keys are named as they are.

    Raises:
        ConfigError: naming the first bad setting as the user gave it, what it
            must be and the value given, e.g. ``--seed must be an integer in
            [0, 2**32), got -1``.
    """
    s, e, p, r = settings.sampling, settings.engine, settings.plan, settings.ray
    # (setting, value given, valid?, what it must be)
    checks: list[tuple[str, Any, bool, str]] = [
        ("model", settings.model, settings.model is None or isinstance(settings.model, str), "a string"),
        ("passthrough", settings.passthrough, isinstance(settings.passthrough, bool), "true or false"),
        (
            "apply_chat_template",
            settings.apply_chat_template,
            isinstance(settings.apply_chat_template, bool) or settings.apply_chat_template == "auto",
            'true, false or "auto"',
        ),
        ("sampling.max_tokens", s.max_tokens, _int_ge_1(s.max_tokens), "an integer >= 1"),
        (
            "sampling.temperature",
            s.temperature,
            _number(s.temperature) and 0 <= s.temperature <= 2,
            "a number in [0, 2]",
        ),
        ("sampling.top_p", s.top_p, _number(s.top_p) and 0 < s.top_p <= 1, "a number in (0, 1]"),
        ("sampling.seed", s.seed, _int_in(s.seed, SEED_RANGE, optional=True), "an integer in [0, 2**63)"),
        (
            "sampling.stop",
            s.stop,
            isinstance(s.stop, tuple) and all(isinstance(x, str) and x for x in s.stop),
            "a list of non-empty strings",  # vLLM: "stop cannot contain an empty string."
        ),
        ("sampling.ignore_eos", s.ignore_eos, isinstance(s.ignore_eos, bool), "true or false"),
        *(
            (f"sampling.{name}", getattr(s, name), getattr(s, name) is None or ok(getattr(s, name)), expected)
            for name, (ok, expected) in REQUEST_FIELDS.items()
            if name != "top_logprobs"
        ),
        (
            "sampling.logprobs",
            s.logprobs,
            s.logprobs is None or REQUEST_FIELDS["top_logprobs"][0](s.logprobs),
            f"the top log-probabilities to return per token, an integer in [0, {MAX_TOP_LOGPROBS}]",
        ),
        ("engine.dtype", e.dtype, isinstance(e.dtype, str) and bool(e.dtype), "a non-empty string"),
        ("engine.tensor_parallel_size", e.tensor_parallel_size, _int_ge_1(e.tensor_parallel_size), "an integer >= 1"),
        ("engine.data_parallel_size", e.data_parallel_size, _int_ge_1(e.data_parallel_size), "an integer >= 1"),
        ("engine.max_model_len", e.max_model_len, _int_ge_1(e.max_model_len, optional=True), "an integer >= 1"),
        ("engine.max_num_seqs", e.max_num_seqs, _int_ge_1(e.max_num_seqs, optional=True), "an integer >= 1"),
        (
            "engine.max_num_batched_tokens",
            e.max_num_batched_tokens,
            _int_ge_1(e.max_num_batched_tokens, optional=True),
            "an integer >= 1",
        ),
        (
            "engine.gpu_memory_utilization",
            e.gpu_memory_utilization,
            e.gpu_memory_utilization is None
            or (_number(e.gpu_memory_utilization) and 0 < e.gpu_memory_utilization <= 1),
            "a number in (0, 1]",
        ),
        (
            "engine.kv_cache_memory_bytes",
            e.kv_cache_memory_bytes,
            _int_ge_1(e.kv_cache_memory_bytes, optional=True),
            "an integer >= 1 (bytes)",
        ),
        (
            "engine.enforce_eager",
            e.enforce_eager,
            e.enforce_eager is None or isinstance(e.enforce_eager, bool),
            "true or false",
        ),
        ("engine.seed", e.seed, _int_in(e.seed, ENGINE_SEED_RANGE), "an integer in [0, 2**32)"),
        ("engine.trust_remote_code", e.trust_remote_code, isinstance(e.trust_remote_code, bool), "true or false"),
        (
            "plan.buckets",
            p.buckets,
            isinstance(p.buckets, tuple)
            and all(_int_ge_1(b) for b in p.buckets)
            and list(p.buckets) == sorted(set(p.buckets)),
            "strictly ascending positive integers",
        ),
        ("plan.order", p.order, p.order in FEED_ORDERS, f"one of {', '.join(FEED_ORDERS)}"),
        ("plan.window_rows", p.window_rows, _int_ge_1(p.window_rows), "an integer >= 1"),
        ("plan.max_in_flight", p.max_in_flight, _int_ge_1(p.max_in_flight, optional=True), "an integer >= 1"),
        (
            "plan.stall_timeout_s",
            p.stall_timeout_s,
            p.stall_timeout_s is None or (_number(p.stall_timeout_s) and p.stall_timeout_s > 0),
            "a number of seconds > 0",
        ),
        ("plan.padding_batch_size", p.padding_batch_size, _int_ge_1(p.padding_batch_size), "an integer >= 1"),
        ("plan.output_order", p.output_order, p.output_order in OUTPUT_ORDERS, f"one of {', '.join(OUTPUT_ORDERS)}"),
        (
            "ray.address",
            r.address,
            r.address is None or (isinstance(r.address, str) and bool(r.address.strip())),
            'a Ray address: "local", "auto", "ray://HOST:PORT" or HOST:PORT',
        ),
        (
            "ray.cpus_per_replica",
            r.cpus_per_replica,
            _int_ge_1(r.cpus_per_replica, optional=True),
            "an integer >= 1",
        ),
        (
            "ray.max_restarts",
            r.max_restarts,
            isinstance(r.max_restarts, int) and not isinstance(r.max_restarts, bool) and r.max_restarts >= -1,
            "an integer >= -1 (-1: without limit)",
        ),
    ]
    for name, value, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{(names or {}).get(name, name)} must be {expected}, got {_shown(value)}")
    problem = None if s.structured_outputs is None else structured_problem(s.structured_outputs)
    if problem:
        name = "sampling.structured_outputs"
        raise ConfigError(f"{(names or {}).get(name, name)}: {problem}")


FEED_ORDERS: tuple[str, ...] = ("descending", "ascending", "arrival")


OUTPUT_ORDERS: tuple[str, ...] = ("input", "completion")
