"""Replicas: the same rows with ``--data-parallel-size 1`` and ``2`` on this
host, and ``2`` as Ray actors (``--ray local``: a Ray cluster started on this
machine for the run), alternating, through the real CLI and engine.

Rows: ``sample_data/sharegpt.jsonl`` (300 ShareGPT first turns) with
``configs/demo.toml`` (max_tokens 128) at temperature 0, so completions can
be compared: the share of rows whose completion equals the first
one-replica run's (batch composition changes floating-point sums, so a few
may differ). Per run: completion and total tokens/s of the generation phase
(the report's ``throughput``), load and generate seconds, every id exactly
once, and with two replicas each replica's rows, busy seconds and the
balance.

Usage: ``python -m bench.replicas [--rounds 2] [--rows N] [--systems
dp1,dp2,ray1,ray2] [--out NAME]``; writes ``bench/results/NAME.{json,md}``
(default ``replicas``). One run at a time (two cores: with two replicas each
gets one core).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "sample_data" / "sharegpt.jsonl"


# system -> its flags
SYSTEMS = {
    "dp1": ["-dp", "1"],
    "dp2": ["-dp", "2"],
    "ray1": ["-dp", "1", "--ray", "local"],
    "ray2": ["-dp", "2", "--ray", "local"],
}


def run_once(system: str, source: Path, out: Path) -> dict[str, Any]:
    """One ``bulkinfer run`` of ``system``; its report and completions by id."""
    cmd = [sys.executable, "-m", "bulkinfer", "run", str(source), "-o", str(out), "--overwrite"]
    cmd += ["--config", "configs/demo.toml", "--temperature", "0", *SYSTEMS[system], "--plain-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bulkinfer run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines() if line.strip()]
    report = orjson.loads(out.with_name(out.name.removesuffix(".jsonl") + ".report.json").read_bytes())
    return {
        "report": report,
        "completions": {row["id"]: row["completion"] for row in rows},
        "ids": [r["id"] for r in rows],
    }


def summary(system: str, run: dict[str, Any], reference: dict[str, str], expected_ids: list[str]) -> dict[str, Any]:
    report = run["report"]
    same = sum(run["completions"].get(i) == text for i, text in reference.items())
    engine = report["engine"]
    return {
        "system": system,
        "data_parallel_size": engine.get("data_parallel_size", 1),
        "completion_tokens_per_s": round(report["throughput"]["completion_tokens_per_s"], 1),
        "total_tokens_per_s": round(report["throughput"]["total_tokens_per_s"], 1),
        "load_s": round(report["seconds"]["load"], 1),
        "generate_s": round(report["seconds"]["generate"], 1),
        "completion_tokens": report["tokens"]["completion"],
        "every_id_once": sorted(run["ids"]) == sorted(expected_ids),
        "identical_to_first_run": f"{same}/{len(reference)}",
        "replicas": engine.get("replicas"),
        "replica_balance": engine.get("replica_balance"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=None, help="the first N rows (default: all 300)")
    parser.add_argument("--systems", default="dp1,dp2", help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--out", default="replicas", help="results file name in bench/results/")
    args = parser.parse_args()
    systems = args.systems.split(",")
    from bulkinfer.engine.args import cpu_model

    lines_in = [line for line in SOURCE.read_bytes().splitlines() if line.strip()][: args.rows]
    expected = [orjson.loads(line)["id"] for line in lines_in]
    results: list[dict[str, Any]] = []
    reference: dict[str, str] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "in.jsonl"
        source.write_bytes(b"\n".join(lines_in) + b"\n")
        for round_ in range(1, args.rounds + 1):
            for system in systems:
                run = run_once(system, source, Path(tmp) / f"{system}-r{round_}.jsonl")
                reference = reference if reference is not None else run["completions"]
                results.append({"round": round_, **summary(system, run, reference, expected)})
                print(f"bench.replicas: round {round_} {system}: {results[-1]}", file=sys.stderr)
    first = systems[0]
    base = [r["completion_tokens_per_s"] for r in results if r["system"] == first]
    ratios = {
        f"{system}/{first}": [
            round(r["completion_tokens_per_s"] / b, 3)
            for r, b in zip([r for r in results if r["system"] == system], base, strict=True)
        ]
        for system in systems[1:]
    }
    command = f"python -m bench.replicas --rounds {args.rounds}"
    command += (f" --rows {args.rows}" if args.rows else "") + (
        f" --systems {args.systems} --out {args.out}" if args.out != "replicas" or args.systems != "dp1,dp2" else ""
    )
    data: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "date": dt.date.today().isoformat(),
        "command": command,
        "systems": {name: " ".join(SYSTEMS[name]) for name in systems},
        "results": results,
        "completion_tokens_per_s_ratios": ratios,
    }
    out = ROOT / "bench" / "results" / f"{args.out}.json"
    out.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    machine = f"{data['machine']['cpu']}, {data['machine']['cores']} cores"
    lines = [
        f"# Replicas on one host ({data['date']}; {machine})",
        "",
        f"Command: `{data['command']}`; sample_data/sharegpt.jsonl ({len(expected)} rows), configs/demo.toml, "
        f"temperature 0; runs in this order. Systems: "
        + "; ".join(f"{name} = `{flags}`" for name, flags in data["systems"].items())
        + ".",
        "",
        "| round | system | replicas | completion tok/s | total tok/s | load s | generate s | every id once "
        "| identical to the first run | rows per replica | busy s per replica | balance |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        reps = r["replicas"] or []
        rows = "/".join(str(x["rows"]) for x in reps) or "-"
        busy = "/".join(f"{x['busy_seconds']:.0f}" for x in reps) or "-"
        lines.append(
            f"| {r['round']} | {r['system']} | {r['data_parallel_size']} | {r['completion_tokens_per_s']} "
            f"| {r['total_tokens_per_s']} "
            f"| {r['load_s']} | {r['generate_s']} | {r['every_id_once']} | {r['identical_to_first_run']} "
            f"| {rows} | {busy} | {r['replica_balance'] or '-'} |"
        )
    lines += [""] + [f"Completion tokens/s, {name}, per round: {', '.join(map(str, v))}." for name, v in ratios.items()]
    lines += [""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
