"""A structured output vLLM's grammar backend refuses (a regex or grammar that
does not compile) is the row's ``invalid_field`` error before the engine,
as vLLM's ``SamplingParams.verify`` would refuse it when the row is added;
what vLLM takes (a grammar only its guidance fallback compiles, under
``backend = "auto"``) runs. bulkinfer.prep.grammar."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
import tiny_model
from fakes import FakeEngine, assert_defaults_refused
from reference_types import check_openai_line
from vllm.config import StructuredOutputsConfig
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams

from bulkinfer.config import SamplingDefaults, load_settings
from bulkinfer.errors import ConfigError
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.models import load_tokenizer
from bulkinfer.prep.grammar import Grammars
from bulkinfer.schema import CHAT_URL
from bulkinfer.settings import EngineSettings

BAD_REGEX = {"regex": "(("}
GUIDANCE_ONLY = {"grammar": 'root ::= "a" | '}  # xgrammar refuses it; llguidance, vLLM's fallback, compiles it
CASES = [
    BAD_REGEX,
    {"regex": "[a-z]+"},
    GUIDANCE_ONLY,
    {"grammar": "root ::= ((("},
    {"grammar": 'root ::= "yes" | "no"'},
    {"choice": ["yes", "no"]},
    {"json_object": True},
    {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
]


def engine(backend: str | None) -> EngineSettings:
    return EngineSettings(extra_args={"structured_outputs_config": {"backend": backend}} if backend else {})


def vllm_verify_refuses(structured: dict[str, Any], backend: str, tokenizer: Any) -> bool:
    """What vLLM's input processor asks of a request as it is added
    (``SamplingParams.verify``), with a model config that has what it reads."""
    model = SimpleNamespace(is_diffusion=False, max_logprobs=20, get_vocab_size=lambda: 23)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**structured))
    try:
        params.verify(model, None, StructuredOutputsConfig(backend=backend), tokenizer)  # type: ignore[arg-type]
    except VLLMValidationError:
        return True
    return False


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "guidance"])
def test_refused_exactly_where_vllm_refuses_with_the_engines_backend(tmp_path: Path, backend: str) -> None:
    tokenizer = load_tokenizer(str(tiny_model.build(tmp_path)))
    grammars = Grammars(tokenizer, engine(backend if backend != "auto" else None))
    refused = [case for case in CASES if grammars.refusal(case) is not None]
    assert refused == [case for case in CASES if vllm_verify_refuses(case, backend, tokenizer)]
    assert BAD_REGEX in refused and {"regex": "[a-z]+"} not in refused
    assert (GUIDANCE_ONLY in refused) == (backend == "xgrammar")  # auto falls back to guidance, as vLLM does


def test_each_distinct_value_is_asked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    grammars = Grammars(load_tokenizer(str(tiny_model.build(tmp_path))), engine(None))
    asked: list[Any] = []
    ask = grammars._ask
    monkeypatch.setattr(grammars, "_ask", lambda structured: asked.append(structured) or ask(structured))
    for _ in range(3):
        assert grammars.refusal({"regex": "(("}) is not None
        assert grammars.refusal({"choice": ["b", "a"]}) is None
    assert len(asked) == 2


def test_a_bad_engine_config_is_the_engines_config_error(tmp_path: Path) -> None:
    grammars = Grammars(load_tokenizer(str(tiny_model.build(tmp_path))), engine("no-such-backend"))
    with pytest.raises(ConfigError, match="engine.structured_outputs_config: "):
        grammars.refusal(BAD_REGEX)


def test_a_run_fails_such_rows_before_the_engine_naming_their_field(tmp_path: Path) -> None:
    engine = FakeEngine()
    rows = [
        {"id": "ok", "prompt": "hi", "structured_outputs": {"regex": "[a-z]+"}},
        {"id": "fallback", "prompt": "hi", "structured_outputs": GUIDANCE_ONLY},
        {"id": "regex", "prompt": "hi", "structured_outputs": BAD_REGEX},
        {"id": "schema", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}},
        {"custom_id": "line", "url": CHAT_URL, "body": {
            "messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"grammar": "root ::= ((("}}},
    ]  # fmt: skip
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    settings = dataclasses.replace(load_settings(), model=str(tiny_model.build(tmp_path / "home")))
    run(paths, settings, RunContext(engine_factory=lambda model, settings: engine))
    assert sorted(engine.reached) == ["fallback", "ok"]
    errors = {e.get("custom_id") or e["id"]: e for e in map(orjson.loads, paths.errors.read_bytes().splitlines())}
    assert errors["regex"]["error"]["type"] == "invalid_field"
    assert errors["regex"]["error"]["message"].startswith("field 'structured_outputs': Grammar error: ")
    assert 'invalid regex "(("' in errors["regex"]["error"]["message"]
    # a schema's pattern is bulkinfer's own JSON-schema check (jsonschema), named as the row gave it
    assert errors["schema"]["error"]["message"].startswith("field 'response_format.json_schema.schema': not a valid")
    check_openai_line(errors["line"])  # vLLM's BatchRequestOutput
    assert errors["line"]["error"]["code"] == "invalid_field"
    assert errors["line"]["error"]["message"].startswith("field 'structured_outputs': Invalid grammar specification")


def test_a_default_vllm_refuses_stops_run_stream_and_plan_before_a_row_or_an_engine(tmp_path: Path) -> None:
    from bulkinfer.jobs.plan import plan_file

    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps({"id": "r", "prompt": "hi"}) + b"\n")
    settings = dataclasses.replace(
        load_settings(),
        model=str(tiny_model.build(tmp_path / "home")),
        sampling=SamplingDefaults(structured_outputs={"regex": "(("}),
    )
    said = "sampling.structured_outputs (--json-schema, --choice, --regex or the config): Grammar error: "
    assert_defaults_refused(src, settings, said, tmp_path)
    ok = dataclasses.replace(settings, sampling=SamplingDefaults(structured_outputs=GUIDANCE_ONLY))
    assert plan_file(src, ok)["rows"]["valid"] == 1


def test_an_online_request_with_one_is_refused_as_a_batch_row_is(tmp_path: Path) -> None:
    from bulkinfer.engine.mux import EngineMux
    from bulkinfer.jobs.online import OnlineRequests
    from bulkinfer.schema import RowInvalid

    tokenizer = load_tokenizer(str(tiny_model.build(tmp_path)))
    settings = load_settings().resolve_chat_template(tokenizer)
    mux = EngineMux(FakeEngine())
    try:
        online = OnlineRequests(mux, tokenizer, settings, "m")
        body = {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": BAD_REGEX}
        with pytest.raises(RowInvalid) as info:
            online.prepare(CHAT_URL, body)
        assert info.value.type == "invalid_field" and 'invalid regex "(("' in info.value.message
        assert online.prepare(CHAT_URL, {**body, "structured_outputs": GUIDANCE_ONLY}).structured == GUIDANCE_ONLY
    finally:
        mux.close()
