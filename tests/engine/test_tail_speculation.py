"""Tail speculation (``engine.speculative_tail``): vLLM's n-gram speculative
decoding only in engine steps of at most that many running rows, as vLLM's
own ``speculative_config``; the settings that vLLM refuses with it refused
before a run starts; the summary's line."""

from __future__ import annotations

import dataclasses

import pytest

from bulkinfer.config import load_settings
from bulkinfer.engine.args import NGRAM_DRAFT_TOKENS, has_nucleus, resolve_engine_args, tail_speculation
from bulkinfer.errors import ConfigError
from bulkinfer.report.terminal import _speculation


def test_the_schedule_speculates_up_to_the_tail_rows_and_never_above() -> None:
    """vLLM expands the ranges into its batch size -> drafts lookup
    (``build_dynamic_sd_schedule_lookup``, what its scheduler reads each
    step): k drafts at 1..16 running rows, none at 17..256."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    config = tail_speculation(16)
    assert (config["method"], config["num_speculative_tokens"]) == ("ngram", NGRAM_DRAFT_TOKENS)
    lookup = build_dynamic_sd_schedule_lookup(config["num_speculative_tokens_per_batch_size"], 256, 4)
    assert lookup[1:17] == [4] * 16 and lookup[17:] == [0] * 240


def test_vllm_takes_the_config_as_its_own_speculative_config() -> None:
    from vllm.config import SpeculativeConfig

    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    assert set(tail_speculation(8)) <= fields


def test_the_setting_becomes_vllms_speculative_config_and_drops_the_nucleus_processor() -> None:
    """vLLM refuses custom logits processors with speculative decoding, so a
    request's top_p then goes to vLLM's own sampler."""
    settings = load_settings(None, {"engine.speculative_tail": 8})
    args = resolve_engine_args("/m", settings.engine, "cpu", 16 * 2**30)
    assert args["speculative_config"] == tail_speculation(8)
    assert not has_nucleus(args)
    off = resolve_engine_args("/m", load_settings().engine, "cpu", 16 * 2**30)
    assert "speculative_config" not in off and has_nucleus(off)


def test_a_speculative_config_of_the_users_beside_it_is_refused() -> None:
    settings = load_settings(None, {"engine.speculative_tail": 8})
    engine = dataclasses.replace(settings.engine, extra_args={"speculative_config": {"method": "ngram"}})
    with pytest.raises(ConfigError, match="speculative_tail and speculative_config both"):
        resolve_engine_args("/m", engine, "cpu", 0, {"speculative_config"})


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"engine.speculative_tail": 8, "sampling.min_p": 0.05}, "sampling.min_p cannot be used with speculative"),
        ({"engine.speculative_tail": 8, "sampling.logit_bias": {"7": 2.0}}, "sampling.logit_bias cannot be used"),
        ({"engine.speculative_config": {"method": "ngram"}, "sampling.min_p": 0.05}, "sampling.min_p cannot"),
        ({"engine.speculative_tail": -1}, "engine.speculative_tail must be an integer >= 0"),
        ({"engine.speculative_tail": 2.5}, "engine.speculative_tail must be an integer >= 0"),
    ],
)
def test_settings_vllm_refuses_with_it_are_refused_before_the_run(overrides: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_settings(None, overrides)


def test_the_summary_says_where_it_speculated_and_the_drafts_checked_and_accepted() -> None:
    engine = {"speculative_config": tail_speculation(16), "spec_decode_draft_tokens": 12345}
    expected = "ngram, 4 draft tokens a step, in steps of at most 16 rows; 12,345 draft tokens checked"
    assert _speculation(engine) == expected  # a report of before 2026-12-04: no acceptance count
    assert _speculation({**engine, "spec_decode_accepted_tokens": 4115}) == expected + ", 4,115 accepted (33%)"
    none = {**engine, "spec_decode_draft_tokens": 0, "spec_decode_accepted_tokens": 0}
    assert _speculation(none).endswith("; 0 draft tokens checked, 0 accepted")
    plain = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}  # vLLM's, every step
    assert _speculation(plain) == "ngram, 3 draft tokens a step"
