"""IR <-> plain JSON-able data: the compile-cache key and the wire format of the service.

Statements are numbered in program order and operands refer to numbers, so the encoding is
deterministic (same kernel, same bytes) and needs no pickle. ``decode`` rebuilds the objects.

Statement locations (:class:`~.nodes.Loc`: file, line, the line's text) travel beside the
statements, so that a kernel compiled elsewhere (the service) reports its errors at the same
line, quoting the same text, without reading any file. They are stored once per kernel::

    "locations": {"files": [path, ...],
                  "lines": [[file index, line, text], ...],
                  "runs": [line index, count, line index, count, ...]}

``runs`` assigns line entries to the statements in their numbering order, run-length encoded
(-1: no location); consecutive statements mostly come from one line, so a kernel pays a few
bytes per source line, not per statement. The key is absent when no statement has a location.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from .. import types as T
from .nodes import Block, Buffer, KernelIR, Loc, Param, Stmt, Task


def _enc_attr(a):
    if isinstance(a, tuple):
        return {"t": [_enc_attr(x) for x in a]}
    return a


def _dec_attr(a):
    if isinstance(a, dict) and "t" in a:
        return tuple(_dec_attr(x) for x in a["t"])
    return a


class _Encoder:
    def __init__(self, locations: bool) -> None:
        self.ids: dict[Stmt, int] = {}
        self.locations_wanted = locations
        self.files: dict[str, int] = {}
        self.lines: dict[Loc, int] = {}
        self.runs: list[int] = []  # line index, count, ...

    def locate(self, loc: Loc | None) -> None:
        k = -1
        if loc is not None:
            k = self.lines.get(loc, -1)
            if k < 0:
                k = self.lines[loc] = len(self.lines)
                self.files.setdefault(loc.file, len(self.files))
        runs = self.runs
        if runs and runs[-2] == k:
            runs[-1] += 1
        else:
            runs += (k, 1)

    def locations(self) -> dict | None:
        if not self.lines:
            return None
        return {"files": list(self.files),
                "lines": [[self.files[loc.file], loc.line, loc.text] for loc in self.lines],
                "runs": self.runs}

    def block(self, block: Block) -> list:
        out = []
        for s in block:
            self.ids[s] = len(self.ids)
            if self.locations_wanted:
                self.locate(s.loc)
            out.append([s.op, s.dtype.name if s.dtype else None,
                        [self.ids[a] for a in s.args], _enc_attr(s.attr),
                        [self.block(b) for b in s.blocks]])
        return out

    def ref(self, s: Stmt | None):
        return None if s is None else self.ids[s]


def _enc_buffer(b: Buffer) -> list:
    """``[key, dtype, shape, name, element_ndim]``, then a field's ``offset`` when it has
    one: the bounds checks (compiled where the IR goes: a server, a loaded graph) report the
    user's index with it. Buffers without one keep their five entries (and their kernels
    their fingerprints)."""
    out = [_enc_attr(b.key), b.dtype.name, list(b.shape), b.name, b.element_ndim]
    if any(b.offset):
        out.append(list(b.offset))
    return out


def encode(ir: KernelIR, locations: bool = True) -> dict:
    """The kernel as JSON-able data; ``locations``: with the statements' source locations
    (without them, what selects the compiled code: they only feed messages, which are
    attributes of the statements that report them by then)."""
    enc = _Encoder(locations)
    data = {
        "name": ir.name,
        "params": [[p.name, p.dtype.name] for p in ir.params],
        "buffers": [_enc_buffer(b) for b in ir.buffers],
        "returns": [t.name for t in ir.returns],
        "debug": ir.debug,
    }
    if ir.deterministic:  # only then: the service's wire format has no such key
        data["deterministic"] = True
    if not ir.fast_math:  # only then (the service's wire format has it, optional)
        data["fast_math"] = False
    if ir.overflow_checks:  # debug=True's overflow reports (the service's wire format has it)
        data["overflow_checks"] = True
    if ir.tasks is None:
        data["body"] = enc.block(ir.body)
    else:
        tasks = []
        for t in ir.tasks:
            tasks.append({"kind": t.kind, "loop_id": t.loop_id, "bounds": enc.block(t.bounds),
                          "begin": enc.ref(t.begin), "end": enc.ref(t.end),
                          "prologue": enc.block(t.prologue), "body": enc.block(t.body),
                          "epilogue": enc.block(t.epilogue), "weight": t.weight,
                          "schedule": t.schedule})
        data["tasks"] = tasks
        data["num_temps"] = ir.num_temps
    locs = enc.locations()
    if locs is not None:
        data["locations"] = locs
    return data


class _Decoder:
    def __init__(self) -> None:
        self.stmts: list[Stmt] = []

    def locate(self, data: dict) -> None:
        """Give the statements their locations (``encode``'s ``locations``)."""
        files = data["files"]
        lines = [Loc(files[f], n, text) for f, n, text in data["lines"]]
        runs = data["runs"]
        at = 0
        for j in range(0, len(runs), 2):
            k, count = runs[j], runs[j + 1]
            if k >= 0:
                loc = lines[k]
                for s in self.stmts[at:at + count]:
                    s.loc = loc
            at += count

    def block(self, data: list) -> Block:
        out = []
        for op, dtype, args, attr, blocks in data:
            # Operands precede uses, except that nested blocks are decoded after their owner
            # is numbered; number the owner first, then decode its blocks.
            s = Stmt(op, T.by_name(dtype) if dtype else None,
                     tuple(self.stmts[a] for a in args), _dec_attr(attr))
            self.stmts.append(s)
            s.blocks = tuple(self.block(b) for b in blocks)
            out.append(s)
        return out


def decode(data: dict) -> KernelIR:
    dec = _Decoder()
    ir = KernelIR(
        name=data["name"],
        params=[Param(n, T.by_name(t)) for n, t in data["params"]],
        buffers=[Buffer(_dec_attr(b[0]), T.by_name(b[1]), tuple(b[2]), b[3], b[4],
                        tuple(b[5]) if len(b) > 5 else ())
                 for b in data["buffers"]],
        body=[], returns=[T.by_name(t) for t in data["returns"]], debug=data["debug"],
        deterministic=data.get("deterministic", False), fast_math=data.get("fast_math", True),
        overflow_checks=data.get("overflow_checks", False))
    if "body" in data:
        ir.body = dec.block(data["body"])
    else:
        ir.tasks = []
        for t in data["tasks"]:
            bounds = dec.block(t["bounds"])
            begin = dec.stmts[t["begin"]] if t["begin"] is not None else None
            end = dec.stmts[t["end"]] if t["end"] is not None else None
            task = Task(t["kind"], [], t["loop_id"], bounds, begin, end,
                        weight=t["weight"], schedule=t.get("schedule", "any"))
            task.prologue = dec.block(t["prologue"])
            task.body = dec.block(t["body"])
            task.epilogue = dec.block(t["epilogue"])
            ir.tasks.append(task)
        ir.num_temps = data["num_temps"]
    if "locations" in data:
        dec.locate(data["locations"])
    return ir


def fingerprint(ir: KernelIR, *extra: str, locations: bool = True) -> str:
    """A stable hash of the IR plus whatever else selects the compiled code; ``locations``:
    the statements' source locations count (a kernel's identity on the service, whose
    messages quote them), or not (the compile cache: the code does not depend on them)."""
    h = hashlib.sha256(json.dumps(encode(ir, locations), sort_keys=True,
                                  separators=(",", ":")).encode())
    quant = [repr(b.quant) for b in ir.buffers if b.quant is not None]
    if quant:  # the bit layout of quantized fields selects the code (not in the wire format)
        h.update(b"\0" + "|".join(quant).encode())
    for e in extra:
        h.update(b"\0" + e.encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# numbers in JSON results and ops

def jsonable(value: Any) -> Any:
    """A result value as JSON: non-finite floats become the strings "NaN" ("-NaN" with the
    sign bit set), "Infinity" and "-Infinity" (strict JSON has no spelling for them; the
    client turns them back)."""
    if isinstance(value, float) and not math.isfinite(value):
        if value != value:  # keep the sign bit: x86 makes 0/0 a negative NaN
            return "-NaN" if math.copysign(1.0, value) < 0 else "NaN"
        return "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


def from_jsonable(value: Any) -> Any:
    """Inverse of :func:`jsonable` (used for values sent *to* the engine as well)."""
    if isinstance(value, str) and value in ("NaN", "-NaN", "Infinity", "-Infinity"):
        return float(value.replace("Infinity", "inf"))
    if isinstance(value, list):
        return [from_jsonable(v) for v in value]
    return value
