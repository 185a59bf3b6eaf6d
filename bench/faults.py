"""How fast `bulkinfer run` reacts to the faults of README "Reliability", with the
real CLI, engine and default model: seconds from the fault to bulkinfer's exit
(and its exit code), and for ``kill -9`` of bulkinfer itself, seconds until no
engine process is left.

Scenarios (each on the first ``--rows`` rows of sample_data/sharegpt.jsonl, 48
tokens out, temperature 0), interleaved over ``--repeats`` rounds:

- ``sigterm_generation``: SIGTERM to bulkinfer once 3 rows finished;
- ``sigterm_engine_start``: SIGTERM 1 s after the engine core process appears;
- ``kill_engine_core``: SIGKILL to ``VLLM::EngineCore`` once 3 rows finished
  (the out-of-memory killer), then ``--resume`` to completion;
- ``kill9_engine_start`` / ``kill9_generation``: SIGKILL to bulkinfer while the
  engine core loads the model / once 3 rows finished; seconds until no process
  of vLLM's started by that run is alive.

Writes bench/results/faults.json and faults.md (machine and versions included).

    .venv/bin/python -m bench.faults            # 5 scenarios x 3 rounds, ~12 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import psutil

from bench.measure import machine, versions

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SCENARIOS = ("sigterm_generation", "sigterm_engine_start", "kill_engine_core", "kill9_engine_start", "kill9_generation")


def vllm_children(pid: int) -> list[psutil.Process]:
    """The processes of vLLM's (``VLLM::...`` titles) below ``pid``."""
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if "VLLM" in " ".join(p.cmdline())]
    except psutil.NoSuchProcess:
        return []


def vllm_processes_since(started: float) -> list[psutil.Process]:
    """Every process of vLLM's started at ``started`` (epoch seconds) or later."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.create_time() >= started and "VLLM" in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _wait(predicate: Any, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended or timed out before the fault (exit {proc.returncode})")
        time.sleep(0.02)


def run_scenario(name: str, src: Path, workdir: Path) -> dict[str, Any]:
    """One scenario in a fresh output directory; returns its measurements."""
    out = workdir / name / "out.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    for path in out.parent.iterdir():
        path.unlink()
    flags = ["--max-tokens", "48", "--temperature", "0", "--plain-progress", "--raw-prompts"]
    cmd = [sys.executable, "-m", "bulkinfer", "run", str(src), "-o", str(out), *flags]
    log = open(out.parent / "run.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    started = psutil.Process(proc.pid).create_time()
    spool = out.with_name(f".{out.name}.partial.jsonl")

    def rows_done() -> bool:
        return spool.exists() and spool.read_bytes().count(b"\n") >= 3

    if name.endswith("engine_start"):
        _wait(lambda: bool(vllm_children(proc.pid)), proc)
        if name.startswith("sigterm"):
            time.sleep(1.0)
    else:
        _wait(rows_done, proc)
    result: dict[str, Any] = {"scenario": name}
    t0 = time.monotonic()
    if name == "kill_engine_core":
        core = [p for p in vllm_children(proc.pid) if "EngineCore" in " ".join(p.cmdline())]
        core[0].kill()
    elif name.startswith("sigterm"):
        proc.send_signal(signal.SIGTERM)
    else:
        proc.kill()
    result["exit_code"] = proc.wait(timeout=120)
    result["seconds_to_exit"] = round(time.monotonic() - t0, 2)
    log.close()
    deadline = time.monotonic() + 60
    while vllm_processes_since(started) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = vllm_processes_since(started)
    result["seconds_until_no_engine_process"] = None if left else round(time.monotonic() - t0, 2)
    result["engine_processes_left_after_60_s"] = len(left)
    for p in left:
        p.kill()
    if name == "kill_engine_core":
        resumed = subprocess.run([*cmd, "--resume"], capture_output=True, cwd=ROOT)
        report = orjson.loads(out.with_name("out.report.json").read_bytes()) if out.exists() else {}
        result["resume_exit_code"] = resumed.returncode
        result["resumed_rows"] = report.get("resumed", {}).get("completed")
        result["rows_after_resume"] = report.get("request_counts", {}).get("completed")
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario: exit codes seen and min/median/max of each timing."""
    summary: dict[str, Any] = {}
    for name in SCENARIOS:
        mine = [r for r in runs if r["scenario"] == name]
        if not mine:
            continue
        entry: dict[str, Any] = {"runs": len(mine), "exit_codes": sorted({r["exit_code"] for r in mine})}
        for key in ("seconds_to_exit", "seconds_until_no_engine_process"):
            values = [r[key] for r in mine if r.get(key) is not None]
            if values:
                entry[key] = {"min": min(values), "median": round(statistics.median(values), 2), "max": max(values)}
        entry["engine_processes_left_after_60_s"] = max(r["engine_processes_left_after_60_s"] for r in mine)
        if name == "kill_engine_core":
            entry["resume_exit_codes"] = sorted({r["resume_exit_code"] for r in mine})
        summary[name] = entry
    return summary


def render(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"#### bench.faults ({doc['started']})",
        "",
        f"Machine: {m.get('cpu')}, {m.get('logical_cores')} logical cores, GPUs: {m.get('gpus') or 'none'}; "
        f"vllm {doc['versions'].get('vllm')}. {doc['rows']} ShareGPT rows, 48 tokens out, "
        f"{doc['repeats']} rounds. Command: `{doc['command']}`.",
        "",
        "| fault | exit code | s to exit (min / median / max) | s until no engine process (median) | left after 60 s |",
        "|---|---|---|---|--:|",
    ]
    for name, entry in doc["summary"].items():
        to_exit = entry.get("seconds_to_exit", {})
        gone = entry.get("seconds_until_no_engine_process", {})
        codes = ", ".join(str(c) for c in entry["exit_codes"])
        if name == "kill_engine_core":
            codes += f" (then --resume: {', '.join(str(c) for c in entry['resume_exit_codes'])})"
        lines.append(
            f"| {name} | {codes} | {to_exit.get('min')} / {to_exit.get('median')} / {to_exit.get('max')} "
            f"| {gone.get('median', '-')} | {entry['engine_processes_left_after_60_s']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--out", type=Path, default=RESULTS / "faults.json")
    args = parser.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    doc: dict[str, Any] = {
        "started": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python -m bench.faults", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "versions": versions(),
        "rows": args.rows,
        "repeats": args.repeats,
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="bulkinfer-faults-") as tmp:
        workdir = Path(tmp)
        src = workdir / "in.jsonl"
        lines = (ROOT / "sample_data" / "sharegpt.jsonl").read_bytes().splitlines()[: args.rows]
        src.write_bytes(b"\n".join(lines) + b"\n")
        for round_ in range(args.repeats):
            for name in names:
                result = {**run_scenario(name, src, workdir), "round": round_}
                print(orjson.dumps(result).decode(), flush=True)
                doc["runs"].append(result)
                doc["summary"] = summarize(doc["runs"])
                args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
                args.out.with_suffix(".md").write_text(render(doc))


if __name__ == "__main__":
    main()
