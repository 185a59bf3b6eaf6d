"""Transparent huge pages at an engine's start (bulkinfer/jobs/engine_choice.py,
choose_huge_pages): paused only when faulting the KV cache in huge pages
costs the start more than the faster steps save over the job; the report
says why. The pause itself: tests/engine/test_malloc.py; a real run's
report: tests/e2e/test_e2e.py."""

from __future__ import annotations

import pytest

from bulkinfer.config import Settings, with_engine
from bulkinfer.jobs.engine_choice import HUGE_PAGE_GAIN, PAUSE_MARGIN, _generation_s, choose_huge_pages

GIB = 1 << 30


def _settings(kv: int | None = 2 * GIB, **engine: object) -> Settings:
    return with_engine(Settings(), kv_cache_memory_bytes=kv, **engine)


def test_a_short_job_with_a_large_cache_starts_with_huge_pages_paused() -> None:
    # 2 GiB at 3 s/GiB: 6 s of start; 100 s of generation at 2.8%: 2.8 s saved
    settings, choice = choose_huge_pages(_settings(), 100.0, lambda: 3.0)
    assert settings.engine.huge_pages_at_start is False
    assert choice["at_start"] is False
    assert choice["start_cost_s"] == pytest.approx(6.0) and choice["steps_gain_s"] == pytest.approx(2.8)
    assert choice["kv_cache_gib"] == 2.0 and choice["fault_s_per_gib"] == 3.0
    assert choice["why"].startswith("paused: ") and "2.00 GiB" in choice["why"]


def test_a_long_job_keeps_them_and_only_a_clear_loss_pauses_them() -> None:
    # seconds of generation that save half the 6 s the start costs: below them the pause wins by the margin
    break_even = 6.0 / HUGE_PAGE_GAIN / PAUSE_MARGIN
    kept, choice = choose_huge_pages(_settings(), break_even * 1.01, lambda: 3.0)
    assert kept.engine.huge_pages_at_start is True and choice["why"].startswith("kept: ")
    paused, _ = choose_huge_pages(_settings(), break_even * 0.99, lambda: 3.0)
    assert paused.engine.huge_pages_at_start is False


def test_a_machine_whose_huge_pages_cost_nothing_to_fault_keeps_them() -> None:
    settings, choice = choose_huge_pages(_settings(), 1.0, lambda: 0.0)
    assert settings.engine.huge_pages_at_start is True and choice["start_cost_s"] == 0.0


@pytest.mark.parametrize(
    ("settings", "generation_s", "why"),
    [
        (_settings(huge_pages_at_start=False), 1e6, "set by the user"),
        (_settings(huge_pages_at_start=True), 1.0, "set by the user"),
        (_settings(kv=None), 1.0, "kept: the job's generation time or KV cache unknown"),
        (_settings(), None, "kept: the job's generation time or KV cache unknown"),
        (_settings(data_parallel_size=2), 1.0, "kept: more than one worker"),
    ],
)
def test_the_user_or_what_is_unknown_decides_without_measuring(
    settings: Settings, generation_s: float | None, why: str
) -> None:
    def never() -> float:
        raise AssertionError("measured")

    chosen, choice = choose_huge_pages(settings, generation_s, never)
    assert choice["why"] == why
    assert chosen.engine.huge_pages_at_start == settings.engine.huge_pages_at_start
    assert choice["at_start"] is (settings.engine.huge_pages_at_start is not False)


def test_no_huge_pages_to_pause_keeps_the_setting_unset() -> None:
    settings, choice = choose_huge_pages(_settings(), 1.0, lambda: None)
    assert settings.engine.huge_pages_at_start is None
    assert choice == {"at_start": True, "why": "kept: this machine offers no transparent huge pages to pause"}


def test_the_generation_time_comes_from_the_compile_choice_else_the_probe_rate() -> None:
    timed = {"enforce_eager": False, "expected_generation_s": {"eager": 40.0, "compiled": 30.0}}
    assert _generation_s(timed, 4800, 100.0) == 30.0
    assert _generation_s({**timed, "enforce_eager": True}, 4800, 100.0) == 40.0
    assert _generation_s({"enforce_eager": True}, 4800, 100.0) == 48.0
    assert _generation_s({"enforce_eager": True}, None, 100.0) is None
    assert _generation_s({"enforce_eager": True}, 4800, None) is None
