"""Orchestration of failures in the run loop, with a fake engine.

The fake engine stands in only to provoke failures at chosen moments (a
rejected request, an engine crash, a signal mid-run); that inference works is
proven by tests/e2e/test_e2e.py with the real engine.
"""

from __future__ import annotations

import html
import os
import signal
import threading
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pyarrow.parquet as pq
import pytest
from fakes import FakeEngine
from typer.testing import CliRunner

from bulkinfer.cli import StopSignals, app
from bulkinfer.config import Settings, load_settings
from bulkinfer.errors import (
    EXIT_OK,
    EXIT_PARTIAL,
    ConfigError,
    EngineError,
    Interrupted,
    LockHeldError,
    OutputExistsError,
)
from bulkinfer.io.journal import input_identity, results_record, results_settings
from bulkinfer.io.output_files import OutputFiles, RunPaths
from bulkinfer.io.spool import spool_records
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.schema import Completion
from bulkinfer.stop import StopToken

SCHEMA = Path(__file__).parents[2] / "bulkinfer" / "report" / "report.schema.json"


def make_input(tmp_path: Path, n: int = 20) -> Path:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "prompt": "word " * (i + 1)}) + b"\n" for i in range(n)))
    return src


def settings(**plan: Any) -> Settings:
    return load_settings(None, {f"plan.{k}": v for k, v in plan.items()})


def test_all_rows_complete_and_in_flight_is_bounded(tmp_path: Path) -> None:
    engine = FakeEngine()
    paths = RunPaths.build(make_input(tmp_path), tmp_path / "out.jsonl")
    result = run(paths, settings(max_in_flight=3, window_rows=7), RunContext(engine_factory=lambda m, s: engine))
    assert result.exit_code == EXIT_OK
    ids = [orjson.loads(line)["id"] for line in paths.output.read_bytes().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(20))
    assert engine.max_queued <= 3
    assert engine.closed
    assert result.report["request_counts"] == {"total": 20, "completed": 20, "failed": 0, "skipped": 0}


def test_the_tokenizer_and_engine_come_from_the_injected_factories(tmp_path: Path) -> None:
    from bulkinfer.models import load_tokenizer

    calls: list[tuple[str, object]] = []

    def tokenizer_factory(model_path: str, trust_remote_code: bool) -> object:
        calls.append((model_path, trust_remote_code))
        tokenizer = load_tokenizer(model_path)
        tokenizer.chat_template = None  # a base model's tokenizer: prompts go raw
        return tokenizer

    def engine_factory(model_path: str, s: Settings) -> FakeEngine:
        calls.append((model_path, s.model))
        return FakeEngine()

    paths = RunPaths.build(make_input(tmp_path, 3), tmp_path / "out.jsonl")
    result = run(paths, settings(), RunContext(engine_factory=engine_factory, tokenizer_factory=tokenizer_factory))
    model_path = result.report["model_path"]
    assert calls == [(model_path, False), (model_path, None)]
    assert result.report["chat_template_applied"] is False  # "auto" decided by the injected tokenizer
    assert result.report["request_counts"]["completed"] == 3


def test_longest_prompts_are_fed_first_within_a_window(tmp_path: Path) -> None:
    engine = FakeEngine()
    paths = RunPaths.build(make_input(tmp_path, 6), tmp_path / "out.jsonl")
    run(paths, settings(max_in_flight=100, output_order="completion"), RunContext(engine_factory=lambda m, s: engine))
    ids = [orjson.loads(line)["id"] for line in paths.output.read_bytes().splitlines()]
    assert ids == ["r5", "r4", "r3", "r2", "r1", "r0"]


def test_rejected_request_is_that_rows_error(tmp_path: Path) -> None:
    engine = FakeEngine(reject={"r3"})
    paths = RunPaths.build(make_input(tmp_path), tmp_path / "out.jsonl")
    result = run(paths, settings(), RunContext(engine_factory=lambda m, s: engine))
    assert result.exit_code == EXIT_PARTIAL
    errors = [orjson.loads(line) for line in paths.errors.read_bytes().splitlines()]
    assert errors == [{"id": "r3", "line": 4, "error": {"type": "engine_error", "message": "ValueError: rejected"}}]
    assert result.report["request_counts"] == {"total": 20, "completed": 19, "failed": 1, "skipped": 0}


def test_engine_crash_ends_the_run_and_keeps_no_final_output(tmp_path: Path) -> None:
    engine = FakeEngine(crash_at=3)
    paths = RunPaths.build(make_input(tmp_path), tmp_path / "out.jsonl")
    with pytest.raises(EngineError, match="boom"):
        run(paths, settings(max_in_flight=2), RunContext(engine_factory=lambda m, s: engine))
    assert not paths.output.exists()
    assert engine.closed


def run_with_signals(paths: RunPaths, s: Settings, **options: Any) -> Any:
    """``run`` under the CLI's signal handling (signals -> the stop token)."""
    with StopSignals() as stop:
        return run(paths, s, RunContext(stop=stop, **options))


def test_sigterm_stops_feeding_flushes_and_exits_143(tmp_path: Path) -> None:
    engine = FakeEngine(signal_at=3)
    paths = RunPaths.build(make_input(tmp_path), tmp_path / "out.jsonl")
    handler_before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as info:
        run_with_signals(paths, settings(max_in_flight=2), engine_factory=lambda m, s: engine)
    assert info.value.exit_code == 143
    assert not paths.output.exists()
    spool = tmp_path / ".out.jsonl.partial.jsonl"
    kept = [record["id"] for _, record in spool_records(spool)]
    assert len(kept) == 6  # three steps of two finished rows; nothing fed after the signal
    assert engine.steps == 3
    assert signal.getsignal(signal.SIGTERM) == handler_before  # handlers restored


def test_a_signal_the_process_ignores_stays_ignored() -> None:
    """``nohup bulkinfer run ...`` starts it ignoring SIGHUP: a closed ssh
    session must not stop the run (its handler used to replace SIG_IGN)."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)  # still handled
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


class SignalBeforeAnyRowEnds(FakeEngine):
    """SIGTERM in its first step, which finishes no row."""

    def step(self, wait: float | None = None) -> list[Completion]:
        self.steps += 1
        os.kill(os.getpid(), signal.SIGTERM)
        return []


def test_sigterm_before_any_row_ended_says_nothing_was_kept(tmp_path: Path) -> None:
    paths = RunPaths.build(make_input(tmp_path), tmp_path / "out.jsonl")
    with pytest.raises(Interrupted) as info:
        run_with_signals(paths, settings(max_in_flight=2), engine_factory=lambda m, s: SignalBeforeAnyRowEnds())
    assert info.value.exit_code == 143
    assert str(info.value) == "stopped by SIGTERM: no row had finished, so nothing is kept; run it again"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "in.jsonl", "out.log"]  # no partial output


def test_a_stop_token_stops_a_run_in_another_thread_without_signal_handlers(tmp_path: Path) -> None:
    stop = StopToken()
    engine = FakeEngine(stop_at=(3, stop))
    paths = RunPaths.build(make_input(tmp_path), tmp_path / "out.jsonl")
    handlers = {sig: signal.getsignal(sig) for sig in StopSignals.SIGNALS}
    caught: list[BaseException] = []

    def target() -> None:
        try:
            run(paths, settings(max_in_flight=2), RunContext(engine_factory=lambda m, s: engine, stop=stop))
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    [exc] = caught
    assert isinstance(exc, Interrupted)
    assert exc.exit_code == 130 and "stopped by the caller: 6 finished rows" in str(exc)
    assert engine.steps == 3 and engine.closed
    spool = tmp_path / ".out.jsonl.partial.jsonl"
    assert len(spool.read_bytes().splitlines()) == 6
    assert {sig: signal.getsignal(sig) for sig in StopSignals.SIGNALS} == handlers  # the core installed none


def interrupted_run(tmp_path: Path, n: int = 20, signal_at: int = 3) -> RunPaths:
    paths = RunPaths.build(make_input(tmp_path, n), tmp_path / "out.jsonl")
    with pytest.raises(Interrupted):
        run_with_signals(paths, settings(max_in_flight=2), engine_factory=lambda m, s: FakeEngine(signal_at=signal_at))
    return paths


def output_ids(paths: RunPaths) -> list[str]:
    return [orjson.loads(line)["id"] for line in paths.output.read_bytes().splitlines()]


def test_resume_after_sigterm_gives_every_row_once(tmp_path: Path) -> None:
    paths = interrupted_run(tmp_path)
    engine = FakeEngine()
    result = run(paths, settings(max_in_flight=2), RunContext(resume=True, engine_factory=lambda m, s: engine))
    assert result.exit_code == EXIT_OK
    ids = output_ids(paths)
    assert sorted(ids) == sorted(f"r{i}" for i in range(20))
    assert len(engine.queue) == 0 and engine.steps == 7  # only the 14 rows not done before ran
    assert result.report["resumed"] == {"completed": 6, "failed": 0}
    assert result.report["request_counts"]["completed"] == 20
    assert sorted(p.name for p in tmp_path.glob(".out*")) == [".out.lock"]  # no spool, journal left


def test_resume_cuts_a_torn_last_line(tmp_path: Path) -> None:
    paths = interrupted_run(tmp_path)
    spool = tmp_path / ".out.jsonl.partial.jsonl"
    with open(spool, "ab") as f:
        f.write(b'{"id": "r19", "completion": "tor')  # kill -9 in the middle of a write
    run(paths, settings(), RunContext(resume=True, engine_factory=lambda m, s: FakeEngine()))
    ids = output_ids(paths)
    assert sorted(ids) == sorted(f"r{i}" for i in range(20))


@pytest.mark.parametrize("out", ["out.jsonl", "in.parquet"])  # in.parquet: the input's stem
def test_resume_after_crash_between_the_final_renames(tmp_path: Path, out: str) -> None:
    src = make_input(tmp_path, 10)
    with open(src, "ab") as f:
        f.write(b"not json\n")
    paths = RunPaths.build(src, tmp_path / out)
    with pytest.raises(Interrupted):
        run_with_signals(paths, settings(max_in_flight=2), engine_factory=lambda m, s: FakeEngine(signal_at=2))
    # the errors file was published, then the process died before the output's rename
    os.replace(tmp_path / f".{paths.errors.name}.partial.jsonl", paths.errors)
    result = run(paths, settings(), RunContext(resume=True, engine_factory=lambda m, s: FakeEngine()))
    assert result.exit_code == EXIT_PARTIAL
    ids = pq.read_table(paths.output)["id"].to_pylist() if out.endswith(".parquet") else output_ids(paths)
    assert sorted(ids) == sorted(f"r{i}" for i in range(10))
    errors = [orjson.loads(line) for line in paths.errors.read_bytes().splitlines()]
    assert [e["line"] for e in errors] == [11]


def test_partial_output_without_flags_is_refused(tmp_path: Path) -> None:
    paths = interrupted_run(tmp_path)
    with pytest.raises(OutputExistsError, match="--resume"):
        run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))


def test_resume_with_changed_input_or_settings_is_refused(tmp_path: Path) -> None:
    paths = interrupted_run(tmp_path)
    with pytest.raises(ConfigError, match="settings differ") as info:
        run(
            paths,
            load_settings(None, {"sampling.max_tokens": 7}),
            RunContext(resume=True, engine_factory=lambda m, s: FakeEngine()),
        )
    old = settings().sampling.max_tokens
    assert f"--max-tokens (sampling.max_tokens): {old} -> 7" in str(info.value)  # which setting, old -> new
    size = paths.input.stat().st_size
    with open(paths.input, "ab") as f:
        f.write(b'{"id": "extra", "prompt": "x"}\n')
    with pytest.raises(ConfigError, match="changed since the interrupted run") as info:
        run(paths, settings(), RunContext(resume=True, engine_factory=lambda m, s: FakeEngine()))
    message = str(info.value)
    assert f"size {size} -> {paths.input.stat().st_size} bytes" in message
    assert "mtime_ns" not in message and "{" not in message  # plain words, no raw dicts


def test_resume_and_overwrite_together_are_refused(tmp_path: Path) -> None:
    paths = interrupted_run(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigError, match="--resume .* or --overwrite .*, not both") as info:
        run(paths, settings(), RunContext(resume=True, overwrite=True, engine_factory=lambda m, s: FakeEngine()))
    assert info.value.exit_code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing started over


def test_resume_on_complete_output_does_nothing(tmp_path: Path) -> None:
    paths = RunPaths.build(make_input(tmp_path), tmp_path / "out.jsonl")
    run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    before = paths.output.read_bytes()
    engine = FakeEngine()
    result = run(paths, settings(), RunContext(resume=True, engine_factory=lambda m, s: engine))
    assert result.exit_code == EXIT_OK and result.report["already_complete"]
    assert engine.steps == 0
    assert paths.output.read_bytes() == before


def test_resume_on_a_complete_output_of_another_input_or_settings_is_refused(tmp_path: Path) -> None:
    """The cron line ``run prompts.jsonl -o out.jsonl --resume`` over a new day's prompts.jsonl must not
    report yesterday's output as today's: the report records what the output is the result of."""
    paths = RunPaths.build(make_input(tmp_path), tmp_path / "out.jsonl")
    run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    saved = orjson.loads(paths.report.read_bytes())["results_of"]
    assert saved == results_record(input_identity(paths.input), results_settings(settings()))
    before = paths.output.read_bytes()
    resume = RunContext(resume=True, engine_factory=lambda m, s: FakeEngine())
    # how rows are fed does not shape results: still complete
    assert run(paths, settings(order="ascending"), resume).report["already_complete"]
    with pytest.raises(ConfigError) as info:
        run(paths, load_settings(None, {"sampling.max_tokens": 8}), resume)
    assert str(info.value).startswith(
        f"cannot resume {paths.output}: it is complete, but settings differ from those of the run that wrote it: "
        "--max-tokens (sampling.max_tokens): "
    )
    make_input(tmp_path, 21)  # the next day's input, at the same path
    with pytest.raises(ConfigError) as info:
        run(paths, settings(), RunContext(resume=True, engine_factory=lambda m, s: FakeEngine()))
    assert info.value.exit_code == 2
    assert f"it is complete, but the input {paths.input.resolve()} changed since the run that wrote it (size" in str(
        info.value
    )
    assert str(info.value).endswith("use the same input, or --overwrite to run it again")
    assert paths.output.read_bytes() == before  # nothing started over
    result = run(paths, settings(), RunContext(overwrite=True, engine_factory=lambda m, s: FakeEngine()))
    assert result.report["request_counts"]["total"] == 21


def test_overwrite_replaces_a_complete_output(tmp_path: Path) -> None:
    paths = RunPaths.build(make_input(tmp_path, 5), tmp_path / "out.jsonl")
    paths.output.write_text("old\n")
    with pytest.raises(OutputExistsError):
        run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    assert paths.output.read_text() == "old\n"
    run(paths, settings(), RunContext(overwrite=True, engine_factory=lambda m, s: FakeEngine()))
    assert sorted(output_ids(paths)) == [f"r{i}" for i in range(5)]


def test_a_held_lock_refuses_a_second_run(tmp_path: Path) -> None:
    paths = RunPaths.build(make_input(tmp_path, 5), tmp_path / "out.jsonl")
    with OutputFiles(paths.output).locked():
        with pytest.raises(LockHeldError, match="another bulkinfer run"):
            run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))  # free again


def test_eval_perplexity_reuses_the_generation_engine_and_closes_it(tmp_path: Path) -> None:
    """One engine start for generation + perplexity; closed once everything is scored."""
    import math

    from fakes import NLL_PER_TOKEN

    from bulkinfer.jobs.eval import EvalOptions, run_eval

    golden = tmp_path / "golden.jsonl"
    golden.write_bytes(
        b"".join(
            orjson.dumps({"id": f"g{i}", "prompt": f"say {i}", "reference": f"echo g{i} and more"}) + b"\n"
            for i in range(5)
        )
    )
    made: list[FakeEngine] = []

    def factory(model: str, s: Settings) -> FakeEngine:
        made.append(FakeEngine())
        return made[-1]

    result = run_eval(
        golden,
        tmp_path / "out.jsonl",
        load_settings(),
        RunContext(engine_factory=factory),
        EvalOptions(perplexity=True),
    )
    assert len(made) == 1 and made[0].closed
    assert result.report["scores"]["perplexity"] == pytest.approx(math.exp(NLL_PER_TOKEN))
    assert result.report["scores"]["perplexity_rows"] == 5
    # With --predictions there is no generation: the perplexity pass makes (and closes) its own engine.
    made.clear()
    run_eval(
        golden,
        tmp_path / "scored.jsonl",
        load_settings(),
        RunContext(engine_factory=factory),
        EvalOptions(predictions=tmp_path / "out.jsonl", perplexity=True),
    )
    assert len(made) == 1 and made[0].closed


def test_eval_closes_the_kept_engine_when_scoring_fails(tmp_path: Path) -> None:
    from bulkinfer.jobs.eval import EvalOptions, run_eval

    golden = tmp_path / "golden.jsonl"
    golden.write_bytes(orjson.dumps({"id": "g0", "prompt": "hi", "reference": "echo g0"}) + b"\n")
    made: list[FakeEngine] = []

    def factory(model: str, s: Settings) -> FakeEngine:
        made.append(FakeEngine(reject={"g0"}))  # the only row fails: nothing to score
        return made[-1]

    with pytest.raises(ConfigError, match="no prediction"):
        run_eval(
            golden,
            tmp_path / "out.jsonl",
            load_settings(),
            RunContext(engine_factory=factory),
            EvalOptions(perplexity=True),
        )
    assert len(made) == 1 and made[0].closed


def test_job_tokens_counts_the_input_and_every_completion(tmp_path: Path) -> None:
    import dataclasses
    import gzip

    from bulkinfer.config import RaySettings
    from bulkinfer.io.inputs import scan_input
    from bulkinfer.jobs.engine_choice import TEMPLATE_TOKENS, job_tokens

    src = make_input(tmp_path, 10)
    packed = tmp_path / "in.jsonl.gz"
    packed.write_bytes(gzip.compress(src.read_bytes()))
    scan = scan_input(packed)
    assert (scan.rows, scan.bytes) == (10, src.stat().st_size)  # the uncompressed bytes
    settings = load_settings(overrides={"sampling.max_tokens": 100, "sampling.n": 2})
    assert job_tokens(settings, scan) == src.stat().st_size // 2 + 10 * (2 * 100 + TEMPLATE_TOKENS)
    remote = dataclasses.replace(settings, ray=RaySettings(address="auto"))
    assert job_tokens(remote, scan) is None  # a cluster's machines: their own default


def test_the_kv_cache_is_sized_from_the_first_rows_tokenized(tmp_path: Path, tiny_home: Path) -> None:
    import math

    from transformers import AutoTokenizer

    from bulkinfer.io.inputs import scan_input
    from bulkinfer.io.readers import open_reader
    from bulkinfer.jobs.engine_choice import SAMPLE_MARGIN, job_tokens, sample_tokens
    from bulkinfer.prep.rows import to_request

    tokenizer = AutoTokenizer.from_pretrained(tiny_home / "models" / "smollm2-135m-instruct")
    src = make_input(tmp_path, 10)  # row i: "word " x (i + 1), as a one-message chat (the tokenizer has a template)
    with open(src, "ab") as f:
        f.write(b'{"id": "bad", "prompt": 7}\n')  # a row error: left out of the sample, reported by the run
    config = load_settings(overrides={"sampling.max_tokens": 100}).resolve_chat_template(tokenizer)
    chats = [[{"role": "user", "content": "word " * (i + 1)}] for i in range(10)]
    # transformers' own tokenization of each rendered chat: another path than the planner's batched backend call
    rendered = [tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True) for c in chats]
    prompts = sum(len(r["input_ids"] if hasattr(r, "keys") else r) for r in rendered)
    sample = sample_tokens(open_reader(src), tokenizer, config, to_request)
    assert sample is not None and sample.whole and sample.rows == 10
    assert (sample.prompt_tokens, sample.completion_tokens) == (prompts, 10 * 100)
    each = [len(r["input_ids"] if hasattr(r, "keys") else r) for r in rendered]
    assert sample.lengths == tuple((n, 100) for n in each)  # each row's own, for the compile choice's decode work
    scan = scan_input(src)
    assert job_tokens(config, scan, sample) == prompts + 1000  # the whole input: its own count
    first = sample_tokens(open_reader(src), tokenizer, config, to_request, limit=4)
    assert first is not None and not first.whole and (first.rows, first.completion_tokens) == (4, 400)
    assert scan.bytes is not None and scan.rows == 11
    estimate = math.ceil(first.prompt_tokens / first.bytes * scan.bytes * SAMPLE_MARGIN + 100 * 11)
    assert job_tokens(config, scan, first) == estimate
    assert estimate >= prompts + 1000  # the later rows are longer, and the bytes say so


def test_a_row_of_n_choices_is_n_sequences_in_the_sample(tmp_path: Path, tiny_home: Path) -> None:
    """The compile choice's decode work and the KV cache's sequences count a
    row of ``n`` choices as ``n`` sequences of its own ``max_tokens`` (vLLM
    decodes each), its prompt beside each; a row of several prompts as one
    sequence a prompt."""
    from transformers import AutoTokenizer

    from bulkinfer.io.readers import open_reader
    from bulkinfer.jobs.engine_choice import sample_tokens
    from bulkinfer.prep.rows import to_request

    tokenizer = AutoTokenizer.from_pretrained(tiny_home / "models" / "smollm2-135m-instruct")
    src = tmp_path / "in.jsonl"
    rows = [{"id": "one", "prompt": "hi", "max_tokens": 7}, {"id": "three", "prompt": "hi", "n": 3, "max_tokens": 5}]
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    config = load_settings().resolve_chat_template(tokenizer)
    sample = sample_tokens(open_reader(src), tokenizer, config, to_request)
    assert sample is not None and sample.completion_tokens == 7 + 3 * 5
    prompt = sample.prompt_tokens // 2  # the same prompt twice
    assert sample.lengths == ((prompt, 7), (prompt, 5), (prompt, 5), (prompt, 5))
    assert sample.shared_prompts == ((prompt, 3),)  # the block size's choice: the row of choices' prompt and its n
    # an OpenAI line of several prompts: one sequence a prompt (vLLM runs each), each its own length
    body = {"model": "m", "prompt": ["one two", "one two three four five six", [1, 2, 3]], "max_tokens": 4, "n": 2}
    line = {"custom_id": "several", "method": "POST", "url": "/v1/completions", "body": body}
    src.write_bytes(orjson.dumps(line) + b"\n")
    sample = sample_tokens(open_reader(src), tokenizer, config, to_request)
    each = [len(tokenizer(p)["input_ids"]) for p in body["prompt"][:2]] + [3]  # raw prompts, no template
    assert sample is not None and sample.lengths == tuple((t, 4) for t in each for _ in range(2))
    assert (sample.prompt_tokens, sample.completion_tokens) == (sum(each), 3 * 2 * 4)
    assert sample.shared_prompts == tuple((t, 2) for t in each)


def test_the_report_itemises_the_start_and_the_first_token(tmp_path: Path) -> None:
    import time

    def slow_start(model_path: str, s: Settings) -> FakeEngine:
        time.sleep(0.3)  # an engine that takes 0.3 s to start
        return FakeEngine()

    paths = RunPaths.build(make_input(tmp_path, 3), tmp_path / "out.jsonl")
    seconds = run(paths, settings(), RunContext(engine_factory=slow_start)).report["seconds"]
    start = seconds["start"]
    assert sorted(start) == ["engine", "engine_choice", "first_token", "tokenizer"]
    assert start["engine"] >= 0.3 and start["tokenizer"] > 0 and start["engine_choice"] >= 0
    assert start["tokenizer"] + start["engine_choice"] + start["engine"] <= seconds["load"]
    assert seconds["load"] <= start["first_token"] <= seconds["total"]


def test_a_run_without_rows_starts_nothing(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"")
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    seconds = run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine())).report["seconds"]
    assert seconds["start"] == {"first_token": None}


class WritesTheInput(FakeEngine):
    """At its first step, appends a row to the input (a writer still at work
    when a cron line started the run) or moves a new file over it."""

    def __init__(self, src: Path, case: str):
        super().__init__()
        self.src, self.replace = src, case == "replaced"
        self.truncate = case == "truncated"

    def step(self, wait: float | None = None) -> list[Completion]:
        if self.steps == 0:
            if self.truncate:
                os.truncate(self.src, self.src.stat().st_size // 2)
            elif self.replace:
                (self.src.parent / "next.jsonl").write_bytes(b'{"id": "new", "prompt": "tomorrow"}\n')
                os.replace(self.src.parent / "next.jsonl", self.src)
            else:
                with open(self.src, "ab") as f:
                    f.write(b'{"id": "late", "prompt": "written while the run read the file"}\n')
        return super().step(wait)


@pytest.mark.parametrize(
    ("case", "window_rows", "code", "late_row_ran"),
    [("appended after it was read", 8192, EXIT_PARTIAL, False), ("appended before its end", 2, EXIT_OK, True)]
    + [("replaced", 8192, EXIT_OK, False), ("truncated", 8192, EXIT_PARTIAL, False)],
)
def test_an_input_written_while_it_was_read_is_reported_and_exits_3_where_rows_were_missed(
    tmp_path: Path, case: str, window_rows: int, code: int, late_row_ran: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    """Appended to after the reader passed its end (all 12 rows read at the
    start): the late row has no record, so the run says so and exits 3 (the
    report's input_changed); appended while the reader (2-row windows, 2
    rows in flight) was still short of its end: the late row ran, said, exit 0; moved over after
    it was opened: the run read the old file, said, exit 0; cut to half after it was read:
    the rows read ran, and the message says the file is now shorter than that, exit 3."""
    src = make_input(tmp_path, 12)
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    engine = WritesTheInput(src, case)
    plan = settings(window_rows=window_rows, max_in_flight=2)
    result = run(paths, plan, RunContext(engine_factory=lambda m, s: engine))
    expected = [f"r{i}" for i in range(12)] + (["late"] if late_row_ran else [])
    assert (result.exit_code, sorted(output_ids(paths))) == (code, sorted(expected))
    changed = result.report["input_changed"]
    assert (changed["replaced"], changed["read_whole"]) == (case == "replaced", code == EXIT_OK)
    assert any(change.startswith("size ") for change in changed["changes"])
    assert changed["message"] in capfd.readouterr().err
    # cut shorter than what was read: no row was written late, the rows read are gone from the file
    assert ("it is now shorter than the" in changed["message"]) == (case == "truncated")
    saved = orjson.loads(paths.report.read_bytes())
    jsonschema.Draft202012Validator(orjson.loads(SCHEMA.read_bytes())).validate(saved)
    assert saved["input_changed"] == changed
    shown = CliRunner().invoke(app, ["report", str(paths.report)], env={"COLUMNS": "400"})
    assert f"input changed {changed['message']}" in " ".join(shown.output.replace("│", " ").split())
    assert html.escape(changed["message"]) in paths.html.read_text()
    # read to its end as it grew: the output is of the file as it is now, and --resume finds it complete
    resume = RunContext(engine_factory=lambda m, s: FakeEngine(), resume=True)
    if case == "appended before its end":
        assert run(paths, plan, resume).report.get("already_complete")
    else:  # rows it missed, or another file now: refused
        with pytest.raises(ConfigError, match="changed since the run that wrote it"):
            run(paths, plan, resume)


def test_the_report_says_which_sampling_fields_rows_set_themselves(tmp_path: Path) -> None:
    """The report's sampling holds the defaults; rows that set their own are
    counted beside it (the JSON, the terminal summary, the HTML)."""
    from test_plan import SET_BY_ROWS, SET_BY_ROWS_COUNTS

    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in SET_BY_ROWS))
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    result = run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    assert result.report["sampling_set_by_rows"] == SET_BY_ROWS_COUNTS
    assert result.report["sampling"]["temperature"] == 1.0  # the default, which three rows kept
    jsonschema.Draft202012Validator(orjson.loads(SCHEMA.read_bytes())).validate(result.report)
    shown = CliRunner().invoke(app, ["report", str(paths.report)], env={"COLUMNS": "400"})
    said = " ".join(shown.output.replace("│", " ").split())
    assert "sampling set by rows (rows) temperature 2, max_completion_tokens 1, max_tokens 1" in said
    assert "Rows that set their own (rows): temperature (2), max_completion_tokens (1), max_tokens (1)." in (
        paths.html.read_text()
    )


def test_an_input_left_alone_has_no_input_changed(tmp_path: Path) -> None:
    paths = RunPaths.build(make_input(tmp_path, 4), tmp_path / "out.jsonl")
    result = run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    assert result.exit_code == EXIT_OK and "input_changed" not in result.report
