"""``ti.ad``: the Tape, custom gradients and gradient utilities.

A :class:`Tape` records the kernel launches made inside its ``with`` block (with their
arguments) and, on exit, seeds ``loss.grad[None] = 1`` and runs the adjoint kernels in reverse
order. Each recorded kernel's adjoint is compiled when it is first recorded, so a kernel whose
gradient cannot be computed correctly is refused (``GradientRuleError``) before it runs.

Program-level AD API: the tape (``tape``), jvp/vjp/jacobian/hessian of programs of kernel
launches (``functional``), Newton's method on them (``newton``) and the tape's graph
(``graph``) sit on the frontend; the IR
transforms they drive are in ``difftape.autodiff``.
"""

from __future__ import annotations

from ..errors import DifftapeError
from ..frontend.decorators import Func
from ..frontend.field import Field
from ..runtime import program
from . import functional as _fn
from .functional import clear_all_duals, hessian, hvp, jacobian
from .newton import NewtonResult, newton
from .tape import (
    GradientCheckError,
    GradientRuleError,
    Tape,
    _Entry,
    clear_all_gradients,
    grad_for,
    grad_replaced,
    no_grad,
    prog_tape_off,
)

__all__ = ["Tape", "FwdMode", "clear_all_gradients", "clear_all_duals", "grad_for",
           "grad_replaced", "no_grad", "GradientCheckError", "grad", "jvp", "vjp", "jacobian",
           "hvp", "hessian", "newton", "NewtonResult", "GradientRuleError"]

_ = (_Entry, prog_tape_off)  # names ti.ad had before the split (difftape.client uses _Entry)


# ---------------------------------------------------------------------------------------------
# forward mode


class FwdMode:
    """``with ti.ad.FwdMode(loss=y, param=x, seed=[...]): ...``: kernels launched inside run in
    forward mode, so on exit ``y.dual`` holds the derivative of ``y`` along ``seed``.

    ``loss``: a field or list of fields with dual storage. ``param``: a float field with dual
    storage; ``seed`` its tangent (default ``[1.0]`` for a 0-D param; required otherwise, one
    value per element). ``clear_gradients``: zero every ``.dual`` on entry. The seed is cleared
    on exit, as in Taichi.
    """

    def __init__(self, loss, param: Field, seed=None, clear_gradients: bool = True) -> None:
        self.losses = list(loss) if isinstance(loss, list | tuple) else [loss]
        self.param = param
        self.seed = seed
        self.clear_gradients = clear_gradients
        self._mode: _fn.forward_mode | None = None

    @program.entry_point
    def __enter__(self) -> FwdMode:
        p = self.param
        for f in [p, *self.losses]:
            if not isinstance(f, Field):
                raise DifftapeError(f"ti.ad.FwdMode: expected fields, got {type(f).__name__}")
            if not f.has_dual:
                raise DifftapeError(f"ti.ad.FwdMode: '{f._label()}' has no dual storage; create "
                                    "it with needs_dual=True or call ti.root.lazy_dual()")
        if program.get().tape is not None:
            raise DifftapeError("ti.ad.FwdMode cannot run inside a ti.ad.Tape; for second "
                                "derivatives put the Tape inside the FwdMode, or use ti.ad.hvp")
        seed = self.seed
        size = _fn._size(p)
        if seed is None:
            if size != 1:
                raise DifftapeError(f"ti.ad.FwdMode: param '{p._label()}' has {size} "
                                    "elements; give seed= (one value per element)")
            seed = [1.0]
        value = _fn._as_seed(p, seed, "seed")
        if self.clear_gradients:
            clear_all_duals()
        if size == 1:
            p.dual.fill(value.reshape(-1)[0])  # (remote: queued, no round trip)
        else:
            p.dual.from_numpy(value)
        self._mode = _fn.forward_mode(self)
        self._mode.__enter__()
        return self

    @program.entry_point
    def __exit__(self, exc_type, exc, tb) -> bool:
        self._mode.__exit__(exc_type, exc, tb)
        self.param.dual.fill(0)
        return False


def grad(f, argnums: int | tuple[int, ...] = 0):
    """``ti.ad.grad(f)``: for a ``@ti.func`` f returning a scalar, a func (callable inside
    kernels) computing its gradient with respect to argument ``argnums``, derived at compile
    time: ``dfdx = ti.ad.grad(f)`` then ``dfdx(1.0)`` in a kernel."""
    return _derived_func()(f, "grad", argnums)


def jvp(f, *args, **kwargs):
    """``ti.ad.jvp(func)``: a func ``(*primals, *tangents) -> (value, J @ tangents)`` for a
    ``@ti.func``. ``ti.ad.jvp(fn, inputs, tangents, outputs)``: run a Python program of kernel
    launches in forward mode with those input tangents; returns the outputs' tangents."""
    DerivedFunc = _derived_func()
    if isinstance(f, Func | DerivedFunc) and not args and not kwargs:
        return DerivedFunc(f, "jvp")
    return _fn.jvp(f, *args, **kwargs)


def vjp(f, *args, **kwargs):
    """``ti.ad.vjp(func)``: a func ``(*primals, cotangent) -> (value, *J^T @ cotangent)``.
    ``ti.ad.vjp(fn, inputs, outputs, cotangents)``: record a Python program of kernel
    launches, seed its outputs' gradients with the cotangents and back-propagate; returns the
    inputs' gradients."""
    DerivedFunc = _derived_func()
    if isinstance(f, Func | DerivedFunc) and not args and not kwargs:
        return DerivedFunc(f, "vjp")
    return _fn.vjp(f, *args, **kwargs)


def _derived_func() -> type:
    """``DerivedFunc`` (frontend/funcs.py): derivatives of ``@ti.func``s."""
    # Function-level: it loads forward mode (~5 ms of import) on the first ti.ad.grad/jvp/vjp.
    from ..frontend.funcs import DerivedFunc

    return DerivedFunc
