"""`bulkinfer eval`, `plan`, `calibrate`, `report`, `models`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from bulkinfer.cli.app import Command, app, epilog, exit_codes
from bulkinfer.cli.options import (
    BootstrapOption,
    BucketsOption,
    ChatTemplateOption,
    CompareOption,
    ConfigOption,
    DtypeOption,
    EnforceEagerOption,
    EngineArgOption,
    EvalOutputOption,
    FailUnderOption,
    FileOutputOrderOption,
    GoldenArgument,
    InputArgument,
    MaxModelLenOption,
    MaxTokensOption,
    MetricsTextfileOption,
    ModelOption,
    NoEnforceEagerOption,
    NOption,
    OverwriteOption,
    PaddingBatchSizeOption,
    PerplexityOption,
    PlainProgressOption,
    PredictionsOption,
    RawPromptsOption,
    ResumeOption,
    TemperatureOption,
    VerboseOption,
    described,
    settings_from_flags,
)
from bulkinfer.cli.signals import StopSignals, fail, invoke
from bulkinfer.errors import EXIT_PARTIAL, BulkinferError, ConfigError, InputFileError

EVAL_EXAMPLES = (
    "bulkinfer eval golden.jsonl",
    "bulkinfer eval golden.jsonl --predictions golden.out.jsonl",
    "bulkinfer eval golden.jsonl --perplexity --bootstrap 1000",
    "bulkinfer eval golden.jsonl --fail-under bleu=20 --compare last.eval.json",
)


@app.command(
    name="eval",
    cls=Command,
    epilog=epilog(EVAL_EXAMPLES, exit_codes(("8", "a metric is below its --fail-under bar"))),
)
def eval_command(
    golden: GoldenArgument,
    output: EvalOutputOption = None,
    predictions: PredictionsOption = None,
    perplexity: PerplexityOption = False,
    bootstrap: BootstrapOption = 0,
    fail_under: FailUnderOption = None,
    compare: CompareOption = None,
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
    metrics_textfile: MetricsTextfileOption = None,
    engine_arg: EngineArgOption = None,
    output_order: FileOutputOrderOption = None,
) -> None:
    """Run GOLDEN through the model (or take --predictions) and score it: BLEU, chrF, ROUGE, exact match, perplexity."""
    options = dict(locals())  # first: only the options are local yet
    from rich.console import Console

    import bulkinfer
    from bulkinfer.jobs.eval import eval_path, load_eval
    from bulkinfer.metrics.bars import parse_fail_under
    from bulkinfer.report.eval_view import print_eval

    try:
        bars = parse_fail_under(fail_under) if fail_under else None
        previous = load_eval(compare) if compare else None
    except BulkinferError as exc:
        fail(exc)
    scoring = {"predictions": predictions, "perplexity": perplexity, "bootstrap": bootstrap, "fail_under": bars}
    result = invoke(options, bulkinfer.evaluate, golden, output, **scoring)
    print_eval(result.report, previous, Console())
    typer.echo(f"written: {result.report['output']}, {eval_path(Path(result.report['output']))}")
    for line in result.below_bar:
        typer.echo(f"bulkinfer: below the bar: {line}", err=True)
    raise typer.Exit(code=result.exit_code)


# plan's flags only a generation (--job run) reads: option -> flag
GENERATION_FLAGS = {
    "apply_chat_template": "--apply-chat-template",
    "raw_prompts": "--raw-prompts",
    "max_tokens": "--max-tokens",
    "n": "-n",
    "temperature": "--temperature",
}
PLAN_EXAMPLES = (
    "bulkinfer plan prompts.jsonl",
    "bulkinfer plan prompts.jsonl --max-tokens 128 --json plan.json",
    "bulkinfer plan prompts.jsonl --strict",
    "bulkinfer plan rerank.jsonl --job score --model ./my-cross-encoder",
)


@app.command(
    cls=Command,
    epilog=epilog(
        PLAN_EXAMPLES,
        (
            (
                ("0", "planned"),
                ("2", "usage or config error"),
                ("3", "some rows would fail (with --strict)"),
                ("4", "the input is missing or unreadable"),
                ("5", "the model cannot be found or loaded"),
            )
        ),
    ),
)
def plan(
    input_path: InputArgument,
    config: ConfigOption = None,
    model: ModelOption = None,
    apply_chat_template: ChatTemplateOption = None,
    raw_prompts: RawPromptsOption = False,
    max_tokens: MaxTokensOption = None,
    n: NOption = None,
    temperature: TemperatureOption = None,
    max_model_len: MaxModelLenOption = None,
    dtype: DtypeOption = None,
    enforce_eager: EnforceEagerOption = None,
    no_enforce_eager: NoEnforceEagerOption = False,
    buckets: BucketsOption = None,
    padding_batch_size: PaddingBatchSizeOption = None,
    json_out: Annotated[
        Path | None,
        typer.Option("--json", metavar="FILE", help=described("Also write the plan as JSON to this file.", "none")),
    ] = None,
    strict: Annotated[bool, typer.Option("--strict", help=described("Exit 3 when any row would fail.", "off"))] = False,
    job: Annotated[
        str,
        typer.Option(
            metavar="JOB",
            show_default=False,
            help=described(
                "The job to plan: run (generation), or score (pairs and reranking, as `bulkinfer score`: "
                "--model an embedding model or a cross-encoder).",
                "run",
            ),
        ),
    ] = "run",
    truncate: Annotated[
        bool, typer.Option("--truncate", help=described("With --job score: as `bulkinfer score --truncate`.", "off"))
    ] = False,
) -> None:
    """Dry run: row counts, failures, prompt lengths, buckets, padding and a time estimate. Loads no engine."""
    options = dict(locals())  # first: only the options are local yet
    from rich.console import Console

    from bulkinfer.jobs.plan import plan_file
    from bulkinfer.report.stats import write_json
    from bulkinfer.report.terminal import print_plan

    # a flag the planned job would not read: refused, not dropped
    unread = GENERATION_FLAGS if job == "score" else {"truncate": "--truncate"} if job == "run" else {}
    given = [flag for name, flag in unread.items() if options[name] not in (None, False)]
    try:
        if given:
            raise ConfigError(
                f"{', '.join(given)}: --job {job} does not read it (`bulkinfer {job}` takes no such flag)"
            )
        result = plan_file(input_path, settings_from_flags(config, options), job, truncate)
    except BulkinferError as exc:
        fail(exc)
    print_plan(result, Console())
    if json_out is not None:
        write_json(result, json_out)
    if strict and result["rows"]["failed"]:
        failed = result["rows"]["failed"]
        typer.echo(f"bulkinfer: {failed} row{'s' if failed > 1 else ''} would fail (--strict)", err=True)
        raise typer.Exit(code=EXIT_PARTIAL)


@app.command(
    cls=Command,
    epilog=epilog(
        ("bulkinfer calibrate", "bulkinfer calibrate --model ./my-model --config configs/default.toml"),
        (("0", "calibrated"), ("2", "usage or config error"), ("5", "the model cannot be found or loaded")),
    ),
)
def calibrate(
    config: ConfigOption = None,
    model: ModelOption = None,
    verbose: VerboseOption = False,
    tune: Annotated[
        bool,
        typer.Option("--tune", help=described("Also tune max_num_seqs, max_num_batched_tokens (minutes).", "off")),
    ] = False,
    compile_: Annotated[
        bool,
        typer.Option(
            "--compile",
            help=described(
                "Also measure compiled against eager engines on CPU: the break-even runs choose by; "
                "warms the compile cache (minutes).",
                "off",
            ),
        ),
    ] = False,
) -> None:
    """Measure this machine: the dtype, optionally the scheduler limits, and throughput (for `plan`)."""
    options = dict(locals())  # first: only the options are local yet
    from bulkinfer.jobs.calibrate import calibrate as run_calibration

    try:
        with StopSignals() as stop_token:
            result = run_calibration(
                settings_from_flags(config, options),
                verbose=verbose,
                stop=stop_token,
                tune_scheduler=tune,
                compile_break_even=compile_,
            )
    except BulkinferError as exc:
        fail(exc)
    if result["dtype_probe"]:
        probe = result["dtype_probe"]
        trials = ", ".join(
            f"{t['dtype']} perplexity {t['perplexity']:.3f} at {t['completion_tokens_per_s']:.1f} tok/s"
            for t in probe["trials"]
        )
        typer.echo(f"dtype: {probe['dtype']} ({trials}; {probe['why']})")
    if result["tuned"]:
        tried = ", ".join(
            f"{'/'.join(str(v) for v in t['settings'].values())}: {t['completion_tokens_per_s']:.1f}"
            for t in result["tuned"]["trials"]
        )
        chosen = ", ".join(f"{k}={v}" for k, v in result["tuned"]["settings"].items())
        typer.echo(f"scheduler: {chosen} (max_num_seqs/max_num_batched_tokens: completion tok/s {tried})")
    if result["compile"]:
        eager, compiled = result["compile"]["eager"], result["compile"]["compiled"]
        cold = compiled["cold_start_s"]
        typer.echo(
            f"compile: eager {eager['completion_tokens_per_s']:.1f} tok/s, start {eager['start_s']:.1f} s; "
            f"compiled {compiled['completion_tokens_per_s']:.1f} tok/s, start "
            f"{'unmeasured' if cold is None else f'{cold:.1f} s'} cold, {compiled['warm_start_s']:.1f} s warm"
        )
        for name, side in (("eager", eager), ("compiled", compiled)):
            if cost := side.get("decode_cost"):
                typer.echo(
                    f"compile: {name} decode step {1000 * cost['fixed_s']:.2f} ms + {1000 * cost['per_row_s']:.3f} ms "
                    f"a row + {1e6 * cost['per_context_token_s']:.2f} us a context token"
                )
    entry = result["calibration"]
    typer.echo(
        f"calibrated: {entry['completion_tokens_per_s']:.1f} completion tokens/s, "
        f"{entry['prompt_tokens_per_s']:.1f} prompt tokens/s, load {entry['load_seconds']:.1f} s"
    )


@app.command(
    cls=Command,
    epilog=epilog(
        ("bulkinfer report answers.out.report.json", "bulkinfer report golden.out.eval.json"),
        (("0", "rendered"), ("4", "the report is missing or unreadable")),
    ),
)
def report(
    path: Annotated[
        Path, typer.Argument(metavar="REPORT", help="A saved OUT.report.json (of run) or OUT.eval.json (of eval).")
    ],
) -> None:
    """Re-render the terminal summary and the HTML report (OUT.report.html) from a saved report."""
    from rich.console import Console

    from bulkinfer.io.output_files import same_file
    from bulkinfer.report.eval_model import EvalReport
    from bulkinfer.report.model import RunReport
    from bulkinfer.report.saved import beside, load_report

    stem = path.name.removesuffix(".json").removesuffix(".report").removesuffix(".eval")
    html_path = path.with_name(stem + ".report.html")
    scores: dict[str, Any] | None = None  # the eval's report, when the page is an eval's
    run_report: dict[str, Any] = {}  # the run report of an eval's generation, when it is found
    try:
        saved, data = load_report(path)
        if isinstance(saved, EvalReport):
            scores, eval_path = data, path
            if run_path := beside(saved.run_report, path):
                generated, run_report = load_report(run_path)
                if not isinstance(generated, RunReport):
                    raise InputFileError(f"{run_path} (the run_report of {path}) is no OUT.report.json")
        elif (eval_path := path.with_name(stem + ".eval.json")).is_file():  # an eval's run: its page is the eval's
            scored, found = load_report(eval_path)
            generated_by = beside(scored.run_report, eval_path) if isinstance(scored, EvalReport) else None
            if generated_by is not None and same_file(generated_by, path):
                scores, run_report = found, data
    except BulkinferError as exc:
        fail(exc)
    if scores is None:
        from bulkinfer.report.html import write_run_html
        from bulkinfer.report.terminal import print_summary

        assert isinstance(saved, RunReport)
        print_summary(saved, Console())
        write_run_html(saved, html_path)
    else:
        from bulkinfer.io.predictions import read_predictions
        from bulkinfer.report.eval_view import print_eval, write_eval_html
        from bulkinfer.report.terminal import print_summary

        output = beside(scores.get("output"), eval_path)
        records = read_predictions(output) if output else []
        if isinstance(saved, RunReport):  # the run's summary, and the eval's page that holds the run's
            print_summary(saved, Console())
        else:
            print_eval(scores, None, Console())  # jobs.eval reads the dicts
        write_eval_html(scores, run_report, records, html_path)
    typer.echo(f"written: {html_path}")


@app.command(cls=Command, epilog=epilog(("bulkinfer models",), ()))
def models() -> None:
    """List the models prepared under $BULKINFER_HOME (default ~/.cache/bulkinfer): name, task, size, path."""
    from bulkinfer.default_model import bulkinfer_home
    from bulkinfer.models import list_models
    from bulkinfer.report.units import format_bytes

    found = list_models()
    if not found:
        typer.echo(
            f"no models prepared under {bulkinfer_home()}; `bulkinfer run` prepares the default LLM, "
            "`bulkinfer embed` and `bulkinfer score` the default encoder"
        )
        return
    for info in found:
        typer.echo(f"{info.name}\t{info.task}\t{format_bytes(info.size_bytes)}\t{info.path}")
