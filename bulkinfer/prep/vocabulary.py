"""The model's vocabulary, and the rows that name a token outside it: refused
before the engine starts, as vLLM would refuse them when they are added.

vLLM 0.32 checks three token-id fields of a request against two bounds:

- ``stop_token_ids`` and ``logit_bias``'s keys: each in ``[0, vocab_size)``,
  ``vocab_size`` the model's (``ModelConfig.get_vocab_size()``: the
  ``vocab_size`` of its Hugging Face text config; they index the logits'
  columns): ``SamplingParams._validate_stop_token_ids`` and
  ``_validate_logit_bias``, "token_id(s) [...] in logit_bias contain
  out-of-vocab token ids";
- a prompt given as token ids: each at most ``max(tokenizer.max_token_id,
  vocab_size - 1)`` (``BaseRenderer.validate_token_ids``, "Token id N is out
  of vocabulary"), ``max_token_id`` the largest id of the tokenizer's
  ``get_vocab()`` or ``vocab_size - 1`` of the tokenizer
  (``vllm/tokenizers/hf.py``), whichever is larger. Negative ids are refused
  where the row is parsed (``integers >= 0``).

Found by the planner, such a row is an ``invalid_field`` error record
naming the field and the bound, and ``bulkinfer plan`` counts it as
failing; a model whose config gives no vocabulary size is left to the
engine's own check (the row's ``engine_error``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.errors import ConfigError
from bulkinfer.prep.grammar import Grammars
from bulkinfer.schema import Request
from bulkinfer.settings import SamplingDefaults

# Where a multimodal model's config keeps its language model's (transformers' get_text_config: text_config first).
_TEXT_CONFIGS = ("text_config", "language_config", "llm_config")


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The token ids a model takes.

    Attributes:
        size: the model's vocabulary size in tokens (ids ``0 .. size - 1``
            for ``stop_token_ids`` and ``logit_bias``).
        max_prompt_id: the largest token id a prompt may hold:
            ``max(tokenizer's largest id, size - 1)``.
    """

    size: int
    max_prompt_id: int

    def problem(self, request: Request) -> str | None:
        """What is wrong with ``request``'s token ids, naming the field
        (``"field 'logit_bias': token id 999999 is outside the model's
        vocabulary: ids 0-49151"``), or None when every id is in range. A
        field the row left to the ``[sampling]`` defaults is named as the
        default."""
        if request.prompts is not None:
            for index, prompt in enumerate(request.prompts):
                if not isinstance(prompt, str) and (bad := _over(prompt, self.max_prompt_id)) is not None:
                    return self._said(f"field 'prompt[{index}]'", bad, self.max_prompt_id)
        elif request.prompt_token_ids is not None:
            if (bad := _over(request.prompt_token_ids, self.max_prompt_id)) is not None:
                return self._said("field 'prompt'", bad, self.max_prompt_id)
        for name in ("stop_token_ids", "logit_bias"):
            ids = request.options.get(name)
            if ids and (bad := _over(ids, self.size - 1)) is not None:
                named = name if name in request.row_sampling else f"{name} (the [sampling] default)"
                return self._said(f"field '{named}'", bad, self.size - 1)
        return None

    def defaults_problem(self, sampling: SamplingDefaults) -> str | None:
        """What is wrong with the ``[sampling]`` defaults' token ids
        (``stop_token_ids``, ``logit_bias``: set by flags or the config, so
        every row that leaves them to the defaults would fail), naming the
        setting (``"sampling.stop_token_ids (--stop-token-ids or the
        config): token id 60000 is outside the model's vocabulary: ids
        0-49151"``), or None."""
        for name, ids in (("stop_token_ids", sampling.stop_token_ids), ("logit_bias", sampling.logit_bias or {})):
            bad = _over((int(token_id) for token_id in ids), self.size - 1)
            if bad is not None:
                flag = "--" + name.replace("_", "-")
                return self._said(f"sampling.{name} ({flag} or the config)", bad, self.size - 1)
        return None

    @staticmethod
    def _said(named: str, token_id: int, highest: int) -> str:
        return f"{named}: token id {token_id} is outside the model's vocabulary: ids 0-{highest}"


def _over(ids: Iterable[int], highest: int) -> int | None:
    """The first id of ``ids`` over ``highest`` (or under 0), else None."""
    return next((token_id for token_id in ids if not 0 <= token_id <= highest), None)


def model_vocab_size(model_path: str) -> int | None:
    """The ``vocab_size`` of the local model directory ``model_path``'s
    ``config.json``, from its language model's config when it has one
    (``text_config``, ``language_config``, ``llm_config``); None for a hub
    id, an unreadable config or none given."""
    try:
        config = orjson.loads((Path(model_path) / "config.json").read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = next((config[key] for key in _TEXT_CONFIGS if isinstance(config.get(key), dict)), config)
    size = text.get("vocab_size", config.get("vocab_size"))
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def vocabulary(tokenizer: Any, model_path: str) -> Vocabulary | None:
    """The :class:`Vocabulary` of the model at ``model_path`` with its
    Hugging Face ``tokenizer``, or None when the model's size is unknown
    (:func:`model_vocab_size`): its rows are then left to the engine."""
    size = model_vocab_size(model_path)
    if size is None:
        return None
    highest = size - 1
    try:
        highest = max(highest, max(tokenizer.get_vocab().values()), int(tokenizer.vocab_size) - 1)
    except (AttributeError, TypeError, ValueError, NotImplementedError):
        pass  # a tokenizer without these: the model's bound alone
    return Vocabulary(size, highest)


def check_defaults(vocab: Vocabulary | None, sampling: SamplingDefaults, grammars: Grammars | None = None) -> None:
    """Refuses ``[sampling]`` defaults that name a token id outside the
    model's vocabulary ``vocab`` (:meth:`Vocabulary.defaults_problem`; none
    checked when it is unknown, None) or a structured output the engine's
    grammar backend refuses (:meth:`~bulkinfer.prep.grammar.Grammars.defaults_problem`),
    before any row is read or an engine starts.

    Raises:
        ConfigError: naming the setting and what is wrong with it (exit 2).
    """
    problem = vocab.defaults_problem(sampling) if vocab is not None else None
    problem = problem or (grammars.defaults_problem(sampling) if grammars is not None else None)
    if problem:
        raise ConfigError(problem)
