"""Plan: tokenize prompts, sort them by length, group them into buckets, and
account for the padding a static batcher would have needed.

Padding efficiency (real tokens / padded tokens) is the figure of merit of
static batching (Hugging Face ``generate``, hand-written batchers): a batch of
``B`` prompts is padded to its longest prompt, so it holds ``B x max_len``
positions of which ``sum(len)`` are real. vLLM does not pad (paged attention
stores each sequence's own tokens), so for the vLLM run these numbers report
what sorting and bucketing *would* save a static batcher; the real effect of
sorting on vLLM is measured in ``bench/``.
"""

from __future__ import annotations

import bisect
import difflib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from bulkinfer.config import PlanSettings
from bulkinfer.prep.chat_template import developer_as_system
from bulkinfer.prep.grammar import Grammars
from bulkinfer.prep.prefix import PrefixStats, prefix_groups
from bulkinfer.prep.rows import CONSUMED_FIELDS
from bulkinfer.prep.vocabulary import Vocabulary
from bulkinfer.schema import Request, RowError


class RowCheck(Protocol):
    """A check of a request before it is tokenized: its error message, or None."""

    def problem(self, request: Request) -> str | None: ...


class UnscheduledPriority:
    """Rows that set a ``priority`` (or leave a ``[sampling] priority`` to
    the default) for an engine that schedules first come, first served
    (vLLM's ``scheduling_policy = "fcfs"``, which ignores a request's
    priority without a word: vLLM 0.32's ``Scheduler``); a run on its own
    engine starts it with priority scheduling when rows set one, an engine
    opened before the run (:func:`bulkinfer.open_engine`) keeps its own."""

    def problem(self, request: Request) -> str | None:
        """The error of a request that sets a priority, or None."""
        if not request.priority:
            return None
        named = "priority" if "priority" in request.row_sampling else "priority (the [sampling] default)"
        return (
            f"field '{named}': this engine schedules first come, first served and would ignore it; open it with "
            "engine_args={'scheduling_policy': 'priority'} (bulkinfer.open_engine)"
        )


def bucket_index(prompt_tokens: int, bounds: Sequence[int]) -> int:
    """Index of the bucket holding a prompt of ``prompt_tokens`` tokens: the
    first bound >= the length, or ``len(bounds)`` for the open last bucket."""
    return bisect.bisect_left(bounds, prompt_tokens)


def bucket_label(index: int, bounds: Sequence[int]) -> str:
    """Human label of bucket ``index``, e.g. ``"17-32"`` or ``"8193+"`` (tokens)."""
    low = bounds[index - 1] + 1 if index > 0 else 1
    if index >= len(bounds):
        return f"{low}+"
    return f"{low}-{bounds[index]}"


def static_batch_tokens(lengths: Sequence[int], batch_size: int) -> tuple[int, int]:
    """(real, padded) prompt tokens when ``lengths`` are cut, in the given order,
    into static batches of ``batch_size`` each padded to its longest prompt."""
    real = sum(lengths)
    padded = 0
    for start in range(0, len(lengths), batch_size):
        batch = lengths[start : start + batch_size]
        padded += len(batch) * max(batch)
    return real, padded


def efficiency(real: int, padded: int) -> float:
    """real / padded, or 1.0 for no tokens at all."""
    return real / padded if padded else 1.0


@dataclass(slots=True)
class BucketStats:
    rows: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0


@dataclass(slots=True)
class PaddingStats:
    """Streaming padding accounting over all planned prompts.

    ``arrival`` batches are cut from the whole stream in arrival order (a batch
    may span windows); ``sorted`` batches are cut within each bucket of each
    window sorted longest first (the default feed order), B at a time.
    """

    bounds: tuple[int, ...]
    batch_size: int
    buckets: dict[int, BucketStats] = field(default_factory=dict)
    arrival_real: int = 0
    arrival_padded: int = 0
    _pending: list[int] = field(default_factory=list)

    def add_window(self, arrival_lengths: Sequence[int]) -> None:
        """Account for one window of prompt lengths (tokens), in arrival order."""
        self._pending.extend(arrival_lengths)
        full = len(self._pending) - len(self._pending) % self.batch_size
        real, padded = static_batch_tokens(self._pending[:full], self.batch_size)
        self.arrival_real += real
        self.arrival_padded += padded
        del self._pending[:full]
        by_bucket: dict[int, list[int]] = {}
        for length in sorted(arrival_lengths, reverse=True):
            by_bucket.setdefault(bucket_index(length, self.bounds), []).append(length)
        for index, lengths in by_bucket.items():
            real, padded = static_batch_tokens(lengths, self.batch_size)
            stats = self.buckets.setdefault(index, BucketStats())
            stats.rows += len(lengths)
            stats.real_tokens += real
            stats.padded_tokens += padded

    def finish(self) -> None:
        """Close the last, partial arrival-order batch."""
        real, padded = static_batch_tokens(self._pending, self.batch_size)
        self.arrival_real += real
        self.arrival_padded += padded
        self._pending.clear()

    def to_report(self) -> dict[str, Any]:
        """``buckets`` rows and overall ``padding_efficiency`` for the report."""
        buckets = [
            {
                "range": bucket_label(index, self.bounds),
                "rows": s.rows,
                "real_tokens": s.real_tokens,
                "padded_tokens": s.padded_tokens,
                "padding_efficiency": efficiency(s.real_tokens, s.padded_tokens),
            }
            for index, s in sorted(self.buckets.items())
        ]
        sorted_real = sum(s.real_tokens for s in self.buckets.values())
        sorted_padded = sum(s.padded_tokens for s in self.buckets.values())
        return {
            "buckets": buckets,
            "padding_efficiency": {
                "batch_size": self.batch_size,
                "arrival": efficiency(self.arrival_real, self.arrival_padded),
                "sorted": efficiency(sorted_real, sorted_padded),
            },
        }


class Planner:
    """Tokenizes windows of requests and orders them for the engine.

    Args:
        tokenizer: a Hugging Face (fast) tokenizer with the model's chat template.
        settings: bucket bounds, feed order and padding batch size.
        max_model_len: the engine's context length in tokens; a request whose
            ``prompt_tokens + max_tokens`` exceeds it becomes a row error.
        block_tokens: the engine's KV-cache block size in tokens when its
            prefix cache is on, else None: rows sharing a first block are
            counted (:attr:`prefix`) and, with ``settings.prefix_aware``, fed
            together (:mod:`bulkinfer.prep.prefix`).
        vocabulary: the token ids the model takes; a request naming another
            becomes a row error (:mod:`bulkinfer.prep.vocabulary`). None:
            left to the engine.
        grammars: the structured outputs the engine's grammar backend
            takes; a request with another becomes a row error
            (:mod:`bulkinfer.prep.grammar`). None: left to the engine.
    """

    # the fields a bulkinfer row's output record writes itself (bulkinfer.io.records.output_record):
    # a pass-through field of one of these names is replaced in the output, and said so
    OUTPUT_FIELDS: frozenset[str] = frozenset(
        {"completion", "finish_reason", "prompt_tokens", "completion_tokens", "logprobs", "completions"}
    )

    def __init__(
        self,
        tokenizer: Any,
        settings: PlanSettings,
        max_model_len: int,
        block_tokens: int | None = None,
        vocabulary: Vocabulary | None = None,
        grammars: Grammars | None = None,
    ):
        self.tokenizer = tokenizer
        # each request's checks before it is tokenized (a job may add its own)
        self.checks: list[RowCheck] = [check for check in (vocabulary, grammars) if check is not None]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            # A tokenizer.json may carry its own padding and truncation
            # (sentence-transformers' all-MiniLM-L6-v2: pad and cut to 128):
            # the transformers wrapper turns them off per call, as vLLM's
            # tokenization does; encode_batch calls the backend directly.
            backend.no_padding()
            backend.no_truncation()
        self.settings = settings
        self.max_model_len = max_model_len
        self.padding = PaddingStats(tuple(settings.buckets), settings.padding_batch_size)
        self.prefix = PrefixStats(block_tokens) if block_tokens else None
        # pass-through field name -> bulkinfer rows planned that carry it
        self.passthrough: Counter[str] = Counter()
        # request field name -> rows planned for the engine that set it themselves
        self.row_sampling: Counter[str] = Counter()

    def sampling_set_by_rows(self) -> dict[str, int]:
        """The request fields the rows planned for the engine set themselves (winning over
        the ``[sampling]`` defaults the report's ``sampling`` holds), as the
        rows name them -> how many rows, most common first."""
        return dict(sorted(self.row_sampling.items(), key=lambda item: (-item[1], item[0])))

    def passthrough_fields(self) -> list[dict[str, Any]]:
        """The pass-through fields of the bulkinfer rows planned, most common
        first: each ``name``, the ``rows`` that carry it, ``did_you_mean``:
        the field bulkinfer reads that the name nearly spells (``max_token`` ->
        ``max_tokens``; :func:`difflib.get_close_matches`, cutoff 0.8), else None
        (a near miss changes nothing in the output: the field is copied, not
        read), and ``replaced``: whether the output record writes a field of
        that name itself (:attr:`OUTPUT_FIELDS`: an input's ``completion`` is
        not copied; the output's own value is written)."""
        known = sorted(CONSUMED_FIELDS)
        return [
            {
                "name": name,
                "rows": rows,
                "did_you_mean": next(iter(difflib.get_close_matches(name, known, 1, 0.8)), None),
                "replaced": name in self.OUTPUT_FIELDS,
            }
            for name, rows in sorted(self.passthrough.items(), key=lambda item: (-item[1], item[0]))
        ]

    def render(self, request: Request) -> str:
        """The text sent to the model: the prompt as is, or the chat rendered
        with the model's chat template (transformers renders it in a sandboxed
        Jinja environment) with the generation prompt appended, or as the
        row's chat template fields say (:mod:`bulkinfer.prep.chat_template`);
        developer messages as vLLM gives them to a template without that role
        (:func:`~bulkinfer.prep.chat_template.developer_as_system`)."""
        if request.messages is None:
            assert request.prompt is not None
            return request.prompt
        kwargs = {"add_generation_prompt": True, **request.template_kwargs}
        messages = developer_as_system(request.messages, getattr(self.tokenizer, "chat_template", None))
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))

    def encode(self, request: Request) -> list[int]:
        """Token ids of one request's rendered prompt (special tokens as in
        :meth:`plan_window`), or its own token ids (of several prompts, all
        of theirs one after another: a count, not one prompt).

        Raises:
            Exception: whatever the chat template raises for this row.
        """
        if request.prompts is not None:  # several prompts: all their tokens (what a count of them needs)
            return [t for part in with_parts([replace(request)]) for t in self.encode(part)]
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        return self.encode_batch([self.render(request)], add_special_tokens=request.messages is None)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of ``texts``, in one batched call. A fast tokenizer's Rust
        ``encode_batch`` is called directly: the same ids as the transformers
        wrapper, without its per-row Python conversion (which cost more than
        the tokenization itself: 2.9 s vs 1.8 s per 100k short prompts)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        return list(self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"])

    def plan_window(self, requests: Sequence[Request]) -> tuple[list[Request], list[RowError]]:
        """Tokenize ``requests`` (arrival order) and return them in feed order.

        Sets each request's ``prompt_token_ids`` (a row's own token ids as they
        are) and drops its text. Rows that name a token id outside the
        model's vocabulary or a structured output vLLM's grammar backend
        refuses, whose chat template fails or that do not fit the context
        come back as errors.
        """
        refused: list[RowError] = []
        if self.checks:
            kept = []
            for request in requests:
                problem = next(filter(None, (check.problem(request) for check in self.checks)), None)
                if problem is None:
                    kept.append(request)
                else:
                    refused.append(
                        RowError(request.line, request.id, "invalid_field", problem, request.openai_url is not None)
                    )
            requests = kept
        failed: list[tuple[Request, str, str]] = []  # (request or part, type, message)
        plain: list[tuple[Request, str]] = []
        chat: list[tuple[Request, str]] = []
        tokenized: list[tuple[Request, list[int]]] = []
        parents = {request.seq: request for request in requests if request.prompts is not None}
        for request in with_parts(requests):
            if request.openai_url is None:
                self.passthrough.update(request.passthrough.keys())
            if request.prompt_token_ids is not None:  # the row's own token ids
                tokenized.append((request, request.prompt_token_ids))
                continue
            try:
                text = self.render(request)
            except Exception as exc:  # template errors are the row's fault
                failed.append((request, "invalid_field", f"field 'messages': chat template failed: {exc}"))
                continue
            (plain if request.messages is None else chat).append((request, text))
        # Completion prompts get the tokenizer's special tokens (as vLLM does);
        # a rendered chat template already holds them.
        for group, special in ((plain, True), (chat, False)):
            if group:
                encoded = self.encode_batch([text for _, text in group], special)
                tokenized += [(request, ids) for (request, _), ids in zip(group, encoded, strict=True)]
        planned: list[Request] = []
        for request, ids in tokenized:
            request.prompt_token_ids = ids
            request.prompt = request.messages = None
            total = len(ids) + request.max_tokens
            if total > self.max_model_len:
                message = (
                    f"prompt is {len(ids)} tokens and max_tokens is {request.max_tokens}: "
                    f"{total} > the model's context of {self.max_model_len} tokens"
                )
                failed.append((request, "context_length_exceeded", message))
                continue
            planned.append(request)
        planned, errors = joined_parts(planned, failed, parents)
        errors = [*refused, *errors]
        planned.sort(key=lambda r: r.seq)
        self.padding.add_window([part.prompt_length for r in planned for part in r.parts or [r]])
        for request in planned:
            self.row_sampling.update(request.row_sampling)
        return self.order(planned), errors

    def order(self, planned: Sequence[Request]) -> list[Request]:
        """One window's tokenized requests (arrival order) in feed order: by
        ``settings.order``, and, with ``settings.prefix_aware`` and a block
        size, each group of rows sharing a first block together, its longest
        first (:func:`order_groups_for_feed`). Counts the shared prefixes
        (:attr:`prefix`) whatever the order."""
        if self.prefix is None:
            return order_for_feed(planned, self.settings.order)
        groups = prefix_groups(planned, self.prefix.block_tokens)
        self.prefix.add_groups(groups)
        if self.settings.prefix_aware:
            return order_groups_for_feed(groups, self.settings.order)
        return order_for_feed(planned, self.settings.order)


def with_parts(requests: Iterable[Request]) -> Iterator[Request]:
    """``requests``, a request of several prompts (``prompts``) as its parts
    instead: each a copy of it with one prompt (set as its ``parts``)."""
    for request in requests:
        if request.prompts is None:
            yield request
            continue
        request.parts = [
            replace(
                request,
                prompt=one if isinstance(one, str) else None,
                prompt_token_ids=None if isinstance(one, str) else list(one),
                prompts=None,
            )
            for one in request.prompts
        ]
        yield from request.parts


def joined_parts(
    planned: list[Request], failed: list[tuple[Request, str, str]], parents: dict[int, Request]
) -> tuple[list[Request], list[RowError]]:
    """The planned requests with each request of several prompts (``parents``,
    by ``seq``) in place of its parts, once every part planned (its
    ``prompt_token_ids`` its first part's: prefix groups and the feed order
    read them); one error per failed row, a part's naming its prompt
    (``prompt[j]``)."""
    errors: list[RowError] = []
    failed_seqs: set[int] = set()
    for request, type_, message in failed:
        if request.seq in failed_seqs:
            continue
        failed_seqs.add(request.seq)
        parent = parents.get(request.seq)
        if parent is not None and parent.parts is not None:
            index = next(j for j, part in enumerate(parent.parts) if part is request)
            message = f"prompt[{index}]: {message}"
        errors.append(RowError(request.line, request.id, type_, message, request.openai_url is not None))
    out: list[Request] = []
    for request in planned:
        parent = parents.get(request.seq)
        if request.seq in failed_seqs:
            continue
        if parent is None:
            out.append(request)
        elif parent.parts is not None and request is parent.parts[0]:
            parent.prompt_token_ids, parent.prompt = request.prompt_token_ids, None
            out.append(parent)
    return out, errors


def order_for_feed(requests: Iterable[Request], order: str) -> list[Request]:
    """Requests in the order they are fed: ``descending`` (longest prompt
    first), ``ascending``, or ``arrival``. Sorting is stable, so equal lengths
    keep their arrival order; buckets are contiguous runs of the result."""
    items = list(requests)
    if order == "arrival":
        return items
    return sorted(items, key=lambda r: r.prompt_length, reverse=order == "descending")


def order_groups_for_feed(groups: Iterable[list[Request]], order: str) -> list[Request]:
    """The rows of prefix groups (see :func:`bulkinfer.prep.prefix.prefix_groups`)
    in feed order: each group's rows one after another, its leader first;
    the groups ordered by their leader's prompt length as
    :func:`order_for_feed` orders rows (``arrival``: in the order of their
    first row), so groups of one keep exactly the plain order."""
    items = list(groups)
    if order != "arrival":
        items.sort(key=lambda g: g[0].prompt_length, reverse=order == "descending")
    return [request for group in items for request in group]
