"""``bulkinfer run`` in a few variants (flags, environment) on the same rows,
alternating, for benchmarks that compare one engine setting
(``bench.speculative``, ``bench.compile``).

Every run is ``bulkinfer run`` as a user runs it (its own dtype choice, KV
cache sized to the job), temperature 0, on one of these workloads:

- ``extraction``: ``--rows`` replies of ``sample_data/sharegpt.jsonl`` (40..300
  reply tokens, file order), each given back to the model with
  :data:`COPY_INSTRUCTION` (chat template applied, bulkinfer's default): the
  answer copies spans of the prompt. ``max_tokens`` = the reply's tokens +
  16; the model stops when it is done (no ``ignore_eos``).
- ``sharegpt``: the first ``--rows`` ShareGPT prompts, ``max_tokens`` = the
  reference reply's length in tokens capped at ``max_tokens``, ``ignore_eos``.
- ``sharegpt-eos``: the same rows without ``ignore_eos``: the model stops
  where it ends its answer, as a user's job does.
- ``fixed``: the same prompts, every row ``max_tokens`` = ``max_tokens``,
  ``ignore_eos``: the rows run together and end within a few steps of one
  another, so the job has (almost) no tail of a few rows running alone.
- ``multiturn``: the first ``--rows`` turns of
  ``sample_data/sharegpt_multiturn.jsonl`` (real conversations, each turn's
  ``messages`` repeating the turns before it: prefixes shared across rows),
  ``max_tokens`` as ``sharegpt``, ``ignore_eos``.
- ``choices`` (``choices2``): the ``sharegpt`` rows with ``n`` = 4 (2): four
  (two) sequences sharing each prompt, ``ignore_eos``, temperature 1 (vLLM
  refuses ``n`` > 1 with greedy sampling): its runs' completions differ by
  design.

Per run: the report's ``seconds.load`` (interpreter excluded: tokenizer,
engine choice, engine start) and ``seconds.generate``, completion tokens
(generation completion tokens/s = completion tokens / generate seconds), the
process's wall time, and how many rows' completions equal the same round's
first variant's (greedy decoding: a setting that only changes speed must not
change them).
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench.measure import machine, run_measured, tail, versions

ROOT = Path(__file__).resolve().parents[1]
SHAREGPT = ROOT / "sample_data" / "sharegpt.jsonl"
MULTITURN = ROOT / "sample_data" / "sharegpt_multiturn.jsonl"
COPY_INSTRUCTION = "Repeat the text above exactly, word for word."
WORKLOADS = ("extraction", "sharegpt", "sharegpt-eos", "fixed", "multiturn", "choices", "choices2")

# A variant: (flags, extra environment) of the round (1, 2, ...) at hand.
Variant = Callable[[int], tuple[list[str], dict[str, str]]]


def sharegpt_prompts(rows: int) -> list[str]:
    """The first ``rows`` prompts of :data:`SHAREGPT`, each cut at 2,000
    characters: the rows the raw-vLLM benches (``bench.step_profile``,
    ``bench.malloc``) generate from."""
    lines = SHAREGPT.read_bytes().splitlines()
    return [orjson.loads(line)["prompt"][:2000] for line in lines if line.strip()][:rows]


def write_workload(name: str, path: Path, rows: int, max_tokens: int) -> dict[str, Any]:
    """Writes the workload's JSONL input to ``path``; returns its description
    and the flags every variant runs it with.

    Raises:
        ValueError: an unknown workload name.
    """
    records = [orjson.loads(line) for line in SHAREGPT.read_bytes().splitlines() if line.strip()]
    if name == "extraction":
        chosen = [r for r in records if 40 <= r["reference_tokens"] <= 300][:rows]
        out = [
            {
                "id": r["id"],
                "prompt": f"{r['reference']}\n\n{COPY_INSTRUCTION}",
                "max_tokens": r["reference_tokens"] + 16,
            }
            for r in chosen
        ]
        flags: list[str] = []
    elif name in ("sharegpt", "sharegpt-eos"):
        out = [
            {"id": r["id"], "prompt": r["prompt"], "max_tokens": min(r["reference_tokens"], max_tokens)}
            for r in records[:rows]
        ]
        flags = ["--ignore-eos"] if name == "sharegpt" else []
    elif name == "fixed":
        out = [{"id": r["id"], "prompt": r["prompt"], "max_tokens": max_tokens} for r in records[:rows]]
        flags = ["--ignore-eos"]
    elif name in ("choices", "choices2"):
        n = 4 if name == "choices" else 2
        out = [
            {"id": r["id"], "prompt": r["prompt"], "n": n, "max_tokens": min(r["reference_tokens"], max_tokens)}
            for r in records[:rows]
        ]
        flags = ["--ignore-eos", "--temperature", "1"]  # after one_run's --temperature 0: the last one counts
    elif name == "multiturn":
        turns = [orjson.loads(line) for line in MULTITURN.read_bytes().splitlines() if line.strip()][:rows]
        out = [
            {"id": r["id"], "messages": r["messages"], "max_tokens": min(r["reference_tokens"], max_tokens)}
            for r in turns
        ]
        flags = ["--ignore-eos"]
    else:
        raise ValueError(f"unknown workload {name!r} (one of {', '.join(WORKLOADS)})")
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in out))
    sequences = sum(r["max_tokens"] * r.get("n", 1) for r in out)
    return {"rows": len(out), "max_tokens_sum": sequences, "flags": flags}


def one_run(src: Path, work: Path, key: str, flags: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One ``bulkinfer run`` of ``src`` with ``flags`` and ``env``; its timings
    and completions (``failed``: the exit code, when it failed)."""
    out = work / f"{key}.jsonl"
    cmd = [sys.executable, "-m", "bulkinfer", "run", str(src), "-o", str(out), "--overwrite", "--plain-progress"]
    cmd += ["--temperature", "0", *flags]
    measured = run_measured(cmd, work / f"{key}.log", env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, cwd=ROOT)
    if measured.returncode != 0:
        return {"key": key, "failed": measured.returncode, "log_tail": tail(work / f"{key}.log", 3000)}
    report = orjson.loads(out.with_name(f"{key}.report.json").read_bytes())
    seconds = report["seconds"]
    tokens = report["tokens"]["completion"]
    return {
        "key": key,
        "flags": flags,
        "env": env,
        "wall_s": measured.wall_s,
        "load_s": seconds["load"],
        "start_s": seconds.get("start", {}),
        "generate_s": seconds["generate"],
        "completion_tokens": tokens,
        "prompt_tokens": report["tokens"]["prompt"],
        "prefix_cache_hit_rate": (report.get("prefix_cache") or {}).get("hit_rate"),
        "gen_completion_tok_s": tokens / seconds["generate"] if seconds["generate"] else None,
        "engine": {
            k: report["engine"].get(k)
            for k in (
                "dtype",
                "enforce_eager",
                "block_size",
                "in_process",
                "speculative_config",
                "kv_cache_memory_bytes",
                "spec_decode_draft_tokens",
                "spec_decode_accepted_tokens",
            )
        },
        "engine_choice": report.get("engine_choice", {}),
        "completions": {r["id"]: r.get("completion") for r in map(orjson.loads, out.read_bytes().splitlines())},
    }


def alternate(
    benchmark: str,
    workloads: list[str],
    variants: dict[str, Variant],
    work: Path,
    rows: int,
    max_tokens: int,
    rounds: int,
) -> dict[str, Any]:
    """Each workload, ``rounds`` times each variant in turn (round 1: every
    variant, then round 2, ...); the results document (``runs``, and per
    workload each variant's mean generation completion tokens/s and load
    seconds as ``means``)."""
    runs: list[dict[str, Any]] = []
    described = {}
    for workload in workloads:
        src = work / f"{workload}.jsonl"
        described[workload] = write_workload(workload, src, rows, max_tokens)
        for i in range(1, rounds + 1):
            first: dict[str, Any] | None = None
            for name, variant in variants.items():
                key = f"{workload}-{name}-{i}"
                print(f"[{benchmark}] {key}", file=sys.stderr, flush=True)
                flags, env = variant(i)
                run = one_run(src, work, key, [*described[workload]["flags"], *flags], env)
                run.update(workload=workload, variant=name, round=i)
                if first is None:
                    first = run.get("completions")
                elif first and run.get("completions"):
                    same = sum(first[k] == run["completions"].get(k) for k in first)
                    run["identical"] = f"{same}/{len(first)}"
                runs.append(run)
    means: dict[str, dict[str, dict[str, float]]] = {}
    for workload in workloads:
        for name in variants:
            done = [r for r in runs if r["workload"] == workload and r["variant"] == name and "failed" not in r]
            if done:
                means.setdefault(workload, {})[name] = {
                    "gen_completion_tok_s": statistics.mean(r["gen_completion_tok_s"] for r in done),
                    "load_s": statistics.mean(r["load_s"] for r in done),
                    "wall_s": statistics.mean(r["wall_s"] for r in done),
                }
    for r in runs:
        r.pop("completions", None)
    return {
        "benchmark": benchmark,
        "created": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python", "-m", benchmark, *sys.argv[1:]]),
        "machine": machine(),
        "versions": versions(),
        "workloads": described,
        "runs": runs,
        "means": means,
    }


def markdown(doc: dict[str, Any], title: str, note: str, sampling: str = "temperature 0") -> str:
    """The results page: every run, then each variant's means against the first variant's."""
    m = doc["machine"]
    lines = [
        f"# {title} ({doc['created']}; {m['cpu']} {m.get('cpu_kind', '')}, {m['logical_cores']} cores)",
        "",
        f"Command: `{doc['command']}`; `bulkinfer run` at its defaults, {sampling}, alternating. {note}",
        "",
        "| workload | run | dtype | eager | load s | generate s | completion tokens | gen. completion tok/s "
        "| wall s | rows identical to the round's first | draft tokens checked / accepted | prefix cache hits |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["runs"]:
        if "failed" in r:
            lines.append(f"| {r['workload']} | {r['key']} | failed (exit {r['failed']}) | | | | | | | | | |")
            continue
        e = r["engine"]
        drafts, accepted = e.get("spec_decode_draft_tokens"), e.get("spec_decode_accepted_tokens")
        speculated = "—" if drafts is None else f"{drafts} / {'—' if accepted is None else accepted}"
        hits = r.get("prefix_cache_hit_rate")
        lines.append(
            f"| {r['workload']} | {r['key']} | {e['dtype']} | {e['enforce_eager']} | {r['load_s']:.1f} "
            f"| {r['generate_s']:.1f} | {r['completion_tokens']} | {r['gen_completion_tok_s']:.1f} | {r['wall_s']:.1f} "
            f"| {r.get('identical', '—')} | {speculated} | {'—' if hits is None else f'{hits:.1%}'} |"
        )
    lines += [
        "",
        "| workload | variant | mean gen. completion tok/s | ratio to the first | mean load s | mean wall s |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for workload, by_variant in doc["means"].items():
        base = next(iter(by_variant.values()))["gen_completion_tok_s"]
        for name, mean in by_variant.items():
            lines.append(
                f"| {workload} | {name} | {mean['gen_completion_tok_s']:.1f} "
                f"| {mean['gen_completion_tok_s'] / base:.2f}x | {mean['load_s']:.1f} | {mean['wall_s']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def write(doc: dict[str, Any], out: Path, title: str, note: str, sampling: str = "temperature 0") -> None:
    """``out`` (JSON) and its ``.md`` page; the page is printed too."""
    out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    text = markdown(doc, title, note, sampling)
    out.with_suffix(".md").write_text(text)
    print(text)
