"""What a job's engine steps cost an engine, from a few measured steps.

vLLM's engine decodes one token for every running row at each step and
attends over each row's context (its prompt and the tokens generated so
far); before that it prefills the rows' prompts. A decode step's seconds
are modelled as a line and the prefill as a cost per prompt token
(:class:`DecodeCost`)::

    fixed_s + per_row_s * rows + per_context_token_s * context tokens of the rows

so a job's seconds are ``fixed_s * steps + per_row_s * completion tokens +
per_context_token_s * context-token steps + per_prompt_token_s * prompt
tokens`` (:class:`DecodeWork`, :func:`decode_work`): only the number of
steps depends on how rows are batched. ``calibrate --compile`` measures
these for an eager and a compiled engine (:data:`DECODE_GRID`,
:func:`fit_decode_cost`), and the compile choice prices each job by its own
shape: on a 2-core AMD EPYC Zen 4 (bfloat16, 2026-12-01;
``bench/results/step-curve-zen4-bf16-*.md``) compiling saved a decode step
4 ms, a row 0.06 ms and a context token 2.3 us (at every step), so a job of
long prompts and long completions gains far more from it than the short
rows of a fixed trial, whose whole-job rate had decided before.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

# The designed steps a decode cost is fitted to: (rows decoded at once, prompt tokens of each). Short and long
# contexts at one, a few and a full batch (vLLM's default of 256 sequences), so the three terms come apart.
DECODE_GRID = ((1, 32), (16, 32), (64, 32), (256, 32), (1, 512), (16, 512), (64, 512))


# Tokens each grid row generates; its decode steps are timed from every row's 2nd token to its last but one. At 64
# rows of 512 prompt tokens vLLM's chunked prefill starts the rows over 8 steps: with 16 tokens a row 6 steps were
# timed, and a compiled engine's step measured 205.7 ms against 144.8 ms over the 38 of 48 tokens (AMD EPYC Zen 4).
GRID_TOKENS = 48


# Rows simulated at most when counting a job's steps: a longer job's count is that many rows' scaled up.
SIMULATED_ROWS = 65_536


@dataclass(frozen=True, slots=True)
class DecodeWork:
    """A job's engine work: ``steps`` (engine steps that decode), ``tokens``
    (completion tokens), ``context`` (context tokens summed over every
    row's decode steps: a row of ``p`` prompt and ``n`` completion tokens
    adds ``n * p + n * (n - 1) / 2``) and ``prompt_tokens`` (to prefill)."""

    steps: int
    tokens: int
    context: int
    prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """A decode step's seconds, ``fixed_s + per_row_s * rows +
    per_context_token_s * context`` (seconds; per row decoded; per context
    token of those rows), and a prompt token's prefill, ``per_prompt_token_s``."""

    fixed_s: float
    per_row_s: float
    per_context_token_s: float
    per_prompt_token_s: float = 0.0

    def seconds(self, work: DecodeWork) -> float:
        """The seconds of ``work`` at this cost."""
        return (
            self.fixed_s * work.steps
            + self.per_row_s * work.tokens
            + self.per_context_token_s * work.context
            + self.per_prompt_token_s * work.prompt_tokens
        )

    def to_json(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> DecodeCost | None:
        """A stored cost, or None when ``data`` is not one."""
        try:
            return cls(*(float(data[name]) for name in _COST_FIELDS))
        except (KeyError, TypeError, ValueError):
            return None


_COST_FIELDS = ("fixed_s", "per_row_s", "per_context_token_s", "per_prompt_token_s")


def grid_context(rows: int, prompt_tokens: int) -> float:
    """The context tokens of a :data:`DECODE_GRID` point's rows in the
    middle of its timed steps (each row's prompt and half its tokens)."""
    return rows * (prompt_tokens + GRID_TOKENS / 2)


def fit_decode_cost(grid: Sequence[Sequence[float]]) -> DecodeCost:
    """The cost measured at ``grid`` (rows, prompt tokens, seconds a decode
    step, seconds a prompt token's prefill; one a point, as
    :func:`~bulkinfer.jobs.tune.step_seconds` measures them at
    :data:`DECODE_GRID`): the decode step's least-squares line
    (:func:`fit_decode_line`, the context at :func:`grid_context`) and the
    prefill's seconds over all the points' prompt tokens.

    Raises:
        ValueError: as :func:`fit_decode_line`.
    """
    line = fit_decode_line([(int(r), grid_context(int(r), int(p)), s) for r, p, s, _ in grid])
    prompts = sum(r * p for r, p, *_ in grid)
    prefill = sum(r * p * t for r, p, _, t in grid) / prompts if prompts else 0.0
    return DecodeCost(line.fixed_s, line.per_row_s, line.per_context_token_s, max(0.0, prefill))


def fit_decode_line(points: Sequence[tuple[int, float, float]]) -> DecodeCost:
    """The least-squares line through ``points`` (rows, context tokens,
    seconds per step), each term at least 0 (a term fitted below 0 is
    dropped and the others fitted again); no prefill cost.

    Raises:
        ValueError: fewer points than the terms left to fit.
    """
    terms = [0, 1, 2]  # fixed, per row, per context token
    while True:
        rows = [[(1.0, float(r), float(c))[t] for t in terms] for r, c, _ in points]
        if len(rows) < len(terms):
            raise ValueError(f"{len(points)} points cannot fit {len(terms)} terms of a decode cost")
        solved = _least_squares(rows, [s for *_, s in points])
        negative = [t for t, v in zip(terms, solved, strict=True) if v < 0]
        if not negative:
            values = dict(zip(terms, solved, strict=True))
            return DecodeCost(*(max(0.0, values.get(t, 0.0)) for t in (0, 1, 2)))
        terms.remove(negative[0])


def _least_squares(x: list[list[float]], y: list[float]) -> list[float]:
    """Solve the normal equations of ``x @ b = y`` (a few columns) by Gauss-Jordan elimination."""
    n = len(x[0])
    a = [
        [sum(r[i] * r[j] for r in x) for j in range(n)] + [sum(r[i] * v for r, v in zip(x, y, strict=True))]
        for i in range(n)
    ]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if a[col][col] == 0:
            raise ValueError("the points do not tell the decode cost's terms apart")
        for i in range(n):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [u - f * v for u, v in zip(a[i], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def decode_work(lengths: Sequence[tuple[int, int]], rows: int, max_num_seqs: int) -> DecodeWork:
    """The work of a job of ``rows`` sequences whose (prompt tokens,
    completion tokens) are ``lengths`` (a sample of them, in feed order,
    cycled and scaled to ``rows``; an ``n`` > 1 row counts as ``n``
    sequences, its prompt ``n`` times, though vLLM prefills it once): every
    sequence generating all its completion tokens, at most ``max_num_seqs``
    at once (:func:`decode_steps`), every prompt token prefilled (none
    found in the prefix cache).

    Raises:
        ValueError: ``max_num_seqs`` under 1.
    """
    if not lengths or rows <= 0:
        return DecodeWork(0, 0, 0)
    scale = rows / len(lengths)
    tokens = sum(n for _, n in lengths)
    context = sum(n * p + n * (n - 1) // 2 for p, n in lengths)
    prompts = sum(p for p, _ in lengths)
    steps = decode_steps([n for _, n in lengths], rows, max_num_seqs)
    return DecodeWork(steps, round(tokens * scale), round(context * scale), round(prompts * scale))


def decode_steps(completion_tokens: Sequence[int], rows: int, max_num_seqs: int) -> int:
    """Engine steps that decode, for ``rows`` sequences whose completion
    tokens are ``completion_tokens`` cycled (in feed order), each decoding a
    token a step from its admission to its end, at most ``max_num_seqs`` at
    once, a freed slot refilled at once (vLLM's scheduler, first come first
    served; prefill, preemption and a KV cache too small for
    ``max_num_seqs`` are not modelled). Beyond :data:`SIMULATED_ROWS`
    sequences, that many's steps scaled up.

    Raises:
        ValueError: ``max_num_seqs`` under 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, not {max_num_seqs}")
    lengths = [int(n) for n in completion_tokens if n > 0]  # a sequence of no tokens takes no decode step
    rows = round(rows * len(lengths) / len(completion_tokens)) if lengths else 0
    if rows <= 0:
        return 0
    simulated = min(rows, SIMULATED_ROWS)
    feed = itertools.islice(itertools.cycle(lengths), simulated)
    ends: list[int] = []  # the step at which each running sequence has all its tokens
    now = 0
    while True:
        for length in itertools.islice(feed, max_num_seqs - len(ends)):
            heapq.heappush(ends, now + length)
        if not ends:
            return round(now * rows / simulated)
        now = heapq.heappop(ends)
        while ends and ends[0] == now:
            heapq.heappop(ends)
