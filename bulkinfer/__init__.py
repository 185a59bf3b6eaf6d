"""bulkinfer: offline bulk inference for LLMs on vLLM.

The public Python API: the functions the CLI calls, with the same defaults,
files and exit semantics, raising the :mod:`bulkinfer.errors` classes the
CLI maps to exit codes. They touch no process-wide state but the engine's
log capture (see :mod:`bulkinfer.engine.log`), install no signal handler,
and run in any thread; stop one from another thread with a
:class:`StopToken`::

    import bulkinfer

    result = bulkinfer.run("prompts.jsonl", max_tokens=64, temperature=0)
    print(result.completed, result.failed, result.report["throughput"])
    vectors = bulkinfer.embed("docs.jsonl", "docs.parquet")  # bulkinfer embed
    scores = bulkinfer.score("pairs.jsonl")  # bulkinfer score: INPUT_STEM.scores.jsonl

    with bulkinfer.open_engine(max_num_seqs=128) as engine:  # one engine start for many files
        for name in ("a.jsonl", "b.jsonl"):
            bulkinfer.run(name, engine=engine, max_tokens=64)

Option names (``**options``) are ``bulkinfer run``'s flags with
underscores (``max_tokens``, ``max_num_seqs``, ``order``, ...) and the
invocation's choices (``overwrite``, ``resume``, ``stop``, ``verbose``,
``progress_plain``, ``observer``: a :class:`RunObserver` told when the engine
is ready and rows finish); any other vLLM ``EngineArgs`` field goes in
``engine_args``.

Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bulkinfer.arguments import EVAL_OPTIONS, RANK_EVAL_OPTIONS, prepare, settings_with
from bulkinfer.config import Settings, load_settings
from bulkinfer.errors import ConfigError
from bulkinfer.stop import StopToken

if TYPE_CHECKING:
    from bulkinfer.jobs.context import RunObserver
    from bulkinfer.jobs.eval import EvalResult
    from bulkinfer.jobs.run import RunReport
    from bulkinfer.jobs.shared_engine import SharedEngine

__version__ = "0.1.0"
__all__ = [
    "EvalResult",
    "RunObserver",
    "RunReport",
    "Settings",
    "SharedEngine",
    "StopToken",
    "embed",
    "evaluate",
    "evaluate_rank",
    "load_settings",
    "open_engine",
    "plan",
    "run",
    "score",
]


def open_engine(
    settings: Settings | None = None, *, engine_args: Mapping[str, Any] | None = None, **overrides: Any
) -> SharedEngine:
    """Start one engine for several runs in this process: pass it as
    ``bulkinfer.run(..., engine=it)`` or ``bulkinfer.evaluate(...,
    engine=it)`` and the engine start (30-60 s on CPU) is paid once. Close
    it with ``.close()`` or a ``with`` block.

    The engine's settings are fixed here (``model=``, the ``[engine]``
    options, ``engine_args``): the dtype bulkinfer decides for this machine,
    the KV cache given or vLLM's default (not sized to one job). A run on
    it that gives an engine setting raises ConfigError. Each run's rows may
    set ``priority`` only if the engine was opened with
    ``engine_args={"scheduling_policy": "priority"}``.

    Raises:
        ConfigError, ModelError, EngineError: as :func:`run`'s engine start.
    """
    from bulkinfer.jobs.shared_engine import SharedEngine

    return SharedEngine(settings_with(settings, overrides, engine_args))


def run(
    input_path: str | Path,
    output_path: str | Path | None = None,
    settings: Settings | None = None,
    *,
    engine_args: Mapping[str, Any] | None = None,
    engine: SharedEngine | None = None,
    errors_path: str | Path | None = None,
    **options: Any,
) -> RunReport:
    """Generate a completion for every row of ``input_path`` (JSONL or
    Parquet): ``bulkinfer run``. Writes ``OUT`` (default
    ``INPUT_STEM.out.jsonl``), ``OUT.errors.jsonl``, ``OUT.report.json``,
    ``OUT.report.html`` and the engine's log ``OUT.log``; every input row ends
    as exactly one output or error record.

    ``input_path`` ``-`` reads JSONL rows from standard input as they arrive
    and writes each result as soon as it is done, in completion order, to
    ``output_path`` (default ``-``: standard output; failed rows' error
    records on the same stream, or in ``errors_path``, a JSONL file):
    :func:`bulkinfer.jobs.stream.stream`.

    Args:
        settings: a :class:`Settings` (e.g. from :func:`load_settings` on a
            TOML file); built-in defaults when None.
        engine_args: any other vLLM ``EngineArgs`` fields
            (``{"enable_prefix_caching": False}``), as ``--engine-arg``.
        engine: an engine from :func:`open_engine` to run on instead of
            starting one; the run then takes no model or engine option.
        **options: the invocation's choices (:data:`~bulkinfer.arguments.CONTEXT_OPTIONS`, see
            :class:`~bulkinfer.jobs.context.RunContext`): ``overwrite`` and
            ``resume`` as ``--overwrite`` / ``--resume``; ``stop``, a
            :class:`StopToken` to set (from any thread) to stop the run
            cleanly (finished rows stay on disk, resume with ``resume=True``;
            given as strings instead, ``stop="###"``, the sampling stop
            strings, as ``--stop``);
            ``verbose``, ``progress_plain``; ``observer``, a
            :class:`~bulkinfer.jobs.context.RunObserver` told when the engine
            is ready and rows finish. Any other: a ``bulkinfer run`` option
            by name (``max_tokens=64``).

    Returns:
        The :class:`RunReport`: the report and the exit code the CLI would end
        with (0, or 3 when some rows failed or rows added to the input after
        it was read past have no record: the report's ``input_changed``).

    Raises:
        ConfigError, InputFileError, ModelError, EngineError,
        OutputExistsError, LockHeldError, OutputWriteError, Interrupted: as
        :func:`bulkinfer.jobs.run.run` (exit codes 2, 4, 5, 6, 7, 9, 128+N).
    """
    from bulkinfer.io.output_files import RunPaths
    from bulkinfer.jobs.run import run as run_job

    run_settings, context = prepare(settings, options, engine_args, engine)
    if str(input_path) == "-":
        import sys

        from bulkinfer.jobs.stream import StreamPaths, stream

        out = StreamPaths.build(
            Path(output_path) if output_path is not None else None,
            Path(errors_path) if errors_path is not None else None,
        )
        _check_stdio(out)
        with _turn(engine, context.stop):
            return stream(sys.stdin.buffer, out, run_settings, context)
    if errors_path is not None:
        raise ConfigError(f"--errors is for a stream (INPUT -); a run of {input_path} writes OUT.errors.jsonl")
    paths = RunPaths.build(Path(input_path), Path(output_path) if output_path is not None else None)
    with _turn(engine, context.stop):
        return run_job(paths, run_settings, context)


def embed(
    input_path: str | Path,
    output_path: str | Path | None = None,
    settings: Settings | None = None,
    *,
    truncate: bool = False,
    engine_args: Mapping[str, Any] | None = None,
    **options: Any,
) -> RunReport:
    """Embed every row of ``input_path`` (JSONL or Parquet: rows with ``id``
    and ``text`` or ``input``, or OpenAI ``/v1/embeddings`` batch lines):
    ``bulkinfer embed``. Writes ``OUT`` (default ``INPUT_STEM.embeddings.parquet``,
    whose ``embedding`` column is ``fixed_size_list<float32>[dim]``),
    ``OUT.errors.jsonl``, ``OUT.report.json``, ``OUT.report.html`` and
    ``OUT.log``; every input row ends as exactly one output or error record.
    The model (``model=``) defaults to the embedded all-MiniLM-L6-v2.

    Args:
        truncate: cut an input over the model's ``max_seq_length`` tokens
            to it (``--truncate``) instead of failing its row.
        Others: as :func:`run` (``**options``: the invocation's choices and
            ``bulkinfer embed``'s options by name).

    Returns:
        The :class:`RunReport` (exit code 0, or 3 as :func:`run`'s).

    Raises:
        As :func:`run`.
    """
    from bulkinfer.jobs.embed import DEFAULT_SUFFIX
    from bulkinfer.jobs.embed import embed as embed_job

    return _encoder_job(embed_job, DEFAULT_SUFFIX, (input_path, output_path, settings, truncate), engine_args, options)


def score(
    input_path: str | Path,
    output_path: str | Path | None = None,
    settings: Settings | None = None,
    *,
    truncate: bool = False,
    engine_args: Mapping[str, Any] | None = None,
    **options: Any,
) -> RunReport:
    """Score every row of ``input_path`` (JSONL or Parquet): ``bulkinfer
    score``. An embedding model (a bi-encoder) scores by the cosine of the
    texts' embeddings; a one-label ``*ForSequenceClassification`` model (a
    cross-encoder) reads each pair at once and outputs its score.
    Pair rows (``text_1``, ``text_2``) get a ``score``; rerank rows
    (``query``, ``documents``, optional ``top_n``, ``return_documents``)
    get ``results`` (``[{index, relevance_score}]``, best first). Writes
    ``OUT`` (default ``INPUT_STEM.scores.jsonl``), ``OUT.errors.jsonl``,
    ``OUT.report.json``, ``OUT.report.html`` and ``OUT.log``; every input
    row ends as exactly one output or error record. The model (``model=``)
    defaults to the embedded all-MiniLM-L6-v2.

    Args:
        truncate: cut each text over the model's ``max_seq_length`` tokens
            to it, each side of a pair on its own (a cross-encoder's pair:
            longest first) (``--truncate``), instead of failing its row.
        Others: as :func:`embed`.

    Returns:
        The :class:`RunReport` (exit code 0, or 3 as :func:`run`'s).

    Raises:
        As :func:`run`; ConfigError for a cross-encoder with more than one label.
    """
    from bulkinfer.jobs.score import DEFAULT_SUFFIX
    from bulkinfer.jobs.score import score as score_job

    return _encoder_job(score_job, DEFAULT_SUFFIX, (input_path, output_path, settings, truncate), engine_args, options)


def _encoder_job(
    job: Any,
    suffix: str,
    given: tuple[str | Path, str | Path | None, Settings | None, bool],
    engine_args: Mapping[str, Any] | None,
    options: Mapping[str, Any],
) -> RunReport:
    """Run an encoder ``job`` (:func:`bulkinfer.jobs.embed.embed` or
    :func:`bulkinfer.jobs.score.score`) on ``given`` (input, output or None
    for ``INPUT_STEM`` + ``suffix``, settings, truncate)."""
    from bulkinfer.io.output_files import RunPaths

    input_path, output_path, settings, truncate = given
    job_settings, context = prepare(settings, options, engine_args, None)
    out = Path(output_path) if output_path is not None else None
    report: RunReport = job(RunPaths.build(Path(input_path), out, suffix), job_settings, context, truncate)
    return report


def evaluate_rank(
    golden: str | Path,
    output_path: str | Path | None = None,
    settings: Settings | None = None,
    *,
    engine_args: Mapping[str, Any] | None = None,
    **options: Any,
) -> EvalResult:
    """Rerank a golden set with :func:`score` (or take ``predictions``) and
    score the rankings with ir-measures: ``bulkinfer eval-rank``. Golden rows
    are rerank rows with ``relevant`` (document indices, or index -> grade).
    Writes the scored rows (default ``GOLDEN_STEM.scores.jsonl``) and
    ``OUT.eval.json`` (``measures``: each measure's mean, 0-1).

    Args:
        **options: the ranking options (:data:`RANK_EVAL_OPTIONS`, see
            :class:`~bulkinfer.jobs.eval_rank.RankEvalOptions`):
            ``predictions`` (a score output to evaluate instead of running
            the model), ``measures`` (ir-measures names; default nDCG@10,
            RR@10, R@10), ``fail_under`` (measure -> bar, ``{"nDCG@10":
            0.5}``: exit code 8 below it), ``truncate``; then as :func:`score`'s.
        the others: as :func:`score`.

    Returns:
        The :class:`~bulkinfer.jobs.eval.EvalResult`.

    Raises:
        as :func:`score`; InputFileError when no golden row has a usable
        ``relevant``; ConfigError for an unknown measure, or when no ranking
        matches a golden id.
    """
    from bulkinfer.io.formats import default_output
    from bulkinfer.jobs.eval_rank import RankEvalOptions, run_eval_rank
    from bulkinfer.jobs.score import DEFAULT_SUFFIX

    golden = Path(golden)
    ranking = RankEvalOptions(**{name: options.pop(name) for name in RANK_EVAL_OPTIONS if name in options})
    rank_settings, context = prepare(settings, options, engine_args, None)
    out = Path(output_path) if output_path is not None else default_output(golden, DEFAULT_SUFFIX)
    return run_eval_rank(golden, out, rank_settings, context, ranking)


def plan(
    input_path: str | Path,
    settings: Settings | None = None,
    *,
    job: str = "run",
    truncate: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """Read and tokenize ``input_path`` as :func:`run` would (``job="score"``:
    as :func:`score` would, with ``truncate``), without an engine:
    ``bulkinfer plan``. Returns the plan (row counts, errors by type,
    prompt-token percentiles, buckets, padding efficiency, a time estimate
    as a range of seconds from this model's calibrations on this machine
    at the dtype the run would take,
    or None with the reason in ``estimate_source``; see
    :func:`bulkinfer.jobs.plan.plan_file`).

    Raises:
        ConfigError, InputFileError, ModelError: as :func:`run`.
    """
    from bulkinfer.jobs.plan import plan_file

    return plan_file(Path(input_path), settings_with(settings, overrides, None), job, truncate)


def _check_stdio(paths: Any) -> None:
    """A stream's standard input and the standard output it writes to were
    not closed when bulkinfer started (``<&-``, ``>&-``: :func:`bulkinfer.engine.log.closed_stdio`).

    Raises:
        InputFileError: standard input was closed (exit 4).
        OutputWriteError: standard output was closed and records go there (exit 9).
    """
    from bulkinfer.engine.log import closed_stdio
    from bulkinfer.errors import InputFileError, OutputWriteError

    closed = closed_stdio()
    if 0 in closed:
        raise InputFileError("standard input was closed (<&-): a stream (INPUT -) has no rows to read")
    if 1 in closed and Path("-") in (paths.output, paths.errors):
        raise OutputWriteError("standard output was closed (>&-): a stream's records go there; give -o OUT.jsonl")


def evaluate(
    golden: str | Path,
    output_path: str | Path | None = None,
    settings: Settings | None = None,
    *,
    engine_args: Mapping[str, Any] | None = None,
    engine: SharedEngine | None = None,
    **options: Any,
) -> EvalResult:
    """Generate completions for a golden set (or take ``predictions``) and
    score them against its references: ``bulkinfer eval``. Writes the scored
    rows (default ``GOLDEN_STEM.out.jsonl``) and ``OUT.eval.json``.

    Args:
        engine: as :func:`run` (the perplexity pass uses it too).
        **options: the scoring options (:data:`~bulkinfer.arguments.EVAL_OPTIONS`, see
            :class:`~bulkinfer.jobs.eval.EvalOptions`): ``predictions`` (a
            file to score instead of generating), ``perplexity`` (also the
            perplexity of each reference given its prompt), ``bootstrap``
            (paired resamples for 95% intervals; 0: none), ``fail_under``
            (metric -> bar, ``{"bleu": 20}``: exit code 8 below it); then as
            :func:`run`'s.
        the others: as :func:`run`.

    Returns:
        The :class:`~bulkinfer.jobs.eval.EvalResult`: the eval report, the
        exit code (8 below a bar, else the generation's) and the bars missed.

    Raises:
        as :func:`run`; ConfigError when no prediction matches a golden id.
    """
    from bulkinfer.io.formats import default_output
    from bulkinfer.jobs.eval import EvalOptions, run_eval

    golden = Path(golden)
    scoring = EvalOptions(**{name: options.pop(name) for name in EVAL_OPTIONS if name in options})
    eval_settings, context = prepare(settings, options, engine_args, engine)
    out = Path(output_path) if output_path is not None else default_output(golden)
    with _turn(engine, context.stop):
        return run_eval(golden, out, eval_settings, context, scoring)


def _turn(engine: SharedEngine | None, stop: StopToken) -> AbstractContextManager[None]:
    """The job's turn on a shared ``engine`` (:meth:`SharedEngine.turn`); no wait without one."""
    return engine.turn(stop) if engine is not None else nullcontext()


def __getattr__(name: str) -> Any:
    """The result types, imported when first asked for (keeps ``import bulkinfer`` light)."""
    if name == "RunReport":
        from bulkinfer.jobs.run import RunReport

        return RunReport
    if name == "EvalResult":
        from bulkinfer.jobs.eval import EvalResult

        return EvalResult
    if name == "RunObserver":
        from bulkinfer.jobs.context import RunObserver

        return RunObserver
    if name == "SharedEngine":
        from bulkinfer.jobs.shared_engine import SharedEngine

        return SharedEngine
    raise AttributeError(f"module 'bulkinfer' has no attribute {name!r}")
