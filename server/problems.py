"""RFC 7807 problem bodies for every error, the gateway's own and the engine's.

``difftape_error`` names the difftape exception class so the client can raise the same type
the local runtime would (``difftape.errors.<name>``); ``null`` for errors with no difftape
counterpart (authentication, routing, request validation).
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger("difftape.server")

PROBLEM_TYPE = "application/problem+json"

#: The id of the request being served (set by the outermost middleware); every problem body
#: carries it, so that a user's report can be matched to the server's access log line.
request_id: ContextVar[str | None] = ContextVar("difftape_request_id", default=None)

#: At most this many request-validation errors are listed in a 422 body (the rest are
#: counted): a small request with many bad items must not produce a huge answer.
MAX_VALIDATION_ERRORS = 20

# Engine exception class (or an ancestor) -> HTTP status. The worker sends the class's MRO
# names, so a new subclass (say, an IR validation error deriving from CompileError) maps
# correctly without the gateway knowing it.
ENGINE_STATUS = {
    "SessionLostError": 410,
    "QuotaExceededError": 429,
    "QuotaUnavailableError": 503,  # the gateway's database failed answering an engine's ask
    "KernelAssertionError": 422,
    "ShapeError": 422,
    "CompileError": 422,
    "DifftapeError": 422,
    # Plain Python errors an engine raises on malformed requests are the client's fault.
    "ValueError": 400,
    "TypeError": 400,
    "KeyError": 400,
    "IndexError": 400,
    "OverflowError": 400,  # a value that does not fit the field's dtype (inf into an int)
}


class ProblemError(Exception):
    """Raised anywhere in the gateway; rendered as a problem response."""

    def __init__(self, status: int, detail: str, *, difftape_error: str | None = None,
                 kernel: str | None = None, title: str | None = None,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.difftape_error = difftape_error
        self.kernel = kernel
        self.title = title or HTTPStatus(status).phrase
        self.headers = headers
        self.extra = extra

    def body(self) -> dict:
        body = {"type": "about:blank", "title": self.title, "status": self.status,
                "detail": self.detail, "difftape_error": self.difftape_error,
                "kernel": self.kernel}
        body.update(self.extra)
        rid = request_id.get()
        if rid is not None and "request_id" not in body:
            body["request_id"] = rid
        return body

    @classmethod
    def from_body(cls, body: dict) -> ProblemError:
        extra = {k: v for k, v in body.items()
                 if k not in ("type", "title", "status", "detail", "difftape_error", "kernel",
                              "request_id")}
        return cls(body["status"], body["detail"], difftape_error=body.get("difftape_error"),
                   kernel=body.get("kernel"), title=body.get("title"), **extra)


def engine_problem(err: dict) -> ProblemError:
    """The problem for an error dict a worker sent back."""
    names = err.get("bases") or [err.get("type", "Exception")]
    status = 500
    for n in names:
        if n in ENGINE_STATUS:
            status = ENGINE_STATUS[n]
            break
    is_difftape = "DifftapeError" in names
    extra = {}
    if err.get("index") is not None:
        extra["index"] = err["index"]
    if err.get("location") is not None:
        extra["location"] = err["location"]
    if isinstance(err.get("output"), dict):  # printed by the request's kernels before it
        extra["output"] = err["output"]
    if status == 429 and isinstance(err.get("limit"), str):
        extra["limit"] = err["limit"]
    if status == 500:
        log.error("engine internal error %s: %s", err.get("type"), err.get("message"))
    return ProblemError(status, str(err.get("message", "")),
                        difftape_error=err.get("type") if is_difftape else None,
                        kernel=err.get("kernel"),
                        title=err.get("type") if is_difftape else None,
                        headers={"Retry-After": "2"} if status == 503 else None, **extra)


def session_lost(detail: str) -> ProblemError:
    return ProblemError(410, detail, difftape_error="SessionLostError", title="Session lost")


def server_stopping() -> ProblemError:
    """A request that arrives (or waited) while the server stops: nothing of it ran."""
    return ProblemError(503, "the server is stopping; nothing was run, retry once it is back",
                        title="Server stopping", headers={"Retry-After": "5"})


def session_moved(sid: str) -> ProblemError:
    """The session is held by another gateway of the same database that took it just now
    (the request raced with the move): nothing of it ran, and a retry reaches it."""
    return ProblemError(503, f"session {sid} has just moved to another gateway; nothing was "
                             "run, retry", title="Session moved", headers={"Retry-After": "1"})


def quota(limit: str, detail: str) -> ProblemError:
    return ProblemError(429, detail, difftape_error="QuotaExceededError",
                        title="Quota exceeded", limit=limit)


def problem_response(p: ProblemError) -> Response:
    # allow_nan: a kernel may return inf/NaN; Python's json reads them back.
    return Response(json.dumps(p.body(), allow_nan=True), status_code=p.status,
                    media_type=PROBLEM_TYPE, headers=p.headers)


def database_failed() -> ProblemError:
    """The gateway's database failed (unreachable, locked past its deadline, out of space):
    the server's fault, worth a retry; what failed goes to the log, not to the user."""
    return ProblemError(503, "the server's database failed; retry (the server's log says why)",
                        title="Database unavailable", headers={"Retry-After": "2"})


def install(app: FastAPI, database_error: type[Exception] | None = None) -> None:
    """Route FastAPI's and Starlette's own errors (404, 405, 422, 500...) through problems,
    and the database's (``database_error``, the backend's base class) as 503s."""

    @app.exception_handler(ProblemError)
    async def _problem(_request: Request, exc: ProblemError) -> Response:
        return problem_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> Response:
        headers = getattr(exc, "headers", None)
        return problem_response(ProblemError(exc.status_code, str(exc.detail), headers=headers))

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> Response:
        all_errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in all_errors[:1]):
            # Not JSON at all: a malformed body, like a broken .npy.
            msg = str(all_errors[0].get("ctx", {}).get("error", "invalid JSON"))[:200]
            return problem_response(ProblemError(400, f"the body is not valid JSON: {msg}"))
        errors = []
        for e in all_errors[:MAX_VALIDATION_ERRORS]:
            loc = ".".join(str(x) for x in e.get("loc", ()))[:200]
            errors.append({"loc": loc, "msg": str(e.get("msg", ""))[:200]})
        detail = "; ".join(f"{e['loc']}: {e['msg']}" for e in errors[:5]) or "invalid request"
        if len(all_errors) > 5:
            detail += f" (and {len(all_errors) - 5} more)"
        extra = {}
        if len(all_errors) > len(errors):
            extra["errors_omitted"] = len(all_errors) - len(errors)
        return problem_response(ProblemError(422, detail, errors=errors, **extra))

    if database_error is not None:
        @app.exception_handler(database_error)
        async def _database(_request: Request, exc: Exception) -> Response:
            log.error("database error: %s: %s", type(exc).__name__, exc)
            return problem_response(database_failed())

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return problem_response(ProblemError(500, "internal server error"))
