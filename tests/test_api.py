"""The public Python API's settings handling and its shared engine, on the fake
engine (the real runs are in tests/e2e/)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest
from fakes import FakeEngine

import bulkinfer
from bulkinfer.config import Settings, load_settings
from bulkinfer.errors import ConfigError
from bulkinfer.jobs.shared_engine import SharedEngine
from bulkinfer.schema import Completion, Request


def test_overrides_are_run_options_by_name() -> None:
    base = load_settings(None, {"sampling.temperature": 0.5})
    settings = bulkinfer.arguments.settings_with(
        base,
        {"max_tokens": 7, "stop": ["END"], "max_num_seqs": 4, "order": "ascending"},
        {"enable_prefix_caching": False},
    )
    assert (settings.sampling.max_tokens, settings.sampling.temperature, settings.sampling.stop) == (7, 0.5, ("END",))
    assert (settings.engine.max_num_seqs, settings.plan.order) == (4, "ascending")
    assert settings.engine.extra_args == {"enable_prefix_caching": False}
    assert bulkinfer.arguments.settings_with(None, {}, None) == load_settings()


def test_an_unknown_option_is_named_with_the_closest() -> None:
    with pytest.raises(ConfigError, match="'max_token'; did you mean max_tokens"):
        bulkinfer.arguments.settings_with(None, {"max_token": 5}, None)
    with pytest.raises(ConfigError, match="max_tokens"):
        bulkinfer.arguments.settings_with(None, {"max_tokens": 0}, None)  # checked like a flag's value


def test_importing_bulkinfer_imports_no_engine() -> None:
    code = "import sys, bulkinfer; print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert set(bulkinfer.__all__) >= {"run", "plan", "evaluate", "Settings", "load_settings", "RunReport"}


def _lines(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_a_shared_engine_starts_once_for_many_runs(tmp_path: Path) -> None:
    started: list[FakeEngine] = []

    def factory(model: str, settings: Settings) -> FakeEngine:
        started.append(FakeEngine())
        return started[-1]

    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "prompt": "hello there"}) + b"\n" for i in range(5)))
    with SharedEngine(load_settings(), engine_factory=factory) as shared:
        assert len(started) == 1  # opened now, before any run
        # the fast suite's CPU has no native bfloat16 (tests/conftest.py): decided without a probe
        assert shared.engine_choice["dtype"]["dtype"] == shared.settings.engine.dtype == "float32"
        reports = [bulkinfer.run(src, tmp_path / f"out{k}.jsonl", engine=shared, max_tokens=8) for k in range(2)]
        assert len(started) == 1 and not started[0].closed  # the runs closed only their own use of it
        for k, report in enumerate(reports):
            assert report.exit_code == 0
            assert [r["id"] for r in _lines(tmp_path / f"out{k}.jsonl")] == [f"r{i}" for i in range(5)]
            # an engine that outlives the run is not sized to its job
            assert "kv_cache" not in report.report["engine_choice"]
            assert report.report["engine_choice"]["dtype"]["dtype"] == "float32"
    assert started[0].closed


def test_a_run_on_a_shared_engine_refuses_engine_settings(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps({"id": "r", "prompt": "hi"}) + b"\n")
    with SharedEngine(load_settings(), engine_factory=lambda m, s: FakeEngine()) as shared:
        with pytest.raises(ConfigError, match="max_num_seqs: an engine setting.*open_engine"):
            bulkinfer.run(src, tmp_path / "a.jsonl", engine=shared, max_num_seqs=4)
        with pytest.raises(ConfigError, match=r"engine_args\[.enable_prefix_caching.\]: an engine setting"):
            bulkinfer.run(src, tmp_path / "b.jsonl", engine=shared, engine_args={"enable_prefix_caching": False})
        with pytest.raises(ConfigError, match="another model than the open engine's"):
            bulkinfer.run(src, tmp_path / "c.jsonl", load_settings(None, {"model": "other/model"}), engine=shared)
        assert not (tmp_path / "a.jsonl").exists()  # refused before any file was made


def test_passthrough_is_a_run_option_on_a_shared_engine_and_a_flag(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from bulkinfer.cli import app

    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps({"id": "r", "prompt": "hi", "note": "kept?"}) + b"\n")
    with SharedEngine(load_settings(), engine_factory=lambda m, s: FakeEngine()) as shared:
        bulkinfer.run(src, tmp_path / "off.jsonl", engine=shared, passthrough=False)
        bulkinfer.run(src, tmp_path / "on.jsonl", engine=shared)
    assert "note" not in _lines(tmp_path / "off.jsonl")[0] and _lines(tmp_path / "on.jsonl")[0]["note"] == "kept?"
    both = CliRunner().invoke(app, ["run", str(src), "--passthrough", "--no-passthrough"])
    assert both.exit_code == 2 and "give --passthrough or --no-passthrough, not both" in both.output


class FcfsEngine(FakeEngine):
    settings = {"fake": True, "scheduling_policy": "fcfs"}  # vLLM's default policy: priorities ignored


def test_stop_strings_the_stop_token_and_arguments_of_the_wrong_type(tmp_path: Path) -> None:
    """``stop=`` is the run's StopToken, or given as strings the sampling stop
    strings (``--stop``); an argument of the wrong type is a ConfigError
    before any file is made, never an AttributeError from deep inside."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps({"id": "r", "prompt": "hi"}) + b"\n")
    with SharedEngine(load_settings(), engine_factory=lambda m, s: FakeEngine()) as shared:
        report = bulkinfer.run(src, tmp_path / "s.jsonl", engine=shared, stop="###")
        assert report.exit_code == 0 and tuple(report.report["sampling"]["stop"]) == ("###",)
        token = bulkinfer.StopToken()
        assert bulkinfer.run(src, tmp_path / "t.jsonl", engine=shared, stop=token).exit_code == 0
        for kwargs, said in [
            (
                {"settings": "configs/demo.toml"},
                "settings= takes a bulkinfer.Settings, got str: bulkinfer.load_settings",
            ),
            ({"engine_args": "x"}, "engine_args= takes a mapping"),
            ({"observer": 5}, "observer= takes a bulkinfer.RunObserver, got int"),
            ({"engine": "x"}, "engine= takes an engine from bulkinfer.open_engine(), got str"),
        ]:
            with pytest.raises(ConfigError, match=re.escape(said)):
                bulkinfer.run(src, tmp_path / "bad.jsonl", **({"engine": shared} | kwargs))  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir() if "bad" in p.name) == []  # no journal, lock or log left


def test_a_row_priority_on_an_engine_that_ignores_priorities_is_the_rows_error(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(
        b"".join(
            orjson.dumps(r) + b"\n" for r in [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "hi", "priority": 1}]
        )
    )
    with SharedEngine(load_settings(), engine_factory=lambda m, s: FcfsEngine()) as shared:
        report = bulkinfer.run(src, tmp_path / "out.jsonl", engine=shared)
    assert report.exit_code == 3 and [r["id"] for r in _lines(tmp_path / "out.jsonl")] == ["a"]
    (error,) = _lines(tmp_path / "out.errors.jsonl")
    assert error["id"] == "b" and error["error"]["type"] == "invalid_field"
    assert error["error"]["message"].startswith("field 'priority': this engine schedules first come, first served")


class OneRunAtATime(FakeEngine):
    """Fails a request added while another run's requests are in the engine."""

    def add(self, request_id: str, request: Request) -> Completion | None:
        runs = {rid.split("-")[0] for rid in self.reached} if self.queue else set()
        assert runs <= {request.id.split("-")[0]}, f"{request.id} joined the requests of run {runs}"
        if not self.queue:
            self.reached.clear()
        return super().add(request_id, request)


def test_runs_in_two_threads_on_one_shared_engine_take_turns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two threads' ``bulkinfer.run`` on one engine: each job has the engine to
    itself in turn (together, each took the other's finished requests from
    the steps: KeyError); a job waiting for its turn stops on its token."""
    for k in range(2):
        (tmp_path / f"in{k}.jsonl").write_bytes(
            b"".join(orjson.dumps({"id": f"{k}-{i}", "prompt": "hello there"}) + b"\n" for i in range(12))
        )
    results: dict[int, object] = {}

    def go(shared: SharedEngine, k: int, **options: object) -> None:
        try:
            results[k] = bulkinfer.run(tmp_path / f"in{k}.jsonl", engine=shared, max_tokens=8, **options).exit_code
        except Exception as exc:  # the assertion below shows it
            results[k] = exc

    with SharedEngine(load_settings(), engine_factory=lambda m, s: OneRunAtATime(step_delay=0.01)) as shared:
        threads = [threading.Thread(target=go, args=(shared, k)) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert results == {0: 0, 1: 0}
        for k in range(2):
            assert sorted(r["completion"] for r in _lines(tmp_path / f"in{k}.out.jsonl")) == sorted(
                f"echo {k}-{i}" for i in range(12)
            )
        assert "waiting for the shared engine: another run in this process is using it" in capsys.readouterr().err

        token = bulkinfer.StopToken()
        with shared.turn(bulkinfer.StopToken()):  # another job has the engine
            waiting = threading.Thread(target=go, args=(shared, 2), kwargs={"stop": token})
            (tmp_path / "in2.jsonl").write_bytes(orjson.dumps({"id": "2-0", "prompt": "hi"}) + b"\n")
            waiting.start()
            token.stop("stopped by the caller")
            waiting.join(10)
        assert isinstance(results[2], bulkinfer.errors.Interrupted)
        assert "waiting for the shared engine" in str(results[2])
    assert not list(tmp_path.glob("in2.out*"))  # nothing was run


def test_tokenizers_load_in_several_threads_at_once(tiny_home: Path) -> None:
    """transformers' lazy module, imported by two threads at once, raised
    "cannot import name 'AutoTokenizer'" in some of them (about one fresh
    process in five, eight threads loading at the same moment): three such
    processes side by side."""
    code = f"""
import threading
from bulkinfer.models import load_tokenizer
start, failed = threading.Barrier(8), []
def load():
    start.wait()
    try:
        load_tokenizer({str(tiny_home / "models" / "smollm2-135m-instruct")!r})
    except Exception as exc:
        failed.append(repr(exc))
threads = [threading.Thread(target=load) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(failed)
"""
    processes = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    assert [p.communicate()[0].strip() for p in processes] == ["[]"] * 3
