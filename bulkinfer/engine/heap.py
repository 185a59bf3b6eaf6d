"""The C heap of a process that runs an engine for a long time (a stream).

glibc's ``malloc`` gives each thread that contends for the heap an arena of
its own, up to 8 per core (``mallopt(3)``, "M_ARENA_MAX"), and a block freed
in an arena stays mapped there. It serves a block of at least its mmap
threshold (128 KiB at start) with its own ``mmap``, returned to the system
when freed; but each time such a block is freed it raises the threshold to
that block's size (up to 32 MiB), so from then on blocks of that size come
from the arenas, which grow with each new largest mix of sizes
("M_MMAP_THRESHOLD"). An engine step's temporary tensors are such blocks, of
a size that depends on the step's batch.

``BULKINFER_HEAP`` in the environment chooses, for a stream's process
(:func:`set_heap`):

- ``arenas`` (the default): at most :data:`ARENA_MAX` arenas, glibc's own
  threshold. Also ``MALLOC_ARENA_MAX`` in the environment of the engine
  processes the stream starts, unless the user set it.
- ``flat``: the arenas capped and the threshold fixed at
  :data:`MMAP_THRESHOLD_BYTES` (glibc then stops adjusting it): blocks of
  at least 1 MiB are mapped and unmapped each time.
- ``glibc``: glibc's own settings.

Measured on a 2-core AMD EPYC Zen 3, SmolLM2-135M, one run each
(``bench/results/stream-zen3-30min-rss*.md``, ``stream-zen3-2000-rate8*.md``):
over a 30-minute stream glibc's own grew 228 MiB from minute 5 to 30, still
rising; the arenas capped 3 MiB (``MALLOC_ARENA_MAX=2`` in the environment)
and 27 MiB (as shipped, ``stream-zen3-30min-rss-shipped.md``); ``flat``
44 MiB from minute 8, none in the last 5. Over capacity a stream made 94.3
completion tokens/s with glibc's own, 92.7 with the arenas capped and 71.2
with ``flat`` (each step's large blocks are mapped and their pages faulted
in again every step).
"""

from __future__ import annotations

import ctypes
import os
import sys

# <malloc.h>'s parameter numbers.
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 1 << 20
ARENA_MAX = 2

HEAP_ENV = "BULKINFER_HEAP"
HEAPS = ("arenas", "flat", "glibc")
DEFAULT_HEAP = "arenas"
GLIBC_ARENA_ENV = "MALLOC_ARENA_MAX"


def heap_choice() -> str:
    """The heap settings ``BULKINFER_HEAP`` asks for, one of :data:`HEAPS`
    (:data:`DEFAULT_HEAP` when unset).

    Raises:
        ValueError: another value (the message names the variable and the choices).
    """
    choice = os.environ.get(HEAP_ENV, DEFAULT_HEAP)
    if choice not in HEAPS:
        raise ValueError(f"{HEAP_ENV}={choice!r}: expected one of {', '.join(HEAPS)}")
    return choice


def set_heap() -> str:
    """Apply :func:`heap_choice` to this process's glibc ``malloc`` (see the
    module); call it before the engine allocates. Returns what holds:
    ``arenas`` or ``flat`` when applied, ``MALLOC_ARENA_MAX=N`` when the
    user's own variable stands (glibc read it at start; ``arenas`` then
    changes nothing), ``glibc`` when asked for or where the C library is not
    glibc.

    Sets ``MALLOC_ARENA_MAX`` in ``os.environ`` (unless set) for ``arenas``
    and ``flat``, so engine processes started from here take the same cap.

    Raises:
        ValueError: ``BULKINFER_HEAP`` has another value.
    """
    choice = heap_choice()
    user_arenas = os.environ.get(GLIBC_ARENA_ENV)
    if choice == "glibc" or not sys.platform.startswith("linux"):
        return "glibc"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "glibc"
    if choice == "flat" and not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        return "glibc"
    if user_arenas is not None:
        return f"{GLIBC_ARENA_ENV}={user_arenas}" if choice == "arenas" else "flat"
    if not mallopt(M_ARENA_MAX, ARENA_MAX):
        return "glibc"
    os.environ[GLIBC_ARENA_ENV] = str(ARENA_MAX)
    return choice
