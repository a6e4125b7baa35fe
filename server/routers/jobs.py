"""Jobs: ``POST /v1/sessions/{sid}/jobs`` (202), then ``/v1/jobs/{id}`` status, SSE
progress, cancel, result."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from difftape.graph import wire

from ..jobs import TERMINAL
from ..models import JobInfo, JobResult, JobSubmit, op_count
from ..problems import ProblemError
from .deps import PROBLEM_RESPONSES, JobIdP, SidP, UserDep, service

router = APIRouter(tags=["jobs"], responses=PROBLEM_RESPONSES)


def _info(svc, row) -> JobInfo:
    done = row["done"]
    job = svc.jobs.active.get((row["owner"], row["id"]))
    if job is not None:
        done = job.done
    return JobInfo(job_id=row["id"], session_id=row["session"], state=row["state"],
                   done=done, total=row["total"], created=row["created"],
                   started=row["started"], finished=row["finished"],
                   problem=json.loads(row["problem"]) if row["problem"] else None)


@router.post("/v1/sessions/{sid}/jobs", status_code=202, response_model=JobInfo)
async def submit_job(request: Request, user: UserDep, body: JobSubmit,
                     sid: SidP) -> Response:
    """Queue the ops as a job. With a ``job_id`` you chose, resubmitting is safe: the job
    runs once and every submission answers with it."""
    svc = service(request)
    ops = [op.model_dump() for op in body.ops]
    svc.sessions.check_batch_size(op_count(ops))
    created, _companions, extra = svc.sessions.plan_fields(sid, ops)
    if extra:
        svc.sessions.check_field_quota(user, extra)
    row, _new = await svc.jobs.submit(user, sid, ops, body.job_id)
    return JSONResponse(_info(svc, row).model_dump(), status_code=202,
                        headers={"Location": f"/v1/jobs/{row['id']}"})


@router.get("/v1/jobs/{job_id}", response_model=JobInfo)
async def job_status(request: Request, user: UserDep, job_id: JobIdP) -> JobInfo:
    svc = service(request)
    return _info(svc, svc.jobs.row(user, job_id))


@router.post("/v1/jobs/{job_id}/cancel", response_model=JobInfo)
async def cancel_job(request: Request, user: UserDep, job_id: JobIdP) -> JobInfo:
    """Cancel: a queued job never runs; a running one stops before its next op."""
    svc = service(request)
    return _info(svc, svc.jobs.cancel(user, job_id))


@router.get("/v1/jobs/{job_id}/result", response_model=JobResult,
            response_model_exclude_unset=True)  # "output" only when the job printed
async def job_result(request: Request, user: UserDep, job_id: JobIdP) -> JobResult:
    """The results of a succeeded job; a failed job answers with its problem."""
    svc = service(request)
    row = svc.jobs.row(user, job_id)
    if row["state"] == "succeeded":
        stored = json.loads(row["result"] or "[]")  # the results; with output, both
        if isinstance(stored, dict):
            return JobResult(job_id=job_id, results=stored["results"],
                             output=stored[wire.OUTPUT])
        return JobResult(job_id=job_id, results=stored)
    if row["state"] == "failed" and row["problem"]:
        raise ProblemError.from_body(json.loads(row["problem"]))
    raise ProblemError(409, f"job {job_id!r} is {row['state']}; it has no result",
                       title="No result", state=row["state"])


@router.get("/v1/jobs/{job_id}/events",
            responses={200: {"description": "server-sent events: `progress` while the job "
                                            "runs, then one `end`",
                             "content": {"text/event-stream": {}}}})
async def job_events(request: Request, user: UserDep, job_id: JobIdP):
    svc = service(request)
    svc.jobs.row(user, job_id)

    async def events():
        last = None
        while True:
            job = svc.jobs.live(user, job_id)
            if job is not None:
                waiter = job.changed
            info = _info(svc, svc.jobs.row(user, job_id))
            data = info.model_dump_json()
            if info.state in TERMINAL:
                yield f"event: end\ndata: {data}\n\n"
                return
            if data != last:
                yield f"event: progress\ndata: {data}\n\n"
                last = data
            if await request.is_disconnected():
                return
            if job is None:
                await asyncio.sleep(0.2)
                continue
            try:
                await asyncio.wait_for(waiter.wait(), timeout=15)
            except TimeoutError:
                yield ": keep-alive\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store"})
