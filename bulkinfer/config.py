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

from bulkinfer.checks import validate
from bulkinfer.errors import ConfigError, InputFileError

FeedOrder = Literal["descending", "ascending", "arrival"]
OutputOrder = Literal["input", "completion"]

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
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: Mapping[str, float] | None = None
    # log-probabilities: None = none; k = each completion token's with the top k alternatives
    logprobs: int | None = None
    # lower runs first (vLLM's priority scheduling; any row with a priority turns it on)
    priority: int = 0
    # a vLLM StructuredOutputsParams table: one of json, regex, choice, grammar, json_object
    structured_outputs: Mapping[str, Any] | None = None


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
    - ``prefix_aware``: within a window, rows whose prompts share at least
      one KV-cache block of tokens are fed together, the longest first, so
      the others hit vLLM's prefix cache (:mod:`bulkinfer.prep.prefix`);
      groups are ordered by ``order``. Measured in README, Performance.
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
    - ``output_order``: the order of the rows in the output and errors files:
      ``input`` (the input's, restored at publishing by an external merge in
      bounded memory, see :mod:`bulkinfer.io.spool`) or ``completion`` (the
      order rows finished in, published in one streaming pass without a sort).
    """

    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    order: FeedOrder = "descending"
    prefix_aware: bool = True
    window_rows: int = 8192
    max_in_flight: int | None = None
    padding_batch_size: int = 16
    stall_timeout_s: float | None = 600.0
    output_order: OutputOrder = "input"


@dataclass(frozen=True, slots=True)
class RaySettings:
    """Where the replicas run when a Ray cluster runs them (``--ray``); they
    do not shape results, so a resumed run may change them.

    - ``address``: None (no Ray: replicas on this host), ``"local"`` (start a
      Ray cluster on this machine for the run), ``"auto"`` (the cluster this
      machine is part of), ``"ray://HOST:PORT"`` (Ray Client) or a GCS
      ``HOST:PORT``; what ``ray.init(address=...)`` takes.
    - ``cpus_per_replica``: Ray CPUs each replica's actor reserves on a
      cluster without GPUs (its engine's threads); None: the cluster's CPUs
      divided among the replicas, at most one node's.
    - ``max_restarts``: how often Ray restarts a replica's actor that died
      (Ray's ``max_restarts``; -1: without limit). Its unfinished requests go
      to the other replicas at once, and it rejoins once restarted.
    """

    address: str | None = None
    cpus_per_replica: int | None = None
    max_restarts: int = 3


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything one ``bulkinfer run`` needs besides its input and output paths."""

    model: str | None = None
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    engine: EngineSettings = field(default_factory=EngineSettings)
    plan: PlanSettings = field(default_factory=PlanSettings)
    ray: RaySettings = field(default_factory=RaySettings)
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
    the dotted settings key it overrides: every sampling default by its own
    name (``max_tokens`` -> ``sampling.max_tokens``), every engine and plan
    setting by its own name (``seed`` is the engine's seed: a row's own
    ``seed`` is the per-request one)."""
    return {
        "model": "model",
        "apply_chat_template": "apply_chat_template",
        **{f.name: f"sampling.{f.name}" for f in dataclasses.fields(SamplingDefaults) if f.name != "seed"},
        **{f.name: f"engine.{f.name}" for f in dataclasses.fields(EngineSettings) if f.name != "extra_args"},
        **{f.name: f"plan.{f.name}" for f in dataclasses.fields(PlanSettings)},
        "ray": "ray.address",
        **{f"ray_{f.name}": f"ray.{f.name}" for f in dataclasses.fields(RaySettings) if f.name != "address"},
    }


_SECTIONS: dict[str, type] = {
    "sampling": SamplingDefaults,
    "engine": EngineSettings,
    "plan": PlanSettings,
    "ray": RaySettings,
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
        InputFileError: the config file does not exist (exit 4, as for every
            missing file).
        ConfigError: a config file that is a directory, unreadable (any other
            ``OSError``) or not valid TOML (with its line and column);
            unknown keys; invalid values (naming the flag or the key and file).
    """
    data: dict[str, Any] = {}
    names: dict[str, str] = {}
    if config_path is not None:
        try:
            data = tomllib.loads(Path(config_path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InputFileError(f"config file not found: {config_path}") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {config_path} is a directory; give a TOML file") from None
        except OSError as exc:  # EACCES, ENOTDIR, ELOOP, EIO, ...
            reason = exc.strerror or str(exc)
            raise ConfigError(f"cannot read config file {config_path}: {reason}") from None
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
