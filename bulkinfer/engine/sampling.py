"""Requests into vLLM and results out: a row's sampling fields as vLLM's
``SamplingParams`` (checked by vLLM itself), and vLLM's ``RequestOutput``
stream as bulkinfer :class:`~bulkinfer.schema.Completion` values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bulkinfer.config import SamplingDefaults
from bulkinfer.errors import ConfigError
from bulkinfer.schema import Choice, Completion, Request

# SamplingParams.extra_args key of a request's top_p for bulkinfer's nucleus processor, and the
# processor as EngineArgs.logits_processors names it (bulkinfer.engine.nucleus).
TOP_P_EXTRA_ARG = "bulkinfer_top_p"


NUCLEUS_PROCESSOR = "bulkinfer.engine.nucleus:NucleusLogitsProcessor"


def top_p_split(request: Request, nucleus: bool) -> tuple[float, dict[str, float] | None]:
    """The ``top_p`` vLLM gets for ``request`` and the ``extra_args`` that
    carry it to bulkinfer's nucleus processor instead (None: vLLM applies
    it). With ``nucleus`` (the engine has the processor), a sampled request
    (temperature > 0) with 0 < ``top_p`` < 1 and no ``top_k`` (vLLM applies
    top-k before top-p, over the same sort) goes to the processor."""
    top_k = request.options.get("top_k")
    if nucleus and request.temperature > 0 and request.top_p < 1 and top_k in (None, 0, -1):
        return 1.0, {TOP_P_EXTRA_ARG: request.top_p}
    return request.top_p, None


def sampling_params(
    request: Request, sampling_params_cls: Any, output_kind: Any, nucleus: bool = False, stream_interval: int = 1
) -> Any:
    """vLLM ``SamplingParams`` for one request (a scoring request: ``max_tokens=1``
    and ``prompt_logprobs=0``, the log-probability of each actual prompt token);
    ``nucleus``: the engine has bulkinfer's nucleus processor (see :func:`top_p_split`);
    ``stream_interval`` (tokens): vLLM's, a streamed request's output comes
    at its first token, then every that many, and when it finishes (1: every
    step; a request's own ``options`` win).

    Raises:
        whatever vLLM's ``SamplingParams`` raises for values it rejects
        (``VLLMValidationError``, a ``ValueError``, since vLLM 0.12).
    """
    if request.score_from is not None:
        return sampling_params_cls(max_tokens=1, temperature=0.0, prompt_logprobs=0, output_kind=output_kind)
    structured = None
    if request.structured is not None:
        from vllm.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(**request.structured)
    top_p, extra_args = top_p_split(request, nucleus)
    every = {"stream_interval": stream_interval} if stream_interval > 1 else {}
    return sampling_params_cls(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=top_p,
        extra_args=extra_args,
        seed=request.seed,
        stop=list(request.stop) or None,
        ignore_eos=request.ignore_eos,
        output_kind=output_kind,
        structured_outputs=structured,
        **{**every, **request.options},
    )


def pooling_params(request: Request, pooling_params_cls: Any) -> list[Any]:
    """vLLM ``PoolingParams`` for each input of one pooling request, in
    input order: ``task`` (``request.pooling["task"]``, default ``"embed"``;
    ``"classify"`` for a cross-encoder's pairs), ``dimensions`` (Matryoshka
    models only) and ``use_activation`` (None: vLLM's default from the
    model's pooler config: normalisation for ``embed``, the sigmoid of a
    one-label classifier). A pair input with ``token_type_starts`` gets
    ``extra_kwargs["compressed_token_type_ids"]``: the position of its first
    segment-B token, as vLLM's cross-encoder renderer passes BERT's token
    type ids (``vllm.entrypoints.pooling.scoring.utils.compress_token_type_ids``).

    Raises:
        whatever vLLM raises for values it rejects (when the request is added).
    """
    params = pooling_params_cls(
        task=request.pooling.get("task", "embed"),
        dimensions=request.pooling.get("dimensions"),
        use_activation=request.pooling.get("use_activation"),
    )
    count = len(request.input_token_ids or ())
    starts = request.pooling.get("token_type_starts")
    if starts is None:
        return [params.clone() for _ in range(count)]
    each = []
    for start in starts:
        one = params.clone()
        one.extra_kwargs = {**(one.extra_kwargs or {}), "compressed_token_type_ids": start}
        each.append(one)
    return each


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


# A log-probability JSON can hold: vLLM's OpenAI server clamps -inf to this too.
MIN_LOGPROB = -9999.0


class _Choice:
    """One choice of a streaming request, as its pieces arrive."""

    __slots__ = ("pieces", "tokens", "logprobs", "finish_reason")

    def __init__(self, logprobs: bool):
        self.pieces: list[str] = []
        self.tokens = 0
        self.logprobs: list[dict[str, Any]] | None = [] if logprobs else None
        self.finish_reason: str | None = None


def _token_logprob(token: str | None, logprob: float) -> dict[str, Any]:
    text = token or ""
    return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode("utf-8"))}


def token_entries(token_ids: Any, positions: Any, top: int) -> list[dict[str, Any]]:
    """OpenAI chat ``logprobs.content`` entries for generated tokens.

    Args:
        token_ids: the sampled token ids.
        positions: vLLM's ``CompletionOutput.logprobs`` for them: per
            position, token id -> ``Logprob`` (``logprob``, ``rank``,
            ``decoded_token``): the sampled token and the ``top`` most likely.
        top: how many alternatives to list (``top_logprobs``).

    Returns:
        One dict per token: ``token``, ``logprob`` (natural log, <= 0,
        -inf clamped to :data:`MIN_LOGPROB` as vLLM's server does),
        ``bytes`` (UTF-8), ``top_logprobs`` (the ``top`` by rank, best first).
    """
    entries = []
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position[token_id]
        best = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top), key=lambda x: x.rank)
        entry = _token_logprob(chosen.decoded_token, chosen.logprob)
        entry["top_logprobs"] = [_token_logprob(lp.decoded_token, lp.logprob) for lp in best]
        entries.append(entry)
    return entries


# Called with each new piece of a watched request: (choice index, text, tokens, finish reason or None).
Watcher = Callable[[int, str, int, str | None], None]


class StreamedOutputs:
    """Turns vLLM's ``RequestOutput`` objects into :class:`Completion` objects.

    A generation request streams (``RequestOutputKind.DELTA``): each output
    holds, for each of its ``n`` choices that moved, the text, token ids and
    log-probabilities new since the last one; the pieces are joined per
    choice when the request finishes. A scoring request (its ``score_from``
    in :attr:`score_from`) comes once, finished, with its ``prompt_logprobs``.
    An embedding request's inputs (vLLM ``PoolingRequestOutput``, one engine
    request each: :meth:`expect_embeddings`) come back as one Completion
    with their vectors once all have finished.
    ``generated_tokens`` counts every completion token seen;
    ``prefilled_tokens`` the prompt tokens of every sequence (a request's
    choice: vLLM runs each of ``n`` as a child request, whose outputs come
    apart) that produced its first output, ``cached_tokens`` those of them
    vLLM served from its prefix cache (each child's
    ``RequestOutput.num_cached_tokens``); :attr:`token_counts`
    and :attr:`prompt_counts` the completion tokens so far (of all its
    choices) and the prompt tokens of each request that has output and has
    not finished (:meth:`running_lengths`: by choice). :attr:`top_logprobs`
    holds, for each request that asked for log-probabilities, how many
    alternatives per token. :attr:`watchers`
    holds, for a request whose caller streams it (an online request), a
    :data:`Watcher` called with each piece as it arrives.
    """

    def __init__(self) -> None:
        # embedding requests: engine request id of each input -> (request id, input index);
        # request id -> one slot per input, filled as they finish
        self.part_of: dict[str, tuple[str, int]] = {}
        self._pooled: dict[str, list[tuple[list[float], int] | str | None]] = {}
        self.score_from: dict[str, int] = {}
        self.top_logprobs: dict[str, int] = {}
        self._choices: dict[str, dict[int, _Choice]] = {}
        self.token_counts: dict[str, int] = {}
        self.prompt_counts: dict[str, int] = {}  # the prompt tokens of each request in token_counts
        self.watchers: dict[str, Watcher] = {}
        self.generated_tokens = 0
        self.prefilled_tokens = self.cached_tokens = 0

    def completions(self, outputs: Any) -> list[Completion]:
        """The finished requests among one step's outputs."""
        done = []
        for out in outputs:
            if out.request_id in self.part_of:
                if out.finished:
                    done.extend(self._pooled_part(out))
                continue
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
            choices = self._choices.get(request_id)
            if choices is None:  # its first output: the prompt has been processed
                choices = self._choices[request_id] = {}
                self.token_counts[request_id] = 0
                self.prompt_counts[request_id] = len(out.prompt_token_ids or ())
            top = self.top_logprobs.get(request_id)
            for piece in out.outputs:
                choice = choices.get(piece.index)
                if choice is None:  # the choice's first output: its sequence's prompt has been processed
                    choice = choices[piece.index] = _Choice(top is not None)
                    self.prefilled_tokens += self.prompt_counts[request_id]
                    self.cached_tokens += getattr(out, "num_cached_tokens", None) or 0
                choice.pieces.append(piece.text)
                choice.tokens += len(piece.token_ids)
                if choice.logprobs is not None and top is not None and piece.logprobs:
                    choice.logprobs += token_entries(piece.token_ids, piece.logprobs, top)
                if piece.finish_reason:
                    choice.finish_reason = piece.finish_reason
                watcher = self.watchers.get(request_id)
                if watcher is not None:
                    watcher(piece.index, piece.text, len(piece.token_ids), piece.finish_reason)
                self.token_counts[request_id] += len(piece.token_ids)
                self.generated_tokens += len(piece.token_ids)
            if out.finished:
                self.watchers.pop(request_id, None)
                done.append(self._finished(out, self._choices.pop(request_id)))
        return done

    def running_lengths(self) -> list[int]:
        """The completion tokens so far of each choice still generating of
        the requests in :attr:`token_counts`: one a sequence (a request of
        ``n`` choices runs ``n``; a choice that ended waits for its request)."""
        return [c.tokens for r in self.token_counts for c in self._choices[r].values() if c.finish_reason is None]

    def ended_sequences(self) -> int:
        """The choices that ended in the requests of :attr:`token_counts` (their request runs on)."""
        return sum(c.finish_reason is not None for r in self.token_counts for c in self._choices[r].values())

    def running_prompt_tokens(self) -> int:
        """The prompt tokens the sequences of :meth:`running_lengths` attend over, summed."""
        return sum(
            n * sum(c.finish_reason is None for c in self._choices[r].values()) for r, n in self.prompt_counts.items()
        )

    def expect_embeddings(self, request_id: str, parts: list[str]) -> None:
        """``request_id`` was added as the engine requests ``parts``, one per input."""
        self._pooled[request_id] = [None] * len(parts)
        for index, part in enumerate(parts):
            self.part_of[part] = (request_id, index)

    def engine_ids(self, request_ids: list[str]) -> list[str]:
        """The engine's request ids of ``request_ids`` (an embedding request's inputs, one each)."""
        parts: dict[str, list[str]] = {request_id: [] for request_id in self._pooled}
        for part, (request_id, _) in self.part_of.items():
            parts[request_id].append(part)
        return [part for request_id in request_ids for part in parts.get(request_id, [request_id])]

    def _pooled_part(self, out: Any) -> list[Completion]:
        """One finished input of an embedding request (vLLM's
        ``PoolingRequestOutput``: ``outputs.data`` the float32 vector);
        the request's :class:`Completion` once all its inputs finished."""
        request_id, index = self.part_of.pop(out.request_id)
        tokens = len(out.prompt_token_ids or ())
        self.prefilled_tokens += tokens
        slots = self._pooled[request_id]
        error = getattr(out, "error", None)
        slots[index] = f"{error}" if error is not None else (out.outputs.data.tolist(), tokens)
        if any(slot is None for slot in slots):
            return []
        del self._pooled[request_id]
        failed = next((slot for slot in slots if isinstance(slot, str)), None)
        if failed is not None:
            return [Completion(request_id, "", "error", 0, 0, error=failed)]
        pooled = [slot for slot in slots if isinstance(slot, tuple)]
        return [
            Completion(
                request_id,
                "",
                "stop",
                prompt_tokens=sum(t for _, t in pooled),
                completion_tokens=0,
                embeddings=tuple(vector for vector, _ in pooled),
            )
        ]

    def forget(self, request_ids: list[str]) -> None:
        """Drop what is kept of unfinished requests (aborted: no more output comes)."""
        for request_id in request_ids:
            kept_maps: tuple[dict[str, Any], ...] = (
                self.score_from,
                self.top_logprobs,
                self._choices,
                self.token_counts,
                self.prompt_counts,
                self._pooled,
                self.watchers,
            )
            for kept in kept_maps:
                kept.pop(request_id, None)
        self.part_of = {part: owner for part, owner in self.part_of.items() if owner[0] in self._pooled}

    def _finished(self, out: Any, choices: dict[int, _Choice]) -> Completion:
        request_id = out.request_id
        self.top_logprobs.pop(request_id, None)
        self.prompt_counts.pop(request_id, None)
        all_choices = tuple(
            Choice(
                index=index,
                text="".join(c.pieces),
                finish_reason=c.finish_reason or "stop",
                completion_tokens=c.tokens,
                logprobs=c.logprobs,
            )
            for index, c in sorted(choices.items())
        )
        first = all_choices[0]
        many = len(all_choices) > 1 or first.logprobs is not None
        return Completion(
            request_id=request_id,
            text=first.text,
            finish_reason=first.finish_reason,
            prompt_tokens=len(out.prompt_token_ids or ()),
            completion_tokens=self.token_counts.pop(request_id),
            choices=all_choices if many else (),
            cached_tokens=int(getattr(out, "num_cached_tokens", None) or 0),
        )

    @staticmethod
    def _scored(out: Any, score_from: int) -> Completion:
        ids = list(out.prompt_token_ids or ())
        logprobs = out.prompt_logprobs or []
        nll = -sum(logprobs[i][ids[i]].logprob for i in range(max(score_from, 1), len(ids)))
        scored = len(ids) - max(score_from, 1)
        return Completion(out.request_id, "", "scored", len(ids), 0, nll=nll, scored_tokens=scored)
