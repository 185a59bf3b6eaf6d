"""The checks of every setting's type and range, run once where settings are
built (:func:`bulkinfer.config.load_settings`), and the ranges that come
from vLLM's own limits (with where in vLLM each comes from). The
``[sampling]`` checks are those of the request fields' table
(:data:`bulkinfer.fields.FIELDS`), which a row's own values meet too, as
they meet the pairs of fields vLLM refuses together (:func:`pair_problem`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bulkinfer.errors import ConfigError
from bulkinfer.fields import (
    CONFIG,
    FIELDS,
    RESERVED_KWARGS,
    int_ge_1,
    int_in,
    is_int,
    is_number,
    shown,
)
from bulkinfer.settings import SamplingDefaults, Settings

# engine.seed: vLLM's workers call ``set_random_seed(model_config.seed)``
# (v1/worker/cpu_worker.py, gpu_worker.py), which runs ``np.random.seed(seed)``
# (vllm/utils/torch_utils.py); NumPy takes only 0 <= seed <= 2**32 - 1.
ENGINE_SEED_RANGE: tuple[int, int] = (0, 2**32)


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
        (
            "chat_template_kwargs",
            settings.chat_template_kwargs,
            isinstance(settings.chat_template_kwargs, dict)
            and all(isinstance(k, str) and k not in RESERVED_KWARGS for k in settings.chat_template_kwargs),
            "a table of template variables (not " + ", ".join(sorted(RESERVED_KWARGS)) + ")",
        ),
        *_sampling_checks(s),
        ("engine.dtype", e.dtype, isinstance(e.dtype, str) and bool(e.dtype), "a non-empty string"),
        ("engine.tensor_parallel_size", e.tensor_parallel_size, int_ge_1(e.tensor_parallel_size), "an integer >= 1"),
        ("engine.data_parallel_size", e.data_parallel_size, int_ge_1(e.data_parallel_size), "an integer >= 1"),
        ("engine.max_model_len", e.max_model_len, int_ge_1(e.max_model_len, optional=True), "an integer >= 1"),
        ("engine.max_num_seqs", e.max_num_seqs, int_ge_1(e.max_num_seqs, optional=True), "an integer >= 1"),
        (
            "engine.max_num_batched_tokens",
            e.max_num_batched_tokens,
            int_ge_1(e.max_num_batched_tokens, optional=True),
            "an integer >= 1",
        ),
        (
            "engine.gpu_memory_utilization",
            e.gpu_memory_utilization,
            e.gpu_memory_utilization is None
            or (is_number(e.gpu_memory_utilization) and 0 < e.gpu_memory_utilization <= 1),
            "a number in (0, 1]",
        ),
        (
            "engine.kv_cache_memory_bytes",
            e.kv_cache_memory_bytes,
            int_ge_1(e.kv_cache_memory_bytes, optional=True),
            "an integer >= 1 (bytes)",
        ),
        (
            "engine.enforce_eager",
            e.enforce_eager,
            e.enforce_eager is None or isinstance(e.enforce_eager, bool),
            "true or false",
        ),
        ("engine.seed", e.seed, int_in(e.seed, ENGINE_SEED_RANGE), "an integer in [0, 2**32)"),
        ("engine.trust_remote_code", e.trust_remote_code, isinstance(e.trust_remote_code, bool), "true or false"),
        (
            "engine.top_p_sampler",
            e.top_p_sampler,
            e.top_p_sampler in TOP_P_SAMPLERS,
            f"one of {', '.join(TOP_P_SAMPLERS)}",
        ),
        ("engine.batch_order", e.batch_order, e.batch_order in BATCH_ORDERS, f"one of {', '.join(BATCH_ORDERS)}"),
        (
            "engine.huge_pages_at_start",
            e.huge_pages_at_start,
            e.huge_pages_at_start is None or isinstance(e.huge_pages_at_start, bool),
            "true or false",
        ),
        (
            "engine.speculative_tail",
            e.speculative_tail,
            is_int(e.speculative_tail) and e.speculative_tail >= 0,
            "an integer >= 0 (running rows; 0: off)",
        ),
        (
            "plan.buckets",
            p.buckets,
            isinstance(p.buckets, tuple)
            and all(int_ge_1(b) for b in p.buckets)
            and list(p.buckets) == sorted(set(p.buckets)),
            "strictly ascending positive integers",
        ),
        ("plan.order", p.order, p.order in FEED_ORDERS, f"one of {', '.join(FEED_ORDERS)}"),
        ("plan.window_rows", p.window_rows, int_ge_1(p.window_rows), "an integer >= 1"),
        ("plan.max_in_flight", p.max_in_flight, int_ge_1(p.max_in_flight, optional=True), "an integer >= 1"),
        (
            "plan.stall_timeout_s",
            p.stall_timeout_s,
            p.stall_timeout_s is None or (is_number(p.stall_timeout_s) and p.stall_timeout_s > 0),
            "a number of seconds > 0",
        ),
        (
            "plan.start_timeout_s",
            p.start_timeout_s,
            p.start_timeout_s is None or (is_number(p.start_timeout_s) and p.start_timeout_s > 0),
            "a number of seconds > 0",
        ),
        ("plan.padding_batch_size", p.padding_batch_size, int_ge_1(p.padding_batch_size), "an integer >= 1"),
        (
            "plan.max_wait_s",
            p.max_wait_s,
            is_number(p.max_wait_s) and 0 <= p.max_wait_s < float("inf"),
            "a number of seconds >= 0",
        ),
        (
            "plan.output_order",
            p.output_order,
            p.output_order is None or p.output_order in OUTPUT_ORDERS,
            f"one of {', '.join(OUTPUT_ORDERS)}",
        ),
        (
            "ray.address",
            r.address,
            r.address is None or (isinstance(r.address, str) and bool(r.address.strip())),
            'a Ray address: "local", "auto", "ray://HOST:PORT" or HOST:PORT',
        ),
        (
            "ray.cpus_per_replica",
            r.cpus_per_replica,
            int_ge_1(r.cpus_per_replica, optional=True),
            "an integer >= 1",
        ),
        (
            "ray.max_restarts",
            r.max_restarts,
            is_int(r.max_restarts) and r.max_restarts >= -1,
            "an integer >= -1 (-1: without limit)",
        ),
    ]
    for name, value, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{(names or {}).get(name, name)} must be {expected}, got {shown(value)}")
    speculating = e.speculative_tail or e.extra_args.get("speculative_config")
    for name in ("min_p", "logit_bias"):
        if speculating and getattr(s, name):
            key = f"sampling.{name}"
            raise ConfigError(
                f"{(names or {}).get(key, key)} cannot be used with speculative decoding (engine.speculative_tail "
                "or speculative_config): vLLM refuses both min_p and logit_bias with it"
            )
    greedy = greedy_choices_expected(s.n, s.temperature)  # both of the right type by now
    if greedy:
        raise ConfigError(f"{(names or {}).get('sampling.n', 'sampling.n')} must be {greedy}, got {s.n}")
    for field in FIELDS.values():
        if field.problem is None or not field.accepts(CONFIG) or getattr(s, field.name) is None:
            continue
        problem = field.problem(getattr(s, field.name))
        if problem:
            name = f"sampling.{field.name}"
            raise ConfigError(f"{(names or {}).get(name, name)}: {problem}")


# Greedy sampling is temperature 0 exactly, and a greedy request may ask for
# one completion only: vLLM 0.32 ``SamplingParams.__post_init__`` raises a
# temperature in (0, 0.01) to 0.01 (``_MAX_TEMP``), then one under 1e-5
# (``_SAMPLING_EPS``: only 0 is left) calls ``_verify_greedy_sampling``,
# which raises "n must be 1 when using greedy sampling".
def greedy_choices_expected(n: int, temperature: float, temperature_from: str = "") -> str | None:
    """What ``n`` must be at ``temperature`` when vLLM would refuse it
    (several greedy completions, all the same one), or None when it takes it.
    ``temperature_from`` follows the temperature in the text (where it was set)."""
    if n > 1 and temperature == 0:
        return f"1 at temperature 0{temperature_from} (greedy sampling: vLLM refuses n > 1 with it)"
    return None


def pair_problem(values: Mapping[str, Any], max_tokens: int, given: Mapping[str, Any]) -> tuple[str, str, Any] | None:
    """The first two sampling fields of a request that vLLM refuses together
    (``min_tokens`` over ``max_tokens``: ``SamplingParams._verify_args``; ``n``
    > 1 at temperature 0: :func:`greedy_choices_expected`), as (the field's
    name, what it must be, its value), or None. ``values``: the request's
    fields with the ``[sampling]`` defaults filled in; ``given``: what the
    row set itself (a field it left out is named as the default: a row must
    not read as if it had set it)."""

    def named(field: str) -> str:
        return field if given.get(field) is not None else f"{field} (the [sampling] default)"

    if values["min_tokens"] > max_tokens:
        return named("min_tokens"), f"an integer <= max_tokens ({max_tokens})", values["min_tokens"]
    from_defaults = "" if given.get("temperature") is not None else ", the [sampling] default"
    greedy = greedy_choices_expected(values["n"], values["temperature"], from_defaults)
    return (named("n"), greedy, values["n"]) if greedy else None


def _sampling_checks(s: SamplingDefaults) -> list[tuple[str, Any, bool, str]]:
    """The ``[sampling]`` checks, from the table of request fields
    (:data:`bulkinfer.fields.FIELDS`): each field a ``[sampling]`` key, but
    those whose :attr:`~bulkinfer.fields.RequestField.problem` says what is
    wrong in its own words (checked after every other setting)."""
    checks = []
    for field in FIELDS.values():
        if field.accepts(CONFIG) and field.problem is None:
            value = getattr(s, field.name)
            ok = field.nullable if value is None else field.valid(value)
            checks.append((f"sampling.{field.name}", value, ok, field.expected))
    return checks


FEED_ORDERS: tuple[str, ...] = ("descending", "ascending", "arrival")


# engine.top_p_sampler: "auto", bulkinfer's nucleus processor on CPU (bulkinfer.engine.nucleus); "vllm", vLLM's sort.
TOP_P_SAMPLERS: tuple[str, ...] = ("auto", "vllm")


# engine.batch_order: "auto", the running batch in KV-block order on CPU (bulkinfer.engine.batch_order); "vllm", vLLM's.
BATCH_ORDERS: tuple[str, ...] = ("auto", "vllm")


OUTPUT_ORDERS: tuple[str, ...] = ("input", "completion")
