"""One engine opened once and used by several runs in one process
(``bulkinfer.open_engine``): a notebook or a script running many files, a
test suite. Each run's files, report and exit code are its own; the engine
start (model load, KV cache, warm-up: 30-60 s on CPU) is paid once.

The engine's settings are fixed when it opens: the dtype bulkinfer decides
for this machine (:func:`~bulkinfer.jobs.tune.measured_settings`, as a run
does), the KV cache the user gave or vLLM's default (not sized to one job,
as a server's is not). A run on it takes no engine setting of its own:
giving one is an error, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bulkinfer.config import Settings
from bulkinfer.engine.args import detect_device
from bulkinfer.engine.base import Engine, EngineFactory, KeptEngine
from bulkinfer.engine.factory import vllm_engine
from bulkinfer.errors import ConfigError
from bulkinfer.jobs.tune import measured_settings, print_to_stderr
from bulkinfer.models import resolve_model
from bulkinfer.stop import StopToken

TURN_CHECK_S = 0.2  # a run waiting for its turn on the engine checks its stop token this often (seconds)


class SharedEngine:
    """An engine kept open across runs; an :data:`EngineFactory` for them
    (each run gets it behind a ``close()`` that only aborts what the run
    left unfinished). Close it with :meth:`close` or a ``with`` block.

    Args:
        settings: the engine's settings (``model`` and ``[engine]``); the
            run-level sections are the runs' own.
        engine_factory: what builds the engine (tests inject fakes).

    Raises:
        ModelError: the model cannot be found.
        ConfigError, EngineError: as a run's engine start.
    """

    outlives_run = True  # read by the run: an engine that outlives it is not sized to its job

    def __init__(self, settings: Settings, engine_factory: EngineFactory = vllm_engine):
        self.requested = settings
        self.model = resolve_model(settings.model)
        # the probe starts engines of its own (never this one), as a run's does
        self.settings, self.engine_choice = measured_settings(
            self.model, settings, detect_device(), vllm_engine, print_to_stderr
        )
        self._kept = KeptEngine(engine_factory)
        self._kept.get(self.model, self.settings)
        self._turn = threading.Lock()

    def __call__(self, model: str, settings: Settings) -> Engine:
        """The kept engine for a run (its ``settings`` were checked by
        :meth:`settings_for`)."""
        return self._kept.reused(model, settings)

    def settings_for(self, settings: Settings | None, engine_overrides: dict[str, Any]) -> Settings:
        """A run's settings on this engine: ``settings`` (default: the ones
        the engine opened with) with the engine's model and engine section.

        Raises:
            ConfigError: the run asks for a model or engine setting
                (``engine_overrides``, or a ``settings`` whose model or
                ``[engine]`` differ from the engine's): they belong to
                :func:`bulkinfer.open_engine`.
        """
        if engine_overrides:
            raise ConfigError(
                f"{', '.join(sorted(engine_overrides))}: an engine setting; this run uses an engine opened "
                "before it: give engine settings to bulkinfer.open_engine()"
            )
        base = settings or self.requested
        for name in ("model", "engine"):
            if getattr(base, name) != getattr(self.requested, name):
                raise ConfigError(
                    f"the run's settings have another {name} than the open engine's; give the engine's "
                    "settings to bulkinfer.open_engine() and leave them out of the run"
                )
        return dataclasses.replace(base, model=self.requested.model, engine=self.requested.engine)

    @contextmanager
    def turn(self, stop: StopToken) -> Iterator[None]:
        """One job at a time on this engine: the ``with`` body runs once no
        other job (another thread's ``bulkinfer.run`` or ``evaluate`` on it)
        is inside its own ``turn``, which it waits for, saying so on stderr.
        Two jobs at once would each take the other's finished requests from
        the engine's steps, and the engine's token counts (throughput, the
        ETA) would be both jobs'.

        Raises:
            Interrupted: ``stop`` was set while the job waited (no file was
                written; checked every :data:`TURN_CHECK_S` seconds).
        """
        if not self._turn.acquire(blocking=False):
            print_to_stderr("waiting for the shared engine: another run in this process is using it")
            while not self._turn.acquire(timeout=TURN_CHECK_S):
                if stop.is_set():
                    raise stop.interrupted("it was waiting for the shared engine (another run had it): nothing was run")
        try:
            yield
        finally:
            self._turn.release()

    def close(self) -> None:
        """Close the engine (its processes end)."""
        self._kept.close()

    def __enter__(self) -> SharedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
