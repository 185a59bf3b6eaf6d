"""A batch through ``bulkinfer serve`` vs ``bulkinfer run`` on the same file.

The file: the first N rows (default 300) of ``sample_data/sharegpt.jsonl``
as OpenAI batch lines (``/v1/chat/completions``, ``max_tokens`` 128,
temperature 0), which both systems read. Alternating, ``--rounds`` times:

- ``run``: ``bulkinfer run FILE -o OUT`` in a fresh process: its wall time
  includes the engine start (the report's ``seconds.load``);
- ``serve``: ``bulkinfer serve`` (127.0.0.1, no key) started fresh, warmed
  by a one-line batch (the engine loads once per server), then the file
  uploaded with the official ``openai`` client and timed from
  ``batches.create`` to ``completed`` (validation, the run, finalizing;
  status polled every 0.2 s), and the server stopped with SIGTERM.

Per run: the report's generation throughput (completion tokens/s of the
generate phase: the same core in both), and the completion tokens over the
wall seconds a user waits: the whole process for ``run``, create ->
completed for ``serve``; ``run`` also without its engine start. Ratios are
serve / run of the same round.

Usage: ``python -m bench.serve [--rounds 2] [--rows 300]``; writes
``bench/results/serve.{json,md}``. One engine at a time (two cores).
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.measure import machine, versions

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "sample_data" / "sharegpt.jsonl"
MAX_TOKENS = 128


def batch_file(rows: int, path: Path) -> int:
    """Write the first ``rows`` ShareGPT prompts as OpenAI batch lines; the count."""
    lines = []
    for raw in SOURCE.read_bytes().splitlines()[:rows]:
        row = orjson.loads(raw)
        lines.append(chat_line(row["id"], row["prompt"], MAX_TOKENS))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return len(lines)


def chat_line(custom_id: str, content: str, max_tokens: int) -> bytes:
    """One OpenAI batch line: a chat request, temperature 0."""
    messages = [{"role": "user", "content": content}]
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def run_once(source: Path, tmp: Path) -> dict[str, Any]:
    """``bulkinfer run`` of ``source``: wall seconds and report."""
    out = tmp / "run" / "out.jsonl"
    cmd = [sys.executable, "-m", "bulkinfer", "run", str(source), "-o", str(out), "--overwrite", "--plain-progress"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"bulkinfer run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    report = orjson.loads(out.with_name("out.report.json").read_bytes())
    return {"wall_s": wall, "report": report, "lines": _lines(out)}


def serve_once(source: Path, tmp: Path) -> dict[str, Any]:
    """A fresh ``bulkinfer serve``, warmed; ``source`` as one batch: create -> completed seconds and report."""
    import openai

    port = _free_port()
    data = tmp / "serve-data"
    with open(tmp / "serve.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "bulkinfer", "serve", "--port", str(port), "--data-dir", str(data)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_up(port, server)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0)
        _finish(client, _create(client, chat_line("warm", "Hi", 2) + b"\n"))
        file = client.files.create(file=("bench.jsonl", io.BytesIO(source.read_bytes())), purpose="batch")
        start = time.monotonic()
        batch = _finish(
            client,
            client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"),
        )
        wall = time.monotonic() - start
        if batch.status != "completed":
            raise SystemExit(f"the batch ended {batch.status}: {batch.errors}")
        out = data / "batches" / batch.id / "output.jsonl"
        return {
            "wall_s": wall,
            "report": orjson.loads(out.with_name("output.report.json").read_bytes()),
            "lines": _lines(out),
        }
    finally:
        stop_server(server)


def stop_server(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 120 s."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _create(client: Any, data: bytes) -> Any:
    file = client.files.create(file=("warm.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")


def _finish(client: Any, batch: Any) -> Any:
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    return batch


def _wait_up(port: int, server: subprocess.Popen[bytes], timeout: float = 600) -> None:
    """Until ``/health`` is 200: the server's engine is ready (it starts with the server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # 503 while the engine starts, or no answer yet
    raise SystemExit("bulkinfer serve did not start")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _lines(path: Path) -> int:
    return sum(1 for line in path.read_bytes().splitlines() if line.strip())


def summary(system: str, measured: dict[str, Any]) -> dict[str, Any]:
    report = measured["report"]
    completion = report["tokens"]["completion"]
    out = {
        "system": system,
        "rows_out": measured["lines"],
        "completion_tokens": completion,
        "generation_completion_tokens_per_s": report["throughput"]["completion_tokens_per_s"],
        "wall_s": measured["wall_s"],
        "completion_tokens_per_wall_s": completion / measured["wall_s"],
    }
    if system == "run":
        without_load = measured["wall_s"] - report["seconds"]["load"]
        out |= {
            "engine_load_s": report["seconds"]["load"],
            "completion_tokens_per_wall_s_without_load": completion / without_load,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=300)
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        source = tmp / "batch.jsonl"
        rows = batch_file(args.rows, source)
        for round_ in range(1, args.rounds + 1):
            for system, once in (("run", run_once), ("serve", serve_once)):
                work = tmp / f"{system}-{round_}"
                work.mkdir()
                results.append({"round": round_, **summary(system, once(source, work))})
                print(f"bench.serve: round {round_}: {results[-1]}", file=sys.stderr)
    ratios = []
    for round_ in range(1, args.rounds + 1):
        run, serve = (next(r for r in results if r["round"] == round_ and r["system"] == s) for s in ("run", "serve"))
        ratios.append(
            {
                "round": round_,
                "generation": serve["generation_completion_tokens_per_s"] / run["generation_completion_tokens_per_s"],
                "wall": serve["completion_tokens_per_wall_s"] / run["completion_tokens_per_wall_s"],
                "wall_without_load": serve["completion_tokens_per_wall_s"]
                / run["completion_tokens_per_wall_s_without_load"],
            }
        )
    data = {
        "command": f"python -m bench.serve --rounds {args.rounds} --rows {args.rows}",
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "versions": versions(),
        "rows": rows,
        "max_tokens": MAX_TOKENS,
        "results": results,
        "ratios": ratios,
    }
    out = ROOT / "bench" / "results" / "serve.json"
    out.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    out.with_suffix(".md").write_text(markdown(data))
    print(f"bench.serve: wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)


def markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        f"# A batch through bulkinfer serve vs bulkinfer run ({data['date']}; {m['cpu']}, {m['logical_cores']} cores)",
        "",
        f"Command: `{data['command']}`; {data['rows']} ShareGPT rows as OpenAI chat lines, "
        f"max_tokens {data['max_tokens']}, temperature 0.",
        "",
        "| round | system | rows out | completion tokens | generation completion tok/s | wall s "
        "| completion tok per wall s | engine load s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["results"]:
        load = f"{r['engine_load_s']:.1f}" if "engine_load_s" in r else "- (warm)"
        lines.append(
            f"| {r['round']} | {r['system']} | {r['rows_out']} | {r['completion_tokens']} | "
            f"{r['generation_completion_tokens_per_s']:.1f} | {r['wall_s']:.1f} | "
            f"{r['completion_tokens_per_wall_s']:.1f} | {load} |"
        )
    lines += ["", "serve / run, per round:", ""]
    for r in data["ratios"]:
        lines.append(
            f"- round {r['round']}: generation {r['generation']:.2f}x; per wall second {r['wall']:.2f}x "
            f"(run with its engine start), {r['wall_without_load']:.2f}x (run without it)"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
