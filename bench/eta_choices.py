"""The ETA of a job whose rows ask for ``n`` choices (best-of-n sampling,
several candidates a prompt), this checkout against a base commit,
alternating: ``--rows`` ShareGPT prompts (``sample_data/sharegpt.jsonl``
from row 100 on: not the demo's first rows), each with ``"n": N``,
``bulkinfer run`` at its defaults but ``--max-tokens``, plain progress;
the order of the two swapped each round.

Before each run the calibration store is put back as it was when the
bench started, so every run sees the same stored lengths and step models
(those of the model's other jobs: a first run of this job), and the store
ends as it began. Each run's report's ETA trace is scored
(:func:`bench.eta_trace.score_trace`, a first run's goals: the range holds
the real time left on 80% of estimates from 10% of the run on, no wider
than +-50% of the point from 25% on, the point within +-35% from 50% on),
with the point's error at 10%, 25% and 50% of the run besides.

``python -m bench.eta_choices --base REF [--rows 120] [--n 4]
[--max-tokens 64] [--rounds 2] [--tag T]`` writes
``bench/results/eta-choices-T.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from bench.eta_trace import score_trace
from bench.measure import runs_doc, write_page

ROOT = Path(__file__).resolve().parents[1]
SKIP_ROWS = 100


def write_rows(path: Path, rows: int, n: int) -> None:
    """``rows`` ShareGPT prompts from row :data:`SKIP_ROWS` on, each asking for ``n`` choices."""
    with open(ROOT / "sample_data" / "sharegpt.jsonl", "rb") as f:
        lines = [orjson.loads(line) for line in f][SKIP_ROWS : SKIP_ROWS + rows]
    path.write_bytes(b"".join(orjson.dumps({"id": r["id"], "prompt": r["prompt"], "n": n}) + b"\n" for r in lines))


def errors_at(points: list[list[float]], end_s: float, fractions: tuple[float, ...]) -> list[float | None]:
    """The point's error (point / real time left - 1) of the estimate nearest each fraction of the run."""
    out: list[float | None] = []
    for fraction in fractions:
        at = min(points, key=lambda p: abs(p[0] - fraction * end_s), default=None)
        out.append(None if at is None or end_s - at[0] <= 0 else at[2] / (end_s - at[0]) - 1)
    return out


def one_run(src: Path, out: Path, root: Path, max_tokens: int) -> dict[str, Any]:
    """``bulkinfer run`` of ``src`` with the code of ``root``; its report's figures and its trace's scores."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "bulkinfer", "run", str(src), "-o", str(out), "--max-tokens", str(max_tokens)]
    proc = subprocess.run([*cmd, "--overwrite", "--plain-progress"], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    report = orjson.loads(out.with_name(out.name.replace(".out.jsonl", ".out.report.json")).read_bytes())
    trace = report["eta_trace"]
    return {
        "generate_s": report["seconds"]["generate"],
        "completion_tokens": report["tokens"]["completion"],
        "points": trace["points"],
        "end_s": trace["end_s"],
        "error_at_10_25_50": errors_at(trace["points"], trace["end_s"], (0.10, 0.25, 0.50)),
        **score_trace(trace["points"], trace["end_s"], first_run=True),
    }


def render(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"# The ETA of rows of n choices ({doc['created']}; {m['cpu']} ({m['cpu_kind']}), {m['logical_cores']} cores)",
        "",
        f"Command: `{doc['command']}`; {doc['rows']} ShareGPT prompts, `n` {doc['n']}, `--max-tokens` "
        f"{doc['max_tokens']}, first runs (the store put back before each), alternating, the order swapped each "
        "round. Goals (a first run): "
        "range held >= 80% from 10%, widest <= +-50% from 25%, point within +-35% from 50%.",
        "",
        "| run | code | generate s | estimates | range held | widest from 25% | point at 10% / 25% / 50% "
        "| point's largest error from 50% |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in doc["runs"]:
        at = " / ".join("-" if e is None else f"{e:+.0%}" for e in r["error_at_10_25_50"])
        held, widest, error = r["coverage"], r["max_half_width"], r["max_point_error"]
        lines.append(
            f"| {r['run']} | {r['code']} | {r['generate_s']:.1f} | {r['estimates']} "
            f"| {'-' if held is None else f'{held:.0%}'} | {'-' if widest is None else f'+-{widest:.0%}'} | {at} "
            f"| {'-' if error is None else f'{error:+.0%}'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare this checkout with")
    parser.add_argument("--rows", type=int, default=120)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tag", default="choices")
    args = parser.parse_args()

    from bulkinfer.report.calibration import calibration_path

    store = calibration_path()
    work = Path(tempfile.mkdtemp(prefix="bench-eta-choices-"))
    kept = work / "calibration.json"
    if store.exists():
        shutil.copy2(store, kept)
    base = work / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True)
    src = work / "in.jsonl"
    write_rows(src, args.rows, args.n)
    runs = []
    try:
        for i in range(1, args.rounds + 1):
            codes = [(f"base {args.base}", base), ("this checkout", ROOT)]
            for code, root in codes if i % 2 else codes[::-1]:  # the order swapped each round
                key = f"{code.split()[0]}-{i}"
                if kept.exists():
                    shutil.copy2(kept, store)
                print(f"[bench.eta_choices] {key}", file=sys.stderr, flush=True)
                measured = one_run(src, work / f"{key}.out.jsonl", root, args.max_tokens)
                runs.append({"run": key, "code": code, **measured})
    finally:
        if kept.exists():
            shutil.copy2(kept, store)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    doc = {**runs_doc("bench.eta_choices", runs), "rows": args.rows, "n": args.n, "max_tokens": args.max_tokens}
    write_page(f"eta-choices-{args.tag}", doc, render)


if __name__ == "__main__":
    main()
