"""Compare bulkinfer with raw vLLM, vLLM run-batch and static transformers batches on one workload.

Usage (from the repo root, after `make install`):

    .venv/bin/python -m bench.compare --workload sharegpt --n 200     # the table: ~25 min on 2 CPU cores
    .venv/bin/python -m bench.compare --workload sharegpt --n 200 --systems a \
        --orders arrival,ascending,descending --repeats 3             # bulkinfer's feed orders: ~45 min
    .venv/bin/python -m bench.compare --workload fixed --n 200      # control: 128-token prompts, 64 tokens out
    .venv/bin/python -m bench.compare --workload fixed --n 4 --max-output 4 --hf-subset 4
    .venv/bin/python -m bench.compare --workload sharegpt,shared-prefix --n 200 --systems a,b \
        --engine defaults --repeats 2                                  # defaults against defaults (issue 15)
    .venv/bin/python -m bench.compare --workload sharegpt --n 200 --systems a,b --repeats 2 \
        --dtype bfloat16 --compiled --vllm-env VLLM_ENABLE_V1_MULTIPROCESSING=0   # identical: bf16, compiled

Systems (``--systems``, letters or names), each in its own subprocess, in this order:

    b  vllm       raw vLLM LLM.generate, all prompts at once, arrival order (the reference)
    a  bulkinfer  `bulkinfer run`, once per --orders entry (default: bulkinfer's default
                  order), --repeats times, interleaved (a-<order>, or a-<order>-<i>)
    c  run-batch  vLLM's OpenAI batch runner on the same rows
    d  hf         transformers generate, static batches (B=16), arrival and length-bucketed,
                  on the first --hf-subset rows with prompt + output <= --hf-max-total tokens;
                  compared with b on those rows (b-subset)
    e  vllm-defaults  raw vLLM LLM.generate as b, with vLLM's own defaults (its default
                  dtype, compilation): LLM(model, seed, kv_cache_memory_bytes) only, the KV
                  cache as bulkinfer's (vLLM's CPU default, 92% of memory, does not start
                  on a 24 GiB machine)

With --repeats R, a, b and e run R rounds, alternating (a, b, e, a, b, e, ...); each round's
bulkinfer runs are compared with that round's b, and the page adds every system's mean,
min and max with bulkinfer's mean over b's and e's. --engine defaults gives each system its
own defaults instead of the same engine arguments (bulkinfer: its measured dtype, eager
mode, its KV cache share; b: bulkinfer's dtype and KV cache size, otherwise vLLM's
defaults, compilation included).

Every system gets the same rows, prompt tokens and per-row max_tokens, generates with
ignore_eos (so each produces the same completion tokens), the same model, seed and
sampling, and (with --engine fixed, the default) the same dtype and engine arguments. Results:
bench/results/compare-<workload>-n<N>-<time>.json and .md, rewritten after every
system (``"complete": false`` until the last). See bench/README.md.
The scale series (1k..100k rows, seconds and memory) is bench/scale.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from bench import measure, systems, table, workload
from bulkinfer.config import PlanSettings

SYSTEM_NAMES = {
    "a": "a",
    "bulkinfer": "a",
    "b": "b",
    "vllm": "b",
    "c": "c",
    "run-batch": "c",
    "d": "d",
    "hf": "d",
    "e": "e",
    "vllm-defaults": "e",
}
ORDERS = ("arrival", "ascending", "descending")
WORKLOADS = ("sharegpt", "fixed", "shared-prefix")
HF_ORDERS = ("arrival", "bucketed")
GiB = 1024**3

NOTES = [
    "Generation = bulkinfer's `seconds.generate` (first request in to last result out); for raw vLLM the "
    "`LLM.generate` call; for run-batch from endpoints ready to every response in (input reading, prompt "
    "rendering and tokenizing included, output writing not); for transformers the batch loop (tokenize, "
    "generate, decode), as vLLM's `hf` backend times it.",
    "End to end = wall time of the system's process from start to exit: interpreter, imports, model load, "
    "engine start, generation, writing, shutdown (for b, minus the b-subset rerun its process does after b).",
    "Tokens are counted from what came back (bulkinfer's report, vLLM's outputs, run-batch's `usage`, "
    "the transformers output ids up to each row's max_tokens). Total = prompt + completion.",
    "Peak RSS is sampled every 0.5 s with psutil over the system's process tree: the sum over its processes "
    "(shared library pages counted once per process) / the largest single process.",
    "Padding efficiency: bulkinfer's plan reports what static batches of B would waste on prompts in arrival "
    "vs sorted order (vLLM itself does not pad); the static runs report the prompt positions and generated "
    "positions they really spent (real / padded).",
    "Ratio = completion tokens/s of the system / the reference's, for generation and end to end. The static "
    "baseline is compared with b-subset (raw vLLM on the same rows, in b's process after b's run, engine warm), "
    "and only for generation: its end-to-end time spreads model load over fewer rows.",
]


def parse_systems(text: str) -> list[str]:
    out: list[str] = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        if item not in SYSTEM_NAMES:
            raise argparse.ArgumentTypeError(f"unknown system {item!r}; choose from {', '.join(SYSTEM_NAMES)}")
        if SYSTEM_NAMES[item] not in out:
            out.append(SYSTEM_NAMES[item])
    return out


def parse_workloads(text: str) -> list[str]:
    names = [w.strip() for w in text.split(",") if w.strip()]
    for w in names:
        if w not in WORKLOADS:
            raise argparse.ArgumentTypeError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    return names


def parse_counts(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--n takes integers, comma-separated: {exc}") from exc


def parse_orders(text: str) -> list[str]:
    orders = [o.strip() for o in text.split(",") if o.strip()]
    for o in orders:
        if o not in ORDERS:
            raise argparse.ArgumentTypeError(f"unknown order {o!r}; choose from {', '.join(ORDERS)}")
    return orders


def parse_prefix_aware(text: str) -> list[bool | None]:
    values = {"on": True, "off": False, "default": None}
    items = [v.strip() for v in text.split(",") if v.strip()]
    for v in items:
        if v not in values:
            raise argparse.ArgumentTypeError(f"--prefix-aware takes on, off or default, got {v!r}")
    return [values[v] for v in items]


def parse_env(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key, val


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workload",
        type=parse_workloads,
        default=["sharegpt"],
        help=f"one or more of {', '.join(WORKLOADS)}, comma-separated: each is run in turn, with its own results files",
    )
    p.add_argument(
        "--n",
        type=parse_counts,
        default=[200],
        help="rows (sharegpt: the first N of sample_data/sharegpt.jsonl; shared-prefix: of sharegpt_multiturn.jsonl);"
        " one value, or one per --workload",
    )
    p.add_argument(
        "--engine",
        choices=("fixed", "defaults"),
        default="fixed",
        help="fixed: every vLLM system gets the same dtype, eager mode, KV cache and seed; defaults: each system "
        "its own defaults (bulkinfer: only --seed; b: bulkinfer's dtype, KV cache size and the seed; e: the seed "
        "and that KV cache size)",
    )
    p.add_argument("--dtype", default="float32", help="--engine fixed: every vLLM system's dtype (default float32)")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="--engine fixed: every vLLM system compiled (vLLM's torch.compile) instead of eager",
    )
    p.add_argument("--systems", type=parse_systems, default=["a", "b", "c", "d"], help="e.g. a,b,c,d (default)")
    p.add_argument(
        "--bulkinfer-env",
        type=parse_env,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="added to bulkinfer's environment (a), e.g. VLLM_ENABLE_V1_MULTIPROCESSING=1: vLLM's engine in "
        "child processes (bulkinfer runs one CPU engine in its own process by default); repeatable",
    )
    p.add_argument(
        "--vllm-env",
        type=parse_env,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="added to the vLLM systems' environment (b, c, e), e.g. VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine "
        "in the caller's process, as bulkinfer runs one CPU engine; repeatable",
    )
    p.add_argument(
        "--bulkinfer-args",
        default="",
        metavar="FLAGS",
        help="added to bulkinfer's command line (a), split as a shell would, e.g. '--speculative-tail 16'",
    )
    p.add_argument(
        "--orders", type=parse_orders, default=[PlanSettings().order], help="bulkinfer --order values to run"
    )
    p.add_argument(
        "--prefix-aware",
        type=parse_prefix_aware,
        default=[None],
        help="bulkinfer's prefix-aware feeding: on, off or on,off (each order runs with each); default: bulkinfer's",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of each bulkinfer order, interleaved")
    p.add_argument("--hf-subset", type=int, default=32, help="rows for the static baseline: the first K (0: all)")
    p.add_argument(
        "--hf-max-total",
        type=int,
        default=512,
        help="static baseline rows: only those with prompt + output <= this many tokens (0: no limit)",
    )
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-output", type=int, default=None, help="cap every row's max_tokens (tiny runs)")
    p.add_argument("--kv-cache-gib", type=float, default=6.0, help="vLLM kv_cache_memory_bytes, in GiB")
    p.add_argument("--seed", type=int, default=0, help="engine / torch seed (and the fixed workload's prompts)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--model", default=None, help="model directory (default: bulkinfer's default model)")
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--work-dir", type=Path, default=None, help="inputs, outputs and logs (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per system before it is killed")
    p.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="skip the untimed import of vllm/torch/transformers"
    )
    return p


def describe_workload(
    args: argparse.Namespace, rows: Sequence[workload.Row], subset: Sequence[workload.Row]
) -> dict[str, Any]:
    cap = f", capped at {args.max_output}" if args.max_output is not None else ""
    if args.workload == "sharegpt":
        text = (
            f"the first {len(rows)} rows of sample_data/sharegpt.jsonl (ShareGPT first turns through vLLM's filter: "
            "prompt 4..1024 tokens, prompt + reply <= 2048; shuffled with seed 0); max_tokens = the reply's "
            f"length in tokens, capped so prompt + output <= 2048{cap}"
        )
    elif args.workload == "shared-prefix":
        text = (
            f"the first {len(rows)} rows of sample_data/sharegpt_multiturn.jsonl (real ShareGPT conversations "
            "replayed turn by turn: row k of a conversation = its messages up to the k-th user turn, rendered with "
            f"the model's chat template; whole conversations, then shuffled with seed {args.seed}); max_tokens = "
            f"the reference reply's length in tokens, capped so prompt + output <= 2048{cap}"
        )
    else:
        text = (
            f"{len(rows)} prompts of {workload.FIXED_PROMPT_TOKENS} tokens (random common words, seed {args.seed}), "
            f"max_tokens {workload.FIXED_OUTPUT_TOKENS}{cap}"
        )
    if len(subset) == len(rows):
        which = f"all {len(rows)} rows"
    else:
        limit = f" with prompt + output <= {args.hf_max_total} tokens" if args.hf_max_total > 0 else ""
        which = (
            f"the first {len(subset)} rows{limit} (compared with b-subset: raw vLLM on those rows; "
            f"{workload.describe(subset)['completion_tokens']} completion tokens)"
        )
    return {
        "name": args.workload,
        "n": args.n,
        "max_output": args.max_output,
        "description": text,
        "hf_subset": f"{which}, batches of {args.hf_batch_size}, arrival order and sorted by prompt length",
        "hf_subset_rows": len(subset),
        "hf_subset_ids": [r.id for r in subset],
        **workload.describe(rows),
    }


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Each result's completion tokens/s over its reference's (``b`` or ``b-subset``)."""
    by_key = {r["key"]: r for r in results if "error" not in r}
    for r in results:
        ref = by_key.get(r.get("reference", ""))
        if ref is None and r.get("reference") == systems.REFERENCE:  # repeated runs: b-1 is the first b
            ref = by_key.get(f"{systems.REFERENCE}-1")
        if "error" in r or ref is None:
            continue

        def ratio(kind: str, r: dict[str, Any] = r, ref: dict[str, Any] = ref) -> float | None:
            mine, theirs = r[kind], ref[kind]
            if not mine or not theirs:
                return None
            return float(mine["completion_tokens_per_s"] / theirs["completion_tokens_per_s"])

        r["ratio"] = {
            "reference": ref["key"],
            "generate": ratio("throughput_generate"),
            "end_to_end": ratio("throughput_end_to_end"),
        }


def _stats(xs: list[float]) -> dict[str, Any]:
    return {"runs": xs, "mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)}


def system_group(result: dict[str, Any]) -> str | None:
    """Which runs are repeats of one system: ``a <feed>`` for bulkinfer, ``b``
    (raw vLLM), ``e`` (vLLM's defaults); None for the rest."""
    key = result["key"]
    if key.startswith("a-"):
        return f"a {result.get('feed', result.get('order'))}"
    if key == "b" or (key.startswith("b-") and key != "b-subset"):
        return "b"
    if key == "e" or key.startswith("e-"):
        return "e"
    return None


def summarize_systems(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Generation completion tokens/s of each system over its runs (each run,
    mean, min, max; see :func:`system_group`), and each bulkinfer feed's mean
    over b's and e's means: ``ratios_of_means[feed]["b"]``."""
    runs: dict[str, list[float]] = {}
    for r in results:
        group = system_group(r)
        if group and "error" not in r and r["throughput_generate"]:
            runs.setdefault(group, []).append(r["throughput_generate"]["completion_tokens_per_s"])
    if not runs:
        return None
    stats = {group: _stats(xs) for group, xs in runs.items()}
    ratios = {
        group[2:]: {ref: stats[group]["mean"] / stats[ref]["mean"] for ref in ("b", "e") if ref in stats}
        for group in stats
        if group.startswith("a ")
    }
    return {"completion_tokens_per_s_generate": stats, "ratios_of_means": ratios}


def summarize_orders(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """bulkinfer's generation completion tokens/s per feed order over its
    repeats: each run, mean, min, max, and the order with the best mean."""
    runs: dict[str, list[float]] = {}
    for r in results:
        if r["key"].startswith("a-") and "error" not in r and r["throughput_generate"]:
            runs.setdefault(r.get("feed", r["order"]), []).append(r["throughput_generate"]["completion_tokens_per_s"])
    if not runs:
        return None
    means = {order: sum(xs) / len(xs) for order, xs in runs.items()}
    by_order = {order: {"runs": xs, "mean": means[order], "min": min(xs), "max": max(xs)} for order, xs in runs.items()}
    best = max(means, key=means.__getitem__)
    return {"completion_tokens_per_s_generate": by_order, "best": best}


def plan_jobs(
    args: argparse.Namespace,
    rows: Sequence[workload.Row],
    subset: Sequence[workload.Row],
    settings: systems.BenchSettings,
) -> list[tuple[str, Any]]:
    """(key, thunk) per system run, in the order they run: each round (of
    ``--repeats``) runs bulkinfer's feeds, then raw vLLM (b), then vLLM's
    defaults (e), so the systems alternate; then c and d once. With
    ``--repeats`` above 1 keys end in the round (``a-<feed>-<i>``, ``b-<i>``)
    and each round's runs are compared with that round's b. With
    ``--engine defaults`` b and e take the KV cache size, and b the dtype,
    that bulkinfer's last run reported."""
    jobs: list[tuple[str, Any]] = []
    state = {"settings": settings}

    def bulkinfer(order: str, key: str, pa: bool | None, reference: str) -> dict[str, Any]:
        out = systems.run_bulkinfer(rows, order, settings, key, prefix_aware=pa, reference=reference)
        engine = out.get("engine") or {}
        if settings.defaults and engine.get("dtype"):
            state["settings"] = replace(
                settings, dtype=engine["dtype"], kv_cache_memory_bytes=engine["kv_cache_memory_bytes"]
            )
        return out

    for i in range(1, args.repeats + 1):
        suffix = "" if args.repeats == 1 else f"-{i}"
        reference = f"b{suffix}"
        if "a" in args.systems:
            for o in args.orders:
                for pa in args.prefix_aware:
                    name = o if pa is None else f"{o}-{'prefix' if pa else 'plain'}"
                    key = f"a-{name}{suffix}"
                    jobs.append((key, lambda o=o, key=key, pa=pa, ref=reference: bulkinfer(o, key, pa, ref)))
        if "b" in args.systems:
            with_subset = subset if "d" in args.systems and i == 1 else ()
            jobs.append(
                (
                    reference,
                    lambda sub=with_subset, key=reference: systems.run_vllm_generate(
                        rows, state["settings"], sub, key=key
                    ),
                )
            )
        if "e" in args.systems:
            key = f"e{suffix}"
            jobs.append(
                (
                    key,
                    lambda key=key, ref=reference: systems.run_vllm_generate(
                        rows,
                        state["settings"],
                        key=key,
                        engine_args={
                            "kv_cache_memory_bytes": state["settings"].kv_cache_memory_bytes,
                            "seed": settings.seed,
                        },
                        reference=ref,
                    ),
                )
            )
    if "c" in args.systems:
        jobs.append(("c", lambda: systems.run_vllm_run_batch(rows, settings)))
    if "d" in args.systems:
        jobs += [(f"d-{o}", lambda o=o: systems.run_hf_static(rows, subset, o, settings)) for o in HF_ORDERS]
    return jobs


def bench_settings(args: argparse.Namespace, model: str, workdir: Path) -> systems.BenchSettings:
    """What every system of this comparison shares, from the command line.

    Raises:
        SystemExit: --dtype or --compiled with --engine defaults (each system keeps its own there).
    """
    if args.engine == "defaults" and (args.compiled or args.dtype != "float32"):
        raise SystemExit("--dtype and --compiled set the fixed engine: not with --engine defaults")
    return systems.BenchSettings(
        model=model,
        workdir=workdir,
        kv_cache_memory_bytes=int(args.kv_cache_gib * GiB),
        dtype=args.dtype,
        enforce_eager=not args.compiled,
        seed=args.seed,
        temperature=args.temperature,
        top_p=args.top_p,
        hf_batch_size=args.hf_batch_size,
        timeout_s=args.timeout,
        defaults=args.engine == "defaults",
        bulkinfer_env=tuple(args.bulkinfer_env),
        vllm_env=tuple(args.vllm_env),
        bulkinfer_args=tuple(shlex.split(args.bulkinfer_args)),
    )


def run(args: argparse.Namespace, workdir: Path, save: Any) -> tuple[dict[str, Any], bool]:
    """Run the chosen systems, calling ``save(doc)`` after each; return the
    results document and whether all succeeded."""
    from bulkinfer.models import resolve_model

    model = resolve_model(args.model)
    rows = workload.build(args.workload, workload.load_tokenizer(model), args.n, args.max_output, args.seed)
    subset = workload.static_subset(rows, args.hf_subset, args.hf_max_total if args.hf_max_total > 0 else None)
    if "d" in args.systems and not subset:
        raise SystemExit(f"no row has prompt + output <= --hf-max-total {args.hf_max_total}")
    settings = bench_settings(args, model, workdir)
    doc: dict[str, Any] = {
        "benchmark": "bench.compare",
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(["python", "-m", "bench.compare", *sys.argv[1:]]),
        "complete": False,
        "loadavg_before": list(os.getloadavg()),
        "machine": measure.machine(),
        "versions": measure.versions(),
        "settings": {
            "model": model,
            "engine": args.engine,
            # with --engine defaults each result's "engine" says what it ran
            **({"seed": settings.seed} if settings.defaults else settings.engine_args()),
            "temperature": args.temperature,
            "top_p": args.top_p,
            "ignore_eos": True,
            "hf_batch_size": args.hf_batch_size,
            "bulkinfer_default_order": PlanSettings().order,
            "bulkinfer_default_prefix_aware": PlanSettings().prefix_aware,
            "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TOKENIZERS_PARALLELISM": "false"},
        },
        "workload": describe_workload(args, rows, subset),
        "memory": f"psutil every {measure.SAMPLE_INTERVAL_S} s over each system's process tree: "
        "peak_rss_bytes = largest sum of RSS, peak_rss_largest_process_bytes = largest single process",
        "notes": NOTES,
        "results": [],
        "work_dir": str(workdir),
    }
    started = time.monotonic()
    jobs = plan_jobs(args, rows, subset, settings)
    if args.warmup:
        # Untimed: read vLLM's, torch's and transformers' files into the page cache once, so that the
        # first system measured does not pay a cold disk the others do not.
        measured = measure.run_measured(
            [sys.executable, "-c", "import torch, transformers, vllm"], workdir / "warmup.log", env=settings.env()
        )
        doc["warmup_s"] = measured.wall_s
    ok = True
    for key, job in jobs:
        try:
            out = job()
        except Exception as exc:  # one failing system must not lose the others' measurements
            print(f"[bench] {key} failed: {exc}", file=sys.stderr, flush=True)
            doc["results"].append({"key": key, "error": f"{type(exc).__name__}: {exc}"})
            ok = False
        else:
            doc["results"] += out if isinstance(out, list) else [out]
        add_ratios(doc["results"])
        doc["orders"] = summarize_orders(doc["results"])
        doc["systems"] = summarize_systems(doc["results"])
        doc["wall_s"] = time.monotonic() - started  # the whole benchmark so far, warm-up included
        save(doc)
    doc["complete"] = True
    return doc, ok


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    counts = args.n * len(args.workload) if len(args.n) == 1 else args.n
    if len(counts) != len(args.workload):
        raise SystemExit(f"--n takes one value or one per workload ({len(args.workload)}), got {len(args.n)}")
    if min(counts) < 1 or args.repeats < 1:
        raise SystemExit("--n and --repeats must be >= 1")
    ok = True
    for name, n in zip(args.workload, counts, strict=True):
        ok = run_workload(argparse.Namespace(**{**vars(args), "workload": name, "n": n})) and ok
    return 0 if ok else 1


def run_workload(args: argparse.Namespace) -> bool:
    """One workload (``args.workload``, ``args.n`` rows): every system, results
    written to ``args.out_dir``; whether every system succeeded."""
    stem = f"compare-{args.workload}-n{args.n}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"{stem}.json"
    md_path = args.out_dir / f"{stem}.md"

    def save(doc: dict[str, Any]) -> None:
        for path, data in ((json_path, orjson.dumps(doc, option=orjson.OPT_INDENT_2)), (md_path, table.render(doc))):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
            os.replace(tmp, path)

    if args.work_dir is not None:
        workdir = args.work_dir / args.workload
        workdir.mkdir(parents=True, exist_ok=True)
        doc, ok = run(args, workdir.resolve(), save)
    else:
        workdir = Path(tempfile.mkdtemp(prefix=f"{stem}-"))
        doc, ok = run(args, workdir, save)
        if ok:
            shutil.rmtree(workdir)
            doc["work_dir"] = None
        else:
            print(f"[bench] logs kept in {workdir}", file=sys.stderr)
    save(doc)
    print(md_path.read_text())
    print(f"[bench] wrote {json_path} and {md_path}", file=sys.stderr)
    return ok


if __name__ == "__main__":
    sys.exit(main())
