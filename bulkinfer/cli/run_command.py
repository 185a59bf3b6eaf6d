"""`bulkinfer run`: every option of a run, as flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bulkinfer.cli.app import EXIT_CODES_HELP, app
from bulkinfer.cli.options import (
    _ENGINE,
    _PLAN,
    ENGINE,
    PLAN,
    SAMPLING,
    BucketsOption,
    ChatTemplateOption,
    ConfigOption,
    EngineArgOption,
    MaxModelLenOption,
    MaxTokensOption,
    ModelOption,
    OverwriteOption,
    PaddingBatchSizeOption,
    PlainProgressOption,
    RawPromptsOption,
    ResumeOption,
    TemperatureOption,
    VerboseOption,
    _origins,
    _overrides,
)
from bulkinfer.cli.signals import StopSignals, fail
from bulkinfer.errors import BulkinferError


@app.command(epilog=EXIT_CODES_HELP)
def run(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT", help="Prompts: .jsonl or .parquet.")],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Output .jsonl or .parquet (default: INPUT_STEM.out.jsonl beside INPUT)."),
    ] = None,
    config: ConfigOption = None,
    model: ModelOption = None,
    apply_chat_template: ChatTemplateOption = None,
    raw_prompts: RawPromptsOption = False,
    overwrite: OverwriteOption = False,
    resume: ResumeOption = False,
    plain_progress: PlainProgressOption = False,
    verbose: VerboseOption = False,
    max_tokens: MaxTokensOption = None,
    temperature: TemperatureOption = None,
    top_p: Annotated[
        float | None,
        typer.Option(
            help="Nucleus sampling: the smallest token set of this probability mass, in (0, 1].",
            rich_help_panel=SAMPLING,
        ),
    ] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).", rich_help_panel=SAMPLING)] = None,
    ignore_eos: Annotated[
        bool | None,
        typer.Option("--ignore-eos", help="Generate max_tokens even past EOS (benchmarks).", rich_help_panel=SAMPLING),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="Weights and activations: auto (float32 on CPU, 16-bit on GPU), float32, bfloat16, float16.",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    tensor_parallel_size: Annotated[
        int | None,
        typer.Option(help=f"GPUs per model replica (default {_ENGINE.tensor_parallel_size}).", rich_help_panel=ENGINE),
    ] = None,
    data_parallel_size: Annotated[
        int | None,
        typer.Option(
            help=f"Model replicas, each on its own GPUs (default {_ENGINE.data_parallel_size}).", rich_help_panel=ENGINE
        ),
    ] = None,
    max_model_len: MaxModelLenOption = None,
    max_num_seqs: Annotated[
        int | None, typer.Option(help="Sequences per engine step at most.", rich_help_panel=ENGINE)
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(help="Tokens per engine step at most.", rich_help_panel=ENGINE)
    ] = None,
    gpu_memory_utilization: Annotated[
        float | None, typer.Option(help="Fraction (0-1] of GPU memory the engine may use.", rich_help_panel=ENGINE)
    ] = None,
    kv_cache_memory_bytes: Annotated[
        int | None,
        typer.Option(
            help="KV cache bytes per GPU, instead of --gpu-memory-utilization "
            "(CPU default: 25% of available memory, 1..8 GiB).",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    enforce_eager: Annotated[
        bool | None,
        typer.Option(
            "--enforce-eager",
            help="Eager PyTorch: no torch.compile or CUDA graphs (default on CPU).",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    no_enforce_eager: Annotated[
        bool,
        typer.Option(
            "--no-enforce-eager", help="Allow torch.compile and CUDA graphs (default on GPU).", rich_help_panel=ENGINE
        ),
    ] = False,
    seed: Annotated[
        int | None, typer.Option(help=f"Engine random seed (default {_ENGINE.seed}).", rich_help_panel=ENGINE)
    ] = None,
    trust_remote_code: Annotated[
        bool | None,
        typer.Option(
            "--trust-remote-code", help="Allow the model repository's own Python code to run.", rich_help_panel=ENGINE
        ),
    ] = None,
    engine_arg: EngineArgOption = None,
    order: Annotated[
        str | None,
        typer.Option(help="Feed order: descending (longest first; default), ascending, arrival.", rich_help_panel=PLAN),
    ] = None,
    buckets: BucketsOption = None,
    window_rows: Annotated[
        int | None,
        typer.Option(help=f"Rows read and sorted together (default {_PLAN.window_rows}).", rich_help_panel=PLAN),
    ] = None,
    max_in_flight: Annotated[
        int | None,
        typer.Option(help="Requests in the engine at once (default 2 x max_num_seqs).", rich_help_panel=PLAN),
    ] = None,
    padding_batch_size: PaddingBatchSizeOption = None,
    stall_timeout_s: Annotated[
        float | None,
        typer.Option(
            help="Seconds one engine step may take before the engine counts as stuck "
            f"(default {_PLAN.stall_timeout_s:g}).",
            rich_help_panel=PLAN,
        ),
    ] = None,
) -> None:
    """Generate a completion for every row of INPUT; write OUT, OUT.errors.jsonl and OUT.report.json."""
    overrides, origins = _overrides(locals()), _origins(locals())  # first: only the options are local yet
    from rich.console import Console

    from bulkinfer.config import load_settings
    from bulkinfer.jobs.output_files import RunPaths
    from bulkinfer.jobs.run import run as run_job
    from bulkinfer.report.terminal import print_summary

    try:
        settings = load_settings(config, overrides, origins)
        paths = RunPaths.build(input_path, output)
        with StopSignals() as stop_token:
            result = run_job(
                paths,
                settings,
                overwrite=overwrite,
                resume=resume,
                progress_plain=plain_progress,
                verbose=verbose,
                stop=stop_token,
            )
    except BulkinferError as exc:
        fail(exc)
    if result.report.get("already_complete"):
        typer.echo(f"bulkinfer: {paths.output} is already complete; nothing to do")
    else:
        print_summary(result.report, Console())
    raise typer.Exit(code=result.exit_code)
