"""``ti.ad.newton``: minimise a loss with Newton's method on exact Hessians.

A Newton iteration is a gradient (one Tape), a dense Hessian (forward-over-reverse, one
Hessian-vector product per parameter), a linear solve and a backtracking line search that
evaluates the loss until it decreases enough. Written as a Python loop over launches and reads,
every read is a round trip under ``arch=ti.remote``; so the iteration is written once, here,
against five primitives (:class:`Steps`), and run either by :class:`LocalSteps` (the program's
own fields) or by the server's engine over programs the client recorded (one request for the
whole solve). Both run this same function, so a remote solve takes the same steps, in the same
floating-point order, as a local one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import DifftapeError
from ..frontend.field import Field
from ..runtime import program
from . import functional as _fn
from .tape import Tape

#: The Armijo constant of the line search, and the smallest step it tries before giving up.
ARMIJO = 1e-4
MIN_STEP = 1e-8
#: Near the minimum, loss changes fall below rounding: a decrease within this many ulps of the
#: loss is accepted (otherwise the line search would halve the step down to MIN_STEP).
ROUNDING = 1e-14
#: The server refuses larger solves in one request (each iteration is a dense Hessian).
MAX_ITER_LIMIT = 10_000


@dataclass(frozen=True)
class NewtonResult:
    """How a Newton solve ended: the iterations taken, the loss and gradient norm at the
    returned parameters, and whether the gradient norm fell below ``tol``."""

    iterations: int
    loss: float
    grad_norm: float
    converged: bool


class Steps(Protocol):
    """What one Newton iteration needs, over the parameters flattened to float64."""

    def value_and_grad(self) -> tuple[float, np.ndarray]: ...
    def hessian(self) -> np.ndarray: ...
    def get(self) -> np.ndarray: ...
    def set(self, flat: np.ndarray) -> None: ...
    def value(self) -> float: ...


def iterate(steps: Steps, tol: float, max_iter: int) -> NewtonResult:
    """Newton's method with a backtracking (Armijo) line search; the parameters are left at
    the last accepted point."""
    for it in range(max_iter):
        e, g = steps.value_and_grad()
        gn = float(np.linalg.norm(g))
        if gn < tol:
            return NewtonResult(it, e, gn, True)
        h = steps.hessian()
        try:
            step = -np.linalg.solve(h, g)
        except np.linalg.LinAlgError:
            raise DifftapeError(
                f"ti.ad.newton: the Hessian is singular at iteration {it} (loss {e:.6g}, "
                f"gradient norm {gn:.3g}); Newton's method needs a strictly convex loss "
                "near the solution: add a regularising term, or use gradient descent") from None
        slope = float(g @ step)
        x0 = steps.get()
        t = 1.0
        while True:
            steps.set(x0 + t * step)
            if steps.value() <= e + ARMIJO * t * slope + ROUNDING * abs(e) or t < MIN_STEP:
                break
            t *= 0.5
    e, g = steps.value_and_grad()
    gn = float(np.linalg.norm(g))
    return NewtonResult(max_iter, e, gn, gn < tol)


def check_options(tol: float, max_iter: int) -> None:
    if not (isinstance(max_iter, int) and 0 <= max_iter <= MAX_ITER_LIMIT):
        raise DifftapeError(f"ti.ad.newton: max_iter must be an integer in [0, "
                            f"{MAX_ITER_LIMIT}], got {max_iter!r}")
    if not (float(tol) >= 0):
        raise DifftapeError(f"ti.ad.newton: tol must be a non-negative number, got {tol!r}")


class LocalSteps:
    """The primitives over the current program's own fields (``fn`` recomputes ``loss``
    from scratch, as for ``ti.ad.hessian``)."""

    def __init__(self, fn: Callable[[], object], loss: Field, params: list[Field]) -> None:
        self.fn, self.loss, self.params = fn, loss, params

    def _loss(self) -> float:
        return float(self.loss.to_numpy().reshape(-1)[0])

    def value_and_grad(self) -> tuple[float, np.ndarray]:
        with Tape(self.loss):
            self.fn()
        return self._loss(), np.concatenate(
            [p.grad.to_numpy().reshape(-1).astype(np.float64) for p in self.params])

    def hessian(self) -> np.ndarray:
        return _fn.hessian(self.fn, self.loss, self.params)

    def get(self) -> np.ndarray:
        return np.concatenate([p.to_numpy().reshape(-1).astype(np.float64)
                               for p in self.params])

    def set(self, flat: np.ndarray) -> None:
        for p, part in zip(self.params, _fn._split(flat, self.params), strict=True):
            p.from_numpy(part)

    def value(self) -> float:
        self.fn()
        return self._loss()


def newton(fn: Callable[[], object], loss: Field, params: Sequence[Field] | Field, *,
           tol: float = 1e-10, max_iter: int = 50) -> NewtonResult:
    """Minimise the 0-D field ``loss``, computed from scratch by ``fn``, over the float
    fields ``params`` (with ``needs_grad=True``), by Newton's method with exact Hessians and a
    backtracking line search, until the gradient norm is below ``tol``. The params are left
    at the result. Under ``arch=ti.remote`` the whole solve is one request."""
    ps = _fn._fields(params)
    _fn._need_grads(ps)
    check_options(tol, max_iter)
    remote = program.get().remote
    if remote is not None:  # one request (difftape.client)
        result = remote.newton(fn, loss, ps, float(tol), max_iter)
        if result is not None:
            return result
    return iterate(LocalSteps(fn, loss, ps), float(tol), max_iter)
