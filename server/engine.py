"""The worker-side engine: one difftape :class:`Program` executing the engine ops of
``server/PROTOCOL.md``.

A worker process owns one :class:`Engine` per session. Everything that touches native code
(compiling IR a client sent, launching it, reading and writing field memory) happens here, so
the gateway never imports the compiler and a crash costs one worker, not the server.

Trust boundary: the IR arrives from the network. It is decoded without pickle or eval, every
buffer it names must be a field of *this* engine with the dtype and shape the IR claims, and
every kernel is compiled with bounds checks on (``ir.debug = True``), so a bad index becomes a
:class:`~difftape.errors.KernelAssertionError` and never a stray write. Python-scope element
access is range-checked here as well. Arrays come in and go out as raw C-order bytes.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import numbers
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from difftape import types as T
from difftape.ad.newton import check_options as newton_options
from difftape.ad.newton import iterate as newton_iterate
from difftape.errors import ArgumentError, CompileError, DifftapeError, GraphError, ShapeError
from difftape.frontend.field import Field, check_offset_range
from difftape.frontend.kernel import (
    CompiledKernel,
    CompileStats,
    compile_ir,
    derive,
    has_storage,
    kernel_prints,
)
from difftape.frontend.ndarray import Ndarray
from difftape.frontend.sparse import sparse_levels
from difftape.graph import saved as saved_graphs
from difftape.graph import wire
from difftape.graph.core import Graph
from difftape.ir import serialize
from difftape.ir.nodes import KernelIR
from difftape.ir.passes import run_pipeline
from difftape.ir.serialize import from_jsonable, jsonable
from difftape.ir.validate import argument_names, decode_untrusted
from difftape.runtime import program
from difftape.runtime.printsink import PrintSink
from difftape.runtime.stackbudget import StackBudget

#: Storage roles of a field: ``grad_dual`` is ``x.grad.dual`` (forward-over-reverse).
ROLES = ("primal", "grad", "dual", "grad_dual", "mark")
VARIANTS = ("primal", "grad", "fwd", "grad_fwd", "fwd_const")
#: Ops that carry a binary payload: they cannot be part of a ``batch``.
PAYLOAD_OPS = ("write", "read", "save", "load")
_SAVE_META = "__difftape_meta__"
#: Ops a ``sweep`` or ``grad_check`` program may repeat (nothing that creates or reads).
PROGRAM_OPS = ("launch", "fill", "set_item", "set_bytes", "zero", "clear_grads",
               "clear_duals")
#: ``get_bytes``/``set_bytes`` carry at most this much (base64 inside a batch's JSON).
INLINE_BYTES = 1 << 20


class EngineError(DifftapeError):
    """A malformed or inconsistent engine request (unknown field or kernel, bad dtype...)."""


class QuotaExceededError(DifftapeError):
    """A session holds as many fields (or kernels) as the server allows; ``limit`` names
    which (the gateway answers 429 with it)."""

    def __init__(self, message: str, *, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class QuotaUnavailableError(RuntimeError):
    """The gateway could not answer an ask for more of the user's memory quota (its
    database failed): the server's fault, not the request's, and worth a retry (the
    gateway answers 503)."""


def _nbytes(dtype: T.DType, shape: list[int], element_shape: list[int]) -> int:
    """Bytes of one copy of a field's or ndarray's storage."""
    return int(np.prod(shape + element_shape, dtype=np.int64)) * np.dtype(dtype.np).itemsize


def _f64_from_b64(text: Any, what: str) -> np.ndarray:
    """Raw float64 values (C order, little-endian) sent as base64 inside a batch."""
    if not isinstance(text, str):
        raise EngineError(f"{what} must be base64 text of float64 values")
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError:
        raise EngineError(f"{what} is not valid base64") from None
    if len(data) % 8:
        raise EngineError(f"{what}: {len(data)} bytes is not a whole number of float64 values")
    return np.frombuffer(data, dtype="<f8")


def _decode_ir(data: Any) -> KernelIR:
    """The single place untrusted IR is decoded: ``difftape.ir.validate.decode_untrusted``
    checks types, operands and attributes as it decodes (ndarray-argument buffers included:
    the launch binds their storage and checks it against them)."""
    return decode_untrusted(data, allow_ndarray=True)


@contextlib.contextmanager
def _current(prog: program.Program) -> Iterator[None]:
    """Make the engine's program the current one while fields are created.

    ``Field`` registers itself with ``program.get()``; in a worker that is the engine's own
    program anyway, but in-process tests also run a client program in the same interpreter.
    """
    saved = program._current
    program._current = prog
    try:
        yield
    finally:
        program._current = saved


def _dtype(name: Any) -> T.DType:
    """A field dtype from its wire name ("f32"; NumPy names such as "float32" also accepted).
    Object, string and structured dtypes are refused."""
    if not isinstance(name, str):
        raise EngineError(f"dtype must be a string, got {type(name).__name__}")
    if name in T.ALL:
        return T.ALL[name]
    try:
        dt = np.dtype(name)
    except TypeError:
        raise EngineError(f"unknown dtype {name!r}") from None
    if dt.kind not in "fiub" or dt.fields is not None:
        raise EngineError(f"dtype {name!r} is not a numeric dtype")
    return T.from_numpy(dt)


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise EngineError(f"{what} must be a list of integers, got {value!r:.80}")
    return tuple(value)


def _offset(value: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A field's ``offset`` (``create_field``): one integer per axis keeping its index range
    (end excluded) in i32 (as ``place(offset=)`` requires), or none (``[]``; all zeros is
    none too). Storage is indexed from 0 whatever it is: the client subtracts it (in the IR
    and in Python scope); it is what the bounds checks report the user's index with, and
    what IR addressing the field must say it is."""
    offset = _int_list(value, "offset")
    if not offset:
        return ()
    if len(offset) != len(shape):
        raise ShapeError(f"field offset {list(offset)} needs one entry per axis of shape "
                         f"{list(shape)}")
    check_offset_range(offset, shape)
    return offset if any(offset) else ()


def _levels_wire(f: Field) -> list[dict]:
    """A field's activity levels as ``create_field``'s ``sparse`` describes them."""
    return [{"activity": act.id, "map": [list(m) for m in imap], "dynamic": dynamic}
            for act, imap, dynamic in f.activity_levels]


def _active_mask(s: Field | _Ndarray) -> np.ndarray | None:
    """The elements a Python-scope write (``fill``, ``set_bytes``, ``write``) reaches in a
    field under sparse SNodes: the active ones, as locally (None: all of them)."""
    if not isinstance(s, Field):
        return None
    active = s._np_active()
    return s._element_mask(active) if active is not None else None


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real)


class _Kernel:
    """A registered kernel: its encoded frontend IR and how wire args map to the params."""

    __slots__ = ("data", "name", "nparams", "arg_names", "plan", "returns", "arrays")

    def __init__(self, data: dict, ir: KernelIR) -> None:
        self.data = data
        self.name = ir.name
        self.nparams = len(ir.params)
        self.returns = bool(ir.returns)
        # Wire args are flattened as the IR params are (``v[0]``, ``v[1]``...); the compiled
        # kernel takes one Python argument per name of ``argument_names`` (vectors as flat
        # lists), ndarray arguments at their own positions (``#k``: the storage bound by the
        # launch's ``arrays``).
        self.arg_names = argument_names(ir)
        members: dict[str, list[tuple[int, int | None]]] = {}
        for k, p in enumerate(ir.params):
            base, _, comp = p.name.partition("[")
            members.setdefault(base, []).append((k, int(comp[:-1]) if comp else None))
        self.plan: list[tuple] = []
        for name in self.arg_names:
            if name[0] == "#":
                self.plan.append(("array", int(name[1:])))
            elif name[0] == "~":  # a template argument: bound into the IR by the client
                self.plan.append(("none",))
            elif len(members[name]) == 1 and members[name][0][1] is None:
                self.plan.append(("scalar", members[name][0][0]))
            else:
                self.plan.append(("vector", members[name],
                                  max(c for _, c in members[name]) + 1))
        # ndarray argument -> the buffers the IR declares for it (checked at each launch
        # against the storage the launch binds).
        self.arrays: dict[int, list] = {}
        for buf in ir.buffers:
            if buf.key[0] == "ndarray":
                self.arrays.setdefault(buf.key[1], []).append(buf)

    def call_args(self, flat: list, bound: dict) -> tuple:
        out: list = []
        for step in self.plan:
            kind = step[0]
            if kind == "scalar":
                out.append(flat[step[1]])
            elif kind == "array":
                out.append(bound[step[1]])
            elif kind == "vector":
                vec: list = [0] * step[2]
                for k, c in step[1]:
                    vec[c] = flat[k]
                out.append(vec)
            else:
                out.append(None)
        return tuple(out)


class _Ndarray(Ndarray):
    """A ``ti.ndarray``'s storage on the server: made by ``create_field`` with ``ndarray``
    true, bound to a kernel's ``ti.types.ndarray()`` argument by each launch (``arrays``).
    Unlike a field it is never captured by a kernel, has ``.grad`` storage only (made with
    it), and ``clear_grads`` leaves it alone (as ``ti.ad.clear_all_gradients`` does
    locally)."""

    def setup(self, fid: int, name: str, role: str = "primal") -> None:
        self.id, self.name, self.role = fid, name, role
        if self.grad is not None:
            self.grad.setup(fid, name, "grad")

    def _label(self) -> str:
        base = f"ndarray '{self.name}'" if self.name else f"ndarray#{self.id}"
        return base if self.role == "primal" else f"{base}.{self.role}"


class Engine:
    """One session's runtime: fields under client-chosen ids, registered kernels, compiled
    variants. Not thread-safe (a worker runs one op at a time per engine)."""

    def __init__(self, cache_dir: str | os.PathLike | None = None, *, num_threads: int = 0,
                 random_seed: int = 0, offline_cache: bool = True,
                 max_fields: int | None = None, max_kernels: int | None = None,
                 arch: str = "cpu", max_memory_bytes: int | None = None,
                 scratch_grant: int | None = None) -> None:
        # arch "cuda": the session's kernels and fields on the device (runtime/cuda.py's
        # CudaLauncher); no device there is an error at start, never a fallback to the CPU.
        if arch not in ("cpu", "cuda"):
            raise ValueError(f"engine arch {arch!r}: expected 'cpu' or 'cuda'")
        cfg = program.Config(arch=program.cuda if arch == "cuda" else program.cpu,
                             random_seed=int(random_seed),
                             cpu_max_num_threads=int(num_threads),
                             offline_cache=bool(offline_cache),
                             offline_cache_file_path=str(cache_dir) if cache_dir else None)
        self.prog = program.Program(cfg)
        # What the session's kernels print is collected, never written to this process's
        # stdout (the server's): each request's lines go back with its response
        # (difftape.graph.wire's "output"; the sink holds one request's worth).
        self.prog.print_sink = PrintSink(wire.MAX_OUTPUT_BYTES)
        self._serving = False  # inside a top-level execute (batch sub-ops are not)
        # CUDA's current context is per thread, and an engine's ops may come on any thread (a
        # Ray actor's, a test's): each op runs with the program's context pushed on the
        # calling thread (a no-op on the thread that made it, the local worker's only one).
        self._bound = getattr(self.prog.launcher, "bound", None)
        # Objects count, not only bytes: every field and kernel costs memory and bookkeeping.
        self.max_fields = max_fields
        self.max_kernels = max_kernels
        # The session's memory quota (the gateway's per-user field quota, which it checks
        # for fields across sessions): here fields, ndarrays and scratch memory together
        # (:meth:`scratch`), checked before each allocation, so a launch's stack pool or a
        # printing kernel's buffer cannot take memory the quota does not allow.
        self.max_memory_bytes = max_memory_bytes
        # The scratch memory the user's quota reserves for this session (the gateway's
        # ``sessions.scratch_bytes``, counted beside every session's fields): None when
        # nothing outside this engine shares the quota. Scratch past it is asked for first
        # (``ask_scratch``, answered by the gateway within the op): without a grant, the
        # user's other sessions could take the same bytes at once. The grant only grows
        # while the engine lives (scratch kept for reuse, such as a stack pool, or taken
        # again each launch, stays reserved), so a session's steady launches ask nothing.
        # Each ask covers all the scratch held, so what the engine holds from its start
        # (random states) is reserved with its first block, before any kernel runs.
        self.scratch_grant = scratch_grant
        self.ask_scratch: Callable[[dict], dict] | None = None
        if self.prog.launcher is not None:
            self.prog.launcher.queue.scratch.admit = self._admit_scratch
        elif max_memory_bytes is not None or scratch_grant is not None:
            # The CPU threads' reverse-mode stacks, taken while a kernel runs: counted, and
            # past the room the quota leaves them asked for (:meth:`_stack_ask`).
            self.prog.stack_budget = StackBudget(self._stack_ask)
        self.kernels: dict[str, _Kernel] = {}
        # ti.ndarray storage, under ids of the same (client-chosen) space as the fields.
        self.ndarrays: dict[int, _Ndarray] = {}
        self.compiled: dict[tuple, CompiledKernel] = {}
        self.epoch = 0  # bumped when a field gains .grad/.dual storage
        self.snapshots: dict[int, dict[int, np.ndarray]] = {}  # Tape(grad_check=...)
        # Captured graphs (ti.graph.capture() under arch=ti.remote) by content hash: the
        # native graph and the op that made it (saved with the session, made again on load).
        self.graphs: dict[str, tuple[Graph, dict]] = {}
        self.launches = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.compile_s = 0.0
        from difftape.codegen.cpu import get_target

        get_target().warm_up()  # load LLVM now: readiness means the compiler is usable

    # ------------------------------------------------------------------ memory
    def storage_bytes(self) -> int:
        """Bytes of the session's fields and ndarrays (their companions included)."""
        return sum(self._field_nbytes(f) for f in [*self.prog.fields.values(),
                                                   *self.ndarrays.values()])

    def scratch(self) -> dict[str, int]:
        """Memory the session holds beyond its fields and ndarrays, by kind, in bytes: the
        print sink (once a kernel prints), the random states and the launch contexts; on a
        grid also the stack pool, the snapshot blocks of overflow reruns, the print buffer
        and the status block (``runtime/grid.py``'s ``Scratch``); and the copies of the
        fields ``Tape(grad_check=...)`` keeps (``snapshot``); on the CPU the reverse-mode
        stacks its threads hold while a kernel runs (freed when it ends), where counted."""
        out = {"print sink": self.prog.print_sink.nbytes, "random states": self.prog.rng.nbytes,
               "grad_check snapshots": sum(a.nbytes for snap in self.snapshots.values()
                                           for a in snap.values())}
        launcher = self.prog.launcher
        if launcher is None:
            out["launch contexts"] = sum(k.ctx_i64.nbytes for k in self.compiled.values())
            if self.prog.stack_budget is not None:
                out["reverse-mode stacks"] = self.prog.stack_budget.held
        else:
            for kind, n in launcher.queue.scratch.bytes.items():
                out[kind] = out.get(kind, 0) + n
        return out

    def _check_memory(self, nbytes: int, what: str, *, scratch: bool = False,
                      counted: int = 0) -> None:
        """Refuse ``nbytes`` more (``what`` needs them) past the session's memory quota,
        saying what holds the memory; ``scratch`` memory past the session's grant is asked
        for first (:meth:`_grant`). ``counted``: of ``nbytes``, what :meth:`scratch` counts
        already (a stack growth, counted before it is asked for)."""
        limit = self.max_memory_bytes
        if limit is None and (not scratch or self.scratch_grant is None):
            return
        if self.prog.stack_budget is not None:  # its room was computed without these bytes
            self.prog.stack_budget.invalidate()
        fields, scratch_now = self.storage_bytes(), self.scratch()
        held = sum(scratch_now.values()) - counted
        used = fields + held
        if limit is not None and used + nbytes > limit:
            parts = ", ".join(f"{k} {n}" for k, n in sorted(scratch_now.items(),
                                                            key=lambda kv: -kv[1]))
            raise QuotaExceededError(
                f"memory quota exceeded: {what} needs {nbytes} bytes; this session holds "
                f"{fields} bytes of fields and ndarrays and {held} bytes of scratch "
                f"memory ({parts}), and its quota is {limit} bytes: free fields or ndarrays "
                "the session no longer needs (a reverse-mode launch's stack pool grows with "
                "the loop iterations per index)",
                limit="field_bytes")
        if scratch:
            self._grant(held + nbytes, what, nbytes)

    #: Scratch is asked for in steps of at least this many bytes (fewer asks, each one a
    #: database transaction at the gateway), never past what the quota leaves.
    GRANT_STEP = 64 * 1024

    def _grant(self, need: int, what: str, nbytes: int) -> None:
        """Make sure the session's scratch grant covers ``need`` bytes of scratch in all
        (``what`` needs ``nbytes`` of them), asking the gateway for more:
        ``ask_scratch({"scratch": need, "want", "what", "bytes"})`` answers ``{"grant":
        bytes}`` (at least ``need``, at most ``want``), ``{"refuse": why}`` (what holds
        the user's memory: a QuotaExceededError here) or ``{"unavailable": why}`` (the
        gateway could not tell: a QuotaUnavailableError)."""
        grant = self.scratch_grant
        if grant is None or need <= grant:
            return
        if self.ask_scratch is None:
            raise QuotaExceededError(
                f"memory quota exceeded: {what} needs {nbytes} bytes of scratch memory, "
                f"{need - grant} more than the {grant} bytes the quota reserves for this "
                "session's scratch",
                limit="field_bytes")
        answer = self.ask_scratch({"scratch": need, "want": max(need, grant + self.GRANT_STEP),
                                   "what": what, "bytes": nbytes})
        if "refuse" in answer:
            raise QuotaExceededError(str(answer["refuse"]), limit="field_bytes")
        if "unavailable" in answer:
            raise QuotaUnavailableError(str(answer["unavailable"]))
        granted = answer.get("grant")
        if not isinstance(granted, int) or granted < need:
            raise EngineError(f"the gateway granted {granted} bytes of scratch memory where "
                              f"{need} were asked")
        self.scratch_grant = granted

    def _stack_ask(self, kernel: str, nbytes: int) -> int:
        """``StackBudget``'s ask: a CPU thread's reverse-mode stack of ``kernel`` grows by
        ``nbytes`` (counted in :meth:`scratch` already) past the room last computed. Checked
        as any scratch is (asked for past the grant, refused past the quota: the
        QuotaExceededError the launch raises); the new room: the bytes of stack the
        session's grant and quota allow beside its other memory, so that the launches that
        follow, whose stacks grow no deeper, ask nothing. A refusal comes while the kernel
        runs: it says that the launch stopped partway (what it wrote before stays)."""
        try:
            self._check_memory(nbytes, f"the reverse-mode stacks of kernel '{kernel}'",
                               scratch=True, counted=nbytes)
        except (QuotaExceededError, QuotaUnavailableError) as e:
            why = (f"{e} (kernel '{kernel}' stopped partway, at a thread's stack growth: the "
                   "fields it writes may hold part of its results)")
            if isinstance(e, QuotaExceededError):
                raise QuotaExceededError(why, limit=e.limit) from None
            raise QuotaUnavailableError(why) from None
        scratch = self.scratch()
        stacks = scratch["reverse-mode stacks"]
        other = sum(scratch.values()) - stacks
        room = 1 << 62
        if self.scratch_grant is not None:
            room = min(room, self.scratch_grant - other)
        if self.max_memory_bytes is not None:
            room = min(room, self.max_memory_bytes - self.storage_bytes() - other)
        return max(room, stacks)

    def _admit_scratch(self, kind: str, nbytes: int, what: str) -> None:
        """``Scratch.admit``: a grid's scratch block, checked against the quota."""
        self._check_memory(nbytes, what, scratch=True)

    def close(self) -> None:
        """Stop the program's worker threads and drop compiled code."""
        self.compiled.clear()
        self.prog.close()

    # ------------------------------------------------------------------ dispatch
    def execute(self, op: dict, payload: bytes | memoryview | None = None
                ) -> tuple[dict, bytes | memoryview | None]:
        """Run one engine op; return ``(result, payload)``. User errors are raised as
        ``DifftapeError`` subclasses (the worker turns them into error responses)."""
        if not isinstance(op, dict):
            raise EngineError("an engine op must be a JSON object")
        name = op.get("op")
        handler = _HANDLERS.get(name) if isinstance(name, str) else None
        if handler is None:
            raise EngineError(f"unknown engine op {name!r}; known: {', '.join(_HANDLERS)}")
        if payload and name not in PAYLOAD_OPS:
            raise EngineError(f"op {name!r} takes no payload")
        if self._serving:  # an op of a batch or program: its request collects the output
            return self._bound_run(handler, name, op, payload)
        self._serving = True
        sink = self.prog.print_sink
        try:
            result, out = self._bound_run(handler, name, op, payload)
        except BaseException as e:
            if sink.pending():  # printed before the error: shown before it is raised
                e.printed = wire.output_document(*sink.take())
            raise
        finally:
            self._serving = False
        if sink.pending():
            result = dict(result or {})
            result[wire.OUTPUT] = wire.output_document(*sink.take())
        return result, out

    def _bound_run(self, handler, name: str, op: dict, payload) -> tuple[dict, Any]:
        if self._bound is None:
            return self._run(handler, name, op, payload)
        with self._bound():
            return self._run(handler, name, op, payload)

    def _run(self, handler, name: str, op: dict, payload) -> tuple[dict, Any]:
        out = handler(self, op, payload) if name in PAYLOAD_OPS else (handler(self, op), None)
        if self.prog.launcher is not None:
            # On a grid (CUDA) launches are asynchronous: wait here, so that a failed launch
            # is reported as the error of the op that made it (its index in a batch), not of
            # a later op of the session.
            self.prog.launcher.synchronize()
        return out

    # ------------------------------------------------------------------ fields
    def _field(self, op: dict) -> Field:
        fid = op.get("id")
        f = self.prog.fields.get(fid) if isinstance(fid, int) else None
        if f is None:
            if fid in self.ndarrays:
                raise EngineError(f"id {fid} is a ti.ndarray, not a field: an ndarray has no "
                                  ".dual and gets its .grad when it is made (needs_grad)")
            raise EngineError(f"no field with id {fid!r} in this session")
        return f

    def _storage(self, op: dict) -> Field | _Ndarray:
        """The storage an op names (``id``, ``role``): a field's or a ti.ndarray's."""
        role = op.get("role", "primal")
        if role == "data":
            role = "primal"
        if role not in ROLES:
            raise EngineError(f"role must be one of data/primal, grad, dual; got {role!r}")
        fid = op.get("id")
        nd = self.ndarrays.get(fid) if isinstance(fid, int) else None
        if nd is not None:
            if role not in ("primal", "grad"):
                raise EngineError(f"{nd._label()} has data and .grad storage only, not "
                                  f"{role!r}")
            if role == "grad" and nd.grad is None:
                raise DifftapeError(f"{nd._label()} has no .grad: create the ndarray with "
                                    "needs_grad=True")
            return nd if role == "primal" else nd.grad
        f = self._field(op)
        s = f.companion(role)
        if s is None:
            raise DifftapeError(f"{f._label()} has no .{role.replace('_', '.')}: create the "
                                f"field with needs_{role.split('_')[-1]}=True")
        return s

    def op_create_field(self, op: dict) -> dict:
        fid = op.get("id")
        if not isinstance(fid, int) or isinstance(fid, bool) or fid <= 0:
            raise EngineError(f"field id must be a positive integer, got {fid!r}")
        dtype = _dtype(op.get("dtype"))
        shape = _int_list(op.get("shape", []), "shape")
        esh = _int_list(op.get("element_shape", []), "element_shape")
        if any(s <= 0 for s in shape + esh):
            raise ShapeError(f"field shape must be positive, got {shape} / {esh}")
        if len(shape) > 8 or len(esh) > 2:
            raise ShapeError(f"at most 8 field axes and 2 element axes, got {shape} / {esh}")
        offset = _offset(op.get("offset", []), shape)
        levels = self._levels(op.get("sparse", []), shape, offset) if op.get("sparse") \
            else None
        name = op.get("name") or ""
        if not isinstance(name, str):
            raise EngineError("name must be a string")
        if op.get("ndarray"):
            if offset:
                raise EngineError("a ti.ndarray has no offset")
            return self._create_ndarray(fid, dtype, shape, esh, name[:200], op)
        if fid in self.ndarrays:
            raise EngineError(f"id {fid} is already a ti.ndarray of this session")
        old = self.prog.fields.get(fid)
        if old is not None:
            if (old.dtype, old.shape, old.element_shape, old._offset, old._wire_levels) != \
                    (dtype, shape, esh, offset, levels):
                raise EngineError(f"field id {fid} already exists with another layout")
        else:
            self._check_count()
            copies = 1 + bool(op.get("needs_grad")) + bool(op.get("needs_dual"))
            self._check_memory(copies * _nbytes(dtype, shape, esh), f"field '{name[:200]}'")
            with _current(self.prog):
                f = Field(dtype, None, esh, name[:200])
                self.prog.unplaced.remove(f)
                f.id = fid  # the client's id: IR buffers refer to fields by it
                f._offset = offset  # only reported: the IR and the client index from 0
                f._wire_levels = levels
                f._allocate(shape)
            old = f
        for role in ("grad", "dual"):
            if op.get(f"needs_{role}"):
                self._make_companion(old, role)
        return {"id": fid, "nbytes": self._field_nbytes(old)}

    def _levels(self, spec: Any, shape: tuple[int, ...], offset: tuple[int, ...]
                ) -> list[tuple[Field, list[tuple[int, int]], bool]]:
        """``create_field``'s ``sparse``: the sparse levels above a client's field, each
        ``{"activity": id, "map": [[axis, divisor], ...], "dynamic": bool}``, checked so that
        every index the engine derives from them is in range: the activity field exists,
        is dense and of the level's dtype (i8 per cell, i32 lengths per list), and its shape
        is the field's divided along the mapped axes (a list's own axis last, undivided).
        Python-scope writes then activate and mask as locally, and reverse-mode kernels guard
        their adjoints with them (``sparse_levels``)."""
        if not isinstance(spec, list) or len(spec) > 8:
            raise EngineError("sparse: a list of at most 8 levels expected")
        if offset:
            raise EngineError("sparse: a field under sparse SNodes has no offset")
        out = []
        for k, lvl in enumerate(spec):
            if not isinstance(lvl, dict) or set(lvl) != {"activity", "map", "dynamic"} or \
                    not isinstance(lvl["dynamic"], bool) or not isinstance(lvl["map"], list):
                raise EngineError(f"sparse level {k}: {{activity, map, dynamic}} expected")
            act = self.prog.fields.get(lvl["activity"]) \
                if isinstance(lvl["activity"], int) else None
            if act is None or act._wire_levels is not None or act.element_shape or \
                    act._offset:
                raise EngineError(f"sparse level {k}: activity {lvl['activity']!r:.40} is not a "
                                  "dense scalar field of this session")
            dynamic = lvl["dynamic"]
            if act.dtype != (T.i32 if dynamic else T.i8):
                raise EngineError(f"sparse level {k}: its activity field must be "
                                  f"{'i32' if dynamic else 'i8'}, got {act.dtype}")
            imap = [_int_list(m, f"sparse level {k}'s map entry") for m in lvl["map"]]
            if any(len(m) != 2 or not 0 <= m[0] < len(shape) or m[1] < 1 for m in imap) or \
                    len({q for q, _ in imap}) != len(imap):
                raise EngineError(f"sparse level {k}: map entries are distinct [axis, divisor "
                                  f">= 1] pairs of a {len(shape)}-axis field")
            cells = imap[:-1] if dynamic else imap
            if dynamic and (not imap or imap[-1][1] != 1):
                raise EngineError(f"sparse level {k}: a list's own axis comes last, undivided")
            if act.shape != tuple(shape[q] // d for q, d in cells) or \
                    any(shape[q] % d for q, d in cells):
                raise EngineError(f"sparse level {k}: activity shape {act.shape} does not "
                                  f"divide the field's {shape} by the map {imap}")
            out.append((act, [(q, d) for q, d in imap], dynamic))
        return out

    def _check_count(self) -> None:
        """The ``fields`` quota: fields and ndarrays together."""
        n = len(self.prog.fields) + len(self.ndarrays)
        if self.max_fields is not None and n >= self.max_fields:
            raise QuotaExceededError(f"this session has {n} fields and ndarrays, the most a "
                                     "session may have", limit="fields")

    def _create_ndarray(self, fid: int, dtype: T.DType, shape: tuple, esh: tuple, name: str,
                        op: dict) -> dict:
        if op.get("needs_dual"):
            raise EngineError("a ti.ndarray has no .dual storage (needs_dual)")
        if fid in self.prog.fields:
            raise EngineError(f"id {fid} is already a field of this session")
        grad = bool(op.get("needs_grad"))
        old = self.ndarrays.get(fid)
        if old is not None:
            if (old.dtype, old.shape, old.element_shape, old.grad is not None) != \
                    (dtype, shape, esh, grad):
                raise EngineError(f"ndarray id {fid} already exists with another layout")
        else:
            self._check_count()
            self._check_memory((1 + grad) * _nbytes(dtype, shape, esh), f"ndarray '{name}'")
            with _current(self.prog):  # an in-process client's program must not see it
                old = _Ndarray(dtype, shape, esh, needs_grad=grad)
            old.setup(fid, name)
            self.ndarrays[fid] = old
        return {"id": fid, "nbytes": self._field_nbytes(old)}

    @staticmethod
    def _field_nbytes(f: Field | _Ndarray) -> int:
        if isinstance(f, Ndarray):
            return f.storage.nbytes * (2 if f.grad is not None else 1)
        return sum(s.storage.nbytes for s in (f, f.companion("grad"), f.companion("dual"),
                                              f.mark)
                   if s is not None)

    def _make_companion(self, f: Field, role: str) -> None:
        if f.companion(role) is not None:
            return
        if role == "mark":  # Tape(validation=True): one byte per element, no new variants
            if not f.dtype.is_float:
                raise EngineError(f"only float fields have read marks, not {f._label()}")
            with _current(self.prog):
                f.make_mark()
            return
        if role == "grad_dual":
            self._make_companion(f, "grad")
            f, role = f.grad, "dual"
        self._check_memory(f.storage.nbytes, f"{f._label()}.{role}")
        with _current(self.prog):
            f._make_companion(role)
        self.epoch += 1  # derivative variants compiled before now would not see it

    def op_companion(self, op: dict) -> dict:
        f = self._field(op)
        role = op.get("role")
        if role not in ROLES[1:]:
            raise EngineError(f"companion role must be one of {', '.join(ROLES[1:])}, "
                              f"got {role!r}")
        self._make_companion(f, role)
        return {}

    def op_write(self, op: dict, payload: bytes | memoryview | None) -> tuple[dict, None]:
        s = self._storage(op)
        arr = s.storage
        dtype = _dtype(op.get("dtype", s.dtype.name)).np
        shape = _int_list(op.get("shape", list(arr.shape)), "shape")
        if shape != arr.shape:
            raise ShapeError(f"write: {s._label()} has shape {arr.shape}, the data has shape "
                             f"{shape}")
        # The worker may hand over a memoryview of its shared mapping: read it, keep nothing.
        data = memoryview(payload if payload is not None else b"").cast("B")
        if data.nbytes != arr.size * dtype.itemsize:
            raise ShapeError(f"write: expected {arr.size * dtype.itemsize} bytes for "
                             f"{shape} {dtype}, got {data.nbytes}")
        src = np.frombuffer(data, dtype=dtype).reshape(shape)
        mask = _active_mask(s)  # from_numpy of a sparse field: its active cells
        np.copyto(arr.write(), src, casting="unsafe", where=True if mask is None else mask)
        return {}, None

    def op_read(self, op: dict, payload: bytes | None) -> tuple[dict, memoryview]:
        if payload:
            raise EngineError("op 'read' takes no payload")
        s = self._storage(op)
        # A view, not a copy: the worker sends it before it runs the next op.
        return ({"dtype": s.dtype.name, "shape": list(s.storage.shape)},
                memoryview(s.storage.read().reshape(-1).view(np.uint8)))

    def op_get_bytes(self, op: dict) -> dict:
        """A small field's raw bytes inside a batch's answer (base64): read with the launches
        before it, in one round trip."""
        s = self._storage(op)
        if s.storage.nbytes > INLINE_BYTES:
            raise EngineError(f"get_bytes: {s._label()} has {s.storage.nbytes} bytes, more than "
                              f"{INLINE_BYTES}; read it with 'read'")
        return {"b64": base64.b64encode(s.storage.read().tobytes()).decode("ascii")}

    def op_set_bytes(self, op: dict) -> dict:
        """A small field's raw bytes (its own dtype, C order, base64) inside a batch."""
        s = self._storage(op)
        text = op.get("b64")
        if not isinstance(text, str):
            raise EngineError("set_bytes: 'b64' must be a base64 string")
        try:
            data = base64.b64decode(text, validate=True)
        except ValueError:
            raise EngineError("set_bytes: 'b64' is not valid base64") from None
        if len(data) != s.storage.nbytes:
            raise ShapeError(f"set_bytes: {s._label()} has {s.storage.nbytes} bytes, got "
                             f"{len(data)}")
        src = np.frombuffer(data, dtype=s.storage.dtype)
        mask = _active_mask(s)
        if mask is None:
            s.storage.write().reshape(-1)[:] = src
        else:  # from_numpy of a field under sparse SNodes: its active cells, as locally
            np.copyto(s.storage.write(), src.reshape(s.storage.shape), where=mask)
        return {}

    def op_zero(self, op: dict) -> dict:
        """Zero a storage whole, active cells or not (``deactivate_all``: the activity fields
        and the data below them)."""
        self.prog.zero(self._storage(op).storage)
        return {}

    def op_fill(self, op: dict) -> dict:
        s = self._storage(op)
        value = from_jsonable(op.get("value"))
        mask = _active_mask(s)
        try:
            if mask is not None:  # as a local fill of a sparse field: the active cells
                np.copyto(s.storage.write(), np.asarray(value, dtype=s.dtype.np), where=mask)
            else:
                s.storage.write()[...] = np.asarray(value, dtype=s.dtype.np) \
                    if isinstance(value, list) else value
        except (TypeError, ValueError) as e:
            raise ShapeError(f"fill {s._label()}: {e}") from None
        return {}

    def _index(self, s: Field, op: dict) -> tuple[int, ...]:
        index = _int_list(op.get("index", []), "index")
        shape = s.shape
        if len(index) != len(shape):
            raise ShapeError(f"{s._label()} has {len(shape)} indices (shape {shape}) but was "
                             f"indexed with {len(index)}")
        for axis, (i, n) in enumerate(zip(index, shape, strict=True)):
            if not -n <= i < n:
                raise EngineError(f"index {i} is out of bounds for axis {axis} of "
                                  f"{s._label()} with size {n}")
        return tuple(i + n if i < 0 else i for i, n in zip(index, shape, strict=True))

    def op_get_item(self, op: dict) -> dict:
        s = self._storage(op)
        value = s.storage.read()[self._index(s, op)]
        return {"value": jsonable(value.tolist())}

    def op_set_item(self, op: dict) -> dict:
        s = self._storage(op)
        key = self._index(s, op)
        value = from_jsonable(op.get("value"))
        try:
            if s.element_shape:
                s.storage.write()[key] = np.asarray(value, dtype=s.dtype.np).reshape(
                    s.element_shape)
            else:
                if not _number(value):
                    raise TypeError(f"expected a number, got {type(value).__name__}")
                s.storage.write()[key] = value
        except (TypeError, ValueError, OverflowError) as e:
            raise ShapeError(f"{s._label()}[{list(key)}] = ...: {e}") from None
        if isinstance(s, Field):  # a write activates the cells along its path, as locally
            s._np_activate(key)
        return {}

    def op_clear_grads(self, op: dict) -> dict:
        for f in list(self.prog.fields.values()):
            if f.has_grad:
                self.prog.zero(f.grad.storage)
        return {}

    def op_seed(self, op: dict) -> dict:
        """Restart ``ti.random`` from the client's ``ti.init(random_seed=)``."""
        self.prog.seed_random(int(op["value"]))
        return {}

    def op_clear_duals(self, op: dict) -> dict:
        """Zero every ``.dual`` and ``.grad.dual`` (as ``FwdMode`` does on entry)."""
        for f in list(self.prog.fields.values()):
            for d in (f.companion("dual"), f.companion("grad_dual")):
                if d is not None:
                    self.prog.zero(d.storage)
        return {}

    # ------------------------------------------------------------------ kernels
    def _check_buffers(self, ir: KernelIR) -> None:
        """Every buffer must be storage of this session, exactly as the IR describes it."""
        for buf in ir.buffers:
            key = buf.key
            if not isinstance(key, tuple) or len(key) != 3:
                raise CompileError(f"malformed buffer key {key!r}", kernel=ir.name)
            kind, ident, role = key
            if kind == "ndarray":
                # An argument (checked by each launch against the storage it binds), not
                # storage of the session; the decoder checked the key.
                continue
            if kind != "field" or role not in ROLES or not isinstance(ident, int):
                raise CompileError(f"malformed buffer key {key!r}", kernel=ir.name)
            f = self.prog.fields.get(ident)
            if f is None:
                raise CompileError(f"kernel uses field id {ident} ('{buf.name}'), which this "
                                   "session does not have", kernel=ir.name)
            s = f.companion(role)
            if s is None:
                raise CompileError(f"'{buf.name}' is used but was never allocated: create the "
                                   f"field with needs_{role}=True", kernel=ir.name)
            full = f.shape + f.element_shape
            if (buf.dtype != s.dtype or tuple(buf.shape) != full
                    or buf.element_ndim != len(f.element_shape)):
                raise CompileError(f"kernel describes '{buf.name}' as {buf.dtype} "
                                   f"{tuple(buf.shape)}, but field {ident} ({role}) is "
                                   f"{s.dtype} {full}", kernel=ir.name)
            if buf.offset != f._offset:  # the bounds checks report indices with it
                raise CompileError(f"kernel describes '{buf.name}' with offset "
                                   f"{buf.offset or None}, but field {ident} has offset "
                                   f"{f._offset or None}", kernel=ir.name)

    def op_register(self, op: dict) -> dict:
        data = op.get("ir")
        ir = _decode_ir(data)
        self._check_buffers(ir)
        kid = serialize.fingerprint(ir)
        if kid not in self.kernels:
            if self.max_kernels is not None and len(self.kernels) >= self.max_kernels:
                raise QuotaExceededError(f"this session has {len(self.kernels)} kernels, the "
                                         f"most a session may have", limit="kernels")
            self.kernels[kid] = _Kernel(data, ir)
        return {"kernel_id": kid}

    def _compile(self, kid: str, variant: str, grads: dict[int, bool]) -> CompiledKernel:
        k = self.kernels[kid]
        t0 = time.perf_counter()
        ir = _decode_ir(k.data)  # derive and the passes consume their input: decode afresh
        self._check_buffers(ir)  # fields are never removed, but stay strict
        ir.debug = True  # bounds checks on every access: remote kernels never write astray
        prog = self.prog

        def storage(buf, role: str) -> bool:
            # The local runtime's predicate; an ndarray argument has a .grad when the launch
            # says so (its storage has one and the annotation does not say needs_grad=False).
            if buf.key[0] == "ndarray":
                return role == "grad" and buf.key[2] == "primal" and grads.get(buf.key[1],
                                                                                 False)
            return has_storage(prog, (), buf, role)

        checks = ir.overflow_checks  # the client's debug=True: overflow reports, printed
        # Sparse fields: adjoints reach active cells only, as locally (their levels came
        # with create_field).
        ir = derive(ir, variant, storage, lambda buf: sparse_levels(prog, buf))
        ir.overflow_checks = checks
        ir = run_pipeline(ir)
        sink = self.prog.print_sink
        if not sink.allocated and kernel_prints(ir):  # taken with the first kernel that prints
            self._check_memory(sink.footprint, f"the print sink (kernel '{ir.name}' prints)",
                               scratch=True)
            sink.allocate()
        stats = CompileStats()
        inst = compile_ir(ir, self.prog, stats, k.arg_names)
        if self.prog.launcher is None:  # a grid's are admitted as its scratch blocks
            # Not kept (nor counted) until admitted: a refusal drops it with the instance.
            self._check_memory(inst.ctx_i64.nbytes, f"the launch context of kernel "
                               f"'{ir.name}'", scratch=True)
        if stats.cache_hit:
            self.cache_hits += 1
        else:
            self.cache_misses += 1
        self.compile_s += time.perf_counter() - t0
        return inst

    def _bind_arrays(self, k: _Kernel, spec: Any) -> tuple[dict[int, _Ndarray], dict]:
        """The launch's ``arrays`` (``[{"arg", "id", "grad"}]``): the ti.ndarray storage of
        each ndarray argument the kernel uses, checked against the IR's description of it
        (dtype, number of axes, element shape, a .grad where it is used), as the local
        runtime checks an argument before it compiles. Extents come from the storage, and
        every access is bounds-checked against them."""
        if not isinstance(spec, list):
            raise EngineError("launch: 'arrays' must be a list of {arg, id, grad}")
        bound: dict[int, _Ndarray] = {}
        grads: dict[int, bool] = {}
        name = k.name
        for a in spec:
            if not isinstance(a, dict) or not isinstance(a.get("arg"), int) or \
                    not isinstance(a.get("id"), int) or not isinstance(a.get("grad", False),
                                                                       bool):
                raise EngineError(f"launch: each of 'arrays' is {{arg, id, grad}}, got {a!r:.80}")
            arg, fid = a["arg"], a["id"]
            if arg in bound:
                raise ArgumentError(f"kernel '{name}': ndarray argument {arg + 1} is bound "
                                    "twice", kernel=name)
            if arg not in k.arrays:
                raise ArgumentError(f"kernel '{name}': argument {arg + 1} is not an ndarray "
                                    "argument the kernel uses", kernel=name)
            nd = self.ndarrays.get(fid)
            if nd is None:
                what = "a field (fields are captured, not passed)" \
                    if fid in self.prog.fields else "unknown"
                raise ArgumentError(f"kernel '{name}': argument {arg + 1} names id {fid}, which "
                                    f"is not a ti.ndarray of this session ({what})",
                                    kernel=name)
            if a.get("grad") and nd.grad is None:
                raise ArgumentError(f"kernel '{name}': argument {arg + 1} ({nd._label()}) has "
                                    "no .grad storage", kernel=name)
            for buf in k.arrays[arg]:
                esh = tuple(buf.shape[len(buf.shape) - buf.element_ndim:])
                if buf.dtype != nd.dtype or len(buf.shape) != nd.storage.ndim or \
                        esh != nd.element_shape:
                    ndim = len(buf.shape) - buf.element_ndim
                    raise ArgumentError(
                        f"kernel '{name}': argument {arg + 1} must be a {ndim}-D ndarray of "
                        f"{buf.dtype} with element shape {esh}, got {nd._label()}: "
                        f"{len(nd.shape)}-D {nd.dtype} with element shape "
                        f"{nd.element_shape}", kernel=name)
                if buf.key[2] == "grad" and nd.grad is None:
                    raise ArgumentError(f"kernel '{name}' uses the .grad of argument "
                                        f"{arg + 1}, but {nd._label()} has none", kernel=name)
            bound[arg] = nd
            grads[arg] = bool(a.get("grad"))
        missing = sorted(set(k.arrays) - set(bound))
        if missing:
            raise ArgumentError(f"kernel '{name}': ndarray argument {missing[0] + 1} is not "
                                "bound (launch 'arrays')", kernel=name)
        return bound, grads

    def op_launch(self, op: dict) -> dict:
        kid = op.get("kernel_id")
        k = self.kernels.get(kid) if isinstance(kid, str) else None
        if k is None:
            raise EngineError(f"unknown kernel id {kid!r:.80}: register the kernel first")
        variant = op.get("variant", "primal")
        if variant not in VARIANTS:
            raise EngineError(f"variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
        args = op.get("args", [])
        if not isinstance(args, list) or len(args) != k.nparams:
            raise ArgumentError(f"kernel '{k.name}' takes {k.nparams} scalar argument(s) "
                                f"(vectors flattened), got {args!r:.80}", kernel=k.name)
        for a in args:
            if not isinstance(a, numbers.Real):
                raise ArgumentError(f"kernel '{k.name}': arguments must be numbers, got "
                                    f"{a!r:.40}", kernel=k.name)
        bound, grads = self._bind_arrays(k, op.get("arrays", []))
        # Derivative variants depend on which storage has a .grad/.dual: the epoch (fields)
        # and which ndarray arguments have one.
        key = (kid, variant, 0, ()) if variant == "primal" else \
            (kid, variant, self.epoch, tuple(sorted(a for a, g in grads.items() if g)))
        inst = self.compiled.get(key)
        if inst is None:
            inst = self._compile(kid, variant, grads)
            if variant != "primal":
                # Variants compiled before a field gained storage are never used again, and
                # at most 4 ndarray .grad patterns are kept: a bounded number per kernel.
                same = [c for c in self.compiled if c[:2] == key[:2]]
                current = [c for c in same if c[2] == key[2]]  # oldest first
                for old in [c for c in same if c[2] != key[2]] + current[:len(current) - 3]:
                    del self.compiled[old]
            self.compiled[key] = inst
        self.launches += 1
        result = inst.launch(k.call_args(args, bound))
        return {"result": jsonable(result)}

    # ------------------------------------------------------------------ batches
    def op_batch(self, op: dict) -> dict:
        ops = op.get("ops")
        if not isinstance(ops, list):
            raise EngineError("batch: 'ops' must be a list")
        results = []
        for i, sub in enumerate(ops):
            name = sub.get("op") if isinstance(sub, dict) else None
            try:
                if name in PAYLOAD_OPS or name == "batch":
                    raise EngineError(f"batch: op {name!r} cannot be part of a batch")
                results.append(self.execute(sub)[0])
            except DifftapeError as e:
                e.op_index = i  # the worker reports where the batch stopped
                raise
        return {"results": results}

    # ------------------------------------------------------------------ derivative loops
    # Library operations that loop over launches and reads (ti.ad.jacobian, hessian, hvp,
    # Tape(grad_check=...)) run here, where the data is, as one op each: the client records
    # the launches its Python program makes (the frontend runs there), and sends them as a
    # ``program`` of plain ops that this engine repeats. No client code runs here.

    def _run_program(self, ops: Any, what: str) -> None:
        if not isinstance(ops, list):
            raise EngineError(f"{what}: 'program' must be a list of ops")
        for i, sub in enumerate(ops):
            name = sub.get("op") if isinstance(sub, dict) else None
            if name not in PROGRAM_OPS:
                raise EngineError(f"{what}: op {name!r} cannot be part of a program (only "
                                  f"{', '.join(PROGRAM_OPS)})")
            try:
                self.execute(sub)
            except DifftapeError as e:
                e.add_note(f"in op {i + 1} of the {what} program ({name})")
                raise

    def _storages(self, spec: Any, what: str) -> list[Field]:
        if not isinstance(spec, dict) or not isinstance(spec.get("fields"), list):
            raise EngineError(f"{what}: expected {{'role': ..., 'fields': [ids]}}")
        role = spec.get("role")
        return [self._storage({"id": fid, "role": role}) for fid in spec["fields"]]

    def _sweep(self, clear: Any, seeds: list[Field], reads: list[Field], program: Any,
               vectors: np.ndarray | None) -> np.ndarray:
        """For each seed vector (rows of ``vectors``; None: each one-hot vector over the seed
        storages): clear (``clear_duals``/``clear_grads``), write the seed, run the program
        and read the ``read`` storages, flattened. Returns (columns, read scalars) float64."""
        if clear not in ("clear_duals", "clear_grads"):
            raise EngineError("sweep: 'clear' must be 'clear_duals' or 'clear_grads'")
        sizes = [s.storage.size for s in seeds]
        total = sum(sizes)
        count = total if vectors is None else len(vectors)
        if vectors is not None and vectors.shape[1:] != (total,):
            raise EngineError(f"sweep: each seed vector must have {total} values")
        columns = np.zeros((count, sum(r.storage.size for r in reads)), dtype=np.float64)
        for c in range(count):
            self.execute({"op": clear})
            if vectors is None:
                k = c
                for s, n in zip(seeds, sizes, strict=True):
                    if 0 <= k < n:
                        # (cleared: the rest of every seed is 0)
                        s.storage.write().reshape(-1)[k] = 1
                    k -= n
            else:
                k = 0
                for s, n in zip(seeds, sizes, strict=True):
                    s.storage.write().reshape(-1)[:] = vectors[c, k:k + n].astype(s.dtype.np)
                    k += n
            self._run_program(program, "sweep")
            if reads:
                columns[c] = np.concatenate([r.storage.read().reshape(-1) for r in reads])
        return columns

    def op_sweep(self, op: dict) -> dict:
        """Columns of a derivative matrix (see :meth:`_sweep`); ``before`` runs once first and
        ``after`` once at the end. Seeds and columns travel as raw float64 bytes (base64),
        never as lists of numbers. Local: ``ad/functional.py``."""
        self._run_program(op.get("before", []), "sweep")
        seeds = self._storages(op.get("seed"), "sweep seed")
        reads = self._storages(op.get("read"), "sweep read")
        vectors = op.get("vectors")
        if vectors is not None:
            total = sum(s.storage.size for s in seeds)
            flat = _f64_from_b64(vectors, "sweep: 'vectors'")
            if total == 0 or flat.size % total:
                raise EngineError(f"sweep: 'vectors' must hold whole seed vectors of {total} "
                                  "float64 values")
            vectors = flat.reshape(-1, total)
        columns = self._sweep(op.get("clear"), seeds, reads, op.get("program", []), vectors)
        self._run_program(op.get("after", []), "sweep")
        return {"columns": base64.b64encode(columns.tobytes()).decode("ascii"),
                "shape": list(columns.shape)}

    def op_newton(self, op: dict) -> dict:
        """``ti.ad.newton`` as one op: the iteration of ``difftape.ad.newton.iterate`` (the
        very function a local solve runs) over three recorded programs: ``value_grad`` (the
        Tape over the loss), ``hessian`` (its forward-over-reverse pass, swept over one-hot
        seeds as ``sweep`` does) and ``primal`` (the loss alone, for the line search)."""
        loss = self._storage({"id": op.get("loss"), "role": "primal"})
        ids = op.get("params")
        if not isinstance(ids, list) or not ids:
            raise EngineError("newton: 'params' must be a non-empty list of field ids")
        params = [self._storage({"id": i, "role": "primal"}) for i in ids]
        grads = [self._storage({"id": i, "role": "grad"}) for i in ids]
        duals = [self._storage({"id": i, "role": "dual"}) for i in ids]
        grad_duals = [self._storage({"id": i, "role": "grad_dual"}) for i in ids]
        tol, max_iter = op.get("tol"), op.get("max_iter")
        if not isinstance(tol, int | float) or isinstance(tol, bool):
            raise EngineError("newton: 'tol' must be a number")
        newton_options(float(tol), max_iter)
        programs = {k: op.get(k) for k in ("value_grad", "hessian", "primal")}
        engine = self

        class Steps:
            def value_and_grad(self) -> tuple[float, np.ndarray]:
                engine._run_program(programs["value_grad"], "newton")
                return float(loss.storage.read().reshape(-1)[0]), np.concatenate(
                    [g.storage.read().reshape(-1).astype(np.float64) for g in grads])

            def hessian(self) -> np.ndarray:
                cols = engine._sweep("clear_duals", duals, grad_duals, programs["hessian"],
                                     None)
                engine.execute({"op": "clear_duals"})
                return np.ascontiguousarray(cols.T)

            def get(self) -> np.ndarray:
                return np.concatenate([p.storage.read().reshape(-1).astype(np.float64)
                                       for p in params])

            def set(self, flat: np.ndarray) -> None:
                k = 0
                for p in params:
                    n = p.storage.size
                    p.storage.write()[...] = flat[k:k + n].astype(p.dtype.np).reshape(
                        p.storage.shape)
                    k += n

            def value(self) -> float:
                engine._run_program(programs["primal"], "newton")
                return float(loss.storage.read().reshape(-1)[0])

        r = newton_iterate(Steps(), float(tol), max_iter)
        return {"iterations": r.iterations, "loss": jsonable(r.loss),
                "grad_norm": jsonable(r.grad_norm), "converged": r.converged}

    def op_snapshot(self, op: dict) -> dict:
        """Keep a copy of every field's values (``Tape(grad_check=...)`` on entry)."""
        key = op.get("key")
        if not isinstance(key, int):
            raise EngineError("snapshot: 'key' must be an integer")
        if len(self.snapshots) >= 4:  # a client that never checks must not pile them up
            self.snapshots.pop(next(iter(self.snapshots)))
        self.snapshots.pop(key, None)
        self._check_memory(sum(f.storage.nbytes for f in self.prog.fields.values()),
                           "a Tape(grad_check=...) snapshot of the fields", scratch=True)
        self.snapshots[key] = {fid: f.storage.read().copy()
                               for fid, f in self.prog.fields.items()}
        return {}

    def op_grad_check(self, op: dict) -> dict:
        """``Tape(grad_check=[...])`` after back-propagation: each field's gradient against
        central finite differences of the recorded ``program`` replayed from the snapshot,
        exactly as the local Tape does it (``difftape.ad.finite_difference_check``); every
        field and gradient is restored afterwards. Returns the disagreements."""
        from difftape.ad.tape import finite_difference_check

        snap = self.snapshots.pop(op.get("snapshot"), None)
        if snap is None:
            raise EngineError("grad_check: no such snapshot (take one with 'snapshot' when "
                              "the Tape begins)")
        loss = self._storage({"id": op.get("loss"), "role": "primal"})
        checked = [self._field({"id": fid}) for fid in op.get("fields", [])]
        labels = op.get("labels") or [f._label() for f in checked]
        if len(labels) != len(checked) or not all(isinstance(x, str) for x in labels):
            raise EngineError("grad_check: 'labels' must name each checked field")
        fields = self.prog.fields
        after = {i: f.storage.read().copy() for i, f in fields.items()}
        grads = {i: f.grad.storage.read().copy() for i, f in fields.items() if f.has_grad}
        program = op.get("program", [])

        def replay(field: Field, idx: tuple, delta: float) -> float:
            for i, arr in snap.items():
                if i in fields:
                    np.copyto(fields[i].storage.write(), arr)
            moved = snap[field.id].copy()
            moved[idx] += delta
            np.copyto(field.storage.write(), moved)
            self._run_program(program, "grad_check")
            return float(loss.storage.read().reshape(-1)[0])

        bad: list[str] = []
        try:
            for f, label in zip(checked, labels, strict=True):
                if not f.has_grad:
                    raise DifftapeError(f"grad_check: '{f._label()}' has no gradient storage")
                if f.id not in snap:
                    raise EngineError(f"grad_check: {f._label()} was created after the "
                                      "snapshot")
                bad += finite_difference_check(
                    label, f.grad.storage.read().copy(), snap[f.id], f.dtype.bits,
                    lambda idx, delta, f=f: replay(f, idx, delta), f._offset)
        finally:
            for i, arr in after.items():
                np.copyto(fields[i].storage.write(), arr)
            for i, arr in grads.items():
                np.copyto(fields[i].grad.storage.write(), arr)
        return {"bad": bad}

    # ------------------------------------------------------------------ graphs
    def op_graph_create(self, op: dict) -> dict:
        """A graph document (``difftape.graph.wire``): validated and compiled as a saved
        graph is loaded (``saved.build``), over this session's fields (``fields`` maps the
        document's field ids to the session's; by default they are the same) and ndarrays,
        with bounds checks on; kept under its content hash, which ``graph_id`` must be."""
        doc, fmap = op.get("graph"), op.get("fields")
        if fmap is not None and (not isinstance(fmap, dict) or not all(
                isinstance(v, int) for v in fmap.values())):
            raise EngineError("graph_create: 'fields' maps the graph's field ids to the "
                              "session's")
        gid = wire.graph_id({"graph": doc, "fields": fmap})
        if op.get("graph_id") != gid:
            raise EngineError("graph_create: 'graph_id' is not the graph's content hash")
        if gid in self.graphs:
            return {"graph_id": gid}
        if len(self.graphs) >= wire.MAX_GRAPHS:
            raise QuotaExceededError(f"this session holds {len(self.graphs)} graphs, the most a "
                                     "session may hold", limit="graphs")
        saved_graphs.check_document(doc)
        fields = self.prog.fields

        def field_for(fid: int, key: str) -> Field | None:
            return fields.get(fmap.get(str(fid)) if fmap is not None else fid)

        t0 = time.perf_counter()
        with _current(self.prog):
            graph = saved_graphs.build(doc, self.prog, field_for, ndarrays=self.ndarrays,
                                       checked=True)
        self.compile_s += time.perf_counter() - t0
        self.graphs[gid] = (graph, op)
        return {"graph_id": gid}

    def op_graph_replay(self, op: dict) -> dict:
        """Replay a graph of this session with ``inputs`` (``difftape.graph.wire``); answers
        the bytes of the array inputs sent as bytes that the graph writes."""
        gid = op.get("graph_id")
        entry = self.graphs.get(gid) if isinstance(gid, str) else None
        if entry is None:
            raise EngineError(f"graph_replay: no graph {gid!r:.80} in this session (send it "
                              "with graph_create first)")
        graph = entry[0]
        inputs = op.get("inputs", {})
        if not isinstance(inputs, dict):
            raise EngineError("graph_replay: 'inputs' must be an object")
        sent: list[tuple[str, _Ndarray]] = []
        for name, v in inputs.items():
            inp = graph._inputs.get(name)
            if inp is None:
                raise GraphError(f"the graph has no input '{name}' (inputs: "
                                 f"{', '.join(graph._inputs) or 'none'})")
            graph._bind(inp, self._graph_value(inp, v, sent))
        with _current(self.prog):
            graph.replay()
        self.launches += graph.launches
        written = sorted(graph.written_inputs)
        return {"written": written,
                "arrays": {name: wire.encode_bytes(nd.storage.read().tobytes()) for name, nd in sent
                           if name in graph.written_inputs}}

    def _graph_value(self, inp, v: Any, sent: list) -> Any:
        """An input's value as it travels (``difftape.graph.wire``), as ``Graph`` takes it."""
        name = inp.name
        try:
            if inp.kind == "scalar":
                return wire.number(v, f"graph input '{name}'")
            if inp.kind == "matrix":
                if not isinstance(v, list) or len(v) > 4096:
                    raise ValueError(f"graph input '{name}': a list of entries expected")
                return [wire.number(x, f"graph input '{name}'") for x in v]
            if inp.kind == "field":
                if not isinstance(v, dict) or not isinstance(v.get("field"), int):
                    raise ValueError(f"graph input '{name}': {{\"field\": id}} expected")
                return self._field({"id": v["field"]})
            if not isinstance(v, dict) or v.get("ndarray") not in self.ndarrays:
                raise ValueError(f"graph input '{name}': {{\"ndarray\": id}} of an ndarray "
                                 "of this session expected")
            nd = self.ndarrays[v["ndarray"]]
            if "b64" in v:
                data = wire.decode_bytes(v["b64"], f"graph input '{name}'")
                out = nd.storage.write()
                if len(data) != out.nbytes:
                    raise ShapeError(f"graph input '{name}': {len(data)} bytes for an array "
                                     f"of {out.nbytes}")
                out.reshape(-1)[:] = np.frombuffer(data, dtype=out.dtype)
                sent.append((name, nd))
            return nd
        except ValueError as e:
            raise EngineError(str(e)) from None

    # ------------------------------------------------------------------ persistence
    def op_save(self, op: dict, payload: None = None) -> tuple[dict, memoryview]:
        """Fields (with companions), ndarrays (with their .grad) and registered kernels as one
        ``.npz``, answered as the payload, so a culled or lost session resumes with its data
        and its kernel ids intact. The gateway writes it where every gateway reaches it: the
        engine may run on another machine (a Ray actor), whose disk is not the gateway's."""
        if payload:
            raise EngineError("op 'save' takes no payload")
        meta = {"fields": [], "ndarrays": [], "kernels": [k.data for k in self.kernels.values()],
                "graphs": [op for _, op in self.graphs.values()]}
        arrays: dict[str, np.ndarray] = {}
        for fid, f in self.prog.fields.items():
            roles = [r for r in ROLES if f.companion(r) is not None]
            meta["fields"].append({"id": fid, "dtype": f.dtype.name, "shape": list(f.shape),
                                   "element_shape": list(f.element_shape), "name": f.name,
                                   "roles": roles, "offset": list(f._offset),
                                   "sparse": _levels_wire(f)})
            for r in roles:
                arrays[f"{fid}_{r}"] = f.companion(r).storage.read()
        for fid, nd in self.ndarrays.items():
            meta["ndarrays"].append({"id": fid, "dtype": nd.dtype.name, "shape": list(nd.shape),
                                     "element_shape": list(nd.element_shape), "name": nd.name,
                                     "needs_grad": nd.grad is not None})
            arrays[f"{fid}_primal"] = nd.storage.read()
            if nd.grad is not None:
                arrays[f"{fid}_grad"] = nd.grad.storage.read()
        arrays[_SAVE_META] = np.array(json.dumps(meta))
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return {}, buf.getbuffer()

    def op_load(self, op: dict, payload: bytes | memoryview | None = None
                ) -> tuple[dict, None]:
        """The inverse of ``save``, from its ``.npz`` as the payload. Answers
        ``{"fields": [...]}``, the restored fields as ``create_field`` describes them (with
        their storage ``roles``), so that the gateway's records match what came back (a
        save may predate fields the gateway still lists)."""
        if payload is None:
            raise EngineError("op 'load' takes the .npz that 'save' answered as its payload")
        try:
            npz = np.load(io.BytesIO(payload), allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise EngineError(f"load: cannot read the saved session: {e}") from None
        with npz:
            meta = json.loads(str(npz[_SAVE_META]))
            for d in meta["fields"]:
                roles = d["roles"]
                self.op_create_field({"id": d["id"], "dtype": d["dtype"], "shape": d["shape"],
                                      "element_shape": d["element_shape"], "name": d["name"],
                                      "offset": d.get("offset", []),
                                      "sparse": d.get("sparse", [])})
                for r in roles[1:]:
                    self.op_companion({"id": d["id"], "role": r})
                for r in roles:
                    src = npz[f"{d['id']}_{r}"]
                    dst = self._storage({"id": d["id"], "role": r}).storage
                    if src.shape != dst.shape or src.dtype != dst.dtype:
                        raise EngineError(f"load: field {d['id']}.{r} does not match its "
                                          "saved description")
                    np.copyto(dst.write(), src)
            for d in meta.get("ndarrays", []):
                self.op_create_field({**d, "ndarray": True})
                for r in ("primal", "grad") if d["needs_grad"] else ("primal",):
                    src = npz[f"{d['id']}_{r}"]
                    dst = self._storage({"id": d["id"], "role": r}).storage
                    if src.shape != dst.shape or src.dtype != dst.dtype:
                        raise EngineError(f"load: ndarray {d['id']}.{r} does not match its "
                                          "saved description")
                    np.copyto(dst.write(), src)
        for data in meta["kernels"]:
            self.op_register({"ir": data})
        for op in meta.get("graphs", []):
            try:
                self.op_graph_create(op)
            except DifftapeError:
                pass  # over storage the save lacks: dropped, as such kernels are (a replay of
                # it is refused as unknown)
        ndarrays = [{**d, "ndarray": True, "roles": ["primal", "grad"] if d["needs_grad"]
                     else ["primal"]} for d in meta.get("ndarrays", [])]
        return {"fields": meta["fields"] + ndarrays}, None

    def op_stats(self, op: dict) -> dict:
        """Counters and figures for the gateway's /metrics (``scratch``: :meth:`scratch`, the
        memory beyond fields that the session's quota counts too). On a CUDA device also the device
        (name, memory used and total, utilisation: ``CudaLauncher.status``), the device
        memory this session holds in all (fields and scratch: launch contexts, stack pools,
        random states) and how its modules were loaded (cubins from the cache, assembled,
        or PTX through the driver's JIT)."""
        stored = [*self.prog.fields.values(), *self.ndarrays.values()]
        out = {"field_bytes": sum(self._field_nbytes(f) for f in stored),
               "kernels": len(self.kernels), "launches": self.launches,
               "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
               "compile_s": self.compile_s, "scratch": self.scratch(),
               "scratch_grant": self.scratch_grant}
        launcher = self.prog.launcher
        if hasattr(launcher, "status"):
            out["device"] = launcher.status()
            out["code_loads"] = launcher.loads.as_dict()
        return out


_HANDLERS = {
    "create_field": Engine.op_create_field,
    "companion": Engine.op_companion,
    "write": Engine.op_write,
    "read": Engine.op_read,
    "fill": Engine.op_fill,
    "get_bytes": Engine.op_get_bytes,
    "set_bytes": Engine.op_set_bytes,
    "set_item": Engine.op_set_item,
    "zero": Engine.op_zero,
    "get_item": Engine.op_get_item,
    "register": Engine.op_register,
    "launch": Engine.op_launch,
    "clear_grads": Engine.op_clear_grads,
    "clear_duals": Engine.op_clear_duals,
    "seed": Engine.op_seed,
    "batch": Engine.op_batch,
    "sweep": Engine.op_sweep,
    "newton": Engine.op_newton,
    "snapshot": Engine.op_snapshot,
    "grad_check": Engine.op_grad_check,
    wire.GRAPH_CREATE: Engine.op_graph_create,
    wire.GRAPH_REPLAY: Engine.op_graph_replay,
    "save": Engine.op_save,
    "load": Engine.op_load,
    "stats": Engine.op_stats,
}
