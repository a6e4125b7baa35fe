"""difftape programs as PyTorch operators: ``difftape.interop.torch.operator``.

::

    x = ti.field(ti.f64, shape=n, needs_grad=True)        # declared storage
    y = ti.field(ti.f64, shape=(), needs_grad=True)

    def energy():                                          # launches difftape kernels
        compute(x, y)

    op = difftape.interop.torch.operator(energy, inputs=[x], outputs=[y])
    out = op(torch_tensor)                                 # a torch.Tensor; differentiable

Reverse mode is difftape's Tape (``kernel.grad``), forward mode (``torch.func.jvp``,
``torch.autograd.forward_ad``) is difftape's forward mode, and double backward
(``create_graph=True``, ``gradgradcheck``) is forward-over-reverse (the Hessian-vector
products of ``ti.ad.hvp``); forward mode and second order need fields as the declared storage.
Tensors must have the declared dtype and shape (no silent casts); ndarray storage shares the
tensors' memory, field storage is copied (see ``interop/core.py``).

CUDA tensors, on a grid program (``ti.init(arch=ti.cuda)``): the inputs (and cotangents,
tangents) are read in place, and the outputs and gradients are new CUDA tensors PyTorch
allocates on the inputs' device (the caller owns them), written by our kernels: ndarray storage
in place, field storage by a copy on the device. Everything, forward, backward, double backward
and forward mode, is ordered with PyTorch's current stream on that device by events, without
a host synchronisation (``runtime/devicearrays.py``). Refused, saying how to fix it: CUDA
tensors on a program whose storage is host memory (a CPU program, or ``arch=ti.remote``),
inputs on different devices (CPU and CUDA, or two CUDA devices), strided CUDA tensors. CPU
tensors on a grid program are copied to the device and back, as for a kernel.
Under ``arch=ti.remote`` (field or ndarray storage) the program runs on the server: a call, and its
backward pass, are one request each.
The tensors' ``.grad`` are never written by difftape: PyTorch accumulates what the operator
returns. Under ``torch.compile`` the operator is called eagerly (a graph break): its kernels
are opaque to the compiler.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..errors import DifftapeError
from ..frontend.field import Field
from ..runtime import devicearrays, program
from ..runtime.foreign import as_numpy
from ..runtime.storage import SimulatedDeviceMemory
from .core import DeviceCall, DiffProgram, Exchange, _full_shape, add_into

__all__ = ["operator", "Operator", "call"]


class Operator:
    """A difftape program called on PyTorch tensors (see the module doc)."""

    def __init__(self, fn: Callable[[], object], inputs: Sequence, outputs: Sequence,
                 name: str | None = None) -> None:
        self.program = DiffProgram(fn, inputs, outputs, name)
        self.__name__ = self.program.name
        self._record = False
        self._last_token: object | None = None
        # Registered now: the compiler cannot trace a registration.
        self._lib = _register(self)

    def __call__(self, *tensors: torch.Tensor):
        p = self.program
        if len(tensors) != len(p.inputs):
            raise DifftapeError(f"{p.name} takes {len(p.inputs)} tensor(s), got {len(tensors)}")
        for k, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise DifftapeError(f"{p.name}: input {k} must be a torch.Tensor, got "
                                    f"{type(t).__name__}")
        # Record (for a backward pass) only when one may follow; inside the Function's
        # forward grad mode is off, so this is decided here.
        if torch.compiler.is_compiling():  # an opaque custom operator for the compiler
            outs = self._lib(list(tensors))
            return outs[0] if len(outs) == 1 else tuple(outs)
        self._record = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        outs = _Apply.apply(self, *tensors)
        return outs[0] if len(outs) == 1 else outs

    def __repr__(self) -> str:
        return f"<difftape torch operator {self.__name__}>"


def operator(fn: Callable[[], object], inputs: Sequence, outputs: Sequence,
             name: str | None = None) -> Operator:
    """A PyTorch operator running ``fn`` (a Python function launching difftape kernels) on
    the declared ``inputs`` and ``outputs`` (fields or ``ti.ndarray`` with
    ``needs_grad=True``): ``op(*input_tensors)`` returns the output tensor(s)."""
    return Operator(fn, inputs, outputs, name)


class CudaTensors:
    """The bridge's device-specific calls to PyTorch, in one place (tests without a GPU
    replace :data:`cuda` with one over simulated device memory): which tensors are CUDA
    arrays, how PyTorch allocates on a device, its current stream there, and on which device
    PyTorch computes for the current program (:func:`call`)."""

    def device_array(self, t: torch.Tensor) -> object | None:
        """What exports ``t``'s device memory (DLPack), or None for a CPU tensor."""
        return None if t.device.type == "cpu" else t.detach()

    def empty(self, shape: tuple, dtype: np.dtype, device: torch.device
              ) -> tuple[torch.Tensor, object]:
        """A new tensor on ``device``, and what exports its memory."""
        t = torch.empty(shape, dtype=_torch_dtype(dtype), device=device)
        return t, t

    def stream(self, device: torch.device) -> int:
        """PyTorch's current stream on ``device`` (a driver handle)."""
        return devicearrays.stream_handle(torch.cuda.current_stream(device))

    def program_device(self) -> torch.device | None:
        """The CUDA device of the current program when it runs on one PyTorch can use (a
        grid program on a real device), else None (PyTorch computes on the host)."""
        prog = program.get()
        if prog.remote is not None or not devicearrays.shares_device_memory(prog.allocator):
            return None
        memory = prog.allocator.memory
        if isinstance(memory, SimulatedDeviceMemory) or not torch.cuda.is_available():
            return None
        return torch.device("cuda", memory.ordinal)


#: the seam (see :class:`CudaTensors`)
cuda = CudaTensors()


def _arrays(p: DiffProgram, groups: Sequence[tuple[str, Sequence]]
            ) -> tuple[DeviceCall | None, list[list]]:
    """The tensors of each ``(what, tensors)`` group as the program takes them: NumPy arrays
    over CPU tensors' memory, or, when they are CUDA tensors, what exports their device
    memory, with the :class:`DeviceCall` that orders the call with PyTorch's stream. All on
    one device (None entries, zero tangents or cotangents, are kept)."""
    seam = cuda
    found: list[tuple[str, torch.Tensor, object | None]] = []
    for what, ts in groups:
        for k, t in enumerate(ts):
            if t is not None:
                found.append((f"{what} {k}", t, seam.device_array(t)))
    on_device = [f for f in found if f[2] is not None]
    if not on_device:
        return None, [[None if t is None else _numpy_in(t, f"{p.name}: {what} {k}")
                       for k, t in enumerate(ts)] for what, ts in groups]
    host = [f for f in found if f[2] is None]
    if host:
        raise DifftapeError(f"{p.name}: {on_device[0][0]} is on {on_device[0][1].device} but "
                            f"{host[0][0]} is on {host[0][1].device}: pass all tensors on one "
                            "device (t.to(device), a copy of your choosing)")
    devices = sorted({str(t.device) for _, t, _ in on_device})
    if len(devices) > 1:
        raise DifftapeError(f"{p.name}: the tensors are on {' and '.join(devices)}: pass all "
                            "tensors on one device (the program's)")
    prog = program.get()
    if prog.remote is not None or not devicearrays.shares_device_memory(prog.allocator):
        where = "on a server (arch=ti.remote)" if prog.remote is not None else "host memory"
        raise DifftapeError(f"{p.name}: {on_device[0][0]} is on {on_device[0][1].device}; "
                            f"this difftape program's storage is {where}: pass "
                            "tensor.cpu() (a copy), or run the program on the device "
                            "(ti.init(arch=ti.cuda) takes CUDA tensors in place)")
    device = on_device[0][1].device
    call = DeviceCall(seam.stream(device), lambda shape, dtype: seam.empty(shape, dtype, device))
    arrays = iter([a for _, _, a in found])
    return call, [[None if t is None else next(arrays) for t in ts] for _, ts in groups]


def _tensor(a) -> torch.Tensor:
    """A result as a tensor (a device call's results are PyTorch's own already)."""
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(a)


def _forward(p: DiffProgram, xs: Sequence[torch.Tensor], record: bool
             ) -> tuple[int, list[torch.Tensor]]:
    """Run the program on the tensors ``xs``: its token and the output tensors."""
    device, (arrays,) = _arrays(p, [("input", xs)])
    if device is not None:
        return p.run(arrays, record=record, device=device)
    outs = [torch.empty(s, dtype=_torch_dtype(d)) for s, d in zip(p.shapes_out, p.dtypes_out,
                                                                 strict=True)]
    token, _ = p.run(arrays, record=record, out=[o.numpy() for o in outs])
    return token, outs


def _numpy_in(t: torch.Tensor, what: str) -> np.ndarray:
    """A CPU tensor's memory as a NumPy array (no copy)."""
    try:
        return t.detach().numpy()
    except (TypeError, RuntimeError):  # a dtype NumPy lacks (bfloat16), a tensor subclass
        return as_numpy(t.detach(), what)


class _Apply(torch.autograd.Function):
    """The operator's forward, backward (a differentiable :class:`_VJP`) and jvp."""

    @staticmethod
    def forward(op: Operator, *xs: torch.Tensor):
        op._last_token, outs = _forward(op.program, xs, op._record)
        return tuple(outs)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        op, *xs = inputs
        ctx.op = op
        ctx.token, ctx.inputs = op._last_token, xs
        ctx.save_for_backward(*xs)

    @staticmethod
    def backward(ctx, *us):
        xs = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the backward pass is differentiated
            grads = _VJP.apply(ctx.op, ctx.token, len(us), *us, *xs)
        else:
            grads = _VJP.forward(ctx.op, ctx.token, len(us), *us, *xs)
        return (None, *grads)

    @staticmethod
    def jvp(ctx, _op_tangent, *ts):
        p = ctx.op.program
        # (the inputs as the forward saw them: ctx.inputs; their tangents on the same device)
        device, (xs, tangents) = _arrays(p, [("input", ctx.inputs), ("tangent", ts)])
        _, touts = p.jvp(xs, tangents, device=device)
        outs = tuple(_tensor(t) for t in touts)
        return outs[0] if len(outs) == 1 else outs


def _vjp(p, n_out: int, saved, ws):
    """The program's vector-Jacobian products for a saved ``(outputs' cotangents, inputs)``
    call and the cotangents ``ws`` (None: zero): the adjoints of the outputs and of the
    inputs."""
    us, xs = saved[:n_out], saved[n_out:]
    device, (xs, us, ws) = _arrays(p, [("input", xs), ("cotangent", us), ("cotangent", ws)])
    d_us, d_xs = p.vjp_derivative(xs, us, ws, device=device)
    return [_tensor(d) for d in d_us], [_tensor(d) for d in d_xs]


def _grads(p, token, us, xs) -> list[torch.Tensor]:
    """``J(xs)^T us`` as new tensors (see :meth:`DiffProgram.vjp`)."""
    device, (xs, us) = _arrays(p, [("input", xs), ("cotangent", us)])
    return [_tensor(g) for g in p.vjp(token, xs, us, device=device)]


class _VJP(torch.autograd.Function):
    """``(us, xs) -> J(xs)^T us``, itself differentiable once (double backward)."""

    @staticmethod
    def forward(op: Operator, token, n_out: int, *args: torch.Tensor):
        return tuple(_grads(op.program, token, args[:n_out], args[n_out:]))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        op, _token, n_out, *args = inputs
        ctx.op, ctx.n_out = op, n_out
        ctx.save_for_backward(*args)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *ws):
        d_us, d_xs = _vjp(ctx.op.program, ctx.n_out, ctx.saved_tensors, ws)
        return (None, None, None, *d_us, *d_xs)


# PyTorch binds the arguments of a Function with ``setup_context`` through
# ``inspect.signature(forward)`` on every call (a fifth of a 1-element call's Python time);
# the signature never changes, so it is computed once and kept where inspect looks first.
for _fn in (_Apply.forward, _VJP.forward):
    _fn.__signature__ = inspect.signature(_fn)


def _torch_dtype(d: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, d)).dtype


_op_ids = itertools.count()


def _register(op: Operator):
    """``difftape::<name>_<n>`` and its backward ``..._vjp`` as PyTorch custom operators,
    used under ``torch.compile`` so that the compiler keeps them whole: forward, backward and
    double backward. Forward mode is eager only (custom operators have no forward-mode rule),
    and the backward pass always runs the program again (no recording is kept across the
    compiler's boundaries)."""
    p = op.program
    base = f"difftape::{''.join(c if c.isalnum() else '_' for c in p.name)}_{next(_op_ids)}"

    @torch.library.custom_op(base, mutates_args=())
    def forward(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return _forward(p, xs, record=False)[1]

    @forward.register_fake
    def _(xs):
        device = xs[0].device if xs else None
        return [torch.empty(s, dtype=_torch_dtype(d), device=device)
                for s, d in zip(p.shapes_out, p.dtypes_out, strict=True)]

    @torch.library.custom_op(base + "_vjp", mutates_args=())
    def vjp(us: list[torch.Tensor], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        # (copied on the host: an ndarray's gradient array must not alias what the
        # compiler may keep; on a device each gradient is a new tensor already)
        return [g if g.device.type != "cpu" else g.clone() for g in _grads(p, None, us, xs)]

    @vjp.register_fake
    def _(us, xs):
        return [torch.empty_like(x) for x in xs]

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[0])

    def backward(ctx, grads):
        return (vjp(list(grads), list(ctx.saved_tensors)),)

    def setup_vjp(ctx, inputs, output):
        us, xs = inputs
        ctx.n_out = len(us)
        ctx.save_for_backward(*us, *xs)

    def backward_vjp(ctx, ws):
        args = ctx.saved_tensors
        return _vjp(p, ctx.n_out, args, ws)

    forward.register_autograd(backward, setup_context=setup)
    vjp.register_autograd(backward_vjp, setup_context=setup_vjp)
    return forward


# ---------------------------------------------------------------------------------------------
# PyTorch inside difftape programs


def call(fn: Callable, inputs: Sequence, outputs: Sequence) -> None:
    """Run a PyTorch function or module between kernel launches of a difftape program:
    ``fn(*tensors)`` on copies of the ``inputs`` (fields or ``ti.ndarray``), its result(s)
    written into the ``outputs``. Inside a ``ti.ad.Tape`` the call is recorded and takes part
    in the gradient: back-propagation hands the outputs' ``.grad`` to PyTorch, which
    accumulates into the module's parameters' ``.grad`` (PyTorch's own rule) and gives the
    inputs' gradients, added into their ``.grad``; the outputs' ``.grad`` are then zeroed (the
    call overwrote them, as a kernel's store does). Under ``ti.ad.FwdMode`` the inputs'
    ``.dual`` are PyTorch forward-mode tangents and the outputs' ``.dual`` receive theirs.
    The tensors are copies: a kernel may overwrite the inputs later in the recording. On a
    grid program running on a device PyTorch can use they are CUDA tensors, copied, set and
    added on the device on PyTorch's current stream (:class:`_DeviceExchange`).
    Under ``arch=ti.remote`` PyTorch runs here and the storage on the server: a call, its
    backward pass and its forward-mode pass each read what they need in one request
    (:class:`~difftape.interop.core.Exchange`)."""
    prog = program.get()
    tape = prog.tape
    recording = tape is not None and not tape._suspended
    if prog.fwd is not None:
        if recording:
            raise DifftapeError("difftape.interop.torch.call: second order (a Tape under "
                                "forward mode) is not supported through PyTorch calls")
        _call_forward_mode(fn, inputs, outputs)
        return
    io = _exchange(inputs)
    ins = [_tensor(v) for v in io.values]
    if recording:
        ins = [t.requires_grad_() if t.is_floating_point() else t for t in ins]
        with torch.enable_grad():
            outs = _as_tuple(fn(*ins))
    else:
        with torch.no_grad():
            outs = _as_tuple(fn(*ins))
    _write(io, outs, outputs)
    io.commit()
    if recording:
        def backward() -> None:
            grads = [s.grad for s in inputs if s.has_grad]
            io = _exchange([s.grad for s in outputs], accumulated=grads)
            us = [_tensor(u) for u in io.values]
            pairs = [(o, u) for o, u in zip(outs, us, strict=True) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [u for _, u in pairs])
            for s in outputs:
                io.zero(s.grad)
            for s, t in zip(inputs, ins, strict=True):
                if t.grad is not None and s.has_grad:
                    io.add(s.grad, _value(io, t.grad))
            io.commit()

        def forward() -> None:  # a replay (Tape grad_check): the values only
            io = _exchange(inputs)
            with torch.no_grad():
                _write(io, _as_tuple(fn(*(_tensor(v) for v in io.values))), outputs)
            io.commit()

        forward.__name__ = getattr(fn, "__name__", type(fn).__name__)
        tape.record_custom(forward, backward, (), {})


def _call_forward_mode(fn: Callable, inputs: Sequence, outputs: Sequence) -> None:
    import torch.autograd.forward_ad as fwAD

    # ndarrays have no tangents; the inputs and their tangents are read together
    tangent_of = [s.dual if isinstance(s, Field) and s.has_dual else None for s in inputs]
    io = _exchange(list(inputs) + [d for d in tangent_of if d is not None])
    values, tangents = io.values[:len(inputs)], iter(io.values[len(inputs):])
    with fwAD.dual_level():
        duals = []
        for d, v in zip(tangent_of, values, strict=True):
            t = _tensor(v)
            if d is not None:
                tangent = next(tangents)
                if t.is_floating_point():
                    t = fwAD.make_dual(t, _tensor(tangent))
            duals.append(t)
        outs = _as_tuple(fn(*duals))
        unpacked = [fwAD.unpack_dual(o) for o in outs]
    _write(io, [u.primal for u in unpacked], outputs)
    for s, u in zip(outputs, unpacked, strict=True):
        dual = s.dual if isinstance(s, Field) and s.has_dual else None
        if dual is not None:
            if u.tangent is None:
                io.zero(dual)
            else:
                io.set(dual, _value(io, u.tangent.reshape(_full_shape(dual))))
    io.commit()


class _DeviceExchange:
    """:class:`~difftape.interop.core.Exchange` on a grid program whose device PyTorch
    computes on: the values read are new CUDA tensors (copies made on the device), and the
    storage is set, added into and zeroed on the device, each step ordered with PyTorch's
    current stream by events (no host synchronisation). A CPU tensor given back is copied
    in through the host."""

    __slots__ = ("values", "_call")

    def __init__(self, reads: Sequence, device: torch.device) -> None:
        seam = cuda
        self._call = DeviceCall(seam.stream(device),
                                lambda shape, dtype: seam.empty(shape, dtype, device))
        with self._call.joined():
            self.values = [self._call.copy_out(s.storage) for s in reads]

    def _borrowed(self, t: torch.Tensor):
        return self._call.borrow(cuda.device_array(t.contiguous()),
                                 "difftape.interop.torch.call: a tensor")

    def set(self, s, t: torch.Tensor) -> None:
        if cuda.device_array(t) is None:
            s.storage.write()[...] = _numpy_in(t, "difftape.interop.torch.call: a tensor")
            return
        with self._call.joined():
            s.storage.copy_from(self._borrowed(t))

    def zero(self, s) -> None:
        s.storage.zero()

    def add(self, s, t: torch.Tensor) -> None:
        if cuda.device_array(t) is None:
            s.storage.write()[...] += _numpy_in(t, "difftape.interop.torch.call: a tensor")
            return
        with self._call.joined():
            add_into(s.storage, self._borrowed(t))

    def commit(self) -> None:
        """(Nothing queued: every update is on the device already.)"""


def _exchange(reads: Sequence, accumulated: Sequence = ()) -> Exchange | _DeviceExchange:
    """The storage traffic of a :func:`call`: on the device PyTorch computes on for this
    program (:meth:`CudaTensors.program_device`), else through host arrays."""
    device = cuda.program_device()
    if device is not None:
        return _DeviceExchange(reads, device)
    return Exchange(reads, accumulated)


def _value(io: Exchange | _DeviceExchange, t: torch.Tensor):
    """A tensor result as ``io`` takes it: the tensor on the device, else a NumPy array."""
    t = t.detach()
    return t if isinstance(io, _DeviceExchange) else t.numpy()


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def _write(io: Exchange, outs: Sequence, outputs: Sequence) -> None:
    if len(outs) != len(outputs):
        raise DifftapeError(f"difftape.interop.torch.call: the function returned {len(outs)} "
                            f"tensor(s) for {len(outputs)} output(s)")
    for k, (o, s) in enumerate(zip(outs, outputs, strict=True)):
        shape, dtype = _full_shape(s), np.dtype(s.dtype.np)
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != shape or \
                o.dtype != _torch_dtype(dtype):
            what = f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor) \
                else type(o).__name__
            raise DifftapeError(f"difftape.interop.torch.call: output {k} is {what}; the "
                                f"storage it goes to has shape {shape} and dtype "
                                f"{dtype} (no silent casts)")
        io.set(s, _value(io, o))
