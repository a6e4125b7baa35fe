"""Bearer-token authentication (every endpoint except /livez and /readyz)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .db import User
from .problems import ProblemError

# auto_error=False: a missing token is our own 401 problem, not FastAPI's 403.
_bearer = HTTPBearer(auto_error=False, description="a token from `difftape token create NAME`")


async def current_user(request: Request,
                 creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
                 ) -> User:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise ProblemError(401, "missing bearer token",
                           headers={"WWW-Authenticate": "Bearer"})
    # async and in the loop: the lookup is a dict hit (or one indexed SQLite read), cheaper
    # than the thread hop FastAPI makes for a sync dependency.
    user = request.app.state.service.db.user_by_token(creds.credentials)
    if user is None:
        raise ProblemError(401, "invalid token", headers={"WWW-Authenticate": "Bearer"})
    return user
