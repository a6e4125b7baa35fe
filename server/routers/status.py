"""The status page: ``GET /status`` (``/`` redirects there), server-rendered HTML.

Behind the same tokens as the API. A browser cannot send an Authorization header by
following a link, so the page also signs in with a form: ``POST /status/login`` takes the
token and keeps it in an HttpOnly, SameSite=Strict cookie read on the page's paths only
(middleware.PAGE_PATHS), never by the API. Without a valid token the page answers 401 with
that form. The page runs no script (its Content-Security-Policy forbids any); it reloads
itself every few seconds with a ``<meta http-equiv="refresh">``. Every value is escaped by
Jinja2's autoescaping: user names and ids are whatever their creators typed.
"""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from ..middleware import TOKEN_COOKIE
from ..status import snapshot
from .deps import service

router = APIRouter(tags=["status"], include_in_schema=False)

_HEADERS = {
    "Cache-Control": "no-store",
    # No script, no foreign resource, no framing: what the page needs and nothing more.
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    # Not no-referrer: under it browsers send "Origin: null" with the sign-in form's POST,
    # which the Origin check (GuardMiddleware) must refuse.
    "Referrer-Policy": "same-origin",
}


def _size(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _duration(s: float | None) -> str:
    if s is None:
        return "unknown"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    if s < 86400:
        return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"
    return f"{int(s // 86400)} d {int(s % 86400 // 3600)} h"


def _utc(t: float | None) -> str:
    """A Unix time as a person reads it, in UTC (the gateways of one database may run in
    different time zones): ``2026-11-24 08:45:03 UTC``."""
    if t is None:
        return "unknown"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _iso(t: float) -> str:
    """A Unix time for a ``<time datetime=...>`` attribute (ISO 8601, UTC)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _percent(x: float | None) -> str:
    return "unknown" if x is None else f"{100 * x:.0f}%"


_env = Environment(loader=FileSystemLoader(Path(__file__).resolve().parent.parent / "templates"),
                   autoescape=select_autoescape(["html"]), trim_blocks=True,
                   lstrip_blocks=True)
_env.filters.update(size=_size, duration=_duration, percent=_percent, utc=_utc, iso=_iso)


def _render(name: str, status: int = 200, **context) -> HTMLResponse:
    html = _env.get_template(name).render(**context)
    headers = dict(_HEADERS)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return HTMLResponse(html, status_code=status, headers=headers)


def _signin(request: Request, invalid: bool) -> HTMLResponse:
    return _render("signin.html", 401, invalid=invalid)


@router.get("/")
async def root() -> RedirectResponse:
    """The status page is the server's front page."""
    return RedirectResponse("/status", status_code=307)


@router.get("/status", response_class=HTMLResponse)
async def status_page(request: Request,
                      refresh: int = Query(5, ge=0, le=3600,
                                           description="reload every this many seconds "
                                                       "(0: never)")) -> HTMLResponse:
    state = request.scope.get("state", {})
    user = state.get("user")
    if user is None:
        return _signin(request, invalid=state.get("token_given", False))
    snap = await snapshot(service(request), user)
    return _render("status.html", s=snap, refresh=refresh)


def _secure(request: Request) -> bool:
    """Whether the browser reached us over HTTPS (directly or through a TLS proxy)."""
    proto = request.headers.get("x-forwarded-proto", request.url.scheme)
    return proto.split(",")[0].strip().lower() == "https"


@router.post("/status/login")
async def login(request: Request) -> Response:
    """The sign-in form: a valid token goes into the page's cookie (303 to the page)."""
    form = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=4)
    token = (form.get("token") or [""])[0].strip()
    if not token or service(request).db.user_by_token(token) is None:
        return _signin(request, invalid=bool(token))
    r = RedirectResponse("/status", status_code=303)
    r.set_cookie(TOKEN_COOKIE, token, path="/status", httponly=True, samesite="strict",
                 secure=_secure(request))
    return r


@router.post("/status/logout")
async def logout(request: Request) -> Response:
    r = RedirectResponse("/status", status_code=303)
    r.delete_cookie(TOKEN_COOKIE, path="/status", httponly=True, samesite="strict",
                    secure=_secure(request))
    return r
