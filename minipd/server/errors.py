"""What can go wrong for a client, in the server's own terms. Only the HTTP layer (app.py)
turns these into status codes and OpenAI-style error bodies."""

from __future__ import annotations


def shown(value: str, limit: int = 200) -> str:
    """A client's string as an error message quotes it: cut short, so a huge one is not sent back whole."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value):,} characters)"


class ServeError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class InvalidRequest(ServeError):
    """The request itself is wrong (400)."""


class NotFound(ServeError):
    """No such model, request or route (404)."""


class Overloaded(ServeError):
    """The bounded queue is full (429)."""


class Unavailable(ServeError):
    """The server cannot take work now: starting, shutting down, switching, workers gone (503)."""


class Conflict(ServeError):
    """The request clashes with the server's state, which the client can change first (409)."""
