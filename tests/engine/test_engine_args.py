"""Engine arguments: bulkinfer's CPU defaults, and any other field of vLLM's
``EngineArgs`` passed through, checked against vLLM's own dataclass."""

from __future__ import annotations

import dataclasses

import pytest

from bulkinfer.config import load_settings
from bulkinfer.engine.args import resolve_engine_args
from bulkinfer.errors import ConfigError


@pytest.fixture(scope="module")
def engine_args_fields() -> set[str]:
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def test_extra_args_reach_the_engine_args_and_win(engine_args_fields: set[str]) -> None:
    settings = load_settings(None, {"engine.enable_prefix_caching": False, "engine.enforce_eager": None})
    extra = {"enable_prefix_caching": False, "kv_cache_dtype": "auto", "max_logprobs": 5}
    engine = dataclasses.replace(settings.engine, extra_args=extra)
    args = resolve_engine_args("/m", engine, "cpu", 16 * 2**30, engine_args_fields)
    assert {k: args[k] for k in extra} == extra
    assert args["enforce_eager"] is True and args["dtype"] == "float32"  # bulkinfer's CPU defaults stay
    args = resolve_engine_args("/m", dataclasses.replace(engine, extra_args={"enforce_eager": False}), "cpu")
    assert args["enforce_eager"] is False  # a user's value wins


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("enable_prefix_cachng", "did you mean enable_prefix_caching"),
        ("kv_cache_dtyp", "did you mean kv_cache_dtype"),
        ("no_such_thing_at_all", "not a field of vllm.EngineArgs"),
        ("model", "--model"),
        ("tokenizer", "cannot be set"),
    ],
)
def test_a_wrong_engine_arg_is_named_with_the_closest_field(
    name: str, expected: str, engine_args_fields: set[str]
) -> None:
    engine = dataclasses.replace(load_settings().engine, extra_args={name: 1})
    with pytest.raises(ConfigError, match=expected) as info:
        resolve_engine_args("/m", engine, "cpu", 0, engine_args_fields)
    assert repr(name) in str(info.value)
