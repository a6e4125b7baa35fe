"""Server errors back into the exception classes the local runtime raises.

A problem body names the difftape exception class (``difftape_error``); re-raising that very
class means ``except ti.KernelAssertionError`` works the same whether a program runs locally
or through the service. Classes the client does not know (an engine's own subclass, or the
gateway's ``SessionLostError``/``QuotaExceededError``) become subclasses of DifftapeError
created on demand under the server's name, so a caller can still catch them by base class.
"""

from __future__ import annotations

from typing import Any

from difftape import errors as _errors
from difftape.errors import CompileError, DifftapeError, location_arguments


class RemoteError(DifftapeError):
    """An error of the service itself (HTTP status and problem detail), not of the program:
    authentication, a missing session, a malformed request, an internal server error."""

    def __init__(self, message: str, *, status: int | None = None,
                 body: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body or {}


class AuthenticationError(RemoteError):
    """401/403: the token is missing, wrong or revoked."""


class SessionLostError(DifftapeError):
    """The session's worker died or the session was deleted; its fields are gone."""


class QuotaExceededError(DifftapeError):
    """A per-user limit (field memory, sessions, job time) was reached."""


_dynamic: dict[str, type[DifftapeError]] = {
    "SessionLostError": SessionLostError,
    "QuotaExceededError": QuotaExceededError,
}


def exception_class(name: str | None) -> type[DifftapeError] | None:
    """The difftape exception class called ``name`` (None if ``name`` is None)."""
    if not name:
        return None
    cls = getattr(_errors, name, None)
    if cls is None:
        from difftape import ad

        cls = getattr(ad, name, None)
    if isinstance(cls, type) and issubclass(cls, DifftapeError):
        return cls
    if not name.isidentifier():
        return DifftapeError
    if name not in _dynamic:
        _dynamic[name] = type(name, (DifftapeError,), {"__module__": "difftape.client.errors"})
    return _dynamic[name]


def error_from_problem(status: int, body: Any) -> DifftapeError:
    """The exception to raise for an error response (problem JSON or anything else)."""
    if not isinstance(body, dict):
        text = str(body)[:500]
        cls = AuthenticationError if status in (401, 403) else RemoteError
        return cls(f"HTTP {status}: {text}", status=status)
    detail = str(body.get("detail") or body.get("title") or f"HTTP {status}")
    cls = exception_class(body.get("difftape_error"))
    if cls is None:
        kind = AuthenticationError if status in (401, 403) else RemoteError
        title = body.get("title")
        return kind(f"HTTP {status} {title}: {detail}" if title else f"HTTP {status}: {detail}",
                    status=status, body=body)
    kernel = body.get("kernel")
    if issubclass(cls, CompileError):
        err: DifftapeError = cls(detail, kernel=kernel, **location_arguments(body.get("location")))
    else:
        err = cls(detail)
        err.kernel = kernel  # e.g. the launch of a replayed graph that failed
    err.status = status
    err.op_index = body.get("index")
    return err
