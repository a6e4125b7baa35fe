"""Pure ASGI middleware: request ids and access logs, Host and Origin checks, the body-size
limit, authentication.

Pure ASGI (not ``BaseHTTPMiddleware``) so that request bodies stream through untouched and a
body is counted as it arrives: uvicorn has no body limit, and a Content-Length header can be
absent (chunked) or false, so the limit is enforced on the bytes actually received. The token
is checked here too, before the application reads (let alone parses) a byte of the body.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from http.cookies import CookieError, SimpleCookie

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .problems import PROBLEM_TYPE, database_failed, request_id

access_log = logging.getLogger("difftape.access")
log = logging.getLogger("difftape.server")

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
ARRAY_TYPES = {"application/x-npy", "application/octet-stream"}


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when the body passes the limit. An HTTPException, so FastAPI
    passes it through its body parsing and the problem handler renders it as a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than the limit of {limit} bytes")


async def _problem(send: Send, status: int, title: str, detail: str,
                   headers: list[tuple[bytes, bytes]] = (), close: bool = True) -> None:
    """A problem response sent before the application saw the request. With ``close``
    (``connection: close``) the connection ends after it, unread body and all; without, the
    server reads past the rest of the body (discarding it, never buffering it) so that a
    client still sending its body gets this answer rather than a reset connection."""
    problem = {"type": "about:blank", "title": title, "status": status, "detail": detail,
               "difftape_error": None, "kernel": None}
    rid = request_id.get()
    if rid is not None:
        problem["request_id"] = rid
    body = json.dumps(problem).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", PROBLEM_TYPE.encode()),
                            (b"content-length", str(len(body)).encode()),
                            *([(b"connection", b"close")] if close else []), *headers]})
    await send({"type": "http.response.body", "body": body})


def _headers(scope: Scope) -> dict[str, str]:
    headers: dict[str, str] = {}
    for k, v in scope["headers"]:
        headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
    return headers


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        return host.rsplit(":", 1)[0]
    return host


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _same_origin(origin: str, host: str | None) -> bool:
    """Whether a browser ``Origin`` is this server's own (the page came from the server,
    e.g. its /docs): the same host and port as the request's ``Host``. The scheme is not
    compared: behind a TLS proxy the page is https and the request reaches us as http.
    Called only once ``host`` passed the allowed-hosts check, so a rebinding attacker's
    name (whose Origin would match its Host) never gets here."""
    if host is None or "://" not in origin:
        return False
    scheme, _, netloc = origin.partition("://")
    scheme, netloc, host = scheme.lower(), netloc.rstrip("/").lower(), host.strip().lower()
    default = _DEFAULT_PORTS.get(scheme)

    def strip(h: str) -> str:
        return h[:-len(default) - 1] if default and h.endswith(":" + default) else h

    return strip(netloc) == strip(host)


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
        headers = _headers(scope)
        host = headers.get("host")
        if not self.any_host and (host is None or _host_name(host) not in self.hosts):
            await _problem(send, 400, "Host not allowed",
                           f"Host {host!r} is not in the server's allowed hosts")
            return
        origin = headers.get("origin")
        if (origin is not None and scope["method"] not in SAFE_METHODS
                and origin.rstrip("/").lower() not in self.origins
                and not _same_origin(origin, host)):
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


#: What a 401 says: what was wrong and what to do about it, for a difftape program and for
#: any other HTTP client.
MISSING_TOKEN = ("missing bearer token: send 'Authorization: Bearer <token>' (a difftape "
                 "program: set DIFFTAPE_TOKEN=<token> or pass ti.init(arch=ti.remote, "
                 "token=...)); the server's operator makes tokens with `difftape token create "
                 "NAME`")
INVALID_TOKEN = ("invalid token: this server does not know it (revoked, rotated, mistyped, or "
                 "made for another server); ask the server's operator for a new one (`difftape "
                 "token create NAME`) and set DIFFTAPE_TOKEN to it")

#: Paths served without a token: the probes, the API's own documentation, and ``/`` (a
#: redirect to the status page).
PUBLIC_PATHS = frozenset({"/", "/livez", "/readyz", "/docs", "/docs/oauth2-redirect", "/redoc",
                          "/openapi.json"})
#: The status page's paths (routers/status.py). A browser sends no Authorization header, so
#: these also take the token from the cookie the page's sign-in form sets, and a missing or
#: invalid token reaches the route, which answers with the sign-in page (401) rather than a
#: problem body. Only these read the cookie: an API request carrying it is still refused,
#: so a page on another site cannot act with a signed-in browser's token (CSRF).
PAGE_PATHS = frozenset({"/status", "/status/login", "/status/logout"})
TOKEN_COOKIE = "difftape_token"


def _cookie(header: str | None, name: str) -> str | None:
    if not header:
        return None
    jar = SimpleCookie()
    try:
        jar.load(header)
    except CookieError:
        return None
    morsel = jar.get(name)
    return morsel.value if morsel is not None else None


class _NoError(Exception):
    """Never raised: what ``except`` names where no database error type was given."""


class AuthMiddleware:
    """Bearer-token authentication before the application runs: an unauthenticated request
    is answered 401 from its headers alone, its body never read or parsed (it would cost
    the event loop, and memory, for every user). The user goes into ``scope["state"]``,
    where ``auth.current_user`` finds it."""

    def __init__(self, app: ASGIApp, *, users,
                 database_error: type[Exception] | None = None) -> None:
        self.app = app
        self.users = users  # token -> User or None (Database.user_by_token)
        # The database's base error: its failure under the lookup is a 503, as under a route
        # (problems.install), not the bare 500 of an error escaping a middleware.
        self.database_error = database_error or _NoError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        token = token.strip()
        page = scope["path"] in PAGE_PATHS
        if page and (scheme.lower() != "bearer" or not token):
            token = _cookie(headers.get("cookie"), TOKEN_COOKIE) or ""
        elif not page and scheme.lower() != "bearer":
            token = ""
        try:
            user = self.users(token) if token else None
        except self.database_error as e:
            log.error("database error: %s: %s", type(e).__name__, e)
            p = database_failed()
            await _problem(send, p.status, p.title, p.detail,
                           [(k.lower().encode(), v.encode()) for k, v in p.headers.items()],
                           close="transfer-encoding" in headers)
            return
        if page:
            state = scope.setdefault("state", {})
            state["user"] = user
            state["token_given"] = bool(token)
            await self.app(scope, receive, send)
            return
        if user is None:
            # A declared length was checked against the body limit already: the rest of such
            # a body may be read past. A chunked one could go on for ever: close.
            await _problem(send, 401, "Unauthorized", INVALID_TOKEN if token else MISSING_TOKEN,
                           [(b"www-authenticate", b"Bearer")],
                           close="transfer-encoding" in headers)
            return
        scope.setdefault("state", {})["user"] = user
        await self.app(scope, receive, send)


class RequestMiddleware:
    """The outermost layer: a request id (``X-Request-Id`` on every response, and in every
    problem body), the latency histogram by route template (not raw path: session ids would
    explode the label set), and one JSON access-log line per request: user, session, op,
    status, duration, bytes. Headers are never logged, so neither is a token."""

    def __init__(self, app: ASGIApp, *, histogram, log: bool = True) -> None:
        self.app = app
        self.histogram = histogram
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = secrets.token_hex(8)
        for k, _ in scope["headers"]:
            if k == b"x-difftape-forwarded":
                # Passed on by another gateway (forward.py): one id for both hops' logs.
                rid = dict(scope["headers"]).get(b"x-request-id", rid.encode()).decode(
                    "latin-1")[:64]
                break
        token = request_id.set(rid)
        t0 = time.perf_counter()
        status = 500
        bytes_in = bytes_out = 0
        header = (b"x-request-id", rid.encode())

        async def counting_receive() -> Message:
            nonlocal bytes_in
            message = await receive()
            if message["type"] == "http.request":
                bytes_in += len(message.get("body", b""))
            return message

        async def tagging_send(message: Message) -> None:
            nonlocal status, bytes_out
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), header]}
            elif message["type"] == "http.response.body":
                bytes_out += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, tagging_send)
        finally:
            request_id.reset(token)
            elapsed = time.perf_counter() - t0
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.histogram.labels(scope["method"], path, str(status)).observe(elapsed)
            if self.log and access_log.isEnabledFor(logging.INFO):
                user = scope.get("state", {}).get("user")
                params = scope.get("path_params") or {}
                access_log.info(json.dumps({
                    "ts": round(time.time(), 3), "request_id": rid,
                    "user": getattr(user, "name", None), "session": params.get("sid"),
                    "op": f"{scope['method']} {path}", "status": status,
                    "duration_ms": round(elapsed * 1000, 2), "bytes_in": bytes_in,
                    "bytes_out": bytes_out}))
