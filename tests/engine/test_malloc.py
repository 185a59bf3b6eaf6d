"""The console script restarts itself once under glibc malloc tunables
(bulkinfer.engine.malloc): every tunable added, the user's own kept, the same
PID, and never for help or the version; an engine in bulkinfer's process
starts without transparent huge pages and its steps get them again, one in
child processes runs without them; the tokenizer loads, and vLLM is imported,
without them."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bulkinfer.engine import malloc

ALL = ":".join(f"{name}={value}" for name, value in malloc.TUNABLES)


@pytest.fixture(autouse=True)
def _on_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc, "glibc", lambda: True)


def test_every_tunable_is_added_to_an_environment_without_any() -> None:
    env = malloc.tuned_environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": ALL}
    assert "glibc.malloc.mmap_threshold=33554432" in ALL  # 32 MiB, glibc's ceiling for the threshold
    assert "glibc.malloc.hugetlb=1" in ALL


def test_a_tunable_the_user_set_keeps_its_value_and_theirs_stay_first() -> None:
    mine = "glibc.malloc.mmap_threshold=1048576:glibc.cpu.x86_rep_movsb_threshold=4096"
    env = malloc.tuned_environment({"GLIBC_TUNABLES": mine})
    assert env is not None
    items = env["GLIBC_TUNABLES"].split(":")
    assert items[:2] == mine.split(":")
    assert [i for i in items if i.startswith("glibc.malloc.mmap_threshold=")] == ["glibc.malloc.mmap_threshold=1048576"]
    assert {i.partition("=")[0] for i in items} >= {name for name, _ in malloc.TUNABLES}


@pytest.mark.parametrize(
    "environ",
    [{"GLIBC_TUNABLES": ALL}, {"BULKINFER_MALLOC_TUNABLES": "0"}],
    ids=["all-set", "switched-off"],
)
def test_nothing_to_add(environ: dict[str, str]) -> None:
    assert malloc.tuned_environment(environ) is None


def test_nothing_is_added_where_the_c_library_is_not_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc, "glibc", lambda: False)
    assert malloc.tuned_environment({}) is None


PROBE = """
import os, sys
from bulkinfer.engine import malloc
sys.stderr.write(f"PID={os.getpid()} TUNABLES={os.environ.get('GLIBC_TUNABLES')}\\n")
sys.stderr.flush()
malloc.restart_tuned(["bulkinfer", *sys.argv[1:]])
sys.stderr.write("RAN\\n")
"""


def _probe(tmp_path: Path, *args: str, **env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", malloc.SWITCH)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env={**base, **env}, check=True
    )
    return proc.stderr.splitlines()


@pytest.mark.skipif(not malloc.glibc(), reason="the restart happens on glibc only")
def test_a_command_restarts_once_with_the_same_pid_and_every_tunable(tmp_path: Path) -> None:
    first, second, ran = _probe(tmp_path, "run", "in.jsonl")
    assert first.endswith("TUNABLES=None")
    assert second == f"{first.split()[0]} TUNABLES={ALL}"  # the same process, exec'd once
    assert ran == "RAN"


@pytest.mark.parametrize("args", [(), ("--help",), ("run", "-h"), ("--version",)])
def test_help_and_the_version_answer_without_a_restart(tmp_path: Path, args: tuple[str, ...]) -> None:
    lines = _probe(tmp_path, *args)
    assert lines[0].endswith("TUNABLES=None") and lines[1:] == ["RAN"]


def test_the_switch_keeps_glibcs_defaults(tmp_path: Path) -> None:
    lines = _probe(tmp_path, "run", "in.jsonl", BULKINFER_MALLOC_TUNABLES="0")
    assert lines[0].endswith("TUNABLES=None") and lines[1:] == ["RAN"]


def _thp_enabled() -> str | None:
    """``THP_enabled`` of /proc/self/status ("1" or "0"), None where the kernel has no such line."""
    for line in Path("/proc/self/status").read_text().splitlines() if sys.platform == "linux" else ():
        if line.startswith("THP_enabled:"):
            return line.split()[1]
    return None


def _huge_kib(buffer: mmap.mmap) -> int:
    """``AnonHugePages`` (KiB) of the mapping that holds ``buffer`` (/proc/self/smaps)."""
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            found = low <= start < high
        elif found and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError("mapping not found")


def _touched_madvised(size: int = 16 << 20) -> mmap.mmap:
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    for offset in range(0, size, 4096):
        buffer[offset] = 1
    return buffer


def _child_thp_enabled() -> str:
    """``THP_enabled`` of a child interpreter started now."""
    code = "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('THP_enabled:')))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(_thp_enabled() is None, reason="a kernel that reports THP_enabled (Linux)")
def test_an_engine_in_this_process_starts_without_huge_pages_and_the_steps_get_them_again() -> None:
    before = _thp_enabled()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    offered = thp.exists() and "[never]" not in thp.read_text()
    with malloc.huge_pages_paused(False) as paused:
        assert paused and _thp_enabled() == "0"
        during = _touched_madvised()
        assert _huge_kib(during) == 0  # 4 KiB pages though malloc (here: we) asked for huge ones
        # an engine in vLLM's processes, spawned now, runs without them for its life
        assert _child_thp_enabled() == "0"
    assert _thp_enabled() == before == "1"
    assert _child_thp_enabled() == "1"
    if offered:  # the kernel's own setting again: madvise or always gives this mapping huge pages
        after = _touched_madvised()
        assert _huge_kib(after) > 0
        after.close()
    during.close()


@pytest.mark.skipif(_thp_enabled() is None, reason="a kernel that reports THP_enabled (Linux)")
def test_a_pause_inside_a_pause_leaves_the_outer_one_in_place() -> None:
    with malloc.no_huge_pages() as outer:
        with malloc.no_huge_pages() as inner:
            assert outer and inner and _thp_enabled() == "0"
        assert _thp_enabled() == "0"  # the inner block ended; the outer pause holds
    assert _thp_enabled() == "1"
    with malloc.no_huge_pages(active=False) as paused:
        assert not paused and _thp_enabled() == "1"


@pytest.mark.parametrize("wanted", [True, None])
def test_huge_pages_stay_unless_the_setting_pauses_them(wanted: bool | None) -> None:
    before = _thp_enabled()
    with malloc.huge_pages_paused(wanted) as paused:
        assert not paused and _thp_enabled() == before
    assert malloc.reported(paused)["huge_pages_paused_at_start"] is False


def _sysfs(tmp_path: Path, thp: str, features: str | None) -> Path:
    (tmp_path / "kernel/mm/transparent_hugepage").mkdir(parents=True)
    (tmp_path / "kernel/mm/transparent_hugepage/enabled").write_text(thp)
    if features is not None:
        (tmp_path / "bus/virtio/drivers/virtio_balloon/virtio0").mkdir(parents=True)
        (tmp_path / "bus/virtio/drivers/virtio_balloon/virtio0/features").write_text(features + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("thp", "features", "expected"),
    [
        # a Firecracker guest's balloon (this machine's sysfs, 2026-12-05): stats, deflate on OOM, free page reporting
        ("always [madvise] never", "0110010100000000000000000000000010000000", malloc.REPORTING_FAULT_S_PER_GIB),
        ("always [madvise] never", "0110000100000000000000000000000010000000", 0.0),  # a balloon that does not report
        ("[always] madvise never", None, 0.0),  # no balloon: fresh memory is the machine's own
        ("always madvise [never]", "0110010100000000000000000000000010000000", None),  # no huge pages to pause
    ],
)
def test_huge_pages_cost_the_start_where_a_balloon_reports_free_pages_to_the_host(
    tmp_path: Path, thp: str, features: str | None, expected: float | None
) -> None:
    assert malloc.huge_page_fault_s_per_gib(_sysfs(tmp_path, thp, features)) == expected


@pytest.mark.skipif(_thp_enabled() is None, reason="a kernel that reports THP_enabled (Linux)")
def test_vllm_is_imported_without_huge_pages_and_a_second_call_pauses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import_vllm`` imports vLLM (here a stand-in, which notes THP_enabled
    as each of its modules is imported) with huge pages paused: since the
    tokenizer's load no longer imports torch, vLLM's import is where torch's
    and transformers' heap is faulted in. Called again (a replica's thread),
    it pauses nothing."""
    import importlib.abc
    import importlib.util
    from types import ModuleType

    from bulkinfer.engine import args

    seen: list[tuple[str, str | None]] = []

    class StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
            if name.split(".")[0] != "vllm":
                return None
            return importlib.util.spec_from_loader(name, self, is_package=True)

        def exec_module(self, module: ModuleType) -> None:
            seen.append((module.__name__, _thp_enabled()))
            for name in ("EngineArgs", "LLMEngine", "PoolingParams", "SamplingParams", "RequestOutputKind"):
                setattr(module, name, object)
            module.UsageContext = object  # type: ignore[attr-defined]

    real = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "vllm"}
    pauses: list[bool] = []
    pause = malloc.no_huge_pages

    def recorded(active: bool = True) -> object:
        pauses.append(active)
        return pause(active)

    monkeypatch.setattr(malloc, "no_huge_pages", recorded)
    monkeypatch.setattr(args, "configure_environment", lambda: None)
    monkeypatch.setattr(sys, "meta_path", [StandIn(), *sys.meta_path])
    try:
        for name in real:
            del sys.modules[name]
        args.import_vllm()
        args.import_vllm()
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] == "vllm"]:
            del sys.modules[name]
        sys.modules.update(real)
    assert [name for name, _ in seen] == ["vllm", "vllm.sampling_params", "vllm.usage", "vllm.usage.usage_lib"]
    assert {thp for _, thp in seen} == {"0"}
    assert pauses == [True, False]
    assert _thp_enabled() == "1"
