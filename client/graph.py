"""``ti.graph.capture()`` and ``ti.graph.load()`` under ``arch=ti.remote``: a step recorded
here, sent to the server once, replayed there natively, one request per replay.

While a graph is captured the remote runtime records the engine ops the step makes (the
same ops an eager step queues: launches of every variant, so those of a ``ti.ad.Tape``,
``FwdMode`` and ``kernel.grad()`` too, fills, element and byte writes, clearing gradients
and tangents) instead of queueing them; creating fields and registering kernels go on as
usual. When the capture ends they become the saved-graph document (:mod:`difftape.graph.saved`:
the kernels as the frontend IR the server already receives, launch records with their
scalar parameters packed, fills and copies over storage named by id, the named inputs and
where they bind). The first replay sends the document (``graph_create``) and every replay
is one ``graph_replay`` op with the inputs (:mod:`difftape.graph.wire`), sent with whatever
else is queued, in one request: the server builds the native graph from the document with
the code that loads a saved graph (validated as any IR a client sends, bounds checks on)
and runs it as a local replay runs (``dt_run_graph``).

What a local capture refuses is refused here with the same error and line (host reads, a
kernel's return value, element writes into a field input...); in addition a NumPy array
passed to a kernel must be a graph input (its bytes travel with each replay and, when the
graph writes it, come back into it): local memory that the graph would address directly
does not exist on the server.
"""

from __future__ import annotations

import base64
import json
import numbers
from typing import TYPE_CHECKING, Any

import numpy as np

from difftape import types as T
from difftape._version import __version__
from difftape.errors import GraphCaptureError, GraphError
from difftape.frontend.field import Field
from difftape.frontend.ndarray import Ndarray
from difftape.graph import saved, wire
from difftape.graph.core import (
    Graph,
    Placeholder,
    _Input,
    _matrix_entries,
    _write_scalar,
    scalar_component,
    user_line,
)
from difftape.ir.serialize import from_jsonable
from difftape.runtime import program

if TYPE_CHECKING:
    from .runtime import RemoteRuntime, _RemoteKernel



class GraphRecording:
    """The runtime's recording while a graph is captured: ops go to the graph, and what a
    replay could not repeat is refused with a :class:`GraphCaptureError` naming the line."""

    __slots__ = ("graph", "start", "ops")

    def __init__(self, graph: RemoteGraph, start: int) -> None:
        self.graph = graph
        self.start = start
        self.ops: list[dict] = []

    def record(self, op: dict) -> None:
        self.graph.record_op(op)

    @staticmethod
    def refuse(what: str) -> None:
        raise GraphCaptureError(
            f"{what} inside ti.graph.capture() (at {user_line()}): a graph replays without "
            "Python, so a value read on the host now would be frozen into every replay. Do "
            "the computation (and any branch on it) in a kernel, or read after g.replay()")


class RemoteGraph(Graph):
    """A graph whose replays run on the server of an ``arch=ti.remote`` program."""

    def __init__(self, rt: RemoteRuntime) -> None:
        super().__init__()
        self.rt = rt
        self._program = rt.prog
        self._kernels: list[dict] = []
        self._kindex: dict[tuple, int] = {}
        self._doc_ops: list[dict] = []
        self._field_ids: set[int] = set()
        self._nd: dict[int, dict] = {}  # ndarray id -> its description in the document
        self._arrays: dict[int, str] = {}  # id(NumPy array input) -> the input's name
        self._homes: dict[str, tuple[int, tuple]] = {}  # NumPy input -> (ndarray id, layout)
        self._doc: dict | None = None
        self._field_map: dict[str, int] | None = None
        self.graph_id: str | None = None
        self._uploaded = False

    # ------------------------------------------------------------------ inputs
    def input(self, name: str, value):
        """As :meth:`Graph.input`: fields and ``ti.ndarray``s of this program, NumPy arrays
        (whose bytes travel with each replay), scalars, vectors/matrices and types."""
        self._declare(name)
        if isinstance(value, Field):
            if value.role != "primal":
                raise GraphError(f"graph input '{name}': a field, not its .{value.role}")
            self._dense_input(name, value)
            self._add_input(_Input(name, "field", example=value, dtype=value.dtype,
                                   element_shape=value.element_shape, shape=value.shape), value)
            self._field_ids.add(value.id)
            return value
        if isinstance(value, Ndarray):
            if value.role != "primal":
                raise GraphError(f"graph input '{name}': an ndarray, not its .{value.role}")
            self._add_input(_Input(name, "array", example=value, dtype=value.dtype,
                                   element_shape=value.element_shape, shape=value.shape), value)
            self._describe(value)
            return value
        if isinstance(value, np.ndarray):
            try:
                dtype = T.from_numpy(value.dtype)
            except TypeError:
                raise GraphError(f"graph input '{name}': a numeric array expected, got dtype "
                                 f"{value.dtype}") from None
            self._add_input(_Input(name, "array", example=value, dtype=dtype,
                                   shape=value.shape), value)
            self._arrays[id(value)] = name
            return value
        return super().input(name, value)

    def _describe(self, nd: Ndarray) -> None:
        if nd._program is not self._program:
            raise GraphCaptureError(f"{nd._label()} belongs to an earlier program (at "
                                    f"{user_line()})")
        self._nd[nd.id] = {"dtype": nd.dtype.name, "shape": list(nd.shape),
                           "element_shape": list(nd.element_shape),
                           "grad": nd.grad is not None}

    # ------------------------------------------------------------------ recording
    def record_launch(self, rk: _RemoteKernel, args: tuple, variant: str) -> None:
        """A launch made while the graph is captured (``RemoteRuntime.launch``)."""
        name = rk.kernel.name
        if rk.returns:
            raise GraphCaptureError(
                f"kernel '{name}' returns a value, which Python would read on the host while "
                f"the graph is captured (at {user_line()}): a replay runs without Python; "
                "write the result into a field instead")
        subst, holders = list(args), {}
        for k, a in enumerate(args):
            if isinstance(a, Placeholder):
                if a.graph is not self:
                    raise GraphCaptureError(f"graph input '{a.name}' belongs to another graph "
                                            f"(at {user_line()})")
                holders[k] = a
                subst[k] = a.example()
        flat = rk.flatten(tuple(subst))
        params = np.zeros(max(1, len(flat)), dtype=np.int64)
        here = len(self._doc_ops)
        for p, ((index, path, _), kind, v) in enumerate(zip(rk.plan, rk.kinds, flat,
                                                            strict=True)):
            _write_scalar(params, p, kind, v, name)
            ph = holders.get(index)
            if ph is not None:
                self._bind_scalar(ph, here, p, kind, path, name)
        arrays = self._bind_arrays(rk, args)
        grads = tuple(a["arg"] for a in arrays if a["grad"])
        key = (rk.kid, variant, grads)
        k = self._kindex.get(key)
        if k is None:
            k = self._kindex[key] = len(self._kernels)
            entry = {"ir": rk.data, "variant": variant, "deterministic": False,
                     "fast_math": rk.data.get("fast_math", True)}
            if grads:
                entry["array_grads"] = list(grads)
            self._kernels.append(entry)
        op = {"op": "launch", "kernel": k, "params": params[:len(flat)].tolist()}
        if arrays:
            op["arrays"] = arrays
        self._doc_ops.append(op)
        self._field_ids.update(rk.field_ids)
        self.launches += 1

    def _bind_scalar(self, ph: Placeholder, op: int, p: int, kind, path, kernel: str) -> None:
        inp = self._inputs[ph.name]
        inp.slots.append([op, p, kind, scalar_component(ph.name, inp.kind, path, kernel)])

    def _bind_arrays(self, rk: _RemoteKernel, args: tuple) -> list[dict]:
        out = []
        for k in rk.arrays:
            a, desc = args[k], rk.spec[k]
            if isinstance(a, Ndarray) and self.rt.ndarrays.get(getattr(a, "id", None)) is a:
                self._describe(a)
                nid = a.id
            elif isinstance(a, np.ndarray) and id(a) in self._arrays:
                nid = self._home(self._arrays[id(a)], a, desc)
            else:
                raise GraphCaptureError(
                    f"kernel '{rk.kernel.name}': argument {k + 1} is an array that is not a "
                    f"graph input (at {user_line()}): under arch=ti.remote the graph runs on "
                    "the server, where this memory is not; declare it with g.input(name, "
                    "array) (its bytes then travel with each replay) or pass a ti.ndarray")
            out.append({"arg": k, "id": nid, "grad": bool(desc[3])})
        return out

    def _home(self, name: str, arr: np.ndarray, desc: tuple) -> int:
        """The ndarray of the session that holds NumPy array input ``name`` (made the first
        time a launch binds it, with that argument's layout)."""
        layout = (desc[0].name, tuple(arr.shape[:desc[1]]), tuple(arr.shape[desc[1]:]))
        home = self._homes.get(name)
        if home is not None:
            if home[1] != layout:
                raise GraphCaptureError(f"graph input '{name}' is passed to kernels as arrays "
                                        f"of two layouts (at {user_line()})")
            return home[0]
        from difftape.frontend.field import _field_ids

        nid = next(_field_ids)
        self.rt.queue({"op": "create_field", "ndarray": True, "id": nid, "dtype": layout[0],
                       "shape": list(layout[1]), "element_shape": list(layout[2]),
                       "name": f"(graph input {name})"})
        self._homes[name] = (nid, layout)
        self._nd[nid] = {"dtype": layout[0], "shape": list(layout[1]),
                         "element_shape": list(layout[2]), "grad": False}
        inp = self._inputs[name]
        inp.element_shape = layout[2]
        return nid

    def record_input_copy(self, target: Field | Ndarray, arr) -> bool:
        """``target.from_numpy(arr)`` while the graph is captured: when ``arr`` is a NumPy
        graph input, a copy on the server from the ndarray holding its bytes (sent with each
        replay), as a local replay copies from the array bound at that replay; True then.
        (Any other array is a constant: its bytes now, recorded as the engine op.)"""
        what = f"{target._label() if isinstance(target, Field) else 'ndarray'}.from_numpy()"
        self._dense(target, what)  # refused as a local capture refuses it
        name = self._arrays.get(id(arr))
        if name is None:
            return False
        key, dtype, shape, esh, _ = self._target({"id": target.id, "role": target.role})
        if arr.dtype != dtype or arr.shape != shape + esh:
            raise GraphCaptureError(f"{what}: graph input '{name}' has dtype {arr.dtype} and "
                                    f"shape {arr.shape}, the target {np.dtype(dtype)} and "
                                    f"{shape + esh}; give the input the target's dtype and "
                                    f"shape (at {user_line()})")
        nid = self._homes[name][0] if name in self._homes else \
            self._home(name, arr, (T.from_numpy(arr.dtype), arr.ndim))
        self._doc_ops.append({"op": "copy", **key, "offset": 0, "begin": 0,
                              "end": _nbytes(dtype, shape + esh),
                              "source": {"ndarray": nid, "role": "primal", "offset": 0}})
        return True

    def _target(self, op: dict) -> tuple[dict, np.dtype, tuple, tuple, str | None]:
        """The storage an engine op names: its key in the document, dtype, shape, element
        shape and the name of the input it is (if one)."""
        sid, role = op.get("id"), op.get("role", "primal")
        f = self._program.fields.get(sid)
        if f is not None:
            c = f.companion(role)
            self._field_ids.add(sid)
            name = next((i.name for i in self._inputs.values()
                         if i.kind == "field" and i.example is f), None)
            return ({"field": sid, "role": role}, c.dtype.np, tuple(f.shape),
                    tuple(f.element_shape), name)
        nd = self.rt.ndarrays.get(sid)
        if nd is None:
            raise GraphCaptureError(f"storage {sid} is not a field or ndarray of this program "
                                    f"(at {user_line()})")
        self._describe(nd)
        name = next((i.name for i in self._inputs.values()
                     if i.kind == "array" and i.example is nd), None)
        return ({"ndarray": sid, "role": role}, nd.dtype.np, tuple(nd.shape),
                tuple(nd.element_shape), name)

    def record_op(self, op: dict) -> None:
        """An engine op (other than a launch) made while the graph is captured."""
        kind = op.get("op")
        if kind in ("clear_grads", "clear_duals"):  # as the engine runs them, field by field
            roles = ("grad",) if kind == "clear_grads" else ("dual", "grad_dual")
            for fid, f in self._program.fields.items():
                for role in roles:
                    c = f.companion(role)
                    if c is not None:
                        self._field_ids.add(fid)
                        self._doc_ops.append({"op": "zero", "field": fid, "role": role,
                                              "offset": 0, "begin": 0,
                                              "end": _nbytes(c.dtype.np, f.shape +
                                                             f.element_shape)})
            return
        if kind not in ("fill", "set_item", "set_bytes", "zero"):
            GraphRecording.refuse(f"the engine op '{kind}'")
        f = self._program.fields.get(op.get("id"))
        if f is not None and kind != "zero":  # refused as a local capture refuses it
            label = f.companion(op.get("role", "primal"))._label()
            Graph._dense(f, {"fill": f"{label}.fill()", "set_item": f"writing {label}[...]",
                             "set_bytes": f"{label}.from_numpy()"}[kind])
        key, dtype, shape, esh, bound = self._target(op)
        nbytes = _nbytes(dtype, shape + esh)
        entry = {"op": "copy", **key, "offset": 0, "begin": 0, "end": nbytes}
        if kind == "zero":  # deactivate_all: the storage cleared, active or not
            entry["op"] = "zero"
        elif kind == "fill":
            value = from_jsonable(op.get("value"))
            pattern = np.empty(esh, dtype=dtype)
            try:
                pattern[...] = value
            except ValueError:  # a value of the whole storage's shape: a constant copy
                data = np.array(np.broadcast_to(np.asarray(value, dtype=dtype), shape + esh))
                entry["data"] = wire.encode_bytes(data.tobytes())
            else:
                if not pattern.reshape(-1).view(np.uint8).any():
                    entry["op"] = "zero"
                else:
                    entry.update(op="fill", end=nbytes // max(1, pattern.nbytes),
                                 pattern=wire.encode_bytes(pattern.tobytes()))
        elif kind == "set_item":
            if bound is not None:
                raise GraphCaptureError(f"writing an element of graph input '{bound}': element "
                                        f"writes into graph inputs are not supported (at "
                                        f"{user_line()}); write in a kernel")
            elem = np.empty(esh, dtype=dtype)
            elem[...] = np.asarray(from_jsonable(op.get("value")), dtype=dtype).reshape(esh)
            index = [i + n if i < 0 else i for i, n in zip(op["index"], shape, strict=True)]
            entry.update(offset=int(np.ravel_multi_index(index, shape)) * elem.nbytes,
                         end=elem.nbytes, data=wire.encode_bytes(elem.tobytes()))
        else:
            entry["data"] = op["b64"]
        self._doc_ops.append(entry)

    # ------------------------------------------------------------------ the document
    def finish_capture(self) -> None:
        """Make the graph's document (when its capture block ends without an error)."""
        prog = self._program
        fields = {}
        for fid in sorted(self._field_ids):
            f = prog.fields[fid]
            fields[str(fid)] = saved.field_entry(f)
        inputs = []
        for inp in self._inputs.values():
            out: dict[str, Any] = {"name": inp.name, "kind": inp.kind}
            if inp.kind == "field":
                out["field"] = inp.example.id
            elif inp.kind == "array":
                if isinstance(inp.example, np.ndarray):
                    home = self._homes.get(inp.name)
                    if home is None:  # no launch binds it: nothing of the graph reads it
                        continue
                    out["ndarray"] = home[0]
                else:
                    out["ndarray"] = inp.example.id
            else:
                out["dtype"] = saved._dtype_text(inp.dtype)
                out["slots"] = inp.slots
                if inp.has_value:
                    out["value"] = _wire_value(inp)
            inputs.append(out)
        self._doc = {"format": saved.FORMAT, "version": saved.VERSION,
                     "difftape": __version__, "fields": fields,
                     "ndarrays": {str(k): v for k, v in sorted(self._nd.items())},
                     "kernels": self._kernels, "ops": self._doc_ops, "inputs": inputs}
        if not self._nd:
            del self._doc["ndarrays"]
        self._identify()

    def _identify(self) -> None:
        self.graph_id = wire.graph_id({"graph": self._doc, "fields": self._field_map})
        self.prog = self._program

    @classmethod
    def loaded(cls, rt: RemoteRuntime, doc: dict, mapping: dict[int, Field],
               keys: dict[int, str]) -> RemoteGraph:
        """A saved graph's document, to be built on the server over ``mapping``'s fields
        (saved id -> this program's field); ``keys``: their names in ``g.fields``."""
        g = cls(rt)
        g._doc = doc
        g._field_map = {str(fid): f.id for fid, f in mapping.items()}
        g.fields = {keys[fid]: f for fid, f in mapping.items()}
        g.launches = sum(1 for op in doc["ops"] if isinstance(op, dict) and
                         op.get("op") == "launch")
        for spec in doc["inputs"]:
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise saved._bad("each input needs a name")
            name, kind = spec["name"], spec.get("kind")
            if kind == "field":
                f = mapping.get(spec.get("field"))
                if f is None:
                    raise saved._bad(f"input '{name}': not one of the graph's fields")
                g._inputs[name] = _Input(name, "field", example=f, dtype=f.dtype,
                                         element_shape=f.element_shape, shape=f.shape,
                                         value=f, has_value=True)
            elif kind in ("scalar", "matrix"):
                inp = g._inputs[name] = _Input(name, kind,
                                               dtype=saved.parse_dtype(kind, spec.get("dtype"),
                                                                       name))
                inp.slots = [s for s in spec.get("slots", []) if isinstance(s, list)
                             and len(s) == 4]
                if "value" in spec:
                    inp.value, inp.has_value = spec["value"], True
            else:
                raise saved._bad(f"input '{name}': unknown kind {kind!r:.20}")
        g._identify()
        return g

    def save(self, path: str) -> None:
        """Write the graph's document to ``path`` (``ti.graph.load`` reads it, locally or
        remotely). Graphs over ``ti.ndarray``s or array inputs are not saved, as locally."""
        if self._doc is None:
            raise GraphError("only a captured graph can be saved (after its capture block)")
        if self._doc.get("ndarrays") or any(i.kind == "array" for i in self._inputs.values()):
            raise GraphError("saving a graph: it binds ndarrays or array inputs; saved graphs "
                             "address fields only")
        with open(path, "w") as fh:
            json.dump(self._doc, fh)

    # ------------------------------------------------------------------ replay
    def replay(self, **inputs) -> None:
        """Run the graph on the server: one request (with whatever else is queued), which
        also carries the graph itself the first time. Raises what the replay raised there
        (a bad index: the kernel's error with its line), as a local replay does."""
        rt = self.rt
        if self.prog is None:
            raise GraphError("the graph is still being captured (or its capture failed): "
                             "replay it after the `with ti.graph.capture()` block")
        if program.get() is not self.prog or rt.closed:
            raise GraphError("this graph was captured under a program that ti.init()/ti.reset() "
                             "has ended (its fields and kernels are gone): capture it again")
        for name, value in inputs.items():
            inp = self._inputs.get(name)
            if inp is None:
                raise GraphError(f"the graph has no input '{name}' (inputs: "
                                 f"{', '.join(self._inputs) or 'none'})")
            self._check(inp, value)
            inp.value, inp.has_value = value, True
        for inp in self._inputs.values():
            if not inp.has_value:
                raise GraphError(f"graph input '{inp.name}' has no value yet: pass "
                                 f"{inp.name}=... to the first replay")
        sent, large = {}, []
        for inp in self._inputs.values():
            if inp.kind != "array":
                sent[inp.name] = _wire_value(inp)
            elif isinstance(inp.value, np.ndarray):
                home = self._homes.get(inp.name)
                if home is None:
                    continue
                data = np.ascontiguousarray(inp.value)
                if data.nbytes <= wire.INLINE_BYTES:
                    sent[inp.name] = {"ndarray": home[0],
                                      "b64": wire.encode_bytes(data.tobytes())}
                else:  # an upload of its own, before the replay
                    rt.write(home[0], "primal", data)
                    sent[inp.name] = {"ndarray": home[0]}
                    large.append(inp)
            else:
                sent[inp.name] = {"ndarray": inp.value.id}
        if not self._uploaded:
            op = {"op": wire.GRAPH_CREATE, "graph_id": self.graph_id, "graph": self._doc}
            if self._field_map is not None:
                op["fields"] = self._field_map
            rt.queue(op)
        result = rt.call({"op": wire.GRAPH_REPLAY, "graph_id": self.graph_id, "inputs": sent})
        self._uploaded = True
        for name, text in result.get("arrays", {}).items():
            arr = self._inputs[name].value
            np.copyto(arr, np.frombuffer(base64.b64decode(text), dtype=arr.dtype)
                      .reshape(arr.shape))
        written = set(result.get("written", ()))
        for inp in large:
            if inp.name in written:
                arr = inp.value
                np.copyto(arr, rt.read(self._homes[inp.name][0], "primal", arr.dtype,
                                       arr.shape))

    __call__ = replay

    def _check(self, inp: _Input, value) -> None:
        """A new value for ``inp``, checked here as a local replay checks it (so that a
        refused value is never kept)."""
        probe = np.zeros(1, dtype=np.int64)
        if inp.kind == "scalar":
            for kind in {s[2] for s in inp.slots} or {"f"}:
                _write_scalar(probe, 0, kind, value, inp.name)
        elif inp.kind == "matrix":
            entries = _matrix_entries(value, inp)
            for s in inp.slots:
                _write_scalar(probe, 0, s[2], entries[s[3]], inp.name)
        elif inp.kind == "field":
            ex = inp.example
            if not isinstance(value, Field) or value.role != "primal":
                raise GraphError(f"graph input '{inp.name}' is a field; got "
                                 f"{type(value).__name__}")
            if (value.shape, value.element_shape, value.dtype) != (ex.shape, ex.element_shape,
                                                                   ex.dtype):
                raise GraphError(f"graph input '{inp.name}': the graph was captured with a "
                                 f"field of shape {ex.shape}, element {ex.element_shape}, "
                                 f"{ex.dtype}; got shape {value.shape}, element "
                                 f"{value.element_shape}, {value.dtype}: capture the graph "
                                 "again for it")
        elif isinstance(value, np.ndarray):
            try:
                dtype = T.from_numpy(value.dtype)
            except TypeError:
                dtype = None
            if dtype != inp.dtype:
                raise GraphError(f"graph input '{inp.name}': Dispatch node is compiled for an "
                                 f"array of {inp.dtype} elements, but got an ndarray with "
                                 f"dtype={dtype}: pass one of the captured kind (or capture "
                                 "again)")
            if value.shape != tuple(inp.shape):
                raise GraphError(f"graph input '{inp.name}': the graph was captured with shape "
                                 f"{tuple(inp.shape)}, got {value.shape}; capture the graph "
                                 "again for the new shape (its launches were packed for the "
                                 "old one)")
            if inp.name in self._homes and not value.flags.writeable:
                raise GraphError(f"graph input '{inp.name}': the array must be writable")
        elif not isinstance(value, Ndarray) or getattr(value, "_program", None) is not self.prog:
            raise GraphError(f"graph input '{inp.name}' is an array; got "
                             f"{type(value).__name__}")


def _nbytes(dtype, full: tuple) -> int:
    return int(np.prod(full, dtype=np.int64)) * np.dtype(dtype).itemsize


def _wire_value(inp: _Input) -> Any:
    """A scalar, vector/matrix or field input's value as it travels (:mod:`wire`)."""
    v = inp.value
    if inp.kind == "field":
        return {"field": v.id}
    if inp.kind == "matrix":
        return [wire.encode_number(_plain(x)) for x in _matrix_entries(v, inp)]
    return wire.encode_number(_plain(v))


def _plain(v):
    if isinstance(v, np.generic | np.ndarray):
        v = v.item()
    if isinstance(v, bool):
        return int(v)
    return v if isinstance(v, numbers.Number) else float(v)


__all__ = ["GraphRecording", "RemoteGraph"]
