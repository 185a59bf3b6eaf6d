"""Requests into vLLM and results out: a row's sampling fields as vLLM's
``SamplingParams`` (checked by vLLM itself), and vLLM's ``RequestOutput``
stream as bulkinfer :class:`~bulkinfer.schema.Completion` values."""

from __future__ import annotations

from typing import Any

from bulkinfer.config import SamplingDefaults
from bulkinfer.errors import ConfigError
from bulkinfer.schema import Completion, Request


def sampling_params(request: Request, sampling_params_cls: Any, output_kind: Any) -> Any:
    """vLLM ``SamplingParams`` for one request (a scoring request: ``max_tokens=1``
    and ``prompt_logprobs=0``, the log-probability of each actual prompt token).

    Raises:
        whatever vLLM's ``SamplingParams`` raises for values it rejects
        (``VLLMValidationError``, a ``ValueError``, since vLLM 0.12).
    """
    if request.score_from is not None:
        return sampling_params_cls(max_tokens=1, temperature=0.0, prompt_logprobs=0, output_kind=output_kind)
    return sampling_params_cls(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=list(request.stop) or None,
        ignore_eos=request.ignore_eos,
        output_kind=output_kind,
    )


def check_sampling_defaults(defaults: SamplingDefaults) -> None:
    """Build vLLM's ``SamplingParams`` from the run's ``[sampling]`` defaults
    once, before any model loads, so a default vLLM rejects (``stop = [""]``)
    fails the run at once instead of every row. Without vLLM installed it
    checks nothing (the engine's start reports that).

    Raises:
        ConfigError: vLLM rejects a default; the message is vLLM's.
    """
    try:
        from vllm import SamplingParams
    except ImportError:
        return
    probe = Request(
        seq=0,
        line=0,
        id="[sampling]",
        prompt="-",
        messages=None,
        max_tokens=defaults.max_tokens,
        temperature=defaults.temperature,
        top_p=defaults.top_p,
        seed=defaults.seed,
        stop=defaults.stop,
        ignore_eos=defaults.ignore_eos,
    )
    try:
        sampling_params(probe, SamplingParams, None)
    except Exception as exc:
        raise ConfigError(f"[sampling] defaults rejected by vLLM: {exc}") from None


class StreamedOutputs:
    """Turns vLLM's ``RequestOutput`` objects into :class:`Completion` objects.

    A generation request streams (``RequestOutputKind.DELTA``): each output
    holds the text and token ids new since the last one; the pieces are
    joined when it finishes. A scoring request (its ``score_from`` in
    :attr:`score_from`) comes once, finished, with its ``prompt_logprobs``.
    ``generated_tokens`` counts every completion token seen;
    ``prefilled_tokens`` the prompt tokens of every request that produced
    its first output.
    """

    def __init__(self) -> None:
        self.score_from: dict[str, int] = {}
        self._pieces: dict[str, list[str]] = {}
        self.token_counts: dict[str, int] = {}
        self.generated_tokens = 0
        self.prefilled_tokens = 0

    def completions(self, outputs: Any) -> list[Completion]:
        """The finished requests among one step's outputs."""
        done = []
        for out in outputs:
            if not isinstance(out.outputs, list):
                continue
            request_id = out.request_id
            score_from = self.score_from.pop(request_id, None) if out.finished else None
            if score_from is not None:
                self.prefilled_tokens += len(out.prompt_token_ids or ())
                done.append(self._scored(out, score_from))
                continue
            if not out.outputs:
                continue
            choice = out.outputs[0]
            pieces = self._pieces.get(request_id)
            if pieces is None:  # its first output: the prompt has been processed
                pieces = self._pieces[request_id] = []
                self.token_counts[request_id] = 0
                self.prefilled_tokens += len(out.prompt_token_ids or ())
            pieces.append(choice.text)
            self.token_counts[request_id] += len(choice.token_ids)
            self.generated_tokens += len(choice.token_ids)
            if not out.finished:
                continue
            del self._pieces[request_id]
            done.append(
                Completion(
                    request_id=request_id,
                    text="".join(pieces),
                    finish_reason=choice.finish_reason or "stop",
                    prompt_tokens=len(out.prompt_token_ids or ()),
                    completion_tokens=self.token_counts.pop(request_id),
                )
            )
        return done

    @staticmethod
    def _scored(out: Any, score_from: int) -> Completion:
        ids = list(out.prompt_token_ids or ())
        logprobs = out.prompt_logprobs or []
        nll = -sum(logprobs[i][ids[i]].logprob for i in range(max(score_from, 1), len(ids)))
        scored = len(ids) - max(score_from, 1)
        return Completion(out.request_id, "", "scored", len(ids), 0, nll=nll, scored_tokens=scored)
