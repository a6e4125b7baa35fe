"""Sparse SNodes (``pointer``, ``bitmasked``, ``dynamic``) on dense storage.

A sparse level keeps its activity in a hidden field (see :class:`~.field.SNode`): a byte per
cell of a pointer/bitmasked level, a length per list of a dynamic level. What Taichi does with
allocation, this module does with that metadata and one invariant: **an inactive cell's data is
zero** (storage starts zeroed, deactivation zeroes it), so reads never consult activity and
``to_numpy`` needs no masking. Here:

* the activity of an element, as NumPy (Python scope) and as kernel IR (struct-for guards,
  ``ti.is_active``);
* activation by writes (every write through a field below a sparse level), ``ti.activate``,
  ``ti.deactivate`` (zeroes the cell's data and the activity below it), and the dynamic-list
  operations ``ti.append`` / ``ti.length`` / ``x[i].append(v)``...;
* :func:`finish_struct_fors`: a struct-for visits the cells active when it starts (Taichi lists
  them first); where the kernel itself changes that activity, the loop reads a snapshot taken
  just before it instead of the live metadata.

Under ``arch=ti.remote`` the activity fields are fields of the server session, kernels over
them are ordinary IR, and the Python-scope half works from :attr:`Field.activity_levels`,
which the service's engine rebuilds from ``create_field``'s ``sparse``: the engine activates,
masks and guards adjoints with the same functions as a local program.
"""

from __future__ import annotations

import numpy as np

from .. import types as T
from ..errors import DifftapeError, GradientRuleError
from ..ir.nodes import walk
from . import builder as _b
from . import field as _field
from . import ops
from .field import Field, SNode, assign, kernel_element, root
from .matrix import Matrix, Vector, _coerce
from .values import Expr


# ---------------------------------------------------------------------------- Python scope
def active_mask(levels: list, shape: tuple[int, ...]) -> np.ndarray:
    """Which cells of an index space of ``shape`` are active, as a bool array, from the
    activity ``levels`` above them (``Field.activity_levels``: activity field, index map,
    dynamic?)."""
    out = np.ones(shape, dtype=bool)
    for activity, imap, dynamic in levels:
        idx = []
        for q, d in imap:
            ax = np.arange(shape[q]) // d
            idx.append(ax.reshape([-1 if k == q else 1 for k in range(len(shape))]))
        act = activity.storage.read()
        if dynamic:
            *par, j = idx
            cond = j < (act[tuple(par)] if par else act[()])
        else:
            cond = act[tuple(idx)] != 0 if idx else np.asarray(act != 0)
        out &= np.broadcast_to(cond, shape)
    return out


# ---------------------------------------------------------------------------- kernel IR
def _ops():
    return ops


def level_index(idx: list, imap: list[tuple[int, int]]) -> list:
    """The index of an ancestor level from a node's index (``imap`` from ``index_map``)."""
    ops = _ops()
    return [idx[q] if d == 1 else ops.binary("floordiv", idx[q], d) for q, d in imap]


def _element(field: Field, idx: list):
    return kernel_element(field.buffer(), tuple(idx))


def emit_activate(node: SNode, idx: list) -> None:
    """Activate the cells along the path of ``node[idx]`` (a write to a field there)."""
    for lvl, imap in node.activity_terms():
        _activate_level(lvl, level_index(idx, imap))


def _activate_level(lvl: SNode, lidx: list) -> None:
    ops = _ops()
    if lvl.kind == "dynamic":
        *par, j = lidx
        _element(lvl.activity, par).atomic("max", ops.binary("add", j, 1))
    else:
        # A plain store: racing writers all store 1.
        _element(lvl.activity, lidx).store(ops.const(1, T.i8))


def active_condition(node: SNode, idx: list) -> Expr:
    """An i32 that is nonzero iff ``node[idx]`` is active at every sparse level above it."""
    ops = _ops()
    cond = None
    for lvl, imap in node.activity_terms():
        lidx = level_index(idx, imap)
        if lvl.kind == "dynamic":
            *par, j = lidx
            c = ops.binary("lt", j, _element(lvl.activity, par).expr())
        else:
            c = ops.binary("ne", _element(lvl.activity, lidx).expr(), ops.const(0, T.i8))
        cond = c if cond is None else ops.logical_and(cond, c)
    return cond if cond is not None else ops.const(1, T.i32)


def sparse_levels(prog, buf) -> list:
    """The sparse levels above a field buffer's cells, for the reverse-mode transform
    (``autodiff.reverse.ActivityLevel``: activity buffer, index map, dynamic?); empty for
    dense storage and ndarrays. The service's engine derives a client's kernels with it too
    (its fields know their levels from ``create_field``)."""
    kind, ident, _role = buf.key
    f = prog.fields.get(ident) if kind == "field" else None
    if f is None:
        return []
    return [(act.buffer(), imap, dynamic) for act, imap, dynamic in f.activity_levels]


def struct_for_guard(tr, node: SNode, indices: list) -> None:
    """At the top of a struct-for body: skip an inactive cell. The guard's loads of activity
    are recorded, so :func:`finish_struct_fors` can point them at a snapshot."""
    bld = tr.bld
    ops = _ops()
    with bld.block() as guard:
        ok = active_condition(node, indices)
        with bld.block() as skip:
            bld.emit("continue", None)
        bld.emit("if", None, (ops.logical_not(ok).stmt,), None, (skip, []))
    bld.splice(guard)
    slots = {bld.buffer_slot(lvl.activity.buffer()): lvl.activity
             for lvl, _ in node.activity_terms()}
    loads = [s for s in guard if s.op == "load" and s.attr in slots]
    bld.struct_fors.append({"loads": loads, "slots": slots, "loop": None})


def finish_struct_fors(bld, key: tuple) -> None:
    """After the kernel body is built: a struct-for whose activity the kernel writes (writes
    that activate, ``ti.activate``/``deactivate``/``append``) reads a snapshot of it taken just
    before the loop, so it visits the cells active when it starts, as in Taichi, whatever the
    order in which iterations run. ``key`` names the kernel (snapshot storage is per loop)."""
    if not bld.struct_fors:
        return
    written = {s.attr if s.op == "store" else s.attr[0]
               for s in walk(bld.body) if s.op in ("store", "atomic")}
    for n, rec in enumerate(bld.struct_fors):
        stale = {slot: f for slot, f in rec["slots"].items() if slot in written}
        if not stale:
            continue
        loop = rec["loop"]
        copies = []
        for slot, act in stale.items():
            snap = act.__dict__.setdefault("_snapshots", {})
            if (key, n) not in snap:
                snap[(key, n)] = Field(act.dtype, act.shape, name=f"{act.name}.snapshot")
            copy = snap[(key, n)]
            with bld.block() as blk:
                _copy_loop(bld, act, copy)
            copies += blk
            new_slot = bld.buffer_slot(copy.buffer())
            for ld in rec["loads"]:
                if ld.attr == slot:
                    ld.attr = new_slot
        at = next(k for k, s in enumerate(bld.body) if s is loop)
        bld.body[at:at] = copies


def _copy_loop(bld, src: Field, dst: Field) -> None:
    """``dst[I] = src[I]`` over the whole field, the outer loop parallel."""
    ops = _ops()
    def nest(level: int, idx: list) -> None:
        if level == len(src.shape):
            _element(dst, idx).store(_element(src, idx).expr())
            return
        loop_id = next(bld.loop_ids)
        with bld.block() as body:
            bld.loop_stack.append(("parallel" if level == 0 else "range", loop_id))
            nest(level + 1, idx + [Expr(bld.emit("loop_index", T.i32, (), loop_id))])
            bld.loop_stack.pop()
        bld.emit("range_for", None, (ops.const(0, T.i32).stmt,
                                     ops.const(src.shape[level], T.i32).stmt),
                 (loop_id, "parallel" if level == 0 else "inner"), (body,))

    nest(0, [])


# ---------------------------------------------------------------------------- builtins
def _node(x, what: str) -> SNode:
    if isinstance(x, Field):
        return x.parent()
    if isinstance(x, SNode):
        return x
    raise _b.require().error(f"{what}: the first argument must be an SNode or a field, got "
                             f"{type(x).__name__}")


def _indices(node: SNode, indices, ndim: int, what: str) -> list:
    if isinstance(indices, Matrix):
        indices = indices.entries
    elif not isinstance(indices, list | tuple):
        indices = [indices]
    indices = list(indices)
    if len(indices) != ndim:
        raise _b.require().error(f"{what}: {node!r} takes {ndim} ind"
                                 f"{'ex' if ndim == 1 else 'ices'}, got {len(indices)}")
    return [_ops().to_expr(i, T.i32) for i in indices]


def _kernel_only(what: str):
    bld = _b.current()
    if bld is None:
        raise DifftapeError(f"ti.{what}() is only valid inside a kernel (as in Taichi)")
    return bld


def is_active(node, indices):
    """``ti.is_active(snode, I)``: 1 if ``snode[I]`` is active (at every sparse level above
    and at it), else 0. Dense SNodes are always active."""
    _kernel_only("is_active")
    node = _node(node, "ti.is_active")
    return active_condition(node, _indices(node, indices, len(node.shape), "ti.is_active"))


def activate(node, indices) -> None:
    """``ti.activate(snode, I)``: activate ``snode[I]`` (only that cell, as in Taichi)."""
    bld = _kernel_only("activate")
    node = _node(node, "ti.activate")
    idx = _indices(node, indices, len(node.shape), "ti.activate")
    if node.kind not in ("pointer", "bitmasked", "dynamic"):
        return  # a dense cell is always active
    if bld.adjoint:
        return
    _activate_level(node, idx)


def deactivate(node, indices) -> None:
    """``ti.deactivate(snode, I)``: deactivate a cell of a pointer/bitmasked SNode, or clear a
    dynamic list (``I`` is then the list's index, without the position). The cell's data and
    the activity below it are zeroed (Taichi recycles and zero-fills its memory)."""
    bld = _kernel_only("deactivate")
    node = _node(node, "ti.deactivate")
    if node.kind not in ("pointer", "bitmasked", "dynamic"):
        raise bld.error(f"ti.deactivate: {node!r} is not a pointer, bitmasked or dynamic "
                        "SNode")
    if bld.adjoint:
        raise bld.error(f"cannot differentiate ti.deactivate of {node!r}: the gradient of "
                        "a kernel that deactivates cells is not defined (Taichi's neither); "
                        "deactivate in a kernel outside the Tape", GradientRuleError)
    ops = _ops()
    # The box to clear: the cell, or for a list the parent's cell (all positions).
    box = node.parent() if node.kind == "dynamic" else node
    cell = _indices(node, indices, len(box.shape), "ti.deactivate")
    # The cell's own activity first: in debug mode its bounds check is the one that names
    # the user's index and the SNode's shape (the zeroing below indexes scaled data fields).
    _element(node.activity, cell).store(ops.const(0, node.activity.dtype))
    # zero the data of every field in the cell, and the activity of the sparse levels below
    targets = [(f, f.primal._container) for f in node.subtree_fields()]
    targets += [(m.activity, m if m.kind != "dynamic" else m.parent())
                for m in node._subtree() if m is not node and m.activity is not None]
    for f, n in targets:
        _zero_box(bld, f, n, box, cell)


def _zero_box(bld, f: Field, n: SNode, box: SNode, cell: list) -> None:
    """Store 0 in every element of ``f`` (indexed like node ``n``) inside ``box[cell]``."""
    ops = _ops()
    bmap = n.index_map(box)
    amap = dict(bmap)
    pos = {q: k for k, (q, _) in enumerate(bmap)}
    buf = f.buffer()

    def nest(q: int, idx: list) -> None:
        if q == len(f.shape):
            zero = ops.const(0, f.dtype)
            assign(kernel_element(buf, tuple(idx)), zero)
            return
        if q in pos:
            d = amap[q]
            begin = ops.binary("mul", cell[pos[q]], d) if d != 1 else cell[pos[q]]
            extent = d
        else:
            begin, extent = 0, f.shape[q]
        if extent == 1:
            nest(q + 1, idx + [ops.to_expr(begin, T.i32)])
            return
        loop_id = next(bld.loop_ids)
        with bld.block() as body:
            bld.loop_stack.append(("range", loop_id))
            k = Expr(bld.emit("loop_index", T.i32, (), loop_id))
            nest(q + 1, idx + [ops.binary("add", begin, k)])
            bld.loop_stack.pop()
        bld.emit("range_for", None, (ops.const(0, T.i32).stmt, ops.const(extent, T.i32).stmt),
                 (loop_id, "inner"), (body,))

    nest(0, [])


def _list_field(node: SNode, what: str) -> Field:
    bld = _b.require()
    if node.kind != "dynamic":
        raise bld.error(f"{what}: {node!r} is not a dynamic SNode")
    if len(node.fields) != 1:
        raise bld.error(f"{what}: the dynamic SNode holds {len(node.fields)} fields; appending "
                        "needs exactly one (place one field, or a vector field, per list; a "
                        "struct field's list appends with x.append(struct))")
    return node.fields[0]


def _entries(target, value) -> list[tuple[Field, object]]:
    """(field, its value): ``target`` a field, or each member field of a struct field with
    the value's member of that name."""
    if not isinstance(target, _field.StructField):
        return [(target, value)]
    out = []
    for k, f in target.field_dict.items():
        out += _entries(f, value[k] if isinstance(value, dict) else getattr(value, k))
    return out


def append(node, indices, value):
    """``ti.append(snode, I, v)``: append ``v`` to the list ``snode[I]``; returns the position
    it took (the old length). Appending to a full list raises KernelAssertionError."""
    _kernel_only("append")
    node = _node(node, "ti.append")
    x = _list_field(node, "ti.append")
    return _append(node, indices, [(x, value)], x._label())


def _append(node: SNode, indices, entries: list[tuple[Field, object]], label: str):
    """Append one element to the list ``node[indices]``: each (field, value) of ``entries``
    stored at the position the list's counter gives (one position for all of them)."""
    bld = _kernel_only("append")
    if bld.adjoint:
        raise bld.error(f"cannot differentiate ti.append to {label}: the position comes "
                        "from an atomic counter; append in a kernel outside the Tape",
                        GradientRuleError)
    ops = _ops()
    par = _indices(node, indices, len(node.parent().shape), "ti.append")
    k = _element(node.activity, par).atomic("add", ops.const(1, T.i32))
    with bld.block() as then:
        # the cells above the list are activated as by a write; the list's length already is
        idx = par + [k]
        for lvl, imap in node.activity_terms():
            if lvl is not node:
                _activate_level(lvl, level_index(idx, imap))
        for x, value in entries:
            assign(kernel_element(x.buffer(), tuple(_x_index(x, node, par, k))),
                   _coerce(value))
    fits = ops.binary("lt", k, node.sizes[0])
    # Storage is dense: a list cannot grow past its declared size (Taichi's can); say so
    # rather than drop the value.
    bld.emit("assert", None, (fits.stmt,),
             (f"ti.append: the list of {label} is full (dynamic SNode of size "
              f"{node.sizes[0]}); declare a larger size"
              + (bld.loc.where(bld.kernel_name) if bld.loc else ""),))
    bld.emit("if", None, (fits.stmt,), None, (then, []))
    return k


def _x_index(x: Field, node: SNode, par: list, j) -> list:
    """The field index of position ``j`` of list ``node[par]`` (the dynamic axis is the
    field's last used axis; the list's parent index gives the others)."""
    axis = node.axes[0].index
    mine = node._axis_numbers()
    out, k = [], 0
    for a in mine:
        if a == axis:
            out.append(j)
        else:
            out.append(par[k])
            k += 1
    return out


def length(node, indices):
    """``ti.length(snode, I)``: the length of the list ``snode[I]``."""
    _kernel_only("length")
    node = _node(node, "ti.length")
    if node.kind != "dynamic":
        raise _b.require().error(f"ti.length: {node!r} is not a dynamic SNode")
    par = _indices(node, indices, len(node.parent().shape), "ti.length")
    return _element(node.activity, par).expr()


class DynamicRow:
    """``x[i]`` of a field in a dynamic SNode, one index short: the list, with ``append``,
    ``length`` and ``deactivate`` as in Taichi. ``x`` may be a struct field placed in the
    list (its members share the positions)."""

    def __init__(self, field, par: list) -> None:
        self.field = field
        self.par = par
        self.node = _list_node(field)

    def append(self, value):
        if isinstance(self.field, Field):
            return append(self.node, self.par, value)
        return _append(self.node, self.par, _entries(self.field, value), self.field.name)

    def length(self):
        return length(self.node, self.par)

    def deactivate(self) -> None:
        deactivate(self.node, self.par)


def _list_node(x) -> SNode | None:
    """The dynamic SNode a field, or every member of a struct field, is placed in (else
    None)."""
    if isinstance(x, Field):
        return x._dynamic()
    nodes = {f._dynamic() for f in x.leaf_fields()}
    return nodes.pop() if len(nodes) == 1 else None


def dynamic_row(field, key) -> DynamicRow | None:
    """``x[I]`` with one index fewer than the field has: the list (None otherwise)."""
    if key is None:
        key = ()
    elif isinstance(key, Matrix):
        key = tuple(key.entries)
    elif not isinstance(key, tuple):
        key = (key,)
    if len(key) != len(field.shape) - 1:
        return None
    return DynamicRow(field, list(key))


def dynamic_op(field, op: str, par: tuple, *args):
    """``x.append(v)`` / ``x.length()`` / ``x.deactivate()`` of a field (or a struct field)
    in a 1-D list."""
    if _list_node(field) is None:
        label = field._label() if isinstance(field, Field) else field.name
        raise DifftapeError(f"{label}.{op}(): the field is not in a dynamic SNode")
    _kernel_only(op)
    row = DynamicRow(field, list(par))
    return getattr(row, op)(*args)


def rescale_index(a, b, index):
    """``ti.rescale_index(a, b, I)``: the index of ``b`` (a field or SNode) holding element
    ``I`` of ``a``, from the two shapes (as Taichi computes it)."""
    entries = list(index.entries if isinstance(index, Matrix) else index)
    out = list(entries)
    for k in range(min(len(entries), len(a.shape), len(b.shape))):
        if a.shape[k] > b.shape[k]:
            out[k] = entries[k] // (a.shape[k] // b.shape[k])
        elif a.shape[k] < b.shape[k]:
            out[k] = entries[k] * (b.shape[k] // a.shape[k])
    return Vector(out)


def deactivate_all_snodes() -> None:
    """``ti.deactivate_all_snodes()``: deactivate every sparse SNode of the program."""
    root.deactivate_all()


def no_activate(*_fields) -> None:
    """``ti.no_activate(x)``: Taichi's promise that the kernel's writes to ``x`` hit active
    cells (a hint to skip activation). Activation of an active cell changes nothing, so the
    hint needs no action here."""
    _kernel_only("no_activate")


__all__ = ["DynamicRow", "activate", "active_condition", "active_mask", "append",
           "deactivate", "deactivate_all_snodes", "dynamic_op", "dynamic_row", "emit_activate",
           "finish_struct_fors", "is_active", "length", "no_activate", "rescale_index",
           "sparse_levels", "struct_for_guard"]


_field.bind(active_condition=active_condition, active_mask=active_mask, dynamic_op=dynamic_op,
            dynamic_row=dynamic_row, emit_activate=emit_activate)
