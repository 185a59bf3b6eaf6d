"""What every route of the API shares: :class:`ApiError` (an error response
in OpenAI's shape) and the tenant of a request's bearer key (:data:`Tenant`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from bulkinfer.serve.access import noted
from bulkinfer.serve.auth import DEFAULT_TENANT, header_key, key_tenant
from bulkinfer.serve.objects import error_body


class ApiError(Exception):
    """An error response: HTTP ``status`` and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, code, param)
        self.headers = headers


def not_found(what: str, id_: str) -> ApiError:
    return ApiError(404, f"No such {what}: '{id_}'", code="not_found")


def not_json(why: object) -> str:
    """The message of a request body that is not JSON (``why``: the parser's reason)."""
    return f"the request body is not valid JSON: {why}"


def found(row: dict[str, Any] | None, what: str, id_: str) -> dict[str, Any]:
    """``row``, the tenant's ``what`` (file, batch) ``id_``.

    Raises:
        ApiError: 404 when it is None (no such id, or another tenant's).
    """
    if row is None:
        raise not_found(what, id_)
    return row


def tenant(request: Request) -> str:
    """The tenant of the request's bearer key (``app.state.keys``: key -> tenant;
    compared in constant time, see :mod:`bulkinfer.serve.auth`).

    Raises:
        ApiError: 401, no bearer key or an unknown one.
    """
    key = header_key(request.headers.get("authorization", ""))
    if key is None:
        raise ApiError(401, "Missing bearer authentication in header", code="invalid_api_key")
    keys: dict[str, str] = request.app.state.keys
    if not keys:
        return noted(request, DEFAULT_TENANT)
    found = key_tenant(keys, key)
    if found is None:
        raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")
    return noted(request, found)


Tenant = Annotated[str, Depends(tenant)]
