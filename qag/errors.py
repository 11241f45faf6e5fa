"""The one error type of the HTTP contract: status, snake_case code, a sentence, and extras."""
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


class DatabaseError(ApiError):
    """An ApiError the database caused (502 connection_failed...): `message` is a fixed sentence for any caller;
    `db_text`, what the database or driver said, is for administrators only."""

    def __init__(self, status: int, code: str, message: str, extra: dict | None = None, *, db_text: str = ""):
        super().__init__(status, code, message, extra)
        self.db_text = db_text

    def for_admin(self) -> ApiError:
        if not self.db_text:
            return self
        return ApiError(self.status, self.code, f"{self.message} The database said: {self.db_text}", self.extra,
                        self.headers)
