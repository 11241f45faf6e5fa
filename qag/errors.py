"""The errors below the HTTP layer. Domain errors (what went wrong, in the contract's words: a snake_case code,
a sentence a person can act on, and the extras the contract names) are raised by the store and the connectors;
qag/http/errors.py maps each to its status and body, once. `ApiError` is the contract's answer itself, still
raised by the modules that decide one directly (authentication, plans, parameters, limits, governance)."""
from __future__ import annotations


class ApiError(Exception):
    __slots__ = ("status", "code", "message", "extra", "headers")

    def __init__(self, status: int, code: str, message: str, extra: dict | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.extra = extra or {}
        self.headers = headers or {}

    def body(self, request_id: str) -> dict:
        out = {"error": self.message, "code": self.code, "request_id": request_id}
        out.update(self.extra)
        return out


def bad_request(code: str, message: str, **extra) -> ApiError:
    return ApiError(400, code, message, extra)


def not_found(code: str, message: str) -> ApiError:
    return ApiError(404, code, message)


# -- domain errors -------------------------------------------------------------------------------------------
class DomainError(Exception):
    """A refusal or failure of the store or a connector. `code` and `message` are the contract's; `extra` its
    extras; `str()` may say more, for a log line or the command line (never for a caller)."""
    code = "internal_error"

    def __init__(self, code: str | None = None, message: str = "", extra: dict | None = None, *,
                 detail: str | None = None):
        super().__init__(detail if detail is not None else message)
        if code is not None:
            self.code = code
        self.message = message
        self.extra = extra or {}


class NotFound(DomainError):
    """The named thing does not exist (connection_not_found, query_not_found, version_not_found...)."""


class Conflict(DomainError):
    """The name is taken (connection_exists, query_exists, key_exists...); raised without a code by a statement
    that broke a unique constraint, and given the entity's code by the store method that knows which."""
    code = "conflict"


class InUse(DomainError):
    """The thing cannot go: others still point at it (connection_in_use); `users` names them."""

    def __init__(self, code: str, message: str, users: list[str]):
        super().__init__(code, message)
        self.users = users


class StoreUnavailable(DomainError):
    """The metadata store cannot be reached; the API answers 503 and recovers when it returns. `str()` says why
    (for `qag serve`'s one line); callers get the contract's fixed sentence."""
    code = "store_unavailable"

    def __init__(self, detail: str):
        super().__init__(None, "The metadata store is unreachable right now; retry shortly.", detail=detail)


class SchemaTooNew(DomainError):
    """The metadata store was migrated by a newer qag than this one: refused at start (a rolling upgrade runs the
    new version's hosts first; an old host must not write a schema it does not know)."""
    code = "schema_too_new"

    def __init__(self, found: int, known: int):
        super().__init__(None, f"the metadata store's schema is version {found}, newer than this qag knows "
                               f"(version {known}); upgrade qag on this host, or point it at another store")
        self.found, self.known = found, known


class SecretKeyProblem(DomainError):
    """A stored password cannot be opened with this server's QAG_SECRET_KEY (secret_key_missing / _mismatch)."""


class ConnectorError(DomainError):
    """What a connector raises about its database (qag/connectors.py S7)."""


class DriverMissing(ConnectorError):
    """The database's Python driver is not installed (driver_missing); the sentence names the extra."""
    code = "driver_missing"

    def __init__(self, message: str):
        super().__init__(None, message)


class QueryFailed(ConnectorError):
    """The database rejected the statement, the session still usable (connectors S7). `db_text`, what the
    database said, is for administrators only."""
    code = "query_failed"

    def __init__(self, db_text: str):
        super().__init__(None, "The database rejected the statement; an administrator can see why in the run "
                               "history.", detail=db_text)
        self.db_text = db_text


class Unreachable(ConnectorError):
    """The database cannot be reached, or the session was lost (connectors S6, S7): connection_failed. The
    sentence depends only on the connection's name; `db_text` (the driver's first line, no password) is for
    administrators only."""
    code = "connection_failed"
    SENTENCE = "Could not reach the database of connection '{}'; check that it is running and reachable, then retry."

    def __init__(self, name: str, db_text: str = ""):
        super().__init__(None, self.SENTENCE.format(name))
        self.name = name
        self.db_text = db_text


class Timeout(ConnectorError):
    """The statement ran over its time limit and was cancelled (connectors S3, S4): query_timeout."""
    code = "query_timeout"

    def __init__(self, seconds: float):
        super().__init__(None, f"The statement ran longer than its time limit of {seconds:g} s and was cancelled.",
                         {"timeout": seconds})
        self.seconds = seconds
