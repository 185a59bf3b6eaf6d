"""Security: sandboxed chat templates, no remote code by default, no secrets in files."""

from __future__ import annotations

from pathlib import Path

import orjson
from fakes import FakeEngine

from bulkinfer.config import EngineSettings, PlanSettings, SamplingDefaults, load_settings
from bulkinfer.engine.args import resolve_engine_args
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.models import load_tokenizer, resolve_model
from bulkinfer.prep.planner import Planner
from bulkinfer.prep.rows import parse_row


def test_chat_template_runs_in_a_sandbox() -> None:
    tokenizer = load_tokenizer(resolve_model(None))
    tokenizer.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    planner = Planner(tokenizer, PlanSettings(), 2048)
    request = parse_row({"messages": [{"role": "user", "content": "hi"}]}, 0, 1, SamplingDefaults())
    planned, errors = planner.plan_window([request])
    assert planned == []
    assert errors[0].type == "invalid_field"
    assert "unsafe" in errors[0].message  # jinja2's SecurityError, raised by the sandbox


def test_remote_code_is_off_unless_asked() -> None:
    assert resolve_engine_args("m", EngineSettings(), "cpu")["trust_remote_code"] is False
    assert load_settings().engine.trust_remote_code is False


def test_no_secret_from_the_environment_reaches_any_file(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    secret = "hf_SECRETtoken1234567890"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps({"id": "a", "prompt": "hi"}) + b"\n" + b"{bad\n")
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    run(paths, load_settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    for path in tmp_path.iterdir():
        assert secret.encode() not in path.read_bytes(), path
