"""`bulkinfer embed` and `bulkinfer score`: the commands of an encoder job,
their flags declared once (:func:`encoder_command`); and `bulkinfer
eval-rank`, which scores the rankings of `score`.

This module evaluates its annotations (no ``from __future__ import
annotations``): each command's flags carry that command's help texts, which
Typer reads from the evaluated ``Annotated`` parameters of the function it
registers.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from bulkinfer.cli.app import Command, app, epilog, exit_codes
from bulkinfer.cli.options import (
    ConfigOption,
    DtypeOption,
    EngineArgOption,
    FileOutputOrderOption,
    MaxInFlightOption,
    MaxNumBatchedTokensOption,
    MaxNumSeqsOption,
    MetricsTextfileOption,
    NoPassthroughOption,
    OrderOption,
    OverwriteOption,
    PassthroughOption,
    PlainProgressOption,
    ResumeOption,
    VerboseOption,
    WindowRowsOption,
    described,
)
from bulkinfer.cli.run_command import summarize
from bulkinfer.cli.signals import invoke

DEFAULT_ENCODER_HELP = "the embedded all-minilm-l6-v2"


@dataclass(frozen=True, slots=True)
class EncoderCommand:
    """What sets apart ``bulkinfer embed`` and ``bulkinfer score``: the name
    (also that of the :mod:`bulkinfer` function it calls), its one-line
    help, the help of INPUT, --output, --model and --truncate, and examples."""

    name: str
    summary: str
    input: str
    output: str
    model: str
    truncate: str
    examples: tuple[str, ...]


def encoder_command(spec: EncoderCommand) -> None:
    """Register ``bulkinfer NAME`` (``spec.name``): INPUT, -o, --model,
    --truncate and the flags every encoder job shares; it calls
    ``bulkinfer.NAME(INPUT, OUT, settings, truncate=...)`` and exits with
    the job's exit code."""

    @app.command(spec.name, cls=Command, epilog=epilog(spec.examples), help=spec.summary)
    def command(
        input_path: Annotated[Path, typer.Argument(metavar="INPUT", help=spec.input)],
        output: Annotated[Path | None, typer.Option("--output", "-o", metavar="FILE", help=spec.output)] = None,
        model: Annotated[str | None, typer.Option(metavar="MODEL", help=spec.model)] = None,
        truncate: Annotated[bool, typer.Option("--truncate", help=spec.truncate)] = False,
        config: ConfigOption = None,
        passthrough: PassthroughOption = None,
        no_passthrough: NoPassthroughOption = False,
        overwrite: OverwriteOption = False,
        resume: ResumeOption = False,
        plain_progress: PlainProgressOption = False,
        verbose: VerboseOption = False,
        metrics_textfile: MetricsTextfileOption = None,
        dtype: DtypeOption = None,
        max_num_seqs: MaxNumSeqsOption = None,
        max_num_batched_tokens: MaxNumBatchedTokensOption = None,
        engine_arg: EngineArgOption = None,
        order: OrderOption = None,
        window_rows: WindowRowsOption = None,
        max_in_flight: MaxInFlightOption = None,
        output_order: FileOutputOrderOption = None,
    ) -> None:
        import bulkinfer

        options = {name: value for name, value in locals().items() if name != "spec"}
        summarize(invoke(options, getattr(bulkinfer, spec.name), input_path, output, truncate=truncate))


encoder_command(
    EncoderCommand(
        name="embed",
        summary="Embed every row of INPUT; write OUT (default Parquet), OUT.errors.jsonl and OUT.report.json.",
        input="Texts: rows with id and text (or input), or OpenAI /v1/embeddings batch lines; .jsonl or .parquet.",
        output=described(
            "Output: .parquet (embedding as fixed_size_list<float32>) or .jsonl.",
            "INPUT_STEM.embeddings.parquet beside INPUT",
        ),
        model=described(
            "A local embedding model directory (sentence-transformers layout) or prepared model name.",
            DEFAULT_ENCODER_HELP,
        ),
        truncate=described(
            "Cut a text over the model's max_seq_length tokens to it (as sentence-transformers does).",
            "such a row fails",
        ),
        examples=(
            "bulkinfer embed docs.jsonl",
            "bulkinfer embed docs.parquet -o vectors.parquet --truncate",
            "bulkinfer embed batch.jsonl -o batch.out.jsonl --model ./my-encoder",
            "bulkinfer embed docs.jsonl --resume",
        ),
    )
)
encoder_command(
    EncoderCommand(
        name="score",
        summary="Score pairs and rerank documents with an embedding model (cosine similarity) or a "
        "cross-encoder; write OUT, OUT.errors.jsonl and OUT.report.json.",
        input="Rows with text_1 and text_2 (a pair: its score), or query, documents and optional top_n "
        "(results ranked by relevance_score), or OpenAI-style /v1/score and /v1/rerank batch lines "
        "(vLLM's bodies); .jsonl or .parquet.",
        output=described("Output: .jsonl or .parquet.", "INPUT_STEM.scores.jsonl beside INPUT"),
        model=described(
            "A local model directory or prepared model name: an embedding model (a bi-encoder: a score is "
            "the cosine of the two texts' embeddings) or a one-label *ForSequenceClassification model (a "
            "cross-encoder: it reads each pair at once).",
            DEFAULT_ENCODER_HELP,
        ),
        truncate=described(
            "Cut what is over the model's max_seq_length tokens, as sentence-transformers does: a "
            "bi-encoder's texts each on its own, a cross-encoder's pair longest first.",
            "such a row fails",
        ),
        examples=(
            "bulkinfer score pairs.jsonl",
            "bulkinfer score queries.parquet -o ranked.parquet --truncate",
            "bulkinfer score pairs.jsonl --model ./my-encoder",
            "bulkinfer score rerank.jsonl --model ./my-cross-encoder",
            "bulkinfer score pairs.jsonl --resume",
        ),
    )
)


RANK_EXAMPLES = (
    "bulkinfer eval-rank golden-rerank.jsonl",
    "bulkinfer eval-rank golden-rerank.jsonl --model ./my-cross-encoder --truncate",
    "bulkinfer eval-rank golden-rerank.jsonl --predictions ranked.jsonl --measure nDCG@5 --measure AP",
    "bulkinfer eval-rank golden-rerank.jsonl --fail-under nDCG@10=0.6,RR@10=0.5",
)


@app.command(
    name="eval-rank",
    cls=Command,
    epilog=epilog(RANK_EXAMPLES, exit_codes(("8", "a measure is below its --fail-under bar"))),
)
def eval_rank_command(
    golden: Annotated[
        Path,
        typer.Argument(
            metavar="GOLDEN",
            help="Rerank rows with id, query, documents and relevant (the indices of the relevant documents, "
            "or an object of index -> graded relevance); .jsonl or .parquet.",
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", metavar="FILE", help=described("The scored rankings.", "GOLDEN_STEM.scores.jsonl")
        ),
    ] = None,
    predictions: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help=described("Evaluate this `bulkinfer score` output instead of running the model (by id).", "rerank"),
        ),
    ] = None,
    measure: Annotated[
        list[str] | None,
        typer.Option(
            metavar="MEASURE",
            help=described(
                "An ir-measures measure, repeatable: nDCG@10, RR@10 (MRR@10), R@10, P@5, AP, ...",
                "nDCG@10, RR@10, R@10",
            ),
        ),
    ] = None,
    fail_under: Annotated[
        str | None,
        typer.Option(
            metavar="MEASURE=BAR,...",
            help=described("Exit 8 when a measure's mean is below its bar (0-1), e.g. nDCG@10=0.6.", "none"),
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            metavar="MODEL", help=described("The scoring model, as for `bulkinfer score`.", DEFAULT_ENCODER_HELP)
        ),
    ] = None,
    truncate: Annotated[
        bool, typer.Option("--truncate", help=described("As `bulkinfer score --truncate`.", "off"))
    ] = False,
    config: ConfigOption = None,
    overwrite: OverwriteOption = False,
    resume: ResumeOption = False,
    plain_progress: PlainProgressOption = False,
    verbose: VerboseOption = False,
    metrics_textfile: MetricsTextfileOption = None,
    engine_arg: EngineArgOption = None,
) -> None:
    """Rerank GOLDEN (or take --predictions) and score the rankings with ir-measures: nDCG, MRR, recall."""
    options = dict(locals())  # first: only the options are local yet
    import bulkinfer
    from bulkinfer.cli.signals import fail
    from bulkinfer.errors import BulkinferError
    from bulkinfer.jobs.eval import eval_path
    from bulkinfer.jobs.eval_rank import DEFAULT_MEASURES
    from bulkinfer.metrics.ranking import parse_measures, parse_rank_bars
    from bulkinfer.report.eval_view import invalid_golden_line

    names = tuple(measure or DEFAULT_MEASURES)
    try:
        bars = parse_rank_bars(fail_under, parse_measures(names)) if fail_under else None
    except BulkinferError as exc:
        fail(exc)
    ranking = {"predictions": predictions, "measures": names, "fail_under": bars, "truncate": truncate}
    result = invoke(options, bulkinfer.evaluate_rank, golden, output, **ranking)
    report = result.report
    counts = report["row_counts"]
    scoring = report["scoring"]
    method = scoring.get("method", "unknown") if isinstance(scoring, dict) else scoring
    typer.echo(f"{counts['scored']} of {counts['golden']} queries scored (rankings by: {method})")
    if counts["invalid_golden"]:
        typer.echo(invalid_golden_line(counts["invalid_golden"]))
    for name, value in report["measures"].items():
        typer.echo(f"  {name:<12} {value:.4f}")
    typer.echo(f"written: {report['output']}, {eval_path(Path(report['output']))}")
    for line in result.below_bar:
        typer.echo(f"bulkinfer: below the bar: {line}", err=True)
    raise typer.Exit(code=result.exit_code)
