"""``/v1/sessions``: create, list, inspect, delete, resume."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..models import SessionCreate, SessionInfo, SessionList
from .deps import PROBLEM_RESPONSES, SidP, UserDep, service

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=PROBLEM_RESPONSES)


def _info(row) -> SessionInfo:
    return SessionInfo(session_id=row["id"], arch=row["arch"], state=row["state"],
                       field_bytes=row["field_bytes"], created=row["created"],
                       last_activity=row["last_activity"], lost_reason=row["lost_reason"],
                       scratch_bytes=row["scratch_bytes"])


@router.post("", status_code=201, response_model=SessionInfo)
async def create_session(request: Request, user: UserDep,
                         body: SessionCreate | None = None) -> SessionInfo:
    """Start a session: a worker process with its own difftape program (a Ray actor
    reserving ``resources`` when the server runs on a cluster)."""
    svc = service(request)
    resources = (body.resources.model_dump(exclude_none=True)
                 if body is not None and body.resources is not None else None)
    sid = await svc.sessions.create(user, resources)
    return _info(svc.db.session(sid))


@router.get("", response_model=SessionList)
async def list_sessions(request: Request, user: UserDep) -> SessionList:
    return SessionList(sessions=[_info(r) for r in service(request).db.sessions_of(user.id)])


@router.get("/{sid}", response_model=SessionInfo)
async def get_session(request: Request, user: UserDep, sid: SidP) -> SessionInfo:
    return _info(service(request).sessions.row(user, sid))


@router.delete("/{sid}", status_code=204)
async def delete_session(request: Request, user: UserDep, sid: SidP) -> Response:
    await service(request).sessions.delete(user, sid)
    return Response(status_code=204)


@router.post("/{sid}/resume", response_model=SessionInfo)
async def resume_session(request: Request, user: UserDep, sid: SidP) -> SessionInfo:
    """Bring a culled session back (any other request on it does this too)."""
    svc = service(request)
    await svc.sessions.resume(user, sid)
    return _info(svc.db.session(sid))
