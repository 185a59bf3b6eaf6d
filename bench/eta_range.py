"""Is the progress line's ETA range honest? Three real jobs, each run twice
(a first run, then the same job run again, as from cron), each run's ETA
trace (the report's ``eta_trace``) scored against its real end.

Jobs (:func:`bench.eta_trace.record`, in a process of their own, one at a
time: two cores):

- ``sharegpt``: ``sample_data/sharegpt.jsonl`` (300 ShareGPT first turns),
  ``configs/demo.toml`` (max_tokens 128);
- ``short``: 1,000 short questions (:func:`bench.eta.short_prompts`), the
  defaults (max_tokens 256);
- ``multiturn``: the 452 turns of ``sample_data/sharegpt_multiturn.jsonl``
  (each turn repeats the conversation so far: shared prefixes), demo.toml.

A first run: the calibration store keeps no completion lengths of the job's
output (removed before it; the lengths of the model's other jobs stay, as
do the step models fitted on this machine: a first run of a new job on a
machine that has run the model). The run again writes the same output, so
its ETA starts from the first run's lengths.

Scores (:func:`bench.eta_trace.score_trace`): the share of estimates from
10% of the run on whose range held the real time left (goal >= 80%), the
widest range from 25% on (goal: within +-50% of the point), the point's
largest error (goal +-35%, from 10% on for a run again, from 50% on for a
first run). Each run's recording (events and report) is kept beside the
results for replay (``python -m bench.eta_trace score``).

``python -m bench.eta_range [--workloads sharegpt,short,multiturn] [--tag T]``
writes ``bench/results/eta-range-T.{json,md}`` and ``eta-range-T-WORKLOAD-{first,again}.json``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

from bench.eta_trace import score_trace
from bench.measure import machine, versions

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORKLOADS = ("sharegpt", "short", "multiturn")
DESCRIBED = {
    "sharegpt": "300 ShareGPT first turns, configs/demo.toml (max_tokens 128)",
    "short": "1,000 short questions, defaults (max_tokens 256)",
    "multiturn": "452 turns of ShareGPT conversations (shared prefixes), configs/demo.toml",
}


def forget_job_lengths(output: Path) -> None:
    """Remove the completion lengths stored with runs that wrote ``output``
    (the job's own, its ETA prior); every other figure of the store stays."""
    from bulkinfer.io.files import atomic_write
    from bulkinfer.report.calibration import calibration_path

    path = calibration_path()
    if not path.exists():
        return
    store = orjson.loads(path.read_bytes())
    for entry in store.get("entries", []):
        if isinstance(entry, dict) and entry.get("output") == str(output):
            entry["completion_lengths"] = []
    atomic_write(path, orjson.dumps(store, option=orjson.OPT_INDENT_2))


def run_job(workload: str, recording: Path, job_output: Path) -> dict[str, Any]:
    """One recorded run of ``workload`` (its own process) writing ``job_output``; its recording."""
    cmd = [sys.executable, "-m", "bench.eta_trace", "record", workload, "--out", str(recording)]
    cmd += ["--job-output", str(job_output)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return orjson.loads(recording.read_bytes())  # type: ignore[no-any-return]


def scored(recording: dict[str, Any], first_run: bool) -> dict[str, Any]:
    """The run's figures and :func:`score_trace` of its report's ETA trace."""
    report = recording["report"]
    trace = report["eta_trace"]
    return {
        "first_run": first_run,
        "generate_s": report["seconds"]["generate"],
        "rows": report["request_counts"]["completed"],
        "completion_tokens": report["tokens"]["completion"],
        "step_cost_stored": trace.get("step_cost_stored"),
        **score_trace(trace["points"], trace["end_s"], first_run),
    }


def render(doc: dict[str, Any]) -> str:
    """The Markdown table of a bench run."""
    m = doc["machine"]
    lines = [
        f"# The ETA range against the real end ({m['cpu']} ({m.get('cpu_kind', '')}), {m['logical_cores']} cores)\n",
        f"Command: `{doc['command']}`. Goals: range held the real time left on >= 80% of estimates from 10% of "
        "the run on; from 25% on no wider than +-50% of the point; the point within +-35% (from 10% on for a "
        "run again, from 50% on for a first run); widths and point errors not on the last 10 s.\n",
        "| job | run | generate s | estimates | range held | widest (from 25%) | median width | "
        "largest point error | goals met |",
        "| --- | --- | --: | --: | --: | --: | --: | --: | --- |",
    ]
    for row in doc["runs"]:
        lines.append(
            f"| {row['workload']} ({DESCRIBED[row['workload']]}) | {'first' if row['first_run'] else 'again'} "
            f"| {row['generate_s']:.0f} | {row['estimates']} | {_pct(row['coverage'])} "
            f"| +-{_pct(row['max_half_width'])} | +-{_pct(row['median_half_width'])} "
            f"| {_pct(row['max_point_error'], signed=True)} (from {row['point_error_from']:.0%}) "
            f"| {'yes' if row['met'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.0%}" if signed else f"{value:.0%}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--tag", default="default")
    args = parser.parse_args(argv)
    from bulkinfer.default_model import bulkinfer_home

    jobs = bulkinfer_home() / "bench-eta"
    jobs.mkdir(parents=True, exist_ok=True)
    runs = []
    for workload in args.workloads.split(","):
        output = jobs / f"{workload}.out.jsonl"
        forget_job_lengths(output)
        for first_run in (True, False):
            name = f"eta-range-{args.tag}-{workload}-{'first' if first_run else 'again'}.json"
            print(f"bench.eta_range: {workload}, {'first run' if first_run else 'again'}", file=sys.stderr, flush=True)
            recording = run_job(workload, RESULTS / name, output)
            runs.append({"workload": workload, "recording": name, **scored(recording, first_run)})
            print(f"  {runs[-1]}", file=sys.stderr, flush=True)
    command = " ".join(["python -m bench.eta_range", *(argv if argv is not None else sys.argv[1:])])
    doc = {"command": command, "machine": machine(), "versions": versions(), "runs": runs}
    (RESULTS / f"eta-range-{args.tag}.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    (RESULTS / f"eta-range-{args.tag}.md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
