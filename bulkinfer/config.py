"""Settings: built-in defaults < a TOML file (``--config``) < CLI flags.

A row's own values (``max_tokens``, ``temperature``, ...) win over all three;
that merge happens per row in :mod:`bulkinfer.rows`.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bulkinfer.errors import ConfigError

FeedOrder = Literal["descending", "ascending", "arrival"]
FEED_ORDERS: tuple[str, ...] = ("descending", "ascending", "arrival")

# Upper bounds (inclusive, prompt tokens) of the default buckets; a last
# bucket takes everything longer than the last bound.
DEFAULT_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Per-request sampling defaults; a row's own fields override them.

    Names and meanings follow the OpenAI API and vLLM's ``SamplingParams``.
    ``max_tokens`` counts completion tokens.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """vLLM engine arguments, with vLLM's names. ``None`` means "let bulkinfer
    choose for this device" (see :func:`bulkinfer.engine.resolve_engine_args`).
    """

    dtype: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool | None = None
    seed: int = 0
    trust_remote_code: bool = False


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """How prompts are sorted, bucketed and fed to the engine.

    - ``buckets``: inclusive upper bounds in prompt tokens, ascending.
    - ``order``: the order buckets are fed in; ``descending`` (longest first)
      by default: the three orders measured level on ShareGPT-200 on CPU
      (README, Performance: Feed order), and longest-first shortens the tail
      when the queue is deeper than the engine's running batch.
    - ``window_rows``: rows read, tokenized and sorted together; memory is
      bounded by about two windows whatever the file size.
    - ``max_in_flight``: requests handed to the engine and not yet finished;
      ``None`` means 2 x the engine's ``max_num_seqs``.
    - ``padding_batch_size``: the static batch size B used only to *report*
      padding efficiency (vLLM itself does not pad).
    """

    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    order: FeedOrder = "descending"
    window_rows: int = 8192
    max_in_flight: int | None = None
    padding_batch_size: int = 16


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything one ``bulkinfer run`` needs besides its input and output paths."""

    model: str | None = None
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    engine: EngineSettings = field(default_factory=EngineSettings)
    plan: PlanSettings = field(default_factory=PlanSettings)
    passthrough: bool = True
    # Send each ``prompt`` as a one-message user chat through the model's chat
    # template (what instruct models expect); ``messages`` rows always are.
    apply_chat_template: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (tuples become lists)."""
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type] = {
    "sampling": SamplingDefaults,
    "engine": EngineSettings,
    "plan": PlanSettings,
}
_TOP_LEVEL = {"model", "passthrough", "apply_chat_template"}


def _check_keys(where: str, cls: type, values: Mapping[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def _build(cls: type, where: str, values: Mapping[str, Any]) -> Any:
    _check_keys(where, cls, values)
    converted = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**converted)


def load_settings(config_path: Path | None = None, overrides: Mapping[str, Any] | None = None) -> Settings:
    """Build the frozen :class:`Settings` from defaults, a TOML file and flags.

    Args:
        config_path: a TOML file laid out as in ``configs/default.toml``, or None.
        overrides: flag values as dotted keys, e.g. ``{"sampling.max_tokens": 64,
            "engine.dtype": "float32", "model": "path"}``; ``None`` values are
            ignored (flag not given).

    Raises:
        ConfigError: unreadable TOML, unknown keys, or invalid values.
    """
    data: dict[str, Any] = {}
    if config_path is not None:
        try:
            data = tomllib.loads(Path(config_path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {config_path}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{config_path}: not valid TOML: {exc}") from None
    where = str(config_path) if config_path else "settings"
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
    try:
        settings = Settings(
            **top,
            **{name: _build(cls, f"{where} [{name}]", sections[name]) for name, cls in _SECTIONS.items()},
        )
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    validate(settings)
    return settings


def _int_ge_1(value: Any, optional: bool = False) -> bool:
    """An integer (not a bool) >= 1, or None when ``optional``."""
    if value is None:
        return optional
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def validate(settings: Settings) -> None:
    """Check types and ranges once, where settings are built.

    Raises:
        ConfigError: naming the setting and the allowed range.
    """
    s, e, p = settings.sampling, settings.engine, settings.plan
    checks: list[tuple[bool, str]] = [
        (isinstance(settings.passthrough, bool), "passthrough must be true or false"),
        (isinstance(settings.apply_chat_template, bool), "apply_chat_template must be true or false"),
        (_int_ge_1(s.max_tokens), "sampling.max_tokens must be an integer >= 1"),
        (_number(s.temperature) and 0 <= s.temperature <= 2, "sampling.temperature must be in [0, 2]"),
        (_number(s.top_p) and 0 < s.top_p <= 1, "sampling.top_p must be in (0, 1]"),
        (
            isinstance(s.stop, tuple) and all(isinstance(x, str) for x in s.stop),
            "sampling.stop must be a list of strings",
        ),
        (_int_ge_1(e.tensor_parallel_size), "engine.tensor_parallel_size must be an integer >= 1"),
        (_int_ge_1(e.data_parallel_size), "engine.data_parallel_size must be an integer >= 1"),
        (_int_ge_1(e.max_model_len, optional=True), "engine.max_model_len must be an integer >= 1"),
        (_int_ge_1(e.max_num_seqs, optional=True), "engine.max_num_seqs must be an integer >= 1"),
        (
            e.gpu_memory_utilization is None
            or (_number(e.gpu_memory_utilization) and 0 < e.gpu_memory_utilization <= 1),
            "engine.gpu_memory_utilization must be in (0, 1]",
        ),
        (
            isinstance(p.buckets, tuple)
            and all(_int_ge_1(b) for b in p.buckets)
            and list(p.buckets) == sorted(set(p.buckets)),
            "plan.buckets must be strictly ascending positive integers",
        ),
        (p.order in FEED_ORDERS, f"plan.order must be one of {', '.join(FEED_ORDERS)}"),
        (_int_ge_1(p.window_rows), "plan.window_rows must be an integer >= 1"),
        (_int_ge_1(p.max_in_flight, optional=True), "plan.max_in_flight must be an integer >= 1"),
        (_int_ge_1(p.padding_batch_size), "plan.padding_batch_size must be an integer >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
