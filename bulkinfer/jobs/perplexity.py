"""Perplexity of references: the negative log-likelihood of each reference
given its prompt, from vLLM's ``prompt_logprobs`` on prompt + reference
(scoring requests: nothing is generated), sent through the feed loop like
any other request.

Perplexity = exp(NLL / tokens) per row; the corpus perplexity is
exp(total NLL / total reference tokens) (Jelinek et al. 1977; as Hugging
Face's "Perplexity of fixed-length models" guide computes it, without a
stride: a row that does not fit the context is not scored).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bulkinfer.config import Settings
from bulkinfer.engine.base import Engine
from bulkinfer.engine.feed import FeedStopped, feed
from bulkinfer.prep.planner import Planner
from bulkinfer.report.progress import Progress
from bulkinfer.schema import Completion, Request
from bulkinfer.stop import StopToken


@dataclass(slots=True)
class ReferenceNLL:
    """Per row id: ``scored`` (NLL in nats, reference tokens) of the rows
    scored; ``failed``: why a row could not be scored (it does not fit the
    context, its reference is empty, or the engine rejected or failed it)."""

    scored: dict[str, tuple[float, int]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def row_fields(self, row_id: str) -> dict[str, Any]:
        """The fields row ``row_id``'s scored record gets: ``perplexity``
        (exp(NLL / tokens)), or ``perplexity_error`` (why not); none when the
        row was not in the pass."""
        if row_id in self.scored:
            total, count = self.scored[row_id]
            return {"perplexity": math.exp(total / count)}
        if row_id in self.failed:
            return {"perplexity_error": self.failed[row_id]}
        return {}

    def corpus_fields(self) -> dict[str, Any]:
        """The corpus figures of the eval's ``scores``: ``perplexity``
        (exp(total NLL / total reference tokens); None when no row was
        scored), ``perplexity_rows``, ``perplexity_tokens`` (reference tokens)
        and ``perplexity_failed`` (rows)."""
        total_nll = sum(nll for nll, _ in self.scored.values())
        total_tokens = sum(tokens for _, tokens in self.scored.values())
        return {
            "perplexity": math.exp(total_nll / total_tokens) if total_tokens else None,
            "perplexity_rows": len(self.scored),
            "perplexity_tokens": total_tokens,
            "perplexity_failed": len(self.failed),
        }


def reference_nll(
    rows: list[tuple[Request, str]],
    tokenizer: Any,
    engine: Engine,
    settings: Settings,
    progress_plain: bool = False,
    stop: StopToken | None = None,
) -> ReferenceNLL:
    """The NLL of each ``(request, reference)`` pair's reference given the
    request's prompt (its chat template applied as the generation did);
    every row ends scored or failed, with the reason.

    Raises:
        Interrupted: ``stop`` was set.
        EngineError: the engine died.
    """
    planner = Planner(tokenizer, settings.plan, engine.max_model_len)
    result = ReferenceNLL()
    pending: list[Request] = []
    for request, reference in rows:
        if request.prompts is not None:
            result.failed[request.id] = f"a reference scores after one prompt; this row has {len(request.prompts)}"
            continue
        prompt_ids = planner.encode(request)
        reference_ids = list(tokenizer(reference, add_special_tokens=False)["input_ids"])
        if not reference_ids:
            result.failed[request.id] = "the reference is empty"
        elif len(prompt_ids) + len(reference_ids) > engine.max_model_len:
            result.failed[request.id] = (
                f"prompt + reference are {len(prompt_ids) + len(reference_ids)} tokens, "
                f"more than the context ({engine.max_model_len})"
            )
        else:
            request.prompt_token_ids = prompt_ids + reference_ids
            request.score_from = len(prompt_ids)
            pending.append(request)
    progress = Progress(len(pending), force_plain=progress_plain, task="perplexity", tokens="reference")

    def finished(request: Request, completion: Completion) -> None:
        if completion.nll is not None and completion.scored_tokens:
            result.scored[request.id] = (completion.nll, completion.scored_tokens)
            progress.update(done=1, completion_tokens=completion.scored_tokens)
        else:
            failed(request, "the engine returned no prompt logprobs")

    def failed(request: Request, message: str) -> None:
        result.failed[request.id] = message
        progress.update(failed=1)

    try:
        feed(
            engine,
            iter(pending),
            max_in_flight=settings.plan.max_in_flight or 2 * engine.max_num_seqs,
            on_finished=finished,
            on_failed=failed,
            stop=stop,
            id_prefix="ppl-",  # apart from the generation's ids on a kept engine
        )
    except FeedStopped:
        raise (stop or StopToken()).interrupted(
            f"during the perplexity pass, {len(result.scored)} rows scored"
        ) from None
    finally:
        progress.close()
    return result
