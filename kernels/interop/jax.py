"""difftape programs as JAX functions: ``difftape.interop.jax.function``.

::

    f = difftape.interop.jax.function(energy, inputs=[x], outputs=[y])    # custom_vjp
    g = difftape.interop.jax.function(energy, inputs=[x], outputs=[y], mode="forward")
    jax.jit(jax.grad(lambda a: f(a)))(a0)

The program (a Python function launching difftape kernels on declared fields or
``ti.ndarray``, see ``interop/core.py``) runs as an XLA custom call: ``jax.ffi.ffi_call`` of
difftape's FFI handler (``interop/xlaffi.py``), so it works eagerly, under ``jax.jit`` and
under ``jax.vmap`` (sequentially). ``mode="reverse"`` (default) is a ``jax.custom_vjp`` function:
``jax.grad``/``jax.vjp`` run difftape's reverse mode, and their own derivative (second order,
``jax.hessian``) runs forward-over-reverse (fields only). ``mode="forward"`` is a
``jax.custom_jvp`` function: ``jax.jvp``/``jax.jacfwd`` run difftape's forward mode, first
order (JAX cannot transpose a custom call, so reverse mode needs ``mode="reverse"``).

Copies. Each pass runs on XLA's own buffers (:class:`_Passes`): on the CPU platform
``ti.ndarray`` storage is XLA's argument and result memory itself (outputs and an ndarray
input's gradient written in place), field storage is copied in or out once per call, as for
PyTorch; on the CUDA platform, with a grid program on that device, XLA's device buffers are
borrowed in place and the pass is ordered with XLA's stream (``DeviceCall``: events, no host
wait), where the backward pass runs the program again (its token is device memory, which the
host would have to wait to read). Only JAX on a GPU with a program whose storage is not that
device's memory (a CPU program, ``arch=ti.remote``) takes ``jax.pure_callback``: host copies
of the arrays and of the results (chosen per platform by ``jax.lax.platform_dependent``).
Arrays must have the declared dtype and shape (f64 needs ``jax_enable_x64``). Under
``arch=ti.remote`` each pass is one request to the server (XLA's buffers sent as bytes).

When. A pass runs when XLA executes the computation, on the thread XLA runs it on, which may
be after the JAX call has returned (JAX dispatches asynchronously); passes are serialised
with each other (``xlaffi``). The program's later operations wait for them, so that what the
caller wrote after the JAX call happens after its passes: each call site of a pass (the
function, its backward and second-order rules, its forward-mode rule) adds a
side-effecting mark on the pass's results (``xlaffi.MARK``, an FFI call that runs nothing),
so that JAX records every computation holding a pass as one with side effects, and the
program's ``await_passes`` (``runtime/program.py``: before each launch, host access to
storage, Tape or graph replay) is ``jax.effects_barrier()``, which waits for the
side-effecting computations the calling thread dispatched. A pass's own launches (on XLA's
thread) do not wait. Passes need no wait for the caller's earlier launches: on the CPU these
have ended when they return, and on a grid they are queued on the program's stream, as the
pass's are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import DifftapeError
from ..frontend.field import Field
from ..runtime import devicearrays, program
from ..runtime.storage import SimulatedDeviceMemory
from . import xlaffi
from .core import DeviceCall, DiffProgram, Exchange, _full_shape

__all__ = ["function", "call", "Params"]


# the passes a call names (its ``stage`` attribute)
RUN, RUN_RECORDED, VJP, SECOND, JVP = range(5)


class _Passes:
    """The passes of one :func:`function`, run by the XLA FFI handler (``interop/xlaffi.py``)
    on XLA's buffers: on the CPU platform NumPy arrays over them, the results written in
    place; on CUDA the device memory itself, ordered with XLA's stream
    (:class:`~difftape.interop.core.DeviceCall`)."""

    def __init__(self, p: DiffProgram) -> None:
        self.program = p
        self.key = xlaffi.register_target(self)

    def execute(self, frame: xlaffi.Frame) -> None:
        p, stage = self.program, frame.attrs.get("stage")
        if frame.platform == "cpu":
            args = [b.host_array(writeable=False) for b in frame.args]
            rets = [b.host_array(writeable=True) for b in frame.rets]
            device = None
        else:
            args, rets, device = self._device(frame)
        try:
            self._run(stage, args, rets, device)
        finally:
            p.unbind()  # (XLA frees or reuses its buffers after the call)

    def _run(self, stage: int, args: list, rets: list, device: DeviceCall | None) -> None:
        p = self.program
        n_in, n_out = len(p.inputs), len(p.outputs)
        if stage in (RUN, RUN_RECORDED):
            record = stage == RUN_RECORDED and device is None
            if device is not None:
                p.run(args, record=False, device=device)
            else:
                p.run(args, record=record, out=rets[:n_out])
            if stage == RUN_RECORDED:  # the token (on CUDA 0: "unknown", see _token)
                if device is None:
                    rets[n_out][...] = p._token
                else:
                    with device.joined():
                        device.empty((), np.dtype(np.int32), n_out)[1].zero()
        elif stage == VJP:  # (token, inputs, the run's outputs, cotangents)
            token = None if device is not None else int(args[0]) or None
            xs, ys, us = args[1:1 + n_in], args[1 + n_in:1 + n_in + n_out], args[1 + n_in + n_out:]
            if device is not None:
                p.vjp(token, xs, us, device=device)
            else:
                p.vjp(token, xs, us, out=rets, ys=ys)
        elif stage == SECOND:
            xs, us, ws = args[:n_in], args[n_in:n_in + n_out], args[n_in + n_out:]
            p.vjp_derivative(xs, us, ws, device=device, out=None if device is not None
                             else rets)
        elif stage == JVP:
            p.jvp(args[:n_in], args[n_in:], device=device,
                  out=None if device is not None else rets)
        else:
            raise DifftapeError(f"{p.name}: XLA FFI call of unknown stage {stage}")

    def _device(self, frame: xlaffi.Frame) -> tuple[list, list, DeviceCall]:
        """XLA's device buffers as CUDA arrays on its stream, for a grid program."""
        prog = program.get()
        if prog.remote is not None or not devicearrays.shares_device_memory(prog.allocator):
            raise DifftapeError(f"{self.program.name}: JAX runs this call on a GPU but the "
                                "program's storage is not device memory (it changed after "
                                "the function was traced): call the function again")
        args = [_DeviceBuffer(b, frame.stream, readonly=True) for b in frame.args]
        rets = [_DeviceBuffer(b, frame.stream, readonly=False) for b in frame.rets]
        return args, rets, DeviceCall(frame.stream, results=rets)


class _DeviceBuffer:
    """One of XLA's device buffers as a ``__cuda_array_interface__`` (v3) array on XLA's
    stream: what :func:`~difftape.runtime.devicearrays.borrow` takes in place (``readonly``:
    an argument, which kernels must not write)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, b: xlaffi.Buffer, stream: int | None, readonly: bool) -> None:
        self.__cuda_array_interface__ = {
            "version": 3, "shape": b.shape, "typestr": b.dtype.str, "strides": None,
            "data": (b.address, readonly), "stream": stream}


def _register_handlers() -> None:
    """Register the FFI handler with XLA for the CPU and CUDA platforms (once)."""
    global _registered
    if _registered:
        return
    for platform, name in (("cpu", "cpu"), ("cuda", "CUDA")):
        jax.ffi.register_ffi_target(xlaffi.TARGET, jax.ffi.pycapsule(xlaffi.handler[platform]),
                                    platform=name)
    _registered = True


_registered = False

#: the platforms on which the FFI handler serves programs whose storage is not the device's
#: memory (XLA's buffers are host memory there); elsewhere ``jax.pure_callback`` (host copies)
FFI_PLATFORMS = ("cpu",)


def _marked(results: tuple) -> tuple:
    """``results`` (a pass's), after a side-effecting mark that reads them
    (``xlaffi.MARK``): the computation holding the pass is one with side effects to JAX,
    which keeps its runtime token for ``jax.effects_barrier`` (eagerly, the mark's own
    computation waits for the pass's results). The mark reads them through
    ``stop_gradient`` (no derivative to take) and returns nothing."""
    marks = [jax.lax.stop_gradient(r) for r in results]
    jax.ffi.ffi_call(xlaffi.TARGET, (), has_side_effect=True, vmap_method="sequential")(
        *marks, target=np.int64(xlaffi.MARK), stage=np.int32(-1))
    return results


def _await_passes() -> None:
    """The program's ``await_passes`` once it has JAX functions: wait until the
    computations this thread dispatched have run their passes (``jax.effects_barrier``; they
    are side-effecting by :func:`_marked`). Not inside a pass (XLA's thread, whose own
    launches would wait for the computation running them)."""
    if not xlaffi.in_pass():
        jax.effects_barrier()


def _on_device(p: DiffProgram) -> bool:
    """Does ``p`` run on a CUDA device whose memory XLA's CUDA buffers are (a grid program on
    a real GPU: the FFI handler takes them in place on the CUDA platform too)?"""
    prog = program.get()
    if p._remote or not devicearrays.shares_device_memory(prog.allocator):
        return False
    return not isinstance(prog.allocator.memory, SimulatedDeviceMemory)


def function(fn: Callable[[], object], inputs: Sequence, outputs: Sequence,
             mode: str = "reverse", name: str | None = None) -> Callable:
    """A JAX function ``f(*arrays) -> output array(s)`` running ``fn`` on the declared
    ``inputs``/``outputs`` (fields or ``ti.ndarray`` with ``needs_grad=True``)."""
    p = DiffProgram(fn, inputs, outputs, name)
    _register_handlers()
    passes = _Passes(p)
    on_device = _on_device(p)
    out_specs = tuple(jax.ShapeDtypeStruct(s, d) for s, d in zip(p.shapes_out, p.dtypes_out,
                                                                 strict=True))
    in_specs = tuple(jax.ShapeDtypeStruct(s, d) for s, d in zip(p.shapes_in, p.dtypes_in,
                                                                strict=True))
    token_spec = jax.ShapeDtypeStruct((), np.int32)
    n_in = len(p.inputs)

    def arrays(xs) -> list[np.ndarray]:
        return [np.asarray(x) for x in xs]

    # The passes through jax.pure_callback: host copies, for JAX on a GPU with a program whose
    # storage is host memory or on a server (the FFI handler on CUDA takes device memory).
    def run_cb(*xs):
        return tuple(p.run(arrays(xs), record=False)[1])

    def run_recorded_cb(*xs):
        token, outs = p.run(arrays(xs), record=True)
        return (*outs, np.int32(token))

    def vjp_cb(token, *args):  # (the outputs the run wrote are its own arrays here)
        xs, us = args[:n_in], args[n_in + len(out_specs):]
        return tuple(p.vjp(int(token), arrays(xs), arrays(us)))

    def second_cb(*args):
        xs, us, ws = args[:n_in], args[n_in:n_in + len(out_specs)], args[n_in + len(out_specs):]
        d_us, d_xs = p.vjp_derivative(arrays(xs), arrays(us), arrays(ws))
        return (*d_us, *d_xs)

    def jvp_cb(*args):
        xs, ts = args[:n_in], args[n_in:]
        outs, touts = p.jvp(arrays(xs), arrays(ts))
        return (*outs, *touts)

    def host_pass(cb: Callable) -> Callable:
        def run(*args):
            with xlaffi.running():
                return cb(*args)
        return run

    callbacks = {stage: host_pass(cb) for stage, cb in (
        (RUN, run_cb), (RUN_RECORDED, run_recorded_cb), (VJP, vjp_cb), (SECOND, second_cb),
        (JVP, jvp_cb))}

    def pass_(stage: int, specs: tuple, *args):
        """One pass as a JAX operation: the FFI call (in place on XLA's buffers) where the
        handler serves the platform, else the host callback."""
        def ffi(*a):
            return tuple(jax.ffi.ffi_call(xlaffi.TARGET, specs, vmap_method="sequential")(
                *a, target=np.int64(passes.key), stage=np.int32(stage)))

        if on_device:
            return ffi(*args)

        def copied(*a):
            return tuple(jax.pure_callback(callbacks[stage], specs, *a,
                                           vmap_method="sequential"))

        served = {platform: ffi for platform in FFI_PLATFORMS}
        return tuple(jax.lax.platform_dependent(*args, **served, default=copied))

    def check(xs) -> None:
        if len(xs) != n_in:
            raise DifftapeError(f"{p.name} takes {n_in} array(s), got {len(xs)}")
        for k, (x, spec) in enumerate(zip(xs, in_specs, strict=True)):
            if tuple(jnp.shape(x)) != spec.shape or jnp.result_type(x) != spec.dtype:
                raise DifftapeError(f"{p.name}: input {k} has shape {tuple(jnp.shape(x))} "
                                    f"and dtype {jnp.result_type(x)}; expected {spec.shape} "
                                    f"and {spec.dtype} (f64 needs jax_enable_x64)")

    def result(outs):
        return outs[0] if len(outs) == 1 else tuple(outs)

    if mode == "reverse":
        # The backward pass takes the run's outputs too: its recording reads ndarray outputs
        # where they are (XLA's buffers; JAX keeps residuals alive until the backward pass).
        @jax.custom_vjp
        def backward(token, xs, ys, us):
            return pass_(VJP, in_specs, token, *xs, *ys, *us)

        def backward_fwd(token, xs, ys, us):
            return backward(token, xs, ys, us), (xs, us)

        def backward_bwd(res, ws):
            xs, us = res
            d = _marked(pass_(SECOND, out_specs + in_specs, *xs, *us, *ws))
            return (None, tuple(d[len(out_specs):]), None,  # (ys: a cache of xs' values)
                    tuple(d[:len(out_specs)]))

        backward.defvjp(backward_fwd, backward_bwd)

        # The outputs and a token naming the run (its recording, which the backward pass
        # reuses when it is still the latest); calling g itself in its fwd rule keeps the
        # pass out of JAX's JVP when the backward pass is differentiated in turn.
        @jax.custom_vjp
        def g(*xs):
            return pass_(RUN_RECORDED, out_specs + (token_spec,), *xs)

        def g_fwd(*xs):
            outs = g(*xs)
            return outs, (outs[-1], xs, outs[:-1])

        def g_bwd(res, cts):
            token, xs, ys = res
            return _marked(tuple(backward(token, xs, ys, tuple(cts[:-1]))))

        g.defvjp(g_fwd, g_bwd)
        f = lambda *xs: g(*xs)[:-1]
    elif mode == "forward":
        @jax.custom_jvp
        def f(*xs):
            return pass_(RUN, out_specs, *xs)

        @f.defjvp
        def f_jvp(xs, ts):
            ts = tuple(jnp.zeros(s.shape, s.dtype) if type(t).__name__ == "SymbolicZero"
                       else t for t, s in zip(ts, in_specs, strict=True))
            # Two passes: under jax.jacfwd the tangents are batched, the outputs not.
            outs = f(*xs)
            touts = _marked(pass_(JVP, out_specs + out_specs, *xs, *ts)[len(out_specs):])
            return outs, tuple(touts)
    else:
        raise DifftapeError(f"difftape.interop.jax.function: mode must be 'reverse' or "
                            f"'forward', got {mode!r}")

    def call(*xs):
        check(xs)
        program.get().await_passes = _await_passes  # (the program the passes will run on)
        return result(_marked(tuple(f(*xs))))

    call.__name__ = p.name
    call.program = p
    call.passes = passes  # (the FFI target's owner: lives as long as the function)
    return call


# ---------------------------------------------------------------------------------------------
# JAX inside difftape programs


class Params:
    """Parameters (a pytree) of JAX functions called inside a difftape program with
    :func:`call`: back-propagation through a ``ti.ad.Tape`` adds their gradient into
    ``.grad`` (call :meth:`zero_grad` between training steps)."""

    def __init__(self, value) -> None:
        self.value = value
        self.zero_grad()

    def zero_grad(self) -> None:
        self.grad = jax.tree_util.tree_map(jnp.zeros_like, self.value)


def call(fn: Callable, inputs: Sequence, outputs: Sequence, params: Params | None = None
         ) -> None:
    """Run a JAX function between kernel launches of a difftape program: ``fn(*arrays)``
    (``fn(params.value, *arrays)`` with ``params``) on copies of the ``inputs`` (fields or
    ``ti.ndarray``), its result(s) written into the ``outputs`` (dtype and shape checked).
    Inside a ``ti.ad.Tape`` the call is recorded and back-propagation runs its ``jax.vjp``:
    the inputs' gradients are added into their ``.grad``, the parameters' into
    ``params.grad``, and the outputs' ``.grad`` are zeroed (the call overwrote them). Under
    ``ti.ad.FwdMode`` the inputs' ``.dual`` are its ``jax.jvp`` tangents. Under
    ``arch=ti.remote`` JAX runs here and the storage on the server: a call, its backward pass
    and its forward-mode pass each read what they need in one request
    (:class:`~difftape.interop.core.Exchange`)."""
    prog = program.get()
    lead = (params.value,) if params is not None else ()
    tape = prog.tape
    recording = tape is not None and not tape._suspended
    if prog.fwd is not None:
        if recording:
            raise DifftapeError("difftape.interop.jax.call: second order (a Tape under "
                                "forward mode) is not supported through JAX calls")
        # the inputs and their tangents in one read (ndarrays have none: zero)
        tangent_of = [s.dual if isinstance(s, Field) and s.has_dual else None for s in inputs]
        io = Exchange(list(inputs) + [d for d in tangent_of if d is not None])
        ins = [jnp.asarray(v) for v in io.values[:len(inputs)]]
        read = iter(io.values[len(inputs):])
        tangents = [jnp.zeros_like(x) if d is None else jnp.asarray(next(read))
                    for d, x in zip(tangent_of, ins, strict=True)]
        lead_t = tuple(jax.tree_util.tree_map(jnp.zeros_like, v) for v in lead)
        outs, touts = jax.jvp(fn, (*lead, *ins), (*lead_t, *tangents))
        _write(io, _as_tuple(outs), outputs)
        for s, t in zip(outputs, _as_tuple(touts), strict=True):
            if isinstance(s, Field) and s.has_dual:
                io.set(s.dual, np.asarray(t))
        io.commit()
        return
    io = Exchange(inputs)
    ins = [jnp.asarray(v) for v in io.values]
    if not recording:
        _write(io, _as_tuple(fn(*lead, *ins)), outputs)
        io.commit()
        return
    outs, vjp_fn = jax.vjp(fn, *lead, *ins)
    _write(io, _as_tuple(outs), outputs)
    io.commit()

    def backward() -> None:
        io = Exchange([s.grad for s in outputs],
                      accumulated=[s.grad for s in inputs if s.has_grad])
        us = tuple(jnp.asarray(u) for u in io.values)
        cts = vjp_fn(us if isinstance(outs, tuple | list) else us[0])
        for s in outputs:
            io.zero(s.grad)
        if params is not None:
            params.grad = jax.tree_util.tree_map(jnp.add, params.grad, cts[0])
            cts = cts[1:]
        for s, c in zip(inputs, cts, strict=True):
            if s.has_grad and jnp.issubdtype(c.dtype, jnp.floating):
                io.add(s.grad, np.asarray(c))
        io.commit()

    def forward() -> None:  # a replay (Tape grad_check): the values only
        io = Exchange(inputs)
        _write(io, _as_tuple(fn(*lead, *(jnp.asarray(v) for v in io.values))), outputs)
        io.commit()

    forward.__name__ = getattr(fn, "__name__", "jax_call")
    tape.record_custom(forward, backward, (), {})


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def _write(io: Exchange, outs: Sequence, outputs: Sequence) -> None:
    if len(outs) != len(outputs):
        raise DifftapeError(f"difftape.interop.jax.call: the function returned {len(outs)} "
                            f"array(s) for {len(outputs)} output(s)")
    for k, (o, s) in enumerate(zip(outs, outputs, strict=True)):
        shape, dtype = _full_shape(s), np.dtype(s.dtype.np)
        if tuple(jnp.shape(o)) != shape or jnp.result_type(o) != dtype:
            raise DifftapeError(f"difftape.interop.jax.call: output {k} is "
                                f"{tuple(jnp.shape(o))} {jnp.result_type(o)}; the storage it "
                                f"goes to has shape {shape} and dtype {dtype} (no "
                                "silent casts)")
        io.set(s, np.asarray(o))
