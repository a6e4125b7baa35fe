"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import functools
import os
import tempfile

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..models import Health
from .deps import UserDep, service

router = APIRouter(tags=["health"])


@router.get("/livez", response_model=Health)
async def livez() -> Health:
    """The gateway's event loop answers: nothing more (a restart would not fix the rest)."""
    return Health(status="ok")


def _cache_writable(path) -> str | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path, prefix=".readyz-")
        os.close(fd)
        os.unlink(name)
        return None
    except OSError as e:
        return str(e)


@functools.cache
def device_check(arch: str) -> str:
    """"ok" when the engine's arch can run here: always for the CPU; for CUDA the check
    ``ti.init(arch=ti.cuda)`` makes (runtime/cuda.py: pycuda, the driver, a device), else
    why not (asked once: devices do not come and go). The engines (worker processes) open
    the device themselves."""
    if arch == "cpu":
        return "ok"
    # Function-level: the gateway does not load difftape (nor pycuda) unless it serves a GPU.
    from difftape.runtime import cuda as cuda_runtime

    reason = cuda_runtime.why_unavailable()
    return "ok" if reason is None else f"arch {arch!r} cannot run here: {reason}"


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(request: Request):
    """Ready when a worker (engine and LLVM) has started, the device is one this build
    drives, the compiled-code cache is writable and the database answers."""
    svc = service(request)
    pool = svc.pool
    checks = {
        "worker": "ok" if pool.started_ok and pool.start_error is None
        else (pool.start_error or "starting"),
        "device": device_check(svc.settings.arch),
        "cache": _cache_writable(svc.settings.cache_dir) or "ok",
        "database": "ok" if svc.db.ping() else "unavailable",
    }
    ok = all(v == "ok" for v in checks.values())
    device = None
    if svc.settings.arch != "cpu" and checks["device"] == "ok":
        # The workers hold the device's context; the gateway shows what they last reported
        # (/metrics refreshes it), or the device's identity until one has.
        device = svc.metrics.totals().device or device_identity()
    health = Health(status="ok" if ok else "unavailable", checks=checks, device=device)
    return JSONResponse(health.model_dump(exclude_none=True), status_code=200 if ok else 503)


@functools.cache
def device_identity() -> dict:
    """The device the engines use (name, ordinal, total memory), read without a context."""
    from difftape.runtime import cuda as cuda_runtime

    d = cuda_runtime.select_device(cuda_runtime.load_driver())
    return {"name": d.name, "ordinal": d.ordinal, "memory_total": d.total_memory}


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request, user: UserDep) -> Response:
    """Prometheus text format (bearer token required, like everything but the probes)."""
    svc = service(request)
    await svc.refresh_all_stats()
    return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)
