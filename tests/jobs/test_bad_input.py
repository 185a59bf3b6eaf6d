"""Bad input, one fixture per case: where each row ends up (output or error
record, with its line number and error type), and that outputs + errors +
skipped blank lines cover every input line exactly once.

The runs go through the real reader, parser, tokenizer and planner; the engine
is the fake one (what is tested is the routing of rows, not inference).
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fakes import FakeEngine
from vllm.entrypoints.launchers.run_batch import BatchRequestOutput

from bulkinfer.config import load_settings
from bulkinfer.errors import EXIT_OK, EXIT_PARTIAL, InputFileError
from bulkinfer.io import readers
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run


def good(i: int) -> bytes:
    return orjson.dumps({"id": f"g{i}", "prompt": "hello there"})


# name -> (the bad line's bytes, its error type or None when the row must succeed)
CASES: dict[str, tuple[bytes, str | None]] = {
    "malformed_json": (b'{"id": "x", "prompt": ', "invalid_json"),
    "not_an_object": (b"[1, 2, 3]", "invalid_row"),
    "invalid_utf8": (b'{"id": "x", "prompt": "caf\xe9"}', "invalid_json"),
    "line_separators_in_string": ('{"id": "x", "prompt": "a\u2028b\u0085c"}'.encode(), None),
    "missing_prompt": (b'{"id": "x"}', "missing_field"),
    "null_prompt": (b'{"id": "x", "prompt": null}', "missing_field"),
    "empty_prompt": (b'{"id": "x", "prompt": ""}', "invalid_field"),
    "non_string_prompt": (b'{"id": "x", "prompt": 42}', "invalid_field"),
    "empty_messages": (b'{"id": "x", "messages": []}', "invalid_field"),
    "bad_role": (b'{"id": "x", "messages": [{"role": "wizard", "content": "hi"}]}', "invalid_field"),
    "bad_content": (b'{"id": "x", "messages": [{"role": "user", "content": 7}]}', "invalid_field"),
    "max_tokens_text": (b'{"id": "x", "prompt": "hi", "max_tokens": "lots"}', "invalid_field"),
    "max_tokens_zero": (b'{"id": "x", "prompt": "hi", "max_tokens": 0}', "invalid_field"),
    "temperature_out_of_range": (b'{"id": "x", "prompt": "hi", "temperature": 9}', "invalid_field"),
    "top_p_out_of_range": (b'{"id": "x", "prompt": "hi", "top_p": 0}', "invalid_field"),
    "too_long_for_context": (b'{"id": "x", "prompt": "hi", "max_tokens": 2048}', "context_length_exceeded"),
    "duplicate_id": (b'{"id": "g0", "prompt": "again"}', "duplicate_id"),
}


def run_file(tmp_path: Path, data: bytes, name: str = "in.jsonl") -> tuple[RunPaths, int, list, list]:  # type: ignore[type-arg]
    src = tmp_path / name
    src.write_bytes(data)
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    result = run(paths, load_settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    outputs = [orjson.loads(line) for line in paths.output.read_bytes().splitlines()]
    errors = [orjson.loads(line) for line in paths.errors.read_bytes().splitlines()]
    counts = result.report["request_counts"]
    assert counts["completed"] == len(outputs) and counts["failed"] == len(errors)
    assert counts["total"] == counts["completed"] + counts["failed"] + counts["skipped"]
    return paths, result.exit_code, outputs, errors


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_row_becomes_one_error_record(tmp_path: Path, case: str) -> None:
    bad, error_type = CASES[case]
    lines = [good(0), good(1), bad, good(2)]  # the bad row is line 3
    _, code, outputs, errors = run_file(tmp_path, b"\n".join(lines) + b"\n")
    assert len(outputs) + len(errors) == 4
    if error_type is None:
        assert code == EXIT_OK and errors == []
        return
    assert code == EXIT_PARTIAL
    assert sorted(o["id"] for o in outputs) == ["g0", "g1", "g2"]
    assert len(errors) == 1
    assert errors[0]["line"] == 3
    assert errors[0]["error"]["type"] == error_type


def test_context_error_gives_both_token_counts(tmp_path: Path) -> None:
    lines = [good(0), CASES["too_long_for_context"][0]]
    _, _, _, errors = run_file(tmp_path, b"\n".join(lines) + b"\n")
    message = errors[0]["error"]["message"]
    assert "max_tokens is 2048" in message and "context of 2048 tokens" in message
    assert "prompt is " in message


def test_bom_crlf_blank_lines_and_no_final_newline(tmp_path: Path) -> None:
    data = b"\xef\xbb\xbf" + good(0) + b"\r\n\r\n   \r\n" + good(1) + b"\r\n\t\n" + good(2)
    _, code, outputs, errors = run_file(tmp_path, data)
    assert code == EXIT_OK and errors == []
    assert sorted(o["id"] for o in outputs) == ["g0", "g1", "g2"]


def test_blank_lines_are_counted_as_skipped(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(good(0) + b"\n\n  \n" + good(1) + b"\n")
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    result = run(paths, load_settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    assert result.report["request_counts"] == {"total": 4, "completed": 2, "failed": 0, "skipped": 2}


def test_line_over_the_limit_is_a_row_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 200)
    long_row = orjson.dumps({"id": "long", "prompt": "x" * 500})
    _, _, outputs, errors = run_file(tmp_path, b"\n".join([good(0), long_row, good(1)]) + b"\n")
    assert [o["id"] for o in outputs] == ["g0", "g1"] or sorted(o["id"] for o in outputs) == ["g0", "g1"]
    assert [(e["line"], e["error"]["type"]) for e in errors] == [(2, "invalid_row")]
    assert "over the limit" in errors[0]["error"]["message"]


def test_openai_error_records_have_the_batch_shape(tmp_path: Path) -> None:
    ok = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}]},
    }
    bad = {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"max_tokens": 3}}
    _, _, outputs, errors = run_file(tmp_path, orjson.dumps(ok) + b"\n" + orjson.dumps(bad) + b"\n")
    assert outputs[0]["custom_id"] == "a" and outputs[0]["response"]["status_code"] == 200
    assert errors[0]["custom_id"] == "b" and errors[0]["response"] is None
    assert errors[0]["error"]["code"] == "missing_field" and errors[0]["line"] == 2


def never_engine(model: str, settings: object) -> FakeEngine:
    raise AssertionError("the engine must not start for an unreadable input")


def test_parquet_without_prompt_column_fails_before_the_model(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": ["hi"]}), src)
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    with pytest.raises(InputFileError, match="columns found: id, text"):
        run(paths, load_settings(), RunContext(engine_factory=never_engine))
    assert not paths.output.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("damage", ["truncated", "not_parquet"])
def test_unreadable_parquet_fails_cleanly(tmp_path: Path, damage: str) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["hi", "yo"]}), src)
    src.write_bytes(src.read_bytes()[:-30] if damage == "truncated" else b"id,prompt\na,hi\n")
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    with pytest.raises(InputFileError, match="not a readable Parquet file"):
        run(paths, load_settings(), RunContext(engine_factory=never_engine))
    assert not paths.output.exists() and not list(tmp_path.glob(".out*"))


def test_parquet_rows_route_by_row_number(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    table = pa.table({"id": ["a", "b", "c", "d"], "prompt": ["hi", "", "yo", "hey"], "max_tokens": [4, 4, 4, 0]})
    pq.write_table(table, src, row_group_size=2)
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    run(paths, load_settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    errors = [orjson.loads(line) for line in paths.errors.read_bytes().splitlines()]
    assert sorted((e["line"], e["id"], e["error"]["type"]) for e in errors) == [
        (2, "b", "invalid_field"),
        (4, "d", "invalid_field"),
    ]


def test_an_undecodable_line_keeps_its_readable_id(tmp_path: Path) -> None:
    """The id (or custom_id) of an undecodable line is read from its bytes, so
    results can still be reconciled by id; the record says it was recovered."""
    openai_line = b'{"custom_id": "req-9", "method": "POST", "url": "/v1/chat/completions", "body": {"x": "\xff"}}'
    lines = [good(0), CASES["invalid_utf8"][0], b'{"prompt": "no id \xff"}', openai_line, CASES["malformed_json"][0]]
    _, code, outputs, errors = run_file(tmp_path, b"\n".join(lines) + b"\n")
    assert code == EXIT_PARTIAL and [o["id"] for o in outputs] == ["g0"]
    by_line = {e["line"]: e for e in errors}
    assert (by_line[2]["id"], by_line[2]["id_recovered"]) == ("x", True)
    assert "not valid UTF-8" in by_line[2]["error"]["message"]
    assert by_line[3]["id"] is None and "id_recovered" not in by_line[3]
    assert (by_line[4]["custom_id"], by_line[4]["id_recovered"], by_line[4]["response"]) == ("req-9", True, None)
    assert by_line[4]["error"]["code"] == "invalid_json"
    assert (by_line[5]["id"], by_line[5]["id_recovered"]) == ("x", True)  # truncated JSON: the id is still there


def test_an_id_names_one_record_across_the_output_and_errors_files(tmp_path: Path) -> None:
    """A row with bad fields keeps its id, so a later row of that id is a
    duplicate (one record per id for a join of both files), a line number
    taken as a default id included; an id guessed from a line that is not
    JSON claims nothing."""
    lines = [
        good(0),
        b'{"id": "c", "prompt": "hi", "max_tokens": 0}',
        b'{"id": "c", "prompt": "fixed"}',
        b'{"prompt": ""}',  # default id "4"
        b'{"id": 4, "prompt": "a number"}',
        CASES["invalid_utf8"][0],  # id "x", recovered
        b'{"id": "x", "prompt": "hi"}',
    ]
    _, code, outputs, errors = run_file(tmp_path, b"\n".join(lines) + b"\n")
    assert code == EXIT_PARTIAL and sorted(o["id"] for o in outputs) == ["g0", "x"]
    assert sorted((e["line"], e["id"], e["error"]["type"]) for e in errors) == [
        (2, "c", "invalid_field"),
        (3, "c", "duplicate_id"),
        (4, "4", "invalid_field"),
        (5, "4", "duplicate_id"),
        (6, "x", "invalid_json"),
    ]


def test_a_recovered_openai_error_record_is_a_valid_vllm_batch_output() -> None:
    """Checked against vLLM's own pydantic record, not our reading of the format."""
    from bulkinfer.io.records import error_record
    from bulkinfer.schema import RowError

    record = error_record(RowError(3, "req-9", "invalid_json", "line is not valid UTF-8", True, True))
    parsed = BatchRequestOutput.model_validate(record)
    assert (parsed.custom_id, parsed.response, parsed.error) == ("req-9", None, record["error"])
