"""The saved reports as types: ``OUT.report.json`` of ``bulkinfer run`` and ``bulkinfer
embed`` (:class:`RunReport`); ``OUT.eval.json`` of ``bulkinfer eval`` and
``eval-rank`` in :mod:`bulkinfer.report.eval_model`, reading any of them
from a file in :mod:`bulkinfer.report.saved`.

One writer (:func:`bulkinfer.report.stats.write_report`) stamps every report
with ``report_version`` (:data:`REPORT_VERSION`); a report without one is
version 1 (bulkinfer up to commit c64a83e). Readers (the terminal summary, the
HTML report, ``bulkinfer report``) read these types, never the dict: a key that
an older bulkinfer did not write gets its default here, once, instead of a
``report.get(...)`` in every reader. The JSON Schema of both files is
``report.schema.json`` beside this module.

Units: tokens are counts of model tokens, ``*_s`` and ``seconds`` are seconds
of wall time, ``*_per_s`` are per second of wall time, ``*_bytes`` are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bulkinfer.errors import InputFileError
from bulkinfer.report.typed_json import Where, from_json

REPORT_VERSION = 2  # written today; 1: no such key (bulkinfer up to c64a83e); 2: the same keys, plus this one


@dataclass(frozen=True, slots=True)
class Counts:
    """Rows of the output: ``total`` = ``completed`` + ``failed`` (in the
    errors file) + ``skipped`` (blank input lines); resumed rows included."""

    total: int
    completed: int
    failed: int
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class Resumed:
    """Rows an earlier attempt finished (``--resume``)."""

    completed: int = 0
    failed: int = 0


@dataclass(frozen=True, slots=True)
class Tokens:
    """Prompt and completion tokens of the completed rows, resumed ones included."""

    prompt: int
    completion: int


@dataclass(frozen=True, slots=True)
class StartSeconds:
    """What ``load`` spent, in seconds: the ``tokenizer``'s load, the
    ``engine_choice`` (the dtype probe on a machine's first run, the KV cache
    size) and the ``engine``'s start; ``first_token``: from the run's start to
    the first completion token the engine reported (None: none was generated).
    Absent from reports before 2026-11-25 (zeros, None)."""

    tokenizer: float = 0.0
    engine_choice: float = 0.0
    engine: float = 0.0
    first_token: float | None = None


@dataclass(frozen=True, slots=True)
class Seconds:
    """Wall time in seconds by phase (``plan`` and ``write`` overlap
    ``generate``); ``total`` includes the model ``load``, itemised in ``start``."""

    load: float
    plan: float
    generate: float
    write: float
    total: float
    start: StartSeconds = StartSeconds()


@dataclass(frozen=True, slots=True)
class Throughput:
    """Rows and tokens of this attempt per second (of ``seconds.generate``,
    or of ``seconds.total`` end to end)."""

    requests_per_s: float
    prompt_tokens_per_s: float
    completion_tokens_per_s: float
    total_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Padding:
    """Real / padded prompt tokens (0-1) if batches of ``batch_size`` rows were
    padded, cut in ``arrival`` order and in length-sorted order within each
    length bucket, as bulkinfer feeds them (the key ``sorted``; ``plan`` calls
    it ``bucketed``, and its ``sorted`` is one global sort)."""

    batch_size: int
    arrival: float
    sorted: float


@dataclass(frozen=True, slots=True)
class PrefixCache:
    """Prompt tokens vLLM served from its prefix cache (``cached_tokens``) of
    ``prompt_tokens``; ``hit_rate`` = their ratio (0-1); ``estimate``: the
    plan's shareable-prefix count, None when the cache was off."""

    cached_tokens: int
    prompt_tokens: int
    hit_rate: float
    estimate: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Embedding:
    """``bulkinfer embed``: ``max_seq_length`` in tokens, whether vectors are
    L2-normalised (None: unknown), whether long inputs are truncated, and how many were."""

    max_seq_length: int
    normalize: bool | None
    truncate: bool
    truncated_inputs: int


@dataclass(frozen=True, slots=True)
class Scoring:
    """``bulkinfer score``: ``method`` ("bi-encoder cosine": each text
    embedded on its own, a score the cosine of two vectors; "cross-encoder":
    each pair read at once, a score the classifier's output), and of its
    inputs as :class:`Embedding` says (``truncated_inputs`` counts texts
    cut, each side of a pair on its own; for a cross-encoder, pairs cut)."""

    method: str
    max_seq_length: int
    normalize: bool | None
    truncate: bool
    truncated_inputs: int


@dataclass(frozen=True, slots=True)
class StructuredCounts:
    """Completions under one kind of constraint, checked against it."""

    completions: int
    valid: int
    cut_at_max_tokens: int
    invalid: int
    unchecked: int


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """vLLM's grammar ``backend`` and the counts by constraint kind (json, choice, regex, ...)."""

    backend: str | None
    by_kind: dict[str, StructuredCounts]


@dataclass(frozen=True, slots=True)
class LengthBin:
    """A histogram bin: ``rows`` whose length (tokens) falls in ``range`` ('low-high')."""

    range: str
    rows: int


@dataclass(frozen=True, slots=True)
class Bucket(LengthBin):
    """A prompt-length bucket: ``rows`` whose prompt tokens fall in ``range``,
    their real and padded prompt tokens in a static batcher,
    ``padding_efficiency`` = real / padded (0-1)."""

    real_tokens: int
    padded_tokens: int
    padding_efficiency: float


@dataclass(frozen=True, slots=True)
class TokenSeries:
    """The engine's cumulative live counts: ``seconds`` since generation
    started, ``completion_tokens`` generated and ``prompt_tokens`` processed (parallel lists)."""

    seconds: list[float]
    completion_tokens: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    interval_s: float | None = None
    source: str | None = None


@dataclass(frozen=True, slots=True)
class PassthroughField:
    """An input field copied to the output unread, with its row count, the
    bulkinfer field it resembles (``did_you_mean``), if any, and whether the
    output's own field of that name replaces it (``replaced``)."""

    name: str
    rows: int
    did_you_mean: str | None = None
    replaced: bool = False

    @property
    def note(self) -> str:
        """What the summary says of it: a near miss or a replaced field, else ""."""
        if self.replaced:
            return "replaced by the output's own field: not copied"
        return f"did you mean {self.did_you_mean}? copied, not read" if self.did_you_mean else ""


@dataclass(frozen=True, slots=True)
class Replica:
    """One engine replica's share: rows, tokens, busy seconds, completion
    tokens/s over them; ``deaths``, ``requeued`` and ``node`` are None in
    reports that predate them (or, for ``node``, without Ray)."""

    rows: int
    prompt_tokens: int
    completion_tokens: int
    busy_seconds: float
    completion_tokens_per_s: float
    deaths: int | None = None
    requeued: int | None = None
    node: str | None = None


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype the probe chose and why (its trials stay in ``engine_choice``)."""

    dtype: str
    why: str


@dataclass(frozen=True, slots=True)
class SchedulerChoice:
    """Scheduler limits measured by ``bulkinfer calibrate --tune``."""

    settings: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CompileChoice:
    """Eager or compiled, and why (:mod:`bulkinfer.jobs.compile_choice`)."""

    enforce_eager: bool
    why: str


@dataclass(frozen=True, slots=True)
class BlockSizeChoice:
    """The KV cache's block size (tokens; None: vLLM's) and why (:mod:`bulkinfer.jobs.block_choice`)."""

    block_size: int | None
    why: str


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """What bulkinfer measured or sized for this run's engine."""

    dtype: DtypeChoice | None = None
    scheduler: SchedulerChoice | None = None
    kv_cache: dict[str, Any] | None = None
    compile: CompileChoice | None = None
    block_size: BlockSizeChoice | None = None


@dataclass(frozen=True, slots=True)
class PeakRss:
    """Peak resident set size in bytes of bulkinfer and of its largest engine
    process (``children``); None when not recorded."""

    bulkinfer: int | None = None
    children: int | None = None


@dataclass(frozen=True, slots=True)
class RunReport:
    """``OUT.report.json`` of ``bulkinfer run`` (``job`` "run") or ``bulkinfer
    embed`` (``job`` "embed", with ``embedding`` and no sampling, finish
    reasons or structured outputs) or ``bulkinfer score`` (``job`` "score",
    with ``scoring``, no generation figures either). Paths are as the run was
    given them; keys an older bulkinfer did not write take the defaults below."""

    input: str
    output: str
    model: str
    request_counts: Counts
    tokens: Tokens
    seconds: Seconds
    throughput: Throughput
    padding_efficiency: Padding
    version: int = field(default=1, metadata={"key": "report_version"})
    job: str = "run"
    errors: str | None = None
    model_path: str | None = None
    resumed: Resumed = field(default_factory=Resumed)
    throughput_end_to_end: Throughput | None = None
    buckets: list[Bucket] = field(default_factory=list)
    prefix_cache: PrefixCache | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    replicas: list[Replica] = field(default_factory=list, metadata={"key": "engine.replicas"})
    replica_balance: float | None = field(default=None, metadata={"key": "engine.replica_balance"})
    sampling: dict[str, Any] | None = None
    sampling_set_by_rows: dict[str, int] = field(default_factory=dict)  # field -> rows that set their own
    chat_template_applied: bool | str | None = None  # None: the report does not say
    finish_reasons: dict[str, int] = field(default_factory=dict)
    structured_outputs: StructuredOutputs | None = None
    completion_length_histogram: list[LengthBin] = field(default_factory=list)
    tokens_over_time: TokenSeries | None = None
    passthrough_fields: list[PassthroughField] = field(default_factory=list)
    engine_choice: EngineChoice = field(default_factory=EngineChoice)
    peak_rss_bytes: PeakRss = field(default_factory=PeakRss)
    eta_trace: dict[str, Any] | None = None  # {"points": [[s, low, point, high]], "end_s"}: see report.schema.json
    input_changed: dict[str, Any] | None = None  # {"replaced", "read_whole", "changes", "message"}: the same
    embedding: Embedding | None = None
    scoring: Scoring | None = None

    @property
    def encoder(self) -> Embedding | Scoring | None:
        """The figures of an encoder job (embed or score; None for a run: it generated text)."""
        return self.embedding or self.scoring

    @property
    def engine_settings(self) -> dict[str, Any]:
        """The engine's settings without the per-replica figures."""
        return {k: v for k, v in self.engine.items() if k not in ("replicas", "replica_balance")}

    @classmethod
    def from_dict(cls, data: Any, source: str = "the run report") -> RunReport:
        """A run or embed report from its JSON object, version 1 or 2.

        Raises:
            InputFileError: ``data`` is no such report (a required key missing
                or of the wrong type, or a newer ``report_version``); the
                message names ``source`` (the file) and the key.
        """
        return typed_report(cls, data, source, "OUT.report.json")


def as_run_report(report: RunReport | dict[str, Any]) -> RunReport:
    """``report`` typed: a dict (as a run builds it) goes through :meth:`RunReport.from_dict`."""
    return report if isinstance(report, RunReport) else RunReport.from_dict(report)


def typed_report(cls: type[Any], data: Any, source: str, kind: str) -> Any:
    """``data`` as the report type ``cls`` (``kind``: the file's name, for messages).

    Raises:
        InputFileError: not a JSON object, a newer ``report_version``, or a
            required key missing or of the wrong type (named with ``source``).
    """
    if not isinstance(data, dict):
        raise InputFileError(f"{source}: not a saved {kind} (a JSON {type(data).__name__}, not an object)")
    version = data.get("report_version", 1)
    if isinstance(version, int) and version > REPORT_VERSION:
        raise InputFileError(
            f"{source}: report_version {version} was written by a newer bulkinfer; "
            f"this one reads versions 1 to {REPORT_VERSION}: upgrade bulkinfer"
        )
    return from_json(cls, data, Where(source, kind))
