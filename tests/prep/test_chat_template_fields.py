"""The chat template's own fields (:mod:`bulkinfer.prep.chat_template`):
read from bulkinfer rows and OpenAI chat bodies, merged as vLLM's
``ChatCompletionRequest.build_chat_params`` merges them (checked against
it), refused where vLLM refuses them, and rendered by a
tokenizer with SmolLM2's ChatML template: a prefilled assistant message is
continued, a template variable reaches the template (the real model's run:
tests/e2e/test_e2e.py)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from bulkinfer.config import PlanSettings, SamplingDefaults, Settings, load_settings
from bulkinfer.errors import ConfigError
from bulkinfer.models import load_tokenizer, resolve_model
from bulkinfer.prep.chat_template import RESERVED_KWARGS, TEMPLATE_FIELDS, developer_as_system
from bulkinfer.prep.planner import Planner
from bulkinfer.prep.rows import parse_row, to_request
from bulkinfer.schema import CHAT_URL, COMPLETIONS_URL, Request, RowInvalid

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PREFILLED = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
DOCUMENTS = [{"title": "France", "text": "Paris is the capital of France."}]


def row(**fields: Any) -> Request:
    return to_request({"id": "r", "messages": QUESTION, **fields}, 0, 1, Settings(apply_chat_template=True))


def refused(data: dict[str, Any], settings: Settings | None = None) -> RowInvalid:
    with pytest.raises(RowInvalid) as info:
        to_request(data, 0, 1, settings or Settings(apply_chat_template=True))
    return info.value


def test_the_reserved_keys_are_apply_chat_templates_own_parameters() -> None:
    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    named = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}
    assert named - {"tools", *TEMPLATE_FIELDS} == RESERVED_KWARGS


@pytest.mark.parametrize(
    "body",
    [
        {"chat_template_kwargs": {"enable_thinking": False, "documents": []}, "documents": DOCUMENTS},
        {"add_generation_prompt": False, "chat_template_kwargs": {"add_generation_prompt": True, "x": 1}},
        {"continue_final_message": True, "add_generation_prompt": False},
        {"documents": DOCUMENTS},
    ],
)
def test_the_fields_merge_as_vllms_chat_completion_request_merges_them(body: dict[str, Any]) -> None:
    theirs = ChatCompletionRequest(model="m", messages=PREFILLED, **body).build_chat_params(None, "auto")
    ours = parse_row({"custom_id": "c", "body": {"messages": PREFILLED, **body}}, 0, 1, SamplingDefaults())
    assert {"add_generation_prompt": True, "continue_final_message": False, **ours.template_kwargs} == (
        theirs.chat_template_kwargs
    )
    assert ours.template_kwargs  # each case sets something: the assertion could fail


def test_a_row_that_only_continues_the_final_message_starts_no_new_one() -> None:
    assert row(continue_final_message=True).template_kwargs == {
        "continue_final_message": True,
        "add_generation_prompt": False,
    }


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
        ({"add_generation_prompt": "no"}, "field 'add_generation_prompt': expected true or false"),
        ({"documents": ["text"]}, "field 'documents': expected a list of objects"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "field 'chat_template_kwargs': expected an object"),
        ({"chat_template_kwargs": {"tokenize": True}}, "tokenize is apply_chat_template's own parameter"),
    ],
)
def test_a_bad_value_is_an_invalid_field_naming_it(fields: dict[str, Any], says: str) -> None:
    error = refused({"id": "r", "messages": QUESTION, **fields})
    assert error.type == "invalid_field" and says in error.message and error.row_id == "r"


def test_vllm_refuses_both_flags_true_too() -> None:
    with pytest.raises(Exception, match="Cannot set both"):
        ChatCompletionRequest(model="m", messages=PREFILLED, continue_final_message=True, add_generation_prompt=True)


def test_a_prompt_sent_raw_cannot_set_them_and_completions_lines_refuse_them() -> None:
    raw = refused({"id": "p", "prompt": "Once", "continue_final_message": True}, Settings(apply_chat_template=False))
    assert raw.type == "invalid_field" and "'continue_final_message' shapes the chat template" in raw.message
    line = {"custom_id": "c", "url": COMPLETIONS_URL, "body": {"prompt": "Once", "documents": DOCUMENTS}}
    assert refused(line).type == "unsupported_field"
    body = {"messages": QUESTION, "documents": DOCUMENTS}
    chat = to_request({"custom_id": "c", "url": CHAT_URL, "body": body}, 0, 1, Settings(apply_chat_template=True))
    assert chat.template_kwargs == {"documents": DOCUMENTS}
    assert "documents" not in row(documents=DOCUMENTS).passthrough  # read, not copied


# SmolLM2-135M-Instruct's chat template (ChatML), as its tokenizer_config.json has it
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def planner_with(template: str) -> Planner:
    """A planner whose tokenizer (the fast tests' stand-in default model's) renders ``template``."""
    tokenizer = copy.deepcopy(load_tokenizer(resolve_model(None)))
    tokenizer.chat_template = template
    return Planner(tokenizer, PlanSettings(), 8192)


def test_a_chatml_template_continues_a_prefilled_message() -> None:
    planner = planner_with(CHATML)
    plain = planner.render(row(messages=PREFILLED, continue_final_message=False, add_generation_prompt=True))
    prefilled = planner.render(row(messages=PREFILLED, continue_final_message=True))
    assert prefilled.endswith("<|im_start|>assistant\nThe capital of France is")
    assert plain.endswith("The capital of France is<|im_end|>\n<|im_start|>assistant\n")
    no_header = planner.render(row(add_generation_prompt=False))
    assert no_header.endswith("What is the capital of France?<|im_end|>\n")


def test_template_variables_and_documents_reach_the_template() -> None:
    planner = planner_with(
        "{% for d in documents or [] %}[{{ d.title }}]{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    rendered = planner.render(row(documents=DOCUMENTS, chat_template_kwargs={"enable_thinking": False}))
    assert rendered == "[France]/no_think user: What is the capital of France?\n"
    assert planner.render(row()) == "user: What is the capital of France?\n"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "developer", "content": "Be brief."}],
        [{"role": "system", "content": "A"}, {"role": "developer", "content": "B"}, {"role": "user", "content": "Hi"}],
        [{"role": "developer", "content": ""}, {"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "A"}, {"role": "user", "content": "Hi"}],
    ],
)
def test_developer_messages_reach_a_template_without_that_role_as_vllm_hands_them(
    messages: list[dict[str, Any]],
) -> None:
    from vllm.renderers.hf import _consolidate_system_messages, _convert_developer_to_system

    theirs = _convert_developer_to_system(messages)  # type: ignore[arg-type]
    if any(m["role"] == "developer" for m in messages):
        theirs = _consolidate_system_messages(theirs)
    assert developer_as_system(messages, CHATML) == theirs
    assert developer_as_system(messages, "{% if m.role == 'developer' %}{% endif %}") == messages
    rendered = planner_with(CHATML).render(row(messages=messages))
    assert ("developer" in rendered) is False


def test_the_configs_template_variables_sit_under_a_rows_own() -> None:
    settings = load_settings(None, {"chat_template_kwargs": {"enable_thinking": False, "style": "terse"}})
    settings = dataclasses.replace(settings, apply_chat_template=True)
    own = {"id": "r", "messages": QUESTION, "chat_template_kwargs": {"style": "long"}, "add_generation_prompt": False}
    assert to_request(own, 0, 1, settings).template_kwargs == {
        "enable_thinking": False,
        "style": "long",
        "add_generation_prompt": False,
    }
    planner = planner_with(
        "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}{{ style }}"
    )
    assert planner.render(to_request({"messages": QUESTION}, 0, 1, settings)) == "/no_think terse"
    raw = dataclasses.replace(settings, apply_chat_template=False)
    assert to_request({"prompt": "Once"}, 0, 1, raw).template_kwargs == {}  # a default, not the row's: no error


@pytest.mark.parametrize("value", [{"tokenize": True}, ["enable_thinking"]])
def test_a_bad_configured_chat_template_kwargs_is_a_config_error(value: Any) -> None:
    with pytest.raises(ConfigError, match="chat_template_kwargs"):
        load_settings(None, {"chat_template_kwargs": value})


@pytest.mark.parametrize(("text", "says"), [("{nope", "takes a JSON object"), ("[1]", "takes a JSON object, got")])
def test_the_flag_takes_a_json_object(tmp_path: Path, text: str, says: str) -> None:
    from typer.testing import CliRunner

    from bulkinfer.cli import app

    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(app, ["run", str(tmp_path / "in.jsonl"), "--chat-template-kwargs", text])
    assert result.exit_code == 2 and says in " ".join(result.output.split()), result.output
