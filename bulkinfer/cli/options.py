"""Command-line options: their declarations, and the settings overrides they make."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from bulkinfer.config import EngineSettings, PlanSettings, SamplingDefaults, option_keys

# The options, defined once; a command lists the ones it takes. Engine options
# carry vLLM's EngineArgs names and meanings (vllm/config/model.py, cache.py,
# scheduler.py, parallel.py); `None` means "not given": the config file or
# bulkinfer's choice for the device decides (bulkinfer.engine.args.resolve_engine_args).
_SAMPLING, _ENGINE, _PLAN = SamplingDefaults(), EngineSettings(), PlanSettings()


ENGINE = "Engine (vLLM arguments)"


SAMPLING = "Sampling defaults (a row's own fields win)"


PLAN = "Plan"


def _buckets(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("expected comma-separated integers, e.g. 64,128,256") from None


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


def _origins(options: dict[str, Any]) -> dict[str, str]:
    """What the user typed for each override :func:`_overrides` makes, by
    dotted key (``{"plan.order": "--order"}``), for error messages."""
    origins = {
        OVERRIDES[name]: _flag(name) for name, value in options.items() if name in OVERRIDES and value is not None
    }
    origins.update({OVERRIDES[name]: _flag(neg) for neg, name in NEGATIONS.items() if options.get(neg)})
    for item in options.get("engine_arg") or ():
        key = item.partition("=")[0].strip()
        origins[f"engine.{key.replace('-', '_')}"] = f"--engine-arg {key}"
    return origins


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
