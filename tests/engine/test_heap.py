"""glibc's heap settings for a stream's process (bulkinfer/engine/heap.py)."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

from bulkinfer.engine.heap import GLIBC_ARENA_ENV, HEAP_ENV, set_heap

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def test_glibc_is_the_c_library_here() -> None:
    assert ctypes.CDLL("libc.so.6").gnu_get_libc_version() is not None  # as on every CI machine here


def test_the_arenas_are_capped_by_default_and_engine_processes_inherit_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HEAP_ENV, raising=False)
    monkeypatch.delenv(GLIBC_ARENA_ENV, raising=False)
    assert set_heap() == "arenas"
    assert os.environ[GLIBC_ARENA_ENV] == "2"  # what a spawned engine process reads at its start


def test_the_users_own_arena_variable_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HEAP_ENV, raising=False)
    monkeypatch.setenv(GLIBC_ARENA_ENV, "4")
    assert set_heap() == "MALLOC_ARENA_MAX=4"
    assert os.environ[GLIBC_ARENA_ENV] == "4"


@pytest.mark.parametrize(("asked", "held", "arena_env"), [("flat", "flat", "2"), ("glibc", "glibc", None)])
def test_flat_and_glibc_on_request(
    monkeypatch: pytest.MonkeyPatch, asked: str, held: str, arena_env: str | None
) -> None:
    monkeypatch.setenv(HEAP_ENV, asked)
    monkeypatch.delenv(GLIBC_ARENA_ENV, raising=False)
    assert set_heap() == held
    assert os.environ.get(GLIBC_ARENA_ENV) == arena_env


def test_another_value_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HEAP_ENV, "jemalloc")
    with pytest.raises(ValueError, match="BULKINFER_HEAP='jemalloc': expected one of arenas, flat, glibc"):
        set_heap()
