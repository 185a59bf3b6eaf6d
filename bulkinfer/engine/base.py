"""The Engine protocol: what the feed loop needs from an engine. vLLM's
(:class:`bulkinfer.engine.vllm.VllmEngine`) is the real one; several replicas
or a remote actor can satisfy it without touching the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from bulkinfer.config import Settings
from bulkinfer.errors import EngineError
from bulkinfer.schema import Completion, Request


class Engine(Protocol):
    """What the feed loop (:func:`bulkinfer.engine.feed.feed`) needs from an engine;
    :class:`~bulkinfer.engine.vllm.VllmEngine` is the real one.

    ``step(wait)`` returns the requests that finished; with ``wait`` (seconds)
    it returns ``[]`` once that time has passed even though the engine step is
    still running (its results come with a later call), so the caller can
    react to a stop signal. It raises :class:`EngineError` when the engine died.

    ``generated_tokens`` and ``prefilled_tokens`` count, since the engine
    started, the completion tokens generated and the prompt tokens processed
    for every sequence, finished or not (a request of ``n`` choices
    processes its prompt ``n`` times: vLLM prefills each child request,
    whole blocks from the prefix cache once a sibling has them);
    ``cached_tokens`` those of the prompt tokens processed that the engine
    served from its prefix cache (vLLM's ``RequestOutput.num_cached_tokens``:
    not computed again);
    ``running_lengths()`` gives the
    completion tokens so far of each sequence still generating (a choice of
    an unfinished request that has some: a request of ``n`` choices runs
    ``n``; live progress; an engine that cannot see unfinished requests
    counts them when they finish and returns ``[]``), ``running_prompt_tokens``
    the prompt tokens of those sequences, summed (the context they attend
    over, with their completion tokens: the ETA's step model), and
    ``ended_sequences`` the choices that ended while their request runs on
    (neither running nor waiting: their lengths come with the request).

    ``abort_unfinished()`` drops every request the engine still holds (a
    stopped run's) and any finished one not yet returned: nothing of them
    comes from a later ``step``, so another run can use the engine.
    """

    max_model_len: int
    max_num_seqs: int

    @property
    def settings(self) -> dict[str, Any]: ...
    @property
    def generated_tokens(self) -> int: ...
    @property
    def prefilled_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def running_prompt_tokens(self) -> int: ...
    @property
    def ended_sequences(self) -> int: ...
    def running_lengths(self) -> list[int]: ...

    def add(self, request_id: str, request: Request) -> Completion | None: ...
    def step(self, wait: float | None = None) -> list[Completion]: ...
    def has_unfinished(self) -> bool: ...
    def abort_unfinished(self) -> None: ...
    def close(self) -> None: ...


EngineFactory = Callable[[str, Settings], Engine]


class NoEngine:
    """Stands in for the engine of a run with no rows (an empty input): no
    model is loaded and nothing is ever added."""

    max_model_len = 0
    max_num_seqs = 1
    settings: dict[str, Any] = {}
    generated_tokens = prefilled_tokens = cached_tokens = running_prompt_tokens = ended_sequences = 0

    def running_lengths(self) -> list[int]:
        return []

    def add(self, request_id: str, request: Request) -> Completion | None:
        raise AssertionError("an empty input has no requests")

    def step(self, wait: float | None = None) -> list[Completion]:
        return []

    def has_unfinished(self) -> bool:
        return False

    def abort_unfinished(self) -> None:
        pass

    def close(self) -> None:
        pass


class KeptEngine:
    """An engine factory for :func:`bulkinfer.jobs.run.run` that keeps the
    engine it makes open after the run, so that the perplexity pass reuses it
    instead of starting a second engine (~30 s on CPU). The run's ``close()``
    is a no-op; :meth:`close` closes the kept engine."""

    def __init__(self, factory: EngineFactory):
        self.factory = factory
        self.engine: Engine | None = None

    def __call__(self, model_path: str, settings: Settings) -> Engine:
        self.engine = self.factory(model_path, settings)
        return _Unclosed(self.engine)

    def get(self, model_path: str, settings: Settings) -> Engine:
        """The kept engine, or a new one (kept too) when the run made none
        (predictions given, or an already complete output)."""
        if self.engine is None:
            self.engine = self.factory(model_path, settings)
        return self.engine

    def reused(self, model_path: str, settings: Settings) -> Engine:
        """An engine factory for many runs (a server's batches): the kept
        engine (made by the first call) behind a no-op ``close()``. Later
        calls ignore their ``settings``: the engine keeps the first run's."""
        return _Unclosed(self.get(model_path, settings))

    def for_runs(self) -> EngineFactory:
        """An engine factory for many runs (a server's batches) that returns
        :meth:`reused`'s engine and says it outlives each run
        (``outlives_run``: a run neither sizes it to its job nor captures
        the output of its processes)."""
        return _ReusedFactory(self)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class _ReusedFactory:
    """:meth:`KeptEngine.reused` as an engine factory of an engine that outlives the runs."""

    outlives_run = True

    def __init__(self, kept: KeptEngine):
        self._kept = kept

    def __call__(self, model_path: str, settings: Settings) -> Engine:
        return self._kept.reused(model_path, settings)


class _Unclosed:
    """``engine`` with ``close()`` left to its :class:`KeptEngine`."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        """Everything but ``close()`` is the kept engine's, read when asked
        (its ``settings`` at report time: replicas' counts grow during the run)."""
        return getattr(self._engine, name)

    def close(self) -> None:
        """The run is over: the requests it left (a stopped run's) are aborted,
        so the next run on the kept engine starts clean; the engine stays open.
        A dead engine's requests are gone with it: its error is the run's."""
        try:
            self._engine.abort_unfinished()
        except EngineError:
            pass
