"""The one exception governance raises: an HTTP status, a contract code and a sentence a person can act on."""

from __future__ import annotations


class GovernanceError(Exception):
    """A refusal decided at plan time; the API layer renders it as {"error", "code", **extra}."""

    __slots__ = ("code", "extra", "message", "status")

    def __init__(self, status: int, code: str, message: str, extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.extra = dict(extra or {})

    def __reduce__(self):
        # Plans (and their refusals) cross process boundaries; keep the exception picklable.
        return (GovernanceError, (self.status, self.code, self.message, self.extra))

    def __repr__(self) -> str:
        return f"GovernanceError({self.status}, {self.code!r}, {self.message!r}, {self.extra!r})"
