"""Every field that shapes a completion, in bulkinfer rows and OpenAI bodies
(issue 12): parsed into vLLM's names, checked with the field named, and the
fields bulkinfer does not implement refused by name (never ignored)."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams

from bulkinfer.config import SamplingDefaults
from bulkinfer.prep.rows import parse_row
from bulkinfer.schema import CHAT_URL, COMPLETIONS_URL, Request, RowInvalid

DEFAULTS = SamplingDefaults()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def parse(data: Any, defaults: SamplingDefaults = DEFAULTS) -> Request:
    return parse_row(data, seq=0, line=1, defaults=defaults)


def invalid(data: Any) -> RowInvalid:
    with pytest.raises(RowInvalid) as info:
        parse(data)
    return info.value


def chat(**body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hi"}]
    return {"custom_id": "c1", "method": "POST", "url": CHAT_URL, "body": {"messages": messages, **body}}


def completions(**body: Any) -> dict[str, Any]:
    return {"custom_id": "c1", "method": "POST", "url": COMPLETIONS_URL, "body": {"prompt": "Once", **body}}


ALL_FIELDS = {
    "n": 3,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "top_k": 5,
    "min_p": 0.05,
    "min_tokens": 2,
    "stop_token_ids": [2, 7],
    "logit_bias": {"42": -5, "7": 100},
    "seed": 9,
    "priority": -3,
}


@pytest.mark.parametrize("shape", ["row", "chat", "completions"])
def test_every_field_reaches_the_request_in_vllms_names(shape: str) -> None:
    line = {
        "row": {"id": "r", "prompt": "Hi", **ALL_FIELDS},
        "chat": chat(**ALL_FIELDS),
        "completions": completions(**ALL_FIELDS),
    }[shape]
    req = parse(line)
    assert req.options == {
        "n": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "top_k": 5,
        "min_p": 0.05,
        "min_tokens": 2,
        "stop_token_ids": [2, 7],
        "logit_bias": {42: -5.0, 7: 100.0},  # OpenAI's string keys become vLLM's token ids
        "logprobs": None,
    }
    assert (req.seed, req.priority, req.structured) == (9, -3, None)
    assert "n" not in req.passthrough and "priority" not in req.passthrough


def test_an_integral_float_is_the_integer_as_vllms_server_reads_it() -> None:
    """``max_tokens: 8.0`` (pandas writes a nullable integer column as float64)
    is 8, as vLLM's pydantic ``ChatCompletionRequest`` reads it; 8.5 stays refused."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    ints = {"max_tokens": 8, "n": 2, "seed": 3, "top_k": 5, "min_tokens": 1, "priority": -1, "top_logprobs": 2}
    floats = {name: float(value) for name, value in ints.items()} | {"stop_token_ids": [2.0, 7.0]}
    req = parse(chat(**floats, logprobs=True, temperature=0.5))
    got = {
        "max_tokens": req.max_tokens,
        "n": req.options["n"],
        "seed": req.seed,
        "top_k": req.options["top_k"],
        "min_tokens": req.options["min_tokens"],
        "priority": req.priority,
        "top_logprobs": req.options["logprobs"],
    }
    vllm = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], logprobs=True, **floats)
    assert got == ints == {name: getattr(vllm, name) for name in ints}
    assert all(type(value) is int for value in got.values())
    assert req.options["stop_token_ids"] == [2, 7] == vllm.stop_token_ids
    assert "'max_tokens'" in invalid(chat(max_tokens=8.5)).message


def test_defaults_fill_the_fields_a_row_does_not_set() -> None:
    defaults = SamplingDefaults(n=2, top_k=40, logprobs=1, priority=4, structured_outputs={"choice": ["a", "b"]})
    req = parse({"prompt": "Hi"}, defaults)
    assert (req.options["n"], req.options["top_k"], req.options["logprobs"]) == (2, 40, 1)
    assert (req.priority, req.structured) == (4, {"choice": ["a", "b"]})
    plain = parse({"prompt": "Hi"})
    assert plain.options["stop_token_ids"] is None and plain.options["logit_bias"] is None
    # a row's own response_format text drops the file's constraint
    assert parse({"prompt": "Hi", "response_format": {"type": "text"}}, defaults).structured is None


@pytest.mark.parametrize(
    ("line", "top"),
    [
        (chat(logprobs=True, top_logprobs=2), 2),
        (chat(logprobs=True), 0),
        (chat(logprobs=False), None),
        (completions(logprobs=3), 3),
        (completions(logprobs=0), 0),
        ({"prompt": "Hi", "logprobs": True, "top_logprobs": 5}, 5),
        ({"prompt": "Hi", "logprobs": 4}, 4),
        ({"prompt": "Hi"}, None),
    ],
)
def test_logprobs_in_each_shape(line: dict[str, Any], top: int | None) -> None:
    assert parse(line).options["logprobs"] == top


@pytest.mark.parametrize(
    ("line", "field", "says"),
    [
        (chat(n=0), "'n'", "integer in [1, 16384]"),
        (chat(top_logprobs=2), "'top_logprobs'", "logprobs: true"),
        (chat(logprobs=True, top_logprobs=50), "'top_logprobs'", "[0, 20]"),
        (chat(logprobs=3), "'logprobs'", "true or false"),
        (completions(logprobs=True), "'logprobs'", "[0, 20]"),
        (completions(logprobs=21), "'logprobs'", "[0, 20]"),
        (chat(presence_penalty=3), "'presence_penalty'", "[-2, 2]"),
        (chat(frequency_penalty="high"), "'frequency_penalty'", "[-2, 2]"),
        (chat(repetition_penalty=0), "'repetition_penalty'", "> 0"),
        (chat(top_k=-2), "'top_k'", "no limit"),
        (chat(top_k=2.5), "'top_k'", "no limit"),
        (chat(min_p=1.5), "'min_p'", "[0, 1]"),
        (chat(min_tokens=-1), "'min_tokens'", ">= 0"),
        (chat(min_tokens=300, max_tokens=10), "'min_tokens'", "<= max_tokens (10)"),
        (chat(stop_token_ids=[1, -1]), "'stop_token_ids'", "token ids"),
        (chat(logit_bias={"x": 1}), "'logit_bias'", "token id"),
        (chat(logit_bias={"5": 101}), "'logit_bias'", "[-100, 100]"),
        (chat(priority=1.5), "'priority'", "integer"),
        (chat(ignore_eos="yes"), "'ignore_eos'", "true or false"),
        ({"prompt": "Hi", "n": True}, "'n'", "integer in [1, 16384]"),
        (chat(n=16385), "'n'", "integer in [1, 16384]"),  # vLLM's VLLM_MAX_N_SEQUENCES, refused in the engine before
        ({"prompt": "Hi", "logprobs": 5, "top_logprobs": 2}, "'top_logprobs'", "an integer logprobs is the count"),
    ],
)
def test_an_out_of_range_value_is_a_row_error_naming_the_field(line: dict[str, Any], field: str, says: str) -> None:
    err = invalid(line)
    assert err.type == "invalid_field"
    assert field in err.message and says in err.message, err.message


# --- structured output --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "structured"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
            {"json": SCHEMA},
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "strict": True, "schema": SCHEMA},
                }
            },
            {"json": SCHEMA},
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, {"json_object": True}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        ({"structured_outputs": {"regex": "[0-9]{4}"}}, {"regex": "[0-9]{4}"}),
        ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}),
        ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, {"grammar": 'root ::= "a" | "b"'}),
    ],
)
@pytest.mark.parametrize("shape", ["row", "chat"])
def test_structured_output_becomes_vllms_structured_outputs_params(
    source: dict[str, Any], structured: dict[str, Any] | None, shape: str
) -> None:
    line = {"prompt": "Hi", **source} if shape == "row" else chat(**source)
    assert parse(line).structured == structured


def test_the_built_structured_outputs_params_are_vllms() -> None:
    from bulkinfer.engine.sampling import sampling_params

    req = parse(chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}))
    params = sampling_params(req, SamplingParams, None)
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.structured_outputs.json == SCHEMA


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ({"response_format": {"type": "xml"}}, "'response_format'"),
        ({"response_format": "json"}, "'response_format'"),
        ({"response_format": {"type": "json_schema"}}, "'response_format.json_schema'"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}},
            "'response_format.json_schema.schema': not a valid JSON schema",
        ),
        ({"structured_outputs": {"choice": []}}, "choice: expected a non-empty list"),
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "exactly one of"),
        ({"structured_outputs": {}}, "exactly one of"),
        ({"structured_outputs": {"regexp": "a"}}, "unknown key(s) regexp"),
        ({"structured_outputs": {"json": "{not json"}}, "json: not valid JSON text"),
        ({"structured_outputs": {"json_object": False}}, "json_object: expected true"),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            "disable_any_whitespace is engine-wide in vLLM, not per request",
        ),
    ],
)
def test_a_bad_constraint_is_a_row_error_naming_the_field(source: dict[str, Any], says: str) -> None:
    err = invalid(chat(**source))
    assert err.type == "invalid_field" and says in err.message, err.message
    assert err.row_id == "c1" and err.openai


def test_response_format_and_structured_outputs_together_are_refused() -> None:
    err = invalid({"prompt": "Hi", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}})
    assert err.type == "invalid_row" and "not both" in err.message


# --- nothing silently ignored -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field",
    ["tools", "tool_choice", "functions", "function_call", "audio", "modalities", "parallel_tool_calls"],
)
def test_an_unimplemented_body_field_is_an_unsupported_field_error(field: str) -> None:
    err = invalid(chat(**{field: [{"type": "function"}]}))
    assert err.type == "unsupported_field"
    assert f"'body.{field}'" in err.message and err.row_id == "c1" and err.openai


@pytest.mark.parametrize("field", ["echo", "best_of", "suffix", "top_logprobs"])
def test_completions_fields_bulkinfer_does_not_implement_are_refused(field: str) -> None:
    err = invalid(completions(**{field: 1}))
    assert err.type == "unsupported_field" and f"'body.{field}'" in err.message


@pytest.mark.parametrize("stream", [True, "True"])
def test_stream_is_refused(stream: Any) -> None:
    err = invalid(chat(stream=stream))
    assert err.type == "unsupported_field" and "'body.stream'" in err.message and "stream" in err.message


def test_harmless_metadata_is_accepted() -> None:
    req = parse(chat(model="m", user="u", metadata={"k": "v"}, store=False, stream=False, service_tier="auto"))
    assert req.id == "c1" and req.passthrough == {"model": "m"}


def test_vllms_own_run_batch_input_cases() -> None:
    """The lines of vLLM's tests/entrypoints/openai/test_run_batch.py
    INPUT_BATCH: two chat requests, a bad url, a completions-shaped chat line
    with ``stream: "True"`` (both error records), and one with ``max_tokens``."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello"}]
    ok = parse(
        {
            "custom_id": "request-1",
            "method": "POST",
            "url": CHAT_URL,
            "body": {"model": "m", "messages": messages, "max_tokens": 1000},
        }
    )
    assert (ok.id, ok.max_tokens) == ("request-1", 1000)
    bad_url = invalid(
        {"custom_id": "request-3", "method": "POST", "url": "/bad_url", "body": {"model": "m", "messages": messages}}
    )
    assert bad_url.type == "invalid_field" and "'url'" in bad_url.message
    stream = invalid(
        {
            "custom_id": "request-4",
            "method": "POST",
            "url": CHAT_URL,
            "body": {"model": "m", "stream": "True", "messages": messages, "max_tokens": 1000},
        }
    )
    assert stream.type == "unsupported_field" and stream.row_id == "request-4"


def test_a_row_may_set_ignore_eos() -> None:
    assert parse({"prompt": "Hi", "ignore_eos": True}).ignore_eos is True
    assert parse(chat(ignore_eos=True)).ignore_eos is True


def test_the_built_sampling_params_carry_every_field() -> None:
    """Penalties, top_k, min_p, min_tokens, stop_token_ids, logit_bias, n,
    logprobs reach vLLM's own ``SamplingParams`` (the object vLLM checks and runs)."""
    from bulkinfer.engine.sampling import sampling_params

    req = parse({"prompt": "Hi", **ALL_FIELDS, "logprobs": True, "top_logprobs": 2, "max_tokens": 16})
    params = sampling_params(req, SamplingParams, None)
    assert (params.n, params.presence_penalty, params.frequency_penalty) == (3, 0.5, -0.5)
    assert (params.repetition_penalty, params.top_k, params.min_p, params.min_tokens) == (1.2, 5, 0.05, 2)
    assert params.stop_token_ids == [2, 7]
    assert params.logit_bias == {42: -5.0, 7: 100.0}
    assert (params.logprobs, params.seed, params.max_tokens) == (2, 9, 16)


@pytest.mark.parametrize("temperature", [0, 1e-6, 1e-5, 0.5])
@pytest.mark.parametrize("n", [1, 2])
def test_several_greedy_completions_are_refused_where_vllm_refuses_them(n: int, temperature: float) -> None:
    """vLLM's own SamplingParams decides: a row of ``n`` > 1 at temperature 0
    (greedy) is an error record naming ``n``, before the engine starts."""
    try:
        SamplingParams(n=n, temperature=temperature)
        vllm_refuses = False
    except VLLMValidationError:
        vllm_refuses = True
    for line in ({"id": "r", "prompt": "Hi", "n": n, "temperature": temperature}, chat(n=n, temperature=temperature)):
        if vllm_refuses:
            err = invalid(line)
            assert err.type == "invalid_field"
            assert err.message == (
                f"field 'n': expected 1 at temperature {temperature:g} "
                f"(greedy sampling: vLLM refuses n > 1 with it), got {n}"
            )
        else:
            assert parse(line).options["n"] == n
    assert vllm_refuses == (n == 2 and temperature == 0)  # vLLM raises (0, 0.01) to 0.01


def test_several_greedy_completions_name_the_sampling_default_they_come_from() -> None:
    greedy = SamplingDefaults(temperature=0.0)
    with pytest.raises(RowInvalid) as info:
        parse({"id": "r", "prompt": "Hi", "n": 4}, greedy)
    assert info.value.message == (
        "field 'n': expected 1 at temperature 0, the [sampling] default "
        "(greedy sampling: vLLM refuses n > 1 with it), got 4"
    )
    with pytest.raises(RowInvalid) as info:
        parse({"id": "r", "prompt": "Hi", "temperature": 0}, SamplingDefaults(n=3))
    assert info.value.message.startswith("field 'n (the [sampling] default)': expected 1 at temperature 0 (")
    # a row that samples may ask several completions whatever the default temperature
    assert parse({"id": "r", "prompt": "Hi", "n": 4, "temperature": 0.7}, greedy).options["n"] == 4
