"""Tests of bulkinfer.io.readers on small files written byte by byte."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import socket
import zipfile
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulkinfer.config import SamplingDefaults
from bulkinfer.errors import EXIT_INPUT, InputFileError
from bulkinfer.io.inputs import count_rows
from bulkinfer.io.readers import JsonlReader, ParquetReader, RawRow, open_reader
from bulkinfer.prep.rows import parse_row
from bulkinfer.schema import RowInvalid


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


def test_a_json_error_names_the_files_line_and_the_column(tmp_path: Path) -> None:
    rows, _ = read_all(jsonl(tmp_path, b'{"id": "a"}\n{"id": "b"}\n\n{"id": x}\n'))
    bad = rows[2]
    assert bad.line == 4 and bad.error is not None
    # orjson alone says "line 1 column 8": its position within the line
    assert bad.error.message.startswith("line 4, column 8: not valid JSON: unexpected character")
    assert "line 1" not in bad.error.message


def test_a_bad_line_in_a_file_read_whole_names_its_line(tmp_path: Path) -> None:
    from bulkinfer.io.records import read_records

    path = jsonl(tmp_path, b'{"id": "a"}\n\n{"id": "b"\n')
    with pytest.raises(InputFileError, match=r"line 3, column 11: not valid JSON: unexpected end of data") as info:
        list(read_records(path))
    assert info.value.exit_code == EXIT_INPUT


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
    from bulkinfer.io import readers

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
    from bulkinfer.io import readers

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


def test_a_parquet_list_of_strings_prompt_is_read_by_each_row(tmp_path: Path) -> None:
    """As a JSONL ``"prompt": ["one prompt"]``: one prompt is that prompt; more
    is that row's error, the rest of the file runs."""
    table = pa.table({"prompt": pa.array([["one"], ["a", "b"]], pa.list_(pa.string()))})
    rows = list(ParquetReader(write_parquet(tmp_path / "in.parquet", table)))
    assert parse_row(rows[0].data, seq=0, line=1, defaults=SamplingDefaults()).prompt == "one"
    with pytest.raises(RowInvalid, match="give each prompt its own row"):
        parse_row(rows[1].data, seq=1, line=2, defaults=SamplingDefaults())


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


def test_parquet_with_columns_reads_those_and_the_text_and_batch_columns_only(tmp_path: Path) -> None:
    table = pa.table({"id": ["a"], "prompt": ["x"], "max_tokens": [3], "big": ["y" * 1000], "other": [1.5]})
    path = write_parquet(tmp_path / "in.parquet", table)
    narrow = ParquetReader(path, columns={"id", "max_tokens", "custom_id"})
    assert sorted(narrow.columns) == ["id", "max_tokens", "prompt"]
    assert list(narrow)[0].data == {"id": "a", "prompt": "x", "max_tokens": 3}
    wide = open_reader(path)
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


# --- compressed JSONL -----------------------------------------------------------------------------

PLAIN = b'\xef\xbb\xbf{"id": "a", "prompt": "caf\xc3\xa9"}\r\n\n{"id": "b",}\n{"id": "c", "prompt": "x\xe2\x80\xa8y"}'


def zstd_bytes(data: bytes) -> bytes:
    return pa.compress(data, codec="zstd", asbytes=True)


def compressed(tmp_path: Path, name: str, data: bytes, codec: str) -> Path:
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if codec == "gzip" else zstd_bytes(data))
    return path


def triples(rows: list[RawRow]) -> list[tuple[int, object, str | None]]:
    return [(r.line, r.data, r.error.message if r.error else None) for r in rows]


@pytest.mark.parametrize(
    ("name", "codec"),
    [("in.jsonl.gz", "gzip"), ("in.ndjson.gz", "gzip"), ("in.jsonl.zst", "zstd"), ("in.JSONL.zstd", "zstd")],
)
def test_compressed_jsonl_reads_like_the_plain_file(tmp_path: Path, name: str, codec: str) -> None:
    plain_rows, plain_reader = read_all(jsonl(tmp_path, PLAIN))
    path = compressed(tmp_path, name, PLAIN, codec)
    reader = open_reader(path)
    assert isinstance(reader, JsonlReader) and reader.compression == codec
    rows = list(reader)
    assert triples(rows) == triples(plain_rows)
    assert [r.line for r in rows] == [1, 3, 4]
    assert rows[0].data == {"id": "a", "prompt": "café"}
    assert rows[2].data == {"id": "c", "prompt": "x\u2028y"}
    assert reader.blank_lines == plain_reader.blank_lines == 1


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_compression_is_found_by_magic_bytes_whatever_the_name(tmp_path: Path, codec: str) -> None:
    rows = list(open_reader(compressed(tmp_path, "in.jsonl", b'{"prompt": "a"}\n{"prompt": "b"}\n', codec)))
    assert [(r.line, r.data) for r in rows] == [(1, {"prompt": "a"}), (2, {"prompt": "b"})]


def test_plain_file_named_gz_is_read_as_plain(tmp_path: Path) -> None:
    rows = list(open_reader(jsonl(tmp_path, b'{"prompt": "a"}\n', name="in.jsonl.gz")))
    assert rows[0].data == {"prompt": "a"}


def test_multi_member_gzip_and_multi_frame_zstd(tmp_path: Path) -> None:
    one, two = b'{"id": 1}\n', b'{"id": 2}\n'
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(one) + gzip.compress(two))
    (tmp_path / "a.jsonl.zst").write_bytes(zstd_bytes(one) + zstd_bytes(two))
    for name in ("a.jsonl.gz", "a.jsonl.zst"):
        assert [r.data for r in open_reader(tmp_path / name)] == [{"id": 1}, {"id": 2}]


def zip_bytes(data: bytes, tmp_path: Path) -> bytes:
    archive = tmp_path / "archive.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("in.jsonl", data)
    return archive.read_bytes()


@pytest.mark.parametrize(
    ("name", "make", "named"),
    [
        ("in.jsonl.bz2", lambda data, _: bz2.compress(data), "bzip2-compressed"),
        ("in.jsonl", lambda data, _: bz2.compress(data), "bzip2-compressed"),
        ("in.jsonl.xz", lambda data, _: lzma.compress(data), "xz-compressed"),
        ("in.jsonl.zip", zip_bytes, "a zip archive"),
        ("in.jsonl.7z", lambda data, _: b"7z\xbc\xaf\x27\x1c\x00\x04" + data, "a 7z archive"),
        ("in.parquet.xz", lambda data, _: lzma.compress(data), "xz-compressed"),
    ],
)
def test_other_compressions_are_refused_by_name(tmp_path: Path, name: str, make, named: str) -> None:
    path = tmp_path / name
    path.write_bytes(make(b'{"prompt": "a"}\n', tmp_path))
    with pytest.raises(InputFileError) as info:
        open_reader(path)
    message = str(info.value)
    assert message.startswith(f"{path} is {named}; ")
    assert "gzip or zstd" in message
    assert info.value.exit_code == EXIT_INPUT
    with pytest.raises(InputFileError, match=named):
        JsonlReader(path)  # the readers check it too, not only open_reader


@pytest.mark.parametrize(("codec", "command"), [("gzip", "gunzip -k"), ("zstd", "zstd -d")])
def test_compressed_parquet_is_refused(tmp_path: Path, codec: str, command: str) -> None:
    plain = write_parquet(tmp_path / "in.parquet", pa.table({"prompt": ["a"]}))
    path = compressed(tmp_path, "in.parquet" + (".gz" if codec == "gzip" else ".zst"), plain.read_bytes(), codec)
    with pytest.raises(InputFileError) as info:
        open_reader(path)
    assert f"is a {codec}-compressed Parquet file" in str(info.value)
    assert f"decompress it first ({command})" in str(info.value)
    assert count_rows(path) is None


def numbered_lines(n: int) -> bytes:
    return b"".join(b'{"id": "r%d", "prompt": "prompt number %d"}\n' % (i, i) for i in range(n))


def test_truncated_gzip_keeps_the_rows_read_and_ends_with_one_row_error(tmp_path: Path) -> None:
    data = numbered_lines(5000)
    whole = gzip.compress(data)
    cut = whole[: len(whole) // 2]
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(cut)
    complete = zlib.decompressobj(wbits=31).decompress(cut).count(b"\n")  # lines fully inside the cut
    assert 0 < complete < 5000
    rows = list(open_reader(path))
    assert len(rows) == complete + 1
    assert [r.data["id"] for r in rows[:-1]] == [f"r{i}" for i in range(complete)]
    assert all(r.error is None for r in rows[:-1])
    last = rows[-1]
    assert last.line == complete + 1 and last.data is None
    assert last.error is not None and last.error.type == "invalid_row"
    assert f"gzip stream of in.jsonl.gz is corrupt or truncated at line {complete + 1}" in last.error.message
    assert f"the {complete} lines before it were read" in last.error.message
    assert count_rows(path) is None


def test_gzip_without_its_trailer_gives_every_row_then_the_error(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(gzip.compress(numbered_lines(10))[:-8])  # CRC and size missing
    rows = list(open_reader(path))
    assert [r.line for r in rows] == list(range(1, 12))
    assert rows[9].data == {"id": "r9", "prompt": "prompt number 9"}
    assert rows[10].error is not None and "truncated at line 11" in rows[10].error.message


def test_corrupt_gzip_crc_is_reported_after_the_rows(tmp_path: Path) -> None:
    data = bytearray(gzip.compress(numbered_lines(10)))
    data[-6] ^= 0xFF  # the CRC-32 in the trailer
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(bytes(data))
    rows = list(open_reader(path))
    assert len(rows) == 11 and rows[10].line == 11
    assert rows[10].error is not None and "CRC" in rows[10].error.message


def test_truncated_zstd_keeps_the_rows_read_and_ends_with_one_row_error(tmp_path: Path) -> None:
    data = numbered_lines(40000)  # about 1.7 MB: many zstd blocks
    whole = zstd_bytes(data)
    path = tmp_path / "in.jsonl.zst"
    path.write_bytes(whole[: len(whole) // 2])
    rows = list(open_reader(path))
    read = len(rows) - 1
    assert 1000 < read < 40000
    assert [r.data["id"] for r in rows[:-1]] == [f"r{i}" for i in range(read)]
    assert rows[-1].line == read + 1
    assert rows[-1].error is not None
    assert f"zstd stream of in.jsonl.zst is corrupt or truncated at line {read + 1}" in rows[-1].error.message


@pytest.mark.parametrize(
    ("name", "data", "codec"),
    [
        ("in.jsonl.gz", b"\x1f\x8b", "gzip"),
        ("in.jsonl.gz", b"\x1f\x8b\x08\x00" + b"not really gzip" * 4, "gzip"),
        ("in.jsonl.zst", b"\x28\xb5\x2f\xfd" + b"not really zstd" * 4, "zstd"),
    ],
)
def test_stream_broken_from_the_start_is_an_input_error(tmp_path: Path, name: str, data: bytes, codec: str) -> None:
    path = jsonl(tmp_path, data, name=name)
    with pytest.raises(InputFileError, match=f"not a readable {codec} stream"):
        open_reader(path)


def test_empty_compressed_file_has_no_rows(tmp_path: Path) -> None:
    assert list(open_reader(compressed(tmp_path, "in.jsonl.gz", b"", "gzip"))) == []
    assert list(open_reader(compressed(tmp_path, "in.jsonl.zst", b"", "zstd"))) == []


def test_unknown_extension_under_a_compression_suffix(tmp_path: Path) -> None:
    path = compressed(tmp_path, "in.csv.gz", b"a,b\n", "gzip")
    with pytest.raises(InputFileError, match=r"unknown input format '\.csv'"):
        open_reader(path)


def test_oversized_line_in_a_compressed_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer.io import readers

    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 32)
    line = b'{"prompt": "' + b"x" * 5000 + b'"}\n'
    rows = list(open_reader(compressed(tmp_path, "in.jsonl.gz", line + b'{"prompt": "y"}\n', "gzip")))
    assert rows[0].error is not None and f"line is {len(line)} bytes" in rows[0].error.message
    assert (rows[1].line, rows[1].data) == (2, {"prompt": "y"})


# --- Parquet text columns -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "stored"),
    [
        (lambda values: pa.array(values).dictionary_encode(), pa.dictionary(pa.int32(), pa.string())),
        # pyarrow reads a dictionary of large_string back as a dictionary of string
        (
            lambda values: pa.array(values, pa.large_string()).dictionary_encode(),
            pa.dictionary(pa.int32(), pa.string()),
        ),
        (lambda values: pa.array(values, pa.string_view()), pa.string_view()),
        (lambda values: pa.array(values, pa.large_string()), pa.large_string()),
    ],
    ids=["dictionary", "dictionary-large", "string_view", "large_string"],
)
def test_parquet_text_column_types_read_as_str(tmp_path: Path, make, stored: pa.DataType) -> None:
    table = pa.table(
        {
            "id": make(["a", "b", "c"]),
            "prompt": make(["same", "other", "same"]),
            "lang": make(["en", None, "en"]),
        }
    )
    path = write_parquet(tmp_path / "in.parquet", table)
    assert pq.ParquetFile(path).schema_arrow.field("prompt").type == stored  # the type the reader meets
    rows = list(open_reader(path))
    assert [r.data for r in rows] == [
        {"id": "a", "prompt": "same", "lang": "en"},
        {"id": "b", "prompt": "other", "lang": None},
        {"id": "c", "prompt": "same", "lang": "en"},
    ]
    assert all(type(r.data[k]) is str for r in rows for k in ("id", "prompt"))
    request = parse_row(rows[1].data, 1, rows[1].line, SamplingDefaults())
    assert (request.id, request.prompt, request.passthrough) == ("b", "other", {"lang": None})


# --- not a regular file ---------------------------------------------------------------------------


def test_directory_input(tmp_path: Path) -> None:
    folder = tmp_path / "data.jsonl"
    folder.mkdir()
    with pytest.raises(InputFileError) as info:
        open_reader(folder)
    assert str(info.value) == f"{folder} is a directory; give a .jsonl or .parquet file"
    assert info.value.exit_code == EXIT_INPUT
    assert count_rows(folder) is None


def test_fifo_input_is_refused_without_opening_it(tmp_path: Path) -> None:
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)  # opening it for reading would block: these calls must return at once
    for attempt in (open_reader, JsonlReader, ParquetReader):
        with pytest.raises(InputFileError) as info:
            attempt(fifo)
        assert str(info.value).startswith(f"{fifo} is a named pipe (FIFO), not a regular file: ")
        assert "more than once (row count, --resume)" in str(info.value)
        assert "or stream JSONL rows into `bulkinfer run -`" in str(info.value)
    assert count_rows(fifo) is None


def test_socket_and_device_inputs(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(InputFileError, match="is a socket, not a regular file"):
            open_reader(path)
    if os.path.exists(os.devnull):
        with pytest.raises(InputFileError, match="is a character device, not a regular file"):
            open_reader(Path(os.devnull))


def test_missing_input(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl.gz"
    with pytest.raises(InputFileError) as info:
        open_reader(path)
    assert str(info.value) == f"input file not found: {path}"
    assert count_rows(path) is None


def test_unreadable_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer.io import inputs

    path = jsonl(tmp_path, b'{"prompt": "a"}\n')

    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(inputs, "open", denied, raising=False)  # root may read a chmod 000 file
    with pytest.raises(InputFileError, match="permission denied") as info:
        open_reader(path)
    assert info.value.exit_code == EXIT_INPUT


# --- count_rows -----------------------------------------------------------------------------------


def test_count_rows(tmp_path: Path) -> None:
    data = b'{"id": 1}\n\n{"id": 2}\n{"id": 3}'  # blank line counted; last line without newline
    assert count_rows(jsonl(tmp_path, data)) == 4
    assert count_rows(jsonl(tmp_path, data + b"\n", name="nl.jsonl")) == 4
    assert count_rows(jsonl(tmp_path, b"", name="empty.jsonl")) == 0
    assert count_rows(compressed(tmp_path, "in.jsonl.gz", data, "gzip")) == 4
    assert count_rows(compressed(tmp_path, "in.jsonl.zst", data, "zstd")) == 4
    assert count_rows(compressed(tmp_path, "gz.jsonl", data, "gzip")) == 4
    table = pa.table({"prompt": [f"p{i}" for i in range(25)]})
    assert count_rows(write_parquet(tmp_path / "in.parquet", table, row_group_size=10)) == 25
    assert count_rows(jsonl(tmp_path, b"not parquet", name="bad.parquet")) is None
