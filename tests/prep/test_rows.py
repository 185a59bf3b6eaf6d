"""Tests of bulkinfer.prep.rows.parse_row: bulkinfer rows and OpenAI batch lines."""

from __future__ import annotations

from typing import Any

import pytest

from bulkinfer.config import SamplingDefaults
from bulkinfer.prep.rows import parse_row
from bulkinfer.schema import CHAT_URL, COMPLETIONS_URL, RowInvalid

DEFAULTS = SamplingDefaults(max_tokens=100, temperature=0.7, top_p=0.9, seed=11, stop=("###",), ignore_eos=True)


def parse(data: Any, line: int = 5, defaults: SamplingDefaults = DEFAULTS):  # noqa: ANN201
    return parse_row(data, seq=line - 1, line=line, defaults=defaults)


def invalid(data: Any, line: int = 5) -> RowInvalid:
    with pytest.raises(RowInvalid) as info:
        parse(data, line)
    return info.value


# --- bulkinfer rows -------------------------------------------------------------------------------


def test_prompt_row_takes_defaults() -> None:
    req = parse({"id": "a", "prompt": "Hello there"}, line=3)
    assert req.id == "a"
    assert req.seq == 2 and req.line == 3
    assert req.prompt == "Hello there"
    assert req.messages is None
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.stop) == (100, 0.7, 0.9, 11, ("###",))
    assert req.ignore_eos is True
    assert req.passthrough == {}
    assert req.openai_url is None
    assert req.prompt_token_ids is None


def test_messages_row_with_string_content() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    req = parse({"id": "m", "messages": messages})
    assert req.prompt is None
    assert req.messages == messages


def test_messages_row_with_text_parts_joined() -> None:
    content = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    req = parse({"messages": [{"role": "user", "content": content, "name": "bob"}]})
    assert req.messages == [{"role": "user", "content": "Hello, \nworld", "name": "bob"}]  # as vLLM joins them


def test_id_defaults_to_line_number() -> None:
    assert parse({"prompt": "x"}, line=42).id == "42"
    assert parse({"prompt": "x", "id": None}, line=7).id == "7"


def test_int_id_kept_as_string() -> None:
    req = parse({"id": 17, "prompt": "x"})
    assert req.id == "17"
    assert isinstance(req.id, str)
    assert parse({"id": 0, "prompt": "x"}).id == "0"


@pytest.mark.parametrize("bad_id", ["", 1.5, True, [], {"a": 1}])
def test_bad_id(bad_id: Any) -> None:
    err = invalid({"id": bad_id, "prompt": "x"})
    assert err.type == "invalid_field"
    assert "'id'" in err.message


def test_unknown_fields_pass_through() -> None:
    row = {"id": "p", "prompt": "x", "lang": "fr", "meta": {"n": [1, 2]}, "score": None, "max_tokens": 5}
    req = parse(row)
    assert req.passthrough == {"lang": "fr", "meta": {"n": [1, 2]}, "score": None}


def test_row_sampling_fields_override_defaults() -> None:
    req = parse({"prompt": "x", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": ["a", "b"]})
    assert req.max_tokens == 7
    assert req.temperature == 0.0 and isinstance(req.temperature, float)
    assert req.top_p == 0.5
    assert req.seed == 3
    assert req.stop == ("a", "b")


def test_single_stop_string_and_boundaries() -> None:
    req = parse({"prompt": "x", "stop": "END", "temperature": 2, "top_p": 1, "max_tokens": 1})
    assert req.stop == ("END",)
    assert (req.temperature, req.top_p, req.max_tokens) == (2.0, 1.0, 1)


def test_null_sampling_fields_take_defaults() -> None:
    # Parquet files give a null for every column a row does not set.
    req = parse({"prompt": "x", "max_tokens": None, "temperature": None, "top_p": None, "seed": None, "stop": None})
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.stop) == (100, 0.7, 0.9, 11, ("###",))


@pytest.mark.parametrize(
    ("row", "type_", "named"),
    [
        ({"id": "r"}, "missing_field", "prompt"),
        ({"id": "r", "prompt": None}, "missing_field", "prompt"),
        ({"id": "r", "prompt": ""}, "invalid_field", "'prompt'"),
        ({"id": "r", "prompt": 12}, "invalid_field", "'prompt'"),
        ({"id": "r", "prompt": ["a", "b"]}, "invalid_field", "a list of 2 prompts"),
        ({"id": "r", "prompt": [[1], [2]]}, "invalid_field", "give each prompt its own row"),
        ({"id": "r", "prompt": []}, "invalid_field", "'prompt'"),
        ({"id": "r", "prompt": [1, -2]}, "invalid_field", "token ids (integers >= 0)"),
        ({"id": "r", "prompt": [1, 2.0]}, "invalid_field", "'prompt'"),
        ({"id": "r", "prompt": [True]}, "invalid_field", "'prompt'"),
        ({"id": "r", "prompt": [[]]}, "invalid_field", "'prompt[0]'"),
        ({"id": "r", "prompt": [["a"]]}, "invalid_field", "'prompt[0]'"),
        ({"id": "r", "messages": []}, "invalid_field", "'messages'"),
        ({"id": "r", "messages": "hi"}, "invalid_field", "'messages'"),
        ({"id": "r", "messages": ["hi"]}, "invalid_field", "'messages[0]'"),
        ({"id": "r", "messages": [{"role": "robot", "content": "x"}]}, "invalid_field", "'messages[0].role'"),
        ({"id": "r", "messages": [{"content": "x"}]}, "invalid_field", "'messages[0].role'"),
        (
            {"id": "r", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]},
            "invalid_field",
            "'messages[1].content'",
        ),
        (
            {"id": "r", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
            "invalid_field",
            "'messages[0].content'",
        ),
        ({"id": "r", "messages": [{"role": "user"}]}, "invalid_field", "'messages[0].content'"),
        ({"id": "r", "prompt": "x", "max_tokens": 0}, "invalid_field", "'max_tokens'"),
        ({"id": "r", "prompt": "x", "max_tokens": -1}, "invalid_field", "'max_tokens'"),
        ({"id": "r", "prompt": "x", "max_tokens": "abc"}, "invalid_field", "'max_tokens'"),
        ({"id": "r", "prompt": "x", "max_tokens": 1.5}, "invalid_field", "'max_tokens'"),
        ({"id": "r", "prompt": "x", "max_tokens": True}, "invalid_field", "'max_tokens'"),
        ({"id": "r", "prompt": "x", "temperature": 3}, "invalid_field", "'temperature'"),
        ({"id": "r", "prompt": "x", "temperature": -0.5}, "invalid_field", "'temperature'"),
        ({"id": "r", "prompt": "x", "temperature": "x"}, "invalid_field", "'temperature'"),
        ({"id": "r", "prompt": "x", "temperature": True}, "invalid_field", "'temperature'"),
        ({"id": "r", "prompt": "x", "top_p": 0}, "invalid_field", "'top_p'"),
        ({"id": "r", "prompt": "x", "top_p": 1.5}, "invalid_field", "'top_p'"),
        ({"id": "r", "prompt": "x", "seed": "1"}, "invalid_field", "'seed'"),
        ({"id": "r", "prompt": "x", "seed": 1.5}, "invalid_field", "'seed'"),
        ({"id": "r", "prompt": "x", "stop": ["a", 1]}, "invalid_field", "'stop'"),
        ({"id": "r", "prompt": "x", "stop": 5}, "invalid_field", "'stop'"),
        # vLLM refuses an empty stop string ("stop cannot contain an empty string."), as [sampling] stop does
        ({"id": "r", "prompt": "x", "stop": ""}, "invalid_field", "'stop'"),
        ({"id": "r", "prompt": "x", "stop": ["a", ""]}, "invalid_field", "'stop'"),
        ({"id": "r", "prompt": "x", "max_tokens": 5, "max_completion_tokens": 6}, "invalid_row", "not both"),
        (
            {"id": "r", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
            "invalid_row",
            "'prompt' and 'messages'",
        ),
    ],
)
def test_invalid_rows(row: dict[str, Any], type_: str, named: str) -> None:
    err = invalid(row)
    assert err.type == type_
    assert named in err.message
    assert err.row_id == "r"
    assert err.openai is False
    assert err.to_error(9).line == 9
    assert err.to_error(9).id == "r"
    assert err.to_error(9).type == type_


def test_invalid_field_message_shows_the_value() -> None:
    err = invalid({"prompt": "x", "max_tokens": "abc"})
    assert "'abc'" in err.message
    assert ">= 1" in err.message
    long = invalid({"prompt": "x", "stop": ["y" * 500, 1]})
    assert len(long.message) < 200


@pytest.mark.parametrize(("data", "kind"), [([1, 2], "list"), ("text", "str"), (3, "int"), (None, "NoneType")])
def test_non_object_json_is_invalid_row(data: Any, kind: str) -> None:
    err = invalid(data)
    assert err.type == "invalid_row"
    assert kind in err.message
    assert err.row_id is None


# --- OpenAI batch lines ---------------------------------------------------------------------------


def openai_line(url: str = CHAT_URL, **body: Any) -> dict[str, Any]:
    if "messages" not in body and "prompt" not in body:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    return {"custom_id": "req-1", "method": "POST", "url": url, "body": body}


def test_openai_chat_line() -> None:
    req = parse(openai_line(model="gpt-x", max_tokens=9, temperature=0))
    assert req.id == "req-1"
    assert req.openai_url == CHAT_URL
    assert req.messages == [{"role": "user", "content": "Hi"}]
    assert req.prompt is None
    assert req.max_tokens == 9
    assert req.temperature == 0.0
    assert req.top_p == 0.9  # default
    assert req.passthrough == {"model": "gpt-x"}


def test_openai_completions_line() -> None:
    req = parse(openai_line(COMPLETIONS_URL, prompt="Once upon", stop="."))
    assert req.openai_url == COMPLETIONS_URL
    assert req.prompt == "Once upon"
    assert req.messages is None
    assert req.stop == (".",)
    assert req.max_tokens == 100
    assert req.passthrough == {}


def test_a_prompt_of_token_ids_is_sent_as_it_is_and_a_list_of_one_prompt_is_that_prompt() -> None:
    """OpenAI's /v1/completions and vLLM take a prompt as text, token ids, or a
    list of either; bulkinfer rows take the same, one prompt a row."""
    for row in ({"id": "r", "prompt": [1, 2, 3]}, {"id": "r", "prompt": [[1, 2, 3]]}):
        req = parse(row)
        assert (req.prompt, req.messages, req.prompt_token_ids) == (None, None, [1, 2, 3])
    assert parse({"id": "r", "prompt": ["Once upon"]}).prompt == "Once upon"
    line = parse(openai_line(COMPLETIONS_URL, prompt=[[7, 0, 9]]))
    assert (line.prompt, line.prompt_token_ids, line.openai_url) == (None, [7, 0, 9], COMPLETIONS_URL)
    assert parse(openai_line(COMPLETIONS_URL, prompt=["Once upon"])).prompt == "Once upon"
    several = parse(openai_line(COMPLETIONS_URL, prompt=["a", [5, 6], "c"]))  # OpenAI's list: each prompt's choices
    assert (several.prompts, several.prompt, several.prompt_token_ids) == (["a", [5, 6], "c"], None, None)
    err = invalid(openai_line(COMPLETIONS_URL, prompt=["a", ""]))
    assert err.openai and "field 'body.prompt[1]': expected a non-empty string or a list of token ids" in err.message


def test_openai_max_completion_tokens_is_max_tokens() -> None:
    assert parse(openai_line(max_completion_tokens=21)).max_tokens == 21
    # a null max_tokens does not hide max_completion_tokens
    assert parse(openai_line(max_tokens=None, max_completion_tokens=22)).max_tokens == 22


def test_openai_bad_max_completion_tokens_names_that_field() -> None:
    err = invalid(openai_line(max_completion_tokens=0))
    assert err.type == "invalid_field"
    assert "max_completion_tokens" in err.message


def test_openai_custom_id_is_the_id_even_with_an_id_field() -> None:
    line = openai_line()
    line["id"] = "other"
    assert parse(line).id == "req-1"


def test_openai_bad_url() -> None:
    err = invalid(openai_line("/v1/embeddings"))
    assert err.type == "invalid_field"
    assert "'url'" in err.message and "/v1/embeddings" in err.message
    assert err.row_id == "req-1"
    assert err.openai is True


def test_openai_bad_method() -> None:
    line = openai_line()
    line["method"] = "GET"
    err = invalid(line)
    assert err.type == "invalid_field" and "'method'" in err.message


def test_openai_missing_messages() -> None:
    err = invalid({"custom_id": "req-1", "method": "POST", "url": CHAT_URL, "body": {"model": "m"}})
    assert err.type == "missing_field"
    assert "body.messages" in err.message
    assert err.row_id == "req-1"
    assert err.openai is True


def test_openai_missing_prompt_for_completions() -> None:
    err = invalid({"custom_id": "req-1", "url": COMPLETIONS_URL, "body": {"model": "m"}})
    assert err.type == "invalid_field"
    assert "body.prompt" in err.message


def test_openai_body_not_an_object() -> None:
    err = invalid({"custom_id": "req-1", "url": CHAT_URL, "body": "hello"})
    assert err.type == "invalid_field"
    assert "'body'" in err.message


def test_a_line_with_custom_id_and_url_but_no_body_is_an_openai_line_missing_it() -> None:
    err = invalid({"custom_id": "req-1", "method": "POST", "url": CHAT_URL})
    assert (err.type, err.row_id, err.openai) == ("missing_field", "req-1", True)
    assert err.message.startswith("field 'body' is required")
    # a dataset row with columns of those names and a prompt is a bulkinfer row
    row = parse({"custom_id": "c", "url": "https://example.com/a", "prompt": "hi"})
    assert row.prompt == "hi" and row.passthrough == {"custom_id": "c", "url": "https://example.com/a"}


def test_values_of_the_wrong_kind_in_a_role_a_url_or_a_logit_bias_key_are_the_rows_error() -> None:
    """Each was a traceback that ended the whole run (TypeError: unhashable
    type; ValueError from ``int("²")``, a key ``str.isdigit`` accepts)."""
    for line, field in [
        ({"id": "r", "messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
        ({"id": "r", "messages": [{"role": {"r": 1}, "content": "hi"}]}, "messages[0].role"),
        ({"custom_id": "c", "url": ["/v1/chat/completions"], "body": {}}, "url"),
        ({"custom_id": "c", "url": {"a": 1}, "body": {}}, "url"),
        ({"id": "r", "prompt": "hi", "logit_bias": {"²": 5}}, "logit_bias"),
    ]:
        err = invalid(line)
        assert err.type == "invalid_field" and f"'{field}'" in err.message, err.message
    assert parse({"id": "r", "prompt": "hi", "logit_bias": {"12": 5}}).options["logit_bias"] == {12: 5.0}


def test_openai_bad_custom_id() -> None:
    err = invalid({"custom_id": "", "url": CHAT_URL, "body": {"messages": [{"role": "user", "content": "x"}]}})
    assert err.type == "invalid_field"
    assert "custom_id" in err.message
    assert err.openai is True


def test_openai_bad_role_is_an_openai_error() -> None:
    err = invalid(openai_line(messages=[{"role": "bot", "content": "x"}]))
    assert err.type == "invalid_field"
    assert "messages[0].role" in err.message
    assert err.openai is True
    assert err.to_error(2).openai is True


def test_a_min_tokens_default_over_a_rows_max_tokens_is_named_as_the_default() -> None:
    defaults = SamplingDefaults(min_tokens=50)
    with pytest.raises(RowInvalid) as info:
        parse_row({"id": "a", "prompt": "x", "max_tokens": 10}, 0, 1, defaults)  # the row sets no min_tokens
    assert (
        info.value.message
        == "field 'min_tokens (the [sampling] default)': expected an integer <= max_tokens (10), got 50"
    )
    with pytest.raises(RowInvalid, match="field 'min_tokens': expected an integer <= max_tokens"):
        parse_row({"id": "a", "prompt": "x", "max_tokens": 10, "min_tokens": 20}, 0, 1, SamplingDefaults())
    assert parse_row({"id": "a", "prompt": "x", "max_tokens": 60}, 0, 1, defaults).options["min_tokens"] == 50
