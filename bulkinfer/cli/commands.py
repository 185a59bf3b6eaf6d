"""`bulkinfer eval`, `plan`, `calibrate`, `report`, `models`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bulkinfer.cli.app import EXIT_CODES_HELP, app
from bulkinfer.cli.options import (
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
    _overrides,
)
from bulkinfer.cli.signals import StopSignals, fail
from bulkinfer.errors import BulkinferError


@app.command(name="eval", epilog=EXIT_CODES_HELP + " 8 a metric is below its --fail-under bar.")
def eval_command(
    golden: Annotated[Path, typer.Argument(help="Golden rows: prompt or messages, id, reference (.jsonl/.parquet).")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Scored predictions (default: GOLDEN_STEM.out.jsonl).")
    ] = None,
    predictions: Annotated[
        Path | None, typer.Option(help="Score this existing output instead of generating (rows matched by id).")
    ] = None,
    perplexity: Annotated[
        bool, typer.Option("--perplexity", help="Also the perplexity of each reference given its prompt.")
    ] = False,
    bootstrap: Annotated[int, typer.Option(help="Paired bootstrap resamples for 95% intervals (0: none).")] = 0,
    fail_under: Annotated[
        str | None, typer.Option(help="Exit 8 when a metric is below its bar, e.g. bleu=20,rougeL=30.")
    ] = None,
    compare: Annotated[Path | None, typer.Option(help="A previous OUT.eval.json: print each metric's change.")] = None,
    config: ConfigOption = None,
    model: ModelOption = None,
    apply_chat_template: ChatTemplateOption = None,
    raw_prompts: RawPromptsOption = False,
    max_tokens: MaxTokensOption = None,
    temperature: TemperatureOption = None,
    overwrite: OverwriteOption = False,
    resume: ResumeOption = False,
    plain_progress: PlainProgressOption = False,
    verbose: VerboseOption = False,
    engine_arg: EngineArgOption = None,
) -> None:
    """Run GOLDEN through the model (or take --predictions) and score it: BLEU, chrF, ROUGE, exact match, perplexity."""
    overrides = _overrides(locals())  # first: only the options are local yet
    from rich.console import Console

    from bulkinfer.config import load_settings
    from bulkinfer.io.formats import default_output
    from bulkinfer.jobs.eval import load_eval, print_eval, run_eval
    from bulkinfer.metrics.bars import parse_fail_under

    try:
        bars = parse_fail_under(fail_under) if fail_under else None
        previous = load_eval(compare) if compare else None
        settings = load_settings(config, overrides)
        with StopSignals() as stop_token:
            result = run_eval(
                golden,
                output or default_output(golden),
                settings,
                predictions=predictions,
                perplexity=perplexity,
                bootstrap=bootstrap,
                fail_under=bars,
                overwrite=overwrite,
                resume=resume,
                progress_plain=plain_progress,
                verbose=verbose,
                stop=stop_token,
            )
    except BulkinferError as exc:
        fail(exc)
    print_eval(result.report, previous, Console())
    for line in result.below_bar:
        typer.echo(f"bulkinfer: below the bar: {line}", err=True)
    raise typer.Exit(code=result.exit_code)


@app.command()
def plan(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT", help="Prompts: .jsonl or .parquet.")],
    config: ConfigOption = None,
    model: ModelOption = None,
    apply_chat_template: ChatTemplateOption = None,
    raw_prompts: RawPromptsOption = False,
    max_tokens: MaxTokensOption = None,
    max_model_len: MaxModelLenOption = None,
    buckets: BucketsOption = None,
    padding_batch_size: PaddingBatchSizeOption = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the plan as JSON to this file.")] = None,
) -> None:
    """Dry run: row counts, failures, prompt lengths, buckets, padding and a time estimate. Loads no engine."""
    overrides = _overrides(locals())  # first: only the options are local yet
    from rich.console import Console

    from bulkinfer.config import load_settings
    from bulkinfer.jobs.plan import plan_file
    from bulkinfer.report.stats import write_report
    from bulkinfer.report.terminal import print_plan

    try:
        result = plan_file(input_path, load_settings(config, overrides))
    except BulkinferError as exc:
        fail(exc)
    print_plan(result, Console())
    if json_out is not None:
        write_report(result, json_out)


@app.command()
def calibrate(
    config: Annotated[Path | None, typer.Option(help="TOML settings file (engine settings are used).")] = None,
    model: ModelOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Measure this machine with a short fixed workload; `bulkinfer plan` estimates from it."""
    from bulkinfer.config import load_settings
    from bulkinfer.jobs.calibrate import calibrate as run_calibration

    try:
        with StopSignals() as stop_token:
            entry = run_calibration(load_settings(config, {"model": model}), verbose=verbose, stop=stop_token)
    except BulkinferError as exc:
        fail(exc)
    typer.echo(
        f"calibrated: {entry['completion_tokens_per_s']:.1f} completion tokens/s, "
        f"{entry['prompt_tokens_per_s']:.1f} prompt tokens/s, load {entry['load_seconds']:.1f} s"
    )


@app.command()
def report(
    path: Annotated[Path, typer.Argument(help="A saved OUT.report.json (run) or OUT.eval.json (eval).")],
) -> None:
    """Re-render the terminal summary and the HTML report (OUT.report.html) from a saved report."""
    import orjson
    from rich.console import Console

    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        typer.echo(f"bulkinfer: error: cannot read {path}: {exc}", err=True)
        raise typer.Exit(code=2) from None
    html_path = path.with_name(
        path.name.removesuffix(".json").removesuffix(".report").removesuffix(".eval") + ".report.html"
    )
    if "scores" in data:
        from bulkinfer.jobs.eval import print_eval, read_predictions, write_eval_html

        output = Path(data["output"])
        records = read_predictions(output) if output.is_file() else []
        run_path = Path(data["run_report"]) if data.get("run_report") else None
        run_report = orjson.loads(run_path.read_bytes()) if run_path and run_path.is_file() else {}
        print_eval(data, None, Console())
        write_eval_html(data, run_report, records, html_path)
    else:
        from bulkinfer.report.html import write_run_html
        from bulkinfer.report.terminal import print_summary

        print_summary(data, Console())
        write_run_html(data, html_path)
    typer.echo(f"written: {html_path}")


@app.command()
def models() -> None:
    """List the models prepared under $BULKINFER_HOME (default ~/.cache/bulkinfer)."""
    from bulkinfer.default_model import bulkinfer_home
    from bulkinfer.models import list_models
    from bulkinfer.report.units import format_bytes

    found = list_models()
    if not found:
        typer.echo(f"no models prepared under {bulkinfer_home()}; `bulkinfer run` prepares the default one")
        return
    for info in found:
        typer.echo(f"{info.name}\t{format_bytes(info.size_bytes)}\t{info.path}")
