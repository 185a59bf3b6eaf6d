"""The CLI stays thin: --help imports neither vLLM nor torch, and errors map to exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from bulkinfer.cli import app

runner = CliRunner()


def test_help_imports_no_engine() -> None:
    code = (
        "import sys\n"
        "from bulkinfer.cli import app\n"
        "try:\n"
        "    app(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY=\n" in proc.stdout, proc.stdout


def test_run_help_lists_exit_codes() -> None:
    result = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for word in (
        "--max-tokens",
        "--tensor-parallel-size",
        "--max-num-seqs",
        "--gpu-memory-utilization",
        "Exit codes",
        "128+N",
    ):
        assert word in result.output


def test_missing_input_exits_4(tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 4
    assert "not found" in result.output


def test_bad_config_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[sampling]\nmax_tokenz = 3\n")
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    result = runner.invoke(app, ["run", str(src), "--config", str(cfg)])
    assert result.exit_code == 2
    assert "max_tokenz" in result.output


def test_bad_output_extension_exits_2(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    result = runner.invoke(app, ["run", str(src), "-o", str(tmp_path / "out.csv")])
    assert result.exit_code == 2


def test_models_lists_nothing_in_an_empty_home(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    assert "no models prepared" in result.output


def test_eval_bad_fail_under_exits_2(tmp_path: Path) -> None:
    golden = tmp_path / "g.jsonl"
    golden.write_text('{"prompt": "hi", "reference": "hello"}\n')
    result = runner.invoke(app, ["eval", str(golden), "--fail-under", "blue=3"])
    assert result.exit_code == 2
    assert "blue" in result.output
