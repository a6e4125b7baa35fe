"""Graphs: a step of kernel launches captured once, then replayed natively.

``with ti.graph.capture() as g: step()`` records what ``step`` does to device data, without
running it: every kernel launch (its launch context packed as the launch would pack it,
whatever the variant: a plain launch, the forward and reverse launches of a ``ti.ad.Tape``,
the tangent launches of ``ti.ad.FwdMode``, ``kernel.grad()``), and every Python-scope fill,
copy, element write and gradient clearing. ``g.replay(**inputs)`` (or ``g(**inputs)``) then
runs the whole recording in one native call (``runtime/graph.py``), with no Python per launch;
on a grid program (``arch=ti.cuda``, ``simulate_grid``) as graph executables instantiated once
(CUDA graphs: ``runtime/gridgraph.py``), over device memory.

Everything the step computed in Python while it was captured is frozen into the graph (as a
CUDA graph freezes its launch arguments). What may change between replays is declared as a
named input inside the capture, ``g.input(name, value)``:

- a scalar or vector/matrix (``g.input("lr", 0.1)``, ``g.input("t", ti.i32)``): a placeholder
  that can only be passed to kernels; Python arithmetic on it, or reading its value, is
  refused (it has a value only at replay);
- an array (NumPy or ``ti.ndarray``) or a field: the object itself is returned and used as
  usual; at replay another array or field of the same shape and dtype takes its place (its
  storage is what the replayed launches, fills and copies address).

Inputs are sticky: a replay that names only some keeps the others' last values. A host read
of device data inside the capture (``x[i]``, ``to_numpy()``, a kernel's return value, and so
any Python branch on a field value) is refused with a :class:`~difftape.errors.GraphCaptureError`
naming the line: data-dependent control flow belongs in a kernel.

Taichi's ``ti.graph.GraphBuilder`` (see :mod:`.builder`) builds the same :class:`Graph`.
"""

from __future__ import annotations

import ctypes
import numbers
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import types as T
from ..errors import ArgumentError, DifftapeError, GraphCaptureError, GraphError, user_line
from ..frontend.field import Field
from ..frontend.kernel import (
    _ANY,
    _ORDERED,
    _SERIAL,
    _WHOLE,
    DETERMINISTIC_CHUNKS,
    INLINE_WORK,
    MIN_CHUNK_WORK,
    CompiledKernel,
)
from ..frontend.matrix import Matrix, MatrixType
from ..frontend.ndarray import Ndarray
from ..ir.nodes import task_blocks, walk
from ..runtime import graph as native
from ..runtime import program
from ..runtime.grid import DeviceBlock
from ..runtime.gridgraph import GridGraph
from ..runtime.launch import raise_error_word
from ..runtime.parallel import ThreadPool
from ..runtime.storage import Storage

assert (_ANY, _SERIAL, _ORDERED, _WHOLE) == (native.ANY, native.SERIAL_SCHEDULE, native.ORDERED,
                                              native.WHOLE)

_FLOAT, _INT = "f", "i"  # CompiledKernel's scalar writer kinds (an int: an unsigned width)


def memory(storage: Storage) -> np.ndarray | Storage:
    """What a graph's records address for ``storage``: its host array on a CPU program (the
    memory the native replay runs over), the storage itself in device memory (a grid
    program's: ``runtime/gridgraph.py``). Inputs are bound by the identity of this object."""
    return storage.array if storage.host else storage


def address(mem: np.ndarray | Storage) -> int:
    """The address of :func:`memory`'s object."""
    return mem.ctypes.data if isinstance(mem, np.ndarray) else mem.address


def _refuse_use(self: Placeholder, *_a: Any, **_k: Any):
    raise GraphCaptureError(
        f"graph input '{self.name}' has a value only when the graph is replayed, so Python "
        f"cannot compute with it or read it while capturing (at {user_line()}): pass it to a "
        "kernel as an argument and compute with it there")


class Placeholder:
    """A scalar or vector/matrix graph input: passed to kernels, bound at replay."""

    __slots__ = ("name", "dtype", "graph")

    def __init__(self, name: str, dtype: T.DType | MatrixType | None, graph: Graph) -> None:
        self.name = name
        self.dtype = dtype  # None: a Python number given as the example (any scalar param)
        self.graph = graph

    def example(self):
        """A stand-in value of the right shape (what the capture packs before binding)."""
        if isinstance(self.dtype, MatrixType):
            return Matrix._from_entries([0] * _matrix_size(self.dtype), self.dtype.n,
                                        self.dtype.m, self.dtype.ndim)
        return 0

    def __repr__(self) -> str:
        return f"<ti.graph input '{self.name}'>"

    for _name in ("__float__", "__int__", "__index__", "__bool__", "__complex__", "__round__",
                  "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                  "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
                  "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__",
                  "__lt__", "__le__", "__gt__", "__ge__", "__array__", "__getitem__",
                  "__iter__", "__len__", "__matmul__", "__rmatmul__"):
        locals()[_name] = _refuse_use
    del _name


def _matrix_size(mt: MatrixType) -> int:
    return mt.n * (mt.m if mt.ndim == 2 else 1)


@dataclass
class _Input:
    """One named input: what it is, its current value and the places bound to it."""

    name: str
    kind: str  # "scalar", "matrix", "array", "field"
    example: Any = None
    dtype: Any = None  # scalar/matrix: the placeholder's type; array: scalar dtype
    element_shape: tuple = ()
    shape: tuple | None = None  # array/field: the shape; None: any shape of ``ndim`` axes
    ndim: int | None = None
    value: Any = None
    has_value: bool = False
    # (int64 array, index, how): "f"/"i"/bits for scalars (with a component path), a role
    # for array/field storage, ("extent", axis) for an array extent
    slots: list = field(default_factory=list)


class Graph:
    """A captured step: launch records run by one native call, and its named inputs."""

    def __init__(self) -> None:
        self.prog = None
        self._ops: list[tuple] = []  # ("launch", inst, ctx) | ("op", name, fn, ctx, begin, end)
        self._inputs: dict[str, _Input] = {}
        self._storage: dict[int, tuple[str, str]] = {}  # id(np array) -> (input, role)
        self._keep: list = []  # objects whose memory the records address
        # Constant bytes the records copy or fill from, by the address they use (host memory
        # on the CPU, a device block on a grid): what saved.save writes as data.
        self._constants: dict[int, np.ndarray] = {}
        # On a grid a fill is a copy from a filled constant: its pattern by id(op context),
        # so that saved.save writes it as the fill it is (a document is target-independent).
        self._fills: dict[int, np.ndarray] = {}
        self._records: np.ndarray | None = None
        self._failures: list[tuple[CompiledKernel, np.ndarray] | None] = []
        self._policy: np.ndarray | None = None
        self._prints = False
        self._capturing = False
        # A grid program's graph (simulate_grid, arch=ti.cuda): device memory, and a replay
        # by runtime/gridgraph.py; what its records write, as storage or (input, role)
        self._grid = program.get().launcher is not None
        self._written: list = []
        self._grid_graph: GridGraph | None = None
        self.launches = 0  # captured kernel launches
        self.fields: dict[str, Field] = {}  # a loaded graph's fields, by label (saved.py)
        # Array inputs the graph writes (saved.build: a server sends their bytes back to the
        # client whose NumPy array the input was).
        self.written_inputs: set[str] = set()

    # ------------------------------------------------------------------ inputs
    def input(self, name: str, value):
        """Declare a named input inside the capture and return what the step should use: the
        field or array itself, or a placeholder for a scalar/vector/matrix (``value``: an
        example value, or a type such as ``ti.f32`` or ``ti.types.vector(3, ti.f32)``)."""
        self._declare(name)
        if isinstance(value, Field):
            self._dense_input(name, value)
            inp = _Input(name, "field", example=value, dtype=value.dtype,
                         element_shape=value.element_shape, shape=value.shape)
            self._add_input(inp, value)
            for role in ("primal", "grad", "dual", "grad_dual"):
                comp = value.companion(role)
                if comp is not None:
                    self._storage[id(memory(comp.storage))] = (name, role)
            return value
        if isinstance(value, Ndarray | np.ndarray):
            if isinstance(value, np.ndarray) and self._grid:
                raise GraphError(
                    f"graph input '{name}': a NumPy array on a grid program (simulate_grid, "
                    "arch=ti.cuda) is copied into device memory at each launch, which a graph "
                    "replay does not do: use a ti.ndarray (ti.ndarray(dtype, shape), "
                    "from_numpy) as the input")
            arr = memory(value.storage) if isinstance(value, Ndarray) else value
            esh = value.element_shape if isinstance(value, Ndarray) else ()
            dtype = value.dtype if isinstance(value, Ndarray) else T.from_numpy(value.dtype)
            inp = _Input(name, "array", example=value, dtype=dtype, element_shape=esh,
                         shape=arr.shape)
            self._add_input(inp, value)
            self._storage[id(arr)] = (name, "primal")
            if isinstance(value, Ndarray) and value.grad is not None:
                self._storage[id(memory(value.grad.storage))] = (name, "grad")
            return value
        if isinstance(value, T.DType | MatrixType):
            ph = Placeholder(name, value, self)
            self._inputs[name] = _Input(name, "matrix" if isinstance(value, MatrixType)
                                        else "scalar", dtype=value)
            return ph
        if isinstance(value, numbers.Number | Matrix) or (
                isinstance(value, list | tuple) and value):
            kind = "scalar" if isinstance(value, numbers.Number) else "matrix"
            dtype = None
            if kind == "matrix":
                shape = value.shape if isinstance(value, Matrix) else np.shape(value)
                if len(shape) not in (1, 2):
                    raise GraphError(f"graph input '{name}': a vector or matrix, got shape "
                                     f"{shape}")
                dtype = MatrixType(shape[0], shape[1] if len(shape) == 2 else 1, len(shape),
                                   None)
            ph = Placeholder(name, dtype, self)
            inp = _Input(name, kind, dtype=dtype)
            self._inputs[name] = inp
            inp.value, inp.has_value = value, True
            return ph
        raise GraphError(f"graph input '{name}': expected a number, vector/matrix, type, "
                         f"array or field, got {type(value).__name__}")

    def _declare(self, name) -> None:
        """Check that input ``name`` may be declared now."""
        if not self._capturing:
            raise GraphError("g.input() declares an input while the graph is captured: call it "
                             "inside `with ti.graph.capture() as g:`")
        if not isinstance(name, str) or not name.isidentifier():
            raise GraphError(f"a graph input's name must be an identifier, got {name!r}")
        if name in self._inputs:
            raise GraphError(f"graph input '{name}' is declared twice")

    def _add_input(self, inp: _Input, value) -> None:
        self._inputs[inp.name] = inp
        inp.value, inp.has_value = value, True

    @property
    def inputs(self) -> list[str]:
        """The names of the graph's inputs."""
        return list(self._inputs)

    # ------------------------------------------------------------------ recording
    def _record_launch(self, inst: CompiledKernel, args: tuple) -> None:
        if inst.ir.returns:
            raise GraphCaptureError(
                f"kernel '{inst.ir.name}' returns a value, which Python would read on the "
                f"host while the graph is captured (at {user_line()}): a replay runs without "
                "Python; write the result into a field instead")
        subst = list(args)
        holders = {}
        for k, a in enumerate(args):
            if isinstance(a, Placeholder):
                if a.graph is not self:
                    raise GraphCaptureError(f"graph input '{a.name}' belongs to another graph "
                                            f"(at {user_line()})")
                holders[k] = a
                subst[k] = a.example()
        _keep, copies = inst.pack(tuple(subst))
        if copies:
            raise GraphCaptureError(
                f"kernel '{inst.ir.name}': an array argument is not C-contiguous, aligned and "
                f"writable (at {user_line()}); a graph launches over the array's own memory: "
                "pass np.ascontiguousarray(a) (and keep using that array)")
        ctx = inst.ctx_i64.copy()
        if ctx[inst.layout.stack_budget]:  # the program counts the kernel's stacks
            inst.prog.stack_budget.attach(ctx.ctypes.data, inst.ir.name)
        scalars, arrays = inst.argument_slots()
        written = inst.written_pointer_slots() if self._grid else ()
        for slot, kind, arg_index, comp in scalars:
            ph = holders.get(arg_index)
            if ph is not None:
                self._bind_scalar(ph, ctx, slot, kind, comp, inst)
        for ptr, arg_index, role, extents in arrays:
            a = args[arg_index]
            if isinstance(a, Storage):  # a NumPy array a grid launch copied into device memory
                raise GraphCaptureError(
                    f"kernel '{inst.ir.name}': a NumPy array argument on a grid program "
                    "(simulate_grid, arch=ti.cuda) is copied into device memory for each "
                    f"launch, which a graph replay does not repeat (at {user_line()}): pass "
                    "a ti.ndarray instead")
            arr = memory((a if role == "primal" else getattr(a, role)).storage) \
                if isinstance(a, Ndarray) else a
            bound = self._storage.get(id(arr))
            if ptr in written:
                self._written.append(arr if bound is None else bound)
            if bound is None:
                self._keep.append(arr)
                continue
            inp = self._inputs[bound[0]]
            inp.slots.append((ctx, ptr, bound[1]))
            for axis, s in enumerate(extents):
                if s is not None:
                    inp.slots.append((ctx, s, ("extent", axis)))
        for slot, storage in inst.field_storage():
            bound = self._storage.get(id(memory(storage)))
            if slot in written:
                self._written.append(storage if bound is None else bound)
            if bound is not None:
                self._inputs[bound[0]].slots.append((ctx, slot, bound[1]))
        self._ops.append(("launch", inst, ctx))
        self._keep.append(inst)
        self.launches += 1
        if any(s.op == "print" for t in inst.ir.tasks for b in task_blocks(t) for s in walk(b)):
            self._prints = True

    def _bind_scalar(self, ph: Placeholder, ctx: np.ndarray, slot: int, kind, comp,
                     inst: CompiledKernel) -> None:
        inp = self._inputs[ph.name]
        inp.slots.append((ctx, slot, (kind, scalar_component(ph.name, inp.kind, comp,
                                                             inst.ir.name))))

    def _address(self, mem: np.ndarray | Storage, ctx: np.ndarray, index: int,
                 what: str, constant: bool = False) -> int:
        """``mem``'s address for slot ``index`` of an op context, bound when it is an
        input's storage (``mem``: :func:`memory`'s object, or, ``constant``, an array of
        bytes frozen at capture; on a grid every NumPy array is one)."""
        if isinstance(mem, np.ndarray) and not (mem.flags.c_contiguous and mem.flags.aligned):
            raise GraphCaptureError(f"{what}: the array is not C-contiguous (at {user_line()})")
        bound = self._storage.get(id(mem))
        if bound is not None:
            self._inputs[bound[0]].slots.append((ctx, index, bound[1]))
        if isinstance(mem, np.ndarray) and (constant or self._grid):
            return self._constant(mem)
        self._keep.append(mem)
        return address(mem)

    def _constant(self, arr: np.ndarray) -> int:
        """The address of constant bytes the records copy from: ``arr`` itself on a CPU
        program; on a grid, a block of device memory the graph keeps, holding them (uploaded
        now, stream-ordered before any replay)."""
        arr = np.ascontiguousarray(arr)
        self._keep.append(arr)
        if not self._grid:
            self._constants[arr.ctypes.data] = arr
            return arr.ctypes.data
        prog = program.get()
        block = DeviceBlock(prog.allocator, max(1, arr.nbytes))
        prog.allocator.memory.upload(block.address, arr.reshape(-1).view(np.uint8))
        self._keep.append(block)
        self._constants[block.address] = arr
        return block.address

    def _record_op(self, name: str, mem: np.ndarray | Storage, begin: int, end: int,
                   *extra: int, what: str, source: np.ndarray | Storage | None = None,
                   constant: bool = False) -> None:
        ctx = np.zeros(3, dtype=np.int64)
        ctx[0] = self._address(mem, ctx, 0, what)
        if source is not None:
            ctx[1] = self._address(source, ctx, 1, what, constant)
        for k, v in enumerate(extra):
            ctx[1 + k] = v
        self._ops.append(("op", name, ctx, begin, end))
        if self._grid:
            bound = self._storage.get(id(mem))
            self._written.append(mem if bound is None else bound)

    def zero(self, mem: np.ndarray | Storage) -> None:
        """``Program.zero`` (clearing gradients) inside the capture (``mem``: the storage's
        :func:`memory`)."""
        self._record_op("zero", mem, 0, mem.nbytes, what="clearing an array")

    def fill(self, target: Field | Ndarray, value) -> None:
        """``x.fill(value)`` in Python scope inside the capture."""
        what = f"{_label(target)}.fill()"
        self._dense(target, what)
        mem = memory(target.storage)
        esh = target.element_shape
        pattern = np.empty(esh, dtype=mem.dtype)
        try:
            pattern[...] = _host_value(value, target)
        except ValueError:  # a value of the whole array's shape: a constant copy
            self.copy(target, np.broadcast_to(_host_value(value, target), mem.shape), None)
            return
        if not pattern.reshape(-1).view(np.uint8).any():  # all bits zero (-0.0 is not)
            self.zero(mem)
            return
        if self._grid:  # device memory: a copy from a constant block holding the filled array
            self.copy(target, np.broadcast_to(pattern, mem.shape), None)
            self._fills[id(self._ops[-1][2])] = pattern
            return
        count = mem.size // max(1, pattern.size)
        self._record_op("fill", mem, 0, count, self._constant(pattern), pattern.nbytes,
                        what=what)

    def copy(self, target: Field | Ndarray, source: np.ndarray | Storage, origin) -> None:
        """``from_numpy``/``copy_from`` inside the capture: a copy of the source's memory
        when it is device storage or an input, else of its value now (a constant).
        ``source``: an array, or (``copy_from``) the source's storage."""
        if isinstance(source, Storage):
            source = memory(source)
        method = "copy_from" if isinstance(origin, Field | Ndarray) else "from_numpy"
        what = f"{_label(target)}.{method}()"
        self._dense(target, what)
        if isinstance(origin, Field) and origin.sparse_terms:
            raise GraphCaptureError(f"{what}: the source is under a sparse SNode (at "
                                    f"{user_line()}); copy it in a kernel")
        mem = memory(target.storage)
        live = isinstance(origin, Field | Ndarray) or id(source) in self._storage
        if live and (source.dtype != mem.dtype or source.shape != mem.shape):
            raise GraphCaptureError(f"{what}: graph input '{self._storage[id(source)][0]}' "
                                    f"has dtype {source.dtype}, the target {mem.dtype}; give "
                                    f"the input the target's dtype (at {user_line()})")
        if not live:
            source = np.array(np.broadcast_to(source, mem.shape), dtype=mem.dtype, order="C")
        self._record_op("copy", mem, 0, mem.nbytes, what=what, source=source,
                        constant=not live)

    def write_element(self, target: Field | Ndarray, key: tuple, value) -> None:
        """``x[i] = v`` in Python scope inside the capture: the element's bytes, constant."""
        what = f"writing {_label(target)}[...]"
        self._dense(target, what)
        mem = memory(target.storage)
        esh = target.element_shape
        elem = np.empty(esh, dtype=mem.dtype)
        v = _host_value(value, target)
        if isinstance(target, Field) and not esh and target.dtype.is_int and isinstance(
                v, numbers.Integral):
            v = target.dtype.wrap(v)  # as Field.__setitem__: integers wrap around
        elem[...] = np.asarray(v).reshape(esh) if esh else v
        offset = int(np.ravel_multi_index(key, mem.shape[:mem.ndim - len(esh)])) * elem.nbytes
        ctx = np.zeros(3, dtype=np.int64)
        base = self._address(mem, ctx, 0, what)
        if id(mem) in self._storage:
            raise GraphCaptureError(f"{what}: element writes into graph inputs are not "
                                    f"supported (at {user_line()}); write in a kernel")
        ctx[0] = base + offset
        ctx[1] = self._constant(elem)
        self._ops.append(("op", "copy", ctx, 0, elem.nbytes))
        if self._grid:
            self._written.append(mem)

    def read(self, what: str) -> None:
        """A host read of device data inside the capture: refused."""
        raise GraphCaptureError(
            f"{what} inside ti.graph.capture() (at {user_line()}): a graph replays without "
            "Python, so a value read on the host now would be frozen into every replay. Do "
            "the computation (and any branch on it) in a kernel, or read after g.replay()")

    @staticmethod
    def _dense_input(name: str, field: Field) -> None:
        """A field input must be dense (a local capture's and a remote one's)."""
        if field.sparse_terms:
            raise GraphError(f"graph input '{name}': fields under sparse SNodes cannot be "
                             "inputs (their activity is not part of the graph)")

    @staticmethod
    def _dense(target, what: str) -> None:
        if isinstance(target, Field) and target.sparse_terms:
            raise GraphCaptureError(f"{what}: fields under sparse SNodes are filled/copied "
                                    f"over their active cells, which a graph does not track "
                                    f"(at {user_line()}); do it in a kernel")

    # ------------------------------------------------------------------ building
    def _finish(self, prog) -> None:
        if self._grid:
            self._finish_grid(prog)
            return
        ops = native.host_ops()
        rows: list[tuple[int, ...]] = []
        self._failures = []
        for op in self._ops:
            if op[0] == "launch":
                _, inst, ctx = op
                err = ctx.ctypes.data + 8 * inst.layout.err_code
                for is_range, fn, bounds, weight, schedule, address in inst.tasks:
                    fa = address or ctypes.cast(fn, ctypes.c_void_p).value
                    if is_range:
                        ba = ctypes.cast(bounds, ctypes.c_void_p).value
                        rows.append((fa, ctx.ctypes.data, native.RANGE, ba, weight, schedule,
                                     0, 0, err))
                    else:
                        rows.append((fa, ctx.ctypes.data, native.SERIAL, 0, 1, _SERIAL,
                                     0, 0, err))
                    self._failures.append((inst, ctx))
            else:
                _, name, ctx, begin, end = op
                rows.append((ops[name], ctx.ctypes.data, native.STATIC, 0, 1, _ANY, begin, end,
                             0))
                self._failures.append(None)
        self._rows = rows
        self._records = native.records(rows)
        for inp in self._inputs.values():  # the values given at capture (placeholders
            if inp.has_value:              # were packed as zeros)
                self._bind(inp, inp.value)
        self._policy = native.policy(prog.num_threads, INLINE_WORK, DETERMINISTIC_CHUNKS,
                                     MIN_CHUNK_WORK, ThreadPool.CHUNKS_PER_THREAD,
                                     ThreadPool.MIN_CHUNK_WORK)
        self.prog = prog

    def _finish_grid(self, prog) -> None:
        """A grid program's graph: its launches and device operations handed to
        ``runtime/gridgraph.py``, whose argument block holds the launch contexts from now on
        (the inputs' slots are moved there)."""
        steps = []
        for op in self._ops:
            if op[0] == "launch":
                steps.append(("launch", op[1].grid, op[2]))
            else:
                _, name, ctx, begin, end = op
                assert name in ("copy", "zero"), name  # (fills are copies on a grid)
                steps.append((name, ctx, begin, end))
        seen: dict = {}  # what the records write, once each (marked after every replay)
        for w in self._written:
            seen.setdefault(w if isinstance(w, tuple) else id(w), w)
        self._written = list(seen.values())
        gg = GridGraph(prog.launcher, steps)
        moved = gg.contexts
        for inp in self._inputs.values():
            inp.slots = [(moved.get(id(ctx), ctx), slot, how) for ctx, slot, how in inp.slots]
        self._ops = [("launch", op[1], moved.get(id(op[2]), op[2])) if op[0] == "launch"
                     else op for op in self._ops]
        self._grid_graph = gg
        for inp in self._inputs.values():
            if inp.has_value:
                self._bind(inp, inp.value)
        self.prog = prog

    @property
    def instantiations(self) -> int:
        """Graph executables instantiated for this graph (on a grid program: one per device
        segment, at the first replay; 0 on the CPU, which replays natively)."""
        return 0 if self._grid_graph is None else self._grid_graph.instantiations

    @property
    def updates(self) -> int:
        """Times a grid program's graph executable was updated in place for new input
        addresses (instead of instantiating it again)."""
        return 0 if self._grid_graph is None else self._grid_graph.updates

    def _written_storage(self) -> list[Storage]:
        """The storage a grid replay writes, with the inputs' current values."""
        out = []
        for w in self._written:
            if isinstance(w, tuple):
                value = self._inputs[w[0]].value
                w = value.companion(w[1]).storage if isinstance(value, Field) else \
                    (value.storage if w[1] == "primal" else getattr(value, w[1]).storage)
            out.append(w)
        return out

    # ------------------------------------------------------------------ replay
    def replay(self, **inputs) -> None:
        """Run the graph: every captured launch, fill and copy in order, in one native call.
        ``inputs``: new values for named inputs (the others keep their last values)."""
        prog = self.prog
        if prog is None:
            raise GraphError("the graph is still being captured (or its capture failed): "
                             "replay it after the `with ti.graph.capture()` block")
        if program.get() is not prog:
            raise GraphError("this graph was captured under a program that ti.init()/ti.reset() "
                             "has ended (its fields and kernels are gone): capture it again")
        prog.wait_for_passes()
        for name, value in inputs.items():
            inp = self._inputs.get(name)
            if inp is None:
                raise GraphError(f"the graph has no input '{name}' (inputs: "
                                 f"{', '.join(self._inputs) or 'none'})")
            self._bind(inp, value)
        for inp in self._inputs.values():
            if not inp.has_value:
                raise GraphError(f"graph input '{inp.name}' has no value yet: pass "
                                 f"{inp.name}=... to the first replay")
        if self._grid_graph is not None:
            try:
                self._grid_graph.replay()
            finally:  # (also when a host step raised: what ran before it wrote)
                for storage in self._written_storage():
                    storage.device_written()
            return
        if self._prints:
            sys.stdout.flush()
        failed = prog.pool.run_graph(self._records.ctypes.data, len(self._rows),
                                     self._policy.ctypes.data)
        if self._prints:
            ctypes.CDLL(None).fflush(None)
        if failed >= 0:
            inst, ctx = self._failures[failed]
            lay = inst.layout
            code = int(ctx[lay.err_code])
            words = ctx[lay.err_value:lay.err_value + lay.err_values].tolist()
            ctx[lay.err_code] = 0
            try:
                raise_error_word(inst.messages, code, words, inst.ir.name,
                                 prog.stack_budget, ctx.ctypes.data)
            except DifftapeError as e:
                e.kernel = getattr(e, "kernel", None) or inst.ir.name  # the launch that failed
                raise

    __call__ = replay

    def save(self, path: str) -> None:
        """Write the graph to ``path``, to be loaded with ``ti.graph.load`` in another process
        (see :mod:`.saved`)."""
        _saver[0](self, path)

    def run(self, args: dict) -> None:
        """Taichi's ``graph.run({name: value, ...})``: :meth:`replay` with these inputs, all
        of which must be given (as Taichi requires)."""
        if not isinstance(args, dict):
            raise GraphError(f"graph.run takes a dict of arguments by name, got "
                             f"{type(args).__name__}")
        missing = [n for n in self._inputs if n not in args]
        if missing:
            raise GraphError(f"graph.run: argument '{missing[0]}' is missing (the graph's "
                             f"arguments: {', '.join(self._inputs)})")
        self.replay(**args)

    def _bind(self, inp: _Input, value) -> None:
        """Check ``value`` against the input and write it into every place bound to it."""
        if inp.kind == "scalar":
            for ctx, slot, (kind, _) in inp.slots:
                _write_scalar(ctx, slot, kind, value, inp.name)
        elif inp.kind == "matrix":
            entries = _matrix_entries(value, inp)
            for ctx, slot, (kind, comp) in inp.slots:
                _write_scalar(ctx, slot, kind, entries[comp], inp.name)
        elif inp.kind == "field":
            self._check_field(inp, value)
            for ctx, slot, role in inp.slots:
                ctx[slot] = address(memory(value.companion(role).storage))
        else:
            arrs = self._check_array(inp, value)
            for ctx, slot, how in inp.slots:
                if isinstance(how, tuple):  # an extent
                    ctx[slot] = arrs["primal"].shape[how[1]]
                else:
                    ctx[slot] = address(arrs[how])
        inp.value, inp.has_value = value, True

    def _check_field(self, inp: _Input, value) -> None:
        if not isinstance(value, Field):
            raise GraphError(f"graph input '{inp.name}' is a field; got {type(value).__name__}")
        ex = inp.example
        if (value.shape, value.element_shape, value.dtype) != (ex.shape, ex.element_shape,
                                                               ex.dtype):
            raise GraphError(f"graph input '{inp.name}': the graph was captured with a field of "
                             f"shape {ex.shape}, element {ex.element_shape}, {ex.dtype}; got "
                             f"shape {value.shape}, element {value.element_shape}, "
                             f"{value.dtype}: capture the graph again for it")
        if value.sparse_terms:
            raise GraphError(f"graph input '{inp.name}': a field under a sparse SNode")
        for _, _, role in inp.slots:
            if value.companion(role) is None:
                raise GraphError(f"graph input '{inp.name}': the graph uses its .{role}, which "
                                 f"the given field has no storage for")

    def _check_array(self, inp: _Input, value) -> dict[str, np.ndarray | Storage]:
        if isinstance(value, np.ndarray) and self._grid:
            raise GraphError(f"graph input '{inp.name}' is a ti.ndarray on a grid program; "
                             "got a NumPy array (copy it in with from_numpy)")
        if isinstance(value, Ndarray):
            arrs = {"primal": memory(value.storage)}
            if value.grad is not None:
                arrs["grad"] = memory(value.grad.storage)
            esh, dtype = value.element_shape, value.dtype
        elif isinstance(value, np.ndarray):
            arrs = {"primal": value}
            esh = inp.element_shape if value.ndim >= len(inp.element_shape) and \
                value.shape[value.ndim - len(inp.element_shape):] == inp.element_shape else ()
            try:
                dtype = T.from_numpy(value.dtype)
            except TypeError:
                dtype = None
        else:
            raise GraphError(f"graph input '{inp.name}' is an array; got "
                             f"{type(value).__name__}")
        arr = arrs["primal"]
        if dtype != inp.dtype or esh != inp.element_shape:
            raise GraphError(f"graph input '{inp.name}': Dispatch node is compiled for an array "
                             f"of {inp.dtype} elements of shape {inp.element_shape}, but got an "
                             f"ndarray with dtype={dtype}, element shape {esh}: pass one of "
                             "the captured kind (or capture again)")
        if inp.shape is not None and arr.shape != inp.shape:
            raise GraphError(f"graph input '{inp.name}': the graph was captured with shape "
                             f"{inp.shape}, got {arr.shape}; capture the graph again for the "
                             "new shape (its launches were packed for the old one)")
        if inp.ndim is not None and arr.ndim - len(esh) != inp.ndim:
            raise GraphError(f"graph input '{inp.name}': Dispatch node is compiled for ndim="
                             f"{inp.ndim}, got an array of {arr.ndim - len(esh)} dimensions "
                             f"(shape {arr.shape})")
        for a in arrs.values():
            if isinstance(a, np.ndarray) and not (
                    a.flags.c_contiguous and a.flags.aligned and a.flags.writeable):
                raise GraphError(f"graph input '{inp.name}': the array must be C-contiguous, "
                                 "aligned and writable (np.ascontiguousarray)")
        for _, _, how in inp.slots:
            if not isinstance(how, tuple) and how not in arrs:
                raise GraphError(f"graph input '{inp.name}': the graph uses its .{how}, which "
                                 "the given array has no storage for")
        return arrs


def _label(target) -> str:
    return target._label() if isinstance(target, Field) else "ndarray"


def _host_value(value, target):
    """A fill/element value as NumPy takes it (vectors and matrices as nested lists)."""
    if isinstance(value, Placeholder):
        _refuse_use(value)
    if isinstance(value, Matrix):
        return value.to_list()
    return value


def _matrix_entries(value, inp: _Input) -> list:
    if isinstance(value, Matrix):
        shape, flat = value.shape, value.entries
    else:
        a = np.asarray(value)
        shape, flat = a.shape, a.ravel().tolist()
    mt = inp.dtype
    want = (mt.n,) if mt.ndim == 1 else (mt.n, mt.m)
    if tuple(shape) != want:
        raise GraphError(f"graph input '{inp.name}' is a vector/matrix of shape {want}, got "
                         f"shape {tuple(shape)}")
    return list(flat)


def _write_scalar(ctx: np.ndarray, slot: int, kind, v, name: str) -> None:
    """Write a scalar input into a launch context as CompiledKernel.pack does."""
    if isinstance(v, np.ndarray) and v.ndim == 0:
        v = v.item()
    if kind == _FLOAT:
        if not isinstance(v, numbers.Real | np.bool_):
            raise ArgumentError(f"graph input '{name}' must be a number, got "
                                f"{type(v).__name__} ({v!r:.40})")
        ctx.view(np.float64)[slot] = v
        return
    if not isinstance(v, numbers.Integral | np.bool_):
        raise ArgumentError(f"graph input '{name}' must be an integer, got "
                            f"{type(v).__name__} ({v!r:.40})")
    v = int(v)
    if kind == _INT:
        ctx[slot] = v
        return
    if kind == 1:
        ctx[slot] = 1 if v else 0
        return
    if v < 0:
        raise ArgumentError(f"graph input '{name}' is unsigned (u{kind}) but got {v}")
    v &= (1 << kind) - 1
    ctx[slot] = v - (1 << 64) if v >= 1 << 63 else v


_saver: list = []


def register_saver(save) -> None:
    """Registration point for :meth:`Graph.save` (``saved.py``, which imports this module)."""
    _saver[:] = [save]


def refuse_program(prog, what: str) -> None:
    """Refuse to build a graph (``what``) under a program whose launches a replay cannot
    time: profiled. (A CPU program's graph replays natively, a grid program's as graph
    executables: runtime/gridgraph.py; under arch=ti.remote the client records the graph and
    the server replays it: client/graph.py.)"""
    if prog.launcher is None and not prog.allocator.host:  # (no such program today)
        raise GraphError(f"{what}: this program's storage is device memory without a grid")
    if prog.config.kernel_profiler:
        raise GraphError(f"{what} with kernel_profiler=True: a replay times no single "
                         "launch; profile the eager step instead")


def scalar_component(name: str, kind: str, path, kernel: str) -> int | None:
    """Which entry of graph input ``name`` (of ``kind``) a kernel's scalar parameter takes:
    None for a scalar input, the entry index for a vector/matrix one (``path``: the
    parameter's place in the kernel's argument, None for a scalar parameter). A scalar bound
    to a vector parameter, or the reverse, or a struct argument, is refused. (The local
    capture and the client's remote recording bind inputs by the same rule.)"""
    if path is not None and kind != "matrix":
        raise GraphCaptureError(f"graph input '{name}' is a scalar but kernel '{kernel}' takes "
                                f"a vector/matrix/struct there (at {user_line()})")
    if path is None and kind == "matrix":
        raise GraphCaptureError(f"graph input '{name}' is a vector/matrix but kernel "
                                f"'{kernel}' takes a scalar there (at {user_line()})")
    if path is not None and (len(path) != 1 or not isinstance(path[0], int)):
        raise GraphCaptureError(f"graph input '{name}': struct arguments cannot be graph "
                                f"inputs (kernel '{kernel}', at {user_line()})")
    return None if path is None else path[0]


class capture:
    """``with ti.graph.capture() as g: step()``: record ``step`` into the graph ``g``
    (nothing runs while capturing); then ``g.replay(**inputs)``."""

    def __init__(self) -> None:
        self.graph = Graph()
        self._prog = None

    def __enter__(self) -> Graph:
        prog = program.get()
        refuse_program(prog, "ti.graph.capture()")
        if prog.capture is not None:
            raise GraphError("ti.graph.capture() blocks cannot be nested")
        if prog.tape is not None or prog.fwd is not None:
            raise GraphError("ti.graph.capture() inside a ti.ad.Tape or FwdMode block: put the "
                             "Tape/FwdMode inside the captured step instead")
        self._prog = prog
        if prog.remote is not None:
            # arch=ti.remote: the client records the step's engine ops and sends the graph
            # to the server with its first replay (difftape.client.graph).
            self.graph = prog.remote.begin_graph()
            return self.graph
        self.graph._capturing = True
        prog.capture = _Recorder(self.graph, prog)
        return self.graph

    def __exit__(self, exc_type, exc, tb) -> bool:
        prog = self._prog
        if prog.remote is not None:
            prog.remote.end_graph(self.graph, exc_type is None)
            return False
        prog.capture = None
        self.graph._capturing = False
        if exc_type is None:
            self.graph._finish(prog)
        return False


class _Recorder:
    """What the frontend calls instead of running while a graph is captured
    (``Program.capture``)."""

    def __init__(self, graph: Graph, prog) -> None:
        self.graph = graph
        self.prog = prog

    def launch(self, inst: CompiledKernel, args: tuple) -> None:
        tape = self.prog.tape
        if tape is not None and tape.validation:
            raise GraphCaptureError(f"ti.ad.Tape(validation=True) inside ti.graph.capture() "
                                    f"(at {user_line()}): its checks run on the host; "
                                    "validate the eager step instead")
        self.graph._record_launch(inst, args)

    def zero(self, storage) -> None:
        self.graph.zero(memory(storage))

    def fill(self, target, value) -> None:
        self.graph.fill(target, value)

    def copy(self, target, source, origin) -> None:
        self.graph.copy(target, source, origin)

    def write_element(self, target, key: tuple, value) -> None:
        self.graph.write_element(target, key, value)

    def read(self, what: str) -> None:
        self.graph.read(what)
