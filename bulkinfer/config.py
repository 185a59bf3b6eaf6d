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
    choose for this device" (see :func:`bulkinfer.engine.args.resolve_engine_args`).

    The common arguments are typed fields (checked here); ``extra_args``
    holds any other field of vLLM's ``EngineArgs`` (``enable_prefix_caching``,
    ``quantization``, ``kv_cache_dtype``, ...): any other key of the
    ``[engine]`` table or ``--engine-arg KEY=VALUE``, checked against
    ``EngineArgs`` itself where the engine is built.
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
    extra_args: Mapping[str, Any] = field(default_factory=dict)


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
    - ``stall_timeout_s``: seconds one engine step may take before the engine
      counts as stuck (exit 5, finished rows kept). A dead engine process is
      noticed within 0.2 s whatever this is; this catches an engine that is
      alive but no longer answers. One step is at most one batch of
      ``max_num_batched_tokens`` prompt tokens: raise it for large models on
      CPU. ``None``: wait for ever.
    """

    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    order: FeedOrder = "descending"
    window_rows: int = 8192
    max_in_flight: int | None = None
    padding_batch_size: int = 16
    stall_timeout_s: float | None = 600.0


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything one ``bulkinfer run`` needs besides its input and output paths."""

    model: str | None = None
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    engine: EngineSettings = field(default_factory=EngineSettings)
    plan: PlanSettings = field(default_factory=PlanSettings)
    passthrough: bool = True
    # Send each ``prompt`` as a one-message user chat through the model's chat
    # template (what instruct models expect): True, False, or "auto" = when the
    # tokenizer has a chat template (see resolve_chat_template). ``messages``
    # rows and OpenAI /v1/chat/completions lines always are; /v1/completions
    # lines never.
    apply_chat_template: bool | Literal["auto"] = "auto"

    def resolve_chat_template(self, tokenizer: Any) -> Settings:
        """These settings with ``apply_chat_template`` decided: ``"auto"``
        becomes True when ``tokenizer`` has a chat template (an instruct
        model), False when it has none or is None (a base model)."""
        if isinstance(self.apply_chat_template, bool):
            return self
        return dataclasses.replace(self, apply_chat_template=bool(getattr(tokenizer, "chat_template", None)))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (tuples become lists)."""
        return dataclasses.asdict(self)


def option_keys() -> dict[str, str]:
    """Flat option name (a ``bulkinfer run`` flag's, with underscores) ->
    the dotted settings key it overrides: ``max_tokens`` ->
    ``sampling.max_tokens``, every engine and plan setting by its own name
    (``seed`` is the engine's seed)."""
    return {
        "model": "model",
        "apply_chat_template": "apply_chat_template",
        **{name: f"sampling.{name}" for name in ("max_tokens", "temperature", "top_p", "stop", "ignore_eos")},
        **{f.name: f"engine.{f.name}" for f in dataclasses.fields(EngineSettings) if f.name != "extra_args"},
        **{f.name: f"plan.{f.name}" for f in dataclasses.fields(PlanSettings)},
    }


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
    if cls is EngineSettings:  # any other key is one of vLLM's EngineArgs (checked where the engine is built)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra_args"}
        extra = {**values.get("extra_args", {}), **{k: v for k, v in values.items() if k not in known | {"extra_args"}}}
        values = {**{k: v for k, v in values.items() if k in known}, "extra_args": extra}
    _check_keys(where, cls, values)
    converted = {k: tuple(v) if isinstance(v, list) and k != "extra_args" else v for k, v in values.items()}
    return cls(**converted)


def load_settings(config_path: Path | None = None, overrides: Mapping[str, Any] | None = None) -> Settings:
    """Build the frozen :class:`Settings` from defaults, a TOML file and flags.

    Args:
        config_path: a TOML file laid out as in ``configs/default.toml``, or None.
        overrides: flag values as dotted keys, e.g. ``{"sampling.max_tokens": 64,
            "engine.dtype": "float32", "model": "path"}``; ``None`` values are
            ignored (flag not given).

    Raises:
        ConfigError: a config file that is missing, a directory, unreadable
            (any ``OSError``) or not valid TOML; unknown keys; invalid values.
    """
    data: dict[str, Any] = {}
    if config_path is not None:
        try:
            data = tomllib.loads(Path(config_path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {config_path}") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {config_path} is a directory; give a TOML file") from None
        except OSError as exc:  # EACCES, ENOTDIR, ELOOP, EIO, ...
            reason = exc.strerror or str(exc)
            raise ConfigError(f"cannot read config file {config_path}: {reason}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{config_path}: not valid TOML: {exc}") from None
    return _from_data(data, overrides, str(config_path) if config_path else "settings")


def with_overrides(settings: Settings, overrides: Mapping[str, Any]) -> Settings:
    """``settings`` with ``overrides`` (dotted keys, as :func:`load_settings`
    takes them) applied and checked again.

    Raises:
        ConfigError: unknown keys; invalid values.
    """
    return _from_data(settings.to_dict(), overrides, "settings")


def _from_data(data: dict[str, Any], overrides: Mapping[str, Any] | None, where: str) -> Settings:
    """Settings from a TOML-shaped dict and dotted overrides (``None`` values skipped)."""
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


# Seeds, as half-open ranges [low, high).
#
# sampling.seed (per request): vLLM 0.32 declares ``SamplingParams.seed: int |
# None`` and checks nothing in ``_verify_args``; the request then crosses to the
# engine core as an ``EngineCoreRequest`` (vllm/v1/engine/__init__.py,
# ``msgspec.Struct, array_like=True``) through ``MsgpackEncoder``/``Decoder``
# (vllm/v1/serial_utils.py). A float or bool seed is refused only there, by the
# decoder in the engine core's input thread ("Expected `int | null`, got
# `float` - at `$[3].seed`"), which kills the engine; msgpack carries ints in
# [-2**63, 2**64). ``SamplingParams.__post_init__`` turns -1 into None ("no
# seed", sampling_params.py: ``if self.seed == -1: self.seed = None``), and
# vLLM's own OpenAI front end allows ``Field(None, ge=_INT64_MIN,
# le=_INT64_MAX)`` (entrypoints/openai/completion/protocol.py). We take the
# part every path accepts and that means what it says: 0 <= seed < 2**63.
SEED_RANGE: tuple[int, int] = (0, 2**63)
# engine.seed: vLLM's workers call ``set_random_seed(model_config.seed)``
# (v1/worker/cpu_worker.py, gpu_worker.py), which runs ``np.random.seed(seed)``
# (vllm/utils/torch_utils.py); NumPy takes only 0 <= seed <= 2**32 - 1.
ENGINE_SEED_RANGE: tuple[int, int] = (0, 2**32)


def _int(value: Any) -> bool:
    """An integer and not a bool (TOML and JSON ``true`` are ints to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(value: Any, bounds: tuple[int, int], optional: bool = False) -> bool:
    """An integer (not a bool) with ``low <= value < high``, or None when ``optional``."""
    if value is None:
        return optional
    return _int(value) and bounds[0] <= value < bounds[1]


def _shown(value: Any) -> str:
    """``value`` for an error message: lists as lists, cut to 80 characters."""
    shown = repr(list(value) if isinstance(value, tuple) else value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _int_ge_1(value: Any, optional: bool = False) -> bool:
    """An integer (not a bool) >= 1, or None when ``optional``."""
    if value is None:
        return optional
    return _int(value) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def validate(settings: Settings) -> None:
    """Check types and ranges once, where settings are built.

    Raises:
        ConfigError: naming the first bad setting, what it must be and the
            value given, e.g. ``sampling.seed must be an integer in [0, 2**63),
            got 1.5``.
    """
    s, e, p = settings.sampling, settings.engine, settings.plan
    # (setting, value given, valid?, what it must be)
    checks: list[tuple[str, Any, bool, str]] = [
        ("model", settings.model, settings.model is None or isinstance(settings.model, str), "a string"),
        ("passthrough", settings.passthrough, isinstance(settings.passthrough, bool), "true or false"),
        (
            "apply_chat_template",
            settings.apply_chat_template,
            isinstance(settings.apply_chat_template, bool) or settings.apply_chat_template == "auto",
            'true, false or "auto"',
        ),
        ("sampling.max_tokens", s.max_tokens, _int_ge_1(s.max_tokens), "an integer >= 1"),
        (
            "sampling.temperature",
            s.temperature,
            _number(s.temperature) and 0 <= s.temperature <= 2,
            "a number in [0, 2]",
        ),
        ("sampling.top_p", s.top_p, _number(s.top_p) and 0 < s.top_p <= 1, "a number in (0, 1]"),
        ("sampling.seed", s.seed, _int_in(s.seed, SEED_RANGE, optional=True), "an integer in [0, 2**63)"),
        (
            "sampling.stop",
            s.stop,
            isinstance(s.stop, tuple) and all(isinstance(x, str) and x for x in s.stop),
            "a list of non-empty strings",  # vLLM: "stop cannot contain an empty string."
        ),
        ("sampling.ignore_eos", s.ignore_eos, isinstance(s.ignore_eos, bool), "true or false"),
        ("engine.dtype", e.dtype, isinstance(e.dtype, str) and bool(e.dtype), "a non-empty string"),
        ("engine.tensor_parallel_size", e.tensor_parallel_size, _int_ge_1(e.tensor_parallel_size), "an integer >= 1"),
        ("engine.data_parallel_size", e.data_parallel_size, _int_ge_1(e.data_parallel_size), "an integer >= 1"),
        ("engine.max_model_len", e.max_model_len, _int_ge_1(e.max_model_len, optional=True), "an integer >= 1"),
        ("engine.max_num_seqs", e.max_num_seqs, _int_ge_1(e.max_num_seqs, optional=True), "an integer >= 1"),
        (
            "engine.max_num_batched_tokens",
            e.max_num_batched_tokens,
            _int_ge_1(e.max_num_batched_tokens, optional=True),
            "an integer >= 1",
        ),
        (
            "engine.gpu_memory_utilization",
            e.gpu_memory_utilization,
            e.gpu_memory_utilization is None
            or (_number(e.gpu_memory_utilization) and 0 < e.gpu_memory_utilization <= 1),
            "a number in (0, 1]",
        ),
        (
            "engine.kv_cache_memory_bytes",
            e.kv_cache_memory_bytes,
            _int_ge_1(e.kv_cache_memory_bytes, optional=True),
            "an integer >= 1 (bytes)",
        ),
        (
            "engine.enforce_eager",
            e.enforce_eager,
            e.enforce_eager is None or isinstance(e.enforce_eager, bool),
            "true or false",
        ),
        ("engine.seed", e.seed, _int_in(e.seed, ENGINE_SEED_RANGE), "an integer in [0, 2**32)"),
        ("engine.trust_remote_code", e.trust_remote_code, isinstance(e.trust_remote_code, bool), "true or false"),
        (
            "plan.buckets",
            p.buckets,
            isinstance(p.buckets, tuple)
            and all(_int_ge_1(b) for b in p.buckets)
            and list(p.buckets) == sorted(set(p.buckets)),
            "strictly ascending positive integers",
        ),
        ("plan.order", p.order, p.order in FEED_ORDERS, f"one of {', '.join(FEED_ORDERS)}"),
        ("plan.window_rows", p.window_rows, _int_ge_1(p.window_rows), "an integer >= 1"),
        ("plan.max_in_flight", p.max_in_flight, _int_ge_1(p.max_in_flight, optional=True), "an integer >= 1"),
        (
            "plan.stall_timeout_s",
            p.stall_timeout_s,
            p.stall_timeout_s is None or (_number(p.stall_timeout_s) and p.stall_timeout_s > 0),
            "a number of seconds > 0",
        ),
        ("plan.padding_batch_size", p.padding_batch_size, _int_ge_1(p.padding_batch_size), "an integer >= 1"),
    ]
    for name, value, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{name} must be {expected}, got {_shown(value)}")
