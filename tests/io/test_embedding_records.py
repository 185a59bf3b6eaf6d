"""Embedding output records: bulkinfer rows, OpenAI embedding responses
(checked against vLLM's BatchRequestOutput and the openai SDK), base64, read
back for resume, and the Parquet column type."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from reference_types import check_embeddings_line, decode_base64

from bulkinfer.io.files import OutputColumns, jsonl_to_parquet
from bulkinfer.io.records import error_record, output_record, parse_output
from bulkinfer.prep.embeddings import parse_embed_row
from bulkinfer.schema import EMBEDDINGS_URL, Completion, RowError

# float32 values (exactly representable), as vLLM returns them
VECTORS = ([0.5, -0.25, 0.125], [1.0, 0.0, -0.0078125])


def completion(n: int) -> Completion:
    return Completion("0", "", "stop", prompt_tokens=7, completion_tokens=0, embeddings=VECTORS[:n])


def test_a_bulkinfer_row_has_id_embedding_prompt_tokens_and_its_fields() -> None:
    request = parse_embed_row({"id": "a", "text": "x", "lang": "en"}, 0, 1)
    record = output_record(request, completion(1), "all-minilm-l6-v2")
    assert record == {"lang": "en", "id": "a", "embedding": VECTORS[0], "prompt_tokens": 7}
    row = parse_output(record)
    assert row is not None and (row.id, row.prompt_tokens) == ("a", 7)


def line(body: dict) -> dict:
    return {"custom_id": "c1", "method": "POST", "url": EMBEDDINGS_URL, "body": body}


def test_an_openai_line_is_an_embedding_response_in_the_batch_envelope() -> None:
    request = parse_embed_row(line({"input": ["x", "y"], "model": "mine"}), 0, 1)
    record = orjson.loads(orjson.dumps(output_record(request, completion(2), "all-minilm-l6-v2")))
    parsed = check_embeddings_line(record)
    body = record["response"]["body"]
    assert (body["object"], body["model"], body["usage"]) == ("list", "mine", {"prompt_tokens": 7, "total_tokens": 7})
    assert [(d["object"], d["index"], d["embedding"]) for d in body["data"]] == [
        ("embedding", 0, VECTORS[0]),
        ("embedding", 1, VECTORS[1]),
    ]
    assert parsed.custom_id == "c1"
    row = parse_output(record)
    assert row is not None and (row.id, row.prompt_tokens) == ("c1", 7)


def test_a_base64_line_decodes_to_the_same_floats() -> None:
    request = parse_embed_row(line({"input": "x", "encoding_format": "base64"}), 0, 1)
    record = output_record(request, completion(1), "m")
    check_embeddings_line(record)
    encoded = record["response"]["body"]["data"][0]["embedding"]
    assert isinstance(encoded, str)
    assert decode_base64(encoded) == VECTORS[0]


def test_an_error_line_validates_too() -> None:
    record = error_record(RowError(3, "c1", "invalid_field", "field 'body.input': ...", True))
    check_embeddings_line(record)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def test_the_embedding_column_is_a_fixed_size_list_of_float32(tmp_path: Path) -> None:
    src = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {"id": "a", "embedding": VECTORS[0], "prompt_tokens": 3},
            {"id": "b", "embedding": VECTORS[1], "prompt_tokens": 4},
        ],
    )
    jsonl_to_parquet(src, tmp_path / "o.parquet", OutputColumns(("embedding",)))
    table = pq.read_table(tmp_path / "o.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 3)
    assert table.column("embedding").to_pylist() == list(VECTORS)
    matrix = table.column("embedding").combine_chunks().flatten().to_numpy().reshape(-1, 3)
    assert matrix.dtype.name == "float32" and matrix.shape == (2, 3)


def test_vectors_of_different_lengths_are_a_plain_list_and_other_outputs_are_untouched(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "s.jsonl", [{"id": "a", "embedding": [1.0]}, {"id": "b", "embedding": [1.0, 2.0]}])
    jsonl_to_parquet(src, tmp_path / "o.parquet", OutputColumns(("embedding",)))
    assert pq.read_schema(tmp_path / "o.parquet").field("embedding").type == pa.list_(pa.float32())
    jsonl_to_parquet(src, tmp_path / "p.parquet")
    assert pq.read_schema(tmp_path / "p.parquet").field("embedding").type == pa.list_(pa.float64())
