"""Derivatives of Python programs that launch kernels: Jacobian-vector and vector-Jacobian
products with arbitrary seeds (Dr.Jit's ``forward_to``/``backward_to``), dense Jacobians that
pick the cheaper mode, and second order by forward-over-reverse (Hessian-vector products).

``fn`` is a Python callable with no arguments that launches kernels reading the ``inputs`` and
writing the ``outputs`` (fields). It is run once per pass: it should compute its outputs from
scratch (clear accumulators first), as a Tape-recorded program does.

Intermediate fields carry tangents only if they have ``.dual`` storage, and gradients only if
they have ``.grad``: ``jvp``, ``vjp`` and ``jacobian`` allocate what is missing on every float
field (``ti.root.lazy_dual()`` / ``lazy_grad()``) so that every chain of kernels is
differentiated; ``hvp``/``hessian`` differentiate what a Tape would (fields with
``needs_grad``), giving those ``.dual`` and ``.grad.dual``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..autodiff.lost import LostTracker
from ..errors import DifftapeError
from ..frontend.field import Field, root
from ..runtime import program, progress
from .tape import Tape, clear_all_gradients


class forward_mode:
    """Kernels launched inside run their forward-mode variant (value and tangent). While it
    is active it is ``program.fwd``; ``lost`` tracks tangents dropped by storage without
    ``.dual`` (:mod:`.lost`)."""

    def __init__(self, owner: object = True) -> None:
        self.owner = owner
        self.lost = LostTracker("forward")

    def __enter__(self) -> None:
        prog = program.get()
        if prog.fwd is not None:
            raise DifftapeError("forward-mode blocks (ti.ad.FwdMode, jvp, hvp) cannot be nested")
        prog.fwd = self

    def __exit__(self, *exc) -> None:
        program.get().fwd = None


def clear_all_duals() -> None:
    """Zero the ``.dual`` (and ``.grad.dual``) of every field of the current program."""
    prog = program.get()
    if prog.remote is not None:  # arch=ti.remote: one queued op (difftape.client)
        prog.remote.clear_duals()
        return
    for f in list(prog.fields.values()):
        for d in (f.companion("dual"), f.companion("grad_dual")):
            if d is not None:
                prog.zero(d.storage)


def _fields(xs) -> list[Field]:
    xs = list(xs) if isinstance(xs, list | tuple) else [xs]
    for f in xs:
        if not isinstance(f, Field) or not f.dtype.is_float:
            raise DifftapeError(f"expected float fields, got {f!r}")
    return xs


def _full_shape(f: Field) -> tuple[int, ...]:
    return tuple(f.shape) + tuple(f.element_shape)


def _size(f: Field) -> int:
    return int(np.prod(_full_shape(f), dtype=np.int64))


def _as_seed(f: Field, v, what: str) -> np.ndarray:
    """``v`` as an array of ``f``'s full shape (values are checked, not broadcast)."""
    a = np.asarray(v, dtype=f.dtype.np)
    shape = _full_shape(f)
    if a.size != _size(f):
        raise DifftapeError(f"{what} for '{f._label()}' has {a.size} values; the field has "
                            f"{_size(f)} (shape {shape})")
    return a.reshape(shape)


def _flat(f: Field) -> np.ndarray:
    return f.to_numpy().reshape(-1)


def _one_hot(f: Field, k: int) -> np.ndarray:
    e = np.zeros(_size(f), dtype=f.dtype.np)
    e[k] = 1
    return e.reshape(_full_shape(f))


def _ensure_duals() -> None:
    root.lazy_dual()


def _ensure_second_order() -> None:
    """Fields with gradient storage (those a Tape differentiates) get ``.dual`` and
    ``.grad.dual``; fields without stay out of it, exactly as under a Tape."""
    for f in list(program.get().fields.values()):
        if not f.has_grad:
            continue
        f._make_companion("dual")
        f.grad._make_companion("dual")


def _need_grads(ps: list[Field]) -> None:
    for p in ps:
        if not p.has_grad:
            raise DifftapeError(f"hvp: param '{p._label()}' has no gradient storage; create it "
                                "with needs_grad=True (as for a Tape)")


def _split(flat: np.ndarray, fields: list[Field]) -> list[np.ndarray]:
    """A flat float64 vector back into per-field arrays of their dtypes and shapes."""
    out, k = [], 0
    for f in fields:
        n = _size(f)
        out.append(flat[k:k + n].astype(f.dtype.np).reshape(_full_shape(f)))
        k += n
    return out


@program.entry_point
def jvp(fn: Callable[[], object], inputs: Sequence[Field] | Field, tangents,
        outputs: Sequence[Field] | Field) -> list[np.ndarray]:
    """Run ``fn`` in forward mode with ``inputs``' tangents set to ``tangents`` and return the
    outputs' tangents (J @ t), one array per output field."""
    ins, outs = _fields(inputs), _fields(outputs)
    ts = tangents if isinstance(inputs, list | tuple) else [tangents]
    if len(ts) != len(ins):
        raise DifftapeError(f"jvp: {len(ins)} inputs but {len(ts)} tangents")
    _ensure_duals()
    clear_all_duals()
    for f, t in zip(ins, ts, strict=True):
        f.dual.from_numpy(_as_seed(f, t, "the tangent"))
    with forward_mode():
        fn()
    result = [o.dual.to_numpy() for o in outs]
    clear_all_duals()
    return result


def _record(fn: Callable[[], object]):
    root.lazy_grad()
    tape = Tape(loss=None)
    with tape:
        fn()
    return tape


def _backward(tape) -> None:
    with tape.ordered():
        for entry in reversed(tape.entries):
            if entry.backward is None:
                raise DifftapeError(f"'{entry.name}' has no registered gradient")
            entry.backward(*entry.args, **entry.kwargs)


@program.entry_point
def vjp(fn: Callable[[], object], inputs: Sequence[Field] | Field,
        outputs: Sequence[Field] | Field, cotangents) -> list[np.ndarray]:
    """Run ``fn`` recorded, seed ``outputs``' ``.grad`` with ``cotangents`` and back-propagate;
    returns the inputs' gradients (J^T @ u), one array per input field."""
    ins, outs = _fields(inputs), _fields(outputs)
    us = cotangents if isinstance(outputs, list | tuple) else [cotangents]
    if len(us) != len(outs):
        raise DifftapeError(f"vjp: {len(outs)} outputs but {len(us)} cotangents")
    tape = _record(fn)
    clear_all_gradients()
    for f, u in zip(outs, us, strict=True):
        f.grad.from_numpy(_as_seed(f, u, "the cotangent"))
    _backward(tape)
    return [f.grad.to_numpy() for f in ins]


@program.entry_point
def jacobian(fn: Callable[[], object], inputs: Sequence[Field] | Field,
             outputs: Sequence[Field] | Field, mode: str = "auto") -> np.ndarray:
    """The dense Jacobian d(outputs)/d(inputs), shape (output scalars, input scalars), both
    flattened in field order. ``mode``: "forward" (one pass per input scalar), "reverse" (one
    recording, then one backward pass per output scalar) or "auto" (fewer passes)."""
    ins, outs = _fields(inputs), _fields(outputs)
    n_in = sum(_size(f) for f in ins)
    n_out = sum(_size(f) for f in outs)
    if mode == "auto":
        mode = "forward" if n_in <= n_out else "reverse"
    remote = program.get().remote
    if remote is not None and mode in ("forward", "reverse"):
        jac = remote.jacobian(fn, ins, outs, mode)  # one request (difftape.client)
        if jac is not None:
            return jac
    jac = np.zeros((n_out, n_in), dtype=np.float64)
    if mode == "forward":
        _ensure_duals()
        col = 0
        with progress.bar(n_in, "jacobian (forward)", unit="column") as pb:
            for f in ins:
                for k in range(_size(f)):
                    clear_all_duals()
                    f.dual.from_numpy(_one_hot(f, k))
                    with forward_mode():
                        fn()
                    jac[:, col] = np.concatenate([_flat(o.dual) for o in outs])
                    col += 1
                    pb.update()
        clear_all_duals()
    elif mode == "reverse":
        tape = _record(fn)
        row = 0
        with progress.bar(n_out, "jacobian (reverse)", unit="row") as pb:
            for o in outs:
                for k in range(_size(o)):
                    clear_all_gradients()
                    o.grad.from_numpy(_one_hot(o, k))
                    _backward(tape)
                    jac[row] = np.concatenate([_flat(f.grad) for f in ins])
                    row += 1
                    pb.update()
    else:
        raise DifftapeError(f"jacobian: mode must be 'auto', 'forward' or 'reverse', got "
                            f"{mode!r}")
    return jac


@program.entry_point
def hvp(fn: Callable[[], object], loss: Field, params: Sequence[Field] | Field, vectors
        ) -> np.ndarray | list[np.ndarray]:
    """The Hessian of the scalar ``loss`` with respect to ``params`` times ``vectors``, in one
    forward-mode pass of ``fn`` and one forward-over-reverse pass of its adjoint. The gradient
    is left in ``params``' ``.grad`` as a Tape would leave it. Returns one array per param (a
    single array for a single param)."""
    ps = _fields(params)
    vs = vectors if isinstance(params, list | tuple) else [vectors]
    if len(vs) != len(ps):
        raise DifftapeError(f"hvp: {len(ps)} params but {len(vs)} vectors")
    _need_grads(ps)
    remote = program.get().remote
    if remote is not None:  # one request (difftape.client)
        seed = np.concatenate([_as_seed(p, v, "the vector").reshape(-1)
                               for p, v in zip(ps, vs, strict=True)])
        cols = remote.second_order(fn, loss, ps, [seed])
        if cols is not None:
            out = _split(cols[0], ps)
            return out if isinstance(params, list | tuple) else out[0]
    _ensure_second_order()
    clear_all_duals()
    for p, v in zip(ps, vs, strict=True):
        p.dual.from_numpy(_as_seed(p, v, "the vector"))
    with forward_mode():
        with Tape(loss):
            fn()
    out = [p.grad.dual.to_numpy() for p in ps]
    clear_all_duals()
    return out if isinstance(params, list | tuple) else out[0]


@program.entry_point
def hessian(fn: Callable[[], object], loss: Field, params: Sequence[Field] | Field,
            max_params: int = 4096) -> np.ndarray:
    """The dense Hessian of ``loss`` with respect to ``params`` (flattened in order), one
    Hessian-vector product per parameter scalar."""
    ps = _fields(params)
    n = sum(_size(p) for p in ps)
    if n > max_params:
        raise DifftapeError(f"hessian: {n} parameters means {n} Hessian-vector products; "
                            f"raise max_params (now {max_params}) if that is intended, or "
                            "use ti.ad.hvp")
    remote = program.get().remote
    if remote is not None:  # one request (difftape.client)
        _need_grads(ps)
        cols = remote.second_order(fn, loss, ps, None)
        if cols is not None:
            return np.ascontiguousarray(cols.T)
    h = np.zeros((n, n), dtype=np.float64)
    with progress.bar(n, "hessian", unit="column") as pb:
        for col in range(n):
            e = np.zeros(n)
            e[col] = 1
            vs, k = [], 0
            for p in ps:
                vs.append(e[k:k + _size(p)])
                k += _size(p)
            cols = hvp(fn, loss, ps, vs)
            h[:, col] = np.concatenate([c.reshape(-1) for c in cols])
            pb.update()
    return h
