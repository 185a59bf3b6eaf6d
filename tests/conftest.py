"""Shared fixtures. Every test not marked ``e2e`` runs with ``BULKINFER_HOME``
pointing at a session directory whose default model is the tiny stand-in of
:mod:`tiny_model`: orchestration tests never load the real model, whatever
the user's home holds, and need no network. ``e2e`` tests use the real
default model (prepared in the real ``BULKINFER_HOME`` on first use).

Which skips a run allows is :mod:`skip_policy` (loaded here): a test marked
``device("cuda", reason=...)`` or ``devices(2, reason=...)`` is skipped where
the run's device (bulkinfer's own choice, ``detect_device``; the environment
variable ``BULKINFER_TEST_DEVICE=cpu|cuda`` overrides it) or its count falls
short; under CI (``CI`` set, not ``0``/``false``) any other skip fails."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiny_model

pytest_plugins = ["skip_policy"]


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``BULKINFER_HOME`` whose prepared default model is the tiny stand-in."""
    home = tmp_path_factory.mktemp("bulkinfer-home")
    tiny_model.build(home)
    return home


@pytest.fixture(scope="module", autouse=True)
def _tiny_default_model(request: pytest.FixtureRequest) -> Iterator[None]:
    """Module-scoped (before any module fixture runs), for every module outside tests/e2e/."""
    if (Path(__file__).parent / "e2e") in Path(str(request.path)).parents:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BULKINFER_HOME", str(request.getfixturevalue("tiny_home")))
        # the same on every CPU: no native bfloat16, so a run never starts the dtype probe on a fake engine
        patch.setattr("bulkinfer.jobs.tune.cpu_flags", lambda: {"avx2"})
        yield


@pytest.fixture(autouse=True)
def _arena_env_kept() -> Iterator[None]:
    """A stream run in the test process sets ``MALLOC_ARENA_MAX`` for the engine
    processes it starts (bulkinfer/engine/heap.py): undone after each test."""
    before = os.environ.get("MALLOC_ARENA_MAX")
    yield
    if before is None:
        os.environ.pop("MALLOC_ARENA_MAX", None)
    else:
        os.environ["MALLOC_ARENA_MAX"] = before


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e/ is marked ``e2e`` (the real engine and model),
    and tests/e2e/test_calibrate_e2e.py runs first: its ``bulkinfer calibrate``
    stores the session's dtype for every later run, which would otherwise
    each probe it again until one stores it (the first run of
    test_bench_e2e.py's scale series did: 31 s of its 45, CI on an AMD EPYC
    Zen 4, 2026-12-03)."""
    e2e = Path(__file__).parent / "e2e"
    for item in items:
        if e2e in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
    items.sort(key=lambda item: Path(str(item.fspath)) != e2e / "test_calibrate_e2e.py")  # stable: others keep order
