"""The framework-neutral core of the PyTorch and JAX bridges: a Python function that launches
difftape kernels on declared input and output storage (fields or ``ti.ndarray``), run
forward, backward (vector-Jacobian product), in forward mode (Jacobian-vector product) and
to second order (forward-over-reverse), on NumPy arrays that the bridges share with their
tensors.

Storage and copies. A declared ``ti.ndarray`` is re-pointed at the caller's memory for each
call (its storage becomes the input tensor's memory; an output's becomes the new output
tensor's buffer): no copy, when the program's storage is host memory (``runtime/storage.py``;
in device memory it is copied in and out, as a field is). A field owns its storage, so a
declared field is copied into (inputs) or out of (outputs) once per call. An input that is not
C-contiguous is copied once.

Gradients. Adjoint storage is difftape's own (the ``.grad`` of the declared fields and
ndarrays, and fresh arrays for ndarray inputs), never the caller's tensors' ``.grad``; the
bridges hand the results to their framework, which accumulates them exactly once. The
backward pass reuses the recording of the latest forward call when it is the one being
differentiated and has not been used yet; otherwise it runs the function again (recorded)
from the saved inputs first, so interleaved calls of one operator are differentiated right.
The declared storage and whatever the function writes belong to the operator: other code must
not change them between a call and its backward (as for a ``ti.ad.Tape``).

Remotely (``arch=ti.remote``) the declared storage lives on the server, fields and
``ti.ndarray`` alike, so both are copied in and out as fields are here: the same calls queue
the inputs, the launches and the clears, and read what they return (all the outputs, all the
inputs' gradients, the tangents) together at the end (``_values``, through
``prog.remote.read_fields``): one request per forward, backward, forward-mode or second-order
call, plus an upload or download for each array too large to ride inside a batch.

Second order (fields only: ``ti.ndarray`` has no tangent storage) is one forward-mode pass of
the recorded program and of its adjoint, as ``ti.ad.hvp`` does: given the backward pass
``g(x, u) = J(x)^T u`` and a cotangent ``w`` for its result, it gives ``J w`` (for ``u``) and
``(sum_k u_k H_k) w`` (for ``x``, the Hessians being symmetric).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from .. import grouped
from ..ad import Tape, clear_all_gradients
from ..ad.functional import _backward, _ensure_second_order, clear_all_duals, forward_mode
from ..errors import DifftapeError
from ..frontend.annotations import NdarrayType
from ..frontend.decorators import kernel
from ..frontend.field import Field
from ..frontend.ndarray import Ndarray
from ..runtime import devicearrays, program
from ..runtime.storage import BorrowedStorage, DeviceMemoryAllocator


class DeviceCall:
    """One call of an operator on a framework's CUDA arrays, on a grid program: how the
    framework allocates (``empty(shape, dtype)`` returns ``(result, array)``: what goes back
    to the framework, and an object exporting its device memory by DLPack or
    ``__cuda_array_interface__``) and its current ``stream`` (a driver handle).

    Inside :meth:`joined` our stream runs after what ``stream`` was given so far and
    ``stream`` runs its later work after ours (``ti.caller_stream``): nobody waits on the
    host. The framework's arrays are borrowed in place (``runtime/devicearrays.py``: device,
    dtype and layout checked) and kept alive until the launches that address them have run.

    ``results``: where the framework allocated the pass's results before the call (XLA's
    result buffers, ``interop/jax.py``), in the order the pass returns them; result ``k`` of
    a pass is then written into ``results[k]`` in place (:meth:`empty` and :meth:`copy_out`
    with ``index=k``) instead of a new array.
    """

    def __init__(self, stream: int,
                 empty: Callable[[tuple, np.dtype], tuple[object, object]] | None = None,
                 results: Sequence[object] | None = None) -> None:
        self.stream, self._empty, self._results = stream, empty, results
        self.allocator: DeviceMemoryAllocator = program.get().allocator
        self._borrowed: list[BorrowedStorage] = []

    def borrow(self, a: object, what: str) -> BorrowedStorage:
        """``a``'s device memory as storage (no copy)."""
        storage, _ = devicearrays.borrow(a, self.allocator, what, scalar=True)
        self._borrowed.append(storage)
        return storage

    def empty(self, shape: tuple, dtype: np.dtype, index: int | None = None
              ) -> tuple[object, BorrowedStorage]:
        """A new array of the framework's (the caller owns it) and its memory as storage;
        with ``results``, the pass's result ``index`` (shape and dtype checked)."""
        if self._results is not None:
            if index is None or index >= len(self._results):
                raise DifftapeError(f"internal: no result buffer {index} for this call")
            array = self._results[index]
            storage = self.borrow(array, f"result buffer {index}")
            if tuple(storage.shape) != tuple(shape) or storage.dtype != np.dtype(dtype):
                raise DifftapeError(f"result buffer {index} has shape {tuple(storage.shape)} "
                                    f"and dtype {storage.dtype}; the result is {tuple(shape)} "
                                    f"{np.dtype(dtype)}")
            return array, storage
        result, array = self._empty(tuple(shape), np.dtype(dtype))
        return result, self.borrow(array, "an array the framework allocated")

    def copy_out(self, storage, index: int | None = None) -> object:
        """A new array of the framework's (result ``index`` with ``results``) holding a copy
        of ``storage``, made on the device."""
        result, out = self.empty(storage.shape, storage.dtype, index)
        out.copy_from(storage)
        return result

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        with devicearrays.caller_stream(self.stream):
            try:
                yield
            finally:
                borrowed, self._borrowed = self._borrowed, []
                if borrowed:
                    self.allocator.hold(borrowed)


class DiffProgram:
    """``fn()`` launching kernels that read ``inputs`` and write ``outputs`` (fields or
    ``ti.ndarray``, float, with gradient storage: ``needs_grad=True``). ``fn`` must compute
    its outputs from scratch; the outputs are zeroed before each run."""

    def __init__(self, fn: Callable[[], object], inputs: Sequence, outputs: Sequence,
                 name: str | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "difftape_op")
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        if not self.outputs:
            raise DifftapeError(f"{self.name}: declare at least one output")
        for what, xs in (("input", self.inputs), ("output", self.outputs)):
            for k, s in enumerate(xs):
                if not isinstance(s, Field | Ndarray):
                    raise DifftapeError(f"{self.name}: {what} {k} must be a field or a "
                                        f"ti.ndarray, got {type(s).__name__}")
                if not s.dtype.is_float or not s.has_grad:
                    raise DifftapeError(f"{self.name}: {what} {k} must be a float field or "
                                        "ndarray with gradient storage (needs_grad=True)")
        remote = program.get().remote
        # Local ndarrays are re-pointed at the caller's memory; storage on a server is
        # copied in and out (``_copied``).
        self._remote = remote is not None
        for s in self.inputs + self.outputs:
            if remote is not None and isinstance(s, Ndarray) and \
                    remote.ndarray_class(type(s)) is not type(s):
                raise DifftapeError(f"{self.name}: under arch=ti.remote the declared storage "
                                    "must live on the server: make the ti.ndarray after "
                                    "ti.init(arch=ti.remote) (this one is local memory: made "
                                    "by an earlier program, or by ti.from_dlpack)")
        self.shapes_in = [_full_shape(s) for s in self.inputs]
        self.shapes_out = [_full_shape(s) for s in self.outputs]
        self.dtypes_in = [np.dtype(s.dtype.np) for s in self.inputs]
        self.dtypes_out = [np.dtype(s.dtype.np) for s in self.outputs]
        self._token: int | None = None  # the latest run (its recording is in _tape)
        self._runs = itertools.count(1)
        self._tape: Tape | None = None
        self._cotangents: dict[int, np.ndarray] = {}
        self._spare: dict[int, object] = {}  # (unbind)

    # ------------------------------------------------------------------ forward
    def run(self, xs: Sequence, record: bool, out: Sequence[np.ndarray] | None = None,
            device: DeviceCall | None = None) -> tuple[int, list]:
        """Run ``fn`` on ``xs``; returns a token naming this run (an int below 2**31, so
        that it can travel as an array) and the outputs (the arrays
        ``out`` when given: ndarray outputs are written there in place, field outputs copied
        there). ``record``: keep a recording for :meth:`vjp`. With ``device`` the arrays are
        the framework's CUDA arrays and the outputs new ones it allocated
        (:class:`DeviceCall`)."""
        self._check_outside_derivatives()
        if device is not None:
            with device.joined():
                outs = self._launch(xs, record, None, device, results=True)
                self._copy_field_outputs(outs, device=device)
            return self._token, [result for result, _ in outs]
        outs = self._launch(xs, record, out)
        self._copy_field_outputs(outs)
        return self._token, outs

    def _launch(self, xs: Sequence, record: bool, out: Sequence[np.ndarray] | None,
                device: DeviceCall | None = None, results: bool = False) -> list:
        """Bind the storage and run ``fn`` (recorded or not), without reading the field
        outputs back: under ``arch=ti.remote`` everything here is queued, and the read that
        follows (the outputs, or the gradients after a backward pass) is the one request."""
        self._bind_inputs(xs, device)
        outs = self._bind_outputs(out, device, results)
        if record:
            tape = Tape(loss=None)
            with tape:
                self.fn()
        else:
            tape = None
            self.fn()
        self._token, self._tape = next(self._runs) % (1 << 31), tape
        return outs

    # ------------------------------------------------------------------ reverse
    def vjp(self, token: int | None, xs: Sequence, us: Sequence,
            device: DeviceCall | None = None, out: Sequence[np.ndarray] | None = None,
            ys: Sequence[np.ndarray] | None = None) -> list:
        """``J(xs)^T us``, one fresh array per input (with ``out``: written into those
        arrays, an ndarray input's gradient accumulated there in place); ``token``: the run
        being differentiated (None: unknown, run again); ``ys``: that run's outputs, where
        its ndarray outputs are no longer the memory it wrote (XLA's buffers: the recording
        reads them where they are now)."""
        self._check_outside_derivatives()
        if device is not None:
            with device.joined():
                return self._vjp(token, xs, us, device)
        return self._vjp(token, xs, us, None, out, ys)

    def _vjp(self, token: int | None, xs: Sequence, us: Sequence,
             device: DeviceCall | None, out: Sequence[np.ndarray] | None = None,
             ys: Sequence[np.ndarray] | None = None) -> list:
        if token is None or token != self._token or self._tape is None:
            self._launch(xs, True, None, device)  # re-run from the saved inputs (module doc)
        else:
            self._bind_inputs(xs, device)  # the recording reads the ndarrays' current memory
            for s, y in zip(self.outputs, ys or (), strict=False):
                if not self._copied(s):
                    s._bind_host_array(self._checked(y, s, "output"))
        tape, self._tape = self._tape, None  # one backward pass per recording
        self._token = None
        clear_all_gradients()  # (the fields': ndarrays keep theirs, as in Taichi)
        declared = {id(s) for s in self.inputs + self.outputs}
        for entry in tape.entries:  # intermediate ndarrays: their adjoints start at zero
            for a in entry.args:
                if isinstance(a, Ndarray) and a.grad is not None and id(a) not in declared:
                    self._zero_grad(a)
        results: dict[int, object] = {}
        for k, s in enumerate(self.inputs):
            if isinstance(s, Ndarray):
                if device is not None:  # the kernels add into the new array itself
                    results[id(s)], storage = device.empty(_full_shape(s), s.storage.dtype, k)
                    storage.zero()
                    s.grad.storage = storage
                else:
                    self._zero_grad(s, None if out is None else out[k])
        for s, u in zip(self.outputs, us, strict=True):
            if device is not None:
                u = self._checked(device.borrow(u, f"{self.name}: cotangent"), s, "cotangent")
            else:
                u = self._checked(u, s, "cotangent")
            if not self._copied(s):
                # Copied into a buffer of ours (reused: fresh pages cost more than the copy):
                # the adjoint of a store zeroes the output's adjoint.
                key = (id(s), device is not None)
                buf = self._cotangents.get(key)
                if buf is None or buf.shape != u.shape:
                    buf = self._cotangents[key] = np.empty(u.shape, s.storage.dtype) \
                        if device is None else device.allocator.storage(u.shape, u.dtype)
                if device is None:
                    np.copyto(buf, u)
                    s.grad._bind_host_array(buf)
                else:
                    buf.copy_from(u)
                    s.grad.storage = buf
            elif device is not None:
                s.grad.storage.copy_from(u)
            else:
                s.grad.from_numpy(u)
        _backward(tape)
        if device is not None:
            return [results[id(s)] if id(s) in results else device.copy_out(s.grad.storage, k)
                    for k, s in enumerate(self.inputs)]
        grads = _values([s.grad for s in self.inputs if self._copied(s)], copy=out is None)
        return _delivered([grads.pop(0) if self._copied(s) else _ndarray_result(s.grad)
                           for s in self.inputs], out)

    # ------------------------------------------------------------------ forward mode
    def jvp(self, xs: Sequence, ts: Sequence, device: DeviceCall | None = None,
            out: Sequence[np.ndarray] | None = None) -> tuple[list, list]:
        """The outputs and ``J(xs) ts`` (a None tangent is zero); with ``out`` (the outputs,
        then the tangents) written into those arrays."""
        self._need_fields("forward-mode derivatives")
        self._check_outside_derivatives()
        _ensure_second_order()  # what a Tape differentiates (fields with .grad) gets a .dual
        if device is not None:
            with device.joined():
                return self._jvp(xs, ts, device)
        return self._jvp(xs, ts, None, out)

    def _jvp(self, xs: Sequence, ts: Sequence, device: DeviceCall | None,
             out: Sequence[np.ndarray] | None = None) -> tuple[list, list]:
        self._bind_inputs(xs, device)
        clear_all_duals()
        for s, t in zip(self.inputs, ts, strict=True):
            if t is not None:
                self._set(s.dual, t, "tangent", device)
        n = len(self.outputs)
        outs = self._bind_outputs(None if out is None else out[:n], device, results=True)
        try:
            with forward_mode():
                self.fn()
            if device is not None:
                self._copy_field_outputs(outs, device=device)
                return ([result for result, _ in outs],
                        [device.copy_out(s.dual.storage, n + k)
                         for k, s in enumerate(self.outputs)])
            touts = self._copy_field_outputs(outs, [s.dual for s in self.outputs],
                                             into=None if out is None else out[n:])
        finally:
            clear_all_duals()
            self._token = self._tape = None
        return outs, touts

    # ------------------------------------------------------------------ second order
    def vjp_derivative(self, xs: Sequence, us: Sequence, ws: Sequence,
                       device: DeviceCall | None = None,
                       out: Sequence[np.ndarray] | None = None) -> tuple[list, list]:
        """The vector-Jacobian product of ``(xs, us) -> J(xs)^T us`` with cotangents ``ws``:
        ``(J ws`` for each output, ``(sum_k us_k H_k) ws`` for each input); with ``out``
        (the outputs' then the inputs') written into those arrays."""
        self._need_fields("second derivatives")
        self._check_outside_derivatives()
        _ensure_second_order()
        if device is not None:
            with device.joined():
                return self._vjp_derivative(xs, us, ws, device)
        return self._vjp_derivative(xs, us, ws, None, out)

    def _vjp_derivative(self, xs: Sequence, us: Sequence, ws: Sequence,
                        device: DeviceCall | None, out: Sequence[np.ndarray] | None = None
                        ) -> tuple[list, list]:
        self._bind_inputs(xs, device)
        clear_all_duals()
        for s, w in zip(self.inputs, ws, strict=True):
            if w is not None:
                self._set(s.dual, w, "cotangent", device)
        clear_all_gradients()
        try:
            with forward_mode():
                tape = Tape(loss=None)
                with tape:
                    self._bind_outputs(None, device)
                    self.fn()
                for s, u in zip(self.outputs, us, strict=True):
                    self._set(s.grad, u, "cotangent", device)
                _backward(tape)
            wanted = [s.dual for s in self.outputs] + [s.grad.dual for s in self.inputs]
            if device is not None:
                both = [device.copy_out(f.storage, k) for k, f in enumerate(wanted)]
            else:
                both = _delivered(_values(wanted, copy=out is None), out)
            d_us, d_xs = both[:len(self.outputs)], both[len(self.outputs):]
        finally:
            clear_all_duals()
            self._token = self._tape = None
        return d_us, d_xs

    # ------------------------------------------------------------------ storage
    def _bind_inputs(self, xs: Sequence, device: DeviceCall | None = None) -> None:
        if len(xs) != len(self.inputs):
            raise DifftapeError(f"{self.name} takes {len(self.inputs)} input(s), got {len(xs)}")
        for k, (s, x) in enumerate(zip(self.inputs, xs, strict=True)):
            if device is not None:  # the framework's device memory, in place
                x = self._checked(device.borrow(x, f"{self.name}: input {k}"), s, "input")
                if isinstance(s, Ndarray):
                    s.storage = x
                else:
                    s.storage.copy_from(x)
                continue
            x = self._checked(x, s, "input")
            if self._copied(s):
                s.from_numpy(x)
            else:
                _own(s)
                s._bind_host_array(x if x.flags.c_contiguous else np.ascontiguousarray(x))

    def _bind_outputs(self, out: Sequence[np.ndarray] | None,
                      device: DeviceCall | None = None, results: bool = False) -> list:
        """The outputs' arrays, bound or zeroed. With ``device``: (result, storage) pairs:
        ``results``: ndarray outputs are new arrays of the framework's, which the kernels
        write in place (field outputs are copied into theirs by :meth:`_copy_field_outputs`);
        otherwise (a re-run whose outputs nobody reads) storage of ours, and no results."""
        outs: list = []
        for k, s in enumerate(self.outputs):
            if device is not None:
                result = None
                if not isinstance(s, Ndarray):
                    s.fill(0)
                elif results:
                    result, s.storage = device.empty(_full_shape(s), s.storage.dtype, k)
                    s.storage.zero()
                else:
                    s.storage = device.allocator.storage(_full_shape(s), s.storage.dtype)
                outs.append((result, s.storage))
                continue
            a = out[k] if out is not None else np.empty(self.shapes_out[k], self.dtypes_out[k])
            if self._copied(s):
                s.fill(0)
            else:
                a[...] = 0
                _own(s)
                s._bind_host_array(a)  # (device memory: copied back by _copy_field_outputs)
            outs.append(a)
        return outs

    def _copy_field_outputs(self, outs: list, extra: Sequence[Field] = (),
                            device: DeviceCall | None = None,
                            into: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Copy the field outputs into ``outs``; returns copies of the ``extra`` fields'
        values (written into the arrays ``into`` when given), read in the same request
        (tangents, under forward mode). With ``device`` (``outs`` from
        :meth:`_bind_outputs`): every output lands in a new array of the framework's (its
        result buffer), copied on the device."""
        if device is not None:
            for k, s in enumerate(self.outputs):
                if not isinstance(s, Ndarray):
                    outs[k] = (device.copy_out(s.storage, k), s.storage)
            return []
        at = [k for k, s in enumerate(self.outputs) if self._copied(s)]
        values = _values([self.outputs[k] for k in at] + list(extra), copy=False)
        for k, v in zip(at, values, strict=False):
            np.copyto(outs[k], v)
        for k, s in enumerate(self.outputs):
            if not self._copied(s) and not s.storage.host:  # copied in, so copied out
                np.copyto(outs[k], s.storage.read())
        if into is None:
            return [np.array(v) for v in values[len(at):]]
        return _delivered(values[len(at):], into)

    def unbind(self) -> None:
        """Point the declared ndarrays (and their gradients) away from the memory a call
        bound them to, at spare storage of their own (kept for the next call: no allocation
        per call): for callers whose memory is gone after the call (XLA frees its buffers),
        so that nothing later reads or writes it. Their values are then not the call's."""
        for s in self.inputs + self.outputs:
            if self._copied(s):
                continue
            for a in (s, s.grad):
                key = id(a)
                spare = self._spare.get(key)
                if spare is None or spare.shape != a.storage.shape or \
                        spare.dtype != a.storage.dtype or spare.host != a.storage.host:
                    spare = self._spare[key] = program.get().allocator.storage(
                        a.storage.shape, a.storage.dtype)
                a.storage = spare

    def _set(self, target: Field, value, what: str, device: DeviceCall | None) -> None:
        """``target`` (a field's ``.dual`` or ``.grad``) becomes ``value``."""
        if device is not None:
            target.storage.copy_from(self._checked(
                device.borrow(value, f"{self.name}: {what}"), target, what))
        else:
            target.from_numpy(self._checked(value, target, what))

    def _checked(self, x, s, what: str):
        """``x`` (an array, or borrowed device storage) if it fits ``s`` (shape and dtype);
        a clear error otherwise (no conversion: a silent cast would change what is
        differentiated)."""
        want = _full_shape(s)
        if tuple(x.shape) != want or x.dtype != np.dtype(s.dtype.np):
            raise DifftapeError(f"{self.name}: {what} for {_label(s)} has shape "
                                f"{tuple(x.shape)} and dtype {x.dtype}; expected shape {want} "
                                f"and dtype {np.dtype(s.dtype.np)}")
        return x

    def _copied(self, s) -> bool:
        """Is ``s`` storage of its own, copied in and out (a field, or anything on a server),
        rather than a local ndarray re-pointed at the caller's memory?"""
        return self._remote or not isinstance(s, Ndarray)

    def _zero_grad(self, a: Ndarray, into: np.ndarray | None = None) -> None:
        """Zero an ndarray's adjoint: a fresh array, or the array ``into`` zeroed (an
        earlier call's gradient was handed out without a copy: on the host its array, on a
        device the framework's tensor), remotely a queued fill."""
        if self._remote:
            a.grad.fill(0)
        elif a.grad.storage.host:
            if into is None or not into.flags.c_contiguous or into.shape != a.grad.storage.shape \
                    or into.dtype != a.grad.storage.dtype:
                into = np.zeros(a.grad.storage.shape, a.grad.storage.dtype)
            else:
                into[...] = 0
            a.grad._bind_host_array(into)
        else:
            a.grad.storage = program.get().allocator.storage(a.grad.storage.shape,
                                                             a.grad.storage.dtype)

    def _need_fields(self, what: str) -> None:
        if any(isinstance(s, Ndarray) for s in self.inputs + self.outputs):
            raise DifftapeError(f"{self.name}: {what} need fields as inputs and outputs: "
                                "ti.ndarray has no tangent (.dual) storage; declare fields "
                                "(ti.field(..., needs_grad=True))")

    def _check_outside_derivatives(self) -> None:
        prog = program.get()
        if prog.tape is not None or prog.fwd is not None:
            raise DifftapeError(f"{self.name}: a difftape operator cannot run inside a "
                                "ti.ad.Tape or forward mode of difftape's own")


def _values(fields: Sequence[Field], copy: bool) -> list[np.ndarray]:
    """The fields' values (any role), each of shape ``shape + element_shape``: views of
    their storage (copies with ``copy``), or under ``arch=ti.remote`` arrays read from the
    server together in one request (``prog.remote.read_fields``)."""
    if not fields:
        return []
    remote = program.get().remote
    if remote is not None:
        return remote.read_fields(list(fields))
    return [np.array(f.storage.read()) if copy else f.storage.read() for f in fields]


class Exchange:
    """The storage traffic of one call of a PyTorch or JAX function inside a difftape
    program (``interop.torch.call``, ``interop.jax.call``): what it reads (inputs, tangents,
    cotangents) and the storage it then writes, zeroes or adds into (outputs and their
    tangents, the outputs' and inputs' ``.grad``).

    Locally reads are copies of the storage and updates go straight into it. Under
    ``arch=ti.remote`` the reads, and the current values of the storage that ``add`` will add
    into, come back together in one request (with the launches queued before them:
    ``prog.remote.read_fields``); updates are applied, in order, to those copies and
    :meth:`commit` queues the results (bytes inside the next batch up to ``INLINE_BYTES``):
    one round trip per call, and the same floating-point operations as locally, so the
    results are the same bit for bit."""

    __slots__ = ("values", "_remote", "_current", "_dirty")

    def __init__(self, reads: Sequence, accumulated: Sequence = ()) -> None:
        reads = list(reads)
        self._remote = program.get().remote is not None
        self._dirty: dict[int, object] = {}
        targets = list({id(s): s for s in accumulated}.values()) if self._remote else []
        got = _values(reads + targets, copy=True)
        self.values = got[:len(reads)]
        self._current = {id(s): v for s, v in zip(targets, got[len(reads):], strict=True)}

    def set(self, s, value: np.ndarray) -> None:
        """``s`` becomes ``value`` (its dtype and full shape)."""
        if self._remote:
            self._current[id(s)] = np.array(value, dtype=np.dtype(s.dtype.np))
            self._dirty[id(s)] = s
        else:
            s.storage.write()[...] = value

    def zero(self, s) -> None:
        if self._remote:  # a queued fill (fewer bytes than the zeros)
            s.fill(0)
            self._current[id(s)] = np.zeros(_full_shape(s), np.dtype(s.dtype.np))
            self._dirty.pop(id(s), None)
        else:
            s.storage.write()[...] = 0

    def add(self, s, value: np.ndarray) -> None:
        """``s += value``; remotely ``s`` must be one of the ``accumulated`` storage (its
        current value was read with the others) or have been set in this exchange."""
        if self._remote:
            self._current[id(s)] += value
            self._dirty[id(s)] = s
        else:
            s.storage.write()[...] += value

    def commit(self) -> None:
        """Send the updates (remotely queued, no round trip; nothing to do locally)."""
        for key, s in self._dirty.items():
            s.from_numpy(self._current[key])
        self._dirty.clear()


@kernel
def add_into(dst: NdarrayType(), src: NdarrayType()):
    """``dst += src`` on the device (storage of one shape; a bridge adding a framework's
    gradient into a ``.grad``)."""
    for i in grouped(dst):
        dst[i] += src[i]


def _own(a: Ndarray) -> None:
    """Give ``a`` storage of its own again where a device call left it over a framework's
    array (which the caller owns: a host call copies into the ndarray's storage)."""
    if isinstance(a.storage, BorrowedStorage):
        a.storage = program.get().allocator.storage(a.storage.shape, a.storage.dtype)


def _delivered(values: Sequence[np.ndarray], out: Sequence[np.ndarray] | None
               ) -> list[np.ndarray]:
    """``values`` (arrays of the caller's already) as the caller receives them: themselves,
    or, with ``out``, written into those arrays (no copy where a value is its array
    already: an ndarray's gradient accumulated in place)."""
    if out is None:
        return list(values)
    for v, o in zip(values, out, strict=True):
        if v is not o:
            np.copyto(o, v)
    return list(out)


def _ndarray_result(a: Ndarray) -> np.ndarray:
    """An ndarray's values for the caller: its host array itself (host memory: the array
    bound for this call), a copy from device memory."""
    return a.storage.array if a.storage.host else a.storage.read().copy()


def _full_shape(s) -> tuple[int, ...]:
    return tuple(s.shape) + tuple(s.element_shape)


def _label(s) -> str:
    return f"field '{s._label()}'" if isinstance(s, Field) else "a ti.ndarray"
