"""``ti.init(arch=ti.remote)``: the same program, with fields and kernels on a difftape server.

The frontend still runs here: a kernel is parsed and type-checked locally (so compile errors
point at the user's source as usual) and its IR is sent once per specialization. What runs
on the server is only that IR, validated and bounds-checked there.

Launches are asynchronous. Kernel launches and every other op that returns nothing (field
creation, ``fill``, ``x[i] = v``, ``from_numpy`` of a field up to 64 KiB, clearing
gradients, a whole ``ti.ad.Tape``: its recording and back-propagation) are queued and sent as
one ``batch`` request when the program next needs an answer: an element or array read (a
field up to 64 KiB rides in the same request), a kernel with a return value, ``ti.sync()``,
or when the queue is long. One round trip then carries hundreds of small launches, which is
what makes an iterative optimisation through the service cost about what it costs locally.
As with a GPU, an error in a queued launch is raised at that next synchronisation point; the
exception says which op it came from. Library loops over launches and reads
(``ti.ad.jacobian``, ``hessian``, ``hvp``, ``Tape(grad_check=...)``) run on the server as
one op each (:mod:`difftape.client.derivatives`); ``ti.remote_stats()`` counts the round
trips.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any
from weakref import WeakValueDictionary

import numpy as np

from difftape.ad import Tape, _Entry
from difftape.autodiff.lost import Flow, lost_flow
from difftape.errors import ArgumentError, DifftapeError, GraphError, ShapeError
from difftape.frontend import builder as _b
from difftape.frontend.field import Field, _field_ids, _to_python, checked_shape
from difftape.frontend.kernel import (
    LOST_ROLE,
    arg_component,
    compound_return,
    compound_return_type,
    derive,
    has_storage,
    kernel_prints,
    param_arg_map,
    written_arrays,
)
from difftape.frontend.matrix import Matrix, Vector
from difftape.frontend.ndarray import Ndarray, _element_value
from difftape.graph import wire
from difftape.graph.core import Graph
from difftape.ir import serialize
from difftape.ir.serialize import from_jsonable
from difftape.runtime import foreign, program
from difftape.runtime.storage import Storage

from .derivatives import Unrecordable, jacobian, newton, second_order
from .errors import RemoteError, SessionLostError
from .graph import GraphRecording, RemoteGraph

#: Queued ops beyond this many are sent without waiting for a synchronisation point.
MAX_QUEUE = 4096
#: Fields of at most this many bytes move inside batches (base64), not as bodies of their
#: own: a read costs one round trip with whatever is queued, a write none.
INLINE_BYTES = 64 << 10


#: Ops that create or register (run once, whenever the queue goes); everything else a
#: recorded program repeats.
SETUP_OPS = ("create_field", "companion", "register", "seed")
#: Ops that change nothing on the server.
READ_OPS = ("get_item", "get_bytes")
#: Read-ahead (``RemoteRuntime.call``): at most this many fields, each this small (base64).
READ_AHEAD_FIELDS = 8
READ_AHEAD_B64 = 8 << 10
READ_AHEAD_UNUSED = 8
#: Ops a recorded program may hold (the engine's PROGRAM_OPS).
PROGRAM_OPS = ("launch", "fill", "set_item", "set_bytes", "zero", "clear_grads",
               "clear_duals")


class _Recording:
    __slots__ = ("ops", "discard_results", "start")

    def __init__(self, discard_results: bool, start: int) -> None:
        self.ops: list[dict] = []
        self.discard_results = discard_results
        self.start = start  # ops queued before the recording began go first, as they are

    def record(self, op: dict) -> None:
        if op.get("op") not in PROGRAM_OPS:
            raise Unrecordable(f"it runs '{op.get('op')}'")
        self.ops.append(op)

    @staticmethod
    def refuse(what: str) -> None:
        raise Unrecordable(f"it needs {what} while it runs")


class _RemoteKernel:
    """One registered kernel specialization: its id and how to flatten launch arguments."""

    __slots__ = ("kernel", "kid", "data", "spec", "plan", "returns", "return_type", "arrays",
                 "writes", "kinds", "field_ids")

    def __init__(self, kernel, kid: str, data: dict, ir, spec: tuple) -> None:
        self.kernel = kernel
        self.kid = kid
        self.data = data
        self.spec = spec
        # The ndarray arguments the kernel uses (each launch binds their storage), and per
        # variant those it writes (decided from the IR: only those are copied back into a
        # caller's NumPy array).
        self.arrays = sorted({b.key[1] for b in ir.buffers if b.key[0] == "ndarray"})
        self.writes: dict[str, frozenset[int]] = {"primal": written_arrays(ir)} \
            if self.arrays else {}
        arg_map = param_arg_map(ir, [p.name for p in kernel.params])
        self.plan = [(index, path, p.dtype.is_float)
                     for (index, path), p in zip(arg_map, ir.params, strict=True)]
        # How each param is packed into a launch context (CompiledKernel's writer kinds:
        # "f", "i" or an unsigned width), and the fields the kernel addresses: what a
        # captured graph's document needs (client/graph.py).
        self.kinds = ["f" if p.dtype.is_float else "i" if p.dtype.is_signed else p.dtype.bits
                      for p in ir.params]
        self.field_ids = frozenset(b.key[1] for b in ir.buffers if b.key[0] == "field")
        self.returns = bool(ir.returns)
        rt = kernel.return_annotation
        self.return_type = compound_return_type(rt)

    def flatten(self, args: tuple) -> list:
        """Scalar params as the IR has them (vectors component by component), converted as
        the local launch converts them (float params to double, int params truncated)."""
        out = []
        for index, path, is_float in self.plan:
            v = args[index]
            if path is not None:
                v = arg_component(v, path)
            try:
                out.append(float(v) if is_float else int(v))
            except (TypeError, ValueError, OverflowError):
                name = self.kernel.name
                raise ArgumentError(f"kernel '{name}': argument {index + 1} must be a number, "
                                    f"got {type(v).__name__} ({v!r:.40})", kernel=name) from None
        return out

    def written(self, prog, variant: str) -> frozenset[int]:
        """The ndarray arguments the ``variant``'s code stores into (derived here from the
        kernel's IR, as the server derives it)."""
        out = self.writes.get(variant)
        if out is None:
            spec = self.spec
            ir = derive(serialize.decode(self.data), variant,
                        lambda buf, role: has_storage(prog, spec, buf, role))
            out = self.writes[variant] = written_arrays(ir)
        return out

    def convert(self, result: Any) -> Any:
        result = from_jsonable(result)
        rt = self.return_type
        if rt is not None:  # (one value comes back as a number: a struct of one member)
            return compound_return(rt, list(result) if isinstance(result, list | tuple)
                                   else [result])
        return result


class RemoteRuntime:
    """The client half of a remote program (``program.remote``): the op queue, registered
    kernels and the transport to one server session."""

    def __init__(self, prog, transport, session_id: str, *, owns_session: bool) -> None:
        self.prog = prog
        self.transport = transport
        self.session_id = session_id
        self.owns_session = owns_session
        self.field_class = RemoteField
        self.tape_class = RemoteTape
        # NumPy (and PyTorch, JAX...) arrays passed as ndarray arguments travel into scratch
        # ndarrays of the session, one per layout in use, reused launch after launch.
        self._scratch: dict[tuple, list[int]] = {}
        self._queue: list[dict] = []
        self._kernels: dict[tuple, _RemoteKernel] = {}
        self._names: dict[str, str] = {}  # kernel id -> name, for error messages
        # Ids of the kernels that print: their launches wait for the server (see ``launch``).
        self.printing: set[str] = set()
        self.in_job = False  # inside difftape.client.as_job: launches wait for the job
        self._derived: set = set()  # (kernel id, variant, storage epoch) derived here
        self._flows: dict[tuple, Flow] = {}
        self.closed = False
        self.ops_sent = 0
        self._recording: _Recording | GraphRecording | None = None
        # The program's ti.ndarrays by id (a captured graph describes those it addresses).
        self.ndarrays: WeakValueDictionary[int, RemoteNdarray] = WeakValueDictionary()
        # Read-ahead (see ``call``): bumped by every op that may change server state.
        self._gen = 0
        self._hot: dict[tuple, None] = {}  # (field id, role), in order of use
        self._ahead: dict[tuple, list] = {}  # key -> [generation, result, unused reads]

    @staticmethod
    def ndarray_class(cls: type) -> type:
        """The class ``cls(...)`` (a ``ti.ndarray`` class) makes under ``arch=ti.remote``: a
        subclass of it whose storage lives on the server."""
        return remote_ndarray_class(cls)

    def stats(self) -> dict[str, int]:
        """``ti.remote_stats()``: round trips, ops and bytes since this program started."""
        wire = self.transport.stats.as_dict()
        return {"round_trips": wire["round_trips"], "ops": self.ops_sent,
                "bytes_sent": wire["bytes_sent"], "bytes_received": wire["bytes_received"]}

    # ------------------------------------------------------------------ the queue
    # Every op enters the queue, or leaves for the server, through queue, call, read_fields,
    # write or read: each first waits for passes another thread will run on the program
    # (``Program.await_passes``: a JAX call's, which queue ops of their own), so that the
    # server runs the ops in the order the program wrote them.
    def queue(self, op: dict) -> None:
        self.prog.wait_for_passes()
        rec = self._recording
        if rec is not None and op.get("op") not in SETUP_OPS:
            rec.record(op)
            return
        self._gen += 1
        self._queue.append(op)
        if len(self._queue) >= MAX_QUEUE:
            self.flush()

    def flush(self) -> list[dict]:
        """Send every queued op as one batch; raise the first error it hit."""
        if not self._queue:
            return []
        if self._recording is not None:
            # Recording a program (see ``recording``): creation and registration may wait
            # for the request that runs it; anything else here wants an answer now.
            if any(op.get("op") not in SETUP_OPS
                   for op in self._queue[self._recording.start:]):
                self._recording.refuse("a read of device data")
            return []
        ops, self._queue = self._queue, []
        self.ops_sent += len(ops)
        try:
            return self.transport.batch(self.session_id, ops)
        except DifftapeError as e:
            index = getattr(e, "op_index", None)
            if isinstance(index, int) and 0 <= index < len(ops):
                op = ops[index]
                what = op.get("op")
                if what == "launch":
                    name = self._names.get(op.get("kernel_id"), "?")
                    what = f"launch of kernel '{name}' ({op.get('variant', 'primal')})"
                elif what in (wire.GRAPH_CREATE, wire.GRAPH_REPLAY):
                    what = (f"{'upload' if what == wire.GRAPH_CREATE else 'replay'} of "
                            f"captured graph {op.get('graph_id', '?')[:12]}")
                    if getattr(e, "kernel", None):
                        what += f", in its launch of kernel '{e.kernel}'"
                e.add_note(f"raised on the difftape server by queued op {index + 1} of "
                           f"{len(ops)}: {what}; ops after it were not run")
                self._after_error(ops, index)
            raise

    def _after_error(self, ops: list[dict], index: int) -> None:
        """A batch stopped at ``ops[index]``. Launches and writes after it are dropped, as
        an exception stops a local program there; but fields and kernels the program already
        holds must exist on the server, so their creation ops that did not run go first in
        the next batch. A kernel whose registration failed is registered again (and fails
        again, as a local compile error repeats) on its next call."""
        failed = ops[index]
        if failed.get("op") == "register":
            bad = {k for k, rk in self._kernels.items() if rk.data is failed["ir"]}
            for k in bad:
                del self._kernels[k]
        keep = [op for op in ops[index + 1:]
                if op.get("op") in ("create_field", "companion", "register")]
        self._queue[:0] = keep

    def call(self, op: dict) -> dict:
        """Run ``op`` after everything queued and return its result.

        Reads ahead: the small fields the program reads as arrays (``to_numpy``) are read
        again at the end of every request that waits for an answer, and kept until the
        program queues anything that could change them (any op but a read), so that the
        next ``to_numpy`` of one costs no round trip (a loss and a gradient read in turn,
        every iteration). A field read ahead that many times in a row for nothing is no
        longer read ahead."""
        self.prog.wait_for_passes()
        if self._recording is not None:
            self._recording.refuse("a read of device data")
        key = (op["id"], op["role"]) if op.get("op") == "get_bytes" else None
        if key is not None:
            hit = self._ahead.get(key)
            if hit is not None and hit[0] == self._gen:
                hit[2] = 0
                return hit[1]
        elif op.get("op") not in READ_OPS:
            self._gen += 1
        self._queue.append(op)
        extra = [k for k in self._hot if k != key]
        for fid, role in extra:
            self._queue.append({"op": "get_bytes", "id": fid, "role": role})
        results = self.flush()
        gen = self._gen
        for k, res in zip(extra, results[len(results) - len(extra):], strict=True):
            unused = self._ahead[k][2] + 1 if k in self._ahead else 0
            if unused > READ_AHEAD_UNUSED:  # read ahead for nothing, again and again: stop
                self._hot.pop(k, None)
                self._ahead.pop(k, None)
            else:
                self._ahead[k] = [gen, res, unused]
        res = results[len(results) - len(extra) - 1]
        if key is not None:
            self._ahead[key] = [gen, res, 0]
            if len(res.get("b64", "")) <= READ_AHEAD_B64:
                self._hot[key] = None
                while len(self._hot) > READ_AHEAD_FIELDS:
                    self._ahead.pop(next(iter(self._hot)), None)
                    self._hot.pop(next(iter(self._hot)))
        return res

    @contextlib.contextmanager
    def recording(self, *, discard_results: bool = False) -> Iterator[list[dict]]:
        """Capture the ops a block of Python makes (launches, fills, item writes, clears)
        instead of sending them: the list it yields is a *program* the server can repeat
        (the ``sweep`` and ``grad_check`` ops). Fields and kernels the block creates are
        queued as usual. A block that needs an answer from the server while it runs (a
        read, an upload) raises :class:`Unrecordable` and nothing it recorded runs;
        ``discard_results``: kernels that return a value are recorded too (a replay, whose
        results nobody reads), and return None."""
        if self._recording is not None:
            self._recording.refuse("a derivative helper (ti.ad.jacobian, hessian, hvp, "
                                   "newton, Tape(grad_check=...))")
        rec = self._recording = _Recording(discard_results, len(self._queue))
        try:
            yield rec.ops
        finally:
            self._recording = None

    # ------------------------------------------------------------------ graphs
    def begin_graph(self) -> RemoteGraph:
        """``ti.graph.capture()`` begins: record the step's ops into a graph."""
        if self._recording is not None:
            raise GraphError("ti.graph.capture() blocks cannot be nested (nor opened inside a "
                             "derivative helper's function)")
        g = RemoteGraph(self)
        g._capturing = True
        self._recording = GraphRecording(g, len(self._queue))
        return g

    def end_graph(self, graph: RemoteGraph, ok: bool) -> None:
        """The capture block ended (``ok``: without an exception): make the graph's
        document; it goes to the server with the first replay."""
        self._recording = None
        graph._capturing = False
        if ok:
            graph.finish_capture()

    def load_graph(self, doc: dict, mapping: dict, keys: dict) -> RemoteGraph:
        """``ti.graph.load`` under ``arch=ti.remote``: the document, checked and compiled by
        the server over this program's fields ``mapping`` (saved id -> field)."""
        return RemoteGraph.loaded(self, doc, mapping, keys)

    def close(self) -> None:
        """End the session (its fields are dropped, as a local ``ti.reset()`` drops them).

        Launches still queued are sent first, as a local grid program waits for its queued
        launches at ``ti.reset()`` and at exit: a failure among them (a bounds error, a failed
        assert) is raised once the session is released, never dropped. A service that cannot
        be reached any more (or a session already lost) has nothing left to report or release.
        """
        if self.closed:
            return
        failure: DifftapeError | None = None
        if self._recording is None and self._queue:
            try:
                self.flush()
            except (RemoteError, SessionLostError):
                pass  # the service or the session is gone: the queued ops never ran
            except DifftapeError as e:
                failure = e
        self.closed = True
        self._queue.clear()
        try:
            if self.owns_session:
                self.transport.delete_session(self.session_id)
        except DifftapeError:
            pass  # the server may already be gone; nothing is left to clean up here
        finally:
            if self.owns_session:
                self.transport.close()
        if failure is not None:
            raise failure

    # ------------------------------------------------------------------ kernels
    def _kernel(self, kernel, args: tuple, validate: bool = False) -> _RemoteKernel:
        """The registered IR of a kernel specialization; ``validate``: its instrumented
        variant for ``Tape(validation=True)`` (built here, where the frontend runs, and
        registered as a kernel of its own)."""
        if kernel._simple:
            if len(args) != len(kernel.params):
                raise kernel._arg_count_error(args)
            key: tuple = ()
            spec: tuple = ()
        else:
            key, spec = kernel._specialize(args)
        rk = self._kernels.get((kernel, key, validate))
        if rk is None:
            ir = kernel.build_ir(self.prog, spec, "validate" if validate else "primal")
            # debug=True: the server adds the integer overflow reports, as a local compile
            # does; they are printed lines, which come back like the kernel's own.
            ir.overflow_checks = self.prog.config.debug
            ir.fast_math = self.prog.config.fast_math  # the server compiles as told
            data = serialize.encode(ir)
            kid = serialize.fingerprint(ir)
            rk = self._kernels[(kernel, key, validate)] = _RemoteKernel(kernel, kid, data, ir,
                                                                        spec)
            self._names[kid] = kernel.name
            if kernel_prints(ir):
                self.printing.add(kid)
            self.queue({"op": "register", "ir": data})
        return rk

    def launch(self, kernel, args: tuple, variant: str = "primal", validate: bool = False):
        """Queue one launch; wait only when the kernel returns a value."""
        rk = self._kernel(kernel, args, validate)
        if variant != "primal":
            self._check_derivable(rk, variant)
        rec = self._recording
        if isinstance(rec, GraphRecording):
            if validate:
                rec.refuse("ti.ad.Tape(validation=True) (its checks run on the host)")
            return rec.graph.record_launch(rk, args, variant)
        op = {"op": "launch", "kernel_id": rk.kid, "variant": variant,
              "args": rk.flatten(args)}
        back: list = []
        if rk.arrays:
            op["arrays"], back = self._bind_arrays(rk, args, variant)
        rec = self._recording
        if rec is not None:
            if rk.returns and not rec.discard_results:
                raise Unrecordable(f"kernel '{kernel.name}' returns a value")
            if back:
                raise Unrecordable(f"kernel '{kernel.name}' writes a NumPy array argument, "
                                   "which is read back")
            rec.record(op)
            return None
        self._gen += 1
        self._queue.append(op)
        if back:
            return self._copy_back(rk, back)
        if rk.returns:
            return rk.convert(self.flush()[-1]["result"])
        if len(self._queue) >= MAX_QUEUE or (not self.in_job and (
                rk.kid in self.printing or self.prog.config.debug)):
            # A kernel that prints is waited for, its lines written to sys.stdout before
            # the launch returns: they come before what the program prints next, as locally
            # (in a job's block, when the job ends: difftape.client.as_job). Under
            # debug=True every launch is waited for (the server checks bounds in every
            # kernel), so that a failed check or assert raises at its launch, as Taichi checks
            # after every launch in debug mode and as the local runtimes do.
            self.flush()
        return None

    # ------------------------------------------------------------------ ndarray arguments
    def _bind_arrays(self, rk: _RemoteKernel, args: tuple, variant: str
                     ) -> tuple[list[dict], list[tuple[np.ndarray, int]]]:
        """The launch's ``arrays``: a remote ndarray goes by its id; a NumPy array (or the
        NumPy view of a tensor, or a local ``ti.ndarray``) is uploaded, queued before the
        launch, into a scratch ndarray of its layout (bytes inside the batch up to
        ``INLINE_BYTES``, an upload of its own above). Returns the bindings and the arrays
        the ``variant`` writes, which the launch copies back (Taichi's semantics: a kernel
        writes the caller's array)."""
        name = rk.kernel.name
        bound: list[dict] = []
        back: list[tuple[np.ndarray, int]] = []
        staged: dict[int, int] = {}  # id(array) -> scratch id: one array passed twice is one
        for k in rk.arrays:
            a = args[k]
            desc = rk.spec[k]
            if isinstance(getattr(a, "_triplets", None), Ndarray):
                a = a._triplets  # a SparseMatrixBuilder: its triplet storage (a ti.ndarray)
            if isinstance(a, RemoteNdarray):
                if a._program is not self.prog:
                    raise ArgumentError(f"kernel '{name}': argument {k + 1} is a ti.ndarray "
                                        "of an earlier program (made before ti.reset / "
                                        "ti.init); make it again", kernel=name)
                bound.append({"arg": k, "id": a.id, "grad": bool(desc[3])})
                continue
            if desc[3]:
                raise ArgumentError(f"kernel '{name}': argument {k + 1} is a ti.ndarray made "
                                    "outside this remote program, with a .grad that does not "
                                    "live on the server; make it under arch=ti.remote",
                                    kernel=name)
            writes = k in rk.written(self.prog, variant)
            # (a local ndarray: its host values, writable when the kernel writes them back)
            arr = (a.storage.write() if writes else a.storage.read()) \
                if isinstance(a, Ndarray) else a
            if writes and not arr.flags.writeable:
                raise ArgumentError(f"kernel '{name}' writes argument {k + 1}, but it is "
                                    "read-only (a read-only NumPy array, or a JAX array: "
                                    "those are immutable)", kernel=name)
            sid = staged.get(id(arr))
            if sid is None:
                layout = (desc[0].name, arr.shape[:desc[1]], arr.shape[desc[1]:])
                sid = staged[id(arr)] = self._scratch_id(layout, staged.values())
                data = np.ascontiguousarray(arr)
                if data.nbytes <= INLINE_BYTES:
                    self.queue({"op": "set_bytes", "id": sid, "role": "primal",
                                "b64": base64.b64encode(data.tobytes()).decode("ascii")})
                else:
                    self.write(sid, "primal", data)
                if writes:
                    back.append((arr, sid))
            bound.append({"arg": k, "id": sid, "grad": False})
        if back and len(staged) > 1:
            arrays = [args[k] for k in rk.arrays if isinstance(args[k], np.ndarray)]
            for arr, _ in back:
                if any(b is not arr and np.may_share_memory(arr, b) for b in arrays):
                    raise ArgumentError(f"kernel '{name}' writes an array argument that "
                                        "overlaps another array argument; remotely each is "
                                        "sent as a copy, so pass one array (or copies)",
                                        kernel=name)
        return bound, back

    def _scratch_id(self, layout: tuple, taken) -> int:
        """A scratch ndarray of ``layout`` (dtype, shape, element shape) not ``taken`` by
        this launch: reused, or made (queued)."""
        ids = self._scratch.setdefault(layout, [])
        for sid in ids:
            if sid not in taken:
                return sid
        sid = next(_field_ids)
        dtype, shape, esh = layout
        self.queue({"op": "create_field", "ndarray": True, "id": sid,
                    "dtype": dtype, "shape": list(shape),
                    "element_shape": list(esh), "name": "(array argument)"})
        ids.append(sid)
        return sid

    def _copy_back(self, rk: _RemoteKernel, back: list[tuple[np.ndarray, int]]):
        """Send the launch now and copy what it wrote into the callers' arrays: small ones
        ride in the same request, a large one is a download of its own."""
        small = [(arr, sid) for arr, sid in back if arr.nbytes <= INLINE_BYTES]
        for _, sid in small:
            self._queue.append({"op": "get_bytes", "id": sid, "role": "primal"})
        results = self.flush()
        got = results[len(results) - len(small):]
        for (arr, _), res in zip(small, got, strict=True):
            np.copyto(arr, np.frombuffer(base64.b64decode(res["b64"]),
                                         dtype=arr.dtype).reshape(arr.shape))
        for arr, sid in back:
            if arr.nbytes > INLINE_BYTES:
                np.copyto(arr, self.read(sid, "primal", arr.dtype, arr.shape))
        if rk.returns:
            return rk.convert(results[len(results) - len(small) - 1]["result"])
        return None

    def call_kernel(self, kernel, args: tuple):
        """``kernel(*args)`` under ``arch=ti.remote`` (the hook in ``Kernel.__call__``)."""
        prog = self.prog
        fwd = getattr(prog, "fwd", None) is not None
        if kernel.no_grad or getattr(prog, "no_tangents", 0):
            # As locally: under forward mode what it writes gets zero tangents.
            return self.launch(kernel, args, "fwd_const" if fwd else "primal")
        tape = prog.tape
        if tape is not None:
            tape.record(kernel, args)
            if tape.validation and not tape._suspended:
                if fwd:
                    from difftape.autodiff.validation import NOT_WITH_FORWARD_MODE

                    raise DifftapeError(NOT_WITH_FORWARD_MODE)
                return self.launch(kernel, args, validate=True)
        if fwd:  # refuse reading tangents lost by storage without .dual (as locally)
            prog.fwd.lost.launch(kernel.name, self._lost_flow(self._kernel(kernel, args), "fwd"),
                                 args)
        return self.launch(kernel, args, "fwd" if fwd else "primal")

    def _lost_flow(self, rk: _RemoteKernel, variant: str) -> Flow:
        """What the variant's launches may lose (autodiff/lost.py), from the IR here, where
        the client knows which companions exist, as the local runtime computes it."""
        key = (rk.kid, variant, getattr(self.prog, "storage_epoch", 0))
        flow = self._flows.get(key)
        if flow is None:
            prog, role, spec = self.prog, LOST_ROLE[variant], rk.spec
            flow = self._flows[key] = lost_flow(serialize.decode(rk.data),
                                                lambda buf: has_storage(prog, spec, buf, role))
        return flow

    def _check_derivable(self, rk: _RemoteKernel, variant: str) -> None:
        """Derive a derivative ``variant`` here once per specialization (and storage epoch),
        so that a kernel whose derivative cannot be computed is refused by the call that asks
        for it (``kernel.grad()``, a launch under FwdMode, a Tape's recording), as locally,
        not by whatever later call flushes the queue to the server."""
        key = (rk.kid, variant, getattr(self.prog, "storage_epoch", 0))
        if key not in self._derived:
            prog, spec = self.prog, rk.spec
            derive(serialize.decode(rk.data), variant,
                   lambda buf, role: has_storage(prog, spec, buf, role))
            self._derived.add(key)

    def check_grad(self, kernel, args: tuple) -> Flow:
        """Refuse, when it is recorded (as locally), not at Tape exit, a kernel whose
        gradient cannot be computed. Returns what its gradient may lose through fields
        without ``.grad``."""
        rk = self._kernel(kernel, args)
        # Under forward mode (a Tape inside FwdMode) the adjoint runs with tangents.
        variant = "grad_fwd" if getattr(self.prog, "fwd", None) is not None else "grad"
        self._check_derivable(rk, variant)
        return self._lost_flow(rk, variant)

    # ------------------------------------------------------------------ derivative loops
    def jacobian(self, fn, ins: list, outs: list, mode: str) -> np.ndarray | None:
        """``ti.ad.jacobian`` in one request; None if ``fn`` cannot be recorded."""
        return jacobian(self, fn, ins, outs, mode)

    def second_order(self, fn, loss, ps: list, vectors: list | None) -> np.ndarray | None:
        """``ti.ad.hvp`` (one vector) or ``hessian`` (``vectors`` None) in one request."""
        return second_order(self, fn, loss, ps, vectors)

    def newton(self, fn, loss, ps: list, tol: float, max_iter: int):
        """``ti.ad.newton`` in one request; None if ``fn`` cannot be recorded."""
        return newton(self, fn, loss, ps, tol, max_iter)

    def clear_grads(self) -> None:
        self.queue({"op": "clear_grads"})

    def clear_duals(self) -> None:
        self.queue({"op": "clear_duals"})

    # ------------------------------------------------------------------ arrays
    def write(self, fid: int, role: str, arr: np.ndarray) -> None:
        self.prog.wait_for_passes()
        if self._recording is not None:
            self._recording.refuse("an upload of an array")
        self._gen += 1
        self.flush()  # earlier launches first: the write must not overtake them
        self.transport.write(self.session_id, fid, role, arr)

    def read(self, fid: int, role: str, dtype: np.dtype, shape: tuple) -> np.ndarray:
        self.prog.wait_for_passes()
        if self._recording is not None:
            self._recording.refuse("a read of an array")
        self.flush()
        return self.transport.read(self.session_id, fid, role, dtype, shape)

    def read_fields(self, fields: list[RemoteField | RemoteNdarray]) -> list[np.ndarray]:
        """The values of several fields or ndarrays (any role: ``x``, ``x.grad``, ``x.dual``),
        each of shape ``shape + element_shape``, after everything queued: the small ones (up to
        ``INLINE_BYTES``) in one request with the queued ops, a larger one as a download of
        its own. The operators of ``difftape.interop`` read all their outputs (or all their
        inputs' gradients) this way, so a call costs one round trip, not one per field."""
        self.prog.wait_for_passes()
        if self._recording is not None:
            self._recording.refuse("a read of arrays")
        small = [f for f in fields if _inline(f.dtype.np, f.shape + f.element_shape)]
        self._queue.extend({"op": "get_bytes", "id": f.id, "role": f.role} for f in small)
        results = self.flush()
        got = dict(zip((id(f) for f in small), results[len(results) - len(small):],
                       strict=True)) if small else {}
        out = []
        for f in fields:
            full = f.shape + f.element_shape
            res = got.get(id(f))
            if res is None:
                out.append(self.read(f.id, f.role, f.dtype.np, full))
            else:
                out.append(np.frombuffer(base64.b64decode(res["b64"]),
                                         dtype=f.dtype.np).reshape(full).copy())
        return out


# ---------------------------------------------------------------------------- fields

def _jsonable(value: np.ndarray) -> Any:
    """A converted element value as JSON-able Python numbers (non-finite as strings)."""
    out = value.tolist()
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        return _nonfinite(out)
    return out


def _nonfinite(v: Any) -> Any:
    if isinstance(v, list):
        return [_nonfinite(x) for x in v]
    if v != v:
        return "NaN"
    return v if abs(v) != float("inf") else ("Infinity" if v > 0 else "-Infinity")


def _read_storage(rt: RemoteRuntime, fid: int, role: str, dtype: np.dtype,
                  full: tuple) -> np.ndarray:
    """A field's or ndarray's values after everything queued. Up to ``INLINE_BYTES`` the
    bytes ride along with the queued ops (base64 in the batch's answer): one round trip, not
    a flush and then a download (a parameter and its gradient, read every iteration of an
    optimisation loop); larger storage is a download of its own."""
    if _inline(dtype, full):
        res = rt.call({"op": "get_bytes", "id": fid, "role": role})
        return np.frombuffer(base64.b64decode(res["b64"]), dtype=dtype).reshape(full).copy()
    return rt.read(fid, role, dtype, full)


def _write_storage(rt: RemoteRuntime, fid: int, role: str, data: np.ndarray) -> None:
    """Replace a field's or ndarray's values with ``data`` (its dtype and full shape): queued
    with the launches up to ``INLINE_BYTES`` (no round trip at all, every bit kept), an
    upload of its own above."""
    if data.nbytes <= INLINE_BYTES:
        rt.queue({"op": "set_bytes", "id": fid, "role": role,
                  "b64": base64.b64encode(data.tobytes()).decode("ascii")})
    else:
        rt.write(fid, role, data)


def _copied_input(target, arr) -> bool:
    """``target.from_numpy(arr)`` while a graph is captured, ``arr`` one of its NumPy
    inputs: recorded as a copy from the input (client/graph.py), True."""
    rec = target._remote._recording
    return isinstance(rec, GraphRecording) and isinstance(arr, np.ndarray) and \
        rec.graph.record_input_copy(target, arr)


def _converted(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``arr`` in ``dtype``, C order, converted exactly as a local ``from_numpy`` converts
    (``np.copyto``, unsafe casting); ``arr`` itself when nothing needs converting (the
    transport reads it once, without a copy)."""
    if arr.dtype == dtype and arr.flags.c_contiguous:
        return arr
    data = np.empty(arr.shape, dtype=dtype)
    np.copyto(data, arr, casting="unsafe")
    return data


def _inline(dtype: np.dtype, full: tuple) -> bool:
    return int(np.prod(full, dtype=np.int64)) * np.dtype(dtype).itemsize <= INLINE_BYTES


class RemoteField(Field):
    """A field whose storage lives on the server (the class ``ti.field`` makes under
    ``arch=ti.remote``). Inside kernels it is the same as a local field; in Python scope,
    element and array access become engine ops."""

    @property
    def _remote(self) -> RemoteRuntime:
        return self._program.remote

    def _allocate(self, shape) -> None:
        self._shape = shape = checked_shape(shape)
        if self.role == "primal":
            op = {"op": "create_field", "id": self.id, "dtype": self.dtype.name,
                  "shape": list(shape), "element_shape": list(self.element_shape),
                  "name": self.name}
            if self._offset:  # reported by the server's bounds checks, checked against IR
                op["offset"] = list(self._offset)
            levels = self.activity_levels
            if levels:  # under sparse SNodes: which fields hold its activity, and how
                op["sparse"] = [{"activity": act.id, "map": [list(m) for m in imap],
                                 "dynamic": dynamic} for act, imap, dynamic in levels]
            self._remote.queue(op)
            self._program.fields[self.id] = self
            if self in self._program.unplaced:
                self._program.unplaced.remove(self)
        else:
            self._remote.queue({"op": "companion", "id": self.id, "role": self.role})

    @property
    def storage(self):
        raise DifftapeError(f"{self._label()} lives on the difftape server (arch=ti.remote) "
                            "and has no local storage; use to_numpy() / from_numpy()")

    def _device_storage(self) -> None:
        return None  # on the server: to_torch/to_jax/from_* go through to_numpy/from_numpy

    def _index(self, key) -> list[int]:
        """A Python-scope index, checked here exactly as the local field checks it."""
        return list(self._host_index(key))

    def __getitem__(self, key):
        if _b.current() is not None:
            return super().__getitem__(key)
        index = self._index(self._norm_key(key))
        value = from_jsonable(self._remote.call({"op": "get_item", "id": self.id,
                                              "role": self.role, "index": index})["value"])
        if not self.element_shape:
            return value
        out = _to_python(np.asarray(value, dtype=self.dtype.np), self.element_shape)
        out.__class__ = _element_class(len(self.element_shape))
        out._remote_target = (self, index)
        return out

    def __setitem__(self, key, value) -> None:
        if _b.current() is not None:
            super().__setitem__(key, value)
            return
        index = self._index(self._norm_key(key))
        self._set(index, value)

    def _set(self, index: list[int], value) -> None:
        if isinstance(value, Matrix):
            value = value.entries
        conv = np.asarray(self._host_element(value), dtype=self.dtype.np)
        if not self.element_shape and conv.shape != ():
            raise ValueError(f"cannot assign an array of shape {conv.shape} to an element of "
                             f"the scalar field {self._label()}")
        self._remote.queue({"op": "set_item", "id": self.id, "role": self.role,
                            "index": index, "value": _jsonable(conv)})

    def _inline(self) -> bool:
        return _inline(self.dtype.np, self.shape + self.element_shape)

    @_b.python_scope
    def to_numpy(self, dtype=None, keep_dims: bool = False) -> np.ndarray:
        out = _read_storage(self._remote, self.id, self.role, self.dtype.np,
                            self.shape + self.element_shape)
        out = self._numpy_dims(out, keep_dims)
        return out.astype(dtype) if dtype is not None else out

    @_b.python_scope
    def from_numpy(self, arr) -> None:
        if _copied_input(self, arr):
            return
        _write_storage(self._remote, self.id, self.role,
                       _converted(self._numpy_in(arr), self.dtype.np))

    def fill(self, value) -> None:
        if _b.current() is not None:  # in a kernel: a loop in the kernel's IR
            super().fill(value)
            return
        # (a matrix value by its shape, as the ndarray's fill takes it: .entries is flat)
        conv = np.asarray(_element_value(value, self.element_shape), dtype=self.dtype.np)
        self._remote.queue({"op": "fill", "id": self.id, "role": self.role,
                            "value": _jsonable(conv)})

    @_b.python_scope
    def copy_from(self, other: Field) -> None:
        self._check_copy_source(other)
        if self.activity_levels:
            rec = self._remote._recording
            if isinstance(rec, GraphRecording):  # refused as a local capture refuses it
                Graph._dense(self, f"{self._label()}.copy_from()")
            # As locally: every cell along the index range is activated, then the whole
            # array copied (a write of the active cells, which are now all of them).
            self._np_activate_all()
        self.from_numpy(other.to_numpy())

    def _np_activate_all(self) -> None:
        """The activity fields filled (the engine's ``fill``: they are dense storage)."""
        for act, imap, dynamic in self.activity_levels:
            self._remote.queue({"op": "fill", "id": act.id, "role": "primal",
                                "value": self.shape[imap[-1][0]] if dynamic else 1})

    def _zero(self) -> None:
        self._remote.queue({"op": "zero", "id": self.id, "role": self.role})


_ELEMENTS: dict[int, type] = {}


def _element_class(ndim: int) -> type:
    """Vector/Matrix subclasses whose entry writes (``x[i][0] = 1``) write the server's
    element too, as the local field element views do."""
    if not _ELEMENTS:
        def _assign_entry(self, k: int, value) -> None:
            self.entries[k] = value
            field, index = self._remote_target
            field._set(index, np.asarray(self.entries).reshape(field.element_shape))

        _ELEMENTS[1] = type("RemoteVectorElement", (Vector,), {"_assign_entry": _assign_entry})
        _ELEMENTS[2] = type("RemoteMatrixElement", (Matrix,), {"_assign_entry": _assign_entry})
    return _ELEMENTS[ndim]


# ---------------------------------------------------------------------------- ndarrays

class RemoteNdarray(Ndarray):
    """A ``ti.ndarray`` whose storage lives on the server (what ``ti.ndarray``,
    ``ti.Vector.ndarray``... make under ``arch=ti.remote``; each class gets a subclass of
    itself and of this one, so ``isinstance`` holds). A kernel launch passes its id; in
    Python scope, element and array access are the engine ops fields use, batched and read
    ahead alike. Its ``.grad`` (``needs_grad=True``) is a RemoteNdarray of role ``grad``."""

    _remote_doc = ("lives on the difftape server (arch=ti.remote) and has no local array; "
                   "use to_numpy() / from_numpy()")

    def _allocate(self, storage: Storage | None, needs_grad: bool) -> None:
        self._program = program.get()
        self.id = next(_field_ids)
        self.role = "primal"
        self._remote.ndarrays[self.id] = self
        self._remote.queue({"op": "create_field", "ndarray": True, "id": self.id,
                            "dtype": self.dtype.name, "shape": list(self.shape),
                            "element_shape": list(self.element_shape),
                            "needs_grad": bool(needs_grad)})
        if needs_grad:
            g = self.grad = object.__new__(type(self))
            g.dtype, g.shape, g.element_shape = self.dtype, self.shape, self.element_shape
            g.grad, g._program, g.id, g.role = None, self._program, self.id, "grad"

    @classmethod
    def _like(cls, other: Ndarray) -> Ndarray:
        """A new remote ndarray of the same class, dtype and shapes (no gradient)."""
        out = object.__new__(cls)
        Ndarray.__init__(out, other.dtype, other.shape, other.element_shape)
        return out

    @property
    def _remote(self) -> RemoteRuntime:
        prog = self._program
        if prog is not program.get() or prog.remote is None or prog.remote.closed:
            raise DifftapeError(f"{self._label()} belongs to an earlier program (made before "
                                "ti.reset / ti.init): its storage went with that session")
        return prog.remote

    def _label(self) -> str:
        return f"ndarray#{self.id}" + (".grad" if self.role == "grad" else "")

    @property
    def storage(self) -> Storage:
        raise DifftapeError(f"{self._label()} {self._remote_doc}")

    def _device_storage(self) -> None:
        return None  # on the server: to_torch/to_jax/from_* go through to_numpy/from_numpy

    def _dlpack_array(self) -> np.ndarray:
        raise DifftapeError(f"{self._label()} {self._remote_doc}: DLPack shares memory, and "
                            "this memory is on the server (to_torch() / to_numpy() copy)")

    def _index(self, key) -> list[int]:
        """A Python-scope index, checked as the local ndarray checks it (negative indices
        count from the end, as there)."""
        return [k + n if k < 0 else k for k, n in zip(self._norm_key(key), self.shape,
                                                         strict=True)]

    @_b.python_scope
    def __getitem__(self, key):
        index = self._index(key)
        value = from_jsonable(self._remote.call({"op": "get_item", "id": self.id,
                                                 "role": self.role, "index": index})["value"])
        if not self.element_shape:
            return value
        out = _to_python(np.asarray(value, dtype=self.dtype.np), self.element_shape)
        out.__class__ = _element_class(len(self.element_shape))
        out._remote_target = (self, index)  # nd[i][j] = v writes the server's element
        return out

    @_b.python_scope
    def __setitem__(self, key, value) -> None:
        self._set(self._index(key), _element_value(value, self.element_shape))

    def _set(self, index: list[int], value) -> None:
        conv = np.asarray(value, dtype=self.dtype.np)  # converted as the local assignment
        if self.element_shape:
            conv = np.broadcast_to(conv, self.element_shape)
        self._remote.queue({"op": "set_item", "id": self.id, "role": self.role,
                            "index": index, "value": _jsonable(conv)})

    @_b.python_scope
    def to_numpy(self) -> np.ndarray:
        return _read_storage(self._remote, self.id, self.role, self.dtype.np,
                             self.shape + self.element_shape)

    @_b.python_scope
    def from_numpy(self, arr) -> None:
        if _copied_input(self, arr):
            return
        arr = foreign.array_in(arr)
        full = self.shape + self.element_shape
        if arr.shape != full:
            raise ShapeError(f"from_numpy: the ndarray has shape {full} (shape {self.shape}, "
                             f"element {self.element_shape}), the array has {arr.shape}")
        _write_storage(self._remote, self.id, self.role, _converted(arr, self.dtype.np))

    @_b.python_scope
    def fill(self, value) -> None:
        conv = np.asarray(_element_value(value, self.element_shape), dtype=self.dtype.np)
        self._remote.queue({"op": "fill", "id": self.id, "role": self.role,
                            "value": _jsonable(conv)})

    @_b.python_scope
    def copy_from(self, other: Ndarray) -> None:
        if not isinstance(other, Ndarray):
            raise TypeError(f"copy_from takes an ndarray, got {type(other).__name__}")
        full = self.shape + self.element_shape
        if other.shape + other.element_shape != full:
            raise ShapeError(f"copy_from: shapes differ: {full} vs "
                             f"{other.shape + other.element_shape}")
        self.from_numpy(other.to_numpy())


_REMOTE_NDARRAYS: dict[type, type] = {}


def remote_ndarray_class(cls: type) -> type:
    """``cls`` (Ndarray or a subclass) with its storage on the server."""
    if issubclass(cls, RemoteNdarray):
        return cls
    out = _REMOTE_NDARRAYS.get(cls)
    if out is None:
        out = RemoteNdarray if cls is Ndarray else type(
            f"Remote{cls.__name__}", (cls, RemoteNdarray),
            {"__module__": __name__, "__doc__": f"{cls.__name__} under arch=ti.remote."})
        _REMOTE_NDARRAYS[cls] = out
    return out


# ---------------------------------------------------------------------------- the Tape

_SNAPSHOT_KEYS = itertools.count(1)


class RemoteTape(Tape):
    """``ti.ad.Tape`` under ``arch=ti.remote``: records as locally and back-propagates by
    queueing the adjoint launches; the whole recording goes with the program's next read."""

    def record(self, kernel, args: tuple) -> None:
        if self._suspended:
            return
        from difftape.runtime import program

        flow = program.get().remote.check_grad(kernel, args)
        self.lost.launch(kernel.name, flow, args)
        self.entries.append(_Entry(kernel, kernel.grad, args, {}, kernel.name))

    def _take_snapshot(self) -> None:
        """``grad_check``: the server keeps the values the recording starts from."""
        from difftape.runtime import program

        self._snapshot_key = next(_SNAPSHOT_KEYS)
        program.get().remote.queue({"op": "snapshot", "key": self._snapshot_key})

    def _check_gradients(self) -> None:
        """The finite-difference check as one server op: the recorded launches replayed
        there from the snapshot (``grad_check``), judged as the local Tape judges."""
        from difftape.ad import GradientCheckError, prog_tape_off
        from difftape.runtime import program

        rt = program.get().remote
        for field in self.grad_check:
            if not field.has_grad:
                raise DifftapeError(f"grad_check: '{field._label()}' has no gradient storage")
        try:
            with prog_tape_off(), rt.recording(discard_results=True) as ops:
                for entry in self.entries:
                    entry.forward(*entry.args, **entry.kwargs)
        except Unrecordable as e:
            names = ", ".join(sorted({en.name for en in self.entries}))
            raise DifftapeError(f"Tape(grad_check=...) under arch=ti.remote replays the "
                                f"recorded program ({names}) on the server, but it cannot "
                                f"be replayed there: {e}. Check the gradient locally "
                                "(arch=ti.cpu) instead") from None
        bad = rt.call({"op": "grad_check", "snapshot": self._snapshot_key,
                       "loss": self.loss.id, "fields": [f.id for f in self.grad_check],
                       "labels": [f._label()[:200] for f in self.grad_check],
                       "program": ops})["bad"]
        if bad:
            raise GradientCheckError("gradients disagree with central finite differences:\n  "
                                     + "\n  ".join(bad[:20]))

    def __exit__(self, exc_type, exc, tb) -> bool:
        from difftape.runtime import program

        super().__exit__(exc_type, exc, tb)
        if exc_type is None and self.validation:
            # Its errors (a rule broken by the recorded kernels) belong to the Tape, as
            # locally. Otherwise no flush: the recording and its back-propagation go with
            # the next request that needs an answer (usually the read of the loss or of a
            # gradient).
            program.get().remote.flush()
        return False


# ---------------------------------------------------------------------------- attaching

def attach(prog, *, server: str | None = None, token: str | None = None, session=None,
           transport=None, timeout: float = 300.0) -> RemoteRuntime:
    """Make ``prog`` a remote program: open (or join) a server session and install the
    runtime as ``prog.remote``. Called by ``ti.init(arch=ti.remote, ...)``."""
    from .transport import HttpTransport, default_server, default_token

    if session is not None:
        rt = RemoteRuntime(prog, session.transport, session.session_id, owns_session=False)
    else:
        if transport is None:
            transport = HttpTransport(server or default_server(),
                                      token if token is not None else default_token(),
                                      timeout=timeout)
        try:
            sid = transport.create_session()
        except BaseException:
            transport.close()
            raise
        rt = RemoteRuntime(prog, transport, sid, owns_session=True)
        # A script that ends without ti.reset() must not leave its session to idle until the
        # server culls it (and saves its fields to disk for nobody).
        atexit.register(_close_at_exit, weakref.ref(rt))
    prog.remote = rt
    if prog.config.random_seed:  # ti.random on the server starts where it would locally
        rt.queue({"op": "seed", "value": int(prog.config.random_seed)})
    return rt


def _close_at_exit(ref: weakref.ref) -> None:
    """The process ends: the session is closed, and a failure of a launch still queued is
    reported (Python prints an exception raised here, as for a local grid program's queued
    launches) rather than lost."""
    rt = ref()
    if rt is not None and not rt.closed:
        rt.close()


__all__ = ["RemoteField", "RemoteNdarray", "RemoteRuntime", "RemoteTape", "attach"]
