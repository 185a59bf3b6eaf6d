"""Request parameters bulkinfer reads from no row, by job: named in a
bulkinfer row, one is an ``unsupported_field`` error record, not a
pass-through field. A row that says ``"tools": [...]``, ``"echo": true``,
``"max_new_tokens": 64`` or ``"dimensions": 256`` asks for something its
output would silently lack; every other field a row carries is data, copied
to its output.

The names are OpenAI's (the ``openai`` SDK's ``CompletionCreateParams`` of
chat and of completions, ``EmbeddingCreateParams``) and vLLM 0.32's (its
OpenAI server's ``ChatCompletionRequest``, ``CompletionRequest``,
``EmbeddingCompletionRequest``, ``EmbeddingChatRequest``, score and rerank
requests, and ``SamplingParams``); ``tests/prep/test_unapplied.py`` checks
that each of those is read by bulkinfer, :data:`HARMLESS` or named here.
Hugging Face ``generate``'s and OpenAI's Responses API's names for what
bulkinfer reads as ``max_tokens`` or ``n`` are named too, with the field to
use instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bulkinfer.schema import RowInvalid

# Request fields that do not change a completion or a vector (a user, caching,
# routing, tracing, a predicted output; a priority, where a job does not read
# it): accepted and not used in an OpenAI body, passed through in a bulkinfer
# row.
HARMLESS = frozenset(
    {
        "model",
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prediction",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "cache_salt",
        "request_id",
        "session_id",
        "kv_transfer_params",
        "ec_transfer_params",
        "stream_interval",
        "priority",
    }
)

# Values that ask for what bulkinfer does anyway: accepted wherever the name is
# refused (a completions ``echo`` false, no tool called).
ANYWAY: dict[str, Any] = {"stream": False, "encoding_format": "float", "echo": False, "tool_choice": "none"}


def not_asked(name: str, value: Any) -> bool:
    """Whether request field ``name`` given ``value`` asks for nothing
    bulkinfer would have to do: None (JSON null, a Parquet null: not given,
    as OpenAI reads null) or its :data:`ANYWAY` value."""
    return value is None or (name in ANYWAY and type(value) is type(ANYWAY[name]) and value == ANYWAY[name])


# Refused in every job's rows (but as ANYWAY).
_EVERY_JOB = {"stream": "each row gets one whole response"}

_STRUCTURED = "use response_format or structured_outputs (vLLM's names since 0.11)"
_TEMPLATE = "the model's own chat template is applied as it is"
_SHAPE = "bulkinfer's output records have one shape"

# Generation (``bulkinfer run``, ``eval``): name -> why it is not applied, or the field to use.
GENERATION: dict[str, str] = {
    **_EVERY_JOB,
    **dict.fromkeys(("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"), "no tool calling"),
    **dict.fromkeys(("audio", "modalities"), "text output only"),
    **dict.fromkeys(
        ("reasoning_effort", "include_reasoning", "thinking_token_budget", "verbosity"), "no reasoning controls"
    ),
    "web_search_options": "no web search",
    "moderation": "no moderation",
    "echo": "the completion is returned without its prompt",
    "suffix": "no insertion",
    "best_of": "use n",
    "use_beam_search": "no beam search",
    "length_penalty": "no beam search",
    "stream_options": "each row gets one whole response",
    **dict.fromkeys(
        (
            "prompt_logprobs",
            "logprob_token_ids",
            "prompt_logprob_token_ids",
            "prompt_logprob_start",
            "flat_logprobs",
            "return_token_ids",
            "return_tokens_as_token_ids",
            "return_token_offsets",
            "return_prompt_text",
            "return_mm_kwargs",
            "routed_experts_prompt_start",
            "trace_decode_token_ids",
            "output_kind",
        ),
        _SHAPE,
    ),
    **dict.fromkeys(
        (
            "allowed_token_ids",
            "bad_words",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
            "output_text_buffer_length",
            "repetition_detection",
            "watermarking",
            "logits_processors",
            "extra_args",
            "vllm_xargs",
            "skip_clone",
            "skip_reading_prefix_cache",
        ),
        "not among the sampling fields bulkinfer applies (README, Input)",
    ),
    **dict.fromkeys(("truncate_prompt_tokens", "truncation_side"), "a prompt too long is an error record, never cut"),
    **dict.fromkeys(("add_special_tokens", "chat_template"), _TEMPLATE),
    **dict.fromkeys(("mm_processor_kwargs", "media_io_kwargs", "mm_payload", "prompt_embeds"), "text input only"),
    **dict.fromkeys(
        (
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "guided_decoding_backend",
            "guided_whitespace_pattern",
            "structural_tag",
        ),
        _STRUCTURED,
    ),
    **dict.fromkeys(("max_new_tokens", "max_output_tokens", "max_length"), "use max_tokens"),
    "num_return_sequences": "use n",
    "do_sample": "use temperature (0: greedy)",
    "num_beams": "no beam search",
}

# Embedding (``bulkinfer embed``).
EMBEDDING: dict[str, str] = {
    **_EVERY_JOB,
    "dimensions": "vectors keep the model's size",
    **dict.fromkeys(("encoding_format", "embed_dtype", "endianness"), "vectors are written as float32 lists"),
    **dict.fromkeys(("truncate_prompt_tokens", "truncation_side"), "a text too long is an error record, never cut"),
    **dict.fromkeys(("use_activation", "padding"), "the model's own pooling is applied as it is"),
    **dict.fromkeys(
        ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template"),
        "rows embed 'text' (or 'input') as it is",
    ),
    **dict.fromkeys(("chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs"), "text input only"),
}

# Scoring and reranking (``bulkinfer score``).
SCORING: dict[str, str] = {
    **_EVERY_JOB,
    **dict.fromkeys(("queries", "items", "data_1", "data_2"), "rows give text_1 and text_2, or query and documents"),
    **dict.fromkeys(
        ("truncate_prompt_tokens", "truncation_side", "max_tokens_per_doc", "max_tokens_per_query"),
        "a text too long is an error record, never cut",
    ),
    **dict.fromkeys(("use_activation", "padding", "instruction"), "the model's own scoring is applied as it is"),
    **dict.fromkeys(("chat_template_kwargs", "mm_processor_kwargs"), "text input only"),
}


def check_unapplied(data: Mapping[str, Any], unapplied: Mapping[str, str], row_id: str) -> None:
    """Refuse a bulkinfer row that names a request parameter of
    ``unapplied`` (:data:`GENERATION`, :data:`EMBEDDING`, :data:`SCORING`);
    a field that is None (JSON null, a Parquet null) is not given, and one
    whose value asks for what bulkinfer does anyway (:data:`ANYWAY`:
    ``stream`` false, ``encoding_format`` "float") is accepted.

    Raises:
        RowInvalid: ``unsupported_field``, naming the first such field, why
            (or the field to use), and that a column of data by that name
            must be renamed.
    """
    for name, value in data.items():
        if name not in unapplied or not_asked(name, value):
            continue
        raise RowInvalid(
            "unsupported_field",
            f"field '{name}' is a request parameter bulkinfer does not apply ({unapplied[name]}); the row was not run "
            "(a column of data by that name: rename it)",
            row_id,
        )
