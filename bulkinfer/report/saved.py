"""Saved reports read back from their files: a run's or an eval's
(:func:`load_report`, typed), and the files a report names where they are now
(:func:`beside`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bulkinfer.errors import InputFileError
from bulkinfer.report.eval_model import EvalReport
from bulkinfer.report.model import RunReport


def load_report(path: Path) -> tuple[RunReport | EvalReport, dict[str, Any]]:
    """A saved report (``OUT.report.json`` of run or embed, ``OUT.eval.json``
    of eval), typed, and the JSON object it was read from.

    Raises:
        InputFileError: missing, unreadable, not a JSON object, or not a report
            (the message names the file and the key).
    """
    from bulkinfer.io.records import read_json_file

    data = read_json_file(path, "report file")
    if "measures" in data:
        raise InputFileError(
            f"{path} is the OUT.eval.json of `bulkinfer eval-rank`: its measures are in the file; "
            "`bulkinfer report` shows run and eval reports"
        )
    if "scores" in data:
        return EvalReport.from_dict(data, str(path)), data
    if "request_counts" in data:
        return RunReport.from_dict(data, str(path)), data
    raise InputFileError(f"{path} is neither a saved OUT.report.json nor an OUT.eval.json")


def beside(written: str | None, report_path: Path) -> Path | None:
    """A file a report names (``output``, ``run_report``), where it is now: at
    the path written (relative to the working directory, as the run was
    given it), else under the same name beside the report (a report moved
    with its files); None when neither exists."""
    if not written:
        return None
    for candidate in (Path(written), report_path.parent / Path(written).name):
        if candidate.is_file():
            return candidate
    return None
