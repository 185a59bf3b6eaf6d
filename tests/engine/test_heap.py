"""glibc's heap settings for a stream's process (bulkinfer/engine/heap.py)."""

from __future__ import annotations

import ctypes
import sys

import pytest

from bulkinfer.engine.heap import HEAP_ENV, keep_heap_flat


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_takes_the_settings_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ctypes.CDLL("libc.so.6").gnu_get_libc_version() is not None  # glibc, as on every CI machine here
    monkeypatch.delenv(HEAP_ENV, raising=False)
    assert keep_heap_flat() is False  # the default: glibc's own (the settings cost throughput)
    monkeypatch.setenv(HEAP_ENV, "flat")
    assert keep_heap_flat() is True
