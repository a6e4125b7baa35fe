"""``/v1/sessions/{sid}/kernels``: register serialized IR, launch it."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request

from ..models import KernelRegister, KernelRegistered, LaunchBody, LaunchResult
from ..problems import ProblemError
from .deps import PROBLEM_RESPONSES, KernelIdP, SidP, UserDep, service

router = APIRouter(prefix="/v1/sessions/{sid}/kernels", tags=["kernels"],
                   responses=PROBLEM_RESPONSES)


@router.post("", response_model=KernelRegistered)
async def register_kernel(request: Request, user: UserDep, body: KernelRegister,
                          sid: SidP) -> KernelRegistered:
    """Validate and compile (or load from the shared cache) a kernel's IR. Idempotent: the
    id is the IR's fingerprint. Malformed IR is a 422 naming the problem."""
    svc = service(request)
    async with svc.sessions.use(user, sid, changes=False) as live:
        result, _ = await svc.sessions.call_live(live, {"op": "register", "ir": body.ir})
        await svc.refresh_stats(live)
    kid = result.get("kernel_id")
    if not isinstance(kid, str):
        raise ProblemError(500, "the engine returned no kernel id")
    svc.db.add_kernel(sid, kid, json.dumps(body.ir))
    return KernelRegistered(kernel_id=kid)


@router.post("/{kernel_id}/launch", response_model=LaunchResult)
async def launch_kernel(request: Request, user: UserDep, body: LaunchBody, sid: SidP,
                        kernel_id: KernelIdP) -> LaunchResult:
    """Run a registered kernel as primal, reverse (``grad``) or forward (``fwd``) pass."""
    svc = service(request)
    result, _ = await svc.sessions.call(user, sid, {"op": "launch", "kernel_id": kernel_id,
                                                    "variant": body.variant,
                                                    "args": body.args,
                                                    "arrays": [a.model_dump()
                                                               for a in body.arrays]})
    svc.metrics.launches.labels(body.variant).inc()
    return LaunchResult(result=result.get("result"))
