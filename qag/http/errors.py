"""The one mapping of domain errors (qag/errors.py: what the store and the connectors raise) to the HTTP
contract: a status, the body `{"error", "code", "request_id"}` plus extras, and headers. Nothing below qag/http
knows a status code of these errors."""
from __future__ import annotations

from qag.errors import (
    ApiError,
    Conflict,
    DomainError,
    DriverMissing,
    InUse,
    NotFound,
    QueryFailed,
    SchemaTooNew,
    SecretKeyProblem,
    StoreUnavailable,
    Timeout,
    Unreachable,
)

__all__ = ["ApiError", "STATUS", "answer", "status_of"]

STATUS: dict[type, int] = {
    NotFound: 404,
    Conflict: 409,
    InUse: 409,
    QueryFailed: 500,
    SecretKeyProblem: 500,
    DriverMissing: 500,
    Unreachable: 502,
    StoreUnavailable: 503,
    SchemaTooNew: 503,
    Timeout: 504,
}

QUERY_FAILED_FOR_ADMIN = "The database rejected the statement: "


def status_of(exc: ApiError | DomainError) -> int:
    if isinstance(exc, ApiError):
        return exc.status
    for cls in type(exc).__mro__:
        status = STATUS.get(cls)
        if status is not None:
            return status
    return 500


def answer(exc: ApiError | DomainError, *, admin: bool = False, data_call: bool = False) -> ApiError | None:
    """The contract's answer to `exc`. `admin`: the caller is an administrator, who may read what the database
    said (connectors S7; a scoped key never does). `data_call`: raised while serving a saved query (/q), where
    the answer is also the run's status and code.
    None: not answered here. In a data call, a store that is away is no run of the query: it goes up as it is
    (503, no run recorded). Elsewhere, a 500 internal_error with the failure in the log, as for any unexpected
    error: a statement the database rejected outside a data call, or a unique constraint that no store method
    named (a race the store did not foresee)."""
    if isinstance(exc, ApiError):
        return exc
    if data_call and isinstance(exc, StoreUnavailable):
        return None
    if isinstance(exc, QueryFailed):
        if not data_call:
            return None
        if admin:
            return ApiError(500, exc.code, QUERY_FAILED_FOR_ADMIN + exc.db_text)
        return ApiError(500, exc.code, exc.message)
    if isinstance(exc, Conflict) and exc.code == Conflict.code:
        return None
    message = exc.message
    if isinstance(exc, Unreachable) and admin and exc.db_text:
        message = f"{message} The database said: {exc.db_text}"
    headers = {"Retry-After": "1"} if isinstance(exc, StoreUnavailable) else None
    return ApiError(status_of(exc), exc.code, message, exc.extra, headers)
