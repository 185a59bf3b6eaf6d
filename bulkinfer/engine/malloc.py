"""glibc malloc tunables for a process that runs a CPU engine: the
``GLIBC_TUNABLES`` the ``bulkinfer`` console script restarts itself with
(:func:`restart_tuned`), before it imports anything heavy.

Why: every engine step allocates and frees its activations and logits (at
200 running rows the sampler's float32 logits alone are 200 x 49,152 x 4 =
39 MB). glibc serves a block above its mmap threshold (128 KiB, adjusting
itself up to 32 MiB) with a fresh ``mmap`` and hands a freed heap top over
its trim threshold back to the kernel, so each step faults the same memory
in again, page by zeroed page. Raw vLLM ``LLM.generate`` of 200 ShareGPT
prompts x 256 tokens (bfloat16, eager, Intel Xeon family 6 model 167, 2
cores; ``python -m bench.malloc``, ``bench/results/malloc-xeon-m167.md``)
took 2.9-3.3 M minor page faults and 6.2-6.9 s of system time in 43-44 s;
with :data:`TUNABLES` about 0.1 M faults and 3.5-3.8 s, and 1.05x the
completion tokens/s; ``bulkinfer run`` of ShareGPT-200 1.06x (README,
Engine settings).

The tunables (glibc manual, "Memory Allocation Tunables"; glibc >= 2.35 for
``hugetlb``, which older glibc ignores as it ignores any name it lacks):

- ``glibc.malloc.mmap_threshold`` 32 MiB (glibc's ceiling): blocks up to
  32 MiB come from the heap, kept between steps.
- ``glibc.malloc.trim_threshold`` 256 MiB, ``glibc.malloc.top_pad`` 64
  MiB: the heap keeps what a step freed and grows in larger pieces.
- ``glibc.malloc.hugetlb`` 1: malloc asks for transparent huge pages
  (``madvise(MADV_HUGEPAGE)``) on its heap and its mmapped blocks (the
  KV cache, blocks over 32 MiB): 2 MiB faults instead of 4 KiB ones, and
  fewer TLB misses. Without THP (``/sys/kernel/mm/transparent_hugepage``
  ``never``) it does nothing.

A tunable the environment already sets is left as it is;
``BULKINFER_MALLOC_TUNABLES=0`` leaves glibc's defaults. Only the console
script restarts: the Python API touches no process-wide state, so a caller
sets ``GLIBC_TUNABLES`` before its interpreter starts (the value
:func:`tuned_environment` gives). Child processes (vLLM's engine cores,
replicas) inherit the environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

TUNABLES: tuple[tuple[str, str], ...] = (
    ("glibc.malloc.hugetlb", "1"),
    ("glibc.malloc.mmap_threshold", str(32 << 20)),
    ("glibc.malloc.trim_threshold", str(256 << 20)),
    ("glibc.malloc.top_pad", str(64 << 20)),
)
SWITCH = "BULKINFER_MALLOC_TUNABLES"  # "0": leave glibc's defaults
# <linux/prctl.h>: PR_SET_THP_DISABLE (Linux >= 3.15), arg2 1: no transparent huge page for this process's new faults.
PR_SET_THP_DISABLE = 41
PR_GET_THP_DISABLE = 42  # returns the flag (0 or 1)
# <linux/virtio_balloon.h>: VIRTIO_BALLOON_F_REPORTING, the bit of sysfs's virtio "features" string (bit 0 first).
BALLOON_F_REPORTING = 5
# What a KV cache's start costs in huge pages over 4 KiB pages under free page reporting (s/GiB): an engine with a
# 6 GiB cache started 13.0 s later (bfloat16 compiled, means of 4 runs each: 1.0-2.2 s/GiB against paused or none),
# a 300-row job's 1.76 GiB 6.9-8.8 s later (4.5 s/GiB); AMD EPYC Zen 4, 2 cores, Firecracker, 2026-12-05
# (bench/results/huge-pages-ab-sharegpt-n200-zen4.md, startup-huge-pages-300rows-zen4.md).
REPORTING_FAULT_S_PER_GIB = 2.0
# Arguments that only print (help, version): answered without a restart.
PRINT_ONLY = frozenset({"-h", "--help", "--version"})


def glibc() -> bool:
    """True when this interpreter runs on GNU libc (``confstr``, no import)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # not a name this platform knows
        return False


def tuned_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """``environ`` with :data:`TUNABLES` added to ``GLIBC_TUNABLES`` (colon-
    separated ``name=value``; a name already there keeps its value), or None
    when there is nothing to add: not glibc, ``BULKINFER_MALLOC_TUNABLES=0``,
    or every name already set."""
    if environ.get(SWITCH, "1") == "0" or not glibc():
        return None
    given = [item for item in environ.get("GLIBC_TUNABLES", "").split(":") if item]
    named = {item.partition("=")[0] for item in given}
    missing = [f"{name}={value}" for name, value in TUNABLES if name not in named]
    if not missing:
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join([*given, *missing])}


def restart_tuned(argv: Sequence[str] | None = None) -> None:
    """Replace this process (``os.execve``: the same PID, open files and
    signal dispositions) with the same command under :func:`tuned_environment`;
    returns at once when there is nothing to add, when ``argv`` (default
    ``sys.argv``) names no command or asks only for help or the version,
    or when the interpreter's path or command line is unknown.

    Raises:
        OSError: the ``execve`` failed (the interpreter could not be run).
    """
    argv = sys.argv if argv is None else argv
    if len(argv) < 2 or PRINT_ONLY.intersection(argv[1:]) or not sys.executable:
        return
    environ = tuned_environment(os.environ)
    original = getattr(sys, "orig_argv", None)
    if environ is None or not original:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execve(sys.executable, [sys.executable, *original[1:]], environ)


@contextlib.contextmanager
def no_huge_pages(active: bool = True) -> Iterator[bool]:
    """No transparent huge page for this process's memory faulted in
    inside the block (``prctl(PR_SET_THP_DISABLE)``, process-wide; the flag
    as it was before again after it) when ``active``; yields whether it
    paused them (False off Linux or where ``prctl`` cannot be loaded). A
    process started inside the block inherits the flag for its life (the
    kernel keeps it across ``fork`` and ``execve``).

    Imports fault in hundreds of MiB of interpreter heap that no engine
    step reads; on a VM whose host takes free memory back each huge page
    of it costs the host hundreds of small faults: a 2-row run's tokenizer
    phase (importing torch and transformers) took 5.8-6.9 s under
    bulkinfer's tunables against 4.8-5.6 s paused (AMD EPYC Zen 4,
    2026-12-06, ``bench/results/startup-thp-tokenizer-2rows-zen4.md``)."""
    prctl = _prctl() if active and sys.platform == "linux" else None
    before = prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) if prctl is not None else -1
    paused = before == 0 and prctl is not None and prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0
    try:
        yield paused or before == 1
    finally:
        if paused and prctl is not None:
            prctl(PR_SET_THP_DISABLE, 0, 0, 0, 0)


@contextlib.contextmanager
def huge_pages_paused(wanted: bool | None) -> Iterator[bool]:
    """:func:`no_huge_pages` for an engine's start when ``wanted`` is False
    (the engine setting ``huge_pages_at_start``); yields whether it paused
    them. An engine in this process gets huge pages again for its steps;
    an engine in child processes (vLLM's engine core and worker, spawned
    inside the block) runs without them for its life.

    Why: the engine's start faults its KV cache in, one fresh block of up
    to gigabytes. Under ``glibc.malloc.hugetlb`` (or THP ``always``) that
    is 2 MiB page by 2 MiB page, and on a VM whose free memory goes back to
    the host (Firecracker's ``page_reporting``) each such page costs the
    host hundreds of 4 KiB faults: ``torch.zeros`` of 1.76 GiB took 2.3-6.9
    s there against 0.4-0.6 s paused (AMD EPYC Zen 4, 2026-12-05,
    ``bench/results/malloc-first-touch-zen4.md``). Child processes fault
    their whole interpreter heap in too: a 2-row job's engine in vLLM's
    processes started in 23.6-26.5 s paused against 32.7-33.3 s (the same
    CPU, 2026-12-06, ``bench/results/startup-thp-processes-2rows-zen4.md``).
    The steps run faster over a KV cache in
    huge pages, so a run pauses them only for a job too short to win the
    start back (README, Engine settings).
    """
    with no_huge_pages(wanted is False) as paused:
        yield paused


def huge_page_fault_s_per_gib(sysfs: Path = Path("/sys")) -> float | None:
    """Seconds per GiB that faulting fresh memory in transparent huge pages
    costs this machine over 4 KiB pages: :data:`REPORTING_FAULT_S_PER_GIB`
    in a VM whose balloon reports free pages to its host (virtio's
    ``VIRTIO_BALLOON_F_REPORTING``, feature bit 5, in sysfs: the host takes
    free memory back and backs it again lazily, 4 KiB at a time), else 0;
    None where huge pages are not offered (not Linux, THP ``never``).
    ``sysfs``: where sysfs is mounted.

    Not timed per run: a small probe reads the memory the last process
    freed, still backed for a few seconds, and a gigabyte cache does not
    (``bench.malloc --first-touch``: 1.76 GiB in 2.3-6.9 s, a probe of 64
    MiB 0.0-5.5 s/GiB back to back; AMD EPYC Zen 4, 2026-12-05)."""
    try:
        if "[never]" in (sysfs / "kernel/mm/transparent_hugepage/enabled").read_text():
            return None
    except OSError:
        return None
    for features in (sysfs / "bus/virtio/drivers/virtio_balloon").glob("virtio*/features"):
        try:
            bits = features.read_text().strip()
        except OSError:
            continue
        if len(bits) > BALLOON_F_REPORTING and bits[BALLOON_F_REPORTING] == "1":
            return REPORTING_FAULT_S_PER_GIB
    return 0.0


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None where this interpreter cannot load it."""
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


def reported(huge_pages_paused: bool = False) -> dict[str, str | bool | None]:
    """The report's ``engine.glibc_tunables``: ``GLIBC_TUNABLES`` in this
    process (None: unset); ``engine.huge_pages_paused_at_start``: the
    engine's start ran under :func:`huge_pages_paused` (with
    ``engine.in_process`` false: its processes ran without huge pages for
    their life)."""
    return {"glibc_tunables": os.environ.get("GLIBC_TUNABLES"), "huge_pages_paused_at_start": huge_pages_paused}
