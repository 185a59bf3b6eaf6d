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

import os
import sys
from collections.abc import Mapping, Sequence

TUNABLES: tuple[tuple[str, str], ...] = (
    ("glibc.malloc.hugetlb", "1"),
    ("glibc.malloc.mmap_threshold", str(32 << 20)),
    ("glibc.malloc.trim_threshold", str(256 << 20)),
    ("glibc.malloc.top_pad", str(64 << 20)),
)
SWITCH = "BULKINFER_MALLOC_TUNABLES"  # "0": leave glibc's defaults
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


def reported() -> dict[str, str | None]:
    """The report's ``engine.glibc_tunables``: ``GLIBC_TUNABLES`` in this process (None: unset)."""
    return {"glibc_tunables": os.environ.get("GLIBC_TUNABLES")}
