"""Decoding kernel IR sent by an untrusted client (the service's ``register`` op).

A client sends ``serialize.encode`` of its *frontend* IR: the kernel as the frontend built it,
before the pass pipeline. ``serialize.decode`` trusts its input (it indexes, unpacks and
recurses blindly); the service cannot, because whatever it accepts is compiled to native code and
run in the worker. A malformed kernel must come back as one precise error, never as a KeyError
from deep inside a pass, a RecursionError, an LLVM parse error, a hung worker or code that reads
memory it should not.

:func:`decode_untrusted` works in three layers:

1. *JSON shape*, checked while building objects: top-level keys and value types, names, dtype
   names, the buffer table (field keys, shapes, an element cap), parameters, returns, and every
   statement's form. Sizes are bounded before anything is allocated or walked (statement count,
   nesting depth, table sizes, string lengths), and nesting is bounded before recursing, so
   Python's recursion limit is never reached here or in the passes downstream.
2. *Client policy*, things the frontend never emits and the compiler must not be asked to
   handle: the compiler-internal ops (the reverse-mode stack, temps), attributes on ops that
   take none, constants that do not fit their type, ``parallel`` loops below the top level,
   ``break`` out of a parallel loop, ``return`` below the top level, reused loop ids, vector or
   matrix component indices that are not constants in range (the bounds checks cover array
   axes only). Also what would take the worker process down or stall it although the frontend
   can emit it: constant shifts LLVM folds to poison. (The passes are linear in the shapes
   that once made them superlinear: long or doubling top-level expressions, chains of dead
   locals; tests/core/test_ir_validate.py compiles those.)
3. *Semantics*, by the IR verifier (:mod:`.verify`), which the compiler also runs between its
   passes: scoping (operands defined earlier in the same or an enclosing block), values versus
   statements without one, attribute ranges (buffer, parameter and return slots, atomic kinds,
   enclosing loop ids) and the type rules the lowering relies on. One verifier for both keeps
   the rules from drifting apart; its messages name statements by their path in the JSON here.

Statement locations (``serialize``'s ``locations``: file names, lines and their text) are data
that only messages quote, never compiled or used to open a file; they are checked for types,
sizes and indices like the rest, and must cover exactly the statements sent.

Errors are :class:`~difftape.errors.IRValidationError` with a path into the JSON, e.g.
``body[3].blocks[0][2]: op 'load' takes 1 index per buffer axis ('x' has 1), got 2``.
"""

from __future__ import annotations

import math
import re
import struct

import numpy as np

from .. import types as T
from ..errors import IRValidationError
from .assertfmt import MAX_VALUES, check_template
from .nodes import CONTROL, MAX_SOURCE_TEXT, OPS, Buffer, KernelIR, Loc, Param, Stmt
from .verify import LOOP_FLAGS, IRVerificationError, verify

# Ops the compiler creates for itself (after the frontend); a client never has a reason to send
# them, and the passes assume they only appear where the compiler put them.
INTERNAL_OPS = frozenset({"stack_push", "stack_pop", "temp_load", "temp_store", "temp_atomic",
                          "add_overflows", "sub_overflows", "mul_overflows", "shl_overflows"})
# Ops that carry an attribute in frontend IR; every other op has none (``null``). (Binary ops
# get a "reassoc" marker from the reduction pass only.)
ATTR_OPS = frozenset({"const", "arg", "buf_shape", "loop_index", "load", "store", "atomic",
                      "local_atomic", "assert", "return", "range_for", "print"})
TOP_LEVEL_KEYS = ("name", "params", "buffers", "returns", "debug", "body")
OPTIONAL_KEYS = ("locations", "overflow_checks", "fast_math")
LOCATION_KEYS = ("files", "lines", "runs")
MAX_FILES = 256  # distinct source files of one kernel's statements (its funcs' included)
MAX_PATH = 4096  # a file name's characters
MAX_LINE = (1 << 31) - 1
ROLES = ("primal", "grad", "dual", "mark")  # mark: Tape(validation=True) instrumentation

# The kernel name becomes an LLVM symbol (``@<name>_task0``) written into the module text: only
# characters that need no quoting, so a name can never inject IR. Parameters are named after
# the kernel's arguments, ``v[k]`` for component k of a vector argument.
_KERNEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PARAM_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*){0,8})"
                         r"(?:\[(0|[1-9][0-9]{0,3})\])?\Z")
MAX_NAME = 128  # kernel, parameter and buffer names
MAX_MESSAGE = 1024  # assert messages
MAX_NDIM = 12  # buffer axes, element axes included
MAX_ELEMENT_NDIM = 2  # vectors and matrices
MAX_RETURNS = 64
MAX_OPERANDS = MAX_NDIM + 1  # load/store/atomic: one index per axis and a value
MAX_PRINT_OPERANDS = 1024  # the values one print() shows (a 32x32 matrix)
MAX_ID = (1 << 63) - 1  # field ids, argument indices and loop ids live in int64 slots
MAX_EXTENT = (1 << 31) - 1  # indices are i32
# Nesting above this could exhaust Python's recursion limit in the (recursive) passes and the
# lowering, whatever a caller asks for.
DEPTH_CEILING = 200
# Guards for costs in the passes that grow faster than the kernel (see decode_untrusted):
MAX_MESSAGES = 1024  # distinct assert messages (collected with a linear search per assert)


_TYPE_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
               int: "an integer", float: "a number", type(None): "null"}


def _typename(x: object) -> str:
    return _TYPE_NAMES.get(type(x), type(x).__name__)


def _short(x: object) -> str:
    """A value for a message: scalars shown (briefly), containers named. Never ``repr`` of a
    client's container: a deeply nested one would overflow the stack, a huge one take long."""
    if x is None or type(x) in (bool, float):
        return repr(x)
    if type(x) is int:
        return repr(x) if -(10**20) < x < 10**20 else "a huge integer"
    if type(x) is str:
        return repr(x[:40]) + ("..." if len(x) > 40 else "")
    if type(x) is tuple:
        return "(" + ", ".join(_short(e) for e in x[:4]) + ")"
    return _typename(x)


def _is_int(x: object) -> bool:
    return type(x) is int  # JSON integers only: not bool, not float


class _Decoder:
    def __init__(self, *, max_stmts: int, max_depth: int, max_buffers: int, max_params: int,
                 max_elements: int, allow_ndarray: bool, allow_nonfinite: bool,
                 allow_f16: bool) -> None:
        self.max_stmts = max_stmts
        self.max_depth = max_depth
        self.max_buffers = max_buffers
        self.max_params = max_params
        self.max_elements = max_elements
        self.allow_ndarray = allow_ndarray
        self.allow_nonfinite = allow_nonfinite
        self.allow_f16 = allow_f16
        self.stmts: list[Stmt] = []  # in encoding order: operand k is stmts[k]
        self.paths: dict[Stmt, str] = {}
        self.loop_ids: set[int] = set()
        self.ir: KernelIR | None = None
        self.messages: set[tuple[str, ...]] = set()
        self.count = 0  # statements decoded so far

    @staticmethod
    def fail(path: str, reason: str) -> IRValidationError:
        return IRValidationError(f"{path}: {reason}", path=path)

    def expect(self, x: object, kind: type, path: str, what: str):
        if type(x) is not kind:
            raise self.fail(path, f"{what} must be {_TYPE_NAMES[kind]}, got {_typename(x)}")
        return x

    def string(self, x: object, path: str, what: str, limit: int = MAX_NAME) -> str:
        self.expect(x, str, path, what)
        if not x or len(x) > limit:
            raise self.fail(path, f"{what} must be 1 to {limit} characters, got {len(x)}")
        if not x.isprintable():
            raise self.fail(path, f"{what} {x[:40]!r} has unprintable characters")
        return x

    def dtype(self, x: object, path: str) -> T.DType:
        if type(x) is not str or x not in T.ALL:
            raise self.fail(path, f"unknown dtype {_short(x)}; known: {', '.join(T.ALL)}")
        if x == "f16" and not self.allow_f16:
            raise self.fail(path, "f16 is not accepted here (some f16 conversions are compiled "
                                  "to library calls the CPU JIT does not resolve)")
        return T.ALL[x]

    # -- the kernel's tables -------------------------------------------------------------------
    def kernel(self, data: object) -> KernelIR:
        if type(data) is not dict:
            raise self.fail("$", f"the IR must be a JSON object, got {_typename(data)}")
        if "tasks" in data or "num_temps" in data:
            raise self.fail("$", "offloaded IR ('tasks') is not accepted: send the frontend IR "
                                 "(serialize.encode before the pass pipeline), which has 'body'")
        missing = [k for k in TOP_LEVEL_KEYS if k not in data]
        if missing:
            raise self.fail("$", f"missing key{'s' if len(missing) > 1 else ''} "
                                 f"{', '.join(map(repr, missing))}")
        extra = [k for k in data if k not in TOP_LEVEL_KEYS + OPTIONAL_KEYS]
        if extra:
            raise self.fail("$", f"unknown key {_short(extra[0])}")
        name = self.string(data["name"], "name", "the kernel name")
        if not _KERNEL_NAME.match(name):
            raise self.fail("name", f"kernel name {name!r} must be an ASCII identifier")
        debug = self.expect(data["debug"], bool, "debug", "'debug'")
        ir = KernelIR(name, self.params(data["params"]), self.buffers(data["buffers"]), [],
                      returns=self.returns(data["returns"]), debug=debug)
        # debug=True's integer overflow reports (ir/passes/overflow.py): printed lines
        ir.overflow_checks = self.expect(data.get("overflow_checks", False), bool,
                                         "overflow_checks", "'overflow_checks'")
        # ti.init(fast_math=False): IEEE evaluation as written (codegen reads the flag)
        ir.fast_math = self.expect(data.get("fast_math", True), bool, "fast_math",
                                   "'fast_math'")
        self.ir = ir
        ir.body = self.block(data["body"], "body", 1, ())
        return ir

    def locations(self, data: object) -> None:
        """``serialize``'s location table, checked, then given to the statements (after the
        statements themselves are: a location only feeds messages)."""
        path = "locations"
        self.expect(data, dict, path, "'locations'")
        if sorted(data) != sorted(LOCATION_KEYS):
            raise self.fail(path, "'locations' has the keys " +
                            ", ".join(map(repr, LOCATION_KEYS)))
        files = self.expect(data["files"], list, path + ".files", "'files'")
        if len(files) > MAX_FILES:
            raise self.fail(path + ".files", f"{len(files)} files, at most {MAX_FILES}")
        for k, f in enumerate(files):
            self.text(f, f"{path}.files[{k}]", "a file name", 1, MAX_PATH)
        lines = self.expect(data["lines"], list, path + ".lines", "'lines'")
        if len(lines) > max(self.count, 1):
            raise self.fail(path + ".lines", f"{len(lines)} lines for {self.count} statements")
        table = []
        for k, entry in enumerate(lines):
            where = f"{path}.lines[{k}]"
            if type(entry) is not list or len(entry) != 3:
                raise self.fail(where, "a line is [file index, line, text]")
            f, n, text = entry
            if not _is_int(f) or not 0 <= f < len(files):
                raise self.fail(where + "[0]", f"file index {_short(f)} out of range")
            if not _is_int(n) or not 1 <= n <= MAX_LINE:
                raise self.fail(where + "[1]", f"line numbers are integers 1 to {MAX_LINE}, "
                                               f"got {_short(n)}")
            table.append(Loc(files[f], n, self.text(text, where + "[2]", "a line's text", 0,
                                                    MAX_SOURCE_TEXT)))
        runs = self.expect(data["runs"], list, path + ".runs", "'runs'")
        if len(runs) % 2 or len(runs) > 2 * self.count:
            raise self.fail(path + ".runs", "runs are pairs (line index, count), at most one "
                                            "per statement")
        at = 0
        for j in range(0, len(runs), 2):
            k, count = runs[j], runs[j + 1]
            if not _is_int(k) or not -1 <= k < len(table):
                raise self.fail(f"{path}.runs[{j}]", f"line index {_short(k)} out of range")
            if not _is_int(count) or not 1 <= count <= self.count - at:
                raise self.fail(f"{path}.runs[{j + 1}]", f"a run of {_short(count)} statements "
                                                         f"where {self.count - at} are left")
            if k >= 0:
                loc = table[k]
                for s in self.stmts[at:at + count]:
                    s.loc = loc
            at += count
        if at != self.count:
            raise self.fail(path + ".runs", f"runs cover {at} statements of {self.count}")

    def text(self, x: object, path: str, what: str, low: int, limit: int) -> str:
        """A location's string: bounded, no control characters but tabs."""
        self.expect(x, str, path, what)
        if not low <= len(x) <= limit:
            raise self.fail(path, f"{what} must be {low} to {limit} characters, got {len(x)}")
        if CONTROL.search(x):
            raise self.fail(path, f"{what} {x[:40]!r} has control characters")
        return x

    def params(self, data: object) -> list[Param]:
        self.expect(data, list, "params", "'params'")
        if len(data) > self.max_params:
            raise self.fail("params", f"{len(data)} parameters, at most {self.max_params}")
        out = []
        components: dict[str, int] = {}  # argument name -> components seen (-1: scalar)
        last = None
        for k, p in enumerate(data):
            path = f"params[{k}]"
            self.expect(p, list, path, "a parameter")
            if len(p) != 2:
                raise self.fail(path, f"a parameter is [name, dtype], got {len(p)} entries")
            name = self.string(p[0], path + "[0]", "a parameter name")
            m = _PARAM_NAME.match(name)
            if not m:
                raise self.fail(path + "[0]", f"parameter name {name!r} must be an ASCII "
                                              "identifier, 'name[k]' for a vector component, "
                                              "or 'name.member' for a struct member")
            # Launches map parameters back to arguments by name (frontend.kernel): a vector
            # argument's components must be consecutive and numbered from 0.
            base, comp = m.group(1), m.group(2)
            seen = components.get(base)
            if (seen is not None and (base != last or seen == -1 or comp is None)) or \
                    (comp is not None and int(comp) != (seen or 0)):
                raise self.fail(path + "[0]", f"parameter {name!r} repeats a name or is out of "
                                              "order: a vector argument's components are "
                                              "consecutive, from [0]")
            components[base] = -1 if comp is None else (seen or 0) + 1
            last = base
            out.append(Param(name, self.dtype(p[1], path + "[1]")))
        return out

    def returns(self, data: object) -> list[T.DType]:
        self.expect(data, list, "returns", "'returns'")
        if len(data) > MAX_RETURNS:
            raise self.fail("returns", f"{len(data)} return values, at most {MAX_RETURNS}")
        return [self.dtype(t, f"returns[{k}]") for k, t in enumerate(data)]

    def buffers(self, data: object) -> list[Buffer]:
        self.expect(data, list, "buffers", "'buffers'")
        if len(data) > self.max_buffers:
            raise self.fail("buffers", f"{len(data)} buffers, at most {self.max_buffers}")
        out: list[Buffer] = []
        keys: set[tuple] = set()
        for k, b in enumerate(data):
            path = f"buffers[{k}]"
            self.expect(b, list, path, "a buffer")
            if len(b) not in (5, 6):
                raise self.fail(path, "a buffer is [key, dtype, shape, name, element_ndim] "
                                      f"and a field's offset, got {len(b)} entries")
            key = self.buffer_key(b[0], path + "[0]")
            if key in keys:
                raise self.fail(path + "[0]", f"buffer key {list(key)} appears twice")
            keys.add(key)
            dtype = self.dtype(b[1], path + "[1]")
            if key[2] == "mark" and dtype != T.i8:
                raise self.fail(path + "[1]", f"a .mark buffer holds i8, not {dtype}")
            if key[2] not in ("primal", "mark") and not dtype.is_float:
                raise self.fail(path + "[1]", f"a .{key[2]} buffer holds floats, not {dtype}")
            name = self.string(b[3], path + "[3]", "a buffer name")
            endim = b[4]
            if not _is_int(endim) or not 0 <= endim <= MAX_ELEMENT_NDIM:
                raise self.fail(path + "[4]", f"element_ndim must be an integer 0 to "
                                              f"{MAX_ELEMENT_NDIM}, got {_short(endim)}")
            shape = self.shape(b[2], path + "[2]", key[0] == "ndarray", endim)
            offset = self.offset(b[5], path + "[5]", key, shape[:len(shape) - endim]) \
                if len(b) == 6 else ()
            out.append(Buffer(key, dtype, shape, name, endim, offset))
        return out

    def offset(self, x: object, path: str, key: tuple, shape: tuple) -> tuple[int, ...]:
        """A field buffer's ``offset`` (the index of its first element along each field
        axis): one integer per axis, not all zero (none is written then), the field's index
        range (end excluded) in i32 (as ``place(offset=)`` requires)."""
        if key[0] != "field":
            raise self.fail(path, "only a field's buffer has an offset")
        self.expect(x, list, path, "an offset")
        if len(x) != len(shape):
            raise self.fail(path, f"an offset has one entry per field axis ({len(shape)}), "
                                  f"got {len(x)}")
        for k, (o, n) in enumerate(zip(x, shape, strict=True)):
            if not _is_int(o) or not -MAX_EXTENT - 1 <= o <= MAX_EXTENT - n:
                raise self.fail(f"{path}[{k}]", f"offsets are integers keeping the indices "
                                                f"i32 (extent {n}), got {_short(o)}")
        if not any(x):
            raise self.fail(path, "an offset of zeros is written as none")
        return tuple(x)

    def buffer_key(self, x: object, path: str) -> tuple:
        entries = x.get("t") if type(x) is dict and len(x) == 1 else None
        if type(entries) is not list or len(entries) != 3:
            raise self.fail(path, 'a buffer key is {"t": [kind, id, role]}, got '
                                  f"{_typename(x)}")
        kind, ident, role = entries
        kinds = ("field", "ndarray") if self.allow_ndarray else ("field",)
        if kind not in kinds:
            why = (" (ndarray arguments are not accepted here: use fields)"
                   if kind == "ndarray" else "")
            raise self.fail(path, f"buffer kind {_short(kind)} is not one of "
                                  f"{', '.join(kinds)}{why}")
        low = 1 if kind == "field" else 0
        if not _is_int(ident) or not low <= ident <= MAX_ID:
            raise self.fail(path, f"{kind} id must be an integer >= {low}, got {_short(ident)}")
        if kind == "ndarray" and ident >= self.max_params:
            raise self.fail(path, f"ndarray argument index {ident} out of range")
        if role not in ROLES or (kind == "ndarray" and role == "dual"):
            raise self.fail(path, f"buffer role {_short(role)} is not one of "
                                  f"{', '.join(ROLES if kind == 'field' else ROLES[:2])}")
        return (kind, ident, role)

    def shape(self, x: object, path: str, ndarray: bool, endim: int) -> tuple:
        self.expect(x, list, path, "a buffer shape")
        if not endim <= len(x) <= MAX_NDIM:
            raise self.fail(path, f"a buffer has {endim} to {MAX_NDIM} axes "
                                  f"(element_ndim {endim}), got {len(x)}")
        total = 1
        for k, e in enumerate(x):
            # An ndarray's array axes are known only at launch (null); all else is fixed.
            if ndarray and k < len(x) - endim:
                if e is not None:
                    raise self.fail(f"{path}[{k}]", "an ndarray's array axes are null")
                continue
            if not _is_int(e) or not 1 <= e <= MAX_EXTENT:
                raise self.fail(f"{path}[{k}]", f"extents are integers 1 to {MAX_EXTENT}, "
                                                f"got {_short(e)}")
            total *= e
            if total > self.max_elements:
                raise self.fail(path, f"more than {self.max_elements} elements")
        return tuple(x)

    # -- statements ----------------------------------------------------------------------------
    def block(self, data: object, path: str, depth: int, loops: tuple[str, ...]) -> list[Stmt]:
        """Decode a block. ``loops``: the enclosing loops' kinds, innermost last."""
        self.expect(data, list, path, "a block")
        if depth > self.max_depth:
            raise self.fail(path, f"blocks nested deeper than {self.max_depth}")
        out = []
        for k, item in enumerate(data):
            out.append(self.stmt(item, f"{path}[{k}]", depth, loops))
        return out

    def stmt(self, item: object, path: str, depth: int, loops: tuple[str, ...]) -> Stmt:
        self.count += 1
        if self.count > self.max_stmts:
            raise self.fail(path, f"more than {self.max_stmts} statements")
        self.expect(item, list, path, "a statement")
        if len(item) != 5:
            raise self.fail(path, f"a statement is [op, dtype, args, attr, blocks], got "
                                  f"{len(item)} entries")
        op, dtype, args, attr, blocks = item
        info = OPS.get(op) if type(op) is str else None
        if info is None:
            raise self.fail(path, f"unknown op {_short(op)}")
        if op in INTERNAL_OPS:
            raise self.fail(path, f"op '{op}' is internal to the compiler; clients send "
                                  "frontend IR")
        t = None if dtype is None else self.dtype(dtype, path + ".dtype")
        self.expect(args, list, path + ".args", "operands")
        most = MAX_PRINT_OPERANDS if op == "print" else \
            1 + MAX_VALUES if op == "assert" else MAX_OPERANDS
        if info.nargs is not None and len(args) != info.nargs or len(args) > most:
            want = info.nargs if info.nargs is not None else f"at most {most}"
            raise self.fail(path, f"op '{op}' takes {want} operand{'' if want == 1 else 's'}, "
                                  f"got {len(args)}")
        operands = []
        for k, a in enumerate(args):
            if not _is_int(a) or not 0 <= a < len(self.stmts):
                raise self.fail(path, f"operand {k} ({_short(a)}) must be the number of an "
                                      "earlier statement")
            operands.append(self.stmts[a])
        self.expect(blocks, list, path + ".blocks", "blocks")
        if len(blocks) != info.nblocks:
            raise self.fail(path, f"op '{op}' takes {info.nblocks} block"
                                  f"{'' if info.nblocks == 1 else 's'}, got {len(blocks)}")
        # print's attribute: text around one printf conversion per operand (ir/printf.py,
        # checked by the verifier; the lowering escapes the text's own '%'); assert's: its
        # message template, text around one spec per value (ir/assertfmt.py, checked here)
        most_attr = 2 * MAX_PRINT_OPERANDS + 1 if op == "print" else \
            2 * MAX_VALUES + 1 if op == "assert" else 4
        attr = self.attr(attr, path, most_attr)
        if op == "assert" and type(attr) is str:
            attr = (attr,)  # a message without values as IR before templates wrote it
        s = Stmt(op, t, tuple(operands), attr)
        self.paths[s] = path
        self.policy(s, path, depth, loops)
        self.stmts.append(s)  # numbered before its blocks, as serialize.encode does
        inner = loops + ((s.attr[1] if op == "range_for" else "while"),) \
            if op in ("range_for", "while") else loops
        s.blocks = tuple(self.block(b, f"{path}.blocks[{k}]", depth + 1, inner)
                         for k, b in enumerate(blocks))
        return s

    def attr(self, x: object, path: str, most: int = 4):
        """Attributes are scalars or one tuple of at most ``most`` scalars (``{"t": [...]}``)."""
        if type(x) is dict:
            entries = x.get("t")
            if len(x) != 1 or type(entries) is not list or len(entries) > most:
                raise self.fail(path, 'a tuple attribute is {"t": [scalars]}')
            return tuple(self.scalar(e, path) for e in entries)
        return self.scalar(x, path)

    def scalar(self, x: object, path: str):
        if type(x) is int and not -(1 << 63) <= x < 1 << 64:
            raise self.fail(path, "integer attribute out of the 64-bit range")
        if x is None or type(x) in (int, float):
            return x
        if type(x) is str:
            if len(x) > MAX_MESSAGE:
                raise self.fail(path, f"attribute string longer than {MAX_MESSAGE} characters")
            return x
        raise self.fail(path, 'an attribute is null, a number, a string or {"t": [those]}, got '
                              f"{_typename(x)}")

    def policy(self, s: Stmt, path: str, depth: int, loops: tuple[str, ...]) -> None:
        """What the frontend never emits: refused before the verifier sees it."""
        op = s.op
        if s.attr is not None and op not in ATTR_OPS:
            raise self.fail(path, f"op '{op}' takes no attribute (null), got {_short(s.attr)}")
        if op == "const":
            self.const(s, path)
        elif op == "assert":
            # The condition, then the values the message shows: its template is data (text
            # and specs of a strict grammar, ir/assertfmt.py), formatted here when it fails.
            if not s.args:
                raise self.fail(path, "op 'assert' takes the condition and the values its "
                                      "message shows")
            why = check_template(s.attr, [v.dtype for v in s.args[1:]])
            if why:
                raise self.fail(path, why)
            self.messages.add(s.attr)
            if len(self.messages) > MAX_MESSAGES:
                raise self.fail(path, f"more than {MAX_MESSAGES} distinct assert messages")
        elif op in ("shl", "shr") and len(s.args) == 2 and s.args[1].op == "const":
            # LLVM folds a constant shift by >= the width to poison, which can then erase
            # branches (a bounds check) downstream; a run-time amount is masked by the CPU.
            n, t = s.args[1].attr, s.dtype
            if t is not None and t.is_int and _is_int(n) and not 0 <= n < t.bits:
                raise self.fail(path, f"shift by {n}: a {t} shifts by 0 to {t.bits - 1}")
        elif op == "range_for":
            a = s.attr
            if not (isinstance(a, tuple) and len(a) == 2 and _is_int(a[0]) and
                    a[1] in LOOP_FLAGS and 0 <= a[0] <= MAX_ID):
                raise self.fail(path, f"range_for takes (loop id, one of {', '.join(LOOP_FLAGS)})"
                                      f", got {_short(a)}")
            if a[0] in self.loop_ids:
                raise self.fail(path, f"loop id {a[0]} is used by another loop")
            self.loop_ids.add(a[0])
            if a[1] == "parallel" and depth > 1:
                raise self.fail(path, "only top-level loops are parallel")
        elif op in ("load", "store", "atomic"):
            self.element_indices(s, path)
            if op == "atomic" and s.dtype is not None and s.dtype.bits == 1:
                raise self.fail(path, "atomics on u1 are not supported (at least 8 bits)")
        elif op == "break" and loops and loops[-1] == "parallel":
            raise self.fail(path, "`break` out of a parallel loop is not allowed")
        elif op == "return" and depth > 1:
            raise self.fail(path, "a kernel's return is at the top level of its body")

    def element_indices(self, s: Stmt, path: str) -> None:
        """The bounds-check pass guards array axes only; the frontend indexes vector/matrix
        components with constants, and an index there is otherwise unchecked memory access."""
        slot = s.attr[0] if s.op == "atomic" and isinstance(s.attr, tuple) and s.attr else s.attr
        if not _is_int(slot) or not 0 <= slot < len(self.ir.buffers):
            return  # the verifier reports it
        buf = self.ir.buffers[slot]
        index = s.args if s.op == "load" else s.args[:-1]
        if len(index) != buf.ndim:
            return
        for axis in range(buf.ndim - buf.element_ndim, buf.ndim):
            ix = index[axis]
            if ix.op != "const" or not _is_int(ix.attr) or not 0 <= ix.attr < buf.shape[axis]:
                raise self.fail(path, f"index {axis} selects a vector/matrix component of "
                                      f"'{buf.name}': it must be a constant in "
                                      f"[0, {buf.shape[axis]})")

    def const(self, s: Stmt, path: str) -> None:
        v, t = s.attr, s.dtype
        if t is None:
            return  # the verifier reports the missing type
        if t.is_int:
            lo, hi = (-(1 << (t.bits - 1)), 1 << (t.bits - 1)) if t.is_signed else \
                (0, 1 << t.bits)
            if not _is_int(v) or not lo <= v < hi:
                raise self.fail(path, f"a {t} constant is an integer in [{lo}, {hi}), got "
                                      f"{_short(v)}")
            return
        if type(v) is not float:
            raise self.fail(path, f"a {t} constant is a number with a decimal point, got "
                                  f"{_short(v)}")
        if not math.isfinite(v):
            if not self.allow_nonfinite:
                raise self.fail(path, f"non-finite constant {v!r}")
            return
        if t.bits == 32:
            try:
                struct.pack("<f", v)
            except OverflowError:
                raise self.fail(path, f"{v!r} is out of range for f32") from None
        elif t.bits == 16:
            with np.errstate(all="ignore"):
                h = np.float16(v)
            if float(h) != v:
                raise self.fail(path, f"{v!r} is not exactly representable in f16")


def decode_untrusted(data: object, *, max_stmts: int = 200_000, max_depth: int = 64,
                     max_buffers: int = 256, max_params: int = 1024,
                     max_elements: int = 1 << 31, allow_ndarray: bool = False,
                     allow_nonfinite: bool = True, allow_f16: bool = True) -> KernelIR:
    """Check ``data`` (``serialize.encode`` of a frontend KernelIR, as parsed from JSON) and
    build the IR; raise :class:`IRValidationError` naming the offending place otherwise.

    IR that passes goes through ``passes.run_pipeline`` and ``frontend.kernel.compile_ir`` (with
    ``arg_names=argument_names(ir)``) raising nothing but ``DifftapeError`` subclasses. What is
    *not* checked here: that the buffers are fields of the caller's session with the dtype and
    shape claimed (the service checks that against its field table); that bounds checks are on
    (the caller sets ``ir.debug = True``: array indices are checked at run time, not here); and
    time: a ``while`` loop may never end and LLVM needs seconds per thousand statements, so the
    service needs its kernel and compile time limits whatever ``max_stmts`` is.

    ``allow_ndarray``: accept ndarray-argument buffers (the service has no ndarrays).
    ``allow_nonfinite``: accept inf/nan float constants (kernels use ``-inf`` as a max's start).
    ``allow_f16``: accept f16 (a storage type; its conversions are compiler-runtime calls).
    """
    if not 0 < max_depth <= DEPTH_CEILING:
        raise ValueError(f"max_depth must be 1 to {DEPTH_CEILING}")
    dec = _Decoder(max_stmts=max_stmts, max_depth=max_depth, max_buffers=max_buffers,
                   max_params=max_params, max_elements=max_elements, allow_ndarray=allow_ndarray,
                   allow_nonfinite=allow_nonfinite, allow_f16=allow_f16)
    ir = dec.kernel(data)
    try:
        verify(ir, locate=dec.paths.get)
    except IRVerificationError as e:
        raise IRValidationError(str(e), path=dec.paths.get(e.stmt)) from None
    if "locations" in data:
        dec.locations(data["locations"])
    return ir


def argument_names(ir: KernelIR) -> list[str]:
    """The kernel's argument names recovered from its parameters (``v[0]``, ``v[1]`` -> ``v``)
    and ndarray buffers (named ``#k`` for argument k, which no parameter can be called), in
    order: ``compile_ir``'s ``arg_names`` for a decoded kernel, whose Python signature the
    server never sees. Launch arguments then map one to one onto these names (a vector
    argument is one sequence). An ndarray keeps its position (its buffers name the kernel's
    argument index); the scalar names fill the other positions in order. Positions left over
    belong to arguments the IR has no trace of (``ti.template()`` ones, bound when the client
    built the IR) and are named ``~k``; they take no value."""
    bases: list[str] = []
    for p in ir.params:
        base = p.name.partition("[")[0]
        if not bases or bases[-1] != base:
            bases.append(base)
    arrays = sorted({b.key[1] for b in ir.buffers if b.key[0] == "ndarray"})
    total = max(len(bases) + len(arrays), arrays[-1] + 1 if arrays else 0)
    names = iter(bases)
    return [f"#{k}" if k in arrays else next(names, f"~{k}") for k in range(total)]
