"""The structured-job samples: configs/classify.toml and configs/extract.toml load, every
row of sample_data/classify.jsonl and extract.jsonl becomes a request that carries the
config's constraint, and the rows, the prompts' instructions and the constraints agree."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest

from bench.structured_data import CLASSIFY_INSTRUCTION, EXTRACT_INSTRUCTION, LABELS
from bulkinfer.config import Settings, load_settings
from bulkinfer.prep.rows import to_request
from bulkinfer.schema import Request

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data"
CONFIGS = REPO / "configs"

EXTRACT_SCHEMA = {
    "type": "object",
    "required": ["language", "topic", "asks_for_code"],
    "additionalProperties": False,
    "properties": {
        "language": {
            "type": "string",
            "description": "The natural language the request is written in, named in English, e.g. English",
            "maxLength": 20,
        },
        "topic": {
            "type": "string",
            "description": "What the request is about, in English, in at most five words",
            "maxLength": 60,
        },
        "asks_for_code": {
            "type": "boolean",
            "description": "Whether the request asks for program code to be written, explained or fixed",
        },
    },
}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def requests(config: str, sample: str, chat_template: bool) -> tuple[Settings, list[Request]]:
    settings = dataclasses.replace(load_settings(CONFIGS / config), apply_chat_template=chat_template)
    rows = read_jsonl(SAMPLE / sample)
    return settings, [to_request(row, seq, seq + 1, settings) for seq, row in enumerate(rows)]


@pytest.mark.parametrize("chat_template", [True, False])
def test_every_classify_row_is_a_request_constrained_to_the_labels(chat_template: bool) -> None:
    settings, reqs = requests("classify.toml", "classify.jsonl", chat_template)
    assert settings.sampling.structured_outputs == {"choice": list(LABELS)}
    assert LABELS == ("coding", "writing", "math", "science", "business", "health", "education", "other")
    assert (settings.sampling.temperature, settings.sampling.max_tokens) == (0, 8)
    assert [r.id for r in reqs] == [f"classify-{n}" for n in range(1, 101)]
    for req in reqs:
        assert req.structured == {"choice": list(LABELS)}
        assert (req.temperature, req.max_tokens) == (0, 8)
        prompt = req.messages[0]["content"] if chat_template else req.prompt
        assert req.messages is None or req.messages == [{"role": "user", "content": prompt}]
        assert isinstance(prompt, str) and prompt.startswith(CLASSIFY_INSTRUCTION + "\n\nRequest:\n")
        assert list(req.passthrough) == ["source_id"] and req.passthrough["source_id"].startswith("sharegpt-")


@pytest.mark.parametrize("chat_template", [True, False])
def test_every_extract_row_is_a_request_constrained_to_the_schema(chat_template: bool) -> None:
    settings, reqs = requests("extract.toml", "extract.jsonl", chat_template)
    assert settings.sampling.structured_outputs == {"json": EXTRACT_SCHEMA}
    assert (settings.sampling.temperature, settings.sampling.max_tokens) == (0, 96)
    assert [r.id for r in reqs] == [f"extract-{n}" for n in range(1, 51)]
    for req in reqs:
        assert req.structured == {"json": EXTRACT_SCHEMA}
        prompt = req.messages[0]["content"] if req.messages else req.prompt
        assert isinstance(prompt, str) and prompt.startswith(EXTRACT_INSTRUCTION + "\n\nRequest:\n")


def test_the_extract_schema_keeps_what_the_instruction_asks_for() -> None:
    schema = EXTRACT_SCHEMA
    for key in schema["properties"]:
        assert f'"{key}"' in EXTRACT_INSTRUCTION
    jsonschema.validate({"language": "Korean", "topic": "book summary", "asks_for_code": False}, schema)
    for wrong in (
        {"language": "English", "topic": "regex", "asks_for_code": "yes"},
        {"language": "English", "topic": "regex"},
        {"language": "English", "topic": "regex", "asks_for_code": True, "confidence": 1},
        {"language": "English", "topic": "x" * 61, "asks_for_code": True},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_structured_rows_are_real_requests_found_in_no_other_sample() -> None:
    rows = read_jsonl(SAMPLE / "classify.jsonl") + read_jsonl(SAMPLE / "extract.jsonl")
    texts = [row["prompt"].split("\n\nRequest:\n", 1)[1] for row in rows]
    sources = [row["source_id"] for row in rows]
    assert len(set(texts)) == len(texts) == len(set(sources)) == 150
    assert all(20 <= len(t) <= 600 and t == t.strip() for t in texts)
    others = read_jsonl(SAMPLE / "sharegpt.jsonl") + read_jsonl(SAMPLE / "golden.jsonl")
    assert not set(sources) & {row["id"] for row in others}
    assert not set(texts) & {row["prompt"].strip() for row in others}
