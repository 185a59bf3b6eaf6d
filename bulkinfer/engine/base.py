"""The Engine protocol: what the feed loop needs from an engine. vLLM's
(:class:`bulkinfer.engine.vllm.VllmEngine`) is the real one; several replicas
or a remote actor can satisfy it without touching the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from bulkinfer.config import Settings
from bulkinfer.schema import Completion, Request


class Engine(Protocol):
    """What the runner needs from an engine; :class:`VllmEngine` is the real one.

    ``step(wait)`` returns the requests that finished; with ``wait`` (seconds)
    it returns ``[]`` once that time has passed even though the engine step is
    still running (its results come with a later call), so the caller can
    react to a stop signal. It raises :class:`EngineError` when the engine died.

    ``generated_tokens`` and ``prefilled_tokens`` count, since the engine
    started, the completion tokens generated and the prompt tokens processed
    for every request, finished or not; ``running_lengths()`` gives the
    completion tokens so far of each unfinished request that has some (live
    progress; an engine that cannot see unfinished requests counts them when
    they finish and returns ``[]``).
    """

    max_model_len: int
    max_num_seqs: int
    settings: dict[str, Any]

    @property
    def generated_tokens(self) -> int: ...
    @property
    def prefilled_tokens(self) -> int: ...
    def running_lengths(self) -> list[int]: ...

    def add(self, request_id: str, request: Request) -> Completion | None: ...
    def step(self, wait: float | None = None) -> list[Completion]: ...
    def has_unfinished(self) -> bool: ...
    def close(self) -> None: ...


EngineFactory = Callable[[str, Settings], Engine]


class NoEngine:
    """Stands in for the engine of a run with no rows (an empty input): no
    model is loaded and nothing is ever added."""

    max_model_len = 0
    max_num_seqs = 1
    settings: dict[str, Any] = {}
    generated_tokens = prefilled_tokens = 0

    def running_lengths(self) -> list[int]:
        return []

    def add(self, request_id: str, request: Request) -> Completion | None:
        raise AssertionError("an empty input has no requests")

    def step(self, wait: float | None = None) -> list[Completion]:
        return []

    def has_unfinished(self) -> bool:
        return False

    def close(self) -> None:
        pass
