"""Bearer-token authentication (every endpoint except the probes and the API docs).

The token is checked by ``middleware.AuthMiddleware`` before the application reads the
request's body; this dependency hands the user it found to the routes (and documents the
scheme in the OpenAPI schema).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .db import User
from .middleware import MISSING_TOKEN
from .problems import ProblemError

# auto_error=False: a missing token is our own 401 problem, not FastAPI's 403.
_bearer = HTTPBearer(auto_error=False, description="a token from `difftape token create NAME`")


async def current_user(request: Request,
                       creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
                       ) -> User:
    user = request.scope.get("state", {}).get("user")
    if user is None:  # the middleware lets only public paths through without a user
        raise ProblemError(401, MISSING_TOKEN, headers={"WWW-Authenticate": "Bearer"})
    return user
