"""The checks of every setting's type and range, run once where settings are
built (:func:`bulkinfer.config.load_settings`), and the ranges that come
from vLLM's own limits (with where in vLLM each comes from)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bulkinfer.errors import ConfigError

if TYPE_CHECKING:
    from bulkinfer.config import Settings


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


def validate(settings: Settings, names: Mapping[str, str] | None = None) -> None:
    """Check types and ranges once, where settings are built.

    ``names`` maps a dotted key to what the user typed for it (``--max-tokens``,
    ``sampling.max_tokens in c.toml``); other keys are named as they are.

    Raises:
        ConfigError: naming the first bad setting as the user gave it, what it
            must be and the value given, e.g. ``--seed must be an integer in
            [0, 2**32), got -1``.
    """
    s, e, p = settings.sampling, settings.engine, settings.plan
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
    ]
    for name, value, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{(names or {}).get(name, name)} must be {expected}, got {_shown(value)}")


FEED_ORDERS: tuple[str, ...] = ("descending", "ascending", "arrival")


OUTPUT_ORDERS: tuple[str, ...] = ("input", "completion")
