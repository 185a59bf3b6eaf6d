"""A fake engine for testing the orchestration of failures (rejected requests,
crashes, signals, kills at chosen moments). It never stands in as proof that
inference works: tests/e2e/test_e2e.py runs the real vLLM engine for that."""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from typing import Any

from bulkinfer.errors import EngineError
from bulkinfer.schema import Completion, Request
from bulkinfer.stop import StopToken

NLL_PER_TOKEN = 0.5


def without_native_bfloat16() -> None:
    """Make this process see a CPU without native bfloat16 (flags ``avx2``
    only), as the fast suite does in every test (tests/conftest.py): a run on
    a fake engine then keeps float32 without starting the dtype probe, whose
    engines are real vLLM ones, on every CPU kind. For the driver scripts a
    test runs as its own process."""
    import bulkinfer.jobs.tune

    bulkinfer.jobs.tune.cpu_flags = lambda: {"avx2"}  # type: ignore[assignment]


class FakeEngine:
    max_model_len = 2048
    max_num_seqs = 4
    settings: dict[str, Any] = {"fake": True}

    def __init__(
        self,
        reject: set[str] = frozenset(),
        crash_at: int | None = None,
        signal_at: int | None = None,
        step_delay: float = 0.0,
        hang_at: int | None = None,
        stop_at: tuple[int, StopToken] | None = None,
    ):
        self.step_delay = step_delay
        self.hang_at = hang_at  # from this step on, no step ever finishes (a stuck engine)
        self.queue: deque[tuple[str, Request]] = deque()
        self.reached: dict[str, list[int]] = {}  # row id -> the prompt token ids it reached the engine with
        self.reject, self.crash_at, self.signal_at = reject, crash_at, signal_at
        self.stop_at = stop_at  # (step, token): the token is set after that step, as a caller in another thread would
        self.steps = 0
        self.max_queued = 0
        self.closed = False
        self.generated_tokens = self.prefilled_tokens = self.cached_tokens = self.running_prompt_tokens = 0
        self.ended_sequences = 0

    def add(self, request_id: str, request: Request) -> Completion | None:
        assert request.prompt_token_ids
        self.reached[request.id] = list(request.prompt_token_ids)
        if request.id in self.reject:
            return Completion(request_id, "", "error", len(request.prompt_token_ids), 0, "ValueError: rejected")
        self.queue.append((request_id, request))
        self.max_queued = max(self.max_queued, len(self.queue))
        return None

    def step(self, wait: float | None = None) -> list[Completion]:
        if self.hang_at is not None and self.steps + 1 >= self.hang_at:
            time.sleep(wait if wait is not None else 3600)  # still running: nothing finished
            return []
        self.steps += 1
        time.sleep(self.step_delay)
        if self.steps == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.stop_at is not None and self.steps == self.stop_at[0]:
            self.stop_at[1].stop("stopped by the caller")
        if self.steps == self.crash_at:
            raise EngineError("the vLLM engine failed: RuntimeError: boom")
        done = []
        for _ in range(min(2, len(self.queue))):
            rid, req = self.queue.popleft()
            n = len(req.prompt_token_ids or ())
            if req.score_from is not None:  # a scoring request: NLL_PER_TOKEN nats per scored token
                scored = n - req.score_from
                done.append(Completion(rid, "", "length", n, 0, nll=NLL_PER_TOKEN * scored, scored_tokens=scored))
            else:
                done.append(Completion(rid, f"echo {req.id}", "stop", n, 1))
        self.generated_tokens += sum(c.completion_tokens for c in done)
        self.prefilled_tokens += sum(c.prompt_tokens for c in done)
        return done

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def abort_unfinished(self) -> None:
        self.aborted = [rid for rid, _ in self.queue]
        self.queue.clear()

    def abort(self, request_ids: list[str]) -> None:
        dropped = set(request_ids)
        self.aborted = [rid for rid, _ in self.queue if rid in dropped]
        self.queue = deque((rid, req) for rid, req in self.queue if rid not in dropped)

    def running_lengths(self) -> list[int]:
        return []

    def close(self) -> None:
        self.closed = True


def wait_for(predicate, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` every 50 ms; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class FakeEncoder(FakeEngine):
    """Returns, for each input, the vector [tokens, index, 1.0] (:meth:`vector`)."""

    max_model_len = 256

    def add(self, request_id: str, request: Request) -> Completion | None:
        assert request.input_token_ids and request.pooling.get("use_activation") is True
        self.queue.append((request_id, request))
        return None

    def step(self, wait: float | None = None) -> list[Completion]:
        self.steps += 1
        if self.stop_at is not None and self.steps == self.stop_at[0]:
            self.stop_at[1].stop("stopped by the caller")
        done = []
        for _ in range(min(2, len(self.queue))):
            rid, req = self.queue.popleft()
            ids = req.input_token_ids or []
            vectors = tuple(self.vector(k, one) for k, one in enumerate(ids))
            done.append(Completion(rid, "", "stop", req.prompt_length, 0, embeddings=vectors))
        return done

    def vector(self, index: int, ids: list[int]) -> list[float]:
        return [float(len(ids)), float(index), 1.0]


class FakeBagEncoder(FakeEncoder):
    """Returns, for each input, its token ids counted into 64 bins (id % 64),
    not normalized: the same text, the same vector; texts sharing tokens, a
    higher cosine."""

    def vector(self, index: int, ids: list[int]) -> list[float]:
        bins = [0.0] * 64
        for token in ids:
            bins[token % 64] += 1.0
        return bins


def assert_defaults_refused(src: Any, settings: Any, said: str, tmp_path: Any) -> None:
    """``run`` of ``src`` (a JSONL file), a stream of it (``run -``) and
    ``plan`` each raise ConfigError (exit 2) whose message holds ``said``,
    before an engine is built, leaving no output file."""
    import io
    import re

    import pytest

    from bulkinfer.errors import ConfigError
    from bulkinfer.io.output_files import RunPaths
    from bulkinfer.jobs.context import RunContext
    from bulkinfer.jobs.plan import plan_file
    from bulkinfer.jobs.run import run
    from bulkinfer.jobs.stream import StreamPaths, stream

    started: list[str] = []
    context = RunContext(engine_factory=lambda *a: started.append("!"))
    with pytest.raises(ConfigError, match=re.escape(said)):
        run(RunPaths.build(src, tmp_path / "out.jsonl"), settings, context)
    with pytest.raises(ConfigError, match=re.escape(said)):  # a stream likewise, before a row is read
        stream(io.BytesIO(src.read_bytes()), StreamPaths.build(tmp_path / "stream.jsonl"), settings, context)
    with pytest.raises(ConfigError, match=re.escape(said)):
        plan_file(src, settings)
    assert started == [] and not (tmp_path / "out.jsonl").exists() and not (tmp_path / "stream.jsonl").exists()
