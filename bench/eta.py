"""How honest is the live progress line? The ETA and tokens/s it printed
against what the run then did.

Runs the real CLI (``bulkinfer run --plain-progress``, one progress line a
second through ``BULKINFER_PROGRESS_INTERVAL_S``) on each workload, records
when each line arrived, and compares, at 10%, 25% and 50% of the generation
time (``seconds.generate`` of the report; it ends when the last progress line
is printed):

- the ETA printed then against the real time left (error = eta / real - 1);
- the live tokens/s against the report's final figures (every line after
  the first 20 s: the largest deviation): completion tokens/s against
  ``throughput.completion_tokens_per_s``, prompt + completion tokens/s
  against ``throughput.total_tokens_per_s``, and the run's expected
  completion tokens/s printed after the ETA against the former (also after
  30 s).

Workloads:

- ``sharegpt``: ``sample_data/sharegpt.jsonl`` (300 ShareGPT first turns)
  with ``configs/demo.toml`` (``make demo``'s job: max_tokens 128);
- ``short``: 1,000 short questions (:func:`short_prompts`, seeded) with the
  default settings (max_tokens 256).

Two rounds: first runs (before them the completion lengths that earlier
runs stored as the ETA's prior are removed from ``$BULKINFER_HOME/
calibration.json``: ``sharegpt`` has no prior, ``short`` then has the
ShareGPT run's, as a newcomer's own job after ``make demo``), then the same
jobs run again (as from cron: each one's first run is its prior).

Usage: ``python -m bench.eta [--out bench/results/eta.json] [--rounds 2]``;
writes the JSON and a Markdown table beside it. One engine at a time (two
cores).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.engine.args import cpu_model

ROOT = Path(__file__).resolve().parents[1]
FRACTIONS = (0.10, 0.25, 0.50)
TPS_AFTER_S = 20.0
LINE = re.compile(
    r"bulkinfer: (?P<done>\d+)(?:/(?P<total>\d+))? rows \((?P<failed>\d+) failed\), "
    r"(?:(?P<total_tps>[\d.]+) tok/s, )?(?P<tps>[\d.]+) completion tok/s"
    r"(?:, eta (?P<eta>[\d:]+)(?: \(run ~(?P<expected_tps>[\d.]+) completion tok/s\))?)?"
)
COUNTRIES = (
    "France Germany Japan Italy Spain Canada Brazil Egypt Kenya India China Peru Chile Norway Sweden Poland "
    "Greece Turkey Mexico Cuba Ghana Nepal Iran Iraq Ireland Portugal Austria Hungary Finland Denmark"
).split()
THINGS = "rain rainbows volcanoes bees tides gravity photosynthesis eclipses glaciers magnets".split()
WORDS = "happy quick bright ancient fragile brave calm eager gentle honest".split()
TEMPLATES = (
    "What is the capital of {country}?",
    "Give one synonym for the word '{word}'.",
    "In one sentence, why do {thing} happen?",
    "Translate 'good morning' into the main language of {country}.",
    "Name three facts about {country}.",
    "Explain {thing} to a child in two sentences.",
    "Write a haiku about {thing}.",
    "Is '{word}' an adjective or a noun? Answer in one word.",
)


def short_prompts(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` short questions (8 templates over countries, natural phenomena
    and adjectives), each with a unique id; deterministic for a seed."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        template = rng.choice(TEMPLATES)
        prompt = template.format(country=rng.choice(COUNTRIES), thing=rng.choice(THINGS), word=rng.choice(WORDS))
        rows.append({"id": f"short-{i}", "prompt": prompt})
    return rows


def parse_seconds(text: str) -> float:
    """``H:MM:SS`` (as ``datetime.timedelta`` prints it) in seconds."""
    h, m, s = (int(x) for x in text.split(":"))
    return 3600 * h + 60 * m + s


def run_once(input_path: Path, out_dir: Path, extra: list[str]) -> dict[str, Any]:
    """One ``bulkinfer run``; returns the progress lines (arrival time in s
    since start, rows done, tokens/s, eta s) and the report."""
    out = out_dir / f"{input_path.stem}.out.jsonl"
    cmd = [sys.executable, "-m", "bulkinfer", "run", str(input_path), "-o", str(out), "--overwrite"]
    cmd += ["--plain-progress", *extra]
    env = {**os.environ, "BULKINFER_PROGRESS_INTERVAL_S": "1"}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    assert proc.stderr is not None
    for text in proc.stderr:
        match = LINE.search(text)
        if match:
            eta = match["eta"]
            lines.append(
                {
                    "t": round(time.monotonic() - started, 3),
                    "done": int(match["done"]),
                    "tps": float(match["tps"]),
                    "total_tps": float(match["total_tps"]) if match["total_tps"] else None,
                    "eta_s": parse_seconds(eta) if eta else None,
                    "expected_tps": float(match["expected_tps"]) if match["expected_tps"] else None,
                }
            )
    if proc.wait() != 0:
        raise SystemExit(f"bulkinfer run failed with exit code {proc.returncode}: {' '.join(cmd)}")
    report = orjson.loads(out.with_name(out.name.removesuffix(".jsonl") + ".report.json").read_bytes())
    return {"lines": lines, "report": report}


def forget_length_priors() -> None:
    """Remove the completion lengths stored with earlier runs (the ETA's
    prior) from the calibration store; their throughputs stay."""
    from bulkinfer.io.files import atomic_write
    from bulkinfer.report.calibration import calibration_path, load_calibrations

    entries = load_calibrations()
    if entries:
        kept = [{**e, "completion_lengths": []} for e in entries]
        atomic_write(calibration_path(), orjson.dumps({"entries": kept}, option=orjson.OPT_INDENT_2))


def score(lines: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, Any]:
    """ETA error at each of :data:`FRACTIONS` of the generation time, and the
    largest tokens/s deviation after :data:`TPS_AFTER_S` s."""
    end = lines[-1]["t"]  # the closing line: generation has ended
    generate_s = report["seconds"]["generate"]
    start = end - generate_s
    final_tps = report["throughput"]["completion_tokens_per_s"]
    final_total = report["throughput"]["total_tokens_per_s"]
    at = {}
    for fraction in FRACTIONS:
        target = start + fraction * generate_s
        line = min((x for x in lines[:-1] if x["eta_s"] is not None), key=lambda x: abs(x["t"] - target))
        real = end - line["t"]
        at[f"{round(fraction * 100)}%"] = {
            "elapsed_s": round(line["t"] - start, 1),
            "eta_s": line["eta_s"],
            "real_left_s": round(real, 1),
            "error": round(line["eta_s"] / real - 1, 3) if real > 0 else None,
        }
    later = [x for x in lines[:-1] if x["t"] - start >= TPS_AFTER_S]
    worst = max((abs(x["tps"] / final_tps - 1) for x in later), default=None)
    worst_total = max((abs(x["total_tps"] / final_total - 1) for x in later if x["total_tps"]), default=None)

    def worst_expected(after_s: float) -> float | None:
        errors = [
            abs(x["expected_tps"] / final_tps - 1)
            for x in lines[:-1]
            if x["t"] - start >= after_s and x.get("expected_tps")
        ]
        return round(max(errors), 3) if errors else None

    return {
        "generate_s": round(generate_s, 1),
        "final_completion_tokens_per_s": round(final_tps, 1),
        "final_total_tokens_per_s": round(final_total, 1),
        "eta": at,
        "max_tps_deviation_after_20s": None if worst is None else round(worst, 3),
        "max_total_tps_deviation_after_20s": None if worst_total is None else round(worst_total, 3),
        "max_expected_tps_deviation_after_20s": worst_expected(TPS_AFTER_S),
        "max_expected_tps_deviation_after_30s": worst_expected(30.0),
        "rows": report["request_counts"]["completed"],
        "completion_tokens": report["tokens"]["completion"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "eta.json")
    parser.add_argument("--short-rows", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "date": dt.date.today().isoformat(),
        "command": f"python -m bench.eta --rounds {args.rounds}",
        "workloads": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        short = Path(tmp) / "short.jsonl"
        short.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in short_prompts(args.short_rows)))
        workloads = {
            "sharegpt (300 rows, configs/demo.toml)": (
                ROOT / "sample_data" / "sharegpt.jsonl",
                ["--config", "configs/demo.toml"],
            ),
            f"short ({args.short_rows} rows, defaults)": (short, []),
        }
        forget_length_priors()
        for round_ in range(1, args.rounds + 1):
            for name, (path, extra) in workloads.items():
                name = f"{name}, {'first run' if round_ == 1 else f'run {round_}'}"
                print(f"bench.eta: {name}", file=sys.stderr)
                run = run_once(path, Path(tmp), extra)
                results["workloads"][name] = {**score(run["lines"], run["report"]), "lines": run["lines"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    args.out.with_suffix(".md").write_text(render(results))
    print(render(results))


def render(results: dict[str, Any]) -> str:
    """The Markdown table of a results dict."""
    rows = []
    for name, w in results["workloads"].items():
        for point, x in w["eta"].items():
            rows.append(
                [
                    name,
                    point,
                    f"{x['elapsed_s']:.0f}",
                    f"{x['eta_s']:.0f}",
                    f"{x['real_left_s']:.0f}",
                    f"{x['error']:+.0%}" if x["error"] is not None else "-",
                ]
            )
    head = ["workload", "at", "elapsed s", "ETA printed s", "real s left", "ETA error"]
    table = "\n".join("| " + " | ".join(row) + " |" for row in [head, ["---"] * len(head), *rows])
    tps = "\n".join(
        f"- {name}: final {w['final_completion_tokens_per_s']} completion tok/s and "
        f"{w['final_total_tokens_per_s']} tok/s (prompt + completion) over {w['generate_s']} s; the live "
        f"figures after 20 s within {w['max_tps_deviation_after_20s']:.0%} and "
        f"{w['max_total_tps_deviation_after_20s']:.0%} of them"
        + (
            f"; the run's expected completion tok/s within {w['max_expected_tps_deviation_after_20s']:.0%} "
            f"after 20 s, {w['max_expected_tps_deviation_after_30s']:.0%} after 30 s"
            if w.get("max_expected_tps_deviation_after_20s") is not None
            else ""
        )
        for name, w in results["workloads"].items()
    )
    machine = results["machine"]
    return (
        f"# Progress line vs the real run ({results['date']}; {machine['cpu']}, {machine['cores']} cores)\n\n"
        f"Command: `{results['command']}`\n\n{table}\n\n{tps}\n"
    )


if __name__ == "__main__":
    main()
