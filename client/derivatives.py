"""``ti.ad.jacobian``, ``hessian``, ``hvp``, ``newton`` and ``Tape(grad_check=...)`` under
``arch=ti.remote``: one request each.

Locally these loop in Python over launches and reads (a Hessian of n parameters is n
Hessian-vector products, each a forward-over-reverse pass and a read). Remotely every read
would be a round trip, so the client runs the user's Python function once in *recording*
mode (``RemoteRuntime.recording``: the frontend and the autodiff checks run here as usual,
the launches it makes are captured, not sent) and sends the captured program with the loop's
description as one engine op (``sweep``, ``newton``, ``grad_check``; server/PROTOCOL.md). The server
repeats the program with each seed, exactly as the local loop does (same clears, seeds,
launches and reads, in the same order), so the results are the local ones bit for bit. No
client code runs on the server: the program is IR the client registered plus plain ops.

A function that needs a value from the server while it runs (it reads a field, or launches
a kernel returning a value) cannot be recorded: these functions then return None and the
caller runs the local loop, whose round trips ``ti.remote_stats()`` shows.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from difftape.ad import Tape
from difftape.ad import functional as _fn
from difftape.ad.functional import forward_mode
from difftape.ad.newton import NewtonResult
from difftape.frontend.field import Field, root
from difftape.ir.serialize import from_jsonable

if TYPE_CHECKING:
    from .runtime import RemoteRuntime


class Unrecordable(Exception):
    """A block being recorded as a server-side program needs an answer from the server
    while it runs (internal: the caller runs the block the ordinary way instead)."""


def _ids(fields: list[Field]) -> list[int]:
    return [f.id for f in fields]


def _record(rt: RemoteRuntime, block: Callable[[], object]) -> list[dict] | None:
    try:
        with rt.recording() as ops:
            block()
    except Unrecordable:
        return None
    return ops


def jacobian(rt: RemoteRuntime, fn: Callable[[], object], ins: list[Field],
             outs: list[Field], mode: str) -> np.ndarray | None:
    """The remote half of ``ti.ad.jacobian`` (mode already resolved); None: run it
    locally."""
    n_in = sum(_fn._size(f) for f in ins)
    n_out = sum(_fn._size(f) for f in outs)
    if mode == "forward":
        _fn._ensure_duals()

        def forward() -> None:
            with forward_mode():
                fn()

        program = _record(rt, forward)
        if program is None:
            return None
        cols = _columns(rt, {"clear": "clear_duals",
                             "seed": {"role": "dual", "fields": _ids(ins)},
                             "program": program,
                             "read": {"role": "dual", "fields": _ids(outs)},
                             "after": [{"op": "clear_duals"}]}, n_in, n_out)
        return np.ascontiguousarray(cols.T)
    root.lazy_grad()
    tape = Tape(loss=None)

    def record() -> None:
        with tape:
            fn()

    before = _record(rt, record)
    if before is None:
        return None
    program = _record(rt, lambda: _fn._backward(tape))
    if program is None:
        return None
    return _columns(rt, {"before": before, "clear": "clear_grads",
                         "seed": {"role": "grad", "fields": _ids(outs)},
                         "program": program,
                         "read": {"role": "grad", "fields": _ids(ins)}}, n_out, n_in)


def _columns(rt: RemoteRuntime, op: dict, count: int, length: int,
             vectors: np.ndarray | None = None) -> np.ndarray:
    """Send one sweep (after everything queued); its columns, (count, length) float64. Seeds
    and columns travel as raw float64 bytes (base64 inside the batch)."""
    wire = None if vectors is None else _b64(vectors)
    res = rt.call({"op": "sweep", "vectors": wire, **op})
    out = np.frombuffer(base64.b64decode(res["columns"]), dtype="<f8")
    return out.reshape(count, length)


def _b64(values: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f8").tobytes()).decode("ascii")


def second_order(rt: RemoteRuntime, fn: Callable[[], object], loss: Field,
                 ps: list[Field], vectors: list[np.ndarray] | None) -> np.ndarray | None:
    """Hessian-vector products of ``loss`` w.r.t. ``ps`` for the given seed vectors (one
    per column, in the params' dtypes), or for every one-hot vector (the dense Hessian) when
    ``vectors`` is None. Returns (columns, param scalars); None: run it locally."""
    _fn._ensure_second_order()

    def block() -> None:
        with forward_mode():
            with Tape(loss):
                fn()

    program = _record(rt, block)
    if program is None:
        return None
    n = sum(_fn._size(p) for p in ps)
    wire = None if vectors is None else np.stack([v.astype(np.float64) for v in vectors])
    count = n if vectors is None else len(vectors)
    return _columns(rt, {"clear": "clear_duals",
                         "seed": {"role": "dual", "fields": _ids(ps)},
                         "program": program,
                         "read": {"role": "grad_dual", "fields": _ids(ps)},
                         "after": [{"op": "clear_duals"}]}, count, n, wire)


def newton(rt: RemoteRuntime, fn: Callable[[], object], loss: Field, ps: list[Field],
           tol: float, max_iter: int) -> NewtonResult | None:
    """``ti.ad.newton`` as one request: ``fn`` recorded three ways (under the Tape over the
    loss, under forward-over-reverse for the Hessian, and alone for the line search) and the
    iteration run by the server (difftape.ad.newton.iterate, as locally). None: run it
    locally."""
    _fn._ensure_second_order()

    def value_grad() -> None:
        with Tape(loss):
            fn()

    def second() -> None:
        with forward_mode():
            with Tape(loss):
                fn()

    programs = {}
    for key, block in (("value_grad", value_grad), ("hessian", second), ("primal", fn)):
        program = _record(rt, block)
        if program is None:
            return None
        programs[key] = program
    res = rt.call({"op": "newton", "loss": loss.id, "params": _ids(ps), "tol": tol,
                   "max_iter": max_iter, **programs})
    return NewtonResult(int(res["iterations"]), float(from_jsonable(res["loss"])),
                        float(from_jsonable(res["grad_norm"])), bool(res["converged"]))
