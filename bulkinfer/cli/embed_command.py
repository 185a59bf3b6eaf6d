"""`bulkinfer embed`: an embedding vector for every row."""

from __future__ import annotations

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

EXAMPLES = (
    "bulkinfer embed docs.jsonl",
    "bulkinfer embed docs.parquet -o vectors.parquet --truncate",
    "bulkinfer embed batch.jsonl -o batch.out.jsonl --model ./my-encoder",
    "bulkinfer embed docs.jsonl --resume",
)


@app.command(cls=Command, epilog=epilog(EXAMPLES))
def embed(
    input_path: Annotated[
        Path,
        typer.Argument(
            metavar="INPUT",
            help="Texts: rows with id and text (or input), or OpenAI /v1/embeddings batch lines; .jsonl or .parquet.",
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            help=described(
                "Output: .parquet (embedding as fixed_size_list<float32>) or .jsonl.",
                "INPUT_STEM.embeddings.parquet beside INPUT",
            ),
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            metavar="MODEL",
            help=described(
                "A local embedding model directory (sentence-transformers layout) or prepared model name.",
                "the embedded all-minilm-l6-v2",
            ),
        ),
    ] = None,
    truncate: Annotated[
        bool,
        typer.Option(
            "--truncate",
            help=described(
                "Cut a text over the model's max_seq_length tokens to it (as sentence-transformers does).",
                "such a row fails",
            ),
        ),
    ] = False,
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
    """Embed every row of INPUT; write OUT (default Parquet), OUT.errors.jsonl and OUT.report.json."""
    import bulkinfer

    summarize(invoke(dict(locals()), bulkinfer.embed, input_path, output, truncate=truncate))
