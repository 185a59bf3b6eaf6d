"""`bulkinfer embed` and `bulkinfer score`: the commands of an encoder job,
their flags declared once (:func:`encoder_command`).

This module evaluates its annotations (no ``from __future__ import
annotations``): each command's flags carry that command's help texts, which
Typer reads from the evaluated ``Annotated`` parameters of the function it
registers.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from bulkinfer.cli.app import Command, app, epilog
from bulkinfer.cli.options import (
    ConfigOption,
    DtypeOption,
    EngineArgOption,
    MaxInFlightOption,
    MaxNumBatchedTokensOption,
    MaxNumSeqsOption,
    NoPassthroughOption,
    OrderOption,
    OutputOrderOption,
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
        dtype: DtypeOption = None,
        max_num_seqs: MaxNumSeqsOption = None,
        max_num_batched_tokens: MaxNumBatchedTokensOption = None,
        engine_arg: EngineArgOption = None,
        order: OrderOption = None,
        window_rows: WindowRowsOption = None,
        max_in_flight: MaxInFlightOption = None,
        output_order: OutputOrderOption = None,
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
