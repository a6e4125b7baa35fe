"""Requests for a session another gateway runs, forwarded to that gateway.

With several gateways on one database (README "Scale out") a session's engine is a worker
process of the gateway that holds it: only that process can talk to it (a pipe and shared
memory). A request that reaches another gateway (a load balancer chose it) is passed on, as
it came, to the holder's address from the ``gateways`` table, and the answer streamed back:
one more hop on the local network, against moving the session (saving and loading all its
fields) each time the load balancer changes its mind. A request for a session no live
gateway holds is served here: the session resumes in this gateway from its last save.

A session whose engine is a Ray actor (``server/raycluster.py``) is reachable by name from
every gateway: its requests are never forwarded; the gateway that gets one takes the session
over (``SessionManager.use``) and calls the actor itself.

Only requests that need the engine are forwarded (``/v1/sessions/{sid}/...`` and a running
job's ``/v1/jobs/{id}...``); users, lists, session and finished job records are in the
database every gateway reads. The user's own ``Authorization`` travels with the request, so
the holder authenticates it as any request; ``X-Difftape-Forwarded`` marks it, and a
forwarded request is never forwarded again.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from .middleware import _problem
from .problems import request_id
from .worker import reachable_by_name

log = logging.getLogger("difftape.server")

FORWARDED = b"x-difftape-forwarded"
_SESSION = re.compile(r"^/v1/sessions/([A-Za-z0-9_-]{1,64})(/.*)?$")
_JOB = re.compile(r"^/v1/jobs/([A-Za-z0-9_.:-]{1,128})(/.*)?$")
# Hop-by-hop headers (RFC 9110 7.6.1), and the ones the next hop sets itself.
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
                  b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host",
                  b"x-request-id"})


class ForwardMiddleware:
    """Inside the token check (a request is authenticated before it is passed on), outside
    the routes and the batch fast path."""

    def __init__(self, app: ASGIApp, *, service) -> None:
        self.app = app
        self.service = service
        self._client: httpx.AsyncClient | None = None
        service.forward = self  # closed with the service

    def holder(self, scope: Scope):
        """The live other gateway that runs what this request needs: (id, url) or None
        (served here)."""
        path = scope["path"]
        if not path.startswith("/v1/"):
            return None
        user = scope.get("state", {}).get("user")
        if user is None or any(k == FORWARDED for k, _ in scope["headers"]):
            return None
        svc = self.service
        lease = svc.settings.gateway_lease_s
        m = _SESSION.match(path)
        if m is not None:
            if m.group(2) is None and scope["method"] == "GET":
                return None  # the session's record
            e = svc.sessions.live.get(m.group(1))
            if e is not None and e.worker is not None:
                return None  # the hot path: a session running here costs no statement
            row = svc.db.session_holder(m.group(1), user.id, lease)
            if row is not None and reachable_by_name(row["worker"]):
                return None  # a Ray actor: this gateway takes the session, calls it itself
        elif (m := _JOB.match(path)) is not None:
            if (user.id, m.group(1)) in svc.jobs.active:
                return None
            row = svc.db.job_holder(user.id, m.group(1), lease)
        else:
            return None
        if row is None or row["gateway"] in (None, svc.gateway_id) or not row["live"]:
            return None
        return row["gateway"], row["url"]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.service.settings.gateway_lease_s + 2
        while True:
            target = self.holder(scope)
            if target is None:
                await self.app(scope, receive, send)
                return
            gid, url = target
            if not url:
                await _problem(send, 503, "Gateway unreachable",
                               f"gateway {gid} runs this session but gave no address other "
                               "gateways can reach (set DIFFTAPE_GATEWAY_URL on it)",
                               [(b"retry-after", b"5")])
                return
            sent = await self._forward(url, scope, receive, send)
            if sent is not None:
                return
            # The holder did not take the connection (it is stopping or dead): once its
            # lease runs out, the session is settled and served here.
            if time.monotonic() > deadline:
                await _problem(send, 503, "Gateway unreachable",
                               f"gateway {gid} ({url}), which runs this session, does not "
                               "answer; try again", [(b"retry-after", b"2")])
                return
            await asyncio.sleep(0.5)

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            # No read timeout: a launch may run up to the kernel time limit, which the
            # holder enforces.
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                             limits=httpx.Limits(max_connections=None,
                                                                 max_keepalive_connections=64))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def _forward(self, url: str, scope: Scope, receive: Receive, send: Send):
        """Pass the request on; True once answered, None if the holder could not be
        connected to (nothing of the request was read, so it may go elsewhere)."""
        read = False

        async def body():
            nonlocal read
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return
                read = True
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    return

        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        headers.append((FORWARDED, self.service.gateway_id.encode()))
        rid = request_id.get()
        if rid:
            headers.append((b"x-request-id", rid.encode()))
        target = url + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        request = self.client().build_request(scope["method"], target, headers=headers,
                                              content=body())
        started = False
        try:
            response = await self.client().send(request, stream=True)
        except httpx.ConnectError:
            if read:
                raise
            return None
        except httpx.HTTPError as e:
            await _problem(send, 502, "Bad gateway", f"the gateway running this session "
                                                      f"failed to answer: {e!r}")
            return True
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw
                                    if k.lower() not in _HOP]})
            started = True
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except httpx.HTTPError as e:
            log.warning("forwarding to %s broke off: %r", url, e)
            if not started:
                await _problem(send, 502, "Bad gateway", "the gateway running this session "
                                                         f"broke off its answer: {e!r}")
            else:
                raise
        finally:
            await response.aclose()
        return True

