"""What the routers share: the service object and the authenticated user."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from ..auth import current_user
from ..db import User

UserDep = Annotated[User, Depends(current_user)]

SID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

PROBLEM_RESPONSES = {
    400: {"description": "bad request", "content": {"application/problem+json": {}}},
    401: {"description": "missing or invalid token",
          "content": {"application/problem+json": {}}},
    404: {"description": "no such resource for this user",
          "content": {"application/problem+json": {}}},
    410: {"description": "the session was lost (SessionLostError / KernelTimeoutError)",
          "content": {"application/problem+json": {}}},
    422: {"description": "invalid request or a difftape error (CompileError, "
                         "KernelAssertionError, ...)",
          "content": {"application/problem+json": {}}},
    429: {"description": "a quota would be exceeded", "content": {"application/problem+json": {}}},
}


def service(request: Request):
    return request.app.state.service

_ID = r"^[A-Za-z0-9_.:-]+$"
SidP = Annotated[str, Path(pattern=SID_PATTERN)]
FidP = Annotated[int, Path(ge=0, lt=2**31)]
KernelIdP = Annotated[str, Path(min_length=1, max_length=128, pattern=_ID)]
JobIdP = Annotated[str, Path(min_length=1, max_length=128, pattern=_ID)]
