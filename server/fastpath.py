"""The batch request without the framework: ``POST /v1/sessions/{sid}/batch`` served by a
small ASGI layer inside the middleware stack (so Host/Origin checks, the body limit, the
token, the request id and the access log apply as to every request).

A program that reads values back (``x[None]`` after a launch) makes one batch request per
read, so this request's cost is what such a program costs per step. Routed through FastAPI
it spent most of its time in routing, dependency resolution and response-model encoding
(issue 18: 1.6-1.9 ms against 0.7-0.8 ms for a bare ASGI app). Here the body is parsed and
validated with the very model the route declares (``BatchBody``, as FastAPI does it: JSON
first, then the model), run by the route's own code (``routers.batch.run_ops``) and answered
directly. Anything unusual (a body that does not validate, another content type) is replayed
untouched to the FastAPI route, so every error keeps exactly the route's answer.
"""

from __future__ import annotations

import json
import logging
import re

from pydantic import TypeAdapter, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .models import BatchBody
from .problems import PROBLEM_TYPE, ProblemError
from .routers.batch import run_ops

log = logging.getLogger("difftape.server")

_PATH = re.compile(r"^/v1/sessions/([A-Za-z0-9_-]{1,64})/batch$")
_BODY = TypeAdapter(BatchBody)


class _Route:
    """What the access log and the latency histogram read from ``scope["route"]``."""

    path = "/v1/sessions/{sid}/batch"


_ROUTE = _Route()


class BatchFastPath:
    """Serve valid JSON batch requests directly; hand everything else to ``app``."""

    def __init__(self, app: ASGIApp, *, service) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        m = _PATH.match(scope["path"])
        user = scope.get("state", {}).get("user")
        if m is None or user is None or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks = []
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            ops = [op.model_dump() for op in _BODY.validate_python(json.loads(body)).ops]
        except (ValueError, ValidationError):
            # Not JSON, or not a valid batch: the route answers (its 400/422 problem).
            await self.app(scope, _replay(body, receive), send)
            return
        sid = m.group(1)
        scope["route"] = _ROUTE
        scope["path_params"] = {"sid": sid}
        try:
            answer = await run_ops(self.service, user, sid, ops)
        except ProblemError as p:
            await _answer(send, p.status, PROBLEM_TYPE,
                          json.dumps(p.body(), allow_nan=True).encode(), p.headers)
            return
        except Exception:
            log.exception("unhandled error")
            p = ProblemError(500, "internal server error")
            await _answer(send, 500, PROBLEM_TYPE, json.dumps(p.body()).encode(), None)
            return
        await _answer(send, 200, "application/json",
                      json.dumps(answer, separators=(",", ":"),
                                 allow_nan=True).encode(), None)


def _is_json(scope: Scope) -> bool:
    for k, v in scope["headers"]:
        if k == b"content-type":
            return v.split(b";")[0].strip().lower() == b"application/json"
    return False


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body already read, then defers to the real one."""
    done = False

    async def replay() -> Message:
        nonlocal done
        if not done:
            done = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(send: Send, status: int, ctype: str, body: bytes,
                  headers: dict[str, str] | None) -> None:
    raw = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
    for k, v in (headers or {}).items():
        raw.append((k.lower().encode("latin-1"), v.encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
