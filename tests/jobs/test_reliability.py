"""The faults a 3 a.m. cron job meets (issue 18), orchestrated with the fake
engine: paths that would destroy the input, a stuck engine, a failed start,
disk errors, empty input, signals during load.

The fake engine only provokes failures; tests/e2e/test_e2e.py proves the same
guarantees with the real vLLM engine (engine core killed, kill -9 during
load, a poison row).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
from fakes import FakeEngine, wait_for

from bulkinfer.config import Settings, load_settings
from bulkinfer.errors import (
    EXIT_OK,
    EXIT_WRITE,
    ConfigError,
    EngineError,
    LockHeldError,
    ModelError,
    OutputExistsError,
    OutputWriteError,
)
from bulkinfer.io.output_files import OutputFiles, RunPaths
from bulkinfer.io.spool import spool_records
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run

HERE = Path(__file__).resolve().parents[1]  # tests/, where fault_driver.py is


def write_rows(path: Path, n: int) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "prompt": "word " * (i + 1)}) + b"\n" for i in range(n)))
    return path


def settings(**plan: object) -> Settings:
    return load_settings(None, {"plan.max_in_flight": 2, **{f"plan.{k}": v for k, v in plan.items()}})


def ids(path: Path) -> list[str]:
    """The ids of an output file's records or of a spool's (``[LINE, RECORD]`` lines)."""
    return [record["id"] for _, record in spool_records(path)]


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# -- every path a run writes is checked against the input --------------------------------------


def test_an_errors_file_named_like_the_input_is_refused_and_the_input_kept(tmp_path: Path) -> None:
    src = write_rows(tmp_path / "X.errors.jsonl", 5)
    before = src.read_bytes()
    with pytest.raises(ConfigError, match=r"X\.errors\.jsonl.*would overwrite the input"):
        RunPaths.build(src, tmp_path / "X.jsonl")
    assert src.read_bytes() == before


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_an_output_that_is_the_input_by_a_link_is_refused(tmp_path: Path, link: str) -> None:
    src = write_rows(tmp_path / "in.jsonl", 3)
    out = tmp_path / "out.jsonl"
    (os.symlink if link == "symlink" else os.link)(src, out)
    with pytest.raises(ConfigError, match="would overwrite the input"):
        RunPaths.build(src, out)


def test_report_of_the_output_is_the_input(tmp_path: Path) -> None:
    src = tmp_path / "r.report.jsonl"
    write_rows(src, 2)
    (tmp_path / "link.report.json").symlink_to(src)
    with pytest.raises(ConfigError, match="link.report.json"):
        RunPaths.build(src, tmp_path / "link.jsonl")


def test_jsonl_and_parquet_outputs_of_one_stem_share_one_lock(tmp_path: Path) -> None:
    src = write_rows(tmp_path / "in.jsonl", 4)
    with OutputFiles(tmp_path / "r.jsonl").locked():
        with pytest.raises(LockHeldError, match="another bulkinfer run"):
            run(
                RunPaths.build(src, tmp_path / "r.parquet"),
                settings(),
                RunContext(engine_factory=lambda m, s: FakeEngine()),
            )


def test_an_output_of_the_same_stem_in_another_format_is_not_clobbered(tmp_path: Path) -> None:
    src = write_rows(tmp_path / "in.jsonl", 4)
    run(RunPaths.build(src, tmp_path / "r.jsonl"), settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    report_before = (tmp_path / "r.report.json").read_bytes()
    with pytest.raises(OutputExistsError, match=r"r\.jsonl shares r\.errors\.jsonl and r\.report\.json"):
        run(
            RunPaths.build(src, tmp_path / "r.parquet"),
            settings(),
            RunContext(engine_factory=lambda m, s: FakeEngine()),
        )
    assert (tmp_path / "r.report.json").read_bytes() == report_before
    assert not (tmp_path / "r.parquet").exists()


def test_an_output_of_the_inputs_stem_in_another_format_runs_unless_the_stem_has_another_outputs_files(
    tmp_path: Path,
) -> None:
    """`run data.jsonl -o data.parquet` runs (and runs again with --overwrite);
    where data.jsonl was itself an earlier run's output, its errors and
    report are not overwritten, and the message does not say to remove the
    input."""
    src = write_rows(tmp_path / "data.jsonl", 4)
    out = tmp_path / "data.parquet"
    for overwrite in (False, True):
        result = run(
            RunPaths.build(src, out),
            settings(),
            RunContext(overwrite=overwrite, engine_factory=lambda m, s: FakeEngine()),
        )
        assert result.exit_code == EXIT_OK and pq.read_table(out).num_rows == 4
    (tmp_path / "data.report.json").write_bytes(orjson.dumps({"output": "data.jsonl"}))  # data.jsonl's own report
    out.unlink()
    with pytest.raises(OutputExistsError) as info:
        run(RunPaths.build(src, out), settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    assert str(info.value).startswith(f"the input {src} has the stem of the output {out}, and data.errors.jsonl")
    assert "remove" not in str(info.value) and f"e.g. {tmp_path / 'data.out.parquet'}" in str(info.value)
    assert orjson.loads((tmp_path / "data.report.json").read_bytes()) == {"output": "data.jsonl"}


# -- engine death and a stuck engine ------------------------------------------------------------


def test_engine_death_keeps_finished_rows_and_resume_completes(tmp_path: Path) -> None:
    paths = RunPaths.build(write_rows(tmp_path / "in.jsonl", 12), tmp_path / "out.jsonl")
    engine = FakeEngine(crash_at=3)
    with pytest.raises(EngineError) as info:
        run(paths, settings(), RunContext(engine_factory=lambda m, s: engine))
    assert info.value.exit_code == 5 and engine.closed
    spool = tmp_path / ".out.jsonl.partial.jsonl"
    assert len(ids(spool)) == 4  # two steps of two rows finished before the crash
    result = run(paths, settings(), RunContext(resume=True, engine_factory=lambda m, s: FakeEngine()))
    assert result.exit_code == EXIT_OK and result.report["resumed"]["completed"] == 4
    assert sorted(ids(paths.output)) == sorted(f"r{i}" for i in range(12))


def test_a_resumed_run_still_counts_the_ids_of_rows_that_failed(tmp_path: Path) -> None:
    """A row that failed before the engine died keeps its id on resume: a later
    row of that id, not yet read then, is a duplicate as in one attempt."""
    src = write_rows(tmp_path / "in.jsonl", 12)
    lines = src.read_bytes().splitlines()
    lines[0] = b'{"id": "c", "prompt": "hi", "max_tokens": 0}'
    src.write_bytes(b"\n".join([*lines, b'{"id": "c", "prompt": "late"}']) + b"\n")
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    with pytest.raises(EngineError):
        run(paths, settings(window_rows=2), RunContext(engine_factory=lambda m, s: FakeEngine(crash_at=2)))
    assert [line for line, _ in spool_records(tmp_path / ".out.errors.jsonl.partial.jsonl")] == [1]
    result = run(paths, settings(), RunContext(resume=True, engine_factory=lambda m, s: FakeEngine()))
    errors = {line: record for line, record in spool_records(paths.errors)}
    assert result.exit_code == 3 and sorted(errors) == [1, 13]
    assert (errors[13]["id"], errors[13]["error"]["type"]) == ("c", "duplicate_id")
    assert sorted(ids(paths.output)) == sorted(f"r{i}" for i in range(1, 12))


def fault_driver(src: Path, out: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "fault_driver.py"), str(src), str(out), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def test_one_sigterm_ends_a_run_whose_engine_step_never_returns(tmp_path: Path) -> None:
    src, out = write_rows(tmp_path / "in.jsonl", 10), tmp_path / "out.jsonl"
    proc = fault_driver(src, out, "--step-delay", "0", "--hang-at", "3")
    spool = tmp_path / ".out.jsonl.partial.jsonl"
    wait_for(lambda: spool.exists() and spool.read_bytes().count(b"\n") >= 4)
    time.sleep(1.0)  # the engine is now stuck in a step
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr.decode()
    assert time.monotonic() - sent < 10  # measured: ~0.5 s (the feed loop waits 0.5 s per look)
    assert len(ids(spool)) == 4


def test_sigterm_during_load_acts_at_once(tmp_path: Path) -> None:
    src, out = write_rows(tmp_path / "in.jsonl", 4), tmp_path / "out.jsonl"
    proc = fault_driver(src, out, "--slow-start", "60")  # a model load of a minute
    journal = tmp_path / ".out.jsonl.journal.json"
    wait_for(lambda: journal.exists())
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr.decode()
    assert b"stopped by SIGTERM before any row was run" in stderr
    assert time.monotonic() - sent < 2
    assert hidden(tmp_path) == [".out.lock"]  # nothing finished: no journal or spool left in the way


# -- a failed start leaves nothing in the way ---------------------------------------------------


def test_a_failed_start_leaves_nothing_in_the_way(tmp_path: Path) -> None:
    paths = RunPaths.build(write_rows(tmp_path / "in.jsonl", 6), tmp_path / "out.jsonl")

    def broken(model: str, s: Settings) -> FakeEngine:
        raise ModelError("no such model directory: /nowhere")

    with pytest.raises(ModelError):
        run(paths, settings(), RunContext(engine_factory=broken))
    assert hidden(tmp_path) == [".out.lock"]
    # the corrected cron line, with --resume and other settings, just runs
    fixed = load_settings(None, {"sampling.max_tokens": 9})
    result = run(paths, fixed, RunContext(resume=True, engine_factory=lambda m, s: FakeEngine()))
    assert result.exit_code == EXIT_OK and len(ids(paths.output)) == 6


def test_a_journal_left_by_a_kill_before_any_row_is_no_obstacle(tmp_path: Path) -> None:
    paths = RunPaths.build(write_rows(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl")
    files = OutputFiles(paths.output)
    files.journal.write_bytes(b'{"input": {}, "settings_sha256": "other"}')
    files.spool.write_bytes(b"")
    result = run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))  # no --resume, no --overwrite
    assert result.exit_code == EXIT_OK and len(ids(paths.output)) == 3


# -- OS errors are bulkinfer errors -------------------------------------------------------------


def test_disk_full_during_the_spool_flush_exits_9_and_resume_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = RunPaths.build(write_rows(tmp_path / "in.jsonl", 10), tmp_path / "out.jsonl")
    flushes = 0
    from bulkinfer.io import files as writers

    real_failpoint = writers.failpoint

    def full_after_two(name: str, path: Path | None = None) -> None:
        nonlocal flushes
        if name == "spool_flush" and path is not None and path.name == ".out.jsonl.partial.jsonl":
            flushes += 1
            if flushes == 3:
                monkeypatch.setenv("BULKINFER_FAILPOINT", "spool_flush:ENOSPC")
        real_failpoint(name, path)

    monkeypatch.setattr(writers, "failpoint", full_after_two)
    with pytest.raises(OutputWriteError) as info:
        run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    assert info.value.exit_code == EXIT_WRITE
    message = str(info.value)
    assert ".out.jsonl.partial.jsonl" in message and "No space left on device" in message and "--resume" in message
    monkeypatch.delenv("BULKINFER_FAILPOINT")
    kept = ids(tmp_path / ".out.jsonl.partial.jsonl")
    assert len(kept) >= 4  # the rows flushed before the disk filled
    result = run(paths, settings(), RunContext(resume=True, engine_factory=lambda m, s: FakeEngine()))
    assert result.exit_code == EXIT_OK
    assert sorted(ids(paths.output)) == sorted(f"r{i}" for i in range(10))


def test_a_read_only_file_system_at_the_journal_exits_9_without_debris(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = RunPaths.build(write_rows(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl")
    monkeypatch.setenv("BULKINFER_FAILPOINT", "atomic_write:EROFS:.journal.json")
    with pytest.raises(OutputWriteError, match=r"journal\.json: Read-only file system \(EROFS\); .*choose another -o"):
        run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    assert hidden(tmp_path) == [".out.lock"]


def test_disk_full_at_the_html_report_is_exit_9_and_a_resume_draws_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that cannot write its HTML report fails as for any file of its
    own (exit 9, naming it, not its temporary file); its ``--resume`` draws
    the page from the JSON report and ends the job."""
    paths = RunPaths.build(write_rows(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl")
    monkeypatch.setenv("BULKINFER_FAILPOINT", "atomic_write:ENOSPC:.report.html")
    with pytest.raises(OutputWriteError, match=f"cannot write {paths.html}: No space left on device"):
        run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    assert paths.report.exists() and not paths.html.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.delenv("BULKINFER_FAILPOINT")
    again = run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine(), resume=True))
    assert again.exit_code == EXIT_OK and again.report["already_complete"] and paths.html.exists()
    assert hidden(tmp_path) == [".out.lock"]  # the journal went with the report written


def test_a_complete_output_without_its_report_is_checked_by_its_journal_or_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The rows were published, then the report could not be written: a
    ``--resume`` with another input is refused (the journal, kept until the
    report is written, says what ran), the same one ends with a warning; a
    report deleted later leaves nothing to check by: refused. (Each used to
    be "already complete; nothing to do", exit 0, for any input.)"""
    paths = RunPaths.build(write_rows(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl")
    monkeypatch.setenv("BULKINFER_FAILPOINT", "atomic_write:ENOSPC:.report.json")
    with pytest.raises(OutputWriteError, match=f"cannot write {paths.report}"):
        run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    monkeypatch.delenv("BULKINFER_FAILPOINT")
    assert ids(paths.output) == ["r0", "r1", "r2"] and not paths.report.exists()
    write_rows(tmp_path / "other.jsonl", 5)
    other = RunPaths.build(tmp_path / "other.jsonl", paths.output)
    with pytest.raises(ConfigError, match="it is complete, but the input .*other.jsonl changed"):
        run(other, settings(), RunContext(engine_factory=lambda m, s: FakeEngine(), resume=True))
    same = run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine(), resume=True))
    assert same.exit_code == EXIT_OK and same.report["already_complete"]
    assert "stopped before writing its report" in capfd.readouterr().err
    done = RunPaths.build(paths.input, tmp_path / "done.jsonl")
    assert run(done, settings(), RunContext(engine_factory=lambda m, s: FakeEngine())).exit_code == EXIT_OK
    done.report.unlink()
    with pytest.raises(ConfigError, match="its report .* is missing, so whether it is this input's"):
        run(done, settings(), RunContext(engine_factory=lambda m, s: FakeEngine(), resume=True))


def test_a_directory_where_a_report_goes_is_exit_9_before_any_row(tmp_path: Path) -> None:
    paths = RunPaths.build(write_rows(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl")
    paths.report.mkdir()
    engine = FakeEngine()
    with pytest.raises(OutputWriteError, match=f"cannot write {paths.report}: Is a directory"):
        run(paths, settings(), RunContext(engine_factory=lambda m, s: engine))
    assert engine.reached == {} and not paths.output.exists()


def test_a_read_only_calibration_store_only_warns_a_finished_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import bulkinfer.report.calibration as calibration

    monkeypatch.setattr(calibration, "MIN_ROWS", 1)  # the fake engine's rows are enough to store
    monkeypatch.setattr(calibration, "MIN_COMPLETION_TOKENS", 1)
    monkeypatch.setenv("BULKINFER_FAILPOINT", "atomic_write:EROFS:calibration.json")  # e.g. a read-only $HOME
    paths = RunPaths.build(write_rows(tmp_path / "in.jsonl", 5), tmp_path / "out.jsonl")
    result = run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    assert result.exit_code == EXIT_OK and sorted(ids(paths.output)) == [f"r{i}" for i in range(5)]
    store = calibration.calibration_path()
    assert (
        f"bulkinfer: warning: cannot write the calibration store {store}: Read-only file system (EROFS): "
        "not stored, so later runs measure again" in capfd.readouterr().err
    )


def test_an_os_error_on_a_file_not_the_runs_names_it_without_blaming_the_output(tmp_path: Path) -> None:
    import errno

    elsewhere = tmp_path / "elsewhere" / "weights.bin"

    def engine_factory(model: str, s: Settings) -> FakeEngine:
        raise PermissionError(errno.EACCES, "Permission denied", str(elsewhere))

    paths = RunPaths.build(write_rows(tmp_path / "in.jsonl", 2), tmp_path / "out" / "out.jsonl")
    with pytest.raises(OutputWriteError) as caught:
        run(paths, settings(), RunContext(engine_factory=engine_factory))
    message = f"{elsewhere}: Permission denied (EACCES); finished rows are kept: fix it, then --resume"
    assert str(caught.value) == message  # not "cannot write", nor "choose another -o"


def test_an_output_whose_parent_is_a_file_exits_9(tmp_path: Path) -> None:
    src = write_rows(tmp_path / "in.jsonl", 2)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputWriteError, match=r"afile: Not a directory \(ENOTDIR\)"):
        run(
            RunPaths.build(src, tmp_path / "afile" / "out.jsonl"),
            settings(),
            RunContext(engine_factory=lambda m, s: FakeEngine()),
        )


def test_an_output_that_is_a_directory_exits_9(tmp_path: Path) -> None:
    src = write_rows(tmp_path / "in.jsonl", 2)
    (tmp_path / "out.jsonl").mkdir()
    with pytest.raises(OutputWriteError, match=r"out\.jsonl: Is a directory \(EISDIR\)"):
        run(
            RunPaths.build(src, tmp_path / "out.jsonl"),
            settings(),
            RunContext(engine_factory=lambda m, s: FakeEngine()),
        )


# -- an empty input -----------------------------------------------------------------------------


def no_engine(model: str, s: Settings) -> FakeEngine:
    raise AssertionError("an empty input must not load the model")


@pytest.mark.parametrize("data", [b"", b"\n\n  \n"])
def test_an_empty_input_finishes_without_a_model(tmp_path: Path, data: bytes) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(data)
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    result = run(paths, settings(), RunContext(engine_factory=no_engine))
    assert result.exit_code == EXIT_OK
    assert paths.output.read_bytes() == b"" and paths.errors.read_bytes() == b""
    assert result.report["request_counts"] == {
        "total": data.count(b"\n"),
        "completed": 0,
        "failed": 0,
        "skipped": data.count(b"\n"),
    }
    assert paths.report.exists() and hidden(tmp_path) == [".out.lock"]


def test_an_empty_input_to_parquet_has_the_output_schema(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"")
    paths = RunPaths.build(src, tmp_path / "out.parquet")
    assert run(paths, settings(), RunContext(engine_factory=no_engine)).exit_code == EXIT_OK
    table = pq.read_table(paths.output)
    assert table.num_rows == 0
    assert [(f.name, str(f.type)) for f in table.schema] == [
        ("id", "string"),
        ("completion", "string"),
        ("finish_reason", "string"),
        ("prompt_tokens", "int64"),
        ("completion_tokens", "int64"),
    ]


def test_a_journal_of_an_older_bulkinfer_resumes_while_new_settings_keep_their_defaults() -> None:
    """A journal written before a setting existed lacks its key: no change
    while it has its default, a change once it is set."""
    from bulkinfer.config import load_settings
    from bulkinfer.io.journal import results_settings, settings_changes

    old = results_settings(load_settings())
    for key in ("n", "logprobs", "structured_outputs", "priority"):
        del old["sampling"][key]
    assert settings_changes(old, results_settings(load_settings())) == []
    changed = settings_changes(old, results_settings(load_settings(None, {"sampling.n": 2})))
    assert changed == ["--n (sampling.n): not set -> 2"]


def test_input_changes_say_which_path_size_or_time_differs() -> None:
    from bulkinfer.io.journal import input_changes

    old = {"path": "/a/in.jsonl", "size": 120, "mtime_ns": 10**18}
    assert input_changes(old, {**old, "path": "/b/in.jsonl"}) == ["it read /a/in.jsonl, not /b/in.jsonl"]
    assert input_changes(old, {**old, "size": 140}) == ["size 120 -> 140 bytes"]
    [modified] = input_changes(old, {**old, "mtime_ns": 10**18 + 5 * 10**9})
    assert modified.startswith("modified ") and " -> " in modified
