"""An engine in a process of its own, asked over a pipe to time what
``calibrate --compile`` measures, so that two engines (eager and compiled)
can be alive at once and take turns trial by trial and point by point
(:func:`bulkinfer.jobs.compile_choice.measure_compile`).

Why turns: the compile choice rests on the difference between the two
engines' step costs, and this 2-core VM's speed wanders by up to 30% within
20 minutes (AMD EPYC Zen 4, 2026-12-01). Measured one engine after the
other, minutes apart, a 64-row step of 512-token prompts cost 209 ms eager
and 195 ms compiled (1.07x); the same point measured side by side
(``python -m bench.step_ab``, each point on one engine and straight after on
the other; ``bench/results/step-ab-zen4-round1.log``,
``step-ab-zen4-small.md``) cost 192 and 152 ms (1.26x), 220 and 166 ms,
170 and 162 ms. The waiting engine sleeps on its pipe: it takes no core
from the one that runs.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from bulkinfer.config import Settings
from bulkinfer.engine.args import import_vllm
from bulkinfer.engine.base import EngineFactory
from bulkinfer.errors import EngineError
from bulkinfer.jobs.decode_steps import GRID_TOKENS
from bulkinfer.jobs.tune import speed, step_seconds
from bulkinfer.models import load_tokenizer


class ServedEngine(Protocol):
    """A started engine that runs calibration trials on request."""

    start_s: float  # seconds its engine took to start (vLLM already imported)

    def ask(self, what: str, *args: Any) -> Any:
        """``("speed", rows, tokens)``: completion tokens/s of the speed
        trial (:func:`~bulkinfer.jobs.tune.speed`); ``("step", rows,
        prompt_tokens)``: (seconds a decode step, seconds a prompt token's
        prefill) (:func:`~bulkinfer.jobs.tune.step_seconds`)."""
        ...

    def close(self) -> None: ...


class LocalEngine:
    """The engine in this process (a fake engine's tests; the server's own half).

    Raises:
        EngineError: the engine fails to start.
    """

    def __init__(self, model: str, settings: Settings, engine_factory: EngineFactory) -> None:
        self.tokenizer = load_tokenizer(model, settings.engine.trust_remote_code)  # as a run, before vLLM
        import_vllm()
        clock = time.monotonic()
        self.engine = engine_factory(model, settings)
        self.start_s = round(time.monotonic() - clock, 2)

    def ask(self, what: str, *args: Any) -> Any:
        if what == "speed":
            rows, tokens = args
            return round(speed(self.engine, self.tokenizer, rows, tokens)[0], 2)
        if what == "step":
            rows, prompt_tokens = args
            return step_seconds(self.engine, rows, prompt_tokens, GRID_TOKENS, len(self.tokenizer))
        raise ValueError(f"no calibration trial {what!r}")

    def close(self) -> None:
        self.engine.close()


def _serve(
    conn: Connection, local_engine: Callable[..., ServedEngine], model: str, settings: Settings, factory: EngineFactory
) -> None:
    """The served process: start the engine (``local_engine``), say its start
    seconds, then answer each ``(what, args)`` until ``None``; every answer
    ``("ok", value)`` or ``("error", exception)``."""
    try:
        local = local_engine(model, settings, factory)
    except Exception as exc:  # pickled back and raised in the caller
        conn.send(("error", exc))
        return
    try:
        conn.send(("ok", local.start_s))
        while (message := conn.recv()) is not None:
            what, args = message
            try:
                conn.send(("ok", local.ask(what, *args)))
            except Exception as exc:
                conn.send(("error", exc))
    finally:
        local.close()


class ProcessEngine:
    """The engine in a new Python process (``multiprocessing`` spawn: nothing
    imported, compiled or cached in memory yet, as at a run's start; torch's
    compile caches key a graph by what the process compiled before it).
    Output goes where this process's file descriptors 1 and 2 go.
    ``local_engine``: what the new process starts (a module-level callable).

    Raises:
        EngineError: the engine fails to start, or its process ends.
    """

    def __init__(
        self,
        model: str,
        settings: Settings,
        engine_factory: EngineFactory,
        local_engine: Callable[..., ServedEngine] = LocalEngine,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        args = (child, local_engine, model, settings, engine_factory)
        self._process = context.Process(target=_serve, args=args, daemon=True)
        self._process.start()
        child.close()
        self.start_s: float = self._answer()

    def ask(self, what: str, *args: Any) -> Any:
        self._conn.send((what, args))
        return self._answer()

    def _answer(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._process.join(timeout=10)
            raise EngineError(
                f"the calibration engine's process ended (exit code {self._process.exitcode}); its log says why"
            ) from None
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass  # it ended already
        self._process.join(timeout=120)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join()
        self._conn.close()
