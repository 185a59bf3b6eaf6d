"""A message's content parts read as vLLM's chat API reads them for a chat
template that takes string content (the default model's): the text parts
joined with a newline, an assistant's null content (tool calls) empty;
checked against vLLM's own ``_parse_chat_message_content``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.renderers.chat_utils import _parse_chat_message_content

from bulkinfer.config import SamplingDefaults
from bulkinfer.prep.rows import TEXT_PARTS, parse_row
from bulkinfer.schema import RowInvalid

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def vllm_content(message: dict[str, Any]) -> str:
    """The content vLLM 0.32 hands a string-content chat template for ``message``."""
    parser = SimpleNamespace(model_config=SimpleNamespace(enable_prompt_embeds=False), mm_placeholder_storage=dict)
    tracker = SimpleNamespace(create_parser=lambda **_: parser)
    (parsed,) = _parse_chat_message_content(message, tracker, "string", interleave_strings=False)  # type: ignore[arg-type]
    return str(parsed["content"])


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": [{"type": "text", "text": str(k)} for k in range(1, 5)]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, "b", {"type": "output_text", "text": "c"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}, {"type": "thinking", "thinking": "t"}]},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": [{"type": "text", "text": "4"}, "2"], "tool_call_id": "1"},
        {"role": "user", "content": []},
    ],
)
def test_content_parts_read_as_vllm_reads_them(message: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "hi"}, message] if message["role"] != "user" else [message]
    parsed = parse_row({"id": "r", "messages": messages}, 0, 1, SamplingDefaults())
    assert parsed.messages is not None and parsed.messages[-1]["content"] == vllm_content(message)
    assert {k: v for k, v in parsed.messages[-1].items() if k != "content"} == {
        k: v for k, v in message.items() if k != "content"
    }  # tool_calls and tool_call_id reach the template


def test_every_text_part_type_of_vllm_is_read_and_media_or_a_users_null_content_is_the_rows_error() -> None:
    from vllm.renderers.chat_utils import TEXT_PART_TYPES

    assert set(TEXT_PARTS) == set(TEXT_PART_TYPES)
    for content in (None, [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}], [{"type": "text"}]):
        with pytest.raises(RowInvalid) as info:
            parse_row({"id": "r", "messages": [{"role": "user", "content": content}]}, 0, 1, SamplingDefaults())
        assert "'messages[0].content'" in info.value.message and "text models: no media" in info.value.message
