"""The arguments of :mod:`bulkinfer`'s public functions: the settings with
options given by name, the invocation's choices (:data:`CONTEXT_OPTIONS`)
and the engine, each of its type, checked before any file is made."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bulkinfer.config import Settings, load_settings
from bulkinfer.errors import ConfigError
from bulkinfer.stop import StopToken

if TYPE_CHECKING:
    from bulkinfer.jobs.context import RunContext
    from bulkinfer.jobs.shared_engine import SharedEngine


def settings_with(
    settings: Settings | None, overrides: Mapping[str, Any], engine_args: Mapping[str, Any] | None
) -> Settings:
    """``settings`` (default: the built-in defaults) with flat option overrides
    (:func:`bulkinfer.config.option_overrides`).

    Raises:
        ConfigError: an unknown option name (naming the closest), or an invalid value.
    """
    from bulkinfer.config import option_overrides, with_overrides

    check_types(settings, engine_args)
    options = {**overrides, **{f"engine.{name}": value for name, value in (engine_args or {}).items()}}
    dotted, origins = option_overrides(options, named)
    return with_overrides(settings or load_settings(), dotted, origins)


def check_types(settings: Any, engine_args: Any) -> None:
    """Refuse a ``settings`` that is not a :class:`Settings` (a TOML path is
    :func:`bulkinfer.load_settings`'s) or ``engine_args`` that are not a mapping.

    Raises:
        ConfigError: naming the argument and the type given.
    """
    if settings is not None and not isinstance(settings, Settings):
        hint = ": bulkinfer.load_settings(path) reads a TOML file" if isinstance(settings, str | Path) else ""
        raise ConfigError(f"settings= takes a bulkinfer.Settings, got {type(settings).__name__}{hint}")
    if engine_args is not None and not isinstance(engine_args, Mapping):
        raise ConfigError(f"engine_args= takes a mapping of vLLM EngineArgs fields, got {type(engine_args).__name__}")


def named(option: str) -> str:
    """How a caller of this module named an option: its keyword, or ``engine_args['KEY']``."""
    return f"engine_args[{option.removeprefix('engine.')!r}]" if option.startswith("engine.") else option


def engine_overrides(overrides: Mapping[str, Any], engine_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options among ``overrides`` and ``engine_args`` that set the model or the engine."""
    from bulkinfer.config import option_keys

    keys = option_keys()
    found = {n: v for n, v in overrides.items() if keys.get(n, "").split(".")[0] in ("model", "engine")}
    return {**found, **{f"engine_args[{n!r}]": v for n, v in (engine_args or {}).items()}}


# Keyword arguments of evaluate that say how to score: EvalOptions' fields.
EVAL_OPTIONS = ("predictions", "perplexity", "bootstrap", "fail_under")
RANK_EVAL_OPTIONS = ("predictions", "measures", "fail_under", "truncate")
# Keyword arguments of run, embed and evaluate that are about the invocation: RunContext's fields.
CONTEXT_OPTIONS = ("overwrite", "resume", "stop", "verbose", "progress_plain", "observer")


def prepare(
    settings: Settings | None,
    options: Mapping[str, Any],
    engine_args: Mapping[str, Any] | None,
    engine: SharedEngine | None,
) -> tuple[Settings, RunContext]:
    """A job's settings and :class:`~bulkinfer.jobs.context.RunContext` from
    a public function's arguments: ``options`` holds the context's fields
    (:data:`CONTEXT_OPTIONS`) and the settings overrides; the engine is
    ``engine`` (whose settings a run may not change) or the run's own.

    ``stop`` is the :class:`StopToken` that stops the run, or, given as
    anything else (``stop="###"``, ``stop=["\\n\\n"]``), the sampling stop
    strings, as ``--stop``.

    Raises:
        ConfigError: an unknown option; an engine setting with ``engine``;
            both ``overwrite`` and ``resume``; an argument of the wrong type
            (``settings`` not a :class:`Settings`, ``observer`` not a
            :class:`~bulkinfer.jobs.context.RunObserver`, ``engine`` not an
            engine from :func:`bulkinfer.open_engine`, ``engine_args`` not a mapping).
    """
    from bulkinfer.jobs.context import RunContext, RunObserver
    from bulkinfer.jobs.shared_engine import SharedEngine

    check_types(settings, engine_args)
    options = dict(options)
    token = options.get("stop")
    context_names = [n for n in CONTEXT_OPTIONS if n != "stop" or token is None or isinstance(token, StopToken)]
    given = {name: options.pop(name) for name in context_names if options.get(name) is not None}
    overrides = {name: value for name, value in options.items() if name not in CONTEXT_OPTIONS or name == "stop"}
    for name, value, kind, what in (
        ("observer", given.get("observer"), RunObserver, "a bulkinfer.RunObserver"),
        ("engine", engine, SharedEngine, "an engine from bulkinfer.open_engine()"),
    ):
        if value is not None and not isinstance(value, kind):
            raise ConfigError(f"{name}= takes {what}, got {type(value).__name__}")
    if engine is None:
        return settings_with(settings, overrides, engine_args), RunContext(**given)
    run_only = {n: v for n, v in overrides.items() if n not in engine_overrides(overrides, None)}
    base = engine.settings_for(settings, engine_overrides(overrides, engine_args))
    return settings_with(base, run_only, None), RunContext(**given, engine_factory=engine)
