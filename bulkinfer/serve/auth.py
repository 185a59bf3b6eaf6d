"""Who a request is: the tenant of its API key, given as
``Authorization: Bearer KEY`` (the API and the pages) or, for a browser, as
HTTP Basic with the key as password (the pages; the user name is ignored).

Keys are compared in constant time: :func:`key_tenant` compares the
SHA-256 of the given key with that of every configured key by
``hmac.compare_digest`` and never stops early, so the time a lookup takes
tells neither whether a key matched, nor which, nor any key's length.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping

DEFAULT_TENANT = "default"  # the tenant of every request when no key is configured


def key_tenant(keys: Mapping[str, str], key: str) -> str | None:
    """The tenant of ``key`` in ``keys`` (API key -> tenant), or None when
    no configured key is ``key``. Every key is compared (see the module)."""
    given = hashlib.sha256(key.encode()).digest()
    found = None
    for known, tenant in keys.items():
        if hmac.compare_digest(hashlib.sha256(known.encode()).digest(), given):
            found = tenant
    return found


def header_key(authorization: str, schemes: tuple[str, ...] = ("bearer",)) -> str | None:
    """The API key in an ``Authorization`` header value whose scheme (any
    case) is one of ``schemes``: ``"bearer"`` (the token) or ``"basic"`` (the
    password of base64 ``user:password``); None when there is none, the
    scheme is another, or the value is malformed."""
    scheme, _, value = authorization.strip().partition(" ")
    scheme, value = scheme.lower(), value.strip()
    if scheme not in schemes or not value:
        return None
    if scheme == "bearer":
        return value
    try:
        decoded = base64.b64decode(value, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.partition(":")[2] or None
