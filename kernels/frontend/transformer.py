"""Python AST -> difftape IR.

One ``build_<Node>`` method per statement kind and one ``expr_<Node>`` per expression kind, in
the manner of Taichi's ``ASTTransformer``; each sets the builder's source location first, so any
error names the kernel, file and line. Expressions evaluate to *compile-time* Python objects
(numbers, fields, funcs, tuples) or to kernel values (``Expr``/refs/``Matrix``); only the latter
emit IR. ``ti.static`` and Python constants are resolved here, so the IR has no Python left.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import inspect
import linecache
import numbers
import operator
import textwrap
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import types as T
from ..errors import (
    CallSignatureError,
    CompileError,
    GradientRuleError,
    KernelIndexError,
    KernelNameError,
    KernelSyntaxError,
    KernelTypeError,
    compile_error_class,
)
from ..ir.nodes import OPS, Block, Buffer, Loc, Stmt
from . import builder as _b
from . import ops
from .annotations import (
    TRIPLET_HEADER,
    TRIPLET_VALUE,
    NdarrayType,
    RefType,
    SparseMatrixBuilderType,
    Template,
    _resolve_annotation,
    ndarray_mismatch,
    signature_text,
    template,
)
from .argpack import ArgPackType, bind_view
from .field import Field, SNode, assign, check_read_only, kernel_element
from .matrix import Matrix, MatrixType, Vector, _coerce
from .sparse import struct_for_guard
from .struct import (
    Struct,
    StructField,
    StructType,
    has_runtime_values,
    is_place,
    load_places,
)
from .values import Expr, GlobalRef, LocalRef, Ref, Value

# --------------------------------------------------------------------------- source handling


@dataclass
class ParsedFunction:
    """A kernel's or func's AST with line numbers of the real file."""

    tree: ast.FunctionDef
    file: str
    globals: dict
    closure: dict
    indent: int = 0  # columns the AST's offsets lack (source dedented before parsing)


_parse_cache: dict[Any, ParsedFunction] = {}


_module_asts: dict[tuple[str, int], ast.Module] = {}


def _module_ast(file: str) -> ast.Module | None:
    """The whole file's AST, parsed once per file version (cheaper than re-tokenizing
    each function's source with ``inspect.getsourcelines``)."""
    lines = linecache.getlines(file)
    if not lines:
        return None
    key = (file, hash(tuple(lines)))
    tree = _module_asts.get(key)
    if tree is None:
        try:
            tree = ast.parse("".join(lines), file)
        except SyntaxError:
            return None
        _module_asts[key] = tree
    return tree


def _find_def(tree: ast.AST, fn) -> ast.FunctionDef | None:
    first = fn.__code__.co_firstlineno
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == fn.__name__:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if start == first or node.lineno == first:
                return node
    return None


def parse_function(fn) -> ParsedFunction:
    cached = _parse_cache.get(fn)
    if cached is not None:
        return cached
    file = fn.__code__.co_filename
    tree = None
    module = _module_ast(file)
    if module is not None:
        tree = _find_def(module, fn)
    if tree is None:  # e.g. defined in a string passed to exec: fall back to inspect
        try:
            lines, start = inspect.getsourcelines(fn)
            file = inspect.getsourcefile(fn) or file
        except (OSError, TypeError) as e:
            raise CompileError(f"cannot read the source of '{fn.__name__}' ({e}); difftape "
                               "compiles kernels from their source, so define them in a "
                               "file") from None
        dedented = textwrap.dedent("".join(lines))
        indent = len(lines[0]) - len(lines[0].lstrip()) - (
            len(dedented) - len(dedented.lstrip()))
        mod = ast.parse(dedented)
        ast.increment_lineno(mod, start - 1)
        tree = next(n for n in mod.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    closure = {}
    if fn.__closure__:
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__, strict=True):
            try:
                closure[name] = cell.cell_contents
            except ValueError:
                pass
    parsed = ParsedFunction(tree, file, fn.__globals__, closure,
                            indent if module is None or tree is None else 0)
    _parse_cache[fn] = parsed
    return parsed


def source_frame(parsed: ParsedFunction, name: str, node: ast.AST) -> str:
    """One location of a compile error in Taichi's layout: ``File "f.py", line 7, in foo:``,
    then the lines of ``node`` as written (tabs as 4 spaces; a loop or ``if``: its header)
    with carets under it. (Taichi also wraps them at 80 columns, which splits a long line
    with carets between its pieces; difftape keeps each line whole.)"""
    file = parsed.file
    first = node.lineno
    end_line = getattr(node, "end_lineno", None) or first
    last = end_line
    if isinstance(node, ast.For | ast.While | ast.If | ast.With) and node.body:
        last = max(node.body[0].lineno - 1, first)
    out = [f'File "{file}", line {first}, in {name}:\n']
    for n in range(first, last + 1):
        raw = linecache.getline(file, n).rstrip("\n")
        text = raw.expandtabs(4)
        lo, hi = len(text) - len(text.lstrip()), len(text.rstrip())

        start = (len(raw[:node.col_offset + parsed.indent].expandtabs(4)) if n == first
                 else lo)
        end = (len(raw[:node.end_col_offset + parsed.indent].expandtabs(4))
               if n == end_line and node.end_col_offset else hi)
        out.append(f"{text}\n{' ' * start}{'^' * max(end - start, 0)}\n")
    return "".join(out)


# --------------------------------------------------------------------------- loop helpers


def _ndrange_int(x):
    """A bound of ``ti.ndrange``: an integer (a number, or an integer kernel value). A float
    bound is refused, as in Taichi: ``ndrange((1.1, 10.5))`` has no one meaning (truncated?
    rounded?)."""
    if isinstance(x, Ref):
        x = x.expr()
    ok = x.dtype.is_int if isinstance(x, Value) else (
        ops._is_number(x) and not isinstance(x, bool) and np.asarray(x).dtype.kind in "iu")
    if not ok:
        raise ops._err(f"Every argument of ndrange should be an integer scalar or a tuple/list "
                       f"of (int, int), got {x!r:.40}", KernelTypeError)
    return x


class NdRange:
    """``ti.ndrange(*dims)``; each dim an extent or a (begin, end) pair."""

    def __init__(self, *dims) -> None:
        self.bounds = []
        for d in dims:
            if isinstance(d, tuple | list):
                if len(d) != 2:
                    # A syntax error, as Taichi's (in Python scope too); its words
                    msg = ("Every argument of ndrange should be a scalar or a tuple/list like "
                           f"(begin, end), got {tuple(d)!r:.40}")
                    b = _b.current()
                    raise b.error(msg, KernelSyntaxError) if b is not None else \
                        KernelSyntaxError(msg)
                self.bounds.append((_ndrange_int(d[0]), _ndrange_int(d[1])))
            else:
                self.bounds.append((0, _ndrange_int(d)))

    def __iter__(self):  # Python scope: iterate like itertools.product
        import itertools

        return itertools.product(*[range(int(b), int(e)) for b, e in self.bounds])


class Grouped:
    """``ti.grouped(x)``: iterate a field/ndrange with one vector index."""

    def __init__(self, inner) -> None:
        self.inner = inner


def static(x, *xs):
    """``ti.static``: evaluate at compile time (conditions, loop ranges, values). A value only
    known when the kernel runs is refused: the branch or loop cannot be decided from it."""
    for v in (x, *xs):
        if isinstance(v, Value) or (isinstance(v, Matrix) and
                                     any(isinstance(e, Value) for e in v.entries)) or (
                isinstance(v, Struct) and has_runtime_values(v)):
            bld = _b.current()
            msg = ("ti.static() arguments must be compile-time constants (a constant, a "
                   "global, a field, a ti.template() argument); this one is only known when "
                   "the kernel runs")
            raise bld.error(msg, KernelTypeError) if bld else TypeError(msg)
    return (x, *xs) if xs else x


def static_assert(cond, msg: str | None = None) -> None:
    """``ti.static_assert``: check a compile-time condition while the kernel is compiled (no
    runtime cost); a false one is a CompileError naming the line (in Python scope, an
    AssertionError)."""
    bld = _b.current()
    if isinstance(cond, Value | Matrix):
        text = ("Static assert with non-static condition: ti.static_assert needs a "
                "compile-time condition; this one is a runtime value (a kernel variable is "
                "one, even if assigned a constant); use `assert`, checked with "
                "ti.init(debug=True)")
        raise bld.error(text, KernelTypeError) if bld else TypeError(text)
    if not cond:
        text = "static assertion failed" + (f": {msg}" if msg is not None else "")
        raise bld.error(text) if bld else AssertionError(text)


def _printing():
    """``printing.py``: print(), f-strings and ``str.format`` of kernel values, and assert
    messages showing them."""
    # Function-level: print()/f-strings/assert messages load printing.py (~4 ms) on use.
    from . import printing

    return printing


def static_print(*args, **kwargs) -> None:
    """``ti.static_print``: Python's print, run once while the kernel is compiled."""
    print(*args, **kwargs)


def loop_config(*, serialize: bool = False, block_dim: int | None = None,
                parallelize: int | None = None, **_: object) -> None:
    """``ti.loop_config``: settings for the next for loop (``serialize=True`` runs it in order
    on one thread)."""
    b = _b.current()
    if b is not None:
        b.pending_loop_config = {"serialize": bool(serialize) or parallelize == 1}


_BINOPS = {
    ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.FloorDiv: "floordiv",
    ast.Mod: "mod", ast.Pow: "pow", ast.BitAnd: "bit_and", ast.BitOr: "bit_or",
    ast.BitXor: "bit_xor", ast.LShift: "shl", ast.RShift: "shr", ast.MatMult: "matmul",
}
#: Augmented assignments that are atomic on field elements and kernel-level variables
#: updated in parallel loops, as in Taichi (``*=``, ``/=``, ... are plain read-modify-writes).
_ATOMIC_AUGASSIGN = frozenset(("add", "sub", "bit_and", "bit_or", "bit_xor"))
#: Python's operators, for arithmetic on compile-time NumPy arrays in kernels.
_PY_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
    ast.BitXor: operator.xor, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
    ast.MatMult: operator.matmul,
}


def _compile_time_array(a, b) -> bool:
    """Is this a binary op of compile-time operands, one of them a NumPy array (not 0-d)? It
    is evaluated as Python evaluates it, at compile time (as in Taichi)."""
    if any(isinstance(x, Value | Matrix | Struct | Ref) for x in (a, b)):
        return False
    return any(isinstance(x, np.ndarray) and x.ndim > 0 for x in (a, b))


_PY_COMPARE = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
               ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
               ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}
_CMPOPS = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq",
           ast.NotEq: "ne"}


def apply_binop(op: str, a, b):
    if op == "pow":
        return ops.pow(a, b)
    if op == "matmul":
        return a @ b
    if isinstance(a, Matrix) or isinstance(b, Matrix):
        a, b = _coerce(a), _coerce(b)
    if op == "add" and isinstance(a, tuple) and isinstance(b, tuple):
        return a + b
    return ops.binary(op, a, b)


@dataclass
class _ReturnSlots:
    """A func's early-return state: ``flag`` (an i32 local, 1 once a ``return`` ran) and the
    locals the returned value is stored in (``None`` for a func that returns nothing)."""

    flag: LocalRef
    value: Any


# --------------------------------------------------------------------------- the transformer


class FunctionTransformer:
    """Transforms one kernel or (inlined) func body into IR through the current builder."""

    def __init__(self, bld: _b.Builder, parsed: ParsedFunction, name: str, *,
                 is_kernel: bool) -> None:
        self.bld = bld
        self.parsed = parsed
        self.name = name
        self.is_kernel = is_kernel
        self.scopes: list[dict[str, Any]] = [{}]
        self.loop_depth = 0  # runtime loops of this function around the current statement
        # Per enclosing ti.static loop: (loop_depth, runtime_depth) when its body began; and a
        # `break`/`continue` of the innermost one, which ends the unrolled iteration.
        self.static_loops: list[tuple[int, int]] = []
        self.static_jump: str | None = None
        self.static_scope = 0  # > 0 while evaluating the arguments of ti.static(...)
        # > 0 inside the body of an `if` whose condition is a Python constant but not
        # ti.static(...): Taichi compiles such an `if` as a runtime one, so the loops in it
        # are not the kernel's outermost (parallel) loops.
        self.plain_if_depth = 0
        self.loop_user_breaks: list[bool] = []  # per runtime loop: has a `break` of its own
        self.return_value: Any = None
        # The rest of the current block is unreachable: a `return` ran (at compile time).
        self.returned = False
        self.kernel_args: set[str] = set()
        # Early returns (funcs): a `return` inside runtime control flow sets a flag and leaves
        # the enclosing loops with `break`; the statements after the construct that contained
        # it run only while the flag is clear (see _settle).
        self.return_annotation: Any = None  # the func's parsed `->` annotation, or None
        self.real = False  # a @ti.real_func (its returns must be annotated)
        self.entry: tuple | None = None  # where the return slots go once they are needed
        self.slots: _ReturnSlots | None = None
        self.runtime_depth = 0  # runtime if/loop bodies of this function we are inside
        self.runtime_returns = 0  # how many returns inside runtime control flow so far
        self.pending: str | None = None  # "loop"/"branch": the last construct may have returned
        self.guards: list[Stmt] = []  # open `if not returned:` blocks (their conditions)

    # ------------------------------------------------------------------ names
    def lookup(self, name: str):
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        if name in self.parsed.closure:
            return self.parsed.closure[name]
        if name in self.parsed.globals:
            return self.parsed.globals[name]
        if hasattr(builtins, name):
            return getattr(builtins, name)
        raise self.bld.error(f'Name "{name}" is not defined', KernelNameError)

    def _find_var(self, name: str):
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def new_variable(self, value, dtype=None):
        """A fresh local holding ``value`` (scalar, or a matrix of scalars)."""
        if isinstance(value, Matrix):
            entries = [self.new_variable(e) for e in value.entries]
            return Matrix._from_entries(entries, value.n, value.m, value.ndim)
        if isinstance(value, Struct):
            return value._with({k: self.new_variable(value._get(k)) for k in value._entries})
        if isinstance(value, Value):
            e = value.expr()
            t = dtype or e.dtype
        elif isinstance(value, bool | int | float) or ops._is_number(value):
            t = dtype or ops.literal_dtype(value)
            e = value
        else:
            raise self.bld.error(f"cannot make a kernel variable from {type(value).__name__}")
        alloca = self.bld.emit("alloca", t)
        ref = LocalRef(alloca)
        ref.store(e)
        return ref

    # ------------------------------------------------------------------ statements
    def run_body(self, body: list[ast.stmt]) -> None:
        for st in body:
            if self.returned or self.static_jump:
                return  # unreachable after a `return`, as in Python (Taichi skips it too)
            self._settle()
            self.stmt(st)

    # ------------------------------------------------------------------ early returns
    def _settle(self, at_end: bool = False) -> None:
        """Before a statement (or at the end of a runtime if/loop body): if the construct just
        built may have returned, make what follows respect it. Inside a loop of this function,
        a return inside a branch already left the loop with `break`, but one inside an inner
        loop only left that loop: leave this one too. Outside loops, the rest of the enclosing
        block runs only while no return has happened (a guard block, closed with the body)."""
        kind, self.pending = self.pending, None
        if kind is None or self.slots is None:
            return
        if self.loop_depth:
            if kind == "loop":
                flag = self.slots.flag.expr()
                with self.bld.block() as brk:
                    self.bld.emit("break", None)
                self.bld.emit("if", None, (flag.stmt,), None, (brk, []))
        elif not at_end:
            ok = ops.logical_not(self.slots.flag.expr())
            self.guards.append(ok.stmt)
            self.bld.push_block()

    def _close_guards(self, depth: int) -> None:
        while len(self.guards) > depth:
            ok = self.guards.pop()
            blk = self.bld.pop_block()
            self.bld.emit("if", None, (ok,), None, (blk, []))

    @contextlib.contextmanager
    def _region(self, kind: str):
        """The body of a runtime branch or loop of this function: a `return` inside it is an
        early return. Yields a dict whose "returned" says whether every path through the body
        returned (then, for both branches of an `if`, so does the `if`)."""
        count, guards = self.runtime_returns, len(self.guards)
        self.runtime_depth += 1
        self.scopes.append({})
        info = {"returned": False}
        yield info
        self.scopes.pop()
        self._settle(at_end=True)
        self._close_guards(guards)
        self.runtime_depth -= 1
        info["returned"] = self.returned
        self.returned = False
        if self.runtime_returns != count:
            self.pending = kind

    def _return_slots(self) -> _ReturnSlots:
        """The flag and value locals of an early return, declared (once) at the start of the
        func so that they dominate every use: zero-initialised, then set by each return."""
        if self.slots is None:
            loc = self.bld.loc
            stmts: list[Stmt] = []

            def local(dt: T.DType) -> LocalRef:
                a = Stmt("alloca", dt, loc=loc)
                zero = Stmt("const", dt, (), 0.0 if dt.is_float else 0, loc=loc)
                stmts.extend([a, zero, Stmt("local_store", None, (a, zero), loc=loc)])
                return LocalRef(a)

            def places(ann):
                if isinstance(ann, tuple):
                    return tuple(places(a) for a in ann)
                if isinstance(ann, StructType):
                    return ann.from_leaves([local(dt) for _, dt in ann.leaves()])
                if isinstance(ann, MatrixType):
                    dt = ann.scalar_dtype
                    size = ann.n * (ann.m if ann.ndim == 2 else 1)
                    return Matrix._from_entries([local(dt) for _ in range(size)], ann.n,
                                                ann.m if ann.ndim == 2 else 1, ann.ndim)
                return local(ops.resolve_dtype(ann))

            flag = local(T.i32)
            value = None if self.return_annotation is None else places(self.return_annotation)
            self.bld.insert(self.entry, stmts)
            self.slots = _ReturnSlots(flag, value)
        return self.slots

    def _store_return(self, slots: _ReturnSlots, value) -> None:
        def store(place, v) -> None:
            if isinstance(place, tuple):
                for p, x in zip(place, v, strict=True):
                    store(p, x)
            elif isinstance(place, Matrix):
                for p, x in zip(place.entries, v.entries, strict=True):
                    p.store(x)
            elif isinstance(place, Struct):
                for p, x in zip(place._leaves(), v._leaves(), strict=True):
                    p.store(x)
            else:
                place.store(v)

        if slots.value is not None:
            store(slots.value, value)

    def _check_struct_return(self, value, ann: StructType) -> None:
        """A kernel or real func annotated to return a struct type returns a struct of that
        type (as Taichi requires), not one of another type converted member by member: a
        struct with other member types (an int radius for a float one) is most likely the
        wrong struct."""
        if not (isinstance(value, Struct) and value._type is ann):
            got = (f"a struct of type {value._type!r}" if isinstance(value, Struct) and
                   value._type is not None else f"a {type(value).__name__}")
            what = "kernel" if self.is_kernel else "real func"
            raise self.bld.error(
                f"Return (type={got}) cannot be converted into required type {ann!r}: "
                f"{what} '{self.name}' is annotated to return that struct type; return a "
                "value made by it (e.g. `return T(a=..., b=...)` for `-> T`)", KernelTypeError)

    def _convert_return(self, value, ann):
        """The returned value as the annotation says: cast to its dtype, shape checked."""
        value = _as_value(value)
        if (self.real or self.is_kernel) and isinstance(ann, StructType):
            self._check_struct_return(value, ann)
        if isinstance(ann, tuple):
            if not isinstance(value, tuple) or len(value) != len(ann):
                got = f"{len(value)} values" if isinstance(value, tuple) else "one value"
                raise self.bld.error(f"'{self.name}' is annotated to return {len(ann)} values "
                                     f"but returns {got}")
            return tuple(self._convert_return(v, a) for v, a in zip(value, ann, strict=True))
        if not self.real and isinstance(value, Matrix) and \
                _annotation_kind(ann, f"the return of func '{self.name}'") == "scalar":
            # Taichi's (inlined) func casts its value to a scalar annotation's dtype, a
            # vector/matrix element by element
            return ops.cast(value._values(), ops.resolve_dtype(ann))
        return _convert_to_annotation(self.bld, value, ann, f"the return value of '{self.name}'")

    def _func_return(self, value, has_value: bool) -> None:
        ann = self.return_annotation
        if has_value and ann is not None:
            value = self._convert_return(value, ann)
        elif has_value:
            if self.real:
                raise self.bld.error(
                    "A function with a return value must be annotated with a return type, e.g. "
                    f"def func() -> ti.f32: @ti.real_func '{self.name}' returns a value but "
                    "has no return annotation", KernelSyntaxError)
            value = _loaded(value)
        elif ann is not None:
            raise self.bld.error(f"func '{self.name}' is annotated to return a value; this "
                                 "`return` gives none")
        if self.runtime_depth == 0 and self.slots is None:
            self.return_value = value  # the only return that runs: no flag needed
            return
        if has_value and ann is None:
            raise self.bld.error(
                f"Return inside non-static if/for is not supported in func '{self.name}' "
                "without a return annotation: annotate its return type, e.g. `def f(...) -> "
                "ti.f32:` (as Taichi requires of funcs with such returns), so that every "
                "return gives that type")
        slots = self._return_slots()
        if has_value:
            self._store_return(slots, value)
        if self.runtime_depth:
            slots.flag.store(1)
            if self.loop_depth:
                self.bld.emit("break", None)
            self.runtime_returns += 1

    def finish_func(self):
        """After the body: close the guards and produce the func's value."""
        self._close_guards(0)
        ann = self.return_annotation
        if ann is not None and not self.returned:
            self.bld.loc = Loc.at(self.parsed.file, self.parsed.tree.lineno)
            if not any(isinstance(n, ast.Return) for n in ast.walk(self.parsed.tree)):
                raise self.bld.error(
                    f"Function has a return type but does not have a return statement: func "
                    f"'{self.name}' is annotated to return a value; add a `return` at the end "
                    "of its body")
            if self.slots is None:  # its returns are all in code that never runs
                raise self.bld.error(
                    f"func '{self.name}' is annotated to return a value but not every path "
                    "through it ends in a `return`; add a final `return`")
            # Its returns are inside runtime loops/branches (`for i in range(n): return x`):
            # whether one runs is known only at run time. Falling off the end would leave
            # the value unset (Taichi returns whatever the slot held), so check it there.
            ops.runtime_check(
                self.slots.flag.expr(),
                f"func '{self.name}' is annotated to return a value but reached the end of "
                "its body without a `return` (its returns are inside loops or branches that "
                "did not run one); add a final `return`")
        if self.slots is None or self.slots.value is None:
            return self.return_value

        def load(place):
            if isinstance(place, tuple):
                return tuple(load(p) for p in place)
            if isinstance(place, Matrix | Struct):
                return _loaded(place)
            return place.expr()

        return load(self.slots.value)

    def _at(self, node: ast.AST) -> _b.Builder:
        if hasattr(node, "lineno"):
            self.bld.loc = Loc.at(self.parsed.file, node.lineno)
        return self.bld

    def stmt(self, node: ast.stmt) -> None:
        self._at(node)
        method = getattr(self, "build_" + type(node).__name__, None)
        try:
            if method is None:
                raise self.bld.error(f'Unsupported node "{type(node).__name__}": these '
                                     "statements are not supported in difftape kernels",
                                     KernelSyntaxError)
            method(node)
        except CompileError as e:
            self._locate(e, node)
            raise
        except Exception as e:  # user Python run at compile time failed: report the line
            self._at(node)
            error = self.bld.error(f"{type(e).__name__}: {e}", compile_error_class(e))
            self._locate(error, node)
            raise error from e

    def _locate(self, error: CompileError, node: ast.AST) -> None:
        """Give ``error`` the location of ``node``, the innermost statement or expression of
        this function being built when it failed (a func's caller adds the call's)."""
        if error.frame_owner is not self and hasattr(node, "lineno"):
            error.add_frame(source_frame(self.parsed, self.name, node), self)

    def build_FunctionDef(self, node: ast.FunctionDef) -> None:
        where = "ti.kernel" if self.is_kernel else "ti.func"
        raise self.bld.error(f"Function definition is not allowed in '{where}': define "
                             f"'{node.name}' outside, as a @ti.func", KernelSyntaxError)

    build_AsyncFunctionDef = build_FunctionDef

    def build_Pass(self, node: ast.Pass) -> None:
        pass

    def build_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # docstring
        self.eval(node.value)

    def build_Assign(self, node: ast.Assign) -> None:
        if self._is_static_call(node.value):
            value = self.eval(node.value)
            for target in node.targets:
                self._static_bind(target, value)
            return
        # Python evaluates the whole right-hand side before storing anything, so `a, b = b, a`
        # swaps: the places on the right are loaded now, before any target is written.
        value = _materialize(self.eval(node.value))
        for target in node.targets:
            self.assign(target, value)

    def _is_static_call(self, node: ast.expr) -> bool:
        """Is ``node`` a call of ``ti.static(...)`` (a static assignment's right side)?"""
        return isinstance(node, ast.Call) and self.eval(node.func) is static

    def _static_bind(self, target: ast.expr, value) -> None:
        """``a = ti.static(v)``: as in Taichi, ``a`` names the compile-time value ``v`` itself
        (no kernel variable), in the current block; ``a, b = ti.static(x, y)`` binds each."""
        self._at(target)
        if isinstance(target, ast.Tuple | ast.List):
            items = value.entries if isinstance(value, Matrix) and value.ndim == 1 else value
            if not isinstance(items, list | tuple) or len(items) != len(target.elts):
                raise self.bld.error(f"cannot unpack this ti.static(...) value into "
                                     f"{len(target.elts)} names", KernelSyntaxError)
            for t, v in zip(target.elts, items, strict=True):
                self._static_bind(t, v)
            return
        if not isinstance(target, ast.Name):
            raise self.bld.error(
                "Static assign cannot be used on elements in arrays (or attributes): "
                "`x = ti.static(v)` binds a name to a compile-time value; to store into an "
                "element, assign it without ti.static", KernelSyntaxError)
        self._check_not_kernel_arg(target.id, self._find_var(target.id))
        if target.id in self.scopes[-1]:
            raise self.bld.error(
                f"Recreating variables is not allowed: '{target.id}' already exists in this "
                f"block, and `{target.id} = ti.static(...)` would make a new compile-time name "
                "(as in Taichi); use another name", KernelSyntaxError)
        self.scopes[-1][target.id] = value

    def build_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is None:
            raise self.bld.error("a declaration needs a value: `x: ti.f32 = 0.0`")
        if self._is_static_call(node.value):
            raise self.bld.error("Static assign cannot be used on annotated assignment: a "
                                 "ti.static(...) value has no kernel type; drop the annotation "
                                 "or the ti.static", KernelSyntaxError)
        ann = self.eval(node.annotation)
        value = self.eval(node.value)
        if isinstance(node.target, ast.Name) and self._find_var(node.target.id) is not None:
            self._check_not_kernel_arg(node.target.id, self._find_var(node.target.id))
            self._check_reannotation(node.target.id, ann)
        if isinstance(node.target, ast.Name) and self._find_var(node.target.id) is None:
            if isinstance(ann, MatrixType):
                value = ann(value) if not isinstance(value, Matrix) else ops.cast(
                    value, ann.scalar_dtype)
                self.scopes[-1][node.target.id] = self.new_variable(value)
            else:
                self.scopes[-1][node.target.id] = self.new_variable(value,
                                                                    ops.resolve_dtype(ann))
            return
        self.assign(node.target, value)

    def _store(self, what: str, var, value) -> None:
        """Store ``value`` into the variable (or vector/matrix/struct of places) ``var``; a
        list into a vector/matrix variable is that vector/matrix (as in Taichi)."""
        if isinstance(var, Matrix) and isinstance(value, list | tuple):
            value = _coerce(value)
        if isinstance(var, Matrix) and not isinstance(value, Matrix):
            raise self.bld.error(f"{what} is a vector/matrix; cannot assign a scalar to it")
        if isinstance(var, Struct) and isinstance(value, dict):
            value = Struct(value)
        assign(var, _as_value(value))

    def _list_variable(self, items: list) -> list:
        """A Python list bound to a kernel variable (``l = [a, x[i], 0]``): each kernel value in
        it becomes a variable of its own (a copy, as in Taichi), so ``l[k] = v`` is a store
        that runs when the statement runs (also inside a runtime ``if``); compile-time objects
        (numbers, fields ...) stay as they are. Nested lists likewise."""
        out = [self.new_variable(_materialize(e)) if isinstance(e, Value | Matrix | Struct)
               else self._list_variable(e) if type(e) is list else e for e in items]
        self.bld.list_homes[id(out)] = (out, self.bld.current_block)
        return out

    def _assign_list_entry(self, items: list, index, value) -> None:
        """``l[k] = v`` for a Python list ``l`` and a compile-time ``k``."""
        if not isinstance(index, numbers.Integral):
            raise self.bld.error("a Python list in a kernel is indexed by compile-time "
                                 f"integers, got {type(index).__name__}; for a runtime index "
                                 "use a ti.Vector", KernelIndexError)
        try:
            entry = items[index]
        except IndexError:
            raise self.bld.error(f"list index {index} out of range for a list of "
                                 f"{len(items)}", KernelIndexError) from None
        if isinstance(entry, Ref | Matrix | Struct) and is_place(entry):
            self._store(f"entry {index} of the list", entry, value)
            return
        home = self.bld.list_homes.get(id(items))
        if home is None or home[1] is not self.bld.current_block:
            # Replacing the entry is a compile-time act: inside a runtime branch or loop it
            # would hold whether or not that code runs.
            raise self.bld.error(f"entry {index} of this list is a compile-time "
                                 f"{type(entry).__name__}; it cannot be replaced inside a "
                                 "runtime if/loop (or a func called there): make the list of "
                                 "kernel values, e.g. [ti.i32(0), ...], whose entries are "
                                 "variables")
        items[index] = self.new_variable(_materialize(value)) \
            if isinstance(value, Value | Matrix | Struct) else value

    def _check_reannotation(self, name: str, ann) -> None:
        """``x: T = v`` for an existing ``x`` assigns to it; a ``T`` other than ``x``'s type
        is refused (as in Taichi) rather than ignored: the value would be converted to the
        old type, not to the one written."""
        var = self._find_var(name)
        if isinstance(ann, MatrixType):
            same = isinstance(var, Matrix) and var.shape == tuple(ann.element_shape) and all(
                isinstance(e, Ref) and e.dtype == ops.resolve_dtype(ann.scalar_dtype)
                for e in var.entries)
        else:
            same = isinstance(var, Ref) and var.dtype == ops.resolve_dtype(ann)
        if not same:
            have = var.dtype if isinstance(var, Ref) else type(var).__name__
            raise self.bld.error(f"'{name}' is already a variable (of type {have}); it cannot "
                                 f"be annotated again with another type ({ann!r}): use a new "
                                 "name, or ti.cast the value", KernelSyntaxError)

    def assign(self, target: ast.expr, value) -> None:
        self._at(target)
        if isinstance(target, ast.Name):
            var = self._find_var(target.id)
            self._check_not_kernel_arg(target.id, var)
            if isinstance(var, Ref | Matrix | Struct) and is_place(var):
                self._store(f"'{target.id}'", var, value)
                return
            if var is not None and target.id not in self.scopes[-1]:
                # A name of an enclosing block that holds a compile-time value (a number or
                # field from ti.static, a list, a func's template argument): a new binding
                # here would end with this block, so after it the name would silently hold
                # the old value again.
                raise self.bld.error(
                    f"Variable '{target.id}' cannot be assigned here: it holds a compile-time "
                    f"{type(var).__name__} bound outside this if/for block, and a new binding "
                    "would last only until the block ends (blocks scope names, as in Taichi); "
                    f"use a new name, or make '{target.id}' a kernel variable (e.g. "
                    f"`{target.id} = 0` without ti.static) before the block", KernelSyntaxError)
            if isinstance(value, np.ndarray) and value.ndim > 0:
                raise self.bld.error(
                    "Only 0-dimensional numpy array can be used to initialize a scalar "
                    f"expression: '{target.id}' would be a kernel variable, and a NumPy array "
                    f"of shape {value.shape} is not a kernel value; use its entries where "
                    "needed (a constant index gives a compile-time number), make a "
                    "ti.Vector/ti.Matrix of it, or pass it as a ti.types.ndarray() argument",
                    KernelTypeError)
            if isinstance(value, Value | Matrix | Struct) or ops._is_number(value):
                self.scopes[-1][target.id] = self.new_variable(value)
            elif type(value) is list:
                self.scopes[-1][target.id] = self._list_variable(value)
            else:
                self.scopes[-1][target.id] = value  # compile-time object
            return
        if isinstance(target, ast.Tuple | ast.List):
            items = value.entries if isinstance(value, Matrix) and value.ndim == 1 else value
            try:
                items = list(items)
            except TypeError:
                raise self.bld.error("cannot unpack this value") from None
            if len(items) != len(target.elts):
                raise self.bld.error(f"cannot unpack {len(items)} values into "
                                     f"{len(target.elts)} names")
            for t, v in zip(target.elts, items, strict=True):
                self.assign(t, v)
            return
        if isinstance(target, ast.Subscript):
            container = self.eval(target.value)
            index = self.eval_index(target.slice)
            if type(container) is list:
                self._assign_list_entry(container, index, value)
                return
            if hasattr(container, "__setitem__") and not isinstance(container, dict | list):
                container[index] = _as_value(value)
                return
            raise self.bld.error(f"cannot assign into a {type(container).__name__}")
        if isinstance(target, ast.Attribute):
            obj = self.eval(target.value)
            setattr(obj, target.attr, _as_value(value))
            return
        raise self.bld.error(f"cannot assign to {type(target).__name__}")

    def _check_not_kernel_arg(self, name: str, var) -> None:
        """Kernel arguments are values the launch passes in (as in Taichi, immutable)."""
        if name in self.kernel_args and var is self.scopes[0].get(name):
            raise self.bld.error(f'Kernel argument "{name}" is immutable in the kernel; copy '
                                 f"it into a local first, e.g. `{name}_ = {name}`",
                                 KernelSyntaxError)

    def build_AugAssign(self, node: ast.AugAssign) -> None:
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise self.bld.error("unsupported augmented assignment")
        if isinstance(node.target, ast.Name):
            self._at(node)
            self._check_not_kernel_arg(node.target.id, self._find_var(node.target.id))
        value = _as_value(self.eval(node.value))
        if isinstance(node.target, ast.Subscript):
            container = self.eval(node.target.value)
            if isinstance(container, Matrix):
                index = self.eval_index(node.target.slice)
                keys = index if isinstance(index, tuple) else (index,)
                if any(isinstance(k, Value | slice) for k in keys):
                    # A runtime index (`v[k] += x`, `m[i, j] += x`): read the entry, then a
                    # guarded write of every entry it may be (as for `v[k] = x`). A slice
                    # (`m[:2, :] += rows`): read the entries, write them back.
                    keys = tuple(k.expr() if isinstance(k, Ref) else k for k in keys)
                    index = keys if isinstance(index, tuple) else keys[0]
                    self._at(node)
                    current = _as_value(container[index])
                    container[index] = _as_value(apply_binop(op, current, value))
                    return
        target = self.eval_place(node.target)
        if isinstance(target, TripletEntry):
            target.augassign(op, value)
            return
        if isinstance(target, Matrix) and isinstance(value, list | tuple):
            value = _coerce(value)
        if not is_place(target):
            raise self.bld.error("the target of an augmented assignment must be a variable, "
                                 "a field element or a vector/matrix variable")
        if op in _ATOMIC_AUGASSIGN and (_is_global(target) or _is_reduction(target)):
            ops.atomic(op, target, value)  # Taichi semantics: += &= ... on globals are atomic
            return
        new = apply_binop(op, target._values() if isinstance(target, Matrix) else target.expr(),
                          value)
        assign(target, new)

    def eval_place(self, node: ast.expr):
        """Evaluate an assignment target without loading it."""
        if isinstance(node, ast.Name):
            var = self._find_var(node.id)
            if var is None:
                raise self.bld.error(f"'{node.id}' is used before it is assigned")
            return var
        return self.eval(node)

    def build_If(self, node: ast.If) -> None:
        cond = self.eval(node.test)
        if not isinstance(cond, Value):
            if isinstance(cond, Matrix):
                raise self.bld.error("an `if` condition must be a scalar; use .any()/.all()")
            plain = not self._is_static_call(node.test)
            self.plain_if_depth += plain
            # The body taken is a block of its own, as every body is (in Taichi too): the
            # names it makes end with it, whether or not the condition is ti.static.
            self.scopes.append({})
            try:
                self.run_body(node.body if cond else node.orelse)  # compile-time condition
            finally:
                self.scopes.pop()
                self.plain_if_depth -= plain
            return
        c = ops.to_condition(cond)
        with self.bld.block() as then_blk, self._region("branch") as then_info:
            self.run_body(node.body)
        pending, self.pending = self.pending, None
        with self.bld.block() as else_blk, self._region("branch") as else_info:
            self.run_body(node.orelse)
        self.pending = self.pending or pending
        self._at(node)
        self.bld.emit("if", None, (c.stmt,), None, (then_blk, else_blk))
        if then_info["returned"] and else_info["returned"]:
            self.returned = True  # every path returned: what follows is unreachable

    def build_While(self, node: ast.While) -> None:
        if node.orelse:
            raise self.bld.error("while/else is not supported", KernelSyntaxError)
        with self.bld.block() as body:
            test = self.eval(node.test)
            if isinstance(test, Value):
                stop = ops.logical_not(test)
                with self.bld.block() as brk:
                    self.bld.emit("break", None)
                self.bld.emit("if", None, (stop.stmt,), None, (brk, []))
            elif not test:
                return
            self.loop_depth += 1
            self.bld.loop_stack.append(("while", None))
            self.loop_user_breaks.append(False)
            count = self.runtime_returns
            with self._region("loop"):
                self.run_body(node.body)
            user_break = self.loop_user_breaks.pop()
            self.bld.loop_stack.pop()
            self.loop_depth -= 1
        self._at(node)
        self.bld.emit("while", None, (), None, (body,))
        if not isinstance(test, Value) and not user_break and self.runtime_returns != count:
            self.returned = True  # `while True` left only by a return: nothing follows

    def build_Break(self, node: ast.Break) -> None:
        self._loop_control("break")

    def build_Continue(self, node: ast.Continue) -> None:
        self._loop_control("continue")

    def _loop_control(self, what: str) -> None:
        if self.static_loops and self.static_loops[-1][0] == self.loop_depth:
            # The innermost loop is unrolled: leave it (or its iteration) while compiling.
            if self.runtime_depth > self.static_loops[-1][1]:
                raise self.bld.error(
                    f"You are trying to `{what}` a static `for` loop inside a runtime `if`: "
                    "the loop is unrolled while compiling, so it can only be left at compile "
                    "time (as in Taichi); make the condition ti.static(...), or make the loop "
                    "a runtime loop",
                    KernelSyntaxError)
            self.static_jump = what
            return
        if not self.loop_depth:
            raise self.bld.error(f"`{what}` outside a loop")
        if what == "break":
            self.loop_user_breaks[-1] = True
        if self.bld.loop_stack and self.bld.loop_stack[-1][0] == "parallel" and what == "break":
            raise self.bld.error("Cannot break in the outermost loop: its iterations run in "
                                 "parallel. Use ti.loop_config(serialize=True) before the "
                                 "loop, or an inner loop", KernelSyntaxError)
        self.bld.emit(what, None)

    def build_Return(self, node: ast.Return) -> None:
        has_value = node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None)
        if self.is_kernel and not self.bld.at_top_level:
            raise self.bld.error(
                "Return inside non-static if/for is not supported in a kernel (as in "
                "Taichi): its `return` must be at the top level of its body; compute the "
                "value into a variable and return it at the end, or move the logic into a "
                "@ti.func")
        value = self.eval(node.value) if has_value else None
        self._at(node)
        if self.is_kernel:
            self._kernel_return(value, has_value)
        else:
            self._func_return(value, has_value)
        self.returned = True

    def _kernel_return(self, value, has_value: bool) -> None:
        rt = self.bld.return_type
        if not has_value:
            if rt is not None:
                raise self.bld.error("this kernel is annotated to return a value; this "
                                     "`return` gives none")
            return
        if rt is None:
            raise self.bld.error("this kernel returns a value but has no return annotation; "
                                 "add e.g. `-> ti.f32`")
        ann = self.bld.return_annotation
        if isinstance(ann, StructType | tuple):
            value = self._convert_return(value, ann)

        def leaves(v) -> list:
            if isinstance(v, tuple):
                return [x for item in v for x in leaves(item)]
            return v._leaves() if isinstance(v, Struct) else \
                v.entries if isinstance(v, Matrix) else [v]

        values = leaves(value)
        types_ = rt if isinstance(rt, list) else [rt]
        if len(values) != len(types_):
            raise self.bld.error(f"kernel returns {len(values)} values, annotation says "
                                 f"{len(types_)}")
        for slot, (v, t) in enumerate(zip(values, types_, strict=True)):
            e = ops.to_expr(v, t)
            self.bld.emit("return", None, (e.stmt,), slot)

    def build_Assert(self, node: ast.Assert) -> None:
        cond = self.eval(node.test)
        template, values = self._assert_message(node.msg)
        if not isinstance(cond, Value):
            if cond:
                return
            # A condition known false is still checked where the kernel reaches it, as in
            # Taichi (`assert 0, "unreachable"` in a branch): refusing it at compile time
            # refused correct programs. ti.static_assert is the compile-time check.
            cond = ops.const(0, T.i32)
        if self.bld.debug:
            # The message names the kernel and the line, as a bounds check's does (Taichi's
            # gives the message alone, which leaves the user to find the assert).
            where = self.bld.loc.where(self.bld.kernel_name) if self.bld.loc else ""
            self.bld.emit("assert", None,
                          (ops.to_condition(cond).stmt, *(e.stmt for e in values)),
                          template[:-1] + (template[-1] + where,))

    def _assert_message(self, node: ast.expr | None) -> tuple[tuple[str, ...], list]:
        """An assert's message template and the kernel values it shows (ir/assertfmt.py):
        ``"..." % args`` (Taichi's printf-style messages; a string on the left, whatever the
        right), an f-string or ``str.format`` of kernel values, a plain string. Checked with
        or without ``debug=True``, as Taichi checks it."""
        if node is None:
            return ("assertion failed",), []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            left, right = self.eval(node.left), self.eval(node.right)
            if isinstance(left, str):
                self._at(node)
                printing = _printing()
                return printing.assert_message(printing.percent_items(left, right))
            msg = self._binop(node, left, right)
        else:
            msg = self.eval(node)
        if isinstance(msg, str):
            return (msg.strip(),), []
        return _printing().assert_message(msg)

    # ------------------------------------------------------------------ for loops
    def build_For(self, node: ast.For) -> None:
        if node.orelse:
            raise self.bld.error("for/else is not supported", KernelSyntaxError)
        it = node.iter
        if isinstance(it, ast.Call):
            fn = self.eval(it.func)
            if fn is static:
                self._static_for(node, self.eval(it))
                return
            if fn is builtins.range:
                args = [self.eval(a) for a in it.args]
                if len(args) == 1:
                    bounds = [(0, args[0])]
                elif len(args) == 2:
                    bounds = [(args[0], args[1])]
                else:
                    raise self.bld.error(f"Range should have 1 or 2 arguments, found "
                                         f"{len(args)}: range() with a step is not supported "
                                         "in kernels; loop over range(n) and scale the index")
                self._range_for(node, bounds, grouped=False)
                return
        iterable = self.eval(it)
        grouped = isinstance(iterable, Grouped)
        if grouped:
            iterable = iterable.inner
        bounds = self._iteration_bounds(iterable)
        guard = self._sparse_guard(iterable)
        self._range_for(node, bounds, grouped=grouped, guard=guard, iterable=iterable)
        if guard is not None:
            self.bld.struct_fors[-1]["loop"] = self.bld.body[-1]

    def _sparse_guard(self, iterable):
        """A struct-for over a field or SNode below sparse SNodes visits the active cells
        only: the body starts with a guard (see frontend/sparse.py)."""
        node = iterable.parent() if isinstance(iterable, Field) and \
            iterable.primal._container is not None else iterable
        if not isinstance(node, SNode) or not node.activity_terms():
            return None
        if not (self.bld.at_top_level and not self.bld.loop_stack):
            raise self.bld.error("a struct-for over a field or SNode under sparse SNodes must "
                                 "be at the kernel's top level, not inside another loop or "
                                 "branch (as in Taichi): it visits the cells active when it "
                                 "starts")
        return lambda indices: struct_for_guard(self, node, indices)

    def _iteration_bounds(self, iterable) -> list[tuple]:
        if isinstance(iterable, NdRange):
            return iterable.bounds
        if isinstance(iterable, Field | StructField):  # a field's indices start at its offset
            return [(o, o + s) for o, s in zip(iterable.offset, iterable.shape, strict=True)]
        if isinstance(iterable, SNode):
            return [(0, s) for s in iterable.shape]
        if isinstance(iterable, NdarrayArg):
            return [(0, s) for s in iterable.shape]
        if isinstance(iterable, range):
            return [(iterable.start, iterable.stop)]
        raise self.bld.error(f"cannot loop over a {type(iterable).__name__} in a kernel; use "
                             "range(), ti.ndrange(), a field, or ti.static(...) to unroll")

    def _static_for(self, node: ast.For, iterable) -> None:
        if isinstance(iterable, Grouped):
            iterable = [Vector(list(t)) for t in iterable.inner]
        elif isinstance(iterable, Matrix):
            iterable = iterable.entries if iterable.ndim == 1 else list(iterable)
        self.static_loops.append((self.loop_depth, self.runtime_depth))
        for item in iterable:
            if self.returned:
                break  # a return in an unrolled iteration ends the loop
            self.scopes.append({})
            self._bind_target(node.target, item)
            self.run_body(node.body)
            self.scopes.pop()
            jump, self.static_jump = self.static_jump, None
            if jump == "break":
                break
        self.static_loops.pop()

    def _bind_target(self, target: ast.expr, item) -> None:
        if isinstance(target, ast.Name):
            self.scopes[-1][target.id] = item
        elif isinstance(target, ast.Tuple | ast.List):
            items = list(item.entries if isinstance(item, Matrix) else item)
            if len(items) != len(target.elts):
                raise self.bld.error("loop target count does not match the iterated items")
            for t, v in zip(target.elts, items, strict=True):
                self._bind_target(t, v)
        else:
            raise self.bld.error("loop targets must be names")

    def _range_for(self, node: ast.For, bounds: list[tuple], *, grouped: bool,
                   guard=None, iterable=None) -> None:
        """A runtime loop over ``bounds``; ``iterable`` is what the loop iterates (an ndrange,
        a field, ...), None for ``range(...)``."""
        target = node.target
        names = [target] if isinstance(target, ast.Name) else list(getattr(target, "elts", []))
        if not all(isinstance(n, ast.Name) for n in names):
            raise self.bld.error("loop targets must be names")
        for n in names:
            if self._find_var(n.id) is not None:
                # The loop's index is a variable of the loop: the outer one would keep its old
                # value after the loop, where Python leaves the last index in it.
                raise self.bld.error(f"Variable '{n.id}' is already declared in the outer "
                                     "scope and cannot be used as loop variable: after the "
                                     "loop it would keep its old value (not the last index, "
                                     "as in Python); name the loop variable differently",
                                     KernelSyntaxError)
        if grouped:
            if len(names) != 1:
                raise self.bld.error("ti.grouped(...) binds one vector index: `for I in ...`")
        elif len(names) != len(bounds):
            ours = (f"this loop has {len(bounds)} ind{'ex' if len(bounds) == 1 else 'ices'} but "
                    f"{len(names)} loop variable{'s' if len(names) != 1 else ''}; use "
                    f"`for {', '.join('ijkl'[:len(bounds)])} in ...` or ti.grouped(...)")
            if isinstance(iterable, NdRange):  # Taichi's words, and its error classes
                raise self.bld.error(
                    "Ndrange for loop with number of the loop variables not equal to the "
                    f"dimension of the ndrange is not supported: {ours}", KernelSyntaxError)
            if iterable is not None:
                raise self.bld.error(
                    "Number of struct-for indices does not match loop variable "
                    f"dimensionality ({len(names)} != {len(bounds)}): {ours}",
                    KernelIndexError)
            raise self.bld.error(ours)
        config = getattr(self.bld, "pending_loop_config", None) or {}
        self.bld.pending_loop_config = None
        outermost = self.is_kernel and self.bld.at_top_level and self.loop_depth == 0 and \
            not self.plain_if_depth
        parallel = outermost and not config.get("serialize", False)
        self._nested_loops(node, names, bounds, 0, [], grouped=grouped,
                           parallel=parallel, serialize=config.get("serialize", False),
                           guard=guard)

    def _nested_loops(self, node, names, bounds, level, indices, *, grouped, parallel,
                      serialize, guard=None) -> None:
        if level == len(bounds):
            if guard is not None:
                guard(indices)
            if grouped:
                self.scopes[-1][names[0].id] = Matrix._from_entries(indices, len(indices), 1, 1)
            else:
                for n, ix in zip(names, indices, strict=True):
                    self.scopes[-1][n.id] = ix
            self.run_body(node.body)
            return
        begin, end = bounds[level]
        b = ops.to_expr(begin, T.i32)
        e = ops.to_expr(end, T.i32)
        loop_id = next(self.bld.loop_ids)
        kind = "parallel" if parallel and level == 0 else "range"
        with self.bld.block() as body:
            self.loop_depth += 1
            self.bld.loop_stack.append((kind, loop_id))
            self.loop_user_breaks.append(False)
            index = Expr(self.bld.emit("loop_index", T.i32, (), loop_id))
            with self._region("loop"):  # one per level: a return leaves every level
                self._nested_loops(node, names, bounds, level + 1, indices + [index],
                                   grouped=grouped, parallel=parallel, serialize=serialize,
                                   guard=guard)
            self.loop_user_breaks.pop()
            self.bld.loop_stack.pop()
            self.loop_depth -= 1
        self._at(node)
        flags = "parallel" if kind == "parallel" else ("serial" if serialize else "inner")
        self.bld.emit("range_for", None, (b.stmt, e.stmt), (loop_id, flags), (body,))

    # ------------------------------------------------------------------ expressions
    def eval(self, node: ast.expr):
        method = getattr(self, "expr_" + type(node).__name__, None)
        try:
            if method is None:
                self._at(node)
                raise self.bld.error(f'Unsupported node "{type(node).__name__}": these '
                                     "expressions are not supported in difftape kernels",
                                     KernelSyntaxError)
            return method(node)
        except CompileError as e:
            self._locate(e, node)
            raise

    def expr_Slice(self, node: ast.Slice):
        """``a:b:c`` in a subscript: compile-time bounds (the slice's shape is the value's)."""
        parts = [None if p is None else self.eval(p) for p in (node.lower, node.upper,
                                                                node.step)]
        if any(isinstance(p, Value | Matrix) for p in parts):
            raise self._at(node).error("Taichi does not support variables in slice now: the "
                                       "bounds of a slice must be compile-time constants (a "
                                       "runtime index of one entry is fine: m[i, :])",
                                       KernelIndexError)
        return slice(*parts)

    def eval_index(self, node: ast.expr):
        if isinstance(node, ast.Tuple):
            return tuple(self.eval(e) for e in node.elts)
        return self.eval(node)

    def expr_Constant(self, node: ast.Constant):
        return node.value

    def expr_Name(self, node: ast.Name):
        value = self.lookup(node.id)
        if getattr(value, "name", None) == "" and hasattr(value, "_label"):
            # Name an unnamed field after the user's variable, for messages: a global (or
            # closure) variable names it everywhere; a parameter or local one only in this
            # kernel (another kernel passes the same field as its `src`, or `vf`).
            if any(node.id in scope for scope in self.scopes):
                self.bld.field_names.setdefault(value.id, node.id)
            else:
                value.name = node.id
        return value

    def expr_NamedExpr(self, node: ast.NamedExpr):
        """``(name := value)``: binds ``name`` as ``name = value`` would, and is its value."""
        self.assign(node.target, _materialize(self.eval(node.value)))
        return self.lookup(node.target.id)

    def expr_Attribute(self, node: ast.Attribute):
        obj = self.eval(node.value)
        try:
            return getattr(obj, node.attr)
        except AttributeError:
            self._at(node)
            owner = f"module '{obj.__name__}'" if isinstance(obj, type(ast)) else \
                f"a {type(obj).__name__}"
            raise self.bld.error(f"{owner} has no attribute '{node.attr}'") from None

    def expr_Tuple(self, node: ast.Tuple):
        return tuple(self.eval(e) for e in node.elts)

    def expr_List(self, node: ast.List):
        return [self.eval(e) for e in node.elts]

    def expr_Dict(self, node: ast.Dict):
        out: dict = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if k is not None:
                out[self.eval(k)] = self.eval(v)
                continue
            merged = self.eval(v)  # {**d}: a compile-time dict merged in, as in Python
            if not isinstance(merged, dict):
                raise self._at(v).error(f"`**` in a dict display needs a dict, got a "
                                        f"{type(merged).__name__}", KernelTypeError)
            out.update(merged)
        return out

    def expr_BinOp(self, node: ast.BinOp):
        return self._binop(node, self.eval(node.left), self.eval(node.right))

    def _binop(self, node: ast.BinOp, a, b):
        """``node``'s operation on its operands' values ``a`` and ``b``."""
        self._at(node)
        if type(a) in (list, tuple) and (
                (isinstance(node.op, ast.Add) and type(b) is type(a)) or
                (isinstance(node.op, ast.Mult) and isinstance(b, int))):
            return a + b if isinstance(node.op, ast.Add) else a * b  # Python lists (Taichi too)
        if _compile_time_array(a, b):  # `n_cube - 1` of a global NumPy array: NumPy's result
            return _PY_BINOPS[type(node.op)](a, b)
        return apply_binop(_BINOPS[type(node.op)], _as_value(a), _as_value(b))

    def expr_UnaryOp(self, node: ast.UnaryOp):
        v = _as_value(self.eval(node.operand))
        if isinstance(node.op, ast.USub):
            return -v
        if isinstance(node.op, ast.UAdd):
            return v
        if isinstance(node.op, ast.Not):
            if not isinstance(v, Value | Matrix):
                return not v
            if any(e.dtype.is_float for e in (v.entries if isinstance(v, Matrix) else [v])
                   if isinstance(e, Value)):
                raise self.bld.error("`not` takes integral inputs only (as in Taichi); for a "
                                     "float x write `x == 0`", KernelTypeError)
            return ops.logical_not(v)
        if isinstance(node.op, ast.Invert):
            return ~v
        raise self.bld.error("unsupported unary operator")

    def expr_BoolOp(self, node: ast.BoolOp):
        return self._bool_op(isinstance(node.op, ast.And), node.values)

    def _bool_op(self, is_and: bool, nodes: list[ast.expr]):
        """``a and b and ...`` / ``a or b or ...`` (right-nested as Taichi builds it; the same
        value as Python's left-to-right reading).

        * A compile-time first operand decides as in Python; the rest is evaluated only when
          it does not (so ``ti.static(x is not None) and x[i] > 0`` works).
        * Runtime integer scalars give what Python and Taichi give: an operand's value (the
          promoted type), and the right side runs only when the left does not decide, so
          ``i > 0 and a[i - 1] > 0`` never reads ``a[-1]``.
        * Vectors/matrices give elementwise truth values (0/1), every operand evaluated, as in
          Taichi.
        * Float operands are refused, as Taichi refuses them.
        """
        first = _as_value(self.eval(nodes[0]))
        if len(nodes) == 1:
            return first
        self._at(nodes[0])
        if not isinstance(first, Value | Matrix):  # compile time
            if bool(first) != is_and:
                return first  # `and` after a falsy value, `or` after a truthy one: decided
            rest = _as_value(self._bool_op(is_and, nodes[1:]))
            if isinstance(rest, Matrix):
                return self._elementwise_logic(is_and, first, rest, nodes[1])
            if isinstance(rest, Value):
                self._logic_operand(rest, nodes[1])
            return rest
        self._logic_operand(first, nodes[0])
        if isinstance(first, Matrix):
            rest = _as_value(self._bool_op(is_and, nodes[1:]))
            return self._elementwise_logic(is_and, first, rest, nodes[1])
        rest, rest_blk = self._detached(lambda: self._bool_op(is_and, nodes[1:]))
        if isinstance(rest, Matrix):  # vectors do not short-circuit (Taichi)
            self.bld.splice(rest_blk)
            return self._elementwise_logic(is_and, first, rest, nodes[1])
        self._logic_operand(rest, nodes[1])
        c = ops.to_condition(first)
        if is_and:
            return self._conditional(c, rest, rest_blk, first, [])
        return self._conditional(c, first, [], rest, rest_blk)

    def _elementwise_logic(self, is_and: bool, a, b, node: ast.expr):
        self._logic_operand(a, node)
        self._logic_operand(b, node)
        return ops.binary("logical_and" if is_and else "logical_or", a, b)

    def _logic_operand(self, v, node: ast.expr) -> None:
        """Refuse what Taichi's ``and``/``or`` refuse: floats, and non-numbers beside runtime
        values."""
        for e in (v.entries if isinstance(v, Matrix) else [v]):
            if isinstance(e, Value):
                t = e.dtype
            elif ops._is_number(e):
                t = ops.literal_dtype(e)
            else:
                raise self._at(node).error(f"`and`/`or` cannot combine a {type(e).__name__} "
                                           "with runtime values")
            if t.is_float:
                raise self._at(node).error(
                    f"`and`/`or` need integer operands (as in Taichi), got {t}; compare "
                    "explicitly, e.g. `x != 0 and y > 0.5`")

    def expr_Compare(self, node: ast.Compare):
        left = self.eval(node.left)
        result = None
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = self.eval(comp)
            if type(op) in _PY_COMPARE and _constant_sequence(left) and _constant_sequence(right):
                # two compile-time lists (shapes: `a.element_shape() == [2]`): Python's ==
                r = _PY_COMPARE[type(op)](left, right)
                result = r if result is None else ops.binary("logical_and", result, r)
                left = right
                continue
            left, right = _as_value(left), _as_value(right)
            if isinstance(op, ast.Is | ast.IsNot):
                # As Taichi: identity of kernel values has no meaning (each use is a new
                # value); compare values with ==, or objects in Python before the kernel.
                name = "is" if isinstance(op, ast.Is) else "is not"
                raise self._at(node).error(f'Operator "{name}" in Taichi scope is not '
                                           "supported; compare values with == / !=",
                                           KernelSyntaxError)
            elif isinstance(op, ast.In | ast.NotIn):
                if not self.static_scope:
                    raise self._at(node).error(
                        f'"{type(op).__name__}" is only supported inside `ti.static`: '
                        "membership is decided while compiling, e.g. "
                        "`if ti.static(k in names):`", KernelSyntaxError)
                r = (left in right) == isinstance(op, ast.In)
            elif not isinstance(left, Value | Matrix) and not isinstance(right, Value | Matrix) \
                    and not (ops._is_number(left) and ops._is_number(right)):
                r = _PY_COMPARE[type(op)](left, right)  # compile-time objects (dtypes, ...)
            else:
                a, b = left, right
                if isinstance(a, Matrix) or isinstance(b, Matrix):
                    a, b = _coerce(a), _coerce(b)  # v == (1, 2, 3)
                r = ops.binary(_CMPOPS[type(op)], a, b)
            result = r if result is None else ops.binary("logical_and", result, r)
            left = right
        return result

    def expr_IfExp(self, node: ast.IfExp):
        cond = _as_value(self.eval(node.test))
        if isinstance(cond, Matrix):
            raise self._at(node).error(
                "Using conditional expression for element-wise select operation on vectors/"
                "matrices is not supported (the condition of `x if c else y` must be a "
                'scalar). Please use "ti.select" instead: ti.select(c, x, y) chooses '
                "elementwise; or reduce the condition with c.any() / c.all()",
                KernelSyntaxError)
        if not isinstance(cond, Value):
            return self.eval(node.body) if cond else self.eval(node.orelse)
        c = ops.to_condition(cond)
        then, then_blk = self._detached(lambda: self.eval(node.body))
        other, other_blk = self._detached(lambda: self.eval(node.orelse))
        self._at(node)
        return self._conditional(c, then, then_blk, other, other_blk)

    def _detached(self, evaluate) -> tuple[Any, Block]:
        """Evaluate into a block of its own, not yet placed: the caller decides whether it runs
        unconditionally (:meth:`Builder.splice`) or under a condition."""
        with self.bld.block() as blk:
            value = _as_value(evaluate())
        return value, blk

    def _conditional(self, c: Expr, a, a_blk: Block, b, b_blk: Block):
        """``a if c else b``, where ``a`` and ``b`` were computed by the detached blocks.

        Only the taken side may run, as in Python and Taichi: its loads (which may be out of
        range on the other side, and whose adjoints would be written there), func calls,
        atomics and random numbers. So the value is a temporary written by an ``if``, unless
        both blocks are pure arithmetic on values at hand: then both run and a ``select``
        picks (no branch, vectorizes; autodiff guards the zero adjoint of the other side).
        """
        for v in (a, b):
            if not (isinstance(v, Value | Matrix) or ops._is_number(v)):
                raise self.bld.error("with a runtime condition, both sides of a conditional "
                                     "must be numbers or vectors/matrices, got a "
                                     f"{type(v).__name__}")
        if _speculatable(a_blk) and _speculatable(b_blk):
            self.bld.splice(a_blk)
            self.bld.splice(b_blk)
            return ops.select(c, a, b)
        shape = a if isinstance(a, Matrix) else b if isinstance(b, Matrix) else None
        pairs = _paired_entries(a, b)
        slots = [LocalRef(self.bld.emit("alloca", T.promote(_dtype_of(x), _dtype_of(y))))
                 for x, y in pairs]
        for side, blk in enumerate((a_blk, b_blk)):
            with self.bld.block(blk):
                for slot, pair in zip(slots, pairs, strict=True):
                    slot.store(pair[side])
        self.bld.emit("if", None, (c.stmt,), None, (a_blk, b_blk))
        values = [slot.expr() for slot in slots]
        if shape is None:
            return values[0]
        return Matrix._from_entries(values, shape.n, shape.m, shape.ndim)

    def expr_Subscript(self, node: ast.Subscript):
        container = self.eval(node.value)
        index = self.eval_index(node.slice)
        if not isinstance(container, list | tuple):  # a Python sequence slices as in Python
            for sl in index if isinstance(index, tuple) else (index,):
                if isinstance(sl, slice) and any(isinstance(p, numbers.Integral) and p < 0
                                                 for p in (sl.start, sl.stop, sl.step)):
                    raise self._at(node.slice).error(
                        "Negative indices are not supported in Taichi kernels. Kernels do not "
                        "wrap indices around: write the slice with non-negative bounds, e.g. "
                        "v[:n - 1]", KernelSyntaxError)
        self._at(node)
        if isinstance(index, Ref):
            index = index.expr()
        try:
            return container[index]
        except CompileError:
            raise  # already names the kernel line
        except (TypeError, KeyError) as e:
            raise self.bld.error(f"cannot index a {type(container).__name__}: {e}") from None

    def expr_ListComp(self, node: ast.ListComp):
        """Unrolled at compile time: the iterables must be compile-time (range(3), tuples,
        the entries of a vector, the rows of a matrix)."""
        out: list = []
        self._comprehension(lambda: out.append(self.eval(node.elt)), node.generators)
        return out

    def expr_DictComp(self, node: ast.DictComp):
        """``{k: v for ...}``: unrolled at compile time as a list comprehension; the keys are
        compile-time values (as in Taichi, indexing it with a missing key is an error)."""
        out: dict = {}

        def add() -> None:
            key = self.eval(node.key)
            if isinstance(key, Value):
                raise self._at(node.key).error("dict comprehension keys in kernels must be "
                                               "compile-time values")
            out[key] = self.eval(node.value)

        self._comprehension(add, node.generators)
        return out

    def _comprehension(self, emit, generators) -> None:
        if not generators:
            emit()
            return
        gen = generators[0]
        iterable = self.eval(gen.iter)
        if isinstance(iterable, Value):
            raise self.bld.error("comprehensions in kernels iterate at compile time; the "
                                 "iterable must be a range/tuple of constants, or a vector/"
                                 "matrix (its entries/rows)")
        if isinstance(iterable, Matrix):  # as a ti.static loop: entries, or rows
            iterable = iterable.entries if iterable.ndim == 1 else list(iterable)
        for item in iterable:
            self.scopes.append({})
            self._bind_target(gen.target, item)
            if all(self._static_truth(c) for c in gen.ifs):
                self._comprehension(emit, generators[1:])
            self.scopes.pop()

    def _static_truth(self, node) -> bool:
        v = self.eval(node)
        if isinstance(v, Value):
            raise self.bld.error("comprehension conditions must be compile-time")
        return bool(v)

    def expr_JoinedStr(self, node: ast.JoinedStr):
        """An f-string: Python's text when every value is known at compile time; with kernel
        values, something only print() takes (see printing.py)."""
        values: list = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                values.append(v.value)
                continue
            spec = self.eval(v.format_spec) if v.format_spec is not None else ""
            if not isinstance(spec, str):
                raise self._at(v).error("a format spec must be known at compile time")
            conv = chr(v.conversion) if v.conversion != -1 else None
            values.append((_as_value(self.eval(v.value)), spec, conv))
        return _printing().joined(values)

    def expr_Call(self, node: ast.Call):
        fn = self.eval(node.func)
        args = []
        in_static = fn is static
        if in_static and self.static_scope:
            raise self._at(node).error("'ti.static' cannot be nested: the outer ti.static(...) "
                                       "already evaluates its whole argument at compile time; "
                                       "drop the inner one", KernelSyntaxError)
        self.static_scope += in_static
        try:
            for a in node.args:
                if isinstance(a, ast.Starred):
                    args.extend(self.eval(a.value))
                else:
                    args.append(self.eval(a))
            kwargs = {k.arg: self.eval(k.value) for k in node.keywords if k.arg is not None}
        finally:
            self.static_scope -= in_static
        self._at(node)
        return self.call(fn, args, kwargs)

    def call(self, fn, args: list, kwargs: dict):
        if isinstance(fn, Func):
            return inline_func(self.bld, fn, args, kwargs)
        if getattr(fn, "_kernel_object", False):  # a Kernel (frontend/kernel.py)
            raise self.bld.error(f"kernel '{fn.name}' cannot be called from inside a kernel; "
                                 "make it a @ti.func")
        if fn is print:
            return _printing().emit_print(self.bld, [_as_value(a) for a in args], **kwargs)
        if isinstance(getattr(fn, "__self__", None), str) and \
                getattr(fn, "__name__", None) == "format":
            return _printing().format_string(fn.__self__, tuple(_as_value(a) for a in args),
                                 {k: _as_value(v) for k, v in kwargs.items()})
        if fn in _PY_BUILTIN_MAP:
            return _PY_BUILTIN_MAP[fn](*args, **kwargs)
        if fn is builtins.range:
            return range(*[int(a) for a in args])
        if not callable(fn):
            raise self.bld.error(f"'{type(fn).__name__}' object is not callable")
        return fn(*args, **kwargs)


def _py_int(x):
    return ops.cast(x, ops.resolve_dtype(int)) if isinstance(x, Value | Matrix) else int(x)


def _py_float(x):
    return ops.cast(x, ops.resolve_dtype(float)) if isinstance(x, Value | Matrix) else float(x)


def _py_bool(x=False):
    """``bool(x)`` in a kernel: of a runtime value, "is nonzero" as a ``u1`` (Taichi's
    ``ti.cast(x, ti.u1)``; of a vector or matrix, per entry); of a compile-time value,
    Python's own."""
    return ops.cast(x, T.u1) if isinstance(x, Value | Matrix) else bool(x)


def _py_reduction(which: str):
    """Python's ``any``/``all`` in a kernel: over a vector/matrix (every entry, not its rows),
    or over a list/tuple holding runtime values, a runtime 0/1 like ``v.any()``/``v.all()``;
    over compile-time iterables, Python's own."""
    python = getattr(builtins, which)

    def reduce(x):
        if isinstance(x, list | tuple) and any(isinstance(e, Value) for e in x) and \
                all(isinstance(e, Value) or ops._is_number(e) for e in x):
            x = Vector(list(x))
        if isinstance(x, Matrix):
            return getattr(x, which)()
        return python(x)

    reduce.__name__ = which
    return reduce


_PY_BUILTIN_MAP = {
    builtins.any: _py_reduction("any"),
    builtins.all: _py_reduction("all"),
    builtins.abs: lambda x: ops.abs(x),
    builtins.min: lambda *xs: ops.min(*xs),
    builtins.max: lambda *xs: ops.max(*xs),
    builtins.int: _py_int,
    builtins.float: _py_float,
    builtins.bool: _py_bool,
    builtins.pow: lambda a, b: ops.pow(a, b),
    builtins.round: lambda x: ops.round(x),
}


def _materialize(x):
    """``x`` with every place in it loaded (inside tuples and lists too): the values now."""
    if isinstance(x, Ref):
        return x.expr()
    if isinstance(x, Matrix):
        return x._values() if any(isinstance(e, Ref) for e in x.entries) else x
    if isinstance(x, Struct):
        return load_places(x)
    if type(x) in (tuple, list):
        return type(x)(_materialize(e) for e in x)
    return x


def _speculatable(blk: Block) -> bool:
    """May this block run although its value is not needed? Pure statements without memory
    reads: arithmetic (integer division never traps here), casts, selects, locals' values."""
    return all(OPS[s.op].pure and s.op != "load" for s in blk)


def _dtype_of(x) -> T.DType:
    return x.dtype if isinstance(x, Value) else ops.literal_dtype(x)


def _paired_entries(a, b) -> list[tuple]:
    """The entries of ``a`` and ``b`` side by side; a scalar pairs with every entry."""
    shapes = {(v.n, v.m) for v in (a, b) if isinstance(v, Matrix)}
    if len(shapes) > 1:
        raise ops._err("the two sides of a conditional are matrices of different shapes: "
                       + " vs ".join(f"{n}x{m}" for n, m in sorted(shapes)))
    size = next((len(v.entries) for v in (a, b) if isinstance(v, Matrix)), 1)
    ea = a.entries if isinstance(a, Matrix) else [a] * size
    eb = b.entries if isinstance(b, Matrix) else [b] * size
    return list(zip(ea, eb, strict=True))


def _constant_sequence(x) -> bool:
    """A list/tuple of Python numbers only (nothing computed in the kernel)."""
    return isinstance(x, list | tuple) and not isinstance(x, Matrix) and all(
        isinstance(e, numbers.Number) and not isinstance(e, Value) for e in x)


def _as_value(x):
    """Load places so that a value, not a place, flows on."""
    if isinstance(x, Ref):
        return x.expr()
    if isinstance(x, Matrix):
        return x._values() if any(isinstance(e, Ref) for e in x.entries) else x
    if isinstance(x, Struct):
        return load_places(x)
    if isinstance(x, list) and x and all(isinstance(e, Value | int | float) for e in x):
        # A Python list, not a matrix literal: each entry keeps its own type (print([1, k])
        # shows 1 as an integer), where ti.Vector([...]) promotes them to one.
        return Matrix._from_entries([e.expr() if isinstance(e, Ref) else e for e in x],
                                    len(x), 1, 1)
    return x


def _loaded(x):
    """A returned value with its places loaded (tuples item by item)."""
    if isinstance(x, tuple):
        return tuple(_loaded(v) for v in x)
    if isinstance(x, Ref):
        return x.expr()
    if isinstance(x, Matrix):
        return x._values()
    if isinstance(x, Struct):
        return load_places(x)
    return x


def _is_global(x) -> bool:
    if isinstance(x, Matrix):
        return all(isinstance(e, GlobalRef) for e in x.entries)
    return isinstance(x, GlobalRef)


def _is_reduction(x) -> bool:
    """A kernel-level variable updated inside a parallel loop (``s += v`` is a reduction)."""
    entries = x.entries if isinstance(x, Matrix) else [x]
    bld = _b.require()
    return all(isinstance(e, LocalRef) and bld.is_reduction_target(e.alloca) for e in entries)


# --------------------------------------------------------------------------- ndarray args


class NdarrayArg:
    """An ndarray parameter inside a kernel: indexable, with a runtime ``shape``. With
    ``clamp`` (``boundary="clamp"``) every index is clamped into the array: the array axes to
    [0, shape - 1] and the element components to their range."""

    def __init__(self, buf: Buffer, field_ndim: int, grad: NdarrayArg | None = None,
                 clamp: bool = False) -> None:
        self.buf = buf
        self.field_ndim = field_ndim
        self.grad = grad
        self.clamp = clamp

    @property
    def shape(self) -> tuple:
        bld = _b.require()
        slot = bld.buffer_slot(self.buf)
        return tuple(Expr(bld.emit("buf_shape", T.i32, (), (slot, a)))
                     for a in range(self.field_ndim))

    def element_shape(self) -> list[int]:
        """The shape of one element (``[]`` for scalars, ``[n]`` for n-vectors, ``[n, m]``
        for matrices), known when the kernel is compiled, as Taichi's ``element_shape()``."""
        return [int(n) for n in self.buf.shape[self.field_ndim:]]

    def __getitem__(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        flat: list = []
        for k in key:
            if k is not None:  # x[None] indexes a 0-D ndarray, as for fields
                flat.extend(k.entries if isinstance(k, Matrix) else [k])
        if len(flat) != self.field_ndim:
            raise _b.require().error(f"ndarray '{self.buf.name}' has {self.field_ndim} "
                                     f"dimensions but was indexed with {len(flat)}")
        if not self.clamp:
            return kernel_element(self.buf, tuple(flat))
        flat = [_clamp_index(k, 0, ops.binary("sub", n, 1)) for k, n in zip(flat, self.shape,
                                                                          strict=True)]
        element = kernel_element(self.buf, tuple(flat))
        if isinstance(element, Matrix):
            element.__class__ = _clamped_element_class(element.ndim)
        return element

    def __setitem__(self, key, value) -> None:
        assign(self[key], _coerce(value))



class TripletArg:
    """A ``ti.types.sparse_matrix_builder()`` parameter inside a kernel (``A``): ``A[i, j] +=
    v`` and ``A[i, j] -= v`` append the triplet ``(i, j, +-v)`` to the builder's storage
    (``annotations.TRIPLET_HEADER``); ``build()`` sums duplicates, as Taichi's does.

    The position comes from an atomic add on the count, so parallel loops append without
    losing entries. A position past the storage (more than ``max_num_triplets`` appends) is
    never written: the launch fails with ``KernelAssertionError`` (the count keeps growing, so
    ``build()`` refuses as well), and so does an index outside the matrix, at the line that
    appended it. Taichi writes past the end of its buffer in the first case.
    """

    def __init__(self, arr: NdarrayArg) -> None:
        self.arr = arr
        self.value_dtype = T.ALL[TRIPLET_VALUE[arr.buf.dtype.name]]

    def __getitem__(self, key) -> TripletEntry:
        if not isinstance(key, tuple) or len(key) != 2:
            raise _b.require().error(f"sparse matrix builder '{self.arr.buf.name}' takes two "
                                     "indices: A[i, j] += value", KernelIndexError)
        return TripletEntry(self, key[0], key[1])

    def __setitem__(self, key, value) -> None:
        raise _b.require().error(f"only '+=' and '-=' are supported on a sparse matrix builder "
                                 f"('{self.arr.buf.name}[i, j] += value'): entries are "
                                 "summed when the matrix is built", KernelSyntaxError)


class TripletEntry:
    """``A[i, j]`` of a :class:`TripletArg`: only the target of ``+=``/``-=``."""

    def __init__(self, owner: TripletArg, i, j) -> None:
        self.owner, self.i, self.j = owner, i, j

    def augassign(self, op: str, value) -> None:
        bld = _b.require()
        name = self.owner.arr.buf.name
        if op not in ("add", "sub"):
            raise bld.error(f"only '+=' and '-=' are supported on a sparse matrix builder "
                            f"('{name}[i, j] += value')", KernelSyntaxError)
        if bld.adjoint:
            raise bld.error(f"cannot differentiate filling the sparse matrix builder '{name}' "
                            "(the position comes from an atomic counter): fill it in a kernel "
                            "outside the Tape, or mark that kernel @ti.ad.no_grad",
                            GradientRuleError)
        data = self.owner.arr
        idt = data.buf.dtype
        v = ops.cast(_as_value(value), self.owner.value_dtype)
        if op == "sub":
            v = ops.unary("neg", v)
        idx = []
        for k in (self.i, self.j):
            k = _as_value(k)
            if isinstance(k, Value) and k.dtype.is_float or isinstance(k, float):
                raise bld.error(f"sparse matrix builder '{name}': indices must be integers",
                                KernelTypeError)
            idx.append(ops.cast(k, idt))
        i, j = idx
        n, m = data[1].expr(), data[2].expr()
        inside = ops.logical_and(
            ops.logical_and(ops.binary("ge", i, 0), ops.binary("lt", i, n)),
            ops.logical_and(ops.binary("ge", j, 0), ops.binary("lt", j, m)))
        ops.runtime_check(inside, f"sparse matrix builder '{name}': index (i, j) outside the "
                                  "matrix (0 <= i < num_rows, 0 <= j < num_cols)")
        k = ops.atomic("add", data[0], ops.const(1, idt))
        cap = ops.raw_div(ops.binary("sub", ops.cast(data.shape[0], idt), TRIPLET_HEADER), 3)
        fits = ops.binary("lt", k, cap)
        ops.runtime_check(fits, f"sparse matrix builder '{name}' is full: more triplets "
                                "were added than its max_num_triplets; create it with a larger "
                                "max_num_triplets")
        with bld.block() as then:
            at = ops.binary("add", ops.binary("mul", k, 3), TRIPLET_HEADER)
            assign(data[at], i)
            assign(data[ops.binary("add", at, 1)], j)
            assign(data[ops.binary("add", at, 2)], ops.bit_cast(v, idt))
        bld.emit("if", None, (fits.stmt,), None, (then, []))

def _clamp_index(k, lo, hi):
    """``min(max(k, lo), hi)`` for a kernel index (a number or an integer value)."""
    e = ops.to_expr(k)
    if e.dtype.is_float:
        raise _b.require().error(f"ndarray indices must be integers, got {e.dtype}")
    return ops.min(ops.max(e, lo), hi)


_CLAMPED: dict[int, type] = {}


def _clamped_element_class(ndim: int) -> type:
    """A Vector/Matrix subclass whose component index is clamped into the element (for
    ``boundary="clamp"``). As in Taichi, a matrix clamps its flattened offset ``i * m + j``
    into [0, n * m - 1], not each index."""
    cls = _CLAMPED.get(ndim)
    if cls is None:
        base = Vector if ndim == 1 else Matrix

        def _flat_index(self, index):
            k = base._flat_index(self, index)
            last = len(self.entries) - 1
            if isinstance(k, int):
                return builtins.min(builtins.max(k, 0), last)
            return _clamp_index(k, 0, last)

        cls = _CLAMPED[ndim] = type(f"Clamped{base.__name__}", (base,),
                                    {"_flat_index": _flat_index})
    return cls


# --------------------------------------------------------------------------- entry points


def _convert_to_annotation(bld: _b.Builder, value, ann, what: str):
    """``value`` as a scalar dtype or vector/matrix type annotation says: cast to its dtype,
    its shape checked (Taichi casts annotated scalars; a wrong shape is an error); a struct
    type casts member by member."""
    if isinstance(ann, StructType):
        if isinstance(value, dict):
            value = Struct(value)
        if not isinstance(value, Struct):
            raise bld.error(f"{what} should be a struct {ann!r}, got a {type(value).__name__}")
        return ann.cast(value)
    if isinstance(value, Struct):
        raise bld.error(f"{what} should be a {ann!r}, got a struct")
    if isinstance(ann, MatrixType):
        if isinstance(value, list | tuple) and not isinstance(value, Matrix):
            try:
                value = Matrix(list(value))
            except Exception:
                raise bld.error(f"{what} should be a {ann!r}, got a {type(value).__name__}") \
                    from None
        if not isinstance(value, Matrix):
            scalar = isinstance(value, Value) or ops._is_number(value)
            raise bld.error(f"{what} should be a {ann!r}, got "
                            f"{'a scalar' if scalar else 'a ' + type(value).__name__}")
        m = ann.m if ann.ndim == 2 else 1
        # A size left out (ti.types.vector(), matrix(n=2)) takes any (beyond Taichi).
        if value.ndim != ann.ndim or ann.n not in (None, value.n) or m not in (None, value.m):
            # Taichi's words: which of ndim, n, m differs
            key, want, got = (("ndim", ann.ndim, value.ndim) if value.ndim != ann.ndim else
                              ("n", ann.n, value.n) if ann.n not in (None, value.n) else
                              ("m", m, value.m))
            raise bld.error(f"{what} of type {ann!r} is expected to be a Matrix with {key} "
                            f"{want}, but got {got}: {what} should be a {ann!r}, got a "
                            f"{value._shape_text()}", KernelSyntaxError)
        return ops.cast(value._values(), ann.scalar_dtype)
    if isinstance(value, Matrix):
        raise bld.error(f"{what} should be a scalar ({ann!r}), got a {value._shape_text()}")
    if not (isinstance(value, Value) or ops._is_number(value)):
        raise bld.error(f"{what} should be a scalar ({ann!r}), got a {type(value).__name__}")
    return ops.cast(value, ops.resolve_dtype(ann))


def _annotation_kind(ann, where: str) -> str:
    """'none', 'template', 'ndarray', 'matrix' or 'scalar' for a func's (resolved) annotation."""
    if ann is None:
        return "none"
    if isinstance(ann, Template) or ann is template:
        return "template"
    if isinstance(ann, NdarrayType):
        return "ndarray"
    if isinstance(ann, RefType):
        return "ref"
    if isinstance(ann, MatrixType):
        return "matrix"
    if isinstance(ann, StructType):
        return "struct"
    if isinstance(ann, T.DType) or ann in (int, float, bool) or (
            isinstance(ann, type) and issubclass(ann, np.generic)):
        return "scalar"
    raise KernelSyntaxError(f"Invalid type annotation {ann!r} of {where}: use a dtype "
                            "(ti.f32, float), a vector/matrix or struct type, ti.template() or "
                            "ti.types.ndarray()")


def _func_annotations(fn) -> tuple[dict[str, Any], Any]:
    """A func's parameter annotations and its return annotation (``None``, a dtype, a
    vector/matrix type or a tuple of those), resolved once per func."""
    cached = getattr(fn, "_annotations", None)
    if cached is not None:
        return cached
    name = fn.pyfunc.__name__
    params = {}
    for index, p in enumerate(fn.signature.parameters.values()):
        ann = _resolve_annotation(p.annotation, fn.pyfunc)
        if ann is None and index == 0 and fn.classfunc:
            ann = template()  # `self` of a method: the object itself, as in Taichi
        _annotation_kind(ann, f"parameter '{p.name}' of func '{name}'")
        params[p.name] = ann
    ret = _resolve_annotation(fn.signature.return_annotation, fn.pyfunc)
    if isinstance(ret, list):
        ret = tuple(ret)
    if not fn.real and not isinstance(ret, tuple) and \
            _annotation_kind(ret, f"the return of func '{name}'") == "template":
        # `-> ti.template()` on an inlined func: Taichi returns the value as it is (it casts
        # only to a dtype annotation), which is what a func without an annotation does
        ret = None
    for r in ret if isinstance(ret, tuple) else (ret,):
        if _annotation_kind(r, f"the return of func '{name}'") not in ("none", "matrix",
                                                                       "struct", "scalar"):
            raise CompileError(f"func '{name}' has an unsupported return annotation {r!r}")
    fn._annotations = (params, ret)
    return fn._annotations


def _bind_param(bld: _b.Builder, tr: FunctionTransformer, name: str, value, ann) -> Any:
    """What a func parameter is inside the func: templates and ndarrays bind the object
    itself, other runtime values a copy (cast to the annotation, if any)."""
    kind = _annotation_kind(ann, f"parameter '{name}'")
    what = f"argument '{name}' of func '{tr.name}'"
    if kind == "template":
        return value
    if kind == "ref":
        dt = ops.resolve_dtype(ann.dtype)
        if not isinstance(value, Ref):
            got = "value" if isinstance(value, Value) else type(value).__name__
            raise bld.error(f"{what} is annotated ti.ref({dt}): pass a variable or a field "
                            f"element, not a {got}")
        if value.dtype != dt:
            raise bld.error(f"{what} is annotated ti.ref({dt}) but the variable holds "
                            f"{value.dtype}", KernelTypeError)
        return value  # the caller's place: assignments in the func write it
    if kind == "ndarray":
        if not isinstance(value, NdarrayArg):
            raise bld.error(f"Expected ndarray in the kernel argument for argument {name}: "
                            f"{what} is annotated ti.types.ndarray() but got a "
                            f"{type(value).__name__}; pass an ndarray argument of the kernel "
                            "(a kernel sees ndarrays through its parameters only)",
                            KernelTypeError)
        buf = value.buf
        why = ndarray_mismatch(ann, buf.dtype, value.field_ndim,
                               tuple(buf.shape[value.field_ndim:]))
        if why is not None:  # the func's code would index the array as it is not
            raise bld.error(f"Invalid value for argument {name} - {why}: {what} is annotated "
                            f"{ann!r}; pass an array of that kind, or loosen the annotation",
                            KernelTypeError)
        return value
    if kind in ("scalar", "matrix", "struct"):
        return tr.new_variable(_convert_to_annotation(bld, _as_value(value), ann, what))
    if isinstance(value, Struct):
        return tr.new_variable(_as_value(value))  # structs are passed by value, as in Taichi
    if not isinstance(value, Value | Matrix):
        return value
    if isinstance(value, Matrix) and not any(isinstance(e, Value) for e in value.entries):
        return value  # a compile-time constant matrix
    return tr.new_variable(_as_value(value))


def call_mismatch(names: list[str], labels: list[str], required: set[str], nargs: int,
                  keywords) -> str | None:
    """What is wrong with a call of a kernel or func with parameters ``names`` (``labels``
    name them in messages, ``required`` have no default) given ``nargs`` positional values and
    the ``keywords``, in Taichi's words; None if they fit."""
    if nargs > len(names):
        return f"Too many arguments: it takes {len(names)}, got {nargs}"
    for k in keywords:
        if k not in names:
            return f"Unexpected argument '{k}': there is no parameter of that name"
        if names.index(k) < nargs:
            return f"Multiple values for argument '{k}': given by position and by name"
    for i, (n, label) in enumerate(zip(names, labels, strict=True)):
        if i >= nargs and n not in keywords and n in required:
            return f"Parameter `{label}` missing"
    return None


def inline_func(bld: _b.Builder, fn, args: list, kwargs: dict):
    """Inline a ``@ti.func`` call: a fresh scope whose parameters are copies of the arguments
    (template parameters bind the object itself)."""
    parsed = parse_function(fn.pyfunc)
    params, ret = _func_annotations(fn)  # checked when the func was defined
    try:
        bound = fn.signature.bind(*args, **kwargs)
    except TypeError as e:
        params = [p for p in fn.signature.parameters.values()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        names = [p.name for p in params]
        why = call_mismatch(names, names, {p.name for p in params if p.default is p.empty},
                            len(args), kwargs) if len(params) == len(
            fn.signature.parameters) else None
        raise bld.error(f"bad arguments to func '{fn.pyfunc.__name__}': {why or e}",
                        CallSignatureError) from None
    bound.apply_defaults()
    saved_loc = bld.loc
    tr = FunctionTransformer(bld, parsed, fn.pyfunc.__name__, is_kernel=False)
    tr.return_annotation = ret
    tr.real = fn.real
    for name, value in bound.arguments.items():
        tr.scopes[0][name] = _bind_param(bld, tr, name, value, params[name])
    _check_recursion(bld, fn)
    bld.loc = Loc.at(parsed.file, parsed.tree.lineno)
    tr.entry = bld.insertion_point()
    bld.func_stack.append(fn)
    try:
        tr.run_body(parsed.tree.body)
    finally:
        bld.func_stack.pop()
    result = tr.finish_func()
    bld.loc = saved_loc
    return result


#: How deeply funcs may be inlined into one another: far beyond real programs, well within
#: Python's recursion limit (each level takes a few dozen Python frames).
MAX_FUNC_DEPTH = 24


def _check_recursion(bld: _b.Builder, fn: Func) -> None:
    """Refuse what inlining cannot compile: a real func calling itself (its arguments are
    runtime values, so nothing stops the inlining; Taichi compiles it as a function that
    calls itself, difftape has no calls) and a chain of funcs deeper than MAX_FUNC_DEPTH
    (a ti.func recursing on compile-time arguments that do not end it)."""
    if fn.real and fn in bld.func_stack:
        raise bld.error(
            f"@ti.real_func '{fn.__name__}' calls itself: recursion is not supported by "
            "difftape, which inlines every func (real ones too) where it is called, so a "
            "recursion that ends on runtime values cannot be compiled; rewrite it as a loop "
            "(e.g. with an explicit stack in a local vector or a field)", KernelSyntaxError)
    if len(bld.func_stack) >= MAX_FUNC_DEPTH:
        raise bld.error(
            f"funcs are nested more than {MAX_FUNC_DEPTH} deep (here '{fn.__name__}'): "
            "difftape inlines every func where it is called, so a recursion must end on "
            "compile-time values (ti.template() arguments tested with ti.static) within "
            f"{MAX_FUNC_DEPTH} levels; rewrite a deeper one as a loop", KernelSyntaxError)


def build_kernel_body(bld: _b.Builder, kernel, args: tuple) -> None:
    """Bind a kernel's parameters for one specialization and transform its body."""
    parsed = parse_function(kernel.pyfunc)
    tr = FunctionTransformer(bld, parsed, kernel.name, is_kernel=True)
    bld.loc = Loc.at(parsed.file, parsed.tree.lineno)
    for index, (p, value) in enumerate(zip(kernel.params, args, strict=True)):
        ann = p.annotation
        if isinstance(ann, Template):
            tr.scopes[0][p.name] = value
            tr.kernel_args.add(p.name)
        elif isinstance(ann, SparseMatrixBuilderType):
            tr.scopes[0][p.name] = TripletArg(_ndarray_binding(bld, index, p.name, value))
            tr.kernel_args.add(p.name)
        elif isinstance(ann, NdarrayType):
            tr.scopes[0][p.name] = _ndarray_binding(bld, index, p.name, value)
            tr.kernel_args.add(p.name)
        elif isinstance(ann, MatrixType):
            if ann.n is None or (ann.ndim == 2 and ann.m is None):
                raise bld.error(f"parameter '{p.name}' of kernel '{kernel.name}' is annotated "
                                f"{ann!r} without its size: a kernel's vector/matrix "
                                "arguments need one (e.g. ti.types.vector(3, ti.f32)); funcs "
                                "may leave it out")
            dt = ann.scalar_dtype
            entries = [Expr(bld.emit("arg", dt, (), bld.add_param(f"{p.name}[{k}]", dt)))
                       for k in range(ann.n * (ann.m if ann.ndim == 2 else 1))]
            tr.scopes[0][p.name] = Matrix._from_entries(entries, ann.n,
                                                        ann.m if ann.ndim == 2 else 1, ann.ndim)
            tr.kernel_args.add(p.name)
        elif isinstance(ann, StructType):
            tr.scopes[0][p.name] = ann.from_leaves([
                Expr(bld.emit("arg", dt, (), bld.add_param(f"{p.name}.{path}", dt)))
                for path, dt in ann.leaves()])
            tr.kernel_args.add(p.name)
        elif isinstance(ann, RefType):
            raise bld.error(f"parameter '{p.name}' of kernel '{kernel.name}' is annotated "
                            "ti.ref(...): kernel arguments are values; ti.ref is for func "
                            "parameters")
        else:
            dt = ops.resolve_dtype(ann)
            tr.scopes[0][p.name] = Expr(bld.emit("arg", dt, (), bld.add_param(p.name, dt)))
            tr.kernel_args.add(p.name)
    for p in kernel.arg_params:  # argument packs: bound as views of their members' values
        if isinstance(p.annotation, ArgPackType):
            tr.scopes[0][p.name] = bind_view(p.annotation, p.name, tr.scopes[0])
            tr.kernel_args.add(p.name)
    tr.run_body(parsed.tree.body)
    check_read_only(bld)
    bld.finish_stop_grads()
    if bld.return_type is not None and not tr.returned:
        bld.loc = Loc.at(parsed.file, parsed.tree.lineno)
        raise bld.error(f"Kernel has a return type but does not have a return statement: "
                        f"kernel '{kernel.name}' is annotated to return a value (as Taichi, "
                        "difftape refuses to make one up); add a `return` at the end of its "
                        "body", KernelSyntaxError)


def _ndarray_binding(bld: _b.Builder, index: int, name: str, value) -> NdarrayArg:
    """The kernel-side view of ndarray argument ``index``, from its launch description
    ``(dtype, ndim, element shape, has_grad, boundary)`` (see ``frontend.kernel``)."""
    dtype, field_ndim, esh, has_grad, boundary = value
    clamp = boundary == "clamp"
    buf = Buffer(("ndarray", index, "primal"), dtype, (None,) * field_ndim + esh, name, len(esh))
    grad = None
    if has_grad:
        grad = NdarrayArg(buf.with_role("grad"), field_ndim, clamp=clamp)
    return NdarrayArg(buf, field_ndim, grad, clamp)


# ---------------------------------------------------------------------------------------------
# ``@ti.func`` objects (moved from decorators.py: what this module inlines)


def defined_in_class(pyfunc) -> bool:
    """Was ``pyfunc`` written in a class body (a method)? From its qualified name."""
    parts = pyfunc.__qualname__.split(".")
    return len(parts) > 1 and parts[-2] != "<locals>"


class Func:
    """A ``@ti.func``: inlined at every call site inside a kernel (so it may take and return
    vectors, matrices and tuples, and be specialized by its arguments for free)."""

    def __init__(self, pyfunc, *, real: bool = False, python: bool = False) -> None:
        self.pyfunc = pyfunc
        # @ti.pyfunc: also an ordinary Python function when called outside kernels (Taichi:
        # `wall[i].add_materialID(m)` in Python scope, a method of a @ti.dataclass, writes
        # the field through the element's members)
        self.python = python
        self.signature = inspect.signature(pyfunc)
        # Defined in a class body (a method of a @ti.dataclass or @ti.data_oriented class):
        # its unannotated first parameter (`self`) is the object itself, as in Taichi.
        self.classfunc = defined_in_class(pyfunc)
        # @ti.real_func: Taichi compiles it once, apart from its callers, so its parameters and
        # (if it returns a value) its return must be annotated. difftape inlines it like any
        # func, but asks the same of it, so that a program difftape runs also runs on Taichi.
        self.real = real
        self.__name__ = pyfunc.__name__
        self.__doc__ = pyfunc.__doc__
        self.__wrapped__ = pyfunc
        self._check_signature()

    def _check_signature(self) -> None:
        """Check the annotations when the func is defined, as Taichi does: each must be one
        a func takes (a string must name something defined by now), and a real func's
        parameters must all have one."""
        try:
            if self.real:
                for i, p in enumerate(self.signature.parameters.values()):
                    if p.annotation is inspect.Parameter.empty and not (
                            i == 0 and self.classfunc):
                        raise KernelSyntaxError(
                            f"Taichi function `{self.__name__}` parameter `{p.name}` must be "
                            f"type annotated: a @ti.real_func takes typed values (e.g. "
                            f"`{p.name}: ti.f32`); use @ti.func for a func specialized by its "
                            "arguments")
            _func_annotations(self)
        except CompileError as e:  # name the line of the `def`
            code = self.pyfunc.__code__
            line = code.co_firstlineno
            raise type(e)(e.bare_message, file=code.co_filename, line=line,
                          source_line=linecache.getline(code.co_filename, line) or None) \
                from None

    def __call__(self, *args, **kwargs):
        bld = _b.current()
        if bld is None:
            if self.python:
                return self.pyfunc(*args, **kwargs)
            raise TypeError(f"@ti.func '{self.__name__}' can only be called from a kernel or "
                            "another func (a @ti.pyfunc may also be called from Python)")
        return inline_func(bld, self, list(args), kwargs)

    def __get__(self, obj, objtype=None):
        """``obj.func`` (a method of a ``@ti.data_oriented`` object): the func with ``obj``
        as its first argument."""
        return self if obj is None else functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"<ti.func {self.__name__}{signature_text(self.pyfunc)}>"
