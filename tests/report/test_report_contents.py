"""What the run and eval reports say: the token series comes from the engine's
live counts and stays bounded, the HTML names what padding figures mean,
labels its bars and axes, shows sampling settings, wall time, end-to-end
throughput and bytes in GiB; reports of an older bulkinfer still render."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from fakes import FakeEngine
from rich.console import Console
from typer.testing import CliRunner

from bulkinfer.cli import app
from bulkinfer.config import load_settings
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.report import html as report_html
from bulkinfer.report import stats, threads
from bulkinfer.report.stats import TokenSeries
from bulkinfer.report.terminal import print_summary
from bulkinfer.report.units import format_bytes
from bulkinfer.schema import Completion

TOKENS_PER_ROW = 6


class StreamingEngine(FakeEngine):
    """Generates one token per running request per step, as vLLM streams
    them, and finishes every request together after TOKENS_PER_ROW steps: a
    point of the series between 0 and the total was taken before any row finished."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: dict[str, int] = {}
        self.finished_steps: list[int] = []

    def step(self, wait: float | None = None) -> list[Completion]:
        self.steps += 1
        for rid, req in self.queue:
            if rid not in self.tokens:  # its first step: the prompt is processed
                self.tokens[rid] = 0
                self.prefilled_tokens += len(req.prompt_token_ids or ())
            self.tokens[rid] += 1
            self.generated_tokens += 1
        if not self.queue or any(n < TOKENS_PER_ROW for n in self.tokens.values()):
            return []
        done = [Completion(rid, "x", "length", len(r.prompt_token_ids or ()), TOKENS_PER_ROW) for rid, r in self.queue]
        self.queue.clear()
        self.finished_steps.append(self.steps)
        return done


def _rows(path: Path, n: int) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "prompt": "word " * (i * 9 + 1)}) + b"\n" for i in range(n)))
    return path


def test_the_token_series_rises_with_the_engines_live_counts_before_any_row_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stats, "SERIES_INTERVAL_S", 0.0)  # a point after every step
    engine = StreamingEngine()
    paths = RunPaths.build(_rows(tmp_path / "in.jsonl", 4), tmp_path / "out.jsonl")
    result = run(paths, load_settings(), RunContext(engine_factory=lambda m, s: engine))
    assert engine.finished_steps == [TOKENS_PER_ROW]  # every row finished on the last step
    series = result.report["tokens_over_time"]
    completion, prompt = series["completion_tokens"], series["prompt_tokens"]
    total_prompt = result.report["tokens"]["prompt"]
    assert completion[-1] == 4 * TOKENS_PER_ROW == result.report["tokens"]["completion"]
    # before the step that finished the rows: 4, 8, ... tokens generated, all prompts processed
    assert [c for c in completion if 0 < c < completion[-1]] == [4 * k for k in range(1, TOKENS_PER_ROW)]
    assert prompt[1] == total_prompt and prompt[-1] == total_prompt
    assert series["seconds"] == sorted(series["seconds"]) and series["seconds"][0] == 0.0
    assert len(series["seconds"]) == len(completion) == len(prompt)


def test_a_row_of_n_choices_counts_each_choice_at_its_length_as_its_finish_reason() -> None:
    """The histogram counts choices as ``finish_reasons`` does: a row of 3
    choices of 2, 60 and 64 tokens is three lengths, not one of 126 (past
    its ``max_tokens`` 64, in the 65-128 bin)."""
    from bulkinfer.schema import Choice

    run_stats = stats.RunStats()
    choices = tuple(
        Choice(i, "x", reason, tokens) for i, (tokens, reason) in enumerate([(2, "stop"), (60, "stop"), (64, "length")])
    )
    run_stats.finished(Completion("r0", "x", "stop", 5, 126, choices=choices))
    run_stats.finished(Completion("r1", "y", "stop", 5, 7))
    out = run_stats._completions()
    assert out["finish_reasons"] == {"stop": 3, "length": 1}
    assert out["completion_length_histogram"] == [
        {"range": "2-2", "rows": 1},
        {"range": "5-8", "rows": 1},
        {"range": "33-64", "rows": 2},
    ]


def test_the_token_series_stays_bounded_and_spans_the_whole_run() -> None:
    series = TokenSeries(interval_s=1.0, max_points=8)
    for t in range(1, 1001):
        series.observe(float(t), 10 * t, 3 * t)
    assert len(series.points) <= 8
    assert series.interval_s == 128.0  # doubled at every thinning: 1 -> 128 over 1000 s
    out = series.to_dict(1000.5, 10_000, 3_000)
    assert out["seconds"][0] == 0.0 and out["seconds"][-1] == 1000.5
    assert out["seconds"][-2] >= 1000.5 - 2 * series.interval_s  # the last points are recent
    assert out["completion_tokens"][-1] == 10_000 and out["prompt_tokens"][-1] == 3_000
    gaps = [b - a for a, b in zip(out["seconds"], out["seconds"][1:], strict=False)]
    assert max(gaps) <= 2 * series.interval_s


@pytest.mark.parametrize(
    ("n", "shown"),
    [(5996930048, "5.59 GiB"), (8121188352, "7.56 GiB"), (722526208, "689 MiB"), (1536, "1.50 KiB"), (512, "512 B"),
     (0, "0 B"), (2**40, "1.00 TiB")],
)  # fmt: skip
def test_bytes_read_in_binary_units(n: int, shown: str) -> None:
    assert format_bytes(n) == shown


@pytest.fixture(scope="module")
def run_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("contents")
    paths = RunPaths.build(_rows(tmp / "in.jsonl", 30), tmp / "out.jsonl")
    settings = load_settings(overrides={"sampling.max_tokens": 77, "sampling.temperature": 0.3})
    report = run(paths, settings, RunContext(engine_factory=lambda m, s: FakeEngine())).report
    report["engine"] = {**report["engine"], "kv_cache_memory_bytes": 5996930048}
    report["peak_rss_bytes"] = {"bulkinfer": 722526208, "children": 8121188352}
    return report


def _page(report: dict[str, Any], path: Path) -> str:
    report_html.write_run_html(report, path)
    return path.read_text(encoding="utf-8")


def test_the_html_says_that_vllm_does_not_pad_beside_the_padding_charts(
    run_report: dict[str, Any], tmp_path: Path
) -> None:
    page = _page(run_report, tmp_path / "r.html")
    section = page.split("<h2>Padding: what static batching would waste</h2>")[1].split("<h2>")[0]
    assert "vLLM does not pad" in section and "this run wasted none of these positions" in section
    assert 'alt="padding per bucket"' in section and 'alt="padding overall"' in section
    assert 'alt="padding' not in page.split("<h2>Padding")[0]  # no padding chart outside the note's section


def test_the_html_shows_sampling_wall_time_end_to_end_throughput_and_gib(
    run_report: dict[str, Any], tmp_path: Path
) -> None:
    page = _page(run_report, tmp_path / "r.html")
    sampling = page.split("<h2>Sampling settings</h2>")[1].split("<h2>")[0]
    assert '<td>max_tokens</td><td class="n">77</td>' in sampling
    assert '<td>temperature</td><td class="n">0.30</td>' in sampling
    assert "wall time (model load included)" in page
    e2e = run_report["throughput_end_to_end"]["completion_tokens_per_s"]
    assert f"end to end ({run_report['seconds']['total']:,.1f} s, model load included)" in page
    assert f'<td class="n">{e2e:,.2f}</td>' in page
    assert "5.59 GiB (5,996,930,048 bytes)" in page and "5996930048" not in page
    assert "689 MiB" in page and "7.56 GiB" in page
    assert 'alt="tokens over time"' in page


def _charts(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Captures every figure the report draws, by title, instead of encoding it."""
    figures: dict[str, Any] = {}

    def keep(fig: Any) -> str:
        ax = fig.axes[0]
        figures[ax.get_title()] = ax
        return ""

    monkeypatch.setattr(report_html, "_png", keep)
    return figures


def test_every_bar_carries_its_value_and_row_axes_tick_whole_numbers(
    run_report: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = _charts(monkeypatch)
    report = {**run_report, "seconds": {"load": 28.2, "plan": 0.1, "generate": 203.7, "write": 0.135, "total": 235.9}}
    report_html.run_sections(report)
    phases = figures["time by phase (plan and write overlap generate)"]
    assert [t.get_text() for t in phases.texts] == ["28 s", "0.10 s", "204 s", "0.14 s"]
    prompts = figures["prompt length (rows per bucket)"]
    assert sum(int(t.get_text()) for t in prompts.texts) == 30
    assert all(float(y).is_integer() for y in prompts.get_yticks())
    overall = next(ax for title, ax in figures.items() if title.startswith("padding efficiency overall"))
    pad = run_report["padding_efficiency"]
    assert [t.get_text() for t in overall.texts] == [f"{100 * pad['arrival']:.0f}%", f"{100 * pad['sorted']:.0f}%"]
    tokens = figures["tokens over generation time (engine's live counts; slope = tokens/s)"]
    assert tokens.get_xlabel() == "seconds since the first request" and tokens.get_ylabel() == "tokens (cumulative)"


def test_eval_charts_label_their_score_axes_and_count_rows_in_whole_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    figures = _charts(monkeypatch)
    scores = {name: 10.0 for name in ("bleu", "rougeL")}
    counts = {"golden": 4, "scored": 3, "unmatched": {"golden": 1, "predictions": 0}, "unmatched_golden": ["g4"]}
    report = {"scores": {**scores, "signatures": {"bleu": "nrefs:1"}}, "row_counts": counts}
    rows = [{"bleu": 12.5, "rougeL": 40.0}, {"bleu": 30.0, "rougeL": 45.0}, {"bleu": 31.0, "rougeL": 80.0}]
    sections = report_html.eval_sections(report, ["bleu", "rougeL"], rows)
    bleu, rouge = figures["per-row bleu (3 rows)"], figures["per-row rougeL (3 rows)"]
    assert bleu.get_xlabel() == "sentence BLEU (0-100, higher is better)"
    assert rouge.get_xlabel() == "ROUGE-L F1 (0-100, higher is better)"
    for ax in (bleu, rouge):
        assert ax.get_ylabel() == "rows"
        assert all(float(y).is_integer() for y in ax.get_yticks()), ax.get_yticks()
        assert ax.get_xlim() == (0.0, 100.0)
    page = "".join(sections)
    assert '<td>scored</td><td class="n">3</td>' in page
    assert '<td>unmatched golden</td><td class="n">1</td>' in page  # a list of ids, as its count
    assert "{" not in page.split("<h2>Rows</h2>")[1].split("</table>")[0]  # no raw dict


def test_a_report_of_an_older_bulkinfer_still_renders(run_report: dict[str, Any], tmp_path: Path) -> None:
    old = {k: v for k, v in run_report.items() if k not in {
        "tokens_over_time", "sampling", "throughput_end_to_end", "completion_length_histogram",
        "chat_template_applied", "peak_rss_bytes", "resumed"}}  # fmt: skip
    old["timeline"] = [[0.0, 0], [3.0, 5549], [6.0, 30647]]  # counted at each row's finish: not plotted
    saved = tmp_path / "old.report.json"
    saved.write_bytes(orjson.dumps(old))
    result = CliRunner().invoke(app, ["report", str(saved)])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "old.report.html").read_text(encoding="utf-8")
    assert "This report has no token series" in page and 'alt="tokens over time"' not in page
    assert "<h2>Sampling settings</h2>" not in page and "vLLM does not pad" in page


def test_the_terminal_summary_shows_end_to_end_throughput_and_memory_in_gib(run_report: dict[str, Any]) -> None:
    out = io.StringIO()
    print_summary(run_report, Console(file=out, width=200))
    text = out.getvalue()
    assert "bulkinfer 689 MiB, engine 7.56 GiB" in text
    assert "end to end (load included)" in text and "vLLM does not pad" in text
    assert "30 (30 completed, 0 failed)" in text  # no blank lines: none named
    out = io.StringIO()
    counts = {"total": 13, "completed": 5, "failed": 6, "skipped": 2}
    print_summary({**run_report, "request_counts": counts}, Console(file=out, width=200))
    assert "13 (5 completed, 6 failed, 2 blank lines skipped)" in out.getvalue()  # total = the three


def test_the_terminal_names_a_block_size_bulkinfer_chose_and_not_vllms_own(run_report: dict[str, Any]) -> None:
    chosen = {"block_size": 32, "why": "32 tokens: blocks of 32 tokens spare the rows of n choices 9 prompt tokens"}
    kept = {"block_size": None, "why": "vLLM's: no row of the input's first rows asks more than one choice"}
    shown = []
    for block in (chosen, kept):
        out = io.StringIO()
        choice = {**run_report.get("engine_choice", {}), "block_size": block}
        print_summary({**run_report, "engine_choice": choice}, Console(file=out, width=200))
        shown.append([line for line in out.getvalue().splitlines() if "KV blocks" in line])
    assert len(shown[0]) == 1 and "32 tokens: blocks of 32 tokens spare the rows of n choices 9" in shown[0][0]
    assert "32 tokens: 32 tokens" not in shown[0][0] and shown[1] == []


def test_finish_reasons_structured_checks_and_pass_through_fields_are_reported(
    run_report: dict[str, Any], tmp_path: Path
) -> None:
    assert run_report["finish_reasons"] == {"stop": 30}  # FakeEngine ends every row with "stop"
    assert run_report["structured_outputs"] is None and run_report["passthrough_fields"] == []
    report = {
        **run_report,
        "finish_reasons": {"stop": 7, "length": 2},
        "structured_outputs": {
            "backend": "xgrammar",
            "by_kind": {"json": {"completions": 9, "valid": 7, "cut_at_max_tokens": 2, "invalid": 0, "unchecked": 0}},
        },
        "passthrough_fields": [
            {"name": "max_token", "rows": 3, "did_you_mean": "max_tokens"},  # a report from before "replaced"
            {"name": "completion", "rows": 2, "did_you_mean": None, "replaced": True},
        ],
    }
    page = _page(report, tmp_path / "r.html")
    reasons = page.split("<h2>Completions by finish_reason</h2>")[1].split("<h2>")[0]
    assert '<td>length</td><td class="n">2</td>' in reasons
    structured = page.split("<h2>Structured output</h2>")[1].split("<h2>")[0]
    assert '<td>json</td><td class="n">9</td><td class="n">7</td><td class="n">2</td>' in structured
    assert "Grammar backend: xgrammar" in structured
    assert "did you mean max_tokens? copied, not read" in page
    assert '<td>completion</td><td class="n">2</td><td>replaced by the output&#x27;s own field: not copied</td>' in page
    plain = _page(
        {**report, "passthrough_fields": [{"name": "source", "rows": 9, "did_you_mean": None}]}, tmp_path / "p.html"
    )
    fields = plain.split("<h2>Pass-through fields</h2>")[1].split("<h2>")[0]
    assert "<th></th>" not in fields and '<td>source</td><td class="n">9</td></tr>' in fields  # no empty column
    out = io.StringIO()
    print_summary(report, Console(file=out, width=200))
    text = out.getvalue()
    assert "stop 7, length 2" in text and "7/9 valid, 2 cut at max_tokens, 0 invalid" in text
    assert "max_token 3 (did you mean max_tokens? copied, not read)" in text
    assert "completion 2 (replaced by the output's own field: not copied)" in text


class PreemptingEngine(FakeEngine):
    """Reports one preemption a step (vLLM's count, as bulkinfer's step hook
    gives it) and 5 already when the run starts, as an engine reused from an
    earlier run would."""

    def __init__(self) -> None:
        super().__init__()
        self.preempted = 5

    def step(self, wait: float | None = None) -> list[Completion]:
        self.preempted += 1
        return super().step(wait)

    def step_counts(self) -> dict[str, int]:
        return {"preemptions": self.preempted, "batch_order_swaps": 3}


def test_a_runs_own_preemptions_are_reported_and_named_on_the_terminal(
    run_report: dict[str, Any], tmp_path: Path
) -> None:
    engine = PreemptingEngine()
    paths = RunPaths.build(_rows(tmp_path / "in.jsonl", 8), tmp_path / "out.jsonl")
    report = run(paths, load_settings(), RunContext(engine_factory=lambda m, s: engine)).report
    assert engine.steps >= 4  # FakeEngine finishes 2 rows a step
    assert (report["engine"]["preemptions"], report["engine"]["batch_order_swaps"]) == (engine.steps, 0)
    out = io.StringIO()
    print_summary(report, Console(file=out, width=300))
    row = [cell.strip() for cell in next(x for x in out.getvalue().splitlines() if "KV cache" in x).split("│")]
    assert row[1:3] == [
        "preemptions",
        f"{engine.steps}: the KV cache did not hold every running row, so vLLM "
        "stopped requests and computed their tokens again (a larger --kv-cache-memory-bytes or a "
        "smaller --max-num-seqs avoids it)",
    ]
    out = io.StringIO()
    print_summary(run_report, Console(file=out, width=300))  # an engine without the count: no such line
    assert "preemptions" not in run_report["engine"] and "preemptions" not in out.getvalue()


def test_cpu_seconds_count_the_feeding_thread_apart_from_the_process() -> None:
    """A thread spinning beside the feeding thread (as an engine's step
    thread does) counts in ``process`` and not in ``feed_thread``, which
    holds only what the feeding thread itself ran."""
    run_stats = stats.RunStats()
    run_stats.start()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, name="spinner")
    spinner.start()
    time.sleep(0.5)  # the feeding thread waits, as for an engine step
    busy_until = time.thread_time() + 0.05
    while time.thread_time() < busy_until:
        pass
    run_stats.generation_ended()  # the spinner still running: a thread gone by then is not in /proc
    stop.set()
    spinner.join()
    cpu = run_stats.cpu_seconds
    assert 0.05 <= cpu["feed_thread"] < 0.4
    assert cpu["process"] >= cpu["feed_thread"] + 0.1
    # by thread, from /proc (clock ticks of 0.01 s): the same two threads, named as Python names them
    by_name = {(t["process"], t["thread"]): t for t in cpu["threads"]}
    main, spinner = by_name[("bulkinfer", "MainThread")], by_name[("bulkinfer", "spinner")]
    assert main["seconds"] == pytest.approx(cpu["feed_thread"], abs=0.03)
    assert spinner["seconds"] >= 0.1 and spinner["threads"] == 1


def test_thread_cpu_counts_children_and_threads_started_in_between() -> None:
    """A child process's threads count under its kernel name; a thread that
    did not exist at the first snapshot counts from zero; threads of one name
    are summed; one that used (almost) nothing is left out."""
    before = {(1, 1): ("bulkinfer", "MainThread", 5.0), (1, 2): ("bulkinfer", "gloo_tcp_loop", 1.0)}
    after = {
        (1, 1): ("bulkinfer", "MainThread", 5.004),
        (1, 2): ("bulkinfer", "gloo_tcp_loop", 1.25),
        (1, 3): ("bulkinfer", "gloo_tcp_loop", 0.5),
        (7, 7): ("bulkinfer-watch", "bulkinfer-watch", 0.3),
    }
    assert threads.used(before, after) == [
        {"process": "bulkinfer", "thread": "gloo_tcp_loop", "threads": 2, "seconds": 0.75},
        {"process": "bulkinfer-watch", "thread": "bulkinfer-watch", "threads": 1, "seconds": 0.3},
    ]
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: pass"])
    try:
        time.sleep(0.5)
        found = {pid: name for (pid, _), (name, _, _) in threads.snapshot().items()}
        assert found[os.getpid()] == "bulkinfer" and child.pid in found
    finally:
        child.kill()
        child.wait()
