"""Which engine settings a job runs with: the one place that decides them.

From what the user gave and what was measured on this machine:

- the dtype (the probe's stored decision, see :mod:`bulkinfer.jobs.tune`)
  and the scheduler limits ``calibrate --tune`` measured, on CPU;
- the KV cache's block size, on CPU, for a job whose rows ask several
  choices (:mod:`bulkinfer.jobs.block_choice`);
- the KV cache sized to the job (:func:`job_tokens`), on CPU, when the
  engine lives as long as the job;
- eager or compiled, on CPU (:mod:`bulkinfer.jobs.compile_choice`: by the
  costs ``calibrate --compile`` measured and the job's work; unmeasured, at
  bfloat16, by a prior and the dtype probe's eager rate);
- transparent huge pages paused or kept while the engine starts, on CPU
  (:func:`choose_huge_pages`: by the job's expected generation time);
- vLLM's priority scheduling when rows may set a ``priority``.

The engine itself is then built by the run's engine factory (by default
:func:`bulkinfer.engine.factory.vllm_engine`, which picks a backend from
:data:`bulkinfer.engine.factory.BACKENDS`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.config import Settings, with_engine
from bulkinfer.engine.args import detect_device
from bulkinfer.engine.factory import vllm_engine
from bulkinfer.engine.kv_cache import kv_cache_left_to_bulkinfer, sized_kv_cache
from bulkinfer.engine.malloc import huge_page_fault_s_per_gib
from bulkinfer.errors import BulkinferError
from bulkinfer.io.formats import JSONL, SUFFIXES, format_suffix
from bulkinfer.io.inputs import InputScan
from bulkinfer.io.readers import RawRow, open_reader
from bulkinfer.jobs.block_choice import choose_block_size
from bulkinfer.jobs.compile_choice import choose_compile
from bulkinfer.jobs.decode_steps import DecodeWork, decode_work
from bulkinfer.jobs.tune import TUNE_DEFAULTS, known_dtype, measured_settings, print_to_stderr
from bulkinfer.prep.planner import Planner, with_parts
from bulkinfer.prep.rows import RowParser

# Tokens a row's chat template adds beyond its JSON bytes / 2 (and its n x max_tokens completion tokens).
TEMPLATE_TOKENS = 64


# Rows of a JSONL input tokenized before the engine starts, to size its KV cache (job_tokens).
SAMPLE_ROWS = 1024


# The rows not sampled may hold more tokens per byte than the sampled ones: their prompts' estimate, times this.
SAMPLE_MARGIN = 1.25


# The share of a job's generation time its engine saves with its KV cache in transparent huge pages: 2.8%
# (ShareGPT-200, bfloat16 compiled, 6 GiB: 494.2-496.8 completion tok/s kept against 472.1-491.6 without huge pages,
# means 495.3 and 481.7; 3.1% against paused at the start an hour later; AMD EPYC Zen 4,
# bench/results/huge-pages-ab-sharegpt-n200-zen4.md).
HUGE_PAGE_GAIN = 0.028


# Huge pages are paused only when their start costs this many times what they save: both figures are rough (the
# start's cost per GiB measured 1.0-4.5 s/GiB on one CPU, the gain 2.8-3.1%), so only a clear case leaves the default.
PAUSE_MARGIN = 2.0


def choose_engine_settings(
    model: str,
    settings: Settings,
    scan: InputScan,
    measure: bool,
    size_kv_cache: bool,
    sample: Callable[[], TokenSample | None] | None = None,
) -> tuple[Settings, dict[str, Any]]:
    """``settings`` for the engine of a job on ``model`` (a local path) with
    input ``scan``, and the report's ``engine_choice`` (what was chosen and why).

    Args:
        measure: apply what was measured for generation on this machine (the
            dtype probe, run now if never stored; the tuned scheduler limits).
        size_kv_cache: on CPU, a KV cache sized to the job's tokens instead of
            vLLM's default (off when the engine outlives the job).
        sample: gives the input's first rows tokenized (:func:`sample_tokens`),
            which size the KV cache better than the input's bytes alone and
            give the compile choice each row's own ``max_tokens`` and the
            block size's choice the rows of several choices; called at most once,
            only on CPU when bulkinfer sizes the cache or decides eager
            against compiled.

    Raises:
        EngineError: the dtype probe's engine fails.
    """
    choice: dict[str, Any] = {}
    if measure:
        # the probe starts engines of its own: never a kept engine (serve and eval pass one), which it would reuse
        device = detect_device()
        settings, choice = measured_settings(model, settings, device, vllm_engine, print_to_stderr)
        rows = functools.cache(sample) if sample is not None else lambda: None  # taken once, when first needed
        if size_kv_cache:
            settings, block = block_size_choice(settings, device, rows)
            if block is not None:
                choice["block_size"] = block
        if size_kv_cache and device == "cpu" and kv_cache_left_to_bulkinfer(settings.engine):
            tokens = job_tokens(settings, scan, rows())
            running = running_sequences(settings, scan, rows())
            if tokens is not None and (kv := sized_kv_cache(model, settings.engine, tokens, running)):
                settings = with_engine(settings, kv_cache_memory_bytes=kv["kv_cache_memory_bytes"])
                choice["kv_cache"] = {**kv, "job_tokens": tokens, "running_sequences": running}
                choice["kv_cache"]["tokens_from"] = tokens_from(rows())
        if device == "cpu":
            decides = size_kv_cache and settings.engine.enforce_eager is None
            expected = expected_completion_tokens(settings, scan, rows()) if decides else None
            work = expected_decode_work(settings, scan, rows()) if decides else None
            rate = _probe_rate(choice.get("dtype"), settings.engine.dtype)
            if rate is None and decides:  # a dtype the user set: the rate the stored probe measured at it, if any
                rate = _probe_rate(known_dtype(model), settings.engine.dtype)
            settings, choice["compile"] = choose_compile(model, settings, expected, work, rate)
            generation = _generation_s(choice["compile"], expected, rate) if decides else None
            settings, choice["huge_pages"] = choose_huge_pages(settings, generation)
    return with_priority_scheduling(settings, scan.mentions_priority), choice


def block_size_choice(
    settings: Settings, device: str, sample: Callable[[], TokenSample | None]
) -> tuple[Settings, dict[str, Any] | None]:
    """``settings`` with the KV cache's block size a run of a local CPU
    engine chooses (:func:`~bulkinfer.jobs.block_choice.choose_block_size`,
    from the input's first rows tokenized by ``sample``, called only when the
    block is left to bulkinfer), and the report's ``engine_choice.block_size``;
    None where nothing is chosen (a GPU's, or a Ray cluster's replicas)."""
    if device != "cpu" or settings.ray.address not in (None, "local"):
        return settings, None
    return choose_block_size(settings, lambda: _shared_prompts(sample()))


def _shared_prompts(sample: TokenSample | None) -> tuple[tuple[tuple[int, int], ...] | None, int | None]:
    """The arguments of :func:`~bulkinfer.jobs.block_choice.choose_block_size`
    from a ``sample`` (None: none taken)."""
    if sample is None:
        return None, None
    return sample.shared_prompts, sample.prompt_tokens + sample.completion_tokens


def choose_huge_pages(
    settings: Settings,
    generation_s: float | None,
    fault_s_per_gib: Callable[[], float | None] = huge_page_fault_s_per_gib,
) -> tuple[Settings, dict[str, Any]]:
    """``settings`` with ``huge_pages_at_start`` decided for a CPU job whose
    generation is expected to take ``generation_s`` seconds (None: unknown),
    and the report's ``engine_choice.huge_pages`` (``at_start``, ``why``;
    when decided by the costs ``fault_s_per_gib``, ``kv_cache_gib``,
    ``start_cost_s``, ``steps_gain_s``).

    An engine that starts with its KV cache in transparent huge pages steps
    :data:`HUGE_PAGE_GAIN` faster; faulting them in costs what
    ``fault_s_per_gib()`` gives for this machine (seconds per GiB over 4
    KiB pages: :func:`bulkinfer.engine.malloc.huge_page_fault_s_per_gib`)
    times the cache's size. Paused when that start costs more than
    :data:`PAUSE_MARGIN` times what the steps would save; kept when the
    user set it, the sizes are unknown, or there is more than one worker
    (the pause is for an engine in bulkinfer's process).
    """
    engine = settings.engine
    if engine.huge_pages_at_start is not None:
        return settings, {"at_start": engine.huge_pages_at_start, "why": "set by the user"}
    kv = engine.kv_cache_memory_bytes
    one_worker = engine.data_parallel_size == engine.tensor_parallel_size == 1
    if not one_worker or kv is None or generation_s is None:
        why = "kept: " + ("more than one worker" if not one_worker else "the job's generation time or KV cache unknown")
        return settings, {"at_start": True, "why": why}
    measured = fault_s_per_gib()
    if measured is None:
        return settings, {"at_start": True, "why": "kept: this machine offers no transparent huge pages to pause"}
    gib = kv / (1 << 30)
    cost, gain = measured * gib, HUGE_PAGE_GAIN * generation_s
    keep = cost <= PAUSE_MARGIN * gain
    where = "a VM whose host takes free memory back" if measured else "fresh memory is backed at once here"
    why = (
        f"{'kept' if keep else 'paused'}: faulting the {gib:.2f} GiB KV cache in huge pages is expected to cost "
        f"{cost:.1f} s of the start ({measured:.1f} s/GiB over 4 KiB pages: {where}) against {gain:.1f} s "
        f"saved over {generation_s:.0f} s of generation ({HUGE_PAGE_GAIN:.1%} faster steps; paused only when the "
        f"start costs over {PAUSE_MARGIN:g}x that)"
    )
    decided = {"at_start": keep, "why": why, "fault_s_per_gib": round(measured, 3), "kv_cache_gib": round(gib, 3)}
    decided.update(start_cost_s=round(cost, 1), steps_gain_s=round(gain, 1))
    return with_engine(settings, huge_pages_at_start=keep), decided


def _generation_s(compile_choice: dict[str, Any], tokens: int | None, eager_rate: float | None) -> float | None:
    """The job's expected generation seconds: the compile choice's decode
    cost of the engine it chose, else ``tokens`` at the dtype probe's eager
    rate (completion tokens/s); None when neither is known."""
    seconds = compile_choice.get("expected_generation_s")
    if seconds:
        return float(seconds["eager" if compile_choice["enforce_eager"] else "compiled"])
    return tokens / eager_rate if tokens and eager_rate else None


def _probe_rate(dtype_choice: dict[str, Any] | None, dtype: str) -> float | None:
    """The completion tokens/s the dtype probe measured at ``dtype`` (an
    eager engine), from a dtype choice's trials (the report's
    ``engine_choice.dtype``, or the stored probe's:
    :func:`bulkinfer.jobs.tune.known_dtype`); None when it holds no timed
    trial at ``dtype`` (the user set the dtype and no probe ran here)."""
    for trial in (dtype_choice or {}).get("trials") or ():
        if trial.get("dtype") == dtype and trial.get("completion_tokens_per_s"):
            return float(trial["completion_tokens_per_s"])
    return None


def with_priority_scheduling(settings: Settings, rows_set_priority: bool) -> Settings:
    """``settings`` with vLLM's ``scheduling_policy = "priority"`` when rows
    may set a ``priority`` (or ``[sampling] priority`` is set), unless
    ``[engine] scheduling_policy`` is given: vLLM refuses a request's
    priority under its default first-come-first-served policy."""
    extra = settings.engine.extra_args
    if "scheduling_policy" in extra or not (rows_set_priority or settings.sampling.priority):
        return settings
    return with_engine(settings, extra_args={**extra, "scheduling_policy": "priority"})


def expected_completion_tokens(settings: Settings, scan: InputScan, sample: TokenSample | None = None) -> int | None:
    """The most completion tokens a job generates (as ``plan``'s estimate,
    every row generating all of its ``n x max_tokens``): with a ``sample``
    of the input's first rows (:func:`sample_tokens`), their own ``n x
    max_tokens`` per row over ``scan.rows`` (all of them when the sample is
    the whole input); without one, ``rows x n x`` the default
    ``max_tokens``. None when the input's size is unknown or the engines run
    on other machines (a Ray cluster's, whose compile figures this one lacks)."""
    if scan.rows is None or settings.ray.address not in (None, "local"):
        return None
    if sample is not None and sample.whole:
        return sample.completion_tokens
    if sample is not None and sample.rows > 0:
        return math.ceil(sample.completion_tokens / sample.rows * scan.rows)
    return scan.rows * settings.sampling.n * settings.sampling.max_tokens


def running_sequences(settings: Settings, scan: InputScan, sample: TokenSample | None = None) -> int:
    """The most sequences of a job that hold KV-cache blocks at once: its
    sequences (a row of ``n`` choices counts ``n``; from the ``sample``'s rows
    scaled to ``scan.rows``, else ``rows x n``) up to the engine's
    ``max_num_seqs`` (vLLM's default, 256, when unset; all of them for an
    input of unknown size)."""
    slots = settings.engine.max_num_seqs or TUNE_DEFAULTS["max_num_seqs"]
    if scan.rows is None:
        return slots
    if sample is not None and sample.lengths and sample.rows > 0:
        sequences = len(sample.lengths) if sample.whole else math.ceil(len(sample.lengths) / sample.rows * scan.rows)
    else:
        sequences = scan.rows * settings.sampling.n
    return min(sequences, slots)


def expected_decode_work(settings: Settings, scan: InputScan, sample: TokenSample | None) -> DecodeWork | None:
    """The job's decode work (:func:`~bulkinfer.jobs.decode_steps.decode_work`)
    from the ``sample``'s rows (each row's prompt and ``n x max_tokens``
    tokens) scaled to ``scan.rows``, at the engine's ``max_num_seqs``
    (vLLM's default, 256, when unset); None without a sample with its rows'
    lengths, an input of unknown size, or engines on other machines."""
    if sample is None or not sample.lengths or scan.rows is None or settings.ray.address not in (None, "local"):
        return None
    rows = len(sample.lengths) if sample.whole else math.ceil(len(sample.lengths) / sample.rows * scan.rows)
    slots = settings.engine.max_num_seqs or TUNE_DEFAULTS["max_num_seqs"]
    return decode_work(sample.lengths, rows, slots)


def job_tokens(settings: Settings, scan: InputScan, sample: TokenSample | None = None) -> int | None:
    """About how many tokens a job's prompts and completions take.

    With a ``sample`` of the input's first rows tokenized (:func:`sample_tokens`):
    its tokens when it is the whole input; else its prompt tokens per input
    byte over the input's ``scan.bytes``, times :data:`SAMPLE_MARGIN`, plus
    its completion tokens per row over ``scan.rows``. Without one: the
    input's ``scan.bytes / 2`` plus ``rows x (n x max_tokens +
    TEMPLATE_TOKENS)``, generous on purpose (English runs ~4 bytes a token,
    and the bytes count every field: 590 KB of 300 ShareGPT rows, with their
    reference replies, held 44k prompt tokens). None when the input's size is
    unknown or the engines run on other machines (a Ray cluster's)."""
    if scan.rows is None or scan.bytes is None or settings.ray.address not in (None, "local"):
        return None  # unknown size; or a cluster's machines, whose memory this one does not know
    if sample is not None and sample.whole:
        return sample.prompt_tokens + sample.completion_tokens
    if sample is not None and sample.bytes > 0 and sample.rows > 0:
        prompts = sample.prompt_tokens / sample.bytes * scan.bytes * SAMPLE_MARGIN
        return math.ceil(prompts + sample.completion_tokens / sample.rows * scan.rows)
    sampling = settings.sampling
    return scan.bytes // 2 + scan.rows * (sampling.n * sampling.max_tokens + TEMPLATE_TOKENS)


def tokens_from(sample: TokenSample | None) -> str:
    """Where :func:`job_tokens` took its count from, for the report."""
    if sample is None:
        return "the input's bytes / 2"
    if sample.whole:
        return f"every row tokenized ({sample.rows})"
    return f"the first {sample.rows} rows tokenized, over the input's bytes"


@dataclass(frozen=True, slots=True)
class TokenSample:
    """The first rows of an input as the run tokenizes them: ``rows`` that
    parsed, their ``bytes`` (each row's JSON, compact, and a newline: at most
    its line's bytes), ``prompt_tokens`` (chat template applied),
    ``completion_tokens`` (each row's ``n x max_tokens``); ``whole``: every
    row of the input was read; ``lengths``: each sequence's (prompt tokens,
    ``max_tokens``), a row of ``n`` choices ``n`` times, a row of several
    prompts (an OpenAI ``prompt`` list) once a prompt; ``shared_prompts``:
    each prompt of a row of more than one choice, as (prompt tokens, ``n``)."""

    rows: int
    bytes: int
    prompt_tokens: int
    completion_tokens: int
    whole: bool
    lengths: tuple[tuple[int, int], ...] = ()
    shared_prompts: tuple[tuple[int, int], ...] = ()


def input_sample(path: Path, tokenizer: Any, settings: Settings, parse: RowParser) -> TokenSample | None:
    """A JSONL input's first rows tokenized (:func:`sample_tokens`), from a
    reader of their own, to size the KV cache, count the rows' own
    ``max_tokens`` for the compile choice and the rows of several choices for
    the block size; None for Parquet (its bytes are column bytes, not rows'),
    for what is not a regular file (a pipe cannot be read twice) or when the
    input cannot be read again."""
    if SUFFIXES.get(format_suffix(path)) != JSONL or not path.is_file():
        return None
    rows = iter(open_reader(path))
    try:
        return sample_tokens(rows, tokenizer, settings.resolve_chat_template(tokenizer), parse)
    except (OSError, BulkinferError):
        return None
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()


def sample_tokens(
    rows: Iterable[RawRow], tokenizer: Any, settings: Settings, parse: RowParser, limit: int = SAMPLE_ROWS
) -> TokenSample | None:
    """The first ``limit`` of ``rows`` (a JSONL input's, from a reader of its
    own) parsed with ``parse`` and tokenized as
    :class:`~bulkinfer.prep.planner.Planner` does (``settings`` with
    ``apply_chat_template`` resolved); rows that fail are left out (the run
    reports them). None when no row parsed. Never raises for a row."""
    planner = Planner(tokenizer, settings.plan, max_model_len=1 << 62)
    count = size = prompts = completions = 0
    read = 0
    lengths: list[tuple[int, int]] = []
    shared: list[tuple[int, int]] = []
    for raw in itertools.islice(rows, limit + 1):
        read += 1
        if read > limit or raw.error is not None:
            continue
        try:
            request = parse(raw.data, read, raw.line, settings)
            each = [len(planner.encode(part)) for part in with_parts([replace(request)])]
        except Exception:  # the row's own error, reported when the run reads it
            continue
        count += 1
        size += len(orjson.dumps(raw.data)) + 1
        prompts += sum(each)
        completions += request.max_completion_tokens
        n = int(request.options.get("n", 1))
        lengths += [(tokens, request.max_tokens) for tokens in each for _ in range(n)]
        shared += [(tokens, n) for tokens in each] if n > 1 else []
    if not count:
        return None
    whole = read <= limit
    return TokenSample(count, size, prompts, completions, whole, tuple(lengths), tuple(shared))
