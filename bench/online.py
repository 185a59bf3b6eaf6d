"""Online requests under batch load: ``bulkinfer serve`` answering chat
requests while a 2,000-row batch runs on the same engine (issue 35).

One server (started fresh, warmed by a one-line batch), three phases in one
run, each ``--rounds`` times in turn:

- ``online``: online chat requests alone, open-loop at ``--rate`` per second
  (each in its own thread, so a slow answer never delays the next
  arrival), ``--online`` of them; each streamed with the official ``openai``
  client: time to first token (the first chunk with content) and total
  latency, from the moment the request is sent;
- ``batch``: the batch alone (the report's generation completion tokens/s);
- ``both``: the batch, and from the moment it is ``in_progress`` the same
  online requests at the same rate until it completes.

The batch: ``sample_data/sharegpt.jsonl``'s 300 prompts cycled to ``--rows``
OpenAI batch lines (each prompt tagged with its phase and line number, so
no two share more than the chat template's prefix, and the ``both`` phase's
batch finds nothing of the ``batch`` phase's in the prefix cache), ``max_tokens`` ``--batch-max-tokens``,
temperature 0. The online prompts: ``bench/data/newcomer100.jsonl``
(held-out ShareGPT questions), ``max_tokens`` ``--online-max-tokens``.

Goal (issue 35): p99 with the batch running at most 1.5x p99 alone, and the
batch's completion tokens/s with online traffic at least 0.8x alone.

Usage: ``python -m bench.online [--rows 2000] [--rate 0.5] [--online 40] [--rounds 1]``;
writes ``bench/results/online-latency.{json,md}``. One engine at a time (two cores).
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from bench.measure import machine, versions
from bench.serve import _finish, _free_port, _wait_up, chat_line, stop_server

ROOT = Path(__file__).resolve().parents[1]
BATCH_SOURCE = ROOT / "sample_data" / "sharegpt.jsonl"
ONLINE_SOURCE = ROOT / "bench" / "data" / "newcomer100.jsonl"


def batch_bytes(rows: int, max_tokens: int, salt: str) -> bytes:
    """The batch file; ``salt`` starts every prompt, so no batch finds another's prompts in the prefix cache."""
    prompts = [orjson.loads(line)["prompt"] for line in BATCH_SOURCE.read_bytes().splitlines() if line.strip()]
    return b"".join(
        chat_line(f"row-{i}", f"[{salt}-{i}] {prompts[i % len(prompts)]}", max_tokens) + b"\n" for i in range(rows)
    )


def online_prompts() -> list[str]:
    return [orjson.loads(line)["prompt"] for line in ONLINE_SOURCE.read_bytes().splitlines() if line.strip()]


def one_request(client: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat request: seconds to the first content chunk and to
    the end; or the HTTP status it was refused with (429 past ``--max-online``)."""
    import openai

    sent = time.monotonic()
    at = time.time()
    first = None
    tokens = 0
    try:
        stream = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    except openai.APIStatusError as exc:
        return {"status": exc.status_code, "sent_at": at}
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.monotonic() - sent
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total = time.monotonic() - sent
    return {
        "status": 200,
        "sent_at": at,
        "ttft_s": first if first is not None else total,
        "latency_s": total,
        "completion_tokens": tokens,
    }


def open_loop(client: Any, prompts: list[str], rate: float, max_tokens: int, until: Any) -> list[dict[str, Any]]:
    """Requests at ``rate`` per second (prompts in turn) until ``until()`` is true; their measurements."""
    results: list[dict[str, Any]] = []
    threads = []
    start = time.monotonic()
    k = 0
    while not until(k):
        time.sleep(max(0.0, start + k / rate - time.monotonic()))
        prompt = prompts[k % len(prompts)]
        thread = threading.Thread(target=lambda p=prompt: results.append(one_request(client, p, max_tokens)))
        thread.start()
        threads.append(thread)
        k += 1
    for thread in threads:
        thread.join()
    return results


def run_batch(client: Any, data: bytes, on_running: Any = None) -> dict[str, Any]:
    file = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status in ("validating",):
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    extra = on_running(batch.id) if on_running is not None else None
    batch = _finish(client, batch)
    if batch.status != "completed":
        raise SystemExit(f"the batch ended {batch.status}: {batch.errors}")
    return {"batch": batch, "online": extra}


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive") if len(ordered) > 1 else ordered * 99
    return {"p50": cuts[49], "p99": cuts[98], "max": ordered[-1], "n": len(ordered)}


def describe(online: list[dict[str, Any]]) -> dict[str, Any]:
    """Quantiles over the answered requests; ``refused``: how many got another status (429)."""
    refused = [r for r in online if r["status"] != 200]
    online = [r for r in online if r["status"] == 200]
    return {
        "requests": len(online),
        "refused": len(refused),
        "ttft_s": quantiles([r["ttft_s"] for r in online]),
        "latency_s": quantiles([r["latency_s"] for r in online]),
        "online_completion_tokens": sum(r["completion_tokens"] for r in online),
        "each": sorted(online + refused, key=lambda r: r["sent_at"]),
    }


def batch_rate(data_dir: Path, batch: Any) -> dict[str, Any]:
    report = orjson.loads((data_dir / "batches" / batch.id / "output.report.json").read_bytes())
    return {
        "generation_completion_tokens_per_s": report["throughput"]["completion_tokens_per_s"],
        "completion_tokens": report["tokens"]["completion"],
        "generate_s": report["seconds"].get("generate"),
        "wall_s": batch.completed_at - batch.in_progress_at,
        "in_progress_at": batch.in_progress_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=0.5, help="online requests per second")
    parser.add_argument("--online", type=int, default=40, help="online requests of the online-only phase")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch-max-tokens", type=int, default=32)
    parser.add_argument("--online-max-tokens", type=int, default=64)
    parser.add_argument("--config", type=Path, default=None, help="a bulkinfer config for the server (its engine)")
    parser.add_argument("--tag", default="", help="results file suffix: online-latency-TAG.{json,md}")
    parser.add_argument("--log", type=Path, default=None, help="keep the server's output (vLLM's log) in this file")
    parser.add_argument(
        "--serve-arg", action="append", default=[], metavar="ARG", help="one more argument of bulkinfer serve"
    )
    args = parser.parse_args()
    import openai

    prompts = online_prompts()
    phases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        port, data_dir = _free_port(), tmp / "data"
        with open(args.log or tmp / "serve.log", "wb") as log:
            server = subprocess.Popen(
                [
                    *(sys.executable, "-m", "bulkinfer", "serve", "--port", str(port), "--data-dir", str(data_dir)),
                    *(("--config", str(args.config)) if args.config else ()),
                    *args.serve_arg,
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_up(port, server, timeout=600)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0)
            run_batch(client, chat_line("warm", "Hi", 2) + b"\n")
            open_loop(client, prompts, args.rate, args.online_max_tokens, lambda k: k >= 4)  # warm the online path
            for round_ in range(1, args.rounds + 1):
                alone = open_loop(client, prompts, args.rate, args.online_max_tokens, lambda k: k >= args.online)
                phases.append({"round": round_, "phase": "online", **describe(alone)})
                print(f"bench.online: {phases[-1]}", file=sys.stderr)
                done = run_batch(client, batch_bytes(args.rows, args.batch_max_tokens, f"alone{round_}"))
                phases.append({"round": round_, "phase": "batch", **batch_rate(data_dir, done["batch"])})
                print(f"bench.online: {phases[-1]}", file=sys.stderr)

                def beside(batch_id: str) -> list[dict[str, Any]]:
                    running = lambda k: client.batches.retrieve(batch_id).status in ("in_progress",)  # noqa: E731
                    return open_loop(client, prompts, args.rate, args.online_max_tokens, lambda k: not running(k))

                both = run_batch(client, batch_bytes(args.rows, args.batch_max_tokens, f"both{round_}"), beside)
                phases.append(
                    {
                        "round": round_,
                        "phase": "both",
                        **batch_rate(data_dir, both["batch"]),
                        **describe(both["online"]),
                    }
                )
                print(f"bench.online: {phases[-1]}", file=sys.stderr)
        finally:
            stop_server(server)
    verdicts = []
    for round_ in range(1, args.rounds + 1):
        online, batch, both = (
            next(p for p in phases if p["round"] == round_ and p["phase"] == n) for n in ("online", "batch", "both")
        )
        verdicts.append(
            {
                "round": round_,
                "ttft_p99_ratio": both["ttft_s"]["p99"] / online["ttft_s"]["p99"],
                "latency_p99_ratio": both["latency_s"]["p99"] / online["latency_s"]["p99"],
                "batch_rate_ratio": both["generation_completion_tokens_per_s"]
                / batch["generation_completion_tokens_per_s"],
            }
        )
    result = {
        "command": "python -m bench.online " + " ".join(sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "settings": {
            **vars(args),
            "config": args.config.read_text() if args.config else None,
            "log": str(args.log) if args.log else None,
        },
        "phases": phases,
        "verdicts": verdicts,
        "goal": {"latency_p99_ratio_at_most": 1.5, "batch_rate_ratio_at_least": 0.8},
    }
    out = ROOT / "bench" / "results" / f"online-latency{'-' + args.tag if args.tag else ''}.json"
    out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    out.with_suffix(".md").write_text(markdown(result))
    print(out.with_suffix(".md").read_text())


def markdown(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["settings"]
    lines = [
        f"# Online requests under batch load ({result['date']})",
        "",
        f"`{result['command']}` on {m['cpu']} ({m.get('cpu_kind')}), {m['logical_cores']} cores, "
        f"{m['memory_bytes'] / 2**30:.1f} GiB; vLLM {result['versions']['vllm']}.",
        f"Batch: {s['rows']} ShareGPT rows, max_tokens {s['batch_max_tokens']}. Online: streamed chat requests at "
        f"{s['rate']}/s, max_tokens {s['online_max_tokens']} (held-out ShareGPT questions).",
        "",
        "| round | phase | answered | refused | TTFT p50 s | TTFT p99 s | lat. p50 s | lat. p99 s | batch tok/s |",
        "|--:|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for p in result["phases"]:
        ttft, lat = p.get("ttft_s"), p.get("latency_s")
        cells = [
            str(p["round"]),
            p["phase"],
            str(p.get("requests", "")),
            str(p.get("refused", "")),
            f"{ttft['p50']:.2f}" if ttft else "",
            f"{ttft['p99']:.2f}" if ttft else "",
            f"{lat['p50']:.2f}" if lat else "",
            f"{lat['p99']:.2f}" if lat else "",
            f"{p['generation_completion_tokens_per_s']:.1f}" if "generation_completion_tokens_per_s" in p else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| round | TTFT p99 both/alone | latency p99 both/alone (goal <= 1.5) | batch tok/s both/alone (goal >= 0.8) |",
        "|--:|--:|--:|--:|",
    ]
    for v in result["verdicts"]:
        lines.append(
            f"| {v['round']} | {v['ttft_p99_ratio']:.2f} | {v['latency_p99_ratio']:.2f} | {v['batch_rate_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
