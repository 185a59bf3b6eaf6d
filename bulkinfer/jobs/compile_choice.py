"""Eager or compiled: whether a CPU job's engine runs vLLM's compiled model
(``torch.compile``, vLLM's default) or eager PyTorch (``enforce_eager``,
bulkinfer's default on CPU until measured otherwise).

Compiling costs start-up seconds (the first time on a machine: the whole
compilation; after that the compile cache, see
:func:`~bulkinfer.engine.args.compile_cache_dir`, gives most of it back)
and may make each engine step faster. So it pays from some number of
completion tokens on, and that number is measured, per model, dtype and
machine, by ``bulkinfer calibrate --compile`` (:func:`measure_compile`):
one eager engine and two compiled ones, each in a fresh process as a
run's is (the first fills the cache, the second starts from it), each
start timed, and the first two generating the same fixed workload
(:data:`TRIAL_TOKENS`).

A run then decides (:func:`choose_compile`), where the user set neither
``enforce_eager`` nor ``--no-enforce-eager``: compiled when the job's
expected completion tokens times the seconds compiling saves a token exceed
the start-up it adds (the warm figure when a compiled engine of the same
settings started on this machine before and its cache is still there, the
cold one otherwise), eager otherwise; the report's ``engine_choice.compile``
says which and why, with the break-even. Unmeasured, a job runs eager.

The break-even in completion tokens: ``extra start s / (1 / eager tok/s - 1 /
compiled tok/s)`` (the trials' means); none when compiling was not clearly
faster (:func:`clearly_faster`: every compiled trial beat every eager one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bulkinfer.config import Settings, with_engine
from bulkinfer.engine.args import compile_cache_dir, import_vllm, this_machine, vllm_version
from bulkinfer.engine.base import EngineFactory
from bulkinfer.jobs.tune import speed
from bulkinfer.models import load_tokenizer
from bulkinfer.report.calibration import record_choice, stored_choice

# Each engine runs the speed trial this many times; compiled counts as faster only when its slowest trial beats
# eager's fastest (runs of one system on a 2-core AMD EPYC Zen 3 differed by up to 20% within an hour: compiled
# measured 1.10-1.15x and 0.87-0.96x eager in bench.compile rounds of the same day, bench/results/compile*.md).
TRIALS = 2


# The speed trial of each engine (after a warm-up of 16 x 4 tokens): TRIAL_ROWS chat prompts, row i generating
# TRIAL_TOKENS[i] tokens (ignore_eos), 32 to 512 spread evenly on a log scale (about 11,000 in all): the batch
# thins out as rows finish, as a real job's long tail does. Compilation's gain depends on it: on a 2-core AMD EPYC
# Zen 3 (float32) compiled ran 1.10-1.13x eager on 100 ShareGPT rows (bench/results/compile-vllm-cache-only.md)
# but 0.99x on 128 rows x 64 tokens, a batch that never thins (bulkinfer calibrate --compile, 2026-11-26).
TRIAL_ROWS = 64


TRIAL_TOKENS = tuple(round(32 * 16 ** (i / (TRIAL_ROWS - 1))) for i in range(TRIAL_ROWS))


# The engine settings vLLM's compiled graph depends on (besides model and dtype): a compiled start with the same
# ones finds the compile cache warm (not the KV cache size: vLLM 0.32 CacheConfig.compute_hash ignores it).
GRAPH_SETTINGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens")


def compile_machine(settings: Settings) -> dict[str, Any]:
    """What the compile measurement depends on: CPU, cores, vLLM version and the dtype."""
    return {**this_machine(), "vllm": vllm_version(), "dtype": settings.engine.dtype}


def _graph_key(settings: Settings) -> dict[str, Any]:
    return {**compile_machine(settings), **{k: getattr(settings.engine, k) for k in GRAPH_SETTINGS}}


def cache_warm(model: str, settings: Settings) -> dict[str, Any] | None:
    """The record of a compiled engine of ``model`` with these graph settings
    started on this machine (:func:`record_compiled_start`), when the compile
    cache it filled (:func:`~bulkinfer.engine.args.compile_cache_dir`) is
    still there; else None."""
    cache = compile_cache_dir()
    if not cache.is_dir() or not any(cache.iterdir()):
        return None
    return stored_choice("compile_cache", model, _graph_key(settings))


def record_compiled_start(model: str, settings: Settings, start_s: float) -> None:
    """Remember that a compiled engine of ``model`` with ``settings`` started
    here (in ``start_s`` seconds): the compile cache now holds its graph."""
    record_choice("compile_cache", model, _graph_key(settings), {"start_s": round(start_s, 2)})


def break_even(extra_start_s: float, eager_rate: float, compiled_rate: float) -> float | None:
    """Completion tokens from which a compiled engine that starts
    ``extra_start_s`` seconds later and generates ``compiled_rate`` completion
    tokens/s (``eager_rate`` eager) finishes first; None when it is not faster."""
    if compiled_rate <= eager_rate:
        return None
    return max(0.0, extra_start_s) / (1 / eager_rate - 1 / compiled_rate)


def clearly_faster(eager: dict[str, Any], compiled: dict[str, Any]) -> bool:
    """Whether the compiled engine's slowest trial beat the eager engine's
    fastest (each's ``trial_rates``, else its one ``completion_tokens_per_s``)."""
    slowest = min(compiled.get("trial_rates") or [compiled["completion_tokens_per_s"]])
    return bool(slowest > max(eager.get("trial_rates") or [eager["completion_tokens_per_s"]]))


def choose_compile(model: str, settings: Settings, expected_tokens: int | None) -> tuple[Settings, dict[str, Any]]:
    """``settings`` with ``enforce_eager`` decided for a CPU job expected to
    generate ``expected_tokens`` completion tokens (None: unknown), and the
    report's ``engine_choice.compile`` (``enforce_eager``, ``why``, and when
    measured ``break_even_completion_tokens``, ``expected_completion_tokens``,
    ``cache``: warm or cold). See the module docstring."""
    if settings.engine.enforce_eager is not None:
        return settings, {"enforce_eager": settings.engine.enforce_eager, "why": "set by the user"}
    if settings.engine.data_parallel_size > 1:
        why = "replicas: compilation was measured for one engine on every core, not for one on a share of them"
        return with_engine(settings, enforce_eager=True), {"enforce_eager": True, "why": why}
    measured = stored_choice("compile", model, compile_machine(settings))
    if measured is None:
        why = "compilation not measured for this model and dtype here (bulkinfer calibrate --compile measures it)"
        return with_engine(settings, enforce_eager=True), {"enforce_eager": True, "why": why}
    warm = cache_warm(model, settings)
    eager, compiled = measured["eager"], measured["compiled"]
    start = compiled["warm_start_s"] if warm else compiled.get("cold_start_s")
    choice: dict[str, Any] = {"cache": "warm" if warm else "cold", "expected_completion_tokens": expected_tokens}
    if start is None:  # measured with the cache already warm: what a cold start costs is unknown
        why = "the compile cache is cold for these settings and a cold compile was not measured here"
        return with_engine(settings, enforce_eager=True), {"enforce_eager": True, "why": why, **choice}
    speeds = eager["completion_tokens_per_s"], compiled["completion_tokens_per_s"]
    tokens = break_even(start - eager["start_s"], *speeds) if clearly_faster(eager, compiled) else None
    choice["break_even_completion_tokens"] = None if tokens is None else round(tokens)
    rates = (
        f"compiled {compiled['completion_tokens_per_s']:.1f} vs eager {eager['completion_tokens_per_s']:.1f} "
        f"completion tok/s, start {start:.1f} vs {eager['start_s']:.1f} s with the compile cache "
        f"{choice['cache']} (measured {measured['measured_at']})"
    )
    if tokens is None:
        use_eager, why = True, f"compiling is not faster here: {rates}"
    elif expected_tokens is None:
        use_eager = True
        why = f"the job's size is unknown; compiling pays from {tokens:,.0f} completion tokens: {rates}"
    else:
        use_eager = expected_tokens < tokens
        side = "under" if use_eager else "at or over"
        why = (
            f"the job's expected {expected_tokens:,} completion tokens are {side} the break-even of "
            f"{tokens:,.0f}: {rates}"
        )
    return with_engine(settings, enforce_eager=use_eager), {"enforce_eager": use_eager, "why": why, **choice}


def _timed_engine(model: str, settings: Settings, engine_factory: EngineFactory, trials: bool) -> dict[str, Any]:
    """Start an engine of ``model`` at ``settings`` in this process, timed
    (vLLM imported first, as a run has it when its engine starts), with
    ``trials`` the warm-up and :data:`TRIALS` speed trials, then close it:
    ``{"start_s", "trial_rates"}`` (seconds; completion tokens/s, empty without ``trials``)."""
    tokenizer = load_tokenizer(model, settings.engine.trust_remote_code)  # imports torch._dynamo, as a run's does
    import_vllm()
    clock = time.monotonic()
    engine = engine_factory(model, settings)
    start_s = time.monotonic() - clock
    try:
        rates: list[float] = []
        if trials:
            speed(engine, tokenizer, 16, 4)  # warm-up
            rates = [round(speed(engine, tokenizer, TRIAL_ROWS, TRIAL_TOKENS)[0], 2) for _ in range(TRIALS)]
    finally:
        engine.close()
    return {"start_s": round(start_s, 2), "trial_rates": rates}


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a new Python process (``multiprocessing`` spawn: nothing
    imported, compiled or cached in memory yet, as at a run's start); its
    result or exception (pickled) comes back. Output goes where this
    process's file descriptors 1 and 2 go."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def measure_compile(
    model: str,
    settings: Settings,
    engine_factory: EngineFactory,
    say: Callable[[str], None] | None = None,
    isolate: Callable[..., Any] = in_fresh_process,
) -> dict[str, Any]:
    """Measure eager against compiled for ``model`` at ``settings``' dtype
    on this machine and store it (see the module docstring); returns the
    stored entry: ``eager`` (``start_s``, ``completion_tokens_per_s``: the
    mean of ``trial_rates``, :data:`TRIALS` of them) and ``compiled``
    (``cold_start_s``: the first compiled start, ``warm_start_s``: the second,
    ``completion_tokens_per_s``, ``trial_rates``). The compile cache is warm
    for these settings afterwards.

    Each engine starts in a process of its own (``isolate``, default
    :func:`in_fresh_process`), as a run's does: torch's compile caches key a
    graph by what the process compiled before it, and a compiled engine
    started after another engine (or the dtype probe) in one process wrote
    a cache entry the next run never found, so that run compiled again
    (66-89 s engine start instead of 27-36 s; Intel Xeon, 2026-11-28).

    Raises:
        EngineError: an engine fails to start or a request fails.
    """
    earlier = stored_choice("compile", model, compile_machine(settings))
    results: dict[str, dict[str, Any]] = {}
    for name, eager in (("eager", True), ("compiled", False), ("compiled again", False)):
        if say:
            say(f"compile: starting the {name} engine")
        variant = with_engine(settings, enforce_eager=eager, data_parallel_size=1)
        was_warm = cache_warm(model, variant) is not None
        timed = isolate(_timed_engine, model, variant, engine_factory, name != "compiled again")
        if name == "compiled again":  # the start is what this one measures
            results["compiled"]["warm_start_s"] = timed["start_s"]
            continue
        trials = timed["trial_rates"]
        rate = round(sum(trials) / len(trials), 2)
        results[name] = {"start_s": timed["start_s"], "completion_tokens_per_s": rate, "trial_rates": trials}
        if not eager:  # a cold start only if the compile cache did not hold it yet; else the earlier cold figure
            cold = earlier["compiled"].get("cold_start_s") if was_warm and earlier else None
            results[name] = {"cold_start_s": cold if was_warm else timed["start_s"], **results[name]}
            record_compiled_start(model, variant, timed["start_s"])
    trial = {"rows": TRIAL_ROWS, "completion_tokens": sum(TRIAL_TOKENS)}
    entry = {"eager": results["eager"], "compiled": results["compiled"], "trial": trial}
    return record_choice("compile", model, compile_machine(settings), entry)
