"""bench.compare's bookkeeping without an engine: the static baseline's subset and the feed-order summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.compare import bench_settings, build_parser, plan_jobs, summarize_orders, summarize_systems
from bench.systems import BenchSettings
from bench.table import _cpu, render
from bench.workload import Row, static_subset

# The machine and versions every results page starts with (bench.measure.machine / versions).
PROVENANCE: dict[str, Any] = {
    "machine": {
        "cpu": "cpu",
        "logical_cores": 2,
        "physical_cores": 1,
        "memory_bytes": 2**30,
        "gpus": [],
        "python": "3.12",
    },
    "versions": {"vllm": "v", "torch": "t", "transformers": "x"},
}


def _row(i: int, prompt: int, out: int) -> Row:
    return Row(f"r{i}", "x", list(range(prompt)), out)


def test_static_subset_takes_the_first_rows_within_the_length_limit() -> None:
    rows = [_row(0, 10, 500), _row(1, 10, 10), _row(2, 400, 200), _row(3, 5, 5), _row(4, 1, 1)]
    assert [r.id for r in static_subset(rows, 2, 512)] == ["r0", "r1"]  # r0: 510 <= 512; r2: 600 > 512
    assert [r.id for r in static_subset(rows, 2, 300)] == ["r1", "r3"]
    assert [r.id for r in static_subset(rows, 0, 100)] == ["r1", "r3", "r4"]
    assert static_subset(rows, 0, None) == rows
    assert [r.id for r in static_subset(rows, 3, None)] == ["r0", "r1", "r2"]


def test_static_subset_limit_is_inclusive() -> None:
    rows = [_row(0, 12, 500), _row(1, 13, 500)]
    assert [r.id for r in static_subset(rows, 0, 512)] == ["r0"]


def _a(key: str, order: str, tps: float | None) -> dict[str, Any]:
    gen = None if tps is None else {"completion_tokens_per_s": tps}
    return {"key": key, "order": order, "throughput_generate": gen}


def test_summarize_orders_means_and_best() -> None:
    results = [
        {"key": "b", "throughput_generate": {"completion_tokens_per_s": 999.0}},
        _a("a-arrival-1", "arrival", 260.0),
        _a("a-descending-1", "descending", 250.0),
        _a("a-arrival-2", "arrival", 250.0),
        _a("a-descending-2", "descending", 270.0),
        {"key": "a-ascending-1", "error": "SystemFailed: boom"},
    ]
    summary = summarize_orders(results)
    assert summary is not None
    by_order = summary["completion_tokens_per_s_generate"]
    assert set(by_order) == {"arrival", "descending"}
    assert by_order["arrival"] == {"runs": [260.0, 250.0], "mean": 255.0, "min": 250.0, "max": 260.0}
    assert by_order["descending"]["mean"] == pytest.approx(260.0)
    assert summary["best"] == "descending"
    assert summarize_orders([{"key": "b", "throughput_generate": None}]) is None


def test_table_lists_orders_and_marks_an_incomplete_run() -> None:
    doc: dict[str, Any] = {
        "created": "2026-11-22T00:00:00Z",
        "command": "python -m bench.compare",
        "complete": False,
        "loadavg_before": [0.0, 0.0, 0.0],
        **PROVENANCE,
        "settings": {
            "model": "m",
            "dtype": "float32",
            "enforce_eager": True,
            "kv_cache_memory_bytes": 1,
            "seed": 0,
            "temperature": 0.0,
            "top_p": 1.0,
        },
        "workload": {
            "name": "w",
            "rows": 1,
            "description": "d",
            "prompt_tokens": 1,
            "completion_tokens": 1,
            "prompt_tokens_min_mean_max": [1, 1, 1],
            "completion_tokens_min_mean_max": [1, 1, 1],
            "hf_subset": "s",
        },
        "notes": [],
        "results": [],
        "orders": summarize_orders([_a("a-arrival-1", "arrival", 260.0), _a("a-arrival-2", "arrival", 250.0)]),
    }
    page = render(doc)
    assert "| arrival (best mean) | 260.0, 250.0 | 255.0 | 250.0 | 260.0 |" in page
    assert "**Incomplete**" in page
    assert "No order is measurably best" not in page  # one order only


def test_scale_growth_is_relative_to_the_smallest_size_of_at_least_10k_rows() -> None:
    from bench.scale import add_growth

    def res(rows: int, rss: int, generate_s: float, kv: int = 0) -> dict[str, Any]:
        return {
            "rows": rows,
            "peak_rss_bytes_bulkinfer": rss,
            "kv_cache_bytes": kv,
            "engine_in_process": True,
            "generate_ms_per_row": 1000 * generate_s / rows,
            "seconds": {"total": generate_s + 30},
        }

    results = [res(1_000, 500, 2.0, 100), res(10_000, 700, 100.0, 300), res(100_000, 770, 1200.0, 320)]
    assert add_growth(results) == {"baseline_rows": 10_000}
    small, base, big = (r["growth"] for r in results)
    assert base["rss_ratio"] == 1.0 and base["seconds_per_row_ratio"] == 1.0
    assert big["rows_ratio"] == 10.0
    assert big["rss_ratio"] == pytest.approx(1.1)
    assert big["seconds_per_row_ratio"] == pytest.approx(1.2)  # 12 ms/row over 10 ms/row: worse than linear
    assert big["total_seconds_ratio"] == pytest.approx(1230 / 130)
    assert small["rss_ratio"] == pytest.approx(500 / 700)
    # the KV cache is sized to the job (up to a cap): what is left is what could grow with the file
    assert big["rss_less_kv_cache_ratio"] == pytest.approx(450 / 400) and small["rss_less_kv_cache_ratio"] == 1.0
    assert add_growth([res(1_000, 500, 2.0)]) is None


def test_readme_takes_the_scale_page_between_its_markers(tmp_path: Path) -> None:
    from bench import readme

    doc = {
        "benchmark": "bench.scale",
        "created": "2026-11-22T00:00:00Z",
        "command": "python -m bench.scale",
        **PROVENANCE,
        "workload": "w",
        "results": [
            {
                "rows": 10_000,
                "seconds": {"total": 130.0, "load": 25.0, "plan": 1.0, "generate": 100.0},
                "generate_ms_per_row": 10.0,
                "peak_rss_bytes_bulkinfer": 700e6,
                "kv_cache_bytes": 300e6,
                "engine_in_process": True,
                "peak_rss_tree_bytes": 2e9,
                "growth": {"rss_ratio": 1.0, "rss_less_kv_cache_ratio": 1.0, "seconds_per_row_ratio": 1.0},
            },
            {  # a results file from before the KV cache was recorded
                "rows": 1_000,
                "seconds": {"total": 40.0, "load": 25.0, "plan": 0.0, "generate": 12.0},
                "generate_ms_per_row": 12.0,
                "peak_rss_bytes_bulkinfer": 650e6,
                "peak_rss_tree_bytes": 2e9,
                "growth": {"rss_ratio": 0.93, "seconds_per_row_ratio": 1.2},
            },
        ],
        "growth": {"baseline_rows": 10_000},
    }
    results = tmp_path / "scale.json"
    results.write_bytes(orjson.dumps(doc))
    page = tmp_path / "README.md"
    page.write_text("intro\n<!-- bench.scale:start -->\nOLD CONTENT\n<!-- bench.scale:end -->\nafter\n")
    readme.main([str(results), "--readme", str(page)])
    text = page.read_text()
    assert text.startswith("intro\n<!-- bench.scale:start -->\n#### bench.scale (2026-11-22T00:00:00Z)")
    assert "| 10,000 | 130.0 | 25.0 | 1.0 | 100.0 | 10.00 | 700 | 300 | 400 | 2000 | 1.00x | 1.00x | 1.00x |" in text
    assert "| 1,000 | 40.0 | 25.0 | 0.0 | 12.0 | 12.00 | 650 | — | — | 2000 | 0.93x | — | 1.20x |" in text
    assert "OLD CONTENT" not in text and text.endswith("<!-- bench.scale:end -->\nafter\n")
    with pytest.raises(SystemExit, match="no <!-- bench.orders:start --> marker"):
        readme.main([str(results), "--readme", str(page), "--marker", "bench.orders"])


def test_table_says_when_no_order_is_measurably_best() -> None:
    from bench.table import _orders

    overlapping = summarize_orders(
        [
            _a("a-x-1", "arrival", 250.0),
            _a("a-x-2", "arrival", 262.0),
            _a("a-y-1", "descending", 255.0),
            _a("a-y-2", "descending", 259.0),
        ]
    )
    assert overlapping is not None and overlapping["best"] == "descending"  # 257.0 vs 256.0
    assert any("No order is measurably best: the slowest run of descending (255.0)" in x for x in _orders(overlapping))
    separated = summarize_orders([_a("a-x-1", "arrival", 250.0), _a("a-y-1", "descending", 270.0)])
    assert not any("No order" in x for x in _orders(separated))


def test_headline_ratios() -> None:
    from bench.table import _headline

    def res(key: str, gen: float, e2e: float | None, rows: int = 200) -> dict[str, Any]:
        return {
            "key": key,
            "rows": rows,
            "throughput_generate": {"completion_tokens_per_s": gen},
            "throughput_end_to_end": None if e2e is None else {"completion_tokens_per_s": e2e},
        }

    lines = _headline([res("b", 250.0, 220.0), res("a-descending", 255.0, 225.0), res("d-arrival", 45.0, 40.0, 32)])
    assert "- bulkinfer (`a-descending`) generation: 1.02x raw vLLM's (`b`)." in lines
    assert any(x.startswith("- bulkinfer end to end (model load included): 5.0x") and "its 32 rows" in x for x in lines)
    assert _headline([res("b", 250.0, 220.0)]) == []


def test_faults_summary_and_page() -> None:
    from bench.faults import render as render_faults
    from bench.faults import summarize as summarize_faults

    runs = [
        {
            "scenario": "sigterm_generation",
            "exit_code": 143,
            "seconds_to_exit": t,
            "round": i,
            "seconds_until_no_engine_process": t + 1,
            "engine_processes_left_after_60_s": 0,
        }
        for i, t in enumerate([5.0, 7.0, 6.0])
    ] + [
        {
            "scenario": "kill_engine_core",
            "exit_code": 5,
            "seconds_to_exit": 6.5,
            "round": 0,
            "seconds_until_no_engine_process": 6.6,
            "engine_processes_left_after_60_s": 0,
            "resume_exit_code": 0,
        },
    ]
    summary = summarize_faults(runs)
    assert summary["sigterm_generation"]["seconds_to_exit"] == {"min": 5.0, "median": 6.0, "max": 7.0}
    assert summary["sigterm_generation"]["exit_codes"] == [143]
    assert summary["kill_engine_core"]["resume_exit_codes"] == [0]
    page = render_faults({**PROVENANCE, "started": "T", "command": "c", "rows": 30, "repeats": 3, "summary": summary})
    assert "| sigterm_generation | 143 | 5.0 / 6.0 / 7.0 | 7.0 | 0 |" in page
    assert "| kill_engine_core | 5 (then --resume: 0) | 6.5 / 6.5 / 6.5 | 6.6 | 0 |" in page
    assert page.index("sigterm_generation") < page.index("kill_engine_core")  # scenario order, not run order


def test_the_driver_ceiling_runs_every_row_through_the_instant_engine(tmp_path: Path) -> None:
    from bench.driver_ceiling import measure

    result = measure(rows=50, max_tokens=8)
    assert (result["rows"], result["completion_tokens"]) == (50, 400)
    assert result["completion_tokens_per_s"] > 0
    # both figures rounded to 0.1 from the same unrounded rate: within one rounding step of each other
    assert result["replicas_kept_busy"]["1000"] == pytest.approx(result["completion_tokens_per_s"] / 1000, abs=0.051)


def test_repeats_alternate_the_systems_and_compare_each_round_with_its_own_b(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--systems", "a,b,e", "--repeats", "2", "--engine", "defaults"])
    settings = BenchSettings(model="m", workdir=tmp_path, kv_cache_memory_bytes=1, defaults=True)
    keys = [key for key, _ in plan_jobs(args, [_row(0, 4, 4)], [], settings)]
    assert keys == ["a-descending-1", "b-1", "e-1", "a-descending-2", "b-2", "e-2"]
    # With engine defaults, bulkinfer gets only the seed; b the dtype and the seed; e (its own job) the seed.
    assert settings.bulkinfer_flags() == ["--seed", "0"]
    assert settings.engine_args() == {"dtype": "float32", "kv_cache_memory_bytes": 1, "seed": 0}


def test_fixed_engine_settings_can_be_bfloat16_and_compiled_for_every_vllm_system(tmp_path: Path) -> None:
    argv = ["--dtype", "bfloat16", "--compiled", "--kv-cache-gib", "1"]
    settings = bench_settings(build_parser().parse_args(argv), "m", tmp_path)
    args = {"dtype": "bfloat16", "enforce_eager": False, "kv_cache_memory_bytes": 1024**3, "seed": 0}
    assert settings.engine_args() == args
    assert settings.bulkinfer_flags()[:3] == ["--dtype", "bfloat16", "--no-enforce-eager"]
    default = bench_settings(build_parser().parse_args([]), "m", tmp_path)
    assert (default.dtype, default.enforce_eager) == ("float32", True)
    argv = ["--engine", "defaults", "--bulkinfer-args", "--speculative-tail 16"]  # bulkinfer's own flags, last
    assert bench_settings(build_parser().parse_args(argv), "m", tmp_path).bulkinfer_flags() == [
        "--seed",
        "0",
        "--speculative-tail",
        "16",
    ]
    with pytest.raises(SystemExit, match="not with --engine defaults"):
        bench_settings(build_parser().parse_args(["--engine", "defaults", "--compiled"]), "m", tmp_path)


def test_summarize_systems_means_and_ratios_of_means() -> None:
    def res(key: str, gen: float, feed: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"key": key, "throughput_generate": {"completion_tokens_per_s": gen}}
        return out if feed is None else {**out, "feed": feed}

    summary = summarize_systems(
        [
            res("a-descending-1", 210.0, "descending+prefix"),
            res("b-1", 200.0),
            res("e-1", 50.0),
            res("a-descending-2", 230.0, "descending+prefix"),
            res("b-2", 180.0),
            res("e-2", 70.0),
            res("b-subset", 999.0),
            {"key": "c", "throughput_generate": {"completion_tokens_per_s": 999.0}},
        ]
    )
    assert summary is not None
    stats = summary["completion_tokens_per_s_generate"]
    assert set(stats) == {"a descending+prefix", "b", "e"}
    assert stats["b"] == {"runs": [200.0, 180.0], "mean": 190.0, "min": 180.0, "max": 200.0}
    ratios = summary["ratios_of_means"]["descending+prefix"]
    assert ratios["b"] == pytest.approx(220.0 / 190.0)
    assert ratios["e"] == pytest.approx(220.0 / 60.0)
    assert summarize_systems([res("c", 1.0)]) is None
    from bench.table import _systems

    lines = _systems(summary)
    assert "| b | 200.0, 180.0 | 190.0 | 180.0 | 200.0 | 10.5% |" in lines
    assert "- bulkinfer (descending+prefix), mean over mean: 1.16x b's, 3.67x e's." in lines


def test_eta_trace_rates_against_the_final_figure(tmp_path: Path) -> None:
    """A recording that prefills for 50 s and then decodes 10 tokens a second
    for 50 s: 500 tokens in 100 s, a final 5 tok/s, which no live rate
    shows until the decode phase has run as long as the prefill did."""
    from bench.eta_trace import rates

    events: list[list[Any]] = [["p", 0.0, 10, 100]]
    events += [["t", float(t), max(t - 50, 0) * 10, 1000, []] for t in range(1, 101)]
    path = tmp_path / "trace.json"
    path.write_bytes(orjson.dumps({"events": events, "report": {"engine": {"max_num_seqs": 256}}}))
    out = rates(path)
    since = dict(out["so far"])
    assert since[20.0] == pytest.approx(-1.0)  # nothing decoded yet
    assert since[90.0] == pytest.approx(400 / 90 / 5 - 1)  # -11%
    assert dict(out["last 30 s"])[90.0] == pytest.approx(1.0)  # the decode phase: twice the average


def test_every_job_bench_eta_trace_records_is_described_by_bench_eta_range() -> None:
    from bench.eta_range import DESCRIBED, WORKLOADS
    from bench.eta_trace import RECORDABLE

    assert sorted(DESCRIBED) == sorted(RECORDABLE)
    assert set(WORKLOADS) < set(RECORDABLE)  # the three by default; steady on request


def test_eta_trace_reconstructs_the_running_prompts_of_an_older_recording() -> None:
    """Rows start in plan order, one a step here: a running row with ``g``
    tokens started ``g`` steps ago (steps: the events whose counts moved, not
    the calls that returned while a step ran), and the prompt tokens
    processed say which rows had started by then. A recording that kept the
    figure is read as is."""
    from bench.eta_trace import running_prompts

    planned = [["p", 0.0, prompt, 8] for prompt in (10, 20, 30, 40)]
    steps = [
        ["t", 1.0, 1, 10, [1], 0],  # row 0 starts
        ["t", 1.5, 1, 10, [1], 0],  # a call that returned while a step ran
        ["t", 2.0, 3, 30, [2, 1], 0],  # row 1 starts
        ["t", 2.5, 3, 30, [2, 1], 0],
        ["t", 3.0, 6, 60, [3, 2, 1], 0],  # row 2 starts
        ["t", 4.0, 8, 100, [3, 2, 1], 0],  # row 0 ended, row 3 starts
    ]
    assert list(running_prompts(planned + steps).values()) == [10, 10, 30, 30, 60, 90]
    assert running_prompts([*planned, [*steps[0], 12]]) == {4: 12}


def test_eta_range_pace_is_the_seconds_of_each_fifth_of_the_completion_tokens() -> None:
    from bench.eta_range import fifths

    ticks = [["t", float(t), tokens, 0, [], 0] for t, tokens in enumerate([0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100])]
    assert fifths({"events": ticks}) == [2.0, 2.0, 2.0, 2.0, 2.0]
    slow_end = [*ticks[:9], ["t", 20.0, 90, 0, [], 0], ["t", 30.0, 100, 0, [], 0]]
    assert fifths({"events": slow_end}) == [2.0, 2.0, 2.0, 2.0, 22.0]


def test_eta_range_knows_the_rows_ended_and_tokens_generated_at_a_quarter_of_the_run() -> None:
    """Four rows planned over 0-100 s; at 25 s one had ended and 30 of the
    run's 200 completion tokens were generated (the ``u`` event's done and
    failed both count as ended)."""
    from bench.eta_range import known_at

    events: list[list[Any]] = [["p", 0.0, 10, 100] for _ in range(4)]
    events += [["t", 20.0, 30, 40, [10, 10, 10], 0], ["u", 24.0, 1, 0, 10, True], ["u", 50.0, 1, 1, 50, True]]
    events += [["t", 100.0, 200, 40, [], 0]]
    assert known_at(events, 0.25) == {"rows_ended": 0.25, "tokens_generated": 0.15}


def test_eta_range_split_parts_a_first_runs_point_error_into_tokens_left_and_rate() -> None:
    """On a committed recording (the Zen 4's ShareGPT first run, 89 s):
    estimates every 10 s from a quarter of the run to its last 10 s, each
    point's error the product of its two parts."""
    from bench.eta_split import split

    (run,) = split(["zen4"], ["sharegpt"])["runs"]
    shares = [share for share, *_ in run["points"]]
    assert run["estimates"] == len(shares) == 6 and shares[0] >= 0.25 and shares[-1] <= 1 - 10 / 89
    for _, tokens, rate, point, _ in run["points"]:
        assert (1 + tokens) * (1 + rate) == pytest.approx(1 + point, rel=1e-9)
    assert run["tokens"] == [min(p[1] for p in run["points"]), max(p[1] for p in run["points"])]
    assert run["mix"] == [min(p[4] for p in run["points"]), max(p[4] for p in run["points"])]


def test_eta_split_mix_is_the_median_rate_over_the_summed_rate() -> None:
    """Five decode steps at 1 ms per unit of work, two prefill steps at 0.5
    ms, each 4x the work: the median takes 1 ms, the summed 0.9 s over
    1,300 units."""
    from bench.eta_split import _mix
    from bulkinfer.report.eta import WorkEstimate
    from bulkinfer.report.step_cost import Step, StepCost

    model = StepCost(context_weight=0.0, prefill_weight=1.0, overhead_tokens=0.0)
    work = WorkEstimate(step_cost=model)
    work.steps.extend([Step(0.1, 100, 0, 0.0)] * 5 + [Step(0.2, 0, 400, 0.0)] * 2)
    assert _mix(work) == pytest.approx(1e-3 / (0.9 / 1300) - 1)  # +44%


def test_eta_range_replays_with_an_estimator_constant_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    import bulkinfer.report.eta as eta
    import bulkinfer.report.futures as futures
    from bench.eta_range import overridden

    monkeypatch.setattr(eta, "OTHER_JOBS_SPREAD", eta.OTHER_JOBS_SPREAD)
    monkeypatch.setattr(futures, "BEYOND_POWER", futures.BEYOND_POWER)
    overridden(["OTHER_JOBS_SPREAD=0", "BEYOND_POWER=0.25"])
    assert (eta.OTHER_JOBS_SPREAD, futures.BEYOND_POWER) == (0.0, 0.25)
    with pytest.raises(SystemExit, match="NO_SUCH"):
        overridden(["NO_SUCH=1"])


def test_table_states_what_bulkinfers_own_thread_took_during_generation() -> None:
    results = [
        {
            "key": "a-descending-1",
            "seconds": {"generate": 200.0},
            "bulkinfer_cpu_seconds": {"feed_thread": 1.0, "process": 390.0},
        },
        {"key": "b-1", "seconds": {"generate": 200.0}},
    ]
    assert _cpu(results) == [
        "",
        "- `a-descending-1` CPU during generation: bulkinfer's feed thread 1.0 s (0.5% of a core), "
        "its whole process 390.0 s (1.95 cores).",
    ]


def test_table_states_every_systems_cpu_by_thread_the_most_first_the_rest_summed() -> None:
    def thread(process: str, name: str, seconds: float, n: int = 1) -> dict[str, object]:
        return {"process": process, "thread": name, "threads": n, "seconds": seconds}

    raw = [thread("python", "python", 100.0), thread("python", "gloo_tcp_loop", 1.5, 13)]
    raw += [thread("python", f"t{i}", 0.5) for i in range(6)]
    results = [{"key": "b-1", "seconds": {"generate": 50.0}, "cpu_threads": raw}]
    assert _cpu(results) == [
        "",
        "- `b-1` CPU by thread during generation (share of a core): python/python 100.00 s (200.00%); "
        "python/gloo_tcp_loop x13 1.50 s (3.00%); python/t0 0.50 s (1.00%); python/t1 0.50 s (1.00%); "
        "python/t2 0.50 s (1.00%); python/t3 0.50 s (1.00%); others 1.00 s (2.00%).",
    ]


def test_the_fixed_workload_gives_every_row_the_same_length_so_the_rows_end_together(tmp_path: Path) -> None:
    from bench.variants import write_workload

    described = write_workload("fixed", tmp_path / "fixed.jsonl", rows=5, max_tokens=32)
    rows = [orjson.loads(line) for line in (tmp_path / "fixed.jsonl").read_bytes().splitlines()]
    assert [r["max_tokens"] for r in rows] == [32] * 5 and described["flags"] == ["--ignore-eos"]
    assert described["max_tokens_sum"] == 160 and len({r["prompt"] for r in rows}) == 5


def test_the_multiturn_and_choices_workloads_keep_messages_and_count_every_sequence(tmp_path: Path) -> None:
    """``multiturn`` rows are the conversations' turns (their ``messages``,
    later turns repeating earlier ones); ``choices`` rows ask 4 sequences
    each, and the described token budget counts all four."""
    from bench.variants import write_workload

    turns = write_workload("multiturn", tmp_path / "mt.jsonl", rows=3, max_tokens=16)
    rows = [orjson.loads(line) for line in (tmp_path / "mt.jsonl").read_bytes().splitlines()]
    assert [len(r["messages"]) for r in rows] == [1, 3, 5] and "prompt" not in rows[0]
    assert rows[1]["messages"][0] == rows[0]["messages"][0] and turns["flags"] == ["--ignore-eos"]
    choices = write_workload("choices", tmp_path / "n.jsonl", rows=2, max_tokens=8)
    rows = [orjson.loads(line) for line in (tmp_path / "n.jsonl").read_bytes().splitlines()]
    assert [r["n"] for r in rows] == [4, 4] and choices["max_tokens_sum"] == 4 * sum(r["max_tokens"] for r in rows)
    write_workload("choices2", tmp_path / "n2.jsonl", rows=2, max_tokens=8)
    assert [orjson.loads(line)["n"] for line in (tmp_path / "n2.jsonl").read_bytes().splitlines()] == [2, 2]


def test_block_size_variants_set_vllms_block_size_after_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import bench.block_size as block_size

    seen: dict[str, list[str]] = {}

    def alternate(_name: str, _workloads: Any, variants: Any, *_: Any) -> dict[str, Any]:
        seen.update({name: variant(1)[0] for name, variant in variants.items()})
        return {"runs": []}

    monkeypatch.setattr(block_size, "alternate", alternate)
    monkeypatch.setattr(block_size, "write", lambda *_: None)
    monkeypatch.setattr(sys, "argv", ["bench.block_size", "--sizes", "64,32"])
    block_size.main()
    assert seen == {
        "default": [],
        "bs64": ["--engine-arg", "block_size=64"],
        "bs32": ["--engine-arg", "block_size=32"],
    }


def test_speculative_baselines_and_common_flags_reach_every_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """``again`` repeats the first variant's flags, ``arrival`` changes only
    the feed order, and ``--flags`` go to every variant's run."""
    import sys

    import bench.speculative as speculative

    seen: dict[str, list[str]] = {}

    def alternate(_name: str, _workloads: Any, variants: Any, *_: Any) -> dict[str, Any]:
        seen.update({name: variant(1)[0] for name, variant in variants.items()})
        return {}

    monkeypatch.setattr(speculative, "alternate", alternate)
    monkeypatch.setattr(speculative, "write", lambda *_: None)
    argv = [
        "bench.speculative",
        "--tail",
        "16",
        "--variants",
        "none,again,arrival,tail16",
        "--flags=--no-enforce-eager",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    speculative.main()
    assert seen == {
        "none": ["--no-enforce-eager"],
        "again": ["--no-enforce-eager"],
        "arrival": ["--no-enforce-eager", "--order", "arrival"],
        "tail16": ["--no-enforce-eager", "--speculative-tail", "16"],
    }


def test_thread_watch_takes_the_generation_window_before_the_end_and_shows_busy_threads_alone() -> None:
    from bench.thread_watch import window

    def at(t: float, compute: float, gloo: float) -> dict[str, object]:
        threads = {"1/1": ["python", 1.0 + t / 100], "1/2": ["python", compute]}
        threads |= {f"1/{i}": ["gloo_tcp_loop", gloo] for i in (3, 4)}
        return {"t": t, "threads": threads}

    # generation from t=10 to t=110 (the process ended at 111: --tail-s 1), trimmed 4 s each end: 14..106
    samples = [at(t, compute=max(t - 10, 0) * 0.98, gloo=t / 100) for t in range(0, 112, 2)]
    seconds, used = window(samples, generate_s=100.0, tail_s=1.0, trim_s=4.0)
    assert seconds == 92.0
    assert used["python (pid 1, tid 2)"] == pytest.approx(92 * 0.98)
    assert used["gloo_tcp_loop (pid 1) x2"] == pytest.approx(2 * 0.92)
    assert used["Ppython (pid 1)"] == pytest.approx(0.92)


def test_engine_steps_counts_the_steps_between_ticks_whose_counts_moved() -> None:
    """Two steps before the first moving tick; a tick that did not move
    counts nothing; a step that ran no model does not count."""
    from bench.engine_steps import steps_per_tick

    events = [["e", 0.1, True], ["e", 0.2, True], ["t", 0.3, 10, 5], ["t", 0.8, 10, 5]]
    events += [["e", 0.9, True], ["e", 1.0, False], ["t", 1.1, 20, 5], ["e", 1.2, True], ["t", 1.3, 30, 9]]
    assert steps_per_tick(events) == {2: 1, 1: 2}
