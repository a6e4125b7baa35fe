"""Pure ASGI middleware: Host and Origin checks, the body-size limit, request timing.

Pure ASGI (not ``BaseHTTPMiddleware``) so that request bodies stream through untouched and a
body is counted as it arrives: uvicorn has no body limit, and a Content-Length header can be
absent (chunked) or false, so the limit is enforced on the bytes actually received.
"""

from __future__ import annotations

import json
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .problems import PROBLEM_TYPE

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
ARRAY_TYPES = {"application/x-npy", "application/octet-stream"}


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when the body passes the limit. An HTTPException, so FastAPI
    passes it through its body parsing and the problem handler renders it as a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than the limit of {limit} bytes")


async def _problem(send: Send, status: int, title: str, detail: str) -> None:
    body = json.dumps({"type": "about:blank", "title": title, "status": status,
                       "detail": detail, "difftape_error": None, "kernel": None}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", PROBLEM_TYPE.encode()),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        return host.rsplit(":", 1)[0]
    return host


class GuardMiddleware:
    """Refuse foreign Host headers (DNS rebinding), state-changing requests from foreign
    browser origins (CSRF), and bodies over the limit (413)."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: list[str], allowed_origins: list[str],
                 max_body_bytes: int, max_json_bytes: int | None = None) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = {h.lower().strip("[]") for h in allowed_hosts}
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}
        self.array_limit = max_body_bytes
        self.json_limit = min(max_json_bytes or max_body_bytes, max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        host = headers.get("host")
        if not self.any_host and (host is None or _host_name(host) not in self.hosts):
            await _problem(send, 400, "Host not allowed",
                           f"Host {host!r} is not in the server's allowed hosts")
            return
        origin = headers.get("origin")
        if (origin is not None and scope["method"] not in SAFE_METHODS
                and origin.rstrip("/").lower() not in self.origins):
            await _problem(send, 403, "Origin not allowed",
                           f"state-changing requests from origin {origin!r} are refused")
            return
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        body_limit = self.array_limit if ctype in ARRAY_TYPES else self.json_limit
        length = headers.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                await _problem(send, 400, "Bad Request", "invalid Content-Length")
                return
            if n > body_limit:
                await _problem(send, 413, "Content Too Large",
                               f"request body of {n} bytes is larger than the limit of "
                               f"{body_limit} bytes")
                return

        received = 0
        limit = body_limit
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as e:
            if started:
                raise
            await _problem(send, 413, "Content Too Large", e.detail)


class TimingMiddleware:
    """Request latency by route template (not raw path: session ids would explode the
    label set)."""

    def __init__(self, app: ASGIApp, *, histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.histogram.labels(scope["method"], path, str(status)).observe(
                time.perf_counter() - t0)
