"""``ti.ad``'s Tape, custom gradients and gradient utilities.

A :class:`Tape` records the kernel launches made inside its ``with`` block (with their
arguments) and, on exit, seeds ``loss.grad[None] = 1`` and runs the adjoint kernels in reverse
order. Each recorded kernel's adjoint is compiled when it is first recorded, so a kernel whose
gradient cannot be computed correctly is refused (``GradientRuleError``) before it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ..autodiff import validation
from ..autodiff.lost import LostTracker
from ..errors import DifftapeError, GradientRuleError, KernelRuntimeError
from ..frontend.field import Field
from ..frontend.kernel import Kernel
from ..frontend.ndarray import Ndarray
from ..runtime import devicearrays, program, progress
from ..runtime.storage import BorrowedStorage
from .graph import tape_dot, write_graph

__all__ = ["Tape", "clear_all_gradients", "grad_for", "grad_replaced", "no_grad",
           "GradientCheckError"]


#: Recordings of at least this many launches show a progress bar while they back-propagate
#: (when it takes longer than ``progress.DELAY_S``).
PROGRESS_MIN_LAUNCHES = 64


class GradientCheckError(DifftapeError):
    """``Tape(grad_check=[...])`` found gradient entries that disagree with finite differences."""


def clear_all_gradients() -> None:
    """Zero the ``.grad`` of every field of the current program."""
    prog = program.get()
    if prog.remote is not None:  # arch=ti.remote: one queued op (difftape.client)
        prog.remote.clear_grads()
        return
    for f in list(prog.fields.values()):
        if f.has_grad:
            prog.zero(f.grad.storage)


def no_grad(func):
    """Give a kernel, or a Python function launching kernels, an empty gradient: a Tape runs it
    forward and never differentiates it (and ``kernel.grad()`` does nothing); in forward mode
    what it writes gets a zero tangent (its ``.dual`` is set, not left as it was). For
    bookkeeping (clearing buffers, logging) inside a differentiated program."""
    if isinstance(func, Kernel):
        func.no_grad = True
        return func

    def decorated(*args: Any, **kwargs: Any):
        prog = program.get()
        tape = prog.tape
        recording = tape is not None and not tape._suspended
        # Under forward mode the kernels inside give what they write zero tangents.
        prog.no_tangents += 1
        if recording:
            tape._suspended += 1
        try:
            result = func(*args, **kwargs)
        finally:
            prog.no_tangents -= 1
            if recording:
                tape._suspended -= 1
        if recording:
            tape.record_custom(decorated, _nothing, args, kwargs)
        return result

    decorated.__name__ = getattr(func, "__name__", "no_grad")
    decorated.__doc__ = func.__doc__
    decorated.__wrapped__ = func
    decorated.grad = _nothing  # as in Taichi: the gradient of a no_grad function is empty
    return decorated


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


class _Entry:
    """One recorded call: how to run it forward again and how to run its gradient."""

    __slots__ = ("forward", "backward", "args", "kwargs", "name")

    def __init__(self, forward: Callable, backward: Callable | None, args: tuple,
                 kwargs: dict, name: str) -> None:
        self.forward, self.backward = forward, backward
        self.args, self.kwargs, self.name = args, kwargs, name


class Tape:
    """``with ti.ad.Tape(loss): ...``: record kernel launches, then back-propagate.

    ``loss``: a 0-D field with ``needs_grad=True`` (or None: seed the ``.grad`` of the outputs
    yourself). ``clear_gradients``: zero all ``.grad`` fields on entry. ``validation``: check at
    run time, element by element, that no element a recorded kernel read is modified later in
    the recording (the global data access rule; checks cost one flag per element).
    ``grad_check``: a list of fields whose gradients are compared with central finite
    differences of the recorded program after back-propagation.
    """

    def __new__(cls, *args, **kwargs):
        # arch=ti.remote: the client's subclass sends the recording to the server.
        remote = program.get().remote
        return object.__new__(remote.tape_class if remote is not None and cls is Tape else cls)

    def __init__(self, loss: Field | None = None, clear_gradients: bool = True,
                 validation: bool = False, grad_check: list | None = None) -> None:
        self.loss = loss
        self.clear_gradients = clear_gradients
        self.validation = validation
        self.grad_check = list(grad_check) if grad_check else []
        self.entries: list[_Entry] = []
        self._suspended = 0
        self._entered = False
        self._evaluated = False
        self._snapshot: dict[int, np.ndarray] | None = None
        # Storage holding values whose gradient would be dropped (no .grad): autodiff/lost.py
        self.lost = LostTracker("reverse")

    # ------------------------------------------------------------------ recording
    def __enter__(self) -> Tape:
        if self._entered:
            raise DifftapeError("a ti.ad.Tape can be entered only once; make a new one")
        prog = program.get()
        if prog.tape is not None:
            raise DifftapeError("ti.ad.Tape blocks cannot be nested")
        loss = self.loss
        if loss is not None:
            if isinstance(loss, Field) and loss.shape == ():
                label = loss._label()
            elif isinstance(loss, Ndarray) and \
                    int(np.prod(loss.shape + loss.element_shape)) == 1:
                label = "the loss ndarray"
            else:
                raise DifftapeError("ti.ad.Tape(loss): loss must be a 0-D field (shape=()) or a "
                                    "one-element ndarray; for several outputs, seed their .grad "
                                    "and call kernel.grad() yourself")
            if not loss.has_grad:
                raise DifftapeError(f"ti.ad.Tape(loss): {label} has no gradient storage; "
                                    "create it with needs_grad=True"
                                    + (f" or place {label}.grad" if isinstance(loss, Field)
                                       else ""))
        if self.grad_check and not isinstance(loss, Field):
            raise DifftapeError("ti.ad.Tape(grad_check=...) needs a 0-D field as the loss")
        if self.grad_check and any(f.sparse_terms for f in prog.fields.values()):
            # Its finite differences move every element, inactive cells too: those hold 0 by
            # definition and get no gradient (the adjoints of their reads are dropped), so
            # the check would report them. Remotely as locally.
            raise DifftapeError("ti.ad.Tape(grad_check=...) does not support programs with "
                                "fields under sparse SNodes (pointer/bitmasked/dynamic)")
        self._entered = True
        # As in Taichi: with a loss, gradients are cleared (unless asked not to) and the loss is
        # zeroed; without one, the Tape only records, and tape.grad() back-propagates whatever
        # .grad seeds the caller set.
        if loss is not None:
            if self.clear_gradients and isinstance(loss, Field):
                clear_all_gradients()  # Taichi clears nothing for an ndarray loss
            loss.fill(0)
        if self.grad_check:
            self._take_snapshot()
        if self.validation:
            validation.begin(prog)
        prog.tape = self
        return self

    def record(self, kernel, args: tuple) -> None:
        """Called by a kernel launched inside the block (before it runs)."""
        if self._suspended:
            return
        # Compile now: refuse an undifferentiable kernel early. Under forward mode (ti.ad.hvp)
        # the adjoint runs with tangents.
        inst = kernel.instance(args, "grad_fwd" if program.get().fwd is not None else "grad")
        self.lost.launch(kernel.name, inst.lost, args)
        self.entries.append(_Entry(kernel, kernel.grad, args, {}, kernel.name))

    def record_custom(self, forward: Callable, backward: Callable | None, args: tuple,
                      kwargs: dict) -> None:
        self.entries.append(_Entry(forward, backward, args, kwargs, forward.__name__))

    @program.entry_point
    def __exit__(self, exc_type, exc, tb) -> bool:
        prog = program.get()
        prog.tape = None
        if exc_type is None and self.loss is not None:
            self.grad()
        return False

    # ------------------------------------------------------------------ visualization
    def visualize(self, path: str) -> list[str]:
        """Write the recorded program as a Graphviz graph: one box per launch (in order), one
        ellipse per version of each field it reads or writes, edges for the data flow.
        ``path`` ending in ``.svg``: the picture, drawn by Graphviz's ``dot`` program (the
        DOT text beside it; a ``MediaError`` saying how to install Graphviz when ``dot`` is
        not installed). Any other ``path``: the DOT text, and the SVG beside it when ``dot``
        is installed. Returns the files written."""
        return write_graph(tape_dot(self), path)

    # ------------------------------------------------------------------ back-propagation
    @program.entry_point
    def grad(self) -> None:
        """Seed the loss and run the recorded gradients in reverse order (done on exit)."""
        if self._evaluated:
            raise DifftapeError("this Tape's gradients were already computed")
        self._evaluated = True
        program.get().wait_for_passes()  # (the replay launches compiled code directly)
        if self.loss is not None:
            self.loss.grad.fill(1)
        # A bar (runtime/progress.py) for long recordings only: it costs a little per launch.
        with self.ordered(), progress.bar(
                len(self.entries), "Tape backward", unit="launch",
                show=None if len(self.entries) >= PROGRESS_MIN_LAUNCHES else False) as pb:
            for entry in reversed(self.entries):
                if entry.backward is None:
                    raise DifftapeError(f"'{entry.name}' is decorated with "
                                        "@ti.ad.grad_replaced but no gradient was registered "
                                        "with @ti.ad.grad_for")
                entry.backward(*entry.args, **entry.kwargs)
                pb.update()
        if self.grad_check:
            self._check_gradients()

    def ordered(self) -> contextlib.AbstractContextManager:
        """The context of the reverse launches: on a grid program, ordered with the streams
        of the callers whose CUDA arrays the recorded launches took, as those launches were
        (``runtime/devicearrays.py``'s ``replayed``); nothing to do otherwise."""
        allocator = program.get().allocator
        if getattr(allocator, "host", True):
            return contextlib.nullcontext()
        borrowed = {id(a): a for e in self.entries for a in e.args
                    if isinstance(a, BorrowedStorage)}
        if not borrowed:
            return contextlib.nullcontext()
        return devicearrays.replayed(list(borrowed.values()), allocator)

    # ------------------------------------------------------------------ grad_check
    # (Under arch=ti.remote the client's Tape keeps the snapshot and replays on the server.)
    def _take_snapshot(self) -> None:
        self._snapshot = {i: f.to_numpy() for i, f in program.get().fields.items()}
    def _replay_loss(self, snapshot: dict[int, np.ndarray], field: Field, index: tuple,
                     delta: float) -> float:
        prog = program.get()
        for i, arr in snapshot.items():
            if i != field.id:
                prog.fields[i].from_numpy(arr)
        moved = snapshot[field.id].copy()
        moved[index] += delta
        field.from_numpy(moved)
        for entry in self.entries:
            entry.forward(*entry.args, **entry.kwargs)
        return float(self.loss.to_numpy())

    def _check_gradients(self) -> None:
        prog = program.get()
        after = {i: f.to_numpy() for i, f in prog.fields.items()}
        grads = {i: f.grad.to_numpy() for i, f in prog.fields.items() if f.has_grad}
        bad: list[str] = []
        try:
            for field in self.grad_check:
                bad += self._check_field(field)
        finally:
            for i, arr in after.items():
                prog.fields[i].from_numpy(arr)
            for i, arr in grads.items():
                prog.fields[i].grad.from_numpy(arr)
        if bad:
            raise GradientCheckError("gradients disagree with central finite differences:\n  "
                                     + "\n  ".join(bad[:20]))

    def _check_field(self, field: Field) -> list[str]:
        if not field.has_grad:
            raise DifftapeError(f"grad_check: '{field._label()}' has no gradient storage")
        with prog_tape_off():
            return finite_difference_check(
                field._label(), field.grad.to_numpy(), self._snapshot[field.id],
                field.dtype.bits,
                lambda idx, delta: self._replay_loss(self._snapshot, field, idx, delta),
                field.primal._offset)


def finite_difference_check(label: str, analytic: np.ndarray, x0: np.ndarray, bits: int,
                            replay: Callable[[tuple, float], float],
                            offset: tuple[int, ...] = ()) -> list[str]:
    """Compare the gradient ``analytic`` of a field (``x0``: its values when the recording
    began) with central finite differences ``(replay(i, h) - replay(i, -h)) / 2h``, where
    ``replay`` re-runs the recorded program from the snapshot with element ``i`` moved by
    the given amount and returns the loss. At most 32 elements, a fixed spread-out sample.
    Shared by the local Tape and the service's ``grad_check`` op (one request remotely),
    so both sample and judge alike. Returns the disagreements, one line each, naming the
    element by the user's index (the field's ``offset`` added to its leading axes)."""
    rel_step, tol = (1e-3, 2e-2) if bits < 64 else (1e-6, 1e-5)
    flat = list(np.ndindex(x0.shape))
    if len(flat) > 32:  # a fixed, spread-out sample keeps the check affordable
        picks = np.random.default_rng(0).choice(len(flat), 32, replace=False)
        flat = [flat[k] for k in sorted(picks)]
    scale = float(np.max(np.abs(analytic))) if analytic.size else 0.0
    out = []
    for idx in flat:
        h = rel_step * max(1.0, abs(float(x0[idx])))
        lp = replay(idx, h)
        lm = replay(idx, -h)
        fd = (lp - lm) / (2 * h)
        an = float(analytic[idx])
        denom = max(abs(fd), abs(an), 1e-3 * scale, 1e-12)
        if abs(fd - an) / denom > tol:
            shown = [k + o for k, o in zip(idx, offset, strict=False)] + \
                list(idx[len(offset):])
            out.append(f"{label}{shown}: gradient {an:.6g}, finite difference {fd:.6g}")
    return out


class prog_tape_off:
    """Run kernels without recording them (used while re-running a recorded program)."""

    def __enter__(self) -> None:
        self.prog = program.get()
        self.saved, self.prog.tape = self.prog.tape, None

    def __exit__(self, *exc) -> None:
        self.prog.tape = self.saved


# ---------------------------------------------------------------------------------------------
# custom gradients

def grad_replaced(func: Callable) -> Callable:
    """Replace the gradient of a Python function that launches kernels.

    Inside a Tape, calling the decorated function runs it without recording its kernels and
    records the function instead; on back-propagation, the function registered with
    :func:`grad_for` runs with the same arguments. ``f.grad(*args)`` calls it directly.
    """

    def decorated(*args: Any, **kwargs: Any):
        tape = program.get().tape
        if tape is None or tape._suspended:
            return func(*args, **kwargs)
        tape._suspended += 1
        try:
            result = func(*args, **kwargs)
        finally:
            tape._suspended -= 1
        tape.record_custom(decorated, _Backward(decorated), args, kwargs)
        return result

    decorated.__name__ = getattr(func, "__name__", "grad_replaced")
    decorated.__doc__ = func.__doc__
    decorated.__wrapped__ = func
    decorated._difftape_backward = None
    decorated.grad = _Backward(decorated)
    return decorated


class _Backward:
    """Calls the gradient registered for a grad_replaced function, looked up at call time."""

    def __init__(self, primal: Callable) -> None:
        self.primal = primal

    def __call__(self, *args: Any, **kwargs: Any):
        fn = self.primal._difftape_backward
        if fn is None:
            raise DifftapeError(f"'{self.primal.__name__}' is decorated with "
                                "@ti.ad.grad_replaced but no gradient was registered with "
                                "@ti.ad.grad_for")
        return fn(*args, **kwargs)


def grad_for(primal: Callable) -> Callable:
    """Register the decorated function as the gradient of a ``@ti.ad.grad_replaced`` one."""
    if not hasattr(primal, "_difftape_backward"):
        raise KernelRuntimeError("@ti.ad.grad_for(f): f must be decorated with "
                                 "@ti.ad.grad_replaced (a Python function calling kernels), "
                                 "not a kernel nor an undecorated function")

    def decorator(func: Callable) -> Callable:
        primal._difftape_backward = func
        return func

    return decorator


__all__ += ["GradientRuleError"]
