"""Replicas on one host: the same rows with ``--data-parallel-size 1`` and
``2``, alternating, through the real CLI and engine.

Rows: ``sample_data/sharegpt.jsonl`` (300 ShareGPT first turns) with
``configs/demo.toml`` (max_tokens 128) at temperature 0, so completions can
be compared: the share of rows whose completion equals the first
one-replica run's (batch composition changes floating-point sums, so a few
may differ). Per run: completion and total tokens/s of the generation phase
(the report's ``throughput``), load and generate seconds, every id exactly
once, and with two replicas each replica's rows, busy seconds and the
balance.

Usage: ``python -m bench.replicas [--rounds 2]``; writes
``bench/results/replicas.{json,md}``. One run at a time (two cores: with two
replicas each gets one core).
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


def run_once(dp: int, out: Path) -> dict[str, Any]:
    """One ``bulkinfer run`` with ``dp`` replicas; its report and completions by id."""
    cmd = [sys.executable, "-m", "bulkinfer", "run", str(SOURCE), "-o", str(out), "--overwrite"]
    cmd += ["--config", "configs/demo.toml", "--temperature", "0", "-dp", str(dp), "--plain-progress"]
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


def summary(dp: int, run: dict[str, Any], reference: dict[str, str], expected_ids: list[str]) -> dict[str, Any]:
    report = run["report"]
    same = sum(run["completions"].get(i) == text for i, text in reference.items())
    engine = report["engine"]
    return {
        "data_parallel_size": dp,
        "completion_tokens_per_s": round(report["throughput"]["completion_tokens_per_s"], 1),
        "total_tokens_per_s": round(report["throughput"]["total_tokens_per_s"], 1),
        "load_s": round(report["seconds"]["load"], 1),
        "generate_s": round(report["seconds"]["generate"], 1),
        "completion_tokens": report["tokens"]["completion"],
        "every_id_once": sorted(run["ids"]) == sorted(expected_ids),
        "identical_to_first_dp1": f"{same}/{len(reference)}",
        "replicas": engine.get("replicas"),
        "replica_balance": engine.get("replica_balance"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from bulkinfer.engine.args import cpu_model

    expected = [orjson.loads(line)["id"] for line in SOURCE.read_bytes().splitlines() if line.strip()]
    results: list[dict[str, Any]] = []
    reference: dict[str, str] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, args.rounds + 1):
            for dp in (1, 2):
                run = run_once(dp, Path(tmp) / f"dp{dp}-r{round_}.jsonl")
                reference = reference if reference is not None else run["completions"]
                results.append({"round": round_, **summary(dp, run, reference, expected)})
                print(f"bench.replicas: round {round_} dp {dp}: {results[-1]}", file=sys.stderr)
    dp1 = [r["completion_tokens_per_s"] for r in results if r["data_parallel_size"] == 1]
    dp2 = [r["completion_tokens_per_s"] for r in results if r["data_parallel_size"] == 2]
    ratios = [round(b / a, 3) for a, b in zip(dp1, dp2, strict=True)]
    data: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "date": dt.date.today().isoformat(),
        "command": f"python -m bench.replicas --rounds {args.rounds}",
        "results": results,
        "dp2_over_dp1_completion_tokens_per_s": ratios,
    }
    out = ROOT / "bench" / "results" / "replicas.json"
    out.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    machine = f"{data['machine']['cpu']}, {data['machine']['cores']} cores"
    lines = [
        f"# Replicas on one host ({data['date']}; {machine})",
        "",
        f"Command: `{data['command']}`; sample_data/sharegpt.jsonl (300 rows), configs/demo.toml, temperature 0; "
        "runs in this order.",
        "",
        "| round | replicas | completion tok/s | total tok/s | load s | generate s | every id once "
        "| identical to the first 1-replica run | rows per replica | busy s per replica | balance |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        reps = r["replicas"] or []
        rows = "/".join(str(x["rows"]) for x in reps) or "-"
        busy = "/".join(f"{x['busy_seconds']:.0f}" for x in reps) or "-"
        lines.append(
            f"| {r['round']} | {r['data_parallel_size']} | {r['completion_tokens_per_s']} | {r['total_tokens_per_s']} "
            f"| {r['load_s']} | {r['generate_s']} | {r['every_id_once']} | {r['identical_to_first_dp1']} "
            f"| {rows} | {busy} | {r['replica_balance'] or '-'} |"
        )
    lines += ["", f"Completion tokens/s, 2 replicas / 1, per round: {', '.join(map(str, ratios))}.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
