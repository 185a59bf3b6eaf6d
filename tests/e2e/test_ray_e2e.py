"""End to end (issue 13): ``--ray`` on a local Ray cluster of two nodes (a
head and one more node process on this machine, one CPU each), with the real
engine and model: the replicas are Ray actors, one per node; one of them is
killed with SIGKILL mid-run and every id still ends exactly once; ``kill -9``
of the driver during a ``--ray`` run, then ``--resume``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.e2e.test_e2e import ROOT, SAMPLE, kill_9_then_resume, read_jsonl, write_jsonl

pytestmark = pytest.mark.e2e
ray = pytest.importorskip("ray", reason="the Ray tests need bulkinfer[ray] (make install has it)")

ROWS = 40

# Each replica's KV cache: 1 GiB holds these 40-row jobs; the CPU default (25% of memory) would take each replica
# ~10 s more to allocate. bulkinfer sizes it by itself only where the engines run on this machine (not a cluster's).
KV_CACHE = ["--kv-cache-memory-bytes", str(1 << 30)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A Ray cluster of two nodes on this machine, one CPU each: its address."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    try:
        yield str(nodes.address)
    finally:
        nodes.shutdown()


def replica_actors(_driver: int = 0) -> list[psutil.Process]:
    """The processes of the replicas' Ray actors (Ray titles them ``ray::ReplicaActor...``)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if " ".join(proc.info["cmdline"] or ()).startswith("ray::ReplicaActor"):
            found.append(proc)
    return found


def test_a_replica_killed_mid_run_hands_its_requests_to_the_other(tmp_path: Path, cluster: str) -> None:
    """SIGKILL of one replica's actor process once five rows are on disk: the
    run ends with exit 0, every id exactly once, and the report shows the
    death and the requests that went to the other replica."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, read_jsonl(SAMPLE / "sharegpt.jsonl")[:ROWS])
    flags = ["--max-tokens", "32", "--temperature", "0", "--plain-progress", "--max-in-flight", "8", *KV_CACHE]
    run = subprocess.Popen(
        [sys.executable, "-m", "bulkinfer", "run", str(src), "-o", str(out), "--ray", cluster, "-dp", "2", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    spool = tmp_path / ".out.jsonl.partial.jsonl"
    deadline = time.monotonic() + 600
    while not (spool.exists() and spool.read_bytes().count(b"\n") >= 5):
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before a replica could be killed"
        time.sleep(0.2)
    actors = replica_actors()
    assert len(actors) == 2, actors
    os.kill(actors[0].pid, signal.SIGKILL)
    stdout, stderr = run.communicate(timeout=600)

    assert run.returncode == 0, stderr[-3000:]
    assert "died" in stderr and "go to the others" in stderr, stderr[-3000:]
    ids = [row["id"] for row in read_jsonl(out)]
    assert sorted(ids) == sorted(row["id"] for row in read_jsonl(src))
    assert not read_jsonl(tmp_path / "out.errors.jsonl")
    report: dict[str, Any] = json.loads((tmp_path / "out.report.json").read_text())
    engine = report["engine"]
    assert engine["ray_address"] == cluster and engine["data_parallel_size"] == 2
    replicas = engine["replicas"]
    assert sum(r["deaths"] for r in replicas) == 1
    assert sum(r["requeued"] for r in replicas) >= 1
    assert sum(r["rows"] for r in replicas) == ROWS
    assert report["request_counts"]["completed"] == ROWS


def test_kill_9_of_the_driver_during_a_ray_run_then_resume(tmp_path: Path, cluster: str) -> None:
    """The driver killed: Ray ends its actors (their engines with them), and
    ``--resume`` on the same cluster finishes every id exactly once."""
    report = kill_9_then_resume(tmp_path, "--ray", cluster, *KV_CACHE, engines=replica_actors)
    assert report["engine"]["ray_address"] == cluster
