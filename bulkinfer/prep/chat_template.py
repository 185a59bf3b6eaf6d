"""The chat template's own request fields, as vLLM's ``ChatCompletionRequest``
takes them and hands them to the model's chat template (vLLM 0.32
``entrypoints/openai/chat_completion/protocol.py``, ``build_chat_params``;
rendered by ``transformers``' ``apply_chat_template``):

- ``add_generation_prompt`` (boolean, default true): end the prompt with the
  header that starts an assistant message;
- ``continue_final_message`` (boolean, default false): leave the final
  message open, so the model continues it ("prefill": the completion is the
  continuation only); vLLM refuses it together with ``add_generation_prompt``
  true, and so does bulkinfer where a row sets both, while a row that sets
  only ``continue_final_message`` gets ``add_generation_prompt`` false;
- ``documents`` (array of objects): for templates that render retrieved
  documents (RAG);
- ``chat_template_kwargs`` (object): more variables for the template (for
  example ``{"enable_thinking": false}`` for models whose templates read it);
  the fields above win over its keys, as in vLLM; a key that is one of
  ``apply_chat_template``'s own parameters (``tokenize``, ``chat_template``,
  ``return_dict``, ...: :data:`RESERVED_KWARGS`) is refused, as vLLM refuses
  ``tokenize`` and ``chat_template``.

They shape the prompt, not the sampling, so they live here rather than in
:data:`bulkinfer.fields.FIELDS`. A bulkinfer row (sent through the chat
template) and an OpenAI ``/v1/chat/completions`` body take them; a prompt
sent raw cannot (:func:`needs_template`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bulkinfer.fields import RESERVED_KWARGS, shown
from bulkinfer.schema import RowInvalid

TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "documents", "chat_template_kwargs")


def _invalid(name: str, expected: str, value: Any, row_id: str | None, openai: bool) -> RowInvalid:
    return RowInvalid("invalid_field", f"field '{name}': expected {expected}, got {shown(value)}", row_id, openai)


def template_kwargs(source: Mapping[str, Any], row_id: str | None, openai: bool) -> dict[str, Any]:
    """The keyword arguments for ``apply_chat_template`` that a row (or an
    OpenAI chat body) ``source`` sets, merged as vLLM merges them:
    ``chat_template_kwargs`` first, the named fields over it; empty when it
    sets none (then the template gets ``add_generation_prompt=True``).

    Raises:
        RowInvalid: ``invalid_field`` naming the field: a value of the wrong
            type, a reserved ``chat_template_kwargs`` key, or
            ``continue_final_message`` and ``add_generation_prompt`` both true.
    """
    given = {name: source[name] for name in TEMPLATE_FIELDS if source.get(name) is not None}
    if not given:
        return {}
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in given and not isinstance(given[name], bool):
            raise _invalid(name, "true or false", given[name], row_id, openai)
    documents = given.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise _invalid("documents", "a list of objects", documents, row_id, openai)
    extra = given.pop("chat_template_kwargs", {})
    if not isinstance(extra, dict) or not all(isinstance(key, str) for key in extra):
        raise _invalid("chat_template_kwargs", "an object of template variables", extra, row_id, openai)
    if reserved := sorted(RESERVED_KWARGS & extra.keys()):
        raise RowInvalid(
            "invalid_field",
            f"field 'chat_template_kwargs': {', '.join(reserved)} is apply_chat_template's own parameter, "
            "not a template variable (vLLM refuses tokenize and chat_template too)",
            row_id,
            openai,
        )
    kwargs = {**extra, **given}
    if kwargs.get("continue_final_message"):
        if given.get("add_generation_prompt"):
            raise RowInvalid(
                "invalid_field",
                "fields 'continue_final_message' and 'add_generation_prompt' cannot both be true (vLLM's rule): "
                "the final message is continued, or a new assistant message is started",
                row_id,
                openai,
            )
        kwargs["add_generation_prompt"] = False
    return kwargs


def needs_template(kwargs: Mapping[str, Any], row_id: str | None, openai: bool) -> None:
    """Refuse a row sent without the chat template (a raw prompt) that sets
    a chat template field (``kwargs`` as :func:`template_kwargs` built them).

    Raises:
        RowInvalid: ``invalid_field`` naming the first such field.
    """
    if kwargs:
        named = [name for name in ("continue_final_message", "add_generation_prompt", "documents") if name in kwargs]
        name = named[0] if named else "chat_template_kwargs"
        raise RowInvalid(
            "invalid_field",
            f"field '{name}' shapes the chat template, and this row's prompt is sent raw "
            "(--raw-prompts, or a model without a chat template): give 'messages'",
            row_id,
            openai,
        )


def developer_as_system(messages: list[dict[str, Any]], template: Any) -> list[dict[str, Any]]:
    """``messages`` as vLLM 0.32 hands them to a chat ``template`` (a string,
    or transformers' dict of named templates, whose ``default`` is used)
    that never names the ``developer`` role (OpenAI's newer name for the
    system role): each developer message becomes a system message, and the
    system messages are then merged into one, first, their texts joined by a
    blank line (``renderers/hf.py``: ``safe_apply_chat_template``,
    ``_convert_developer_to_system``, ``_consolidate_system_messages``).
    Otherwise ``messages`` as they are."""
    text = template.get("default", "") if isinstance(template, dict) else template or ""
    if not any(m.get("role") == "developer" for m in messages) or '"developer"' in text or "'developer'" in text:
        return messages
    converted = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if systems in ([], [0]):
        return converted
    merged = "\n\n".join(m["content"] for m in converted if m["role"] == "system" and m.get("content"))
    return [{"role": "system", "content": merged}, *(m for m in converted if m["role"] != "system")]
