"""Tests of bulkinfer.readers on small files written byte by byte."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulkinfer.config import SamplingDefaults
from bulkinfer.errors import EXIT_INPUT, InputFileError
from bulkinfer.readers import JsonlReader, ParquetReader, RawRow, open_reader
from bulkinfer.rows import RowInvalid, parse_row


def jsonl(tmp_path: Path, data: bytes, name: str = "in.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def read_all(path: Path) -> tuple[list[RawRow], JsonlReader]:
    reader = JsonlReader(path)
    return list(reader), reader


# --- JSONL ----------------------------------------------------------------------------------------


def test_bom_on_first_line_is_accepted(tmp_path: Path) -> None:
    rows, _ = read_all(jsonl(tmp_path, b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "b"}\n'))
    assert [(r.line, r.data, r.error) for r in rows] == [(1, {"prompt": "a"}, None), (2, {"prompt": "b"}, None)]


def test_bom_on_a_later_line_is_an_error(tmp_path: Path) -> None:
    rows, _ = read_all(jsonl(tmp_path, b'{"prompt": "a"}\n\xef\xbb\xbf{"prompt": "b"}\n'))
    assert rows[0].data == {"prompt": "a"}
    assert rows[1].line == 2
    assert rows[1].error is not None and rows[1].error.type == "invalid_json"


def test_crlf_and_last_line_without_newline(tmp_path: Path) -> None:
    rows, reader = read_all(jsonl(tmp_path, b'{"id": 1}\r\n{"id": 2}\r\n{"id": 3}'))
    assert [(r.line, r.data) for r in rows] == [(1, {"id": 1}), (2, {"id": 2}), (3, {"id": 3})]
    assert all(r.error is None for r in rows)
    assert reader.blank_lines == 0


def test_blank_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    data = b'\n{"id": "a"}\n\n   \t \n{"id": "b"}\r\n\r\n{"id": "c"}\n\n'
    rows, reader = read_all(jsonl(tmp_path, data))
    assert [(r.line, r.data["id"]) for r in rows] == [(2, "a"), (5, "b"), (7, "c")]
    assert reader.blank_lines == 5


def test_malformed_json_is_a_row_error_with_its_line(tmp_path: Path) -> None:
    rows, _ = read_all(jsonl(tmp_path, b'{"id": "a"}\n{"id": "b",}\n{"id": \n{"id": "d"}\n'))
    assert [r.line for r in rows] == [1, 2, 3, 4]
    assert rows[0].data == {"id": "a"} and rows[3].data == {"id": "d"}
    for bad in rows[1:3]:
        assert bad.data is None
        assert isinstance(bad.error, RowInvalid)
        assert bad.error.type == "invalid_json"
        assert "not valid JSON" in bad.error.message
    error = rows[1].error.to_error(rows[1].line)
    assert (error.line, error.type) == (2, "invalid_json")


def test_invalid_utf8_is_invalid_json_naming_utf8(tmp_path: Path) -> None:
    rows, _ = read_all(jsonl(tmp_path, b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n{"prompt": "fine"}\n'))
    assert rows[0].data == {"prompt": "ok"}
    assert rows[1].line == 2
    assert rows[1].error is not None
    assert rows[1].error.type == "invalid_json"
    assert "UTF-8" in rows[1].error.message
    assert rows[2].data == {"prompt": "fine"}


def test_unicode_line_separators_stay_in_one_row(tmp_path: Path) -> None:
    text = "a\u2028b\u0085c\u2029d"
    data = ('{"prompt": "' + text + '"}\n{"prompt": "next"}\n').encode()
    rows, _ = read_all(jsonl(tmp_path, data))
    assert len(rows) == 2
    assert rows[0].data == {"prompt": text}
    assert rows[1].line == 2 and rows[1].data == {"prompt": "next"}


def test_array_line_is_data_and_parse_row_rejects_it(tmp_path: Path) -> None:
    rows, _ = read_all(jsonl(tmp_path, b'[1, 2, 3]\n"just text"\n'))
    assert rows[0].data == [1, 2, 3] and rows[0].error is None
    assert rows[1].data == "just text"
    with pytest.raises(RowInvalid) as info:
        parse_row(rows[0].data, 0, rows[0].line, SamplingDefaults())
    assert info.value.type == "invalid_row"


def test_oversized_line_is_a_row_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer import readers

    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 32)
    rows, _ = read_all(jsonl(tmp_path, b'{"prompt": "' + b"x" * 100 + b'"}\n{"prompt": "y"}\n'))
    assert rows[0].error is not None and rows[0].error.type == "invalid_row"
    assert "32" in rows[0].error.message
    assert rows[1].data == {"prompt": "y"}


def test_ndjson_suffix_and_missing_file(tmp_path: Path) -> None:
    path = jsonl(tmp_path, b'{"prompt": "a"}\n', name="in.NDJSON")
    assert isinstance(open_reader(path), JsonlReader)
    with pytest.raises(InputFileError, match="not found") as info:
        open_reader(tmp_path / "absent.jsonl")
    assert info.value.exit_code == EXIT_INPUT
    with pytest.raises(InputFileError, match="not found"):
        open_reader(tmp_path / "absent.parquet")


def test_unknown_extension(tmp_path: Path) -> None:
    path = jsonl(tmp_path, b'{"prompt": "a"}\n', name="in.csv")
    with pytest.raises(InputFileError, match=r"\.csv"):
        open_reader(path)


# --- Parquet --------------------------------------------------------------------------------------


def write_parquet(path: Path, table: pa.Table, row_group_size: int | None = None) -> Path:
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def test_parquet_rows_across_row_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer import readers

    monkeypatch.setattr(readers, "PARQUET_BATCH_ROWS", 2)  # several batches per row group too
    table = pa.table(
        {"id": [f"r{i}" for i in range(10)], "prompt": [f"p{i}" for i in range(10)], "lang": ["en", "fr"] * 5}
    )
    path = write_parquet(tmp_path / "in.parquet", table, row_group_size=3)
    assert pq.ParquetFile(path).num_row_groups == 4
    reader = open_reader(path)
    assert isinstance(reader, ParquetReader)
    rows = list(reader)
    assert [r.line for r in rows] == list(range(1, 11))
    assert rows[0].data == {"id": "r0", "prompt": "p0", "lang": "en"}
    assert rows[9].data == {"id": "r9", "prompt": "p9", "lang": "fr"}
    assert all(r.error is None for r in rows)
    assert reader.blank_lines == 0


def test_parquet_null_id_defaults_to_row_number(tmp_path: Path) -> None:
    table = pa.table({"id": ["a", None], "prompt": ["x", "y"], "max_tokens": pa.array([5, None], pa.int64())})
    rows = list(ParquetReader(write_parquet(tmp_path / "in.parquet", table)))
    second = parse_row(rows[1].data, 1, rows[1].line, SamplingDefaults(max_tokens=77))
    assert second.id == "2"
    assert second.max_tokens == 77
    assert parse_row(rows[0].data, 0, rows[0].line, SamplingDefaults()).max_tokens == 5


def test_parquet_messages_column(tmp_path: Path) -> None:
    messages = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
    ]
    table = pa.table({"messages": messages})
    rows = list(ParquetReader(write_parquet(tmp_path / "in.parquet", table)))
    assert rows[1].data == {"messages": messages[1]}
    assert parse_row(rows[1].data, 1, 2, SamplingDefaults()).messages == messages[1]


def test_parquet_without_prompt_column_names_the_columns(tmp_path: Path) -> None:
    table = pa.table({"text": ["a"], "label": [1]})
    with pytest.raises(InputFileError) as info:
        ParquetReader(write_parquet(tmp_path / "in.parquet", table))
    assert "text" in str(info.value) and "label" in str(info.value)
    assert "prompt" in str(info.value)


def test_parquet_openai_columns_are_enough(tmp_path: Path) -> None:
    table = pa.table({"custom_id": ["c1"], "body": [{"prompt": "hi"}], "url": ["/v1/completions"]})
    rows = list(ParquetReader(write_parquet(tmp_path / "in.parquet", table)))
    assert rows[0].data["custom_id"] == "c1"


def test_parquet_int_prompt_column(tmp_path: Path) -> None:
    table = pa.table({"prompt": pa.array([1, 2], pa.int64())})
    with pytest.raises(InputFileError, match="prompt.*int64"):
        ParquetReader(write_parquet(tmp_path / "in.parquet", table))


def test_parquet_large_string_prompt_is_accepted(tmp_path: Path) -> None:
    table = pa.table({"prompt": pa.array(["a", "b"], pa.large_string())})
    rows = list(ParquetReader(write_parquet(tmp_path / "in.parquet", table)))
    assert [r.data["prompt"] for r in rows] == ["a", "b"]


def test_truncated_parquet(tmp_path: Path) -> None:
    table = pa.table({"prompt": [f"prompt {i}" for i in range(100)]})
    good = write_parquet(tmp_path / "good.parquet", table)
    data = good.read_bytes()
    for cut in (len(data) - 10, len(data) // 2, 4):
        bad = tmp_path / "bad.parquet"
        bad.write_bytes(data[:cut])
        with pytest.raises(InputFileError, match="bad.parquet"):
            ParquetReader(bad)


def test_non_parquet_file(tmp_path: Path) -> None:
    path = jsonl(tmp_path, b'{"prompt": "a"}\n', name="in.parquet")
    with pytest.raises(InputFileError, match="not a readable Parquet file"):
        open_reader(path)
    empty = jsonl(tmp_path, b"", name="empty.parquet")
    with pytest.raises(InputFileError):
        open_reader(empty)


def test_parquet_passthrough_false_reads_needed_columns_only(tmp_path: Path) -> None:
    table = pa.table({"id": ["a"], "prompt": ["x"], "max_tokens": [3], "big": ["y" * 1000], "other": [1.5]})
    path = write_parquet(tmp_path / "in.parquet", table)
    narrow = ParquetReader(path, passthrough=False)
    assert sorted(narrow.columns) == ["id", "max_tokens", "prompt"]
    assert list(narrow)[0].data == {"id": "a", "prompt": "x", "max_tokens": 3}
    wide = open_reader(path, passthrough=True)
    assert list(wide)[0].data == {"id": "a", "prompt": "x", "max_tokens": 3, "big": "y" * 1000, "other": 1.5}


def test_parquet_corrupt_row_group_gives_one_error_per_row(tmp_path: Path) -> None:
    table = pa.table({"prompt": [f"prompt number {i}" for i in range(30)]})
    path = tmp_path / "in.parquet"
    pq.write_table(table, path, row_group_size=10, use_dictionary=False)
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    start = chunk.data_page_offset
    data[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(data))  # the footer is intact: the file opens, row group 1 does not decode
    rows = list(ParquetReader(path))
    assert [r.line for r in rows] == list(range(1, 31))
    assert [r.data["prompt"] for r in rows[:10]] == [f"prompt number {i}" for i in range(10)]
    assert [r.data["prompt"] for r in rows[20:]] == [f"prompt number {i}" for i in range(20, 30)]
    for r in rows[10:20]:
        assert r.data is None
        assert r.error is not None and r.error.type == "invalid_row"
        assert "row group 1" in r.error.message
