"""Which skips a test run allows (issue 32: one suite that proves the same on
every machine). A pytest plugin, loaded by ``tests/conftest.py``.

**By design: the device markers.** ``@pytest.mark.device("cuda", reason=...)``
says a test holds only on that device (``"cpu"`` or ``"cuda"``);
``@pytest.mark.devices(2, reason=...)`` says it needs that many devices of
the device the run uses (CPU cores this process may run on,
``os.sched_getaffinity``, on CPU; ``torch.cuda.device_count()`` on CUDA).
The device a run uses is bulkinfer's own decision,
:func:`bulkinfer.engine.args.detect_device` (it imports torch: called once a
session, and only when a collected test carries one of the markers); the
environment variable ``BULKINFER_TEST_DEVICE`` (``cpu`` or ``cuda``)
overrides it. A test whose requirement this run does not meet is skipped
with the marker's reason, on every machine alike.

**Any other skip fails under CI.** When the environment variable ``CI`` is
set (not empty, ``0`` or ``false``), a test that ends skipped (``pytest.skip``,
a ``skipif`` that held, ``pytest.importorskip``) is reported as FAILED, and a
module skipped at collection is a collection error: a machine that lacks a
tool must say so, not pass. Outside CI a skip stays a skip. Expected
failures (``xfail``) are not skips.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

DEVICES = ("cpu", "cuda")


# The test's skip is the device markers' (allowed under CI), with its reason.
BY_DESIGN = pytest.StashKey[str]()


# The device this session's tests run on, once known.
RUN_DEVICE = pytest.StashKey[str]()


def under_ci() -> bool:
    """Whether the environment variable ``CI`` is set to anything but empty, ``0`` or ``false``."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def run_device(config: pytest.Config) -> str:
    """The device this session's tests run on: ``BULKINFER_TEST_DEVICE``
    when set, else :func:`bulkinfer.engine.args.detect_device` (once per
    session: it imports torch).

    Raises:
        pytest.UsageError: ``BULKINFER_TEST_DEVICE`` is neither ``cpu`` nor ``cuda``.
    """
    override = os.environ.get("BULKINFER_TEST_DEVICE", "").strip().lower()
    if override:
        if override not in DEVICES:
            raise pytest.UsageError(f"BULKINFER_TEST_DEVICE={override!r}: expected one of {', '.join(DEVICES)}")
        return override
    if RUN_DEVICE not in config.stash:
        from bulkinfer.engine.args import detect_device

        config.stash[RUN_DEVICE] = detect_device()
    return config.stash[RUN_DEVICE]


def device_count(device: str) -> int:
    """How many ``device`` devices this process may use: CPU cores on
    ``"cpu"`` (its affinity mask), ``torch.cuda.device_count()`` on ``"cuda"``."""
    if device == "cpu":
        return len(os.sched_getaffinity(0))
    import torch

    return int(torch.cuda.device_count())


def _marker_args(item: pytest.Item, mark: pytest.Mark) -> tuple[object, str]:
    """The marker's requirement (its first argument) and its ``reason`` (keyword or second argument)."""
    if not mark.args:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{mark.name} needs an argument (see tests/skip_policy.py)")
    reason = mark.kwargs.get("reason", mark.args[1] if len(mark.args) > 1 else "")
    if not reason:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{mark.name} needs a reason (why the test needs it)")
    return mark.args[0], str(reason)


def device_skip(item: pytest.Item, config: pytest.Config) -> str | None:
    """Why ``item`` does not hold on this run (its ``device``/``devices``
    markers against :func:`run_device`), or None when it does.

    Raises:
        pytest.UsageError: a marker without its requirement or reason, or with an unknown device.
    """
    for mark in item.iter_markers("device"):
        name, reason = _marker_args(item, mark)
        if name not in DEVICES:
            raise pytest.UsageError(f"{item.nodeid}: device({name!r}): expected one of {', '.join(DEVICES)}")
        device = run_device(config)
        if name != device:
            return f"holds only on {name}: {reason}; this run uses {device}"
    for mark in item.iter_markers("devices"):
        needed, reason = _marker_args(item, mark)
        if not isinstance(needed, int) or isinstance(needed, bool) or needed < 1:
            raise pytest.UsageError(f"{item.nodeid}: devices({needed!r}): expected a count of 1 or more")
        device = run_device(config)
        have = device_count(device)
        if have < needed:
            return f"needs {needed} {device} devices: {reason}; this run has {have}"
    return None


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: deselected tests never make torch load
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, with the marker's reason, each test whose device markers this run does not meet."""
    for item in items:
        if reason := device_skip(item, config):
            item.stash[BY_DESIGN] = reason
            item.add_marker(pytest.mark.skip(reason=reason))


def _skip_reason(longrepr: object) -> str:
    """The reason of a skip report's ``(path, line, "Skipped: reason")``."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _not_allowed(reason: str) -> str:
    return f"skipped under CI: {reason}; mark it device(...) if this machine lacks it by design"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under CI, a skip that is not the device markers' becomes a failure."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and BY_DESIGN not in item.stash and under_ci():
        reason = _skip_reason(report.longrepr)
        report.outcome = "failed"
        report.longrepr = _not_allowed(reason)
        report.user_properties.append(("skipped_under_ci", reason))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """Under CI, a module skipped at collection (a module-level ``pytest.skip``
    or ``importorskip``) is a collection error."""
    report = yield
    if report.skipped and under_ci():
        report.outcome = "failed"
        report.longrepr = _not_allowed(_skip_reason(report.longrepr))
    return report


def pytest_report_teststatus(report: pytest.TestReport) -> tuple[str, str, str] | None:
    """A test skipped under CI counts as FAILED, also when the skip came in
    its set-up (a ``skipif`` or a skip marker), which pytest would call an error."""
    if report.failed and any(name == "skipped_under_ci" for name, _ in getattr(report, "user_properties", ())):
        return "failed", "F", "FAILED"
    return None
