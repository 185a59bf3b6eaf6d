"""Who a request is: the tenant of its API key.

Keys are compared in constant time: :func:`key_tenant` compares the
SHA-256 of the given key with that of every configured key by
``hmac.compare_digest`` and never stops early, so the time a lookup takes
tells neither whether a key matched, nor which, nor any key's length.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping


def key_tenant(keys: Mapping[str, str], key: str) -> str | None:
    """The tenant of ``key`` in ``keys`` (API key -> tenant), or None when
    no configured key is ``key``. Every key is compared (see the module)."""
    given = hashlib.sha256(key.encode()).digest()
    found = None
    for known, tenant in keys.items():
        if hmac.compare_digest(hashlib.sha256(known.encode()).digest(), given):
            found = tenant
    return found
