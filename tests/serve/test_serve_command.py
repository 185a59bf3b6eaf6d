"""``bulkinfer serve``: its help, and its refusal to serve beyond 127.0.0.1 without a key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from bulkinfer.cli import app, serve_command
from bulkinfer.cli.serve_command import tenant_of
from bulkinfer.serve.access import ACCESS_LOGGER
from bulkinfer.serve.api import Limits

runner = CliRunner()


def test_help_lists_the_options_with_their_defaults() -> None:
    result = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    for word in (
        "--host",
        "--port",
        "--data-dir",
        "--api-key",
        "--model",
        "BULKINFER_API_KEYS",
        "[default: 127.0.0.1]",
        "--batch-file-expiry",
        "[default: 2592000 (30 days)]",
    ):
        assert word in result.output
    assert "serve" in typer.main.get_group(app).commands


def test_help_fits_80_columns_without_cutting_a_word() -> None:
    result = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0 and "…" not in result.output, result.output
    assert "Exit codes" in result.output and "resumes at start" in result.output


def test_an_unwritable_data_dir_is_exit_9(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = runner.invoke(app, ["serve", "--data-dir", str(blocker / "data")], env={"BULKINFER_API_KEYS": ""})
    assert result.exit_code == 9, result.output
    assert "cannot write" in result.output
    # no access-log handler left on the runner's stream, closed now: a later request would log to it
    assert not logging.getLogger(ACCESS_LOGGER).handlers


def test_without_a_key_it_refuses_any_host_but_localhost() -> None:
    result = runner.invoke(app, ["serve", "--host", "0.0.0.0"], env={"BULKINFER_API_KEYS": ""})
    assert result.exit_code == 2
    assert "without an API key" in result.output


def test_a_keys_tenant_is_stable_and_not_the_key() -> None:
    assert tenant_of("sk-a") == tenant_of("sk-a") != tenant_of("sk-b")
    assert "sk-a" not in tenant_of("sk-a")


def test_webhook_flags_are_checked_before_anything_starts(tmp_path: Path) -> None:
    base = ["serve", "--data-dir", str(tmp_path / "data")]
    env = {"BULKINFER_API_KEYS": "", "BULKINFER_WEBHOOK_SECRET": ""}
    cases = [
        (["--webhook-url", "https://hooks.example.com/b"], "needs a signing secret"),
        (["--webhook-secret", "whsec_c2VjcmV0"], "without --webhook-url"),
        (["--webhook-url", "ftp://hooks.example.com", "--webhook-secret", "whsec_c2VjcmV0"], "http:// or https://"),
        (["--webhook-url", "https://hooks.example.com/b", "--webhook-secret", "whsec_not base64!"], "whsec_"),
    ]
    for flags, message in cases:
        result = runner.invoke(app, [*base, *flags], env=env)
        assert result.exit_code == 2, (flags, result.output)
        assert message in result.output, (flags, result.output)
    assert not (tmp_path / "data").exists()  # refused before the store was made


@pytest.mark.parametrize(("flags", "expiry"), [([], 30 * 24 * 3600), (["--batch-file-expiry", "0"], None)])
def test_the_batch_file_expiry_reaches_the_server(
    flags: list[str], expiry: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[Limits] = []
    monkeypatch.setattr(serve_command, "_serve", lambda *args: served.append(args[-1]))
    result = runner.invoke(app, ["serve", *flags], env={"BULKINFER_API_KEYS": ""})
    assert result.exit_code == 0, result.output
    assert served[0].batch_file_expiry == expiry
