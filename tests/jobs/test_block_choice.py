"""The KV cache's block size for rows of several choices
(bulkinfer/jobs/block_choice.py): 32 tokens only where the prompt tokens the
siblings would compute again are a clear share of the job; the sample's
counts: tests/jobs/test_run.py (test_a_row_of_n_choices_is_n_sequences_in_the_sample); a real run's
report: tests/e2e/test_e2e.py."""

from __future__ import annotations

from typing import Any

import pytest

from bulkinfer.config import Settings, with_engine
from bulkinfer.jobs.block_choice import SMALL_BLOCK_TOKENS, SPARED_SHARE, choose_block_size, computed_again


def test_each_other_sequence_computes_the_prompts_partial_last_block_again() -> None:
    # 300 tokens: two whole blocks of 128 cached, 44 computed again by each of the 3 siblings; at 32: 12
    assert computed_again(300, 4, 128) == 3 * 44 and computed_again(300, 4, 32) == 3 * 12
    assert computed_again(100, 2, 128) == 100  # shorter than a block: all of it again
    assert computed_again(256, 8, 128) == 0 and computed_again(300, 1, 128) == 0


def test_rows_of_four_short_choices_get_small_blocks_and_the_report_says_why() -> None:
    # 10 rows of 4 choices, 100-token prompts, 64 tokens each: 1,000 + 2,560 tokens; 3,000 computed again at 128,
    # 3 x 4 x 10 = 120 at 32: 2,880 spared of 6,560
    settings, choice = choose_block_size(Settings(), lambda: ([(100, 4)] * 10, 1_000 + 2_560))
    assert settings.engine.extra_args["block_size"] == SMALL_BLOCK_TOKENS == choice["block_size"]
    assert choice["spared_prompt_tokens"] == 2_880 and choice["job_tokens"] == 6_560
    assert choice["why"].startswith("32 tokens: ") and "2,880 prompt tokens" in choice["why"]
    assert "(43.9% of the job's tokens" in choice["why"]


def test_long_answers_or_few_rows_of_choices_keep_vllms_block() -> None:
    # the same 10 rows among a job of 100,000 tokens: 2,880 spared is 2.8%
    settings, choice = choose_block_size(Settings(), lambda: ([(100, 4)] * 10, 100_000))
    assert "block_size" not in settings.engine.extra_args and choice["block_size"] is None
    assert choice["why"].startswith("vLLM's: ") and choice["spared_prompt_tokens"] == 2_880
    # just at the share: chosen; just under: not
    spared, again = 2_880, 3_000
    at = round(spared / SPARED_SHARE) - again
    assert choose_block_size(Settings(), lambda: ([(100, 4)] * 10, at))[1]["block_size"] == 32
    under = choose_block_size(Settings(), lambda: ([(100, 4)] * 10, at + 100))[1]
    assert under["block_size"] is None
    assert "(9.9% of the job's tokens; chosen from 10%)" in under["why"]  # 9.97%: cut, not rounded to 10.0%


@pytest.mark.parametrize(
    ("settings", "shared", "why"),
    [
        (with_engine(Settings(), extra_args={"block_size": 64}), [(100, 4)], "set by the user"),
        (with_engine(Settings(), extra_args={"enable_prefix_caching": False}), [(100, 4)], "the prefix cache is off"),
        (Settings(), [], "no row of the input's first rows asks more than one choice"),
        (Settings(), None, "not sampled before the engine started (a Parquet file or a pipe)"),
    ],
)
def test_the_user_or_a_job_without_choices_keeps_the_block(settings: Settings, shared: Any, why: str) -> None:
    chosen, choice = choose_block_size(settings, lambda: (shared, 1_000))
    assert chosen == settings and choice["why"].endswith(why)


def test_a_block_the_user_set_takes_no_sample() -> None:
    def never() -> Any:
        raise AssertionError("sampled")

    settings = with_engine(Settings(), extra_args={"block_size": 128})
    assert choose_block_size(settings, never)[1] == {"block_size": 128, "why": "set by the user"}
