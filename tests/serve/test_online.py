"""Online requests beside batches (issue 35), on fake engines: the
orchestration (admission, priorities, streaming framing, engine deaths),
not inference. The answers' shapes are read with the ``openai`` SDK's own
types (``ChatCompletion``, ``ChatCompletionChunk``, ``Completion``); real
inference is in tests/e2e/test_serve_e2e.py."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import openai
import pytest
from fakes import FakeEngine, wait_for
from fastapi.testclient import TestClient
from serving import KEYS, NoRunner, Server, batch_lines, create, records, upload, wait_done

import bulkinfer.serve.worker
from bulkinfer.config import load_settings
from bulkinfer.engine.mux import BATCH_PRIORITY_FLOOR, BESIDE_KEY, ONLINE_PRIORITY, EngineMux
from bulkinfer.errors import EngineError
from bulkinfer.schema import Completion, Request
from bulkinfer.serve.api import Limits, create_app
from bulkinfer.serve.store import Store

CHAT = [{"role": "user", "content": "hello"}]


class RecordingEngine(FakeEngine):
    """Notes each request's id and vLLM priority as it is added."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.added: list[tuple[str, int]] = []

    def add(self, request_id: str, request: Request) -> Completion | None:
        self.added.append((request_id, request.priority))
        return super().add(request_id, request)


def test_a_chat_completion_and_a_text_completion(serve: Callable[..., Server]) -> None:
    client = serve().client()
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)  # type: ignore[arg-type]
    assert isinstance(chat, openai.types.chat.ChatCompletion)
    assert chat.object == "chat.completion" and chat.model == "tiny"
    assert chat.choices[0].message.content == f"echo {chat.id}" and chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None and chat.usage.completion_tokens == 1 and chat.usage.prompt_tokens > 0
    text = client.completions.create(model="tiny", prompt="once upon", max_tokens=4)
    assert isinstance(text, openai.types.Completion) and text.object == "text_completion"
    assert text.id.startswith("cmpl-") and text.choices[0].text == f"echo {text.id}"


def test_a_streamed_chat_completion_read_with_the_sdk(serve: Callable[..., Server]) -> None:
    client = serve().client()
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(isinstance(c, openai.types.chat.ChatCompletionChunk) for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == f"echo {chunks[0].id}"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 1
    streamed = client.completions.create(model="tiny", prompt="once upon", max_tokens=4, stream=True)
    pieces = list(streamed)
    assert all(isinstance(c, openai.types.Completion) for c in pieces)
    assert "".join(c.choices[0].text for c in pieces) == f"echo {pieces[0].id}"


def test_a_completion_of_several_prompts_answers_each_in_turn_whole_or_streamed(serve: Callable[..., Server]) -> None:
    """OpenAI's list of prompts: one engine request a prompt, one answer with each one's choices in turn."""

    class Poisoned(RecordingEngine):  # a prompt holding token 999 is rejected when added
        def add(self, request_id: str, request: Request) -> Completion | None:
            if 999 in (request.prompt_token_ids or ()):
                return Completion(request_id, "", "error", 1, 0, "ValueError: rejected")
            return super().add(request_id, request)

    engine = Poisoned()
    client = serve(engine=lambda: engine).client()
    text = client.completions.create(model="tiny", prompt=[[5, 6, 7], "once upon"], max_tokens=4)
    assert [(c.index, c.text) for c in text.choices] == [(0, f"echo {text.id}"), (1, f"echo {text.id}")]
    assert text.usage is not None and text.usage.completion_tokens == 2 and text.usage.prompt_tokens > 3
    assert sorted(rid.rpartition(".")[2] for rid, _ in engine.added if text.id in rid) == ["0", "1"]
    pieces = list(client.completions.create(model="tiny", prompt=["a", "b", "c"], max_tokens=4, stream=True))
    assert sorted(c.choices[0].index for c in pieces if c.choices) == [0, 1, 2]
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\]: ValueError: rejected"):
        client.completions.create(model="tiny", prompt=[[5], [999]], max_tokens=4)


def test_a_field_the_batch_lines_refuse_is_a_400_naming_it(serve: Callable[..., Server]) -> None:
    client = serve().client()
    with pytest.raises(openai.BadRequestError, match="'temperature'") as bad:
        client.chat.completions.create(model="tiny", messages=CHAT, temperature="hot")  # type: ignore[arg-type]
    assert "body." not in str(bad.value) and bad.value.param == "temperature"
    for wrong, param in (
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "usr", "content": "x"}]}, "messages[0].role"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream, as vLLM's server
    ):
        with pytest.raises(openai.BadRequestError) as named:
            client.chat.completions.create(**{"model": "tiny", "messages": CHAT, **wrong})  # type: ignore[call-overload]
        assert named.value.param == param, named.value.message
    with pytest.raises(openai.BadRequestError, match="'tools' is not supported"):
        client.chat.completions.create(model="tiny", messages=CHAT, tools=[])  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="word " * 3000, max_tokens=4)


def test_past_max_online_a_request_gets_429_with_retry_after(serve: Callable[..., Server]) -> None:
    gate = threading.Event()

    class Held(FakeEngine):
        def step(self, wait: float | None = None) -> list[Completion]:
            gate.wait(30)
            return super().step(wait)

    server = serve(engine=Held, limits=Limits(max_online=1))
    client = server.client()
    first: list[Any] = []
    held = threading.Thread(
        target=lambda: first.append(client.chat.completions.create(model="tiny", messages=CHAT))  # type: ignore[arg-type]
    )
    held.start()
    wait_for(lambda: "bulkinfer_online_requests_in_flight 1.0" in server.http.get("/metrics").text)
    busy = server.http.post("/v1/chat/completions", json={"messages": CHAT}, headers={"Authorization": "Bearer key-a"})
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == "too_many_requests"
    gate.set()
    held.join(30)
    assert first and first[0].choices[0].finish_reason == "stop"
    metrics = server.http.get("/metrics").text
    assert 'bulkinfer_online_requests_total{endpoint="/v1/chat/completions",status="429"} 1.0' in metrics
    assert 'bulkinfer_online_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in metrics
    assert 'vllm:time_to_first_token_seconds_count{model_name="tiny"} 1.0' in metrics
    assert 'vllm:e2e_request_latency_seconds_count{model_name="tiny"} 1.0' in metrics


def test_no_engine_ready_is_a_503_with_retry_after(tmp_path: Any) -> None:
    runner = NoRunner()
    runner.health = "starting"
    http = TestClient(create_app(Store(tmp_path), KEYS, runner, model="tiny"))
    answer = http.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer key-a"})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    assert "starting" in answer.json()["error"]["message"]


def test_online_requests_go_ahead_of_batch_rows_and_the_batch_completes(serve: Callable[..., Server]) -> None:
    server = serve(engine=lambda: RecordingEngine(step_delay=0.05))
    client = server.client()
    ids = [f"r{i}" for i in range(40)]
    batch = create(client, upload(client, batch_lines(ids)).id)
    wait_for(lambda: len(server.engines[0].added) > 4)
    answer = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)  # type: ignore[arg-type]
    done = wait_done(client, batch.id)
    assert done.status == "completed"
    assert Counter(r["custom_id"] for r in records(client, done.output_file_id)) == Counter(ids)
    priorities = dict(server.engines[0].added)
    assert priorities[answer.id] == ONLINE_PRIORITY
    assert {p for rid, p in priorities.items() if rid != answer.id} == {0}  # the rows' own (none set)
    assert done.usage is not None and done.usage.output_tokens == len(ids)  # the rows', not the online request's


class Heard:
    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.completion: Completion | None = None
        self.error: EngineError | None = None
        self.over = threading.Event()

    def piece(self, index: int, text: str, tokens: int, finish_reason: str | None) -> None:
        self.pieces.append(text)

    def done(self, completion: Completion) -> None:
        self.completion = completion
        self.over.set()

    def failed(self, error: EngineError) -> None:
        self.error = error
        self.over.set()


def request(seq: int, priority: int = 0) -> Request:
    return Request(
        seq, seq + 1, f"r{seq}", None, None, 4, 0.0, 1.0, None, (), priority=priority, prompt_token_ids=[1, 2]
    )


def test_the_mux_keeps_batch_rows_below_online_requests_and_aborts_only_the_batch() -> None:
    engine = RecordingEngine(hang_at=1)  # nothing finishes: both stay in flight
    mux = EngineMux(engine)
    try:
        mux.add("b0", request(0, priority=ONLINE_PRIORITY - 5))  # a row's own priority cannot jump the online band
        heard = Heard()
        mux.submit("o0", request(1), heard)
        wait_for(lambda: len(engine.added) == 2)
        assert dict(engine.added) == {"b0": BATCH_PRIORITY_FLOOR, "o0": ONLINE_PRIORITY}
        assert mux.has_unfinished()
        mux.abort_unfinished()
        assert not mux.has_unfinished() and engine.aborted == ["b0"]
        assert [rid for rid, _ in engine.queue] == ["o0"]
    finally:
        mux.close()
    assert heard.over.wait(5) and heard.error is not None  # closed under it: told, never left hanging


def test_the_mux_keeps_seats_for_online_requests_and_drops_held_rows_at_an_abort() -> None:
    """max_num_seqs 4, two seats kept for online requests: two batch rows run,
    the next two wait in the mux (vLLM would give a waiting online request no
    seat while four run); an abort drops the held rows without the engine."""
    engine = RecordingEngine(hang_at=1)
    mux = EngineMux(engine, online_seats=2)
    try:
        for k in range(4):
            mux.add(f"b{k}", request(k))
        wait_for(lambda: len(engine.added) == 2)
        mux.submit("o0", request(9), Heard())
        wait_for(lambda: len(engine.added) == 3)
        assert [rid for rid, _ in engine.added] == ["b0", "b1", "o0"]
        mux.abort_unfinished()
        assert not mux.has_unfinished() and engine.aborted == ["b0", "b1"]
        mux.add("b4", request(4))  # the next run's rows take the freed seats
        wait_for(lambda: len(engine.added) == 4)
        assert engine.added[-1][0] == "b4"
    finally:
        mux.close()


def test_beside_an_online_request_the_batch_takes_on_only_its_bound_then_refills() -> None:
    engine = RecordingEngine(hang_at=1)
    mux = EngineMux(engine, batch_beside_online=1)
    try:
        mux.submit("o0", request(9), Heard())
        for k in range(3):
            mux.add(f"b{k}", request(k))
        wait_for(lambda: len(engine.added) == 2)
        time.sleep(0.3)  # a few turns of the mux's loop: nothing more enters
        assert [rid for rid, _ in engine.added] == ["o0", "b0"]
        mux.cancel("o0")  # no online request in flight: the batch fills the seats, in order
        wait_for(lambda: len(engine.added) == 4)
        assert [rid for rid, _ in engine.added] == ["o0", "b0", "b1", "b2"]
    finally:
        mux.close()


def test_an_engine_death_fails_online_requests_and_raises_in_the_batch() -> None:
    deaths: list[bool] = []
    mux = EngineMux(FakeEngine(crash_at=1, step_delay=0.05), on_death=lambda: deaths.append(True))
    heard = Heard()
    mux.submit("o0", request(0), heard)
    assert heard.over.wait(5) and isinstance(heard.error, EngineError) and deaths == [True]
    with pytest.raises(EngineError, match="boom"):
        mux.step(wait=1.0)
    with pytest.raises(EngineError):
        mux.submit("o1", request(1), Heard())
    mux.close()


def test_beside_an_online_request_batch_rows_enter_as_the_prefill_backlog_drains() -> None:
    """``prefill_beside_online`` 3 tokens, two-token prompts: beside an online
    request a batch row enters while its predecessors' prompts not yet
    prefilled hold fewer than 3 tokens: two, then two more once the engine
    has prefilled the first two."""
    engine = RecordingEngine(hang_at=1)
    mux = EngineMux(engine, prefill_beside_online=3)
    try:
        mux.submit("o0", request(9), Heard())
        for k in range(5):
            mux.add(f"b{k}", request(k))
        wait_for(lambda: len(engine.added) == 3)
        time.sleep(0.3)
        assert [rid for rid, _ in engine.added] == ["o0", "b0", "b1"]
        engine.prefilled_tokens = 4  # b0's and b1's first outputs
        wait_for(lambda: len(engine.added) == 5)
        time.sleep(0.3)
        assert [rid for rid, _ in engine.added] == ["o0", "b0", "b1", "b2", "b3"]
    finally:
        mux.close()


def test_a_batch_row_of_n_choices_holds_its_prompt_once_a_choice_in_the_prefill_backlog() -> None:
    """A row of 2 choices over a 2-token prompt prefills 4 tokens (each
    choice's sequence: ``Engine.prefilled_tokens``): beside an online
    request with ``prefill_beside_online`` 3, the first row enters alone
    (one-choice rows: two, the test above), the next once it is prefilled."""
    engine = RecordingEngine(hang_at=1)
    mux = EngineMux(engine, prefill_beside_online=3)
    try:
        mux.submit("o0", request(9), Heard())
        for k in range(3):
            row = request(k)
            row.options["n"] = 2
            mux.add(f"b{k}", row)
        wait_for(lambda: len(engine.added) == 2)
        time.sleep(0.3)
        assert [rid for rid, _ in engine.added] == ["o0", "b0"]
        engine.prefilled_tokens = 4  # b0's two choices' first outputs
        wait_for(lambda: len(engine.added) == 3)
        time.sleep(0.3)
        assert [rid for rid, _ in engine.added] == ["o0", "b0", "b1"]
    finally:
        mux.close()


class WatchedEngine(RecordingEngine):
    """Keeps the watcher of each streamed (online) request, as VllmEngine.watch does."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.watchers: dict[str, Callable[[int, str, int, str | None], None]] = {}

    def watch(self, request_id: str, watcher: Callable[[int, str, int, str | None], None]) -> None:
        self.watchers[request_id] = watcher


def test_the_batch_counts_leave_out_an_online_request_prefilled_once_a_choice() -> None:
    """An online request of 2 choices over a 2-token prompt prefills 4 of
    the engine's prompt tokens, counted at each choice's first piece: the
    batch's count (the progress line's and ETA's) is the engine's less those."""
    engine = WatchedEngine(hang_at=1)
    mux = EngineMux(engine)
    try:
        online = request(9)
        online.options["n"] = 2
        mux.submit("o0", online, Heard())
        mux.add("b0", request(0))
        wait_for(lambda: len(engine.added) == 2)
        piece = engine.watchers["o0"]
        for index in (0, 1, 0):  # choice 0's second piece: its prompt was counted
            piece(index, "a", 1, None)
        engine.prefilled_tokens, engine.generated_tokens = 6, 4  # o0's two choices and b0 prefilled
        assert (mux.prefilled_tokens, mux.generated_tokens) == (2, 1)
    finally:
        mux.close()


class DyingEngine(FakeEngine):
    """Its first step waits for ``release``, then raises: the engine died during that step."""

    def __init__(self) -> None:
        super().__init__()
        self.stepping, self.release = threading.Event(), threading.Event()

    def step(self, wait: float | None = None) -> list[Completion]:
        self.stepping.set()
        self.release.wait(10)
        raise EngineError("the vLLM engine died: its processes are gone")


def test_an_online_request_sent_during_the_fatal_step_hears_the_death() -> None:
    """Submitted while the step that finds the engine dead runs (the mux has
    not yet seen the death): told ``failed``, never left waiting; one after
    it is refused at once."""
    engine = DyingEngine()
    mux = EngineMux(engine)
    mux.add("b0", request(0))
    assert engine.stepping.wait(5)
    heard = Heard()
    mux.submit("o0", request(1), heard)  # queued for a thread about to stop
    engine.release.set()
    assert heard.over.wait(5) and isinstance(heard.error, EngineError)
    with pytest.raises(EngineError):
        mux.submit("o1", request(2), Heard())
    mux.close()


def test_an_engine_that_dies_serving_online_requests_comes_back(
    serve: Callable[..., Server], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulkinfer.serve.worker, "ENGINE_RESTART_DELAYS_S", (0.3, 0.3))
    made = [0]

    def engine() -> FakeEngine:
        made[0] += 1
        return FakeEngine(crash_at=1 if made[0] == 1 else None)

    server = serve(engine=engine)
    lost = server.http.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer key-a"})
    assert lost.status_code == 503 and lost.headers["retry-after"] == "5"
    wait_for(lambda: server.http.get("/health").status_code == 200 and len(server.engines) == 2)
    again = server.client().completions.create(model="tiny", prompt="hi", max_tokens=4)
    assert again.choices[0].finish_reason == "stop"
    assert server.engines[0].closed and not server.engines[1].closed


def test_a_batch_request_finished_before_an_abort_never_comes_back_under_a_reused_id() -> None:
    engine = FakeEngine()
    mux = EngineMux(engine)
    try:
        mux.add("0", request(0))
        wait_for(lambda: engine.steps >= 1 and not engine.queue)  # finished, not yet returned by step()
        mux.abort_unfinished()
        engine.hang_at = engine.steps + 1  # from now on nothing finishes
        mux.add("0", request(1))  # the next run's first request: the same engine id
        assert mux.step(wait=0.5) == []
    finally:
        mux.close()


def test_the_endpoint_is_the_path_never_a_query_parameter(serve: Callable[..., Server]) -> None:
    server = serve()
    answer = server.http.post(
        "/v1/chat/completions?url=/v1/completions",
        json={"messages": CHAT, "max_tokens": 4},
        headers={"Authorization": "Bearer key-a"},
    )
    assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"


@pytest.mark.parametrize(
    ("beside", "model", "extra", "scheduler"),
    [
        (2, None, {}, "bulkinfer.engine.online_first.OnlineFirstScheduler"),
        (None, None, {}, None),  # no bound: vLLM's own scheduler
        (2, "all-minilm-l6-v2", {}, None),  # an encoder: no decode steps to share
        (2, None, {"scheduler_cls": "my.Scheduler"}, "my.Scheduler"),  # the user's choice stands
    ],
)
def test_the_engine_pauses_batch_rows_only_under_a_bound(
    tmp_path: Any, beside: int | None, model: str | None, extra: dict[str, Any], scheduler: str | None
) -> None:
    settings = load_settings(overrides={"model": model, "engine.extra_args": {**extra, "additional_config": {"k": 1}}})
    worker = bulkinfer.serve.worker.BatchWorker(
        Store(tmp_path), settings, lambda m, s: FakeEngine(), beside_online=(beside, None)
    )
    args = worker._online_first(worker.settings).engine.extra_args
    assert args.get("scheduler_cls") == scheduler
    expected = {"k": 1, BESIDE_KEY: 2} if scheduler and not extra else {"k": 1}
    assert args["additional_config"] == expected  # the user's own keys kept
