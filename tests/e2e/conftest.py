"""The end-to-end session: the real default model, its own ``BULKINFER_HOME``,
one shared engine, and an account of every model start.

- ``BULKINFER_HOME`` is a directory of this session whose ``models/`` is the
  real home's (the default model and encoder, prepared there once), so the
  runs' calibration store starts empty, as on a machine that never ran the
  model: test_calibrate_e2e.py runs first (tests/conftest.py orders it) and
  its ``bulkinfer calibrate`` probes the dtype and stores it; every later
  run uses it, and the tests read what each run decided.
- ``BULKINFER_E2E_DTYPE=float32|bfloat16`` stores that dtype as this
  machine's measured choice before any test, so the whole suite runs with
  the other dtype than the probe would pick ("forced through the stored
  calibration"); every assertion on the engine reads the report.
- ``shared_engine``: one engine (``bulkinfer.open_engine``) kept for the
  tests that are not about process lifecycle; they run through the Python
  API in this process. Tests about the CLI, signals and processes start
  their own.
- Every engine start appends to ``$BULKINFER_ENGINE_STARTS``
  (:mod:`bulkinfer.engine.starts`) with the id of the test that asked for it;
  the session's count and seconds are printed at the end beside the slowest
  tests, with the starts by test file (where a new test could share one).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bulkinfer.engine.starts import ENV as STARTS_ENV
from bulkinfer.engine.starts import FOR_ENV as STARTS_FOR_ENV
from bulkinfer.engine.starts import summary

_STARTS = Path(tempfile.mkdtemp(prefix="bulkinfer-e2e-")) / "engine_starts.jsonl"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(STARTS_ENV, str(_STARTS))


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    os.environ[STARTS_FOR_ENV] = nodeid  # inherited by the CLI processes the test starts


def pytest_terminal_summary(terminalreporter: Any) -> None:
    account = summary(Path(os.environ.get(STARTS_ENV, _STARTS)))
    if not account["starts"]:
        return
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(account["by_kind"].items()))
    terminalreporter.write_sep("=", "model starts")
    terminalreporter.write_line(
        f"model starts: {account['starts']} ({kinds}); {account['ready']} ready, {account['failed']} failed, "
        f"{account['unfinished']} stopped during the start; {account['seconds']:.0f} s in the starts that ended "
        f"({account['seconds'] / max(1, account['ready'] + account['failed']):.1f} s each)"
    )
    by_file: dict[str, int] = {}
    for nodeid, n in account["by_for"].items():
        name = Path(str(nodeid).split("::")[0]).name if nodeid else "(not a test)"
        by_file[name] = by_file.get(name, 0) + n
    terminalreporter.write_line(
        "by file: " + ", ".join(f"{name} {n}" for name, n in sorted(by_file.items(), key=lambda kv: -kv[1]))
    )


@pytest.fixture(scope="session", autouse=True)
def e2e_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This session's ``BULKINFER_HOME`` (see the module docstring)."""
    from bulkinfer.default_model import prepare_default_encoder, prepare_default_model

    real = prepare_default_model().parents[1]  # once per machine: ~20 s
    prepare_default_encoder(real)
    home = tmp_path_factory.mktemp("e2e-home")
    (home / "models").symlink_to(real / "models", target_is_directory=True)
    before = os.environ.get("BULKINFER_HOME")
    os.environ["BULKINFER_HOME"] = str(home)
    forced = os.environ.get("BULKINFER_E2E_DTYPE")
    if forced:
        from bulkinfer.jobs.tune import dtype_machine
        from bulkinfer.models import resolve_model
        from bulkinfer.report.calibration import record_choice

        why = f"forced for this test run (BULKINFER_E2E_DTYPE={forced})"
        record_choice("dtype", resolve_model(None), dtype_machine(), {"dtype": forced, "why": why, "trials": []})
    try:
        yield home
    finally:
        if before is None:
            os.environ.pop("BULKINFER_HOME", None)
        else:
            os.environ["BULKINFER_HOME"] = before


_shared: list[Any] = []  # the shared engine while it is open


@pytest.fixture(scope="session")
def shared_engine(e2e_home: Path) -> Any:
    """One engine for the tests that only need a real engine to run rows:
    the default model, vLLM's priority scheduling (rows may set a
    ``priority``), a 1 GiB KV cache (holds every such test's rows). Closed
    after the last end-to-end test (its processes must not outlive them)."""
    import bulkinfer

    if not _shared:
        engine_args = {"scheduling_policy": "priority"}
        _shared.append(bulkinfer.open_engine(engine_args=engine_args, kv_cache_memory_bytes=1 << 30))
    return _shared[0]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    here = Path(__file__).parent
    if _shared and (nextitem is None or here not in Path(str(nextitem.path)).parents):
        _shared.pop().close()
