"""The inference engine: vLLM's offline ``LLMEngine`` driven request by request.

bulkinfer keeps the engine's queue full itself (``add_request`` / ``step``)
instead of calling ``LLM.generate`` per chunk, so continuous batching never
drains at a bucket or window boundary. Prompts arrive pre-tokenized.

Importing this module does not import vLLM or torch; :class:`VllmEngine` does.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bulkinfer.config import EngineSettings, structured_outputs_config
from bulkinfer.engine import batch_order, malloc
from bulkinfer.engine.args import (
    IN_PROCESS,
    MULTIPROCESSING_ENV,
    detect_device,
    has_nucleus,
    import_vllm,
    resolve_engine_args,
)
from bulkinfer.engine.kv_cache import available_memory_bytes
from bulkinfer.engine.pollers import idle_engine_pollers
from bulkinfer.engine.processes import (
    alive,
    core_exit_code,
    engine_processes,
    environment_until_spawned,
    exit_description,
    process_name,
)
from bulkinfer.engine.sampling import StreamedOutputs, Watcher, pooling_params, sampling_params
from bulkinfer.engine.starts import engine_start
from bulkinfer.engine.stepper import LIVENESS_INTERVAL_S, Stepper
from bulkinfer.errors import BulkinferError, ConfigError, EngineError
from bulkinfer.schema import Completion, Request

# close(): how long vLLM's own shutdown may take before the processes are killed (seconds).
CLOSE_TIMEOUT_S = 5.0

# Tokens between a streamed request's outputs (vLLM's stream_interval): 1, every step. Every token cost 5-10% of the
# completion tokens/s of 256-row bfloat16 compiled steps against every 16th (bench/results/stream_overhead-zen4-bf16-
# compiled.md; AMD EPYC Zen 4, 2026-12-02), but the ETA's step model (bulkinfer.report.eta, WorkEstimate.observe) and
# calibrate's step costs (bulkinfer.jobs.tune.step_seconds) read each step's tokens from the counts moving every step.
STREAM_INTERVAL = 1


class VllmEngine:
    """One vLLM ``LLMEngine`` for the whole run.

    Generation requests stream their tokens (vLLM's ``RequestOutputKind.DELTA``), so :attr:`generated_tokens`
    counts work as it happens, not only when a request finishes (see :class:`StreamedOutputs`), every
    :attr:`stream_interval` tokens (default :data:`STREAM_INTERVAL`; vLLM's ``SamplingParams.stream_interval``:
    the first token, then every that many, and the last), a watched request (:meth:`watch`) every token. With
    ``stream_tokens`` set to False, requests added from then on return once, finished (``FINAL_ONLY``: the
    baseline of ``bench/stream_overhead.py``).

    Args:
        model: a model directory or hub id, as vLLM takes it.
        settings: the engine arguments.
        stall_timeout_s: an engine step that has not returned after this many
            seconds while requests are in flight means the engine is stuck
            (:class:`EngineError`); None waits for ever (process death is
            still noticed within :data:`LIVENESS_INTERVAL_S`).
        environment: variables set while the engine starts, so its processes
            inherit them (a replica's ``VLLM_CPU_OMP_THREADS_BIND`` or
            ``CUDA_VISIBLE_DEVICES``); this process's own are restored after.
        step_done: set each time an engine step returns (replicas wait on one event for any of them).

    Raises:
        EngineError: vLLM is not installed or the engine fails to start.
        Interrupted: a stop signal arrived during the start (the engine's
            processes are terminated before it propagates).
    """

    overlap_steps = True  # False: a step starts once the last one's outputs are handled (bench's --no-overlap)

    def __init__(
        self,
        model: str | Path,
        settings: EngineSettings,
        stall_timeout_s: float | None = None,
        environment: Mapping[str, str] | None = None,
        step_done: threading.Event | None = None,
    ):
        import_vllm()
        import vllm
        from vllm import EngineArgs, LLMEngine, PoolingParams, SamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm.usage.usage_lib import UsageContext

        self._sampling_params = SamplingParams
        self._pooling_params = PoolingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._delta = RequestOutputKind.DELTA
        self.stream_tokens = True
        self.stream_interval = STREAM_INTERVAL
        self._stall_timeout_s = stall_timeout_s
        device = detect_device()
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        args = resolve_engine_args(str(model), settings, device, available_memory_bytes(), known)
        self._nucleus = has_nucleus(args)
        hooked = batch_order.hooked(device, args)
        if hooked:
            args["worker_extension_cls"] = batch_order.EXTENSION
        if "structured_outputs_config" in args:  # a TOML table: EngineArgs takes the config
            args["structured_outputs_config"] = structured_outputs_config(args["structured_outputs_config"])
        import psutil  # a dependency of vLLM

        from bulkinfer.engine.watchdog import Watchdog

        earlier = {p.pid for p in psutil.Process().children(recursive=True)}  # another replica's
        in_process = IN_PROCESS.claim(self, device, args, environment or {})
        variables = {**(environment or {}), **({MULTIPROCESSING_ENV: "0"} if in_process else {})}
        self._stepper = Stepper(step_done)
        watchdog: Watchdog | None = None
        try:
            start = engine_start(str(model), args.get("runner") or "generate")
            pages = malloc.huge_pages_paused(settings.huge_pages_at_start)

            def build() -> Any:
                return LLMEngine.from_engine_args(
                    EngineArgs(**args), usage_context=UsageContext.LLM_CLASS, enable_multiprocessing=not in_process
                )

            with environment_until_spawned(variables), start, pages as paused:
                watchdog = self._watchdog = Watchdog()  # first, and under the lock (environment_until_spawned)
                self._engine = self._stepper.call(build) if in_process else build()
        except BaseException as exc:
            self._stepper.stop()
            if watchdog is not None:
                watchdog.kill()
            IN_PROCESS.release(self)
            if isinstance(exc, BulkinferError | KeyboardInterrupt | SystemExit):
                raise
            if type(exc).__module__.startswith("pydantic") and type(exc).__name__ == "ValidationError":
                # vLLM's pydantic configs refused a setting as the engine was built: the settings' fault (exit 2)
                raise ConfigError(f"vLLM refused the engine settings ([engine], --engine-arg, flags): {exc}") from exc
            raise EngineError(f"the vLLM engine failed to start: {type(exc).__name__}: {exc}") from exc
        # vLLM's handles of its engine core processes, kept here: vLLM may drop its own once it sees the engine die
        resources = getattr(getattr(self._engine, "engine_core", None), "resources", None)
        manager_processes = getattr(getattr(resources, "engine_manager", None), "processes", None) or ()
        self._core_processes = {proc.pid: proc for proc in manager_processes if getattr(proc, "pid", None)}
        # The engine's processes: its engine cores and their workers (not another replica's, which may start
        # meanwhile, nor multiprocessing's resource tracker, which stays until this process exits and cleans up).
        self._processes = engine_processes(self._core_processes, earlier | {self._watchdog.pid})
        self._names = {p.pid: process_name(p) for p in self._processes}
        self._stepper.step = self._engine.step
        self._buffered: list[Completion] = []
        self._unreported = False  # a step's results waited for by add or abort, not yet returned by step
        self._unfinished: set[str] = set()  # request ids added and not yet returned finished
        self._closed = False
        vllm_config = self._engine.vllm_config
        self.max_model_len: int = vllm_config.model_config.max_model_len
        self.max_num_seqs: int = vllm_config.scheduler_config.max_num_seqs
        hidden = {"model", "tokenizer", "disable_log_stats", *(("worker_extension_cls",) if hooked else ())}
        self.settings = {
            **{k: v for k, v in args.items() if k not in hidden},
            "dtype": str(vllm_config.model_config.dtype).removeprefix("torch."),
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
            "scheduling_policy": vllm_config.scheduler_config.policy,
            "enable_prefix_caching": vllm_config.cache_config.enable_prefix_caching,
            "block_size": vllm_config.cache_config.block_size,
            # vLLM's setting ("auto") until a structured request shows the backend it chose
            "structured_outputs_backend": vllm_config.structured_outputs_config.backend,
            "device": device,
            "in_process": in_process,
            "distributed_executor_backend": vllm_config.parallel_config.distributed_executor_backend,
            "vllm_version": vllm.__version__,
            **malloc.reported(paused),
            "sched_idle_threads": idle_engine_pollers(device, args, in_process, self._processes),
        }
        self.settings["batch_order"] = self._install_step_hook(hooked, batch_order.wanted(settings.batch_order, args))
        self._outputs = StreamedOutputs()
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
        self._finish_step_in_flight()  # never send while a step is in flight
        if request.input_token_ids is not None:
            return self._add_embedding(request_id, request)
        assert request.prompt_token_ids is not None
        try:
            streamed = self.stream_tokens and request.score_from is None
            kind = self._delta if streamed else self._final_only
            every = 1 if request_id in self._outputs.watchers else self.stream_interval
            params = sampling_params(request, self._sampling_params, kind, self._nucleus, every)
            self._engine.add_request(
                request_id, self._tokens_input(request.prompt_token_ids), params, priority=request.priority
            )
        except Exception as exc:
            self._check_alive()
            if type(exc).__name__ == "EngineDeadError":  # vLLM's: the engine, not this request
                raise EngineError(
                    f"the vLLM engine died: {exc}; finished rows are kept: continue with --resume"
                ) from exc
            self._outputs.watchers.pop(request_id, None)
            return Completion(request_id, "", "error", len(request.prompt_token_ids), 0, f"{type(exc).__name__}: {exc}")
        self._unfinished.add(request_id)
        if request.score_from is not None:
            self._outputs.score_from[request_id] = request.score_from
        elif params.logprobs is not None:
            self._outputs.top_logprobs[request_id] = params.logprobs
        if params.structured_outputs is not None:  # vLLM's input processor resolved "auto" to a backend
            backend = getattr(params.structured_outputs, "_backend", None)
            self.settings["structured_outputs_backend"] = backend or self.settings["structured_outputs_backend"]
        return None

    def _add_embedding(self, request_id: str, request: Request) -> Completion | None:
        """Queue an embedding or pair-scoring request: one vLLM pooling request
        (``PoolingParams``, task ``embed`` or ``classify``) per input,
        ``REQUEST_ID#K``; their vectors come back as one :class:`Completion`.
        A rejected input aborts the others and fails the request.

        Raises:
            EngineError: the engine died.
        """
        assert request.input_token_ids is not None
        parts = [f"{request_id}#{k}" for k in range(len(request.input_token_ids))]
        added: list[str] = []
        try:
            params = pooling_params(request, self._pooling_params)
            for part, ids, one in zip(parts, request.input_token_ids, params, strict=True):
                self._engine.add_request(part, self._tokens_input(ids), one, priority=request.priority)
                added.append(part)
        except Exception as exc:
            self._check_alive()
            if type(exc).__name__ == "EngineDeadError":
                raise EngineError(
                    f"the vLLM engine died: {exc}; finished rows are kept: continue with --resume"
                ) from exc
            if added:
                self._engine.abort_request(added)
            return Completion(request_id, "", "error", request.prompt_length, 0, f"{type(exc).__name__}: {exc}")
        self._unfinished.add(request_id)
        self._outputs.expect_embeddings(request_id, parts)
        return None

    def _install_step_hook(self, hooked: bool, ordered: bool) -> str:
        """Installs :mod:`bulkinfer.engine.batch_order`'s step hook on the
        workers of an engine started with it (``hooked``); returns ``"kv-blocks"``
        when it sorts the running batch (``ordered`` and vLLM resolved the prefix
        cache on), else ``"vllm"`` (vLLM's own order)."""
        sort = ordered and bool(self.settings["enable_prefix_caching"])
        self._hooked = hooked and self._stepper.call(lambda: batch_order.install_all(self._engine, sort))
        return "kv-blocks" if sort and self._hooked else "vllm"

    def step_counts(self) -> dict[str, int] | None:
        """The step hook's counts since the engine started (see
        :func:`bulkinfer.engine.batch_order.step_counts`), None without it. Call between steps."""
        sorting = self.settings["batch_order"] == "kv-blocks"
        speculating = bool(self.settings.get("speculative_config"))
        return batch_order.step_counts(self._engine, sorting, speculating) if self._hooked else None

    @property
    def stepping(self) -> bool:
        """An engine step is running (in its thread): :meth:`add` would wait for it."""
        return self._stepper.running_since is not None

    # the live counts of the engine's outputs (StreamedOutputs), as the Engine protocol names them
    generated_tokens = property(operator.attrgetter("_outputs.generated_tokens"))
    prefilled_tokens = property(operator.attrgetter("_outputs.prefilled_tokens"))
    cached_tokens = property(operator.attrgetter("_outputs.cached_tokens"))

    @property
    def running_prompt_tokens(self) -> int:
        return self._outputs.running_prompt_tokens()

    @property
    def ended_sequences(self) -> int:
        return self._outputs.ended_sequences()

    def running_lengths(self) -> list[int]:
        return self._outputs.running_lengths()

    def step(self, wait: float | None = None) -> list[Completion]:
        """Run one engine step; return the requests that finished in it. A
        step :meth:`add` or :meth:`abort` waited for is returned first, and
        alone: each step reaches the caller once, its token counts apart from
        the next step's (a step that finished no row was told with the next:
        18 of 161 steps of a labelling job, ``bench/results/engine-steps-*.md``).

        With ``wait`` (seconds), return ``[]`` after that time if the step is
        still running; its results come with the next call.

        Raises:
            EngineError: an engine process died, vLLM raised, or no step
                returned for ``stall_timeout_s`` seconds.
        """
        if self._unreported:
            done, self._buffered, self._unreported = self._buffered, [], False
            return done
        self._stepper.start()
        return self._wait_step(wait, next_step=True)

    def _finish_step_in_flight(self) -> None:
        """Wait for the step in flight, if any; the next :meth:`step` returns
        its results (none finished, maybe) without running another, so the
        caller sees each step's token counts apart (see :meth:`step`)."""
        if self._stepper.running_since is not None:
            self._buffered.extend(self._wait_step(None))
            self._unreported = True

    def _wait_step(self, wait: float | None, next_step: bool = False) -> list[Completion]:
        """The running step's finished requests (``[]`` after ``wait`` s). With
        ``next_step``, the next step starts as soon as this one returned, while
        this thread turns its outputs into completions and the caller writes
        them: the engine is never idle waiting for bookkeeping (in this
        process the two would take turns, measured 4% of the generation time)."""
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
        if next_step and self.overlap_steps and self._engine.has_unfinished_requests():
            self._stepper.start()
        done = self._outputs.completions(outputs)
        self._unfinished.difference_update(c.request_id for c in done)
        return done

    def _check_alive(self) -> None:
        """Raises EngineError when an engine process is gone or vLLM marked its
        engine dead, naming the process and how it ended (the one whose exit
        code is known first: the engine core, vLLM's child)."""
        resources = getattr(getattr(self._engine, "engine_core", None), "resources", None)
        dead = [proc for proc in self._processes if not alive(proc)]
        if not dead and getattr(resources, "engine_dead", False):
            deadline = time.monotonic() + 1.0  # vLLM noticed first: let the process table catch up
            while not dead and time.monotonic() < deadline:
                time.sleep(0.05)
                dead = [proc for proc in self._processes if not alive(proc)]
            if not dead:
                raise EngineError("the vLLM engine core died; finished rows are kept: continue with --resume")
        if dead:
            codes = {proc.pid: core_exit_code(self._core_processes.get(proc.pid)) for proc in dead}
            proc = next((p for p in dead if codes[p.pid] is not None), dead[0])
            raise EngineError(
                f"the vLLM engine process {self._names.get(proc.pid, '')} (pid {proc.pid}) "
                f"{exit_description(codes[proc.pid])}; finished rows are kept: continue with --resume"
            )

    def has_unfinished(self) -> bool:
        """A request added has not been returned by :meth:`step` yet: it runs,
        or a step that started on its own (see :meth:`_wait_step`) finished
        it and holds its result (vLLM's ``has_unfinished_requests`` would
        already say False), or :meth:`add` buffered it."""
        return bool(self._unfinished or self._buffered)

    def watch(self, request_id: str, watcher: Watcher) -> None:
        """Call ``watcher`` with each piece of the generation request
        ``request_id`` (about to be added, or added and not finished) as the
        engine produces it, in the thread that calls :meth:`step` (an online
        request's streamed answer). Watched before :meth:`add`, a request
        streams every token instead of every :attr:`stream_interval`."""
        self._outputs.watchers[request_id] = watcher

    def abort_unfinished(self) -> None:
        """Abort every request still in the engine (:meth:`abort`), after the
        step in flight, if any; its results and any buffered ones are dropped.

        Raises:
            EngineError: the engine died.
        """
        self.abort(sorted(self._unfinished | {c.request_id for c in self._buffered}))

    def abort(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` (vLLM's ``abort_request``), after the step in
        flight, if any; their results, returned by no later :meth:`step`, are
        dropped. Ids not unfinished are ignored.

        Raises:
            EngineError: the engine died.
        """
        if self._closed:
            return
        self._finish_step_in_flight()
        dropped = set(request_ids)
        self._buffered = [c for c in self._buffered if c.request_id not in dropped]
        aborted = sorted(dropped & self._unfinished)
        self._unfinished.difference_update(aborted)
        if aborted:
            try:
                self._engine.abort_request(self._outputs.engine_ids(aborted))
            except Exception as exc:
                self._check_alive()
                raise EngineError(f"the vLLM engine failed to abort requests: {type(exc).__name__}: {exc}") from exc
        self._outputs.forget(aborted)

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
        if any(alive(p) for p in self._processes):
            self._watchdog.kill()
        else:
            self._watchdog.close()
        IN_PROCESS.release(self)
