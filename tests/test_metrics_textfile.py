"""``--metrics-textfile``: a command's ending as Prometheus gauges for
node_exporter's textfile collector, read back with prometheus_client's own
parser (the reference reader of the format). The engine is the fake one: these
check what is written for each ending, not inference."""

from __future__ import annotations

import math
import os
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from bulkinfer.cli import app
from bulkinfer.report.textfile import Outcome, write_textfile

runner = CliRunner()


def _samples(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(name, sorted labels) -> value of every sample in ``path``."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(path.read_text(encoding="utf-8"))
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float | None:  # type: ignore[type-arg]
    for (found, found_labels), value in samples.items():
        if found == "bulkinfer_last_run_" + name and labels.items() <= dict(found_labels).items():
            return value  # type: ignore[no-any-return]
    return None


@pytest.fixture
def fake_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    from fakes import FakeEngine

    monkeypatch.setattr("bulkinfer.jobs.context.vllm_engine", lambda model, settings: FakeEngine())


def _input(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"id": "a", "prompt": "hi", "reference": "hello"}\n'
        '{"id": "b", "prompt": "", "reference": "x"}\n'
        '{"id": "c", "prompt": "hey", "reference": "hey there"}\n'
    )
    return path


@pytest.mark.usefixtures("fake_engines")
def test_a_run_then_a_failed_one_keep_the_last_complete_time(tmp_path: Path) -> None:
    source, prom = _input(tmp_path), tmp_path / "job.prom"
    out = tmp_path / "out.jsonl"
    first = runner.invoke(app, ["run", str(source), "-o", str(out), "--metrics-textfile", str(prom)])
    assert first.exit_code == 3, first.output  # row b is invalid
    samples = _samples(prom)
    labels = {"command": "run", "input": str(source), "textfile": "job.prom"}
    report = orjson.loads((tmp_path / "out.report.json").read_bytes())
    assert _value(samples, "exit_code", **labels) == 3
    assert _value(samples, "rows", state="completed", **labels) == 2
    assert _value(samples, "rows", state="failed", **labels) == 1
    assert _value(samples, "tokens", kind="completion") == report["tokens"]["completion"]
    assert _value(samples, "seconds", phase="generate") == pytest.approx(report["seconds"]["generate"])
    assert _value(samples, "info", model=report["model"]) == 1
    ended = _value(samples, "end_timestamp_seconds", **labels)
    started = _value(samples, "start_timestamp_seconds", **labels)
    assert started is not None and ended is not None and started <= ended
    assert _value(samples, "complete_timestamp_seconds", **labels) == ended  # exit 3: every row has its record

    again = runner.invoke(app, ["run", str(source), "-o", str(out), "--metrics-textfile", str(prom)])
    assert again.exit_code == 6, again.output  # the output exists
    samples = _samples(prom)
    assert _value(samples, "exit_code", **labels) == 6
    assert _value(samples, "complete_timestamp_seconds", **labels) == ended  # carried over
    assert _value(samples, "end_timestamp_seconds", **labels) > ended  # type: ignore[operator]
    assert _value(samples, "rows", state="completed") is None  # no report this time
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("job")) == ["job.prom"]  # no temporary left


@pytest.mark.usefixtures("fake_engines")
def test_eval_writes_its_scores_and_the_env_var_names_the_file(tmp_path: Path) -> None:
    source, prom = _input(tmp_path), tmp_path / "eval.prom"
    result = runner.invoke(
        app, ["eval", str(source), "-o", str(tmp_path / "e.jsonl")], env={"BULKINFER_METRICS_TEXTFILE": str(prom)}
    )
    assert result.exit_code == 3, result.output
    scores = orjson.loads((tmp_path / "e.eval.json").read_bytes())["scores"]
    samples = _samples(prom)
    assert _value(samples, "exit_code", command="eval") == 3
    for metric in ("bleu", "chrf", "rougeL", "exact_match"):
        assert _value(samples, "eval_score", metric=metric) == pytest.approx(scores[metric])
    assert _value(samples, "eval_score", metric="rows") is None  # counts are no scores
    assert _value(samples, "rows", state="scored") == 2


@pytest.mark.usefixtures("fake_engines")
def test_an_error_before_any_row_is_its_exit_code_with_no_complete_time(tmp_path: Path) -> None:
    prom = tmp_path / "job.prom"
    result = runner.invoke(app, ["run", str(tmp_path / "missing.jsonl"), "--metrics-textfile", str(prom)])
    assert result.exit_code == 4
    samples = _samples(prom)
    assert _value(samples, "exit_code", command="run", input=str(tmp_path / "missing.jsonl")) == 4
    assert _value(samples, "complete_timestamp_seconds") is None


def test_a_bad_flag_is_written_as_its_exit_code_2(tmp_path: Path) -> None:
    prom = tmp_path / "job.prom"
    flags = ["--passthrough", "--no-passthrough", "--metrics-textfile", str(prom)]
    result = runner.invoke(app, ["run", str(_input(tmp_path)), *flags])
    assert result.exit_code == 2
    assert _value(_samples(prom), "exit_code") == 2


@pytest.mark.parametrize(
    ("name", "message"), [("job.txt", "reads only *.prom files"), ("no/such/dir/job.prom", "no such directory")]
)
def test_a_file_the_collector_would_not_read_is_refused_before_the_run(tmp_path: Path, name: str, message: str) -> None:
    result = runner.invoke(app, ["run", str(_input(tmp_path)), "--metrics-textfile", str(tmp_path / name)])
    assert result.exit_code == 2
    assert message in result.output
    assert not (tmp_path / "in.out.jsonl").exists()


def test_a_directory_this_process_cannot_write_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "textfiles"
    locked.mkdir(mode=0o555)  # root may write it all the same: os.access answers as for another user
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == locked else real(path, mode))
    result = runner.invoke(app, ["run", str(_input(tmp_path)), "--metrics-textfile", str(locked / "job.prom")])
    assert result.exit_code == 2 and "not writable" in result.output
    assert not (tmp_path / "in.out.jsonl").exists()


@pytest.mark.usefixtures("fake_engines")
def test_a_file_that_cannot_be_written_is_a_warning_not_another_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(path: Path, outcome: Outcome) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("bulkinfer.report.textfile.write_textfile", full)
    result = runner.invoke(app, ["run", str(_input(tmp_path)), "--metrics-textfile", str(tmp_path / "job.prom")])
    assert result.exit_code == 3
    assert "--metrics-textfile" in result.output and "No space left on device" in result.output


def test_only_its_own_jobs_complete_time_is_carried_and_nothing_not_finite_is_written(tmp_path: Path) -> None:
    prom = tmp_path / "job.prom"
    write_textfile(prom, Outcome("run", "/a.jsonl", 1.0, 2.0, 0, None))
    write_textfile(prom, Outcome("run", "/b.jsonl", 3.0, 4.0, 5, {"throughput": {"completion_tokens_per_s": math.nan}}))
    samples = _samples(prom)
    assert _value(samples, "exit_code", input="/b.jsonl") == 5
    assert _value(samples, "complete_timestamp_seconds") is None  # /a.jsonl's is not /b.jsonl's
    assert _value(samples, "completion_tokens_per_second") is None
    assert _value(samples, "exit_code", input="/a.jsonl") is None  # the file is one job's: replaced whole


def test_an_unreadable_earlier_file_loses_only_the_carried_time(tmp_path: Path) -> None:
    prom = tmp_path / "job.prom"
    prom.write_text("this is { not the text format\n")
    write_textfile(prom, Outcome("run", "/a.jsonl", 1.0, 2.0, 5, None))
    samples = _samples(prom)
    assert _value(samples, "exit_code") == 5
    assert _value(samples, "complete_timestamp_seconds") is None


def test_two_jobs_on_standard_input_never_give_the_collector_one_series_twice(tmp_path: Path) -> None:
    """node_exporter fails its scrape on a series two files both hold: the file's name tells them apart."""
    for name in ("a.prom", "b.prom"):
        write_textfile(tmp_path / name, Outcome("run", "-", 1.0, 2.0, 0, None))
    series = [key for name in ("a.prom", "b.prom") for key in _samples(tmp_path / name)]
    assert len(series) == len(set(series)) == 8  # exit code, start, end, complete: each file's own
