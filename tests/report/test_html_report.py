"""The self-contained HTML report: written by every run, charts embedded, and
rendered by a real headless browser where one is installed."""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path

import orjson
import pytest
from browser import CHROMIUM, FLAGS, NO_CHROMIUM
from fakes import FakeEngine

from bulkinfer.config import load_settings
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.report.html import write_run_html


@pytest.fixture(scope="module")
def report_html(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("html")
    src = tmp / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "prompt": "word " * (i * 7 + 1)}) + b"\n" for i in range(40)))
    paths = RunPaths.build(src, tmp / "out.jsonl")
    run(paths, load_settings(), RunContext(engine_factory=lambda m, s: FakeEngine(step_delay=0.01)))
    return paths.html


def test_every_run_writes_a_self_contained_html_report(report_html: Path) -> None:
    page = report_html.read_text(encoding="utf-8")
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) >= 5  # prompt lengths, padding per bucket, overall, completion lengths, phases
    for data in images:
        assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")
    assert not re.search(r"(src|href)=\"https?://", page), "the report must not fetch anything"
    for heading in ("Summary", "Charts", "Engine settings"):
        assert f"<h2>{heading}</h2>" in page


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_chromium_renders_the_charts(report_html: Path, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    url = report_html.resolve().as_uri()
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    sizes = re.search(r'data-images="([^"]*)"', dom.stdout)
    assert sizes, dom.stderr[-2000:]
    decoded = [tuple(map(int, s.split("x"))) for s in sizes.group(1).split(",")]
    assert len(decoded) >= 5 and all(w > 0 and h > 0 for w, h in decoded), decoded
    # a long value without spaces (GLIBC_TUNABLES, as a run of the CLI reports it) wraps inside its cell
    report = orjson.loads(report_html.with_name("out.report.json").read_bytes())
    report["engine"]["glibc_tunables"] = ":".join(f"glibc.malloc.setting_{i}=33554432" for i in range(6))
    wide = tmp_path / "wide.html"
    write_run_html(report, wide)
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile3'}", "--window-size=1280,800",
         "--virtual-time-budget=5000", "--dump-dom", wide.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    overflow = re.search(r'data-overflow="(-?\d+)"', dom.stdout)
    assert overflow, dom.stderr[-2000:]
    assert int(overflow.group(1)) <= 0, f"the page is {overflow.group(1)} px wider than the window"
    shot = tmp_path / "report.png"
    subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile2'}", "--window-size=1200,1800",
         f"--screenshot={shot}", url],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert shot.exists() and shot.stat().st_size > 10_000
