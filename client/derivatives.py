"""``ti.ad.jacobian``, ``hessian``, ``hvp`` and ``Tape(grad_check=...)`` under
``arch=ti.remote``: one request each.

Locally these loop in Python over launches and reads (a Hessian of n parameters is n
Hessian-vector products, each a forward-over-reverse pass and a read). Remotely every read
would be a round trip, so the client runs the user's Python function once in *recording*
mode (``RemoteRuntime.recording``: the frontend and the autodiff checks run here as usual,
the launches it makes are captured, not sent) and sends the captured program with the loop's
description as one engine op (``sweep``, ``grad_check``; server/PROTOCOL.md). The server
repeats the program with each seed, exactly as the local loop does (same clears, seeds,
launches and reads, in the same order), so the results are the local ones bit for bit. No
client code runs on the server: the program is IR the client registered plus plain ops.

A function that needs a value from the server while it runs (it reads a field, or launches
a kernel returning a value) cannot be recorded: these functions then return None and the
caller runs the local loop, whose round trips ``ti.remote_stats()`` shows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from difftape.ad import Tape
from difftape.ad import functional as _fn
from difftape.ad.functional import forward_mode
from difftape.frontend.field import Field, root
from difftape.ir.serialize import from_jsonable, jsonable

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
             vectors: list | None = None) -> np.ndarray:
    """Send one sweep (after everything queued); its columns, (count, length) float64."""
    res = rt.call({"op": "sweep", "vectors": vectors, **op})["columns"]
    out = np.array([from_jsonable(c) for c in res], dtype=np.float64)
    return out.reshape(count, length)


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
    wire = None if vectors is None else [jsonable(v.astype(np.float64).tolist())
                                         for v in vectors]
    count = n if vectors is None else len(vectors)
    return _columns(rt, {"clear": "clear_duals",
                         "seed": {"role": "dual", "fields": _ids(ps)},
                         "program": program,
                         "read": {"role": "grad_dual", "fields": _ids(ps)},
                         "after": [{"op": "clear_duals"}]}, count, n, wire)
