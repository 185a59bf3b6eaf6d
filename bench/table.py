"""The markdown page of one `bench.compare` run, rendered from its JSON results."""

from __future__ import annotations

from typing import Any

GiB = 1024**3


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "—" if x is None else format(x, fmt)


def _rate(tp: dict[str, float] | None, key: str) -> str:
    return "—" if tp is None else f"{tp[key]:.1f}" if key != "requests_per_s" else f"{tp[key]:.3f}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _padding(p: dict[str, Any] | None) -> str:
    if not p:
        return "—"
    if p.get("static"):
        return f"prompt {_pct(p['prompt'])}, completion {_pct(p['completion'])} ({p['batches']} batches)"
    return f"plan B={p['batch_size']}: arrival {_pct(p['arrival'])}, sorted {_pct(p['sorted'])}"


def _hits(cache: dict[str, Any] | None) -> str:
    """Prompt tokens served from vLLM's prefix cache: share and count (— where not known)."""
    return "—" if not cache else f"{_pct(cache['hit_rate'])} ({cache['cached_tokens']})"


def _ratio(r: dict[str, Any]) -> str:
    ratio = r.get("ratio")
    if not ratio:
        return "—"
    gen, e2e = ratio["generate"], ratio["end_to_end"]
    return f"{_num(gen, '.2f')} / {_num(e2e, '.2f')} (vs {ratio['reference']})"


def _rss(r: dict[str, Any]) -> str:
    if r["peak_rss_bytes"] is None:
        return "(in b)"
    return f"{r['peak_rss_bytes'] / GiB:.2f} / {r['peak_rss_largest_process_bytes'] / GiB:.2f}"


def _headline(results: list[dict[str, Any]]) -> list[str]:
    """bulkinfer (its first run) against raw vLLM and the static baseline in
    arrival order, in completion tokens/s."""
    by_key = {r["key"]: r for r in results if "error" not in r}
    a = next((r for r in results if r["key"].startswith("a-") and "error" not in r), None)
    if a is None:
        return []
    out = []
    b = by_key.get("b")
    if b is not None:
        gen = a["throughput_generate"]["completion_tokens_per_s"] / b["throughput_generate"]["completion_tokens_per_s"]
        out.append(f"- bulkinfer (`{a['key']}`) generation: {gen:.2f}x raw vLLM's (`b`).")
    d = by_key.get("d-arrival")
    if d is not None:
        e2e = (
            a["throughput_end_to_end"]["completion_tokens_per_s"] / d["throughput_generate"]["completion_tokens_per_s"]
        )
        out.append(
            f"- bulkinfer end to end (model load included): {e2e:.1f}x the completion tokens/s of transformers "
            f"static batches in arrival order (`d-arrival`, generation only, on its {d['rows']} rows)."
        )
    return ["", *out] if out else []


def _orders(summary: dict[str, Any] | None) -> list[str]:
    """bulkinfer's feed orders side by side (only when more than one order or run)."""
    if not summary:
        return []
    by_order = summary["completion_tokens_per_s_generate"]
    if len(by_order) == 1 and all(len(v["runs"]) == 1 for v in by_order.values()):
        return []
    lines = [
        "",
        "bulkinfer by feed order, generation completion tokens/s:",
        "",
        "| order | runs | mean | min | max |",
        "|---|---|--:|--:|--:|",
    ]
    for order, v in by_order.items():
        runs = ", ".join(f"{x:.1f}" for x in v["runs"])
        best = " (best mean)" if order == summary["best"] else ""
        lines.append(f"| {order}{best} | {runs} | {v['mean']:.1f} | {v['min']:.1f} | {v['max']:.1f} |")
    best = by_order[summary["best"]]
    others = [v for order, v in by_order.items() if order != summary["best"]]
    spread = max((v["max"] - v["min"]) / v["mean"] for v in by_order.values())
    if others and best["min"] <= max(v["max"] for v in others):
        lines += [
            "",
            f"No order is measurably best: the slowest run of {summary['best']} ({best['min']:.1f}) is slower than "
            f"the fastest run of another order; run-to-run spread is up to {100 * spread:.1f}% of the mean.",
        ]
    return lines


def _engine(s: dict[str, Any]) -> str:
    if s.get("engine") == "defaults":
        return (
            f"each system with its own engine defaults: bulkinfer `--seed {s['seed']}` only; raw vLLM `b` "
            "the dtype and KV cache size bulkinfer ran and the seed; `e` that KV cache size and the seed (vLLM's "
            "CPU default KV cache, 92% of memory, does not start here); what each resolved: the `engine` of each "
            "result in the JSON"
        )
    return (
        f"dtype {s['dtype']}, enforce_eager {s['enforce_eager']}, "
        f"kv_cache_memory_bytes {s['kv_cache_memory_bytes']}, seed {s['seed']}"
    )


def _systems(summary: dict[str, Any] | None) -> list[str]:
    """Each system's runs side by side, and bulkinfer's mean over the others' (only with repeats)."""
    if not summary or all(len(v["runs"]) == 1 for v in summary["completion_tokens_per_s_generate"].values()):
        return []
    lines = [
        "",
        "Generation completion tokens/s by system, over its runs (alternating):",
        "",
        "| system | runs | mean | min | max | spread (max-min)/mean |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for group, v in summary["completion_tokens_per_s_generate"].items():
        runs = ", ".join(f"{x:.1f}" for x in v["runs"])
        spread = (v["max"] - v["min"]) / v["mean"]
        lines.append(f"| {group} | {runs} | {v['mean']:.1f} | {v['min']:.1f} | {v['max']:.1f} | {100 * spread:.1f}% |")
    lines.append("")
    for feed, ratios in summary["ratios_of_means"].items():
        parts = [f"{x:.2f}x {ref}'s" for ref, x in ratios.items()]
        if parts:
            lines.append(f"- bulkinfer ({feed}), mean over mean: {', '.join(parts)}.")
    return lines


# Threads named in a run's CPU line at most (the rest summed as "others").
CPU_THREADS_SHOWN = 6


def _cpu(results: list[dict[str, Any]]) -> list[str]:
    """What bulkinfer's own thread took during generation (its report's
    ``cpu_seconds``), and every system's CPU by thread where it was read
    (bulkinfer's ``cpu_seconds.threads``, raw vLLM's ``cpu_threads``)."""
    lines = []
    for r in results:
        cpu, generate = r.get("bulkinfer_cpu_seconds"), r.get("seconds", {}).get("generate")
        if cpu and generate:
            lines.append(
                f"- `{r['key']}` CPU during generation: bulkinfer's feed thread {cpu['feed_thread']:.1f} s "
                f"({cpu['feed_thread'] / generate:.1%} of a core), its whole process {cpu['process']:.1f} s "
                f"({cpu['process'] / generate:.2f} cores)."
            )
        by_thread = (cpu or {}).get("threads") or r.get("cpu_threads")
        if by_thread and generate:
            shown = [
                f"{t['process']}/{t['thread']}"
                + (f" x{t['threads']}" if t["threads"] > 1 else "")
                + f" {t['seconds']:.2f} s ({t['seconds'] / generate:.2%})"
                for t in by_thread[:CPU_THREADS_SHOWN]
            ]
            rest = sum(t["seconds"] for t in by_thread[CPU_THREADS_SHOWN:])
            shown += [f"others {rest:.2f} s ({rest / generate:.2%})"] if rest else []
            lines.append(f"- `{r['key']}` CPU by thread during generation (share of a core): {'; '.join(shown)}.")
    return ["", *lines] if lines else []


def render(doc: dict[str, Any]) -> str:
    """Title, machine and settings, the results table, and what the columns mean."""
    w, m, v, s = doc["workload"], doc["machine"], doc["versions"], doc["settings"]
    gpus = ", ".join(m["gpus"]) or "none"
    lines = [
        f"# bench.compare: {w['name']}, {w['rows']} rows ({doc['created']})",
        "",
        f"- Machine: {m['cpu']}, {m['logical_cores']} logical / {m['physical_cores']} physical cores, "
        f"{m['memory_bytes'] / GiB:.1f} GiB, GPU: {gpus}; load average before the run "
        f"{', '.join(f'{x:.2f}' for x in doc['loadavg_before'])}",
        f"- Versions: vllm {v['vllm']}, torch {v['torch']}, transformers {v['transformers']}, python {m['python']}",
        f"- Model: `{s['model']}`; {_engine(s)}; temperature {s['temperature']}, top_p {s['top_p']}, ignore_eos",
        f"- Workload: {w['description']}. Prompt tokens {w['prompt_tokens']} "
        f"(min/mean/max {'/'.join(f'{x:.0f}' for x in w['prompt_tokens_min_mean_max'])}), "
        f"completion tokens {w['completion_tokens']} "
        f"(min/mean/max {'/'.join(f'{x:.0f}' for x in w['completion_tokens_min_mean_max'])})",
        *(
            [f"- Static baseline (d): {w['hf_subset']}"]
            if any(r["key"].startswith("d-") for r in doc["results"])
            else []
        ),
        f"- Command: `{doc['command']}`" + (f" ({doc['wall_s'] / 60:.1f} min in all)" if doc.get("wall_s") else ""),
        "",
        "| system | rows | completion tokens | generate s | gen. completion tok/s | gen. total tok/s | gen. req/s "
        "| end-to-end s (incl. load) | e2e completion tok/s | e2e total tok/s | e2e req/s "
        "| peak RSS GiB (tree / largest process) | padding efficiency | prefix cache hits "
        "| ratio to reference, gen. / e2e |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|---|",
    ]
    for r in doc["results"]:
        if "error" in r:
            lines.append(f"| `{r['key']}` failed: {r['error'].splitlines()[0]} |" + " |" * 14)
            continue
        gen, e2e = r["throughput_generate"], r["throughput_end_to_end"]
        full = "" if r["rows_full_length"] == r["rows"] else f" ({r['rows_full_length']} full length)"
        lines.append(
            f"| `{r['key']}` {r['system']} | {r['rows']} | {r['completion_tokens']}{full} "
            f"| {_num(r['seconds']['generate'])} | {_rate(gen, 'completion_tokens_per_s')} "
            f"| {_rate(gen, 'total_tokens_per_s')} | {_rate(gen, 'requests_per_s')} "
            f"| {_num(r['seconds']['end_to_end'])} | {_rate(e2e, 'completion_tokens_per_s')} "
            f"| {_rate(e2e, 'total_tokens_per_s')} | {_rate(e2e, 'requests_per_s')} "
            f"| {_rss(r)} | {_padding(r['padding_efficiency'])} | {_hits(r.get('prefix_cache'))} | {_ratio(r)} |"
        )
    lines += _headline(doc["results"])
    if doc.get("recomputed"):
        lines += ["", f"Recomputed: {doc['recomputed']}."]
    lines += _orders(doc.get("orders"))
    lines += _systems(doc.get("systems"))
    lines += _cpu(doc["results"])
    if not doc.get("complete", True):
        lines += ["", "**Incomplete**: the run stopped (or is still going) before its last system."]
    lines += ["", *(f"- {note}" for note in doc["notes"]), ""]
    return "\n".join(lines)
