"""Command-line options: their declarations (help text, metavar, default
shown, vLLM's short forms), and the settings overrides they make.

Every option is declared here once; a command lists the ones it takes. An
option's default is ``None`` ("not given": the config file, then bulkinfer's
choice for the device decides; see :func:`bulkinfer.config.load_settings` and
:func:`bulkinfer.engine.args.resolve_engine_args`), so its help states the
default that applies. Engine options carry vLLM's ``EngineArgs`` names and
meanings (vllm/config/model.py, cache.py, scheduler.py, parallel.py) and
vLLM's short forms (``-tp``, ``-dp``, ``-q``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from bulkinfer.config import DEFAULT_BUCKETS, EngineSettings, PlanSettings, SamplingDefaults, Settings, option_keys
from bulkinfer.stop import StopToken

_SAMPLING, _ENGINE, _PLAN = SamplingDefaults(), EngineSettings(), PlanSettings()


ENGINE = "Engine (vLLM arguments)"


SAMPLING = "Sampling defaults (a row's own fields win)"


PLAN = "Plan"


def described(text: str, default: object) -> str:
    """Help text ending in its default, ``[default: ...]``, as typer shows
    defaults; square brackets are escaped for Rich markup (Rich would read
    ``[a-z]`` as a style and drop it)."""
    from rich.markup import escape

    return f"{escape(text)} \\[default: {escape(str(default))}]"


def _buckets(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"--buckets takes comma-separated integers, e.g. 64,128,256; got {value!r}") from None


# Input, output and the run itself.

InputArgument = Annotated[Path, typer.Argument(metavar="INPUT", help="Prompts: a .jsonl or .parquet file.")]


RunInputArgument = Annotated[
    Path,
    typer.Argument(
        metavar="INPUT",
        help="Prompts: a .jsonl or .parquet file; or - for JSONL rows from standard input, run as they arrive "
        "and written as they finish (in completion order unless --output-order input; -o - by default; "
        "--resume only with -o FILE.jsonl, by id).",
    ),
]


StreamErrorsOption = Annotated[
    Path | None,
    typer.Option(
        "--errors",
        metavar="FILE",
        help=described("With INPUT -: write error records to this .jsonl file.", "the output stream"),
        show_default=False,
    ),
]


OutputOption = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        metavar="FILE",
        help=described("Output: .jsonl or .parquet.", "INPUT_STEM.out.jsonl beside INPUT"),
    ),
]


RunOutputOption = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        metavar="FILE",
        help=described(
            "Output: .jsonl or .parquet; with INPUT -, - (standard output) or a .jsonl file.",
            "INPUT_STEM.out.jsonl beside INPUT; - for INPUT -",
        ),
    ),
]


ConfigOption = Annotated[
    Path | None,
    typer.Option(
        metavar="FILE",
        help=described("TOML settings file; flags win over it (every key: configs/default.toml).", "none"),
    ),
]


ModelOption = Annotated[
    str | None,
    typer.Option(
        metavar="MODEL",
        help=described(
            "A local model directory (Hugging Face layout) or hub id.", "the embedded smollm2-135m-instruct"
        ),
    ),
]


# Flags of one setting come as two options (`--x` True, `--no-x` False), not
# typer's `--x/--no-x`: a pair takes a column of its own in the help table,
# and rich then cuts the longest option names at 80 columns.
ChatTemplateOption = Annotated[
    bool | None,
    typer.Option(
        "--apply-chat-template",
        help=described("Send each prompt through the model's chat template.", "auto: when the model has one"),
    ),
]


RawPromptsOption = Annotated[
    bool,
    typer.Option(
        "--raw-prompts", help=described("Send each prompt as it is, without a chat template.", "auto, as above")
    ),
]


ChatTemplateKwargsOption = Annotated[
    str | None,
    typer.Option(
        metavar="JSON",
        help=described(
            "Variables for every chat row's template, a JSON object (e.g. '{\"enable_thinking\": false}'); "
            "a row's own chat_template_kwargs win.",
            "none",
        ),
    ),
]


PassthroughOption = Annotated[
    bool | None,
    typer.Option(
        "--passthrough",
        help=described("Copy a row's fields that are no request field to its output row.", "on"),
    ),
]


NoPassthroughOption = Annotated[
    bool,
    typer.Option(
        "--no-passthrough",
        help=described(
            "Do not copy them (and read no other Parquet column): the output holds only bulkinfer's fields.", "off"
        ),
    ),
]


OverwriteOption = Annotated[
    bool, typer.Option("--overwrite", help=described("Replace an existing (or partial) output.", "off"))
]


ResumeOption = Annotated[
    bool,
    typer.Option(
        "--resume",
        help=described(
            "Continue an interrupted run: finished rows are kept, the rest run. On a complete output: nothing "
            "to do (exit 0) for the input and settings that wrote it, refused (exit 2) for another.",
            "off",
        ),
    ),
]


PlainProgressOption = Annotated[
    bool,
    typer.Option(
        "--plain-progress",
        help=described("One plain progress line every few seconds, even on a terminal.", "a live bar on a terminal"),
    ),
]


MetricsTextfileOption = Annotated[
    Path | None,
    typer.Option(
        "--metrics-textfile",
        metavar="FILE.prom",
        envvar="BULKINFER_METRICS_TEXTFILE",
        help=described(
            "At the end, success or not, write the command's exit code, times, rows, tokens and scores "
            "to this file as Prometheus gauges, for node_exporter's textfile collector (one file per job; "
            "env BULKINFER_METRICS_TEXTFILE).",
            "none",
        ),
        show_default=False,
        show_envvar=False,
    ),
]


VerboseOption = Annotated[
    bool,
    typer.Option(
        "--verbose", "-v", help=described("Show the engine's log live instead of writing it to OUT.log.", "off")
    ),
]


# Sampling defaults: a row's own fields win.

MaxTokensOption = Annotated[
    int | None,
    typer.Option(
        metavar="TOKENS",
        help=described("Completion tokens per row at most.", _SAMPLING.max_tokens),
        rich_help_panel=SAMPLING,
    ),
]


TemperatureOption = Annotated[
    float | None,
    typer.Option(
        metavar="FLOAT",
        help=described("Sampling temperature; 0 is greedy.", _SAMPLING.temperature),
        rich_help_panel=SAMPLING,
    ),
]


TopPOption = Annotated[
    float | None,
    typer.Option(
        metavar="FLOAT",
        help=described(
            "Nucleus sampling: the smallest set of tokens of this probability mass, in (0, 1].", _SAMPLING.top_p
        ),
        rich_help_panel=SAMPLING,
    ),
]


StopOption = Annotated[
    list[str] | None,
    typer.Option(
        metavar="TEXT",
        help=described("A stop string; repeat the flag for more.", "none"),
        rich_help_panel=SAMPLING,
    ),
]


IgnoreEosOption = Annotated[
    bool | None,
    typer.Option(
        "--ignore-eos",
        help=described("Generate max_tokens even past the end-of-sequence token (benchmarks).", "off"),
        rich_help_panel=SAMPLING,
    ),
]


NOption = Annotated[
    int | None,
    typer.Option(
        "--n",
        "-n",
        metavar="N",
        help=described("Completions per row (OpenAI's n).", _SAMPLING.n),
        rich_help_panel=SAMPLING,
    ),
]


LogprobsOption = Annotated[
    int | None,
    typer.Option(
        metavar="K",
        help=described("Log-probability of each completion token, with the top K alternatives (0-20).", "none"),
        rich_help_panel=SAMPLING,
    ),
]


TopKOption = Annotated[
    int | None,
    typer.Option(
        metavar="K",
        help=described("Sample from the K likeliest tokens; 0 or -1: all.", _SAMPLING.top_k),
        rich_help_panel=SAMPLING,
    ),
]


MinPOption = Annotated[
    float | None,
    typer.Option(
        metavar="FLOAT",
        help=described("Drop tokens less likely than this share of the likeliest one's, in [0, 1].", _SAMPLING.min_p),
        rich_help_panel=SAMPLING,
    ),
]


PresencePenaltyOption = Annotated[
    float | None,
    typer.Option(
        metavar="FLOAT",
        help=described("Penalty in [-2, 2] on tokens already in the completion.", _SAMPLING.presence_penalty),
        rich_help_panel=SAMPLING,
    ),
]


FrequencyPenaltyOption = Annotated[
    float | None,
    typer.Option(
        metavar="FLOAT",
        help=described("Penalty in [-2, 2] per time a token occurs in the completion.", _SAMPLING.frequency_penalty),
        rich_help_panel=SAMPLING,
    ),
]


RepetitionPenaltyOption = Annotated[
    float | None,
    typer.Option(
        metavar="FLOAT",
        help=described(
            "> 1 discourages tokens of the prompt and completion, < 1 favours them.", _SAMPLING.repetition_penalty
        ),
        rich_help_panel=SAMPLING,
    ),
]


MinTokensOption = Annotated[
    int | None,
    typer.Option(
        metavar="TOKENS",
        help=described("Completion tokens before the end-of-sequence or a stop may end a row.", _SAMPLING.min_tokens),
        rich_help_panel=SAMPLING,
    ),
]


StopTokenIdsOption = Annotated[
    list[int] | None,
    typer.Option(
        metavar="ID",
        help=described("A token id that ends a completion; repeat for more.", "none"),
        rich_help_panel=SAMPLING,
    ),
]


LogitBiasOption = Annotated[
    list[str] | None,
    typer.Option(
        metavar="ID=BIAS",
        help=described("Add BIAS in [-100, 100] to token ID's logit; repeat for more.", "none"),
        rich_help_panel=SAMPLING,
    ),
]


PriorityOption = Annotated[
    int | None,
    typer.Option(
        metavar="INT",
        help=described("Rows' priority (lower runs first); a row's own priority wins.", _SAMPLING.priority),
        rich_help_panel=SAMPLING,
    ),
]


STRUCTURED = "Structured output (one constraint for every row without its own)"


JsonSchemaOption = Annotated[
    Path | None,
    typer.Option(
        metavar="FILE",
        help=described("Every completion is JSON valid under this JSON schema file.", "none"),
        rich_help_panel=STRUCTURED,
    ),
]


ChoiceOption = Annotated[
    str | None,
    typer.Option(
        metavar="A,B,...",
        help=described("Every completion is exactly one of these comma-separated choices.", "none"),
        rich_help_panel=STRUCTURED,
    ),
]


RegexOption = Annotated[
    str | None,
    typer.Option(
        metavar="PATTERN",
        help=described("Every completion matches this regular expression.", "none"),
        rich_help_panel=STRUCTURED,
    ),
]


# Engine (vLLM EngineArgs).

DtypeOption = Annotated[
    Literal["auto", "float32", "float", "bfloat16", "float16", "half"] | None,
    typer.Option(
        metavar="DTYPE",
        help=described(
            "Weights and activations: auto, float32, bfloat16 or float16 (vLLM's float and half too).",
            "auto: on CPU measured (float32 or bfloat16), the model's on GPU",
        ),
        rich_help_panel=ENGINE,
    ),
]


TensorParallelSizeOption = Annotated[
    int | None,
    typer.Option(
        "--tensor-parallel-size",
        "-tp",
        metavar="N",
        help=described("GPUs per model replica.", _ENGINE.tensor_parallel_size),
        rich_help_panel=ENGINE,
    ),
]


DataParallelSizeOption = Annotated[
    int | None,
    typer.Option(
        "--data-parallel-size",
        "-dp",
        metavar="N",
        help=described(
            "Model replicas, each on its own GPUs (CPU: its share of the cores), fed by one reader.",
            _ENGINE.data_parallel_size,
        ),
        rich_help_panel=ENGINE,
    ),
]


RayOption = Annotated[
    str | None,
    typer.Option(
        "--ray",
        metavar="ADDRESS",
        help=described(
            "Run the -dp replicas as Ray actors: local (a cluster on this machine), auto, ray://HOST:PORT.",
            "no Ray",
        ),
        rich_help_panel=ENGINE,
    ),
]


RayCpusPerReplicaOption = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        help=described("With --ray on CPU: Ray CPUs (engine threads) per replica.", "cluster CPUs / replicas"),
        rich_help_panel=ENGINE,
    ),
]


RayMaxRestartsOption = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        help=described("With --ray: Ray restarts of a replica that died; -1 without limit.", 3),
        rich_help_panel=ENGINE,
    ),
]


QuantizationOption = Annotated[
    str | None,
    typer.Option(
        "--quantization",
        "-q",
        metavar="METHOD",
        help=described("vLLM's quantization method for the weights, e.g. fp8, awq, gptq.", "the model's own config"),
        rich_help_panel=ENGINE,
    ),
]


MaxModelLenOption = Annotated[
    int | None,
    typer.Option(
        metavar="TOKENS",
        help=described("Context length in tokens, prompt + completion.", "the model's"),
        rich_help_panel=ENGINE,
    ),
]


MaxNumSeqsOption = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        help=described("Sequences in one engine step at most.", "vLLM's for the device"),
        rich_help_panel=ENGINE,
    ),
]


MaxNumBatchedTokensOption = Annotated[
    int | None,
    typer.Option(
        metavar="TOKENS",
        help=described("Tokens in one engine step at most, prompt + completion.", "vLLM's for the device"),
        rich_help_panel=ENGINE,
    ),
]


GpuMemoryUtilizationOption = Annotated[
    float | None,
    typer.Option(
        metavar="FRACTION",
        help=described("Share (0, 1] of each GPU's memory the engine may use.", "vLLM's, 0.9"),
        rich_help_panel=ENGINE,
    ),
]


KvCacheMemoryBytesOption = Annotated[
    int | None,
    typer.Option(
        metavar="BYTES",
        help=described(
            "KV cache bytes per device, instead of --gpu-memory-utilization.",
            "CPU: 25% of available memory, within 1..8 GiB; GPU: from --gpu-memory-utilization",
        ),
        rich_help_panel=ENGINE,
    ),
]


EnforceEagerOption = Annotated[
    bool | None,
    typer.Option(
        "--enforce-eager",
        help=described(
            "Eager PyTorch: no torch.compile, no CUDA graphs.",
            "CPU: chosen per job, eager unless compiling saves more than it costs (README, Engine settings); GPU: off",
        ),
        rich_help_panel=ENGINE,
    ),
]


NoEnforceEagerOption = Annotated[
    bool,
    typer.Option(
        "--no-enforce-eager",
        help=described("Allow torch.compile and CUDA graphs.", "GPU: on; CPU: chosen per job"),
        rich_help_panel=ENGINE,
    ),
]


SeedOption = Annotated[
    int | None,
    typer.Option(
        metavar="INT",
        help=described("The engine's random seed (a row's seed wins for that row).", _ENGINE.seed),
        rich_help_panel=ENGINE,
    ),
]


TrustRemoteCodeOption = Annotated[
    bool | None,
    typer.Option(
        "--trust-remote-code",
        help=described("Allow the model repository's own Python code to run.", "off"),
        rich_help_panel=ENGINE,
    ),
]


TopPSamplerOption = Annotated[
    Literal["auto", "vllm"] | None,
    typer.Option(
        metavar="SAMPLER",
        help=described(
            "How top_p < 1 is applied on CPU: auto (bulkinfer's nucleus processor: the same tokens kept, "
            "without sorting the vocabulary) or vllm (vLLM's own sort).",
            "auto",
        ),
        rich_help_panel=ENGINE,
    ),
]


BatchOrderOption = Annotated[
    Literal["auto", "vllm"] | None,
    typer.Option(
        metavar="ORDER",
        help=described(
            "The order of the engine's running batch on CPU: auto (by KV blocks, so rows sharing a prompt "
            "prefix are decoded side by side) or vllm (vLLM's own).",
            "auto",
        ),
        rich_help_panel=ENGINE,
    ),
]


HugePagesAtStartOption = Annotated[
    bool | None,
    typer.Option(
        "--huge-pages-at-start",
        help=described(
            "Start the engine with transparent huge pages: its KV cache in 2 MiB pages (faster steps; a slower "
            "start where the host backs fresh memory lazily, as on a VM).",
            "on CPU by the job: off when the start would cost over twice what the steps save",
        ),
        rich_help_panel=ENGINE,
    ),
]


NoHugePagesAtStartOption = Annotated[
    bool,
    typer.Option(
        "--no-huge-pages-at-start",
        help=described(
            "Start the engine with transparent huge pages paused (its KV cache in 4 KiB pages; an engine in "
            "vLLM's child processes keeps the pause for its life).",
            "off",
        ),
        rich_help_panel=ENGINE,
    ),
]


SpeculativeTailOption = Annotated[
    int | None,
    typer.Option(
        metavar="ROWS",
        min=0,
        help=described(
            "Speculative decoding by n-gram prompt lookup (vLLM's, 4 draft tokens) only in engine steps of at "
            "most ROWS running rows: a job's tail. Rows with min_p or logit_bias are then refused; 0: off.",
            "0",
        ),
        rich_help_panel=ENGINE,
    ),
]


EngineArgOption = Annotated[
    list[str] | None,
    typer.Option(
        "--engine-arg",
        metavar="KEY=VALUE",
        help=described("Any vLLM EngineArgs field, e.g. enable_prefix_caching=false; repeat for more.", "none"),
        rich_help_panel=ENGINE,
    ),
]


# Plan: how rows are sorted, bucketed and fed.

OrderOption = Annotated[
    Literal["descending", "ascending", "arrival"] | None,
    typer.Option(
        metavar="ORDER",
        help=described("Feed order: descending (longest prompts first), ascending, or arrival (as read).", _PLAN.order),
        rich_help_panel=PLAN,
    ),
]


PrefixAwareOption = Annotated[
    bool | None,
    typer.Option(
        "--prefix-aware",
        help=described(
            "Feed rows sharing a prompt prefix of one KV-cache block or more together, the longest first.",
            "on" if _PLAN.prefix_aware else "off",
        ),
        rich_help_panel=PLAN,
    ),
]


NoPrefixAwareOption = Annotated[
    bool,
    typer.Option(
        "--no-prefix-aware",
        help=described("Feed rows in the plain --order only.", "off" if _PLAN.prefix_aware else "on"),
        rich_help_panel=PLAN,
    ),
]


BucketsOption = Annotated[
    str | None,
    typer.Option(
        metavar="T1,T2,...",
        help=described(
            "Bucket upper bounds in prompt tokens.",
            f"{DEFAULT_BUCKETS[0]},{DEFAULT_BUCKETS[1]},...,{DEFAULT_BUCKETS[-1]} (doubling)",
        ),
        rich_help_panel=PLAN,
    ),
]


MaxWaitOption = Annotated[
    float | None,
    typer.Option(
        "--max-wait",
        metavar="SECONDS",
        help=described(
            "With INPUT -: plan a window once its oldest row waited this long, or it holds --window-rows rows.",
            f"{_PLAN.max_wait_s:g}",
        ),
        rich_help_panel=PLAN,
    ),
]


WindowRowsOption = Annotated[
    int | None,
    typer.Option(
        metavar="ROWS",
        help=described("Rows read, tokenized and sorted together (memory grows with it).", _PLAN.window_rows),
        rich_help_panel=PLAN,
    ),
]


MaxInFlightOption = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        help=described("Requests in the engine at once.", "2 x max_num_seqs"),
        rich_help_panel=PLAN,
    ),
]


PaddingBatchSizeOption = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        help=described("Static batch size for the padding figures of the report only.", _PLAN.padding_batch_size),
        rich_help_panel=PLAN,
    ),
]


StallTimeoutOption = Annotated[
    float | None,
    typer.Option(
        "--stall-timeout-s",
        metavar="SECONDS",
        help=described(
            "Seconds one engine step may take before the engine counts as stuck.", f"{_PLAN.stall_timeout_s:g}"
        ),
        rich_help_panel=PLAN,
    ),
]


StartTimeoutOption = Annotated[
    float | None,
    typer.Option(
        "--start-timeout-s",
        metavar="SECONDS",
        help=described(
            "Seconds the model load and engine start may take before the run counts as stuck.",
            f"{_PLAN.start_timeout_s:g}",
        ),
        rich_help_panel=PLAN,
    ),
]


OutputOrderOption = Annotated[
    Literal["input", "completion"] | None,
    typer.Option(
        metavar="ORDER",
        help=described(
            "Order of OUT's rows: input (restored when the run ends; a stream holds finished rows in a bounded "
            "buffer) or completion (no sort: the largest files; a stream's rows as they finish).",
            "input for a file, completion for a stream (INPUT -)",
        ),
        rich_help_panel=PLAN,
    ),
]
# The same for the commands that read a file only (eval, embed, score).
FileOutputOrderOption = Annotated[
    Literal["input", "completion"] | None,
    typer.Option(
        "--output-order",
        metavar="ORDER",
        help=described(
            "Order of OUT's rows: input (restored when the run ends) or completion (no sort: the largest files).",
            "input",
        ),
        rich_help_panel=PLAN,
    ),
]


# `bulkinfer eval`'s own options.
GoldenArgument = Annotated[
    Path,
    typer.Argument(
        metavar="GOLDEN", help="Golden rows: id, prompt or messages, and reference; a .jsonl or .parquet file."
    ),
]


EvalOutputOption = Annotated[
    Path | None,
    typer.Option("--output", "-o", metavar="FILE", help=described("The scored predictions.", "GOLDEN_STEM.out.jsonl")),
]


PredictionsOption = Annotated[
    Path | None,
    typer.Option(
        metavar="FILE",
        help=described("Score this existing output instead of generating (rows matched by id).", "generate"),
    ),
]


PerplexityOption = Annotated[
    bool,
    typer.Option("--perplexity", help=described("Also the perplexity of each reference given its prompt.", "off")),
]


BootstrapOption = Annotated[
    int,
    typer.Option(
        metavar="N",
        show_default=False,
        help=described("Paired bootstrap resamples for 95% intervals; 0 for none.", 0),
    ),
]


FailUnderOption = Annotated[
    str | None,
    typer.Option(
        metavar="METRIC=BAR,...",
        help=described("Exit 8 when a metric is below its bar, e.g. bleu=20,rougeL=30.", "none"),
    ),
]


CompareOption = Annotated[
    Path | None,
    typer.Option(metavar="FILE", help=described("A previous OUT.eval.json: print each metric's change.", "none")),
]


# Command-line options that override a setting of the same name (see
# bulkinfer.config.option_overrides): every sampling default, engine and plan
# setting has one; `--seed` is the engine's seed; `--quantization` is one of
# vLLM's EngineArgs bulkinfer passes through (engine.extra_args). `--json-schema`,
# `--choice` and `--regex` make `sampling.structured_outputs` (see _structured).
OVERRIDES = frozenset({*option_keys()} - {"structured_outputs"} | {"quantization"})


# Flag that sets a setting to False -> the option (in OVERRIDES) that sets it to True.
NEGATIONS = {
    "raw_prompts": "apply_chat_template",
    "no_passthrough": "passthrough",
    "no_enforce_eager": "enforce_eager",
    "no_huge_pages_at_start": "huge_pages_at_start",
    "no_prefix_aware": "prefix_aware",
}


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


STRUCTURED_FLAGS = ("json_schema", "choice", "regex")


def _logit_bias(items: list[str] | None) -> dict[str, Any] | None:
    """``--logit-bias ID=BIAS`` items as ``{ID: BIAS}`` (checked with the settings).

    Raises:
        typer.BadParameter: an item without ``=`` or a BIAS that is no number (exit 2).
    """
    if not items:
        return None
    bias: dict[str, Any] = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            bias[token.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise typer.BadParameter(f"--logit-bias takes TOKEN_ID=BIAS, e.g. 50256=-100; got {item!r}")
    return bias


def _json_object(flag: str, text: str | None) -> dict[str, Any] | None:
    """``flag``'s JSON ``text`` as an object (checked with the settings); None when not given.

    Raises:
        typer.BadParameter: not JSON, or not an object (exit 2).
    """
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{flag} takes a JSON object, e.g. '{{\"enable_thinking\": false}}': {exc}") from None
    if not isinstance(value, dict):
        raise typer.BadParameter(f"{flag} takes a JSON object, got {text!r}")
    return value


def _structured(options: dict[str, Any]) -> dict[str, Any] | None:
    """``sampling.structured_outputs`` from ``--json-schema FILE``, ``--choice
    A,B`` or ``--regex PATTERN`` (at most one); None when none is given.

    Raises:
        typer.BadParameter: two of them, or an empty choice list (exit 2).
        InputFileError: the schema file is missing (exit 4), unreadable or
            not a JSON object.
    """
    given = [name for name in STRUCTURED_FLAGS if options.get(name) is not None]
    if len(given) > 1:
        raise typer.BadParameter(
            f"give one of {', '.join(map(_flag, STRUCTURED_FLAGS))}, not {' and '.join(map(_flag, given))}"
        )
    if not given:
        return None
    value = options[given[0]]
    if given[0] == "json_schema":
        from bulkinfer.io.records import read_json_file

        return {"json": read_json_file(Path(value), "JSON schema file")}
    if given[0] == "regex":
        return {"regex": value}
    choices = [c.strip() for c in value.split(",") if c.strip()]
    if not choices:
        raise typer.BadParameter(f"--choice takes comma-separated choices, e.g. yes,no; got {value!r}")
    return {"choice": choices}


# The setting flags not named after their setting.
_FLAG_NAMES = {"max_wait_s": "--max-wait"}


def _flag(name: str) -> str:
    return _FLAG_NAMES.get(name) or "--" + name.replace("_", "-")


def settings_from_flags(config: Path | None, options: dict[str, Any]) -> Settings:
    """The command's settings: the defaults, ``config`` (a TOML file) and the
    flags given among ``options`` (the command's ``locals()``; None means
    "not given"), through :func:`bulkinfer.config.option_overrides`, with
    errors naming the flag as typed (``--max-tokens``, ``--raw-prompts``,
    ``--engine-arg KEY``).

    Raises:
        typer.BadParameter: a flag and its negation both given, or a flag's
            text that cannot be read (exit 2).
        ConfigError, InputFileError: as :func:`bulkinfer.config.load_settings`.
    """
    from bulkinfer.config import load_settings, option_overrides

    flat, typed = _flag_options(options)
    dotted, origins = option_overrides(flat, lambda name: typed.get(name) or _flag(name))
    return load_settings(config, dotted, origins)


def invocation(options: dict[str, Any], stop: StopToken) -> dict[str, Any]:
    """The invocation's choices among a command's ``options`` (its
    ``locals()``), as :mod:`bulkinfer`'s functions take them (the fields of
    :class:`~bulkinfer.jobs.context.RunContext`), with the CLI's ``stop`` token."""
    return {
        "overwrite": options["overwrite"],
        "resume": options["resume"],
        "progress_plain": options["plain_progress"],
        "verbose": options["verbose"],
        "stop": stop,
    }


def _flag_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The flags among ``options`` as :func:`bulkinfer.config.option_overrides`
    takes them (option name, or ``engine.FIELD``, -> value), and the flag the
    user typed for those named otherwise.

    Raises:
        typer.BadParameter: a flag and its negation both given (exit 2).
    """
    flat = {name: value for name, value in options.items() if name in OVERRIDES and name != "quantization"}
    typed: dict[str, str] = {}
    for negation, name in NEGATIONS.items():
        if options.get(negation):
            if options.get(name):
                raise typer.BadParameter(f"give {_flag(name)} or {_flag(negation)}, not both")
            flat[name], typed[name] = False, _flag(negation)
    for item in options.get("engine_arg") or ():
        key, value = _engine_arg(item)
        flat[f"engine.{key}"], typed[f"engine.{key}"] = value, f"--engine-arg {key}"
    if options.get("quantization") is not None:
        flat["engine.quantization"], typed["engine.quantization"] = options["quantization"], "--quantization"
    for name in ("stop", "stop_token_ids"):
        flat[name] = flat.get(name) or None  # an empty list: not given
    flat["logit_bias"] = _logit_bias(flat.get("logit_bias"))
    flat["chat_template_kwargs"] = _json_object("--chat-template-kwargs", flat.get("chat_template_kwargs"))
    flat["buckets"] = _buckets(flat.get("buckets"))
    structured = _structured(options)
    if structured is not None:
        flat["structured_outputs"] = structured
        typed["structured_outputs"] = next(_flag(name) for name in STRUCTURED_FLAGS if options.get(name) is not None)
    return flat, typed
