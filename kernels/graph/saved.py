"""Saved graphs: ``g.save(path)`` and ``ti.graph.load(path)`` in another process.

The file is JSON (no pickle, no machine code, no addresses): the *frontend* IR of each kernel
variant the graph launches (``ir.serialize``, what the service receives), the fields it
addresses (label, dtype, shape, element shape, offset, which of .grad/.dual/.grad.dual
exist), and the ops in order: a launch as its kernel's index and its scalar parameters as
packed, a fill / copy / zero as its target storage and a byte range (constants inline).
Named scalar, vector and field inputs are listed with the places they bind. This is also the
form a server would take a graph in (the hook for remote replay): IR it validates and
compiles itself, and launch records over storage it owns.

Loading trusts nothing in the file: every kernel's IR goes through
``ir.validate.decode_untrusted`` (the service's validator), must address only the listed
fields with their listed dtypes, shapes and offsets, and is derived and compiled here (``derive``,
the pass pipeline, ``compile_ir``: so the code comes from the disk cache when this machine
compiled the same kernels before, else from LLVM); launch contexts are rebuilt from the
compiled layout (pointers, the random state and error words are this process's own) with
only the scalar parameters taken from the file; every fill/copy range is checked against its
storage. The loaded graph's fields are new fields of the current program (``g.fields``, by
label), or the caller's own (``load(path, fields={label: field})``, checked alike).

The document is target-independent: a graph captured on a grid program (``simulate_grid``,
``arch=ti.cuda``) saves the document the CPU saves (its storage located by device address,
a fill written as the fill it is), and a document loads on any target: on a grid it is built
into the grid replay of the code compiled there (``runtime/gridgraph.py``: graph executables),
its constants uploaded into device memory once.

A difftape server builds the graphs clients send it (:mod:`.wire`) with the same code
(:func:`build`), over its session's fields and ``ti.ndarray`` storage (which a document sent
to a server may also bind to kernel arguments: ``ndarrays``, a launch's ``arrays``, inputs of
kind ``array``), with bounds checks on.

Not saved (refused by ``save``): graphs with ndarray arguments or inputs, fields under sparse
SNodes, kernels with ``print``.
"""

from __future__ import annotations

import base64
import json
import numbers
from typing import Any

import numpy as np

from .. import types as T
from .._version import __version__
from ..errors import DifftapeError, GraphError, IRValidationError, ShapeError
from ..frontend.field import Field, check_offset_range, make_field
from ..frontend.kernel import compile_ir, derive
from ..frontend.matrix import MatrixType
from ..frontend.ndarray import Ndarray
from ..ir import serialize
from ..ir.passes import run_pipeline
from ..ir.validate import argument_names, decode_untrusted
from ..runtime import program
from ..runtime.storage import Storage
from . import wire
from .core import Graph, _Input, address, memory, register_saver

FORMAT = "difftape-graph"
VERSION = 1
ROLES = ("primal", "grad", "dual", "grad_dual")
VARIANTS = ("primal", "grad", "fwd", "grad_fwd", "fwd_const")
MAX_OPS = 1 << 20


def save(graph: Graph, path: str) -> None:
    """Write ``graph`` to ``path`` (see the module docstring for what is refused)."""
    prog = graph.prog
    if prog is None:
        raise GraphError("only a captured graph can be saved (after its capture block)")
    storage: dict[int, tuple[int, str, np.ndarray | Storage]] = {}
    for fid, f in prog.fields.items():
        for role in ROLES:
            c = f.companion(role)
            if c is not None:
                mem = memory(c.storage)  # (host memory on the CPU, device memory on a grid)
                storage[address(mem)] = (fid, role, mem)
    constants = graph._constants
    used: set[int] = set()

    def locate(addr: int) -> tuple[int, str, int]:
        for base, (fid, role, arr) in storage.items():
            if base <= addr < base + max(1, arr.nbytes):
                used.add(fid)
                return fid, role, addr - base
        raise GraphError("saving a graph: an op addresses memory that is not a field's "
                         "(ndarrays and NumPy arrays cannot be saved)")

    kernels: list[dict] = []
    index: dict[int, int] = {}
    ops: list[dict] = []
    where: dict[int, int] = {}  # id(op context) -> op number
    for op in graph._ops:
        if op[0] == "launch":
            _, inst, ctx = op
            if inst.origin is None:
                raise GraphError(f"kernel '{inst.ir.name}' was not compiled from a @ti.kernel")
            if any(b.key[0] != "field" for b in inst.ir.buffers if b.key[0] != "private"):
                raise GraphError(f"saving a graph: kernel '{inst.ir.name}' takes ndarray "
                                 "arguments; saved graphs address fields only")
            if id(inst) not in index:
                kernel, spec, variant = inst.origin
                ir = kernel._frontend_ir(prog, spec, adjoint=variant in ("grad", "grad_fwd"))
                if variant not in VARIANTS:
                    raise GraphError(f"saving a graph: kernel variant {variant!r}")
                index[id(inst)] = len(kernels)
                kernels.append({"ir": serialize.encode(ir), "variant": variant,
                                "deterministic": bool(inst.ir.deterministic),
                                "fast_math": bool(inst.ir.fast_math)})
                for b in inst.ir.buffers:
                    if b.key[0] == "field":
                        used.add(b.key[1])
            where[id(ctx)] = len(ops)
            ops.append({"op": "launch", "kernel": index[id(inst)],
                        "params": [int(ctx[s]) for s in inst.layout.params]})
            continue
        _, name, ctx, begin, end = op
        fid, role, offset = locate(int(ctx[0]))
        entry: dict[str, Any] = {"op": name, "field": fid, "role": role, "offset": offset,
                                 "begin": int(begin), "end": int(end)}
        pattern = graph._fills.get(id(ctx))
        if pattern is not None:  # a grid's fill, recorded as a copy of the filled bytes
            name = entry["op"] = "fill"
            k = pattern.nbytes
            entry["begin"], entry["end"] = int(begin) // k, int(end) // k
        if name == "fill":
            pattern = constants[int(ctx[1])] if pattern is None else pattern
            entry["pattern"] = base64.b64encode(pattern.tobytes()).decode()
        elif name == "copy":
            src = int(ctx[1])
            if src in constants:
                data = constants[src].tobytes()[int(begin):int(end)]
                entry["data"] = base64.b64encode(data).decode()
            else:
                sfid, srole, soff = locate(src)
                entry["source"] = [sfid, srole, soff]
        where[id(ctx)] = len(ops)
        ops.append(entry)
    inputs = []
    for inp in graph._inputs.values():
        if inp.kind == "array":
            raise GraphError(f"saving a graph: input '{inp.name}' is an array; saved graphs "
                             "take scalar, vector/matrix and field inputs")
        out: dict[str, Any] = {"name": inp.name, "kind": inp.kind}
        if inp.kind == "field":
            out["field"] = inp.example.id
        else:
            out["dtype"] = _dtype_text(inp.dtype)
            out["slots"] = [[where[id(ctx)], _param_index(graph, ctx, slot), kind, comp]
                            for ctx, slot, (kind, comp) in inp.slots]
            if inp.has_value:
                v = inp.value
                out["value"] = (v.to_list() if hasattr(v, "to_list") else
                                np.asarray(v).tolist())
        inputs.append(out)
    fields = {}
    for fid in sorted(used):
        f = prog.fields[fid]
        if f.sparse_terms:
            raise GraphError(f"saving a graph: '{f._label()}' is under a sparse SNode")
        fields[str(fid)] = field_entry(f)
    doc = {"format": FORMAT, "version": VERSION, "difftape": __version__, "fields": fields,
           "kernels": kernels, "ops": ops, "inputs": inputs}
    with open(path, "w") as fh:
        json.dump(doc, fh)


def field_entry(f: Field) -> dict[str, Any]:
    """A field as a graph document describes it (a saved file's, a captured remote graph's):
    label, dtype, shapes, the storage it has, and its ``offset`` when it has one (the
    kernels' IR indexes from it; a field loaded for the graph gets it)."""
    out = {"label": f._label()[:128], "dtype": f.dtype.name, "shape": list(f.shape),
           "element_shape": list(f.element_shape),
           "roles": [r for r in ROLES if f.companion(r) is not None]}
    if f.primal._offset:
        out["offset"] = list(f.primal._offset)
    return out


def _param_index(graph: Graph, ctx: np.ndarray, slot: int) -> int:
    for op in graph._ops:
        if op[0] == "launch" and op[2] is ctx:
            return op[1].layout.params.index(slot)
    raise GraphError("saving a graph: an input is bound outside a launch")


def _dtype_text(dtype) -> Any:
    if dtype is None:
        return None
    if isinstance(dtype, T.DType):
        return dtype.name
    return {"n": dtype.n, "m": dtype.m, "ndim": dtype.ndim,
            "dtype": None if dtype._dtype is None else dtype.scalar_dtype.name}


# ---------------------------------------------------------------------------------------------
# loading


def _bad(what: str) -> GraphError:
    return GraphError(f"saved graph refused: {what}")


def _int(v, lo: int, hi: int, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _bad(f"{what} must be an integer in [{lo}, {hi}], got {v!r:.40}")
    return v


def read_document(path: str) -> dict:
    """The JSON document of a saved graph, its header checked (nothing else trusted yet)."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as e:
        raise _bad(f"{path} is not readable JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise _bad(f"{path} is not a {FORMAT} file of version {VERSION}")
    return doc


def load(path: str, fields: dict[str, Field] | None = None) -> Graph:
    """A graph saved by :func:`save`, validated and compiled for the current program. Its
    fields are new (``g.fields[label]``) unless ``fields`` maps labels to existing ones.
    Under ``arch=ti.remote`` the fields are made on the server and the document goes there
    (``difftape.client``), where it is validated and compiled the same way."""
    prog = program.get()
    doc = read_document(path)
    check_document(doc)
    given = fields or {}

    def field_for(fid: int, key: str) -> Field | None:
        return given.get(key)

    if prog.remote is not None:
        mapping, manifest = _fields(doc["fields"], field_for, create=True, given=set(given))
        return prog.remote.load_graph(doc, mapping,
                                      {fid: m["key"] for fid, m in manifest.items()})
    return build(doc, prog, field_for, create=True, given=set(given))


def check_document(doc) -> None:
    """The shape of a graph document (before anything in it is used)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise _bad(f"not a {FORMAT} document of version {VERSION}")
    for key, kind in (("fields", dict), ("kernels", list), ("ops", list), ("inputs", list)):
        if not isinstance(doc.get(key), kind):
            raise _bad(f"'{key}' must be a {kind.__name__}")
    if not isinstance(doc.get("ndarrays", {}), dict):
        raise _bad("'ndarrays' must be a dict")
    if len(doc["ops"]) > MAX_OPS:
        raise _bad(f"more than {MAX_OPS} ops")


def build(doc: dict, prog, field_for, *, create: bool = False, given: set | None = None,
          ndarrays: dict | None = None, checked: bool = False) -> Graph:
    """The native graph of a document (:func:`check_document` first), for ``prog``.

    ``field_for(id, label)``: the existing field a saved field id stands for, or None (then
    a new field is made when ``create``, else the document is refused); ``ndarrays``: the
    ``ti.ndarray`` storage the document's ndarray ids name (a server session's; a saved
    file has none); ``checked``: kernels compiled with bounds checks (``ir.debug``), as a
    server compiles every kernel a client sends."""
    mapping, manifest = _fields(doc["fields"], field_for, create=create, given=given)
    ndmap = _ndarrays(doc.get("ndarrays", {}), ndarrays or {})
    insts = [_kernel(k, n, prog, mapping, manifest, checked)
             for n, k in enumerate(doc["kernels"])]
    g = Graph()
    ctxs: list[np.ndarray | None] = []
    written: list[tuple[np.ndarray, int, Storage]] = []
    for n, op in enumerate(doc["ops"]):
        ctxs.append(_op(g, op, n, insts, mapping, ndmap, written))
    if len(doc["inputs"]) > wire.MAX_INPUTS:
        raise _bad(f"more than {wire.MAX_INPUTS} inputs")
    for n, spec in enumerate(doc["inputs"]):
        _input(g, spec, n, ctxs, doc["ops"], mapping, ndmap)
    if g._grid:  # what a grid replay marks changed: an input's (by name) or the storage
        bound = {(id(ctx), slot): (inp.name, how) for inp in g._inputs.values()
                 if inp.kind in ("field", "array")
                 for ctx, slot, how in inp.slots if not isinstance(how, tuple)}
        g._written = [bound.get((id(ctx), slot), st) for ctx, slot, st in written]
    g.fields = {manifest[fid]["key"]: mapping[fid] for fid in mapping}
    g._finish(prog)
    return g


def _fields(data: dict, field_for, *, create: bool, given: set | None = None
            ) -> tuple[dict[int, Field], dict[int, dict]]:
    """The fields the graph addresses, by saved id: existing ones (``field_for``, checked)
    or, when ``create``, new ones."""
    mapping: dict[int, Field] = {}
    manifest: dict[int, dict] = {}
    labels: dict[str, int] = {}
    for key, f in data.items():
        fid = _int(int(key) if isinstance(key, str) and key.isdigit() else None, 1, 1 << 62,
                   "a field id")
        if not isinstance(f, dict) or not isinstance(f.get("label"), str) or \
                len(f["label"]) > 128:
            raise _bad(f"field {fid}: a label is needed")
        try:
            dtype = T.by_name(f.get("dtype"))
        except (ValueError, TypeError):
            raise _bad(f"field {fid}: unknown dtype {f.get('dtype')!r:.40}") from None
        shape, esh = _shapes(f, f"field {fid}")
        offset = _offset(f, shape, f"field {fid}")
        roles = f.get("roles")
        if not isinstance(roles, list) or "primal" not in roles or \
                not set(roles) <= set(ROLES) or (len(roles) > 1 and not dtype.is_float):
            raise _bad(f"field {fid}: roles must include primal, from {ROLES}")
        label = f["label"]
        key_label = label if label not in labels else f"{label}#{fid}"
        labels[key_label] = fid
        manifest[fid] = {"dtype": dtype, "shape": shape, "esh": esh, "roles": set(roles),
                         "key": key_label, "offset": offset}
        field = field_for(fid, key_label)
        if field is None:
            if not create:
                raise _bad(f"field {fid} ('{label}') is not a field of this program")
            field = make_field(dtype, shape, name=label, needs_grad="grad" in roles,
                               needs_dual="dual" in roles, element_shape=esh,
                               offset=offset or None)
            if "grad_dual" in roles:
                field.grad._make_companion("dual")
        elif not isinstance(field, Field) or (field.dtype, field.shape, field.element_shape,
                                              field.primal._offset) \
                != (dtype, shape, esh, offset) or field.sparse_terms or any(
                    field.companion(r) is None for r in roles):
            where = "ti.graph.load(fields=...)" if create else "saved graph refused"
            raise GraphError(f"{where}: '{key_label}' must be a dense field "
                             f"of {dtype}, shape {shape}, element {esh}, offset "
                             f"{offset or None}, with storage for {', '.join(sorted(roles))}")
        mapping[fid] = field
    unknown = set(given or ()) - set(labels)
    if unknown:
        raise GraphError(f"ti.graph.load(fields=...): the graph has no field "
                         f"'{sorted(unknown)[0]}' (its fields: {', '.join(labels)})")
    return mapping, manifest


def _shapes(f: dict, what: str) -> tuple[tuple, tuple]:
    shape = f.get("shape")
    esh = f.get("element_shape")
    if not isinstance(shape, list) or len(shape) > 8 or not isinstance(esh, list) or \
            len(esh) > 2:
        raise _bad(f"{what}: shape and element_shape must be short lists")
    shape = tuple(_int(s, 1, (1 << 31) - 1, f"{what}'s shape") for s in shape)
    esh = tuple(_int(s, 1, 64, f"{what}'s element shape") for s in esh)
    if int(np.prod(shape + esh, dtype=np.int64)) > (1 << 31):
        raise _bad(f"{what}: more than 2**31 elements")
    return shape, esh


def _offset(f: dict, shape: tuple, what: str) -> tuple[int, ...]:
    """A field's ``offset`` in a document: absent for none, else one integer per axis
    keeping its index range (end excluded) in i32 (as ``place(offset=)`` requires), not all
    zero."""
    if "offset" not in f:
        return ()
    offset = f["offset"]
    if not isinstance(offset, list) or len(offset) != len(shape):
        raise _bad(f"{what}: an offset has one integer per axis")
    out = tuple(_int(o, -2**31, 2**31 - 1, f"{what}'s offset") for o in offset)
    if not any(out):
        raise _bad(f"{what}: an offset of zeros is written as none")
    try:
        check_offset_range(out, shape)
    except ShapeError as e:
        raise _bad(f"{what}: {e}") from None
    return out


def _ndarrays(data: dict, given: dict) -> dict[int, Ndarray]:
    """The ``ti.ndarray`` storage the graph binds to kernel arguments, by id: ``given``'s,
    with the dtype, shapes and ``.grad`` the document describes."""
    out: dict[int, Ndarray] = {}
    for key, d in data.items():
        nid = _int(int(key) if isinstance(key, str) and key.isdigit() else None, 1, 1 << 62,
                   "an ndarray id")
        nd = given.get(nid)
        if nd is None:
            raise _bad(f"ndarray {nid} is not an ndarray of this program (a saved file "
                       "cannot hold ndarrays)")
        if not isinstance(d, dict):
            raise _bad(f"ndarray {nid} must be described")
        shape, esh = _shapes(d, f"ndarray {nid}")
        if (d.get("dtype"), shape, esh, bool(d.get("grad"))) != (
                nd.dtype.name, tuple(nd.shape), tuple(nd.element_shape), nd.grad is not None):
            raise _bad(f"ndarray {nid} is not a {d.get('dtype')!r:.10} ndarray of shape "
                       f"{shape}, element {esh}{' with .grad' if d.get('grad') else ''}")
        out[nid] = nd
    return out


def _kernel(data, n: int, prog, mapping: dict[int, Field], manifest: dict[int, dict],
            checked: bool):
    """Kernel ``n``: its IR validated, derived, compiled (from the disk cache if there)."""
    if not isinstance(data, dict) or data.get("variant") not in VARIANTS:
        raise _bad(f"kernel {n}: a variant from {VARIANTS} is needed")
    grads = data.get("array_grads", [])
    if not isinstance(grads, list) or not all(isinstance(a, int) for a in grads):
        raise _bad(f"kernel {n}: 'array_grads' must be a list of argument indices")
    try:
        ir = decode_untrusted(data.get("ir"), allow_ndarray=checked)
    except IRValidationError as e:
        raise _bad(f"kernel {n}: {e}") from None
    for b in ir.buffers:
        kind, fid, role = b.key
        if kind == "ndarray":  # an argument: checked against what each launch binds
            continue
        m = manifest.get(fid) if kind == "field" else None
        if m is None or role not in m["roles"] or b.dtype != m["dtype"] or \
                tuple(b.shape) != m["shape"] + m["esh"]:
            raise _bad(f"kernel {n} ('{ir.name}'): buffer '{b.name}' is not one of the graph's "
                       "fields with its dtype and shape")
        if b.offset != m["offset"]:  # its indices count from the offset (the bounds checks)
            raise _bad(f"kernel {n} ('{ir.name}'): buffer '{b.name}' has offset "
                       f"{b.offset or None}, its field offset {m['offset'] or None}")
    if checked:
        ir.debug = True  # bounds checks on every access (what a server compiles)

    def storage(buf, role: str) -> bool:
        kind, fid, base = buf.key
        if kind == "ndarray":
            return role == "grad" and base == "primal" and fid in grads
        name = role if base == "primal" else f"{base}_{role}"
        return kind == "field" and name in manifest[fid]["roles"]

    try:
        ir = derive(ir, data["variant"], storage)
        ir.deterministic = data.get("deterministic") is True
        ir.fast_math = data.get("fast_math") is not False
        ir = run_pipeline(ir)
        inst = compile_ir(ir, prog, arg_names=argument_names(ir), fields=mapping)
    except DifftapeError as e:
        raise _bad(f"kernel {n} ('{ir.name}') does not compile here: {e}") from None
    inst.array_grads = frozenset(grads)
    return inst


def _storage(mapping: dict[int, Field], ndmap: dict[int, Ndarray], op: dict
             ) -> np.ndarray | Storage:
    """The memory (:func:`~.core.memory`) a fill/copy/zero op addresses: ``field`` or
    ``ndarray`` id, ``role``."""
    role = op.get("role")
    if "ndarray" in op:
        nd = ndmap.get(op["ndarray"]) if isinstance(op["ndarray"], int) else None
        s = nd if role == "primal" else nd.grad if nd is not None and role == "grad" else None
        if s is None:
            raise _bad(f"an op addresses ndarray {op['ndarray']!r:.20} .{role!r:.20}, which is "
                       "not in the graph")
        return memory(s.storage)
    fid = op.get("field")
    f = mapping.get(fid) if isinstance(fid, int) else None
    c = f.companion(role) if f is not None and role in ROLES else None
    if c is None:
        raise _bad(f"an op addresses field {fid!r:.20} .{role!r:.20}, which is not in the graph")
    return memory(c.storage)


def _bind_arrays(inst, spec, n: int, ndmap: dict[int, Ndarray], ctx: np.ndarray,
                 keep: list, written: list) -> None:
    """A launch's ``arrays`` (``[{"arg", "id", "grad"}]``, as the engine's ``launch``): the
    ndarray storage of each ndarray argument, checked against the kernel's buffers for it
    (dtype, axes, element shape), its pointer and extents written into the context."""
    if not isinstance(spec, list):
        raise _bad(f"op {n}: 'arrays' must be a list")
    bound: dict[int, Ndarray] = {}
    grads = set()
    for a in spec:
        if not isinstance(a, dict) or not isinstance(a.get("arg"), int) or \
                a.get("id") not in ndmap or a["arg"] in bound:
            raise _bad(f"op {n}: each of 'arrays' is {{arg, id, grad}} naming one of the "
                       "graph's ndarrays, once per argument")
        bound[a["arg"]] = ndmap[a["id"]]
        if a.get("grad") is True:
            grads.add(a["arg"])
    writes = inst.written_pointer_slots()
    if grads != inst.array_grads:
        raise _bad(f"op {n}: the .grad of its ndarray arguments is not what kernel "
                   f"'{inst.ir.name}' was compiled for")
    for ptr, arg, role, extents in inst.argument_slots()[1]:
        nd = bound.get(arg)
        s = None if nd is None else nd if role == "primal" else nd.grad
        if s is None:
            raise _bad(f"op {n}: kernel '{inst.ir.name}' needs ndarray argument {arg + 1}"
                       f"{'' if role == 'primal' else ' with .' + role}")
        arr = memory(s.storage)
        for buf in inst.ir.buffers:
            if buf.key == ("ndarray", arg, role):
                esh = tuple(buf.shape[len(buf.shape) - buf.element_ndim:])
                if buf.dtype != s.dtype or len(buf.shape) != arr.ndim or \
                        esh != tuple(s.element_shape):
                    raise _bad(f"op {n}: kernel '{inst.ir.name}' takes argument {arg + 1} as "
                               f"{buf.dtype} of {len(buf.shape)} axes, element {esh}; the "
                               f"ndarray is {s.dtype} of shape {arr.shape}")
        ctx[ptr] = address(arr)
        for axis, e in enumerate(extents):
            if e is not None:
                ctx[e] = arr.shape[axis]
        keep.append(arr)
        if ptr in writes:
            written.append((ctx, ptr, s.storage))


def _op(g: Graph, op, n: int, insts: list, mapping: dict[int, Field],
        ndmap: dict[int, Ndarray], written: list) -> np.ndarray | None:
    """Op ``n`` of the document, checked and recorded into ``g``; returns a launch's
    context. ``written`` gains ``(context, slot, storage)`` for what the op writes (a grid
    replay marks it changed). Constant bytes go through ``g._constant`` (device memory on
    a grid, where a fill is a copy from a filled constant)."""
    if not isinstance(op, dict):
        raise _bad(f"op {n} must be an object")
    name = op.get("op")
    if name == "launch":
        k = _int(op.get("kernel"), 0, len(insts) - 1, f"op {n}'s kernel")
        inst = insts[k]
        params = op.get("params")
        if not isinstance(params, list) or len(params) != len(inst.layout.params):
            raise _bad(f"op {n}: kernel '{inst.ir.name}' takes {len(inst.layout.params)} "
                       "parameters")
        ctx = inst.ctx_i64.copy()  # this process's pointers, random state, zeroed error word
        for slot, v in zip(inst.layout.params, params, strict=True):
            ctx[slot] = _int(v, -(1 << 63), (1 << 63) - 1, f"op {n}'s parameter")
        _bind_arrays(inst, op.get("arrays", []), n, ndmap, ctx, g._keep, written)
        writes = inst.written_pointer_slots()
        written.extend((ctx, slot, st) for slot, st in inst.field_storage() if slot in writes)
        g._ops.append(("launch", inst, ctx))
        g._keep.append(inst)
        g.launches += 1
        return ctx
    if name not in ("fill", "copy", "zero"):
        raise _bad(f"op {n}: unknown op {name!r:.20}")
    arr = _storage(mapping, ndmap, op)
    offset = _int(op.get("offset"), 0, arr.nbytes, f"op {n}'s offset")
    begin = _int(op.get("begin"), 0, arr.nbytes, f"op {n}'s begin")
    end = _int(op.get("end"), begin, arr.nbytes, f"op {n}'s end")
    ctx = np.zeros(3, dtype=np.int64)
    ctx[0] = address(arr) + offset
    g._keep.append(arr)
    written.append((ctx, 0, arr))
    if name == "fill":
        pattern = _bytes(op.get("pattern"), n)
        k = len(pattern)
        if k == 0 or offset != 0 or arr.nbytes % k or end * k > arr.nbytes:
            raise _bad(f"op {n}: a fill pattern of {k} bytes over elements [{begin}, {end}) "
                       f"does not fit {arr.nbytes} bytes")
        buf = np.frombuffer(pattern, dtype=np.uint8)
        if g._grid:  # device memory: a copy from a constant holding the filled bytes
            ctx[1] = g._constant(np.tile(buf, end))
            g._ops.append(("op", "copy", ctx, begin * k, end * k))
            g._fills[id(ctx)] = buf
            return None
        ctx[1], ctx[2] = g._constant(buf), k
    elif name == "copy":
        if offset + end > arr.nbytes:
            raise _bad(f"op {n}: bytes [{begin}, {end}) at offset {offset} exceed the target")
        if "data" in op:
            data = _bytes(op["data"], n)
            if len(data) != end - begin:
                raise _bad(f"op {n}: {len(data)} bytes of data for a copy of {end - begin}")
            buf = np.zeros(end, dtype=np.uint8)  # the copy reads src + begin
            buf[begin:] = np.frombuffer(data, dtype=np.uint8)
            ctx[1] = g._constant(buf)
        else:
            src = op.get("source")
            if isinstance(src, dict):  # an ndarray: a NumPy graph input's copy on a server
                buf = _storage(mapping, ndmap, {"ndarray": src.get("ndarray"),  # (client/
                                                "role": src.get("role")})  # graph.py)
                soff = _int(src.get("offset"), 0, buf.nbytes, f"op {n}'s source offset")
            elif isinstance(src, list) and len(src) == 3:  # [field, role, offset]
                buf = _storage(mapping, ndmap, {"field": src[0], "role": src[1]})
                soff = _int(src[2], 0, buf.nbytes, f"op {n}'s source offset")
            else:
                raise _bad(f"op {n}: a copy needs data or a source")
            if soff + end > buf.nbytes:
                raise _bad(f"op {n}: the source is too small")
            g._keep.append(buf)
            ctx[1] = address(buf) + soff
    elif offset + end > arr.nbytes:
        raise _bad(f"op {n}: bytes [{begin}, {end}) exceed the target")
    g._ops.append(("op", name, ctx, begin, end))
    return None


def _bytes(text, n: int) -> bytes:
    if not isinstance(text, str) or len(text) > (1 << 30):
        raise _bad(f"op {n}: base64 data expected")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise _bad(f"op {n}: base64 data expected") from None


def _bind_storage(g: Graph, inp: _Input, roles: dict[str, np.ndarray], ctxs: list) -> None:
    """Bind ``inp`` to every place the graph addresses the storage of ``roles``: launch
    pointers (and, for ndarrays, their extents), fill/copy/zero targets and copy sources.
    Array inputs written by a launch are noted in ``g.written_inputs``."""
    addresses = {address(a): role for role, a in roles.items()}
    for op, ctx in zip(g._ops, ctxs, strict=True):
        if op[0] == "launch":
            inst = op[1]
            for slot, st in inst.field_storage():
                arr = memory(st)
                role = addresses.get(address(arr))
                if role is not None and arr is roles[role]:
                    inp.slots.append((ctx, slot, role))
            for ptr, arg, role, extents in inst.argument_slots()[1]:
                if addresses.get(int(ctx[ptr])) != role:
                    continue
                inp.slots.append((ctx, ptr, role))
                for axis, e in enumerate(extents):
                    if e is not None:
                        inp.slots.append((ctx, e, ("extent", axis)))
                if any(w for s, a, r, _, w in inst._ndarray_slots if (a, r) == (arg, role)):
                    g.written_inputs.add(inp.name)
        else:
            if int(op[2][0]) in addresses:
                inp.slots.append((op[2], 0, addresses[int(op[2][0])]))
                if inp.kind == "array":
                    g.written_inputs.add(inp.name)
            if op[1] == "copy" and int(op[2][1]) in addresses:
                inp.slots.append((op[2], 1, addresses[int(op[2][1])]))


def parse_dtype(kind: str, dtype, name: str):
    """The type of a scalar or vector/matrix input as :func:`_dtype_text` wrote it."""
    try:
        if kind == "scalar":
            return None if dtype is None else T.by_name(dtype)
        if not isinstance(dtype, dict):
            raise _bad(f"input '{name}': a matrix type is needed")
        return MatrixType(_int(dtype.get("n"), 1, 64, "n"), _int(dtype.get("m"), 1, 64, "m"),
                          _int(dtype.get("ndim"), 1, 2, "ndim"),
                          None if dtype.get("dtype") is None else T.by_name(dtype["dtype"]))
    except (ValueError, TypeError):
        raise _bad(f"input '{name}': unknown dtype") from None


def _input(g: Graph, spec, n: int, ctxs: list, ops: list, mapping: dict[int, Field],
           ndmap: dict[int, Ndarray]) -> None:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
            not spec["name"].isidentifier() or spec["name"] in g._inputs:
        raise _bad(f"input {n}: a unique identifier name is needed")
    name, kind = spec["name"], spec.get("kind")
    if kind == "field":
        f = mapping.get(spec.get("field"))
        if f is None:
            raise _bad(f"input '{name}': not one of the graph's fields")
        inp = _Input(name, "field", example=f, dtype=f.dtype, element_shape=f.element_shape,
                     shape=f.shape, value=f, has_value=True)
        g._inputs[name] = inp
        _bind_storage(g, inp, {r: memory(f.companion(r).storage) for r in ROLES
                               if f.companion(r) is not None}, ctxs)
        return
    if kind == "array":
        nd = ndmap.get(spec.get("ndarray"))
        if nd is None:
            raise _bad(f"input '{name}': not one of the graph's ndarrays")
        inp = _Input(name, "array", example=nd, dtype=nd.dtype,
                     element_shape=tuple(nd.element_shape), shape=tuple(nd.storage.shape), value=nd,
                     has_value=True)
        g._inputs[name] = inp
        roles = {"primal": memory(nd.storage)}
        if nd.grad is not None:
            roles["grad"] = memory(nd.grad.storage)
        _bind_storage(g, inp, roles, ctxs)
        return
    if kind not in ("scalar", "matrix"):
        raise _bad(f"input '{name}': unknown kind {kind!r:.20}")
    dtype = parse_dtype(kind, spec.get("dtype"), name)
    inp = _Input(name, kind, dtype=dtype)
    slots = spec.get("slots")
    if not isinstance(slots, list):
        raise _bad(f"input '{name}': slots must be a list")
    size = dtype.n * (dtype.m if dtype.ndim == 2 else 1) if kind == "matrix" else 1
    for s in slots:
        if not isinstance(s, list) or len(s) != 4:
            raise _bad(f"input '{name}': a slot is [op, parameter, kind, component]")
        o = _int(s[0], 0, len(ops) - 1, "a slot's op")
        ctx = ctxs[o]
        if ctx is None:
            raise _bad(f"input '{name}': op {o} is not a launch")
        inst = g._ops[o][1]
        p = _int(s[1], 0, len(inst.layout.params) - 1, "a slot's parameter")
        want = inst.ir.params[p].dtype
        wkind = "f" if want.is_float else "i" if want.is_signed else want.bits
        if s[2] != wkind or not (s[3] is None if kind == "scalar" else
                                 isinstance(s[3], int) and 0 <= s[3] < size):
            raise _bad(f"input '{name}': a slot's kind does not match the parameter")
        inp.slots.append((ctx, inst.layout.params[p], (wkind, s[3])))
    g._inputs[name] = inp
    if "value" in spec:
        v = spec["value"]
        if not isinstance(v, numbers.Number | list):
            raise _bad(f"input '{name}': a number or list value expected")
        inp.value, inp.has_value = v, True


register_saver(save)
