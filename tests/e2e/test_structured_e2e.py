"""End to end (issue 12): structured output, n choices, log-probabilities and
priority through the Python API on the session's shared engine (the real
vLLM engine and default model); unsupported OpenAI fields end as error
records. (That a row's ``priority`` turns on vLLM's priority scheduling is
checked on test_e2e.py's CLI run, whose engine starts for it.)"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from e2e_helpers import read_jsonl, write_jsonl
from reference_types import check_openai_line

import bulkinfer as api
from bulkinfer.engine import logprob_ranks

pytestmark = pytest.mark.e2e

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = ["Ana, 34, lives in Lisbon", "Kenji is 51 and lives in Osaka", "Meet Olu (27) from Lagos"]
LABELS = ["positive", "negative", "neutral"]
REVIEWS = ["I loved this phone!", "Terrible service, never again.", "The box was brown.", "Great value."]
YEAR = r"(19|20)[0-9]{2}"
EVERY_FIELD = {
    "max_tokens": 6,
    "temperature": 0.8,
    "top_p": 0.9,
    "seed": 5,
    "stop": ["\n\n"],
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
    "top_k": 20,
    "min_p": 0.05,
    "min_tokens": 2,
    "stop_token_ids": [2],
    "logit_bias": {"42": -100},
    "priority": 1,
}


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {"messages": messages, **body}}


@pytest.fixture(scope="module")
def structured(tmp_path_factory: pytest.TempPathFactory, shared_engine: Any) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("structured")
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    rows: list[Any] = [
        *(
            chat_line(
                f"person-{i}", f"Extract the person as JSON: {text}", max_tokens=128, response_format=schema_format
            )
            for i, text in enumerate(PEOPLE)
        ),
        *(
            {"id": f"label-{i}", "prompt": f"Sentiment of: {text}", "structured_outputs": {"choice": LABELS}}
            for i, text in enumerate(REVIEWS)
        ),
        *(
            {"id": f"year-{i}", "prompt": q, "structured_outputs": {"regex": YEAR}, "max_tokens": 8}
            for i, q in enumerate(["When did World War 2 end?", "When did the Berlin Wall fall?"])
        ),
        # n = 3 with a seed, twice: the same three choices
        *({"id": f"n3-{k}", "prompt": "Name a colour.", "n": 3, "seed": 7, "max_tokens": 6} for k in "ab"),
        chat_line("lp-chat", "Say hello.", max_tokens=5, logprobs=True, top_logprobs=2),
        {
            "custom_id": "lp-cmpl",
            "url": COMPLETIONS,
            "body": {"prompt": "The capital of France is", "max_tokens": 4, "logprobs": 2},
        },
        {"id": "lp-row", "prompt": "Say hi.", "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "priority": -1},
        # every other field at once, as a bulkinfer row and in an OpenAI body: they run
        {"id": "every-field", "prompt": "Say hi.", **EVERY_FIELD},
        chat_line("every-field-openai", "Say hi.", **EVERY_FIELD, user="u", metadata={"k": "v"}, store=False),
        chat_line("tools", "What is the weather?", tools=[{"type": "function", "function": {"name": "weather"}}]),
        chat_line("stream", "Hello", stream="True"),
        {"custom_id": "bad-url", "method": "POST", "url": "/bad_url", "body": {"messages": []}},
    ]
    src = tmp / "structured.jsonl"
    write_jsonl(src, rows)
    out = tmp / "out.jsonl"
    result = api.run(src, out, engine=shared_engine, temperature=0.7, max_tokens=16, progress_plain=True)
    outputs = read_jsonl(out) if out.exists() else []
    by_id = {r.get("custom_id", r.get("id")): r for r in outputs}
    errors = {r.get("custom_id", r.get("id")): r for r in read_jsonl(out.with_name("out.errors.jsonl"))}
    report = json.loads(out.with_name("out.report.json").read_text())
    return {"result": result, "by_id": by_id, "errors": errors, "report": report, "outputs": outputs}


def body(record: dict[str, Any]) -> dict[str, Any]:
    return record["response"]["body"]


def test_the_run_finishes_with_the_unsupported_lines_as_errors(structured: dict[str, Any]) -> None:
    assert structured["result"].exit_code == 3
    errors = structured["errors"]
    assert set(errors) == {"tools", "stream", "bad-url"}
    assert (
        errors["tools"]["error"]["code"] == "unsupported_field" and "body.tools" in errors["tools"]["error"]["message"]
    )
    assert errors["stream"]["error"]["code"] == "unsupported_field"
    assert len(structured["outputs"]) == 16  # 19 rows, 3 of them errors


def test_json_schema_rows_parse_and_validate(structured: dict[str, Any]) -> None:
    """128 tokens are room enough to close the JSON: every row is checked."""
    for i in range(len(PEOPLE)):
        choice = body(structured["by_id"][f"person-{i}"])["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_choice_rows_are_one_of_the_choices(structured: dict[str, Any]) -> None:
    for i in range(len(REVIEWS)):
        assert structured["by_id"][f"label-{i}"]["completion"] in LABELS


def test_regex_rows_match(structured: dict[str, Any]) -> None:
    for i in range(2):
        assert re.fullmatch(YEAR, structured["by_id"][f"year-{i}"]["completion"])


def test_n_3_gives_three_choices_reproducible_with_a_seed(structured: dict[str, Any]) -> None:
    a, b = structured["by_id"]["n3-a"], structured["by_id"]["n3-b"]
    assert [c["index"] for c in a["completions"]] == [0, 1, 2]
    assert [c["completion"] for c in a["completions"]] == [c["completion"] for c in b["completions"]]
    assert a["completion"] == a["completions"][0]["completion"]
    assert a["completion_tokens"] == sum(c["completion_tokens"] for c in a["completions"])


def test_logprobs_have_two_alternatives_and_are_at_most_zero(structured: dict[str, Any]) -> None:
    chat = body(structured["by_id"]["lp-chat"])["choices"][0]["logprobs"]["content"]
    row = structured["by_id"]["lp-row"]["logprobs"]
    for entries in (chat, row):
        assert entries
        for entry in entries:
            assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
            assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
            assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    cmpl = body(structured["by_id"]["lp-cmpl"])["choices"][0]["logprobs"]
    assert len(cmpl["tokens"]) == len(cmpl["token_logprobs"]) == len(cmpl["top_logprobs"]) > 0
    # the sampled token and two alternatives (fewer when it is one of them, or two decode alike)
    assert all(len(top) <= 3 for top in cmpl["top_logprobs"])
    assert all(list(top)[0] == token for token, top in zip(cmpl["tokens"], cmpl["top_logprobs"], strict=True))
    if structured["report"]["engine"]["in_process"]:  # the worker's step hook ranked them without torch.compile
        from vllm.v1.sample import sampler

        assert sampler.batched_count_greater_than is logprob_ranks.eager_count


def test_every_openai_line_validates_against_the_reference_types(structured: dict[str, Any]) -> None:
    lines = [r for r in [*structured["outputs"], *structured["errors"].values()] if "custom_id" in r]
    assert len(lines) == 9  # 3 JSON schema, 2 log-probabilities, every field, tools, stream, a bad url
    for record in lines:
        check_openai_line(record)


def test_rows_with_every_field_run(structured: dict[str, Any]) -> None:
    row = structured["by_id"]["every-field"]
    assert 2 <= row["completion_tokens"] <= 6  # min_tokens 2, max_tokens 6
    usage = body(structured["by_id"]["every-field-openai"])["usage"]
    assert 2 <= usage["completion_tokens"] <= 6


def test_the_report_counts_finish_reasons_and_checks_the_structured_rows(structured: dict[str, Any]) -> None:
    report = structured["report"]
    assert sum(report["finish_reasons"].values()) == 14 + 3 * 2  # the n=3 rows count 3 choices each
    kinds = report["structured_outputs"]["by_kind"]
    assert report["structured_outputs"]["backend"] == "xgrammar"
    assert kinds["choice"]["valid"] == kinds["choice"]["completions"] == len(REVIEWS)
    assert kinds["regex"]["valid"] == 2
    assert kinds["json"]["completions"] == kinds["json"]["valid"] == len(PEOPLE)
    assert kinds["json"]["cut_at_max_tokens"] == 0
