"""The calibration store: the throughput each model's last run measured on
this machine, in ``$BULKINFER_HOME/calibration.json``. ``plan`` turns it into
a time estimate; every ``run`` of 16 rows or more updates it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.default_model import bulkinfer_home
from bulkinfer.io.files import atomic_write


def calibration_path() -> Path:
    return bulkinfer_home() / "calibration.json"


def record_calibration(report: dict[str, Any]) -> None:
    """Remember a finished run's throughput for its model (atomic write).

    Runs that completed fewer than 16 rows teach nothing and are skipped."""
    if report.get("request_counts", {}).get("completed", 0) - report.get("resumed", {}).get("completed", 0) < 16:
        return
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_calibrations()
    data[str(report["model_path"])] = {
        "completion_tokens_per_s": report["throughput"]["completion_tokens_per_s"],
        "prompt_tokens_per_s": report["throughput"]["prompt_tokens_per_s"],
        "requests_per_s": report["throughput"]["requests_per_s"],
        "load_seconds": report["seconds"]["load"],
        "device": report.get("engine", {}).get("device"),
        "dtype": report.get("engine", {}).get("dtype"),
        "rows": report["request_counts"]["completed"],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "report": report.get("output"),
    }
    atomic_write(path, orjson.dumps(data, option=orjson.OPT_INDENT_2))


def load_calibrations() -> dict[str, Any]:
    try:
        data: dict[str, Any] = orjson.loads(calibration_path().read_bytes())
        return data
    except (OSError, orjson.JSONDecodeError):
        return {}
