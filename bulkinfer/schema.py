"""The data model in one place: a :class:`Request` (one valid input row), a
:class:`RowError` (one failed row) and a :class:`Completion` (what the engine
returned for a request). Every layer speaks these; this module imports
nothing of bulkinfer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHAT_URL = "/v1/chat/completions"


COMPLETIONS_URL = "/v1/completions"


EMBEDDINGS_URL = "/v1/embeddings"


@dataclass(slots=True)
class Request:
    """One valid input row, ready to be tokenized and sent to the engine.

    ``seq`` is the 0-based arrival position among all rows read; ``line`` the
    1-based line (JSONL) or row (Parquet) number. ``prompt_token_ids`` is set
    by the planner. ``openai_url`` is set for OpenAI batch lines and selects
    the output shape.
    """

    seq: int
    line: int
    id: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool = False
    # The other arguments of vLLM's SamplingParams the row (or [sampling])
    # sets, by vLLM's names: n, presence_penalty, frequency_penalty,
    # repetition_penalty, top_k, min_p, min_tokens, stop_token_ids,
    # logit_bias, logprobs (the top alternatives per token; None: none).
    options: dict[str, Any] = field(default_factory=dict)
    # vLLM's StructuredOutputsParams arguments (one constraint), or None.
    structured: dict[str, Any] | None = None
    # vLLM's request priority: lower runs first (priority scheduling).
    priority: int = 0
    passthrough: dict[str, Any] = field(default_factory=dict)
    # The request fields (bulkinfer.fields.FIELDS) the row (or OpenAI body) set
    # itself, as it names them; the rest are the [sampling] defaults.
    row_sampling: tuple[str, ...] = ()
    # Keyword arguments for the chat template (bulkinfer.prep.chat_template):
    # add_generation_prompt, continue_final_message, documents, variables.
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    openai_url: str | None = None
    prompt_token_ids: list[int] | None = None
    # Several prompts in one OpenAI /v1/completions line (its ``prompt`` a
    # list of them): each becomes a part, a Request of one prompt planned and
    # run as any other (the planner sets ``parts`` and the first part's
    # ``prompt_token_ids`` here), and the line's record joins their choices,
    # prompt j's n choices at indices j*n .. j*n+n-1 (bulkinfer.engine.feed).
    prompts: list[str | list[int]] | None = None
    parts: list[Request] | None = None
    # Set for a scoring request (perplexity): the position in prompt_token_ids
    # where the scored continuation starts; the engine then generates nothing.
    score_from: int | None = None
    # An embedding request (bulkinfer embed): its texts or token ids (one per vector; an
    # OpenAI line's ``input`` may list several), then their token ids once
    # planned, and vLLM's PoolingParams arguments (``dimensions``,
    # ``use_activation``: normalize as the model's sentence-transformers
    # config says) with the output's ``encoding_format``.
    inputs: list[str | list[int]] | None = None
    input_token_ids: list[list[int]] | None = None
    pooling: dict[str, Any] = field(default_factory=dict)
    # A similarity request (bulkinfer score): which pairs of its inputs are
    # scored and how the scores become the output: ``shape`` ("pair",
    # "rerank" or "score"), ``pairs`` ((i, j) positions in ``inputs``, in
    # output order), ``names`` (each input's field), ``top_n`` and
    # ``documents`` (rerank), and ``method`` "cross-encoder" once planned for
    # one (then one pooled output per pair); see bulkinfer.prep.scores.
    similarity: dict[str, Any] | None = None

    @property
    def prompt_length(self) -> int:
        """Prompt tokens of the request (of all its inputs for an embedding
        request, of all its parts' prompts for several prompts)."""
        if self.input_token_ids is not None:
            return sum(len(ids) for ids in self.input_token_ids)
        if self.parts is not None:
            return sum(part.prompt_length for part in self.parts)
        return len(self.prompt_token_ids or ())

    @property
    def n(self) -> int:
        """The completions it asks for of each prompt (``SamplingParams.n``)."""
        return int(self.options.get("n", 1))

    @property
    def sequences(self) -> int:
        """The sequences the engine runs for it: ``n`` for each of its prompts."""
        return self.n * len(self.prompts or [None])

    @property
    def max_completion_tokens(self) -> int:
        """Completion tokens this request may generate in all: ``max_tokens``
        for each of its :attr:`sequences`."""
        return self.max_tokens * self.sequences


@dataclass(frozen=True, slots=True)
class RowError:
    """One failed row: where it was, what it was called, and what went wrong.

    ``type`` is one of: ``invalid_json``, ``invalid_row``, ``missing_field``,
    ``invalid_field``, ``unsupported_field``, ``context_length_exceeded``,
    ``duplicate_id``, ``engine_error``.
    """

    line: int
    id: str | None
    type: str
    message: str
    openai: bool = False
    # The id was read from the bytes of a line that is not valid JSON (best effort).
    id_recovered: bool = False


class RowInvalid(Exception):
    """Raised by :func:`parse_row`; carries the error ``type`` and message."""

    def __init__(
        self, type_: str, message: str, row_id: str | None = None, openai: bool = False, id_recovered: bool = False
    ):
        super().__init__(message)
        self.type = type_
        self.message = message
        self.row_id = row_id
        self.openai = openai
        self.id_recovered = id_recovered

    def to_error(self, line: int) -> RowError:
        return RowError(line, self.row_id, self.type, self.message, self.openai, self.id_recovered)


@dataclass(frozen=True, slots=True)
class Choice:
    """One of a request's ``n`` completions (OpenAI's ``choices[index]``).

    ``logprobs``, when asked for: one entry per completion token in the shape
    of OpenAI's chat ``choices[].logprobs.content[]`` (``token``, ``logprob``
    (natural log, <= 0), ``bytes`` (the token's UTF-8 bytes), ``top_logprobs``:
    the most likely tokens at that position, best first, each ``token``,
    ``logprob``, ``bytes``).
    """

    index: int
    text: str
    finish_reason: str
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request. ``error`` is set (and text empty) when the engine
    rejected or failed this one request.

    ``text`` and ``finish_reason`` are the first choice's;
    ``completion_tokens`` counts every choice's tokens (OpenAI's
    ``usage.completion_tokens``). ``choices`` holds all ``n`` of them (with
    their log-probabilities) when the engine returned them; empty means one
    choice, the fields above. ``cached_tokens``: prompt tokens the engine
    served from its prefix cache (vLLM's ``RequestOutput.num_cached_tokens``;
    OpenAI's ``usage.prompt_tokens_details.cached_tokens``).
    """

    request_id: str
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    choices: tuple[Choice, ...] = ()
    # Scoring requests only: negative log-likelihood (nats) of the tokens from
    # ``score_from`` on, and how many tokens that is.
    nll: float | None = None
    scored_tokens: int = 0
    cached_tokens: int = 0
    # Embedding requests only: one vector (float32 values) per input, in input order.
    embeddings: tuple[list[float], ...] | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        """The completion tokens of each choice (one sequence each), in index order."""
        return tuple(c.completion_tokens for c in self.choices) if self.choices else (self.completion_tokens,)


@dataclass(slots=True)
class Done:
    """What earlier attempts of this run finished, read back from the spools."""

    done_ids: set[str] = field(default_factory=set)
    done_lines: set[int] = field(default_factory=set)
    # The ids of the error records (a row's id claims it whether it ran or failed).
    failed_ids: set[str] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
