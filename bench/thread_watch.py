"""CPU seconds by thread of a running process tree, sampled from outside:
what took the cores from an engine's compute threads while it generated,
for a process that cannot report it itself (raw vLLM before
``bench.workers`` read its threads; a ``bulkinfer run`` before its report's
``cpu_seconds.threads``).

    python -m bench.thread_watch watch PID OUT.jsonl
    python -m bench.thread_watch window OUT.jsonl GENERATE_S [--tail-s S] [--trim-s S]

``watch``: every 2 s until PID exits, one JSONL line: the time and every
thread of PID and its descendants (``/proc/PID/task/TID/stat``, proc(5):
kernel name, utime + stime in clock ticks as seconds). ``window``: the CPU
seconds of each thread over the generation window, taken as the
``GENERATE_S`` seconds that ended ``--tail-s`` seconds (the report's
``seconds.write`` and the exit; default 1) before the last sample, less
``--trim-s`` (default 4) at each end: threads of one name in one process
summed (a thread of :data:`BUSY_S` or more alone), the share of a core
each, most first (``P`` marks a process's main thread).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bulkinfer.report.threads import snapshot

INTERVAL_S = 2.0


# A thread that used this many CPU seconds in the window is shown alone (an engine's compute threads), the others
# summed by name and process.
BUSY_S = 5.0


def sample(root: int) -> dict[str, tuple[str, float]]:
    """``"PID/TID"`` -> (kernel name, CPU seconds so far) for every thread of ``root``'s tree."""
    return {f"{pid}/{tid}": (thread, seconds) for (pid, tid), (_, thread, seconds) in snapshot(root=root).items()}


def watch(pid: int, out: Path) -> None:
    with out.open("w") as f:
        while os.path.exists(f"/proc/{pid}"):
            f.write(json.dumps({"t": time.time(), "threads": sample(pid)}) + "\n")
            f.flush()
            time.sleep(INTERVAL_S)


def window(
    samples: list[dict[str, Any]], generate_s: float, tail_s: float, trim_s: float
) -> tuple[float, Counter[str]]:
    """(seconds between the two samples used, CPU seconds by ``[P]name x count``)."""
    end = samples[-1]["t"] - tail_s
    t0, t1 = end - generate_s + trim_s, end - trim_s
    a = min(samples, key=lambda s: abs(s["t"] - t0))
    b = min(samples, key=lambda s: abs(s["t"] - t1))
    used: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for key, (name, cpu) in b["threads"].items():
        pid, tid = key.split("/")
        spent = cpu - a["threads"].get(key, [name, 0.0])[1]
        label = ("P" if pid == tid else "") + name + f" (pid {pid}" + (f", tid {tid})" if spent >= BUSY_S else ")")
        used[label] += spent
        count[label] += 1
    return b["t"] - a["t"], Counter({f"{k} x{count[k]}" if count[k] > 1 else k: v for k, v in used.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("watch")
    w.add_argument("pid", type=int)
    w.add_argument("out", type=Path)
    s = sub.add_parser("window")
    s.add_argument("samples", type=Path)
    s.add_argument("generate_s", type=float)
    s.add_argument("--tail-s", type=float, default=1.0)
    s.add_argument("--trim-s", type=float, default=4.0)
    args = parser.parse_args()
    if args.command == "watch":
        watch(args.pid, args.out)
        return
    samples = [json.loads(line) for line in args.samples.read_text().splitlines() if line.strip()]
    seconds, used = window(samples, args.generate_s, args.tail_s, args.trim_s)
    total = sum(used.values())
    print(f"{args.samples.name}: {seconds:.1f} s of generation, {total:.1f} CPU s ({total / seconds:.3f} cores)")
    for label, cpu in used.most_common():
        if cpu >= 0.05:
            print(f"  {cpu:8.2f} s {cpu / seconds:7.2%}  {label}")


if __name__ == "__main__":
    main()
