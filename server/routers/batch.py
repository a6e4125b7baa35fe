"""``/v1/sessions/{sid}/batch``: many ops in one request (a client Tape's launch list)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from difftape.graph import wire

from ..db import User
from ..models import BatchBody, BatchResult, op_count
from ..problems import ProblemError
from .deps import PROBLEM_RESPONSES, SidP, UserDep, service

router = APIRouter(prefix="/v1/sessions/{sid}/batch", tags=["batch"],
                   responses=PROBLEM_RESPONSES)


@router.post("", response_model=BatchResult,
             response_model_exclude_unset=True)  # "output" only when the batch printed
async def run_batch(request: Request, user: UserDep, body: BatchBody,
                    sid: SidP) -> BatchResult:
    """Run the ops in order in one worker round trip; the first error stops the batch and
    its problem carries the failing op's ``index``. The kernel time limit applies to the
    whole batch."""
    return BatchResult(**await run_ops(service(request), user, sid,
                                       [op.model_dump() for op in body.ops]))


async def run_ops(svc, user: User, sid: str, ops: list[dict]) -> dict:
    """The batch itself, validated ops in: quotas and field accounting around one worker
    call. Shared by this route and the gateway's fast path (``server/fastpath.py``). The
    answer's body: ``results``, and ``output`` when its kernels printed
    (``difftape.graph.wire``)."""
    svc.sessions.check(user, sid)
    svc.sessions.check_batch_size(op_count(ops))
    created, companions, extra = svc.sessions.plan_fields(sid, ops)
    with svc.sessions.reserve_fields(user, extra):
        try:
            result, _ = await svc.sessions.call(user, sid, {"op": "batch", "ops": ops})
        except ProblemError as p:
            # The ops before the failing one did run: account for the storage they made.
            index = p.extra.get("index")
            if isinstance(index, int) and index > 0:
                done, comps, _ = svc.sessions.plan_fields(sid, ops[:index])
                svc.sessions.account_fields(sid, done, comps)
            raise
        results = result.get("results", [])
        if created or companions:
            svc.sessions.account_fields(sid, created, companions)
    svc.sessions.record_kernels(sid, ops, results)
    launches = svc.metrics.launch_counters
    for op in ops:
        if op["op"] == "launch":
            launches[op["variant"]].inc()
    body = {"results": results}
    if result.get(wire.OUTPUT) is not None:
        body[wire.OUTPUT] = result[wire.OUTPUT]
    return body

