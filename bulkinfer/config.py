"""Settings: built-in defaults < a TOML file (``--config``) < CLI flags.

A row's own values (``max_tokens``, ``temperature``, ...) win over all three;
that merge happens per row in :mod:`bulkinfer.prep.rows`.

The TOML layout mirrors the dataclasses below, one table per dataclass::

    model = "smollm2-135m-instruct"
    [sampling]   # SamplingDefaults
    [engine]     # EngineSettings (vLLM's own argument names)
    [plan]       # PlanSettings

``configs/default.toml`` documents every key.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bulkinfer.checks import validate
from bulkinfer.errors import ConfigError, closest, read_whole
from bulkinfer.settings import (
    DEFAULT_BUCKETS,
    EngineSettings,
    FeedOrder,
    OutputOrder,
    PlanSettings,
    RaySettings,
    SamplingDefaults,
    Settings,
)

__all__ = [
    "DEFAULT_BUCKETS",
    "EngineSettings",
    "FeedOrder",
    "OutputOrder",
    "PlanSettings",
    "RaySettings",
    "SamplingDefaults",
    "Settings",
    "load_settings",
    "option_keys",
    "with_engine",
    "with_overrides",
]


def option_keys() -> dict[str, str]:
    """Flat option name (a ``bulkinfer run`` flag's, with underscores) ->
    the dotted settings key it overrides: every sampling default by its own
    name (``max_tokens`` -> ``sampling.max_tokens``), every engine and plan
    setting by its own name (``seed`` is the engine's seed: a row's own
    ``seed`` is the per-request one)."""
    return {
        "model": "model",
        "apply_chat_template": "apply_chat_template",
        "chat_template_kwargs": "chat_template_kwargs",
        "passthrough": "passthrough",
        **{f.name: f"sampling.{f.name}" for f in dataclasses.fields(SamplingDefaults) if f.name != "seed"},
        **{f.name: f"engine.{f.name}" for f in dataclasses.fields(EngineSettings) if f.name != "extra_args"},
        **{f.name: f"plan.{f.name}" for f in dataclasses.fields(PlanSettings)},
        "ray": "ray.address",
        **{f"ray_{f.name}": f"ray.{f.name}" for f in dataclasses.fields(RaySettings) if f.name != "address"},
    }


# Options given as lists whose setting is a tuple (settings are frozen).
_TUPLE_OPTIONS = ("stop", "stop_token_ids")


def option_overrides(
    options: Mapping[str, Any], origin: Callable[[str], str] = str
) -> tuple[dict[str, Any], dict[str, str]]:
    """Options by flat name -> the dotted settings overrides they make and
    what the user typed for each (for :func:`load_settings` and
    :func:`with_overrides`): the one translation, for the CLI's flags and
    :mod:`bulkinfer`'s keyword arguments alike.

    Args:
        options: :func:`option_keys` names (``max_tokens``, ``dtype``, ...)
            or ``engine.FIELD`` for any other vLLM ``EngineArgs`` field;
            a None value is an option not given.
        origin: how the user named an option (``--max-tokens``); the name
            itself by default.

    Raises:
        ConfigError: an unknown option name (naming the closest).
    """
    keys = option_keys()
    dotted: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for name, value in options.items():
        if value is None:
            continue
        if name.startswith("engine.") and name.count(".") == 1:
            key = name
        elif name in keys:
            key = keys[name]
        else:
            raise ConfigError(f"unknown option {name!r}{closest(name, keys, '; known: ' + ', '.join(sorted(keys)))}")
        if name in _TUPLE_OPTIONS:  # one stop string is that string, as in a row (not its characters)
            value = (value,) if isinstance(value, str) else tuple(value)
        dotted[key] = value
        origins[key] = origin(name)
    return dotted, origins


_SECTIONS: dict[str, type] = {
    "sampling": SamplingDefaults,
    "engine": EngineSettings,
    "plan": PlanSettings,
    "ray": RaySettings,
}
_TOP_LEVEL = {"model", "passthrough", "apply_chat_template", "chat_template_kwargs"}


def _check_keys(where: str, cls: type, values: Mapping[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def _build(cls: type, where: str, values: Mapping[str, Any]) -> Any:
    if cls is EngineSettings:  # any other key is one of vLLM's EngineArgs (checked where the engine is built)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra_args"}
        extra = {**values.get("extra_args", {}), **{k: v for k, v in values.items() if k not in known | {"extra_args"}}}
        values = {**{k: v for k, v in values.items() if k in known}, "extra_args": extra}
    if cls is SamplingDefaults and isinstance(values.get("stop"), str) and values["stop"]:  # one, as in a row
        values = {**values, "stop": (values["stop"],)}
    _check_keys(where, cls, values)
    converted = {k: tuple(v) if isinstance(v, list) and k != "extra_args" else v for k, v in values.items()}
    return cls(**converted)


def load_settings(
    config_path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    origins: Mapping[str, str] | None = None,
) -> Settings:
    """Build the frozen :class:`Settings` from defaults, a TOML file and flags.

    Args:
        config_path: a TOML file laid out as in ``configs/default.toml``, or None.
        overrides: flag values as dotted keys, e.g. ``{"sampling.max_tokens": 64,
            "engine.dtype": "float32", "model": "path"}``; ``None`` values are
            ignored (flag not given).
        origins: what the user typed for each override, by dotted key
            (``{"plan.order": "--order"}``): an invalid value's error names
            it. An override without one is named by its dotted key; a value
            from the config file as ``KEY in FILE`` (``plan.order in c.toml``).

    Raises:
        InputFileError: the config file does not exist, cannot be read or
            is no regular file (a directory, a FIFO: exit 4, as for every
            file a command reads).
        ConfigError: a config file that is not valid TOML (with its line and column);
            unknown keys; invalid values (naming the flag or the key and file).
    """
    data: dict[str, Any] = {}
    names: dict[str, str] = {}
    if config_path is not None:
        try:
            data = tomllib.loads(read_whole(Path(config_path), "config file").decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{config_path}: not valid TOML: {exc}") from None
        names = {key: f"{key} in {config_path}" for key in _dotted_keys(data)}
    return _from_data(data, overrides, str(config_path) if config_path else "settings", names, origins)


def with_engine(settings: Settings, **engine: Any) -> Settings:
    """``settings`` with these :class:`EngineSettings` fields replaced."""
    return dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, **engine))


def with_overrides(
    settings: Settings, overrides: Mapping[str, Any], origins: Mapping[str, str] | None = None
) -> Settings:
    """``settings`` with ``overrides`` (dotted keys, as :func:`load_settings`
    takes them) applied and checked again; ``origins`` as for :func:`load_settings`.

    Raises:
        ConfigError: unknown keys; invalid values.
    """
    return _from_data(settings.to_dict(), overrides, "settings", {}, origins)


def _dotted_keys(data: Mapping[str, Any]) -> list[str]:
    """The keys of a TOML-shaped dict, a table's keys as ``table.key``."""
    keys = []
    for name, value in data.items():
        if name in _SECTIONS and isinstance(value, dict):
            keys += [f"{name}.{key}" for key in value]
        else:
            keys.append(name)
    return keys


def _from_data(
    data: dict[str, Any],
    overrides: Mapping[str, Any] | None,
    where: str,
    names: dict[str, str],
    origins: Mapping[str, str] | None,
) -> Settings:
    """Settings from a TOML-shaped dict and dotted overrides (``None`` values
    skipped); ``names``: what an error calls a key of ``data``, updated with
    ``origins`` for the overrides."""
    unknown = sorted(set(data) - set(_SECTIONS) - _TOP_LEVEL)
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)}")
    for name in _SECTIONS:
        if not isinstance(data.get(name, {}), dict):
            raise ConfigError(f"{where}: '{name}' must be a table ([{name}]), got {data[name]!r}")
    sections: dict[str, dict[str, Any]] = {name: dict(data.get(name, {})) for name in _SECTIONS}
    top = {k: data[k] for k in _TOP_LEVEL if k in data}
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        if section and section not in sections:
            raise ConfigError(f"unknown setting {key}; known sections: {', '.join(_SECTIONS)}")
        if section:
            sections[section][name] = value
        else:
            top[name] = value
        names[key] = (origins or {}).get(key, key)
    try:
        settings = Settings(
            **top,
            **{name: _build(cls, f"{where} [{name}]", sections[name]) for name, cls in _SECTIONS.items()},
        )
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    validate(settings, names)
    return settings


def structured_outputs_config(value: Any) -> Any:
    """vLLM's ``StructuredOutputsConfig`` for ``[engine]
    structured_outputs_config`` (a table of its fields; a config object is
    returned as it is). Imports vLLM.

    Raises:
        ConfigError: a field vLLM's config refuses (pydantic's message).
    """
    if not isinstance(value, Mapping):
        return value
    from vllm.config import StructuredOutputsConfig

    try:
        return StructuredOutputsConfig(**value)
    except Exception as exc:  # pydantic's ValidationError: vLLM's own message
        raise ConfigError(f"engine.structured_outputs_config: {exc}") from None
