"""glibc's heap settings for a stream's process (bulkinfer/engine/heap.py)."""

from __future__ import annotations

import ctypes
import sys

import pytest

from bulkinfer.engine.heap import HEAP_ENV, keep_heap_flat


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_takes_the_settings_unless_told_to_keep_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ctypes.CDLL("libc.so.6").gnu_get_libc_version() is not None  # glibc, as on every CI machine here
    assert keep_heap_flat() is True
    monkeypatch.setenv(HEAP_ENV, "glibc")
    assert keep_heap_flat() is False
