"""The C heap of a process that runs an engine for a long time (a stream).

glibc's ``malloc`` serves a block of at least its mmap threshold (128 KiB at
start) with its own ``mmap``, returned to the system when freed; but each
time such a block is freed it raises the threshold to that block's size (up
to 32 MiB), so from then on blocks of that size come from the heap's arenas,
where a freed block stays mapped and the arenas grow with each new largest
mix of sizes (``mallopt(3)``, "M_MMAP_THRESHOLD"). An engine step's
temporary tensors are such blocks, of a size that depends on the step's
batch. Setting the threshold fixes it (glibc then stops adjusting it) and
caps the arenas' count (``M_ARENA_MAX``): blocks of at least
:data:`MMAP_THRESHOLD_BYTES` are mapped and unmapped each time.

Opt-in: ``BULKINFER_HEAP=flat`` in the environment of ``bulkinfer run -``.
Measured on a 2-core AMD EPYC Zen 3 (SmolLM2-135M, one run each,
``bench/results/stream-zen3-30min-rss{,-flat}.md``,
``stream-zen3-2000-rate8{,-glibc}.md``): over a 30-minute stream glibc's
own grew 228 MiB from minute 5 to 30, still rising, these settings 44 MiB
from minute 8 to 30 and none in the last 5; but over capacity a stream
made 71.2 completion tokens/s with them against 94.3 without (the pages of
each step's large blocks are mapped and faulted in again every step), so
glibc's own stays the default.
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


def keep_heap_flat() -> bool:
    """With ``BULKINFER_HEAP=flat``, fix glibc's mmap threshold at
    :data:`MMAP_THRESHOLD_BYTES` and its arenas at :data:`ARENA_MAX` for
    this process (see the module); call it before the engine allocates.
    Returns whether it did (False without the variable, or where the C
    library is not glibc)."""
    if not sys.platform.startswith("linux") or os.environ.get(HEAP_ENV) != "flat":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_ARENA_MAX, ARENA_MAX))
