"""The public Python API's settings handling (the real runs are in tests/e2e/test_e2e.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import bulkinfer
from bulkinfer.config import load_settings
from bulkinfer.errors import ConfigError


def test_overrides_are_run_options_by_name() -> None:
    base = load_settings(None, {"sampling.temperature": 0.5})
    settings = bulkinfer._settings(
        base,
        {"max_tokens": 7, "stop": ["END"], "max_num_seqs": 4, "order": "ascending"},
        {"enable_prefix_caching": False},
    )
    assert (settings.sampling.max_tokens, settings.sampling.temperature, settings.sampling.stop) == (7, 0.5, ("END",))
    assert (settings.engine.max_num_seqs, settings.plan.order) == (4, "ascending")
    assert settings.engine.extra_args == {"enable_prefix_caching": False}
    assert bulkinfer._settings(None, {}, None) == load_settings()


def test_an_unknown_option_is_named_with_the_closest() -> None:
    with pytest.raises(ConfigError, match="'max_token'; did you mean max_tokens"):
        bulkinfer._settings(None, {"max_token": 5}, None)
    with pytest.raises(ConfigError, match="max_tokens"):
        bulkinfer._settings(None, {"max_tokens": 0}, None)  # checked like a flag's value


def test_importing_bulkinfer_imports_no_engine() -> None:
    code = "import sys, bulkinfer; print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert set(bulkinfer.__all__) >= {"run", "plan", "evaluate", "Settings", "load_settings", "RunReport"}
