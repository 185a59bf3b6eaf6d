"""Who a request is: constant-time key lookup."""

from __future__ import annotations

import base64
import hmac
from typing import Any

import pytest

from bulkinfer.serve import auth
from bulkinfer.serve.auth import header_key, key_tenant

KEYS = {"sk-first": "alice", "sk-second-longer": "bob", "sk-third": "carol"}


def test_a_key_names_its_tenant_and_an_unknown_one_none() -> None:
    assert [key_tenant(KEYS, k) for k in ("sk-first", "sk-second-longer", "sk-third")] == ["alice", "bob", "carol"]
    assert key_tenant(KEYS, "sk-firs") is None and key_tenant(KEYS, "") is None and key_tenant({}, "sk-first") is None
    assert key_tenant({"clé-ü": "x"}, "clé-ü") == "x"  # not ASCII: compared as bytes


@pytest.mark.parametrize("key", ["sk-first", "sk-third", "nobody"])
def test_every_configured_key_is_compared_in_constant_time_whichever_matches(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[int, int]] = []
    compare = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        compared.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    key_tenant(KEYS, key)
    assert compared == [(32, 32)] * len(KEYS)  # no early exit; equal lengths (SHA-256 digests) whatever the key


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_the_key_of_a_bearer_or_basic_header_and_none_of_anything_else() -> None:
    both = ("bearer", "basic")
    assert header_key("Bearer sk-a") == header_key("bearer  sk-a ", both) == "sk-a"
    assert header_key(basic("anyone", "sk-a:with-colon"), both) == "sk-a:with-colon"  # the user name is ignored
    assert header_key(basic("", "sk-a"), both) == "sk-a"
    assert header_key(basic("anyone", "sk-a")) is None  # Basic only where asked for
    for bad in ("", "Bearer", "Bearer  ", "Token sk-a", "Basic !!!notbase64", basic("user-only", ""), "Basic /w=="):
        assert header_key(bad, both) is None, bad
