"""The account of engine starts (``$BULKINFER_ENGINE_STARTS``): who asked, ready or failed, killed."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bulkinfer.engine.starts import ENV, FOR_ENV, engine_start, summary


def test_each_start_is_counted_by_kind_and_by_who_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "starts.jsonl"
    monkeypatch.setenv(ENV, str(path))
    monkeypatch.setenv(FOR_ENV, "tests/a.py::test_one")
    with engine_start("m", "generate"):
        pass
    with pytest.raises(RuntimeError), engine_start("m", "generate"):
        raise RuntimeError("the start failed")
    monkeypatch.delenv(FOR_ENV)
    with engine_start("e", "embed"):
        pass
    # a start killed with its process: a begin and no end
    with path.open("ab") as f:
        f.write(orjson.dumps({"event": "begin", "id": "x", "kind": "embed", "for": "tests/b.py::t"}) + b"\n")
    account = summary(path)
    assert (account["starts"], account["ready"], account["failed"], account["unfinished"]) == (4, 2, 1, 1)
    assert account["by_kind"] == {"generate": 2, "embed": 2}
    assert account["by_for"] == {"tests/a.py::test_one": 2, None: 1, "tests/b.py::t": 1}
