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
import inspect
import linecache
import textwrap
from dataclasses import dataclass
from typing import Any

from .. import types as T
from ..errors import CompileError
from ..ir.nodes import Buffer
from . import builder as _b
from . import ops
from .annotations import NdarrayType, Template
from .matrix import Matrix, MatrixType, Vector
from .values import Expr, LocalRef, Ref, Value

# --------------------------------------------------------------------------- source handling


@dataclass
class ParsedFunction:
    """A kernel's or func's AST with line numbers of the real file."""

    tree: ast.FunctionDef
    file: str
    globals: dict
    closure: dict


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
        mod = ast.parse(textwrap.dedent("".join(lines)))
        ast.increment_lineno(mod, start - 1)
        tree = next(n for n in mod.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    closure = {}
    if fn.__closure__:
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__, strict=True):
            try:
                closure[name] = cell.cell_contents
            except ValueError:
                pass
    parsed = ParsedFunction(tree, file, fn.__globals__, closure)
    _parse_cache[fn] = parsed
    return parsed


# --------------------------------------------------------------------------- loop helpers


class NdRange:
    """``ti.ndrange(*dims)``; each dim an extent or a (begin, end) pair."""

    def __init__(self, *dims) -> None:
        self.bounds = []
        for d in dims:
            if isinstance(d, tuple | list):
                if len(d) != 2:
                    raise ops._err("ti.ndrange takes extents or (begin, end) pairs")
                self.bounds.append((d[0], d[1]))
            else:
                self.bounds.append((0, d))

    def __iter__(self):  # Python scope: iterate like itertools.product
        import itertools

        return itertools.product(*[range(int(b), int(e)) for b, e in self.bounds])


class Grouped:
    """``ti.grouped(x)``: iterate a field/ndrange with one vector index."""

    def __init__(self, inner) -> None:
        self.inner = inner


def static(x, *xs):
    """``ti.static``: evaluate at compile time (conditions, loop ranges, values)."""
    return (x, *xs) if xs else x


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
        from .matrix import _coerce

        a, b = _coerce(a), _coerce(b)
    if op == "add" and isinstance(a, tuple) and isinstance(b, tuple):
        return a + b
    return ops.binary(op, a, b)


class _Return(Exception):
    pass


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
        self.loop_depth = 0
        self.static_loop_depth = 0
        self.return_value: Any = None
        self.returned = False
        self.kernel_args: set[str] = set()

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
        raise self.bld.error(f"name '{name}' is not defined")

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
            if self.returned:
                raise self._at(st).error(
                    "statements after `return` are not allowed in difftape funcs/kernels")
            self.stmt(st)

    def _at(self, node: ast.AST) -> _b.Builder:
        if hasattr(node, "lineno"):
            self.bld.loc = (self.parsed.file, node.lineno)
        return self.bld

    def stmt(self, node: ast.stmt) -> None:
        self._at(node)
        method = getattr(self, "build_" + type(node).__name__, None)
        if method is None:
            raise self.bld.error(f"'{type(node).__name__}' statements are not supported in "
                                 "difftape kernels")
        try:
            method(node)
        except CompileError:
            raise
        except Exception as e:  # user Python run at compile time failed: report the line
            self._at(node)
            raise self.bld.error(f"{type(e).__name__}: {e}") from e

    def build_Pass(self, node: ast.Pass) -> None:
        pass

    def build_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # docstring
        self.eval(node.value)

    def build_Assign(self, node: ast.Assign) -> None:
        value = self.eval(node.value)
        for target in node.targets:
            self.assign(target, value)

    def build_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is None:
            raise self.bld.error("a declaration needs a value: `x: ti.f32 = 0.0`")
        ann = self.eval(node.annotation)
        value = self.eval(node.value)
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

    def assign(self, target: ast.expr, value) -> None:
        self._at(target)
        if isinstance(target, ast.Name):
            var = self._find_var(target.id)
            if target.id in self.kernel_args and var is self.scopes[0].get(target.id):
                raise self.bld.error(f"kernel argument '{target.id}' is read-only; copy it into "
                                     f"a local first, e.g. `{target.id}_ = {target.id}`")
            if isinstance(var, Ref | Matrix) and _is_place(var):
                from ..runtime.field import assign

                if isinstance(var, Matrix) and not isinstance(value, Matrix):
                    raise self.bld.error(f"'{target.id}' is a vector/matrix; cannot assign a "
                                         "scalar to it")
                assign(var, _as_value(value))
                return
            if isinstance(value, Value | Matrix) or ops._is_number(value):
                self.scopes[-1][target.id] = self.new_variable(value)
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
            if hasattr(container, "__setitem__") and not isinstance(container, dict | list):
                container[index] = _as_value(value)
                return
            raise self.bld.error(f"cannot assign into a {type(container).__name__}")
        if isinstance(target, ast.Attribute):
            obj = self.eval(target.value)
            setattr(obj, target.attr, _as_value(value))
            return
        raise self.bld.error(f"cannot assign to {type(target).__name__}")

    def build_AugAssign(self, node: ast.AugAssign) -> None:
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise self.bld.error("unsupported augmented assignment")
        value = _as_value(self.eval(node.value))
        target = self.eval_place(node.target)
        if isinstance(target, Matrix) and isinstance(value, list | tuple):
            from .matrix import _coerce

            value = _coerce(value)
        if not _is_place(target):
            raise self.bld.error("the target of an augmented assignment must be a variable, "
                                 "a field element or a vector/matrix variable")
        if op in ("add", "sub") and (_is_global(target) or _is_reduction(target)):
            ops.atomic(op, target, value)  # Taichi semantics: += on globals is atomic
            return
        from ..runtime.field import assign

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
            self.run_body(node.body if cond else node.orelse)  # compile-time condition
            return
        c = ops.to_condition(cond)
        with self.bld.block() as then_blk:
            self.scopes.append({})
            self._branch_body(node.body)
            self.scopes.pop()
        with self.bld.block() as else_blk:
            self.scopes.append({})
            self._branch_body(node.orelse)
            self.scopes.pop()
        self._at(node)
        self.bld.emit("if", None, (c.stmt,), None, (then_blk, else_blk))

    def _branch_body(self, body) -> None:
        self.run_body(body)
        if self.returned and not self.is_kernel:
            raise self.bld.error("`return` inside a branch is not supported in funcs yet: "
                                 "assign to a variable and return it at the end")

    def build_While(self, node: ast.While) -> None:
        if node.orelse:
            raise self.bld.error("while/else is not supported")
        with self.bld.block() as body:
            test = self.eval(node.test)
            if isinstance(test, Value):
                stop = ops.logical_not(test)
                with self.bld.block() as brk:
                    self.bld.emit("break", None)
                self.bld.emit("if", None, (stop.stmt,), None, (brk, []))
            elif not test:
                return
            self.scopes.append({})
            self.loop_depth += 1
            self.bld.loop_stack.append(("while", None))
            self.run_body(node.body)
            self.bld.loop_stack.pop()
            self.loop_depth -= 1
            self.scopes.pop()
        self._at(node)
        self.bld.emit("while", None, (), None, (body,))

    def build_Break(self, node: ast.Break) -> None:
        self._loop_control("break")

    def build_Continue(self, node: ast.Continue) -> None:
        self._loop_control("continue")

    def _loop_control(self, what: str) -> None:
        if self.static_loop_depth and not self.loop_depth:
            raise self.bld.error(f"`{what}` in a ti.static loop is not supported")
        if not self.loop_depth:
            raise self.bld.error(f"`{what}` outside a loop")
        if self.bld.loop_stack and self.bld.loop_stack[-1][0] == "parallel" and what == "break":
            raise self.bld.error("`break` in a parallel (outermost) loop is not allowed: its "
                                 "iterations run concurrently. Use ti.loop_config(serialize="
                                 "True) before the loop, or an inner loop")
        self.bld.emit(what, None)

    def build_Return(self, node: ast.Return) -> None:
        value = self.eval(node.value) if node.value is not None else None
        if self.is_kernel:
            self._kernel_return(value)
        else:
            if isinstance(value, Matrix):
                value = value._values()
            elif isinstance(value, Ref):
                value = value.expr()
            elif isinstance(value, tuple):
                value = tuple(v._values() if isinstance(v, Matrix) else
                              v.expr() if isinstance(v, Ref) else v for v in value)
            self.return_value = value
        self.returned = True

    def _kernel_return(self, value) -> None:
        if not self.bld.at_top_level:
            raise self.bld.error("a kernel's `return` must be at the top level of its body")
        rt = self.bld.return_type
        if rt is None:
            raise self.bld.error("this kernel returns a value but has no return annotation; "
                                 "add e.g. `-> ti.f32`")
        values = value.entries if isinstance(value, Matrix) else [value]
        types_ = rt if isinstance(rt, list) else [rt]
        if len(values) != len(types_):
            raise self.bld.error(f"kernel returns {len(values)} values, annotation says "
                                 f"{len(types_)}")
        for slot, (v, t) in enumerate(zip(values, types_, strict=True)):
            e = ops.to_expr(v, t)
            self.bld.emit("return", None, (e.stmt,), slot)

    def build_Assert(self, node: ast.Assert) -> None:
        cond = self.eval(node.test)
        msg = self.eval(node.msg) if node.msg is not None else "assertion failed"
        if not isinstance(cond, Value):
            if not cond:
                raise self.bld.error(f"static assertion failed: {msg}")
            return
        if self.bld.debug:
            self.bld.emit("assert", None, (ops.to_condition(cond).stmt,), str(msg))

    # ------------------------------------------------------------------ for loops
    def build_For(self, node: ast.For) -> None:
        if node.orelse:
            raise self.bld.error("for/else is not supported")
        it = node.iter
        if isinstance(it, ast.Call):
            fn = self.eval(it.func)
            if fn is static:
                self._static_for(node, self.eval(it.args[0]))
                return
            if fn is builtins.range:
                args = [self.eval(a) for a in it.args]
                if len(args) == 1:
                    bounds = [(0, args[0])]
                elif len(args) == 2:
                    bounds = [(args[0], args[1])]
                else:
                    raise self.bld.error("range() with a step is not supported in kernels; "
                                         "loop over range(n) and scale the index")
                self._range_for(node, bounds, grouped=False)
                return
        iterable = self.eval(it)
        grouped = isinstance(iterable, Grouped)
        if grouped:
            iterable = iterable.inner
        bounds = self._iteration_bounds(iterable)
        self._range_for(node, bounds, grouped=grouped)

    def _iteration_bounds(self, iterable) -> list[tuple]:
        from ..runtime.field import Field

        if isinstance(iterable, NdRange):
            return iterable.bounds
        if isinstance(iterable, Field):
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
        self.static_loop_depth += 1
        for item in iterable:
            self.scopes.append({})
            self._bind_target(node.target, item)
            self.run_body(node.body)
            self.scopes.pop()
        self.static_loop_depth -= 1

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

    def _range_for(self, node: ast.For, bounds: list[tuple], *, grouped: bool) -> None:
        target = node.target
        names = [target] if isinstance(target, ast.Name) else list(getattr(target, "elts", []))
        if not all(isinstance(n, ast.Name) for n in names):
            raise self.bld.error("loop targets must be names")
        if grouped:
            if len(names) != 1:
                raise self.bld.error("ti.grouped(...) binds one vector index: `for I in ...`")
        elif len(names) != len(bounds):
            raise self.bld.error(
                f"this loop has {len(bounds)} ind{'ex' if len(bounds) == 1 else 'ices'} but "
                f"{len(names)} loop variable{'s' if len(names) != 1 else ''}; use "
                f"`for {', '.join('ijkl'[:len(bounds)])} in ...` or ti.grouped(...)")
        config = getattr(self.bld, "pending_loop_config", None) or {}
        self.bld.pending_loop_config = None
        outermost = self.is_kernel and self.bld.at_top_level and self.loop_depth == 0
        parallel = outermost and not config.get("serialize", False)
        self._nested_loops(node, names, bounds, 0, [], grouped=grouped,
                           parallel=parallel, serialize=config.get("serialize", False))

    def _nested_loops(self, node, names, bounds, level, indices, *, grouped, parallel,
                      serialize) -> None:
        if level == len(bounds):
            self.scopes.append({})
            if grouped:
                self.scopes[-1][names[0].id] = Matrix._from_entries(indices, len(indices), 1, 1)
            else:
                for n, ix in zip(names, indices, strict=True):
                    self.scopes[-1][n.id] = ix
            self.run_body(node.body)
            self.scopes.pop()
            return
        begin, end = bounds[level]
        b = ops.to_expr(begin, T.i32)
        e = ops.to_expr(end, T.i32)
        loop_id = next(self.bld.loop_ids)
        kind = "parallel" if parallel and level == 0 else "range"
        with self.bld.block() as body:
            self.loop_depth += 1
            self.bld.loop_stack.append((kind, loop_id))
            index = Expr(self.bld.emit("loop_index", T.i32, (), loop_id))
            self._nested_loops(node, names, bounds, level + 1, indices + [index],
                               grouped=grouped, parallel=parallel, serialize=serialize)
            self.bld.loop_stack.pop()
            self.loop_depth -= 1
        self._at(node)
        flags = "parallel" if kind == "parallel" else ("serial" if serialize else "inner")
        self.bld.emit("range_for", None, (b.stmt, e.stmt), (loop_id, flags), (body,))

    # ------------------------------------------------------------------ expressions
    def eval(self, node: ast.expr):
        method = getattr(self, "expr_" + type(node).__name__, None)
        if method is None:
            self._at(node)
            raise self.bld.error(f"'{type(node).__name__}' expressions are not supported in "
                                 "difftape kernels")
        return method(node)

    def eval_index(self, node: ast.expr):
        if isinstance(node, ast.Tuple):
            return tuple(self.eval(e) for e in node.elts)
        return self.eval(node)

    def expr_Constant(self, node: ast.Constant):
        return node.value

    def expr_Name(self, node: ast.Name):
        value = self.lookup(node.id)
        if getattr(value, "name", None) == "" and hasattr(value, "_label"):
            value.name = node.id  # name unnamed fields after the user's variable, for messages
        return value

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

    def expr_BinOp(self, node: ast.BinOp):
        a, b = self.eval(node.left), self.eval(node.right)
        self._at(node)
        return apply_binop(_BINOPS[type(node.op)], _as_value(a), _as_value(b))

    def expr_UnaryOp(self, node: ast.UnaryOp):
        v = _as_value(self.eval(node.operand))
        if isinstance(node.op, ast.USub):
            return -v
        if isinstance(node.op, ast.UAdd):
            return v
        if isinstance(node.op, ast.Not):
            return ops.logical_not(v) if isinstance(v, Value | Matrix) else (not v)
        if isinstance(node.op, ast.Invert):
            return ~v
        raise self.bld.error("unsupported unary operator")

    def expr_BoolOp(self, node: ast.BoolOp):
        values = [self.eval(v) for v in node.values]
        op = "logical_and" if isinstance(node.op, ast.And) else "logical_or"
        if not any(isinstance(v, Value | Matrix) for v in values):
            out = values[0]
            for v in values[1:]:
                out = (out and v) if op == "logical_and" else (out or v)
            return out
        out = _as_value(values[0])
        for v in values[1:]:  # like Python: `a and b` is b if a else a (both evaluated)
            v = _as_value(v)
            truthy = ops.binary("ne", out, 0)
            out = ops.select(truthy, v, out) if op == "logical_and" else \
                ops.select(truthy, out, v)
        return out

    def expr_Compare(self, node: ast.Compare):
        left = _as_value(self.eval(node.left))
        result = None
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = _as_value(self.eval(comp))
            if isinstance(op, ast.Is | ast.IsNot):
                r = (left is right) == isinstance(op, ast.Is)
            elif isinstance(op, ast.In | ast.NotIn):
                r = (left in right) == isinstance(op, ast.In)
            elif not isinstance(left, Value | Matrix) and not isinstance(right, Value | Matrix) \
                    and not (ops._is_number(left) and ops._is_number(right)):
                r = _PY_COMPARE[type(op)](left, right)  # compile-time objects (dtypes, ...)
            else:
                r = ops.binary(_CMPOPS[type(op)], left, right)
            result = r if result is None else ops.binary("logical_and", result, r)
            left = right
        return result

    def expr_IfExp(self, node: ast.IfExp):
        cond = self.eval(node.test)
        if not isinstance(cond, Value):
            return self.eval(node.body) if cond else self.eval(node.orelse)
        return ops.select(cond, _as_value(self.eval(node.body)),
                          _as_value(self.eval(node.orelse)))

    def expr_Subscript(self, node: ast.Subscript):
        container = self.eval(node.value)
        index = self.eval_index(node.slice)
        self._at(node)
        if isinstance(index, Ref):
            index = index.expr()
        try:
            return container[index]
        except (TypeError, KeyError) as e:
            raise self.bld.error(f"cannot index a {type(container).__name__}: {e}") from None

    def expr_ListComp(self, node: ast.ListComp):
        """Unrolled at compile time: the iterables must be compile-time (range(3), tuples)."""
        out: list = []
        self._comprehension(node.elt, node.generators, out)
        return out

    def _comprehension(self, elt, generators, out: list) -> None:
        if not generators:
            out.append(self.eval(elt))
            return
        gen = generators[0]
        iterable = self.eval(gen.iter)
        if isinstance(iterable, Value) or isinstance(iterable, Matrix) and iterable.ndim == 2:
            raise self.bld.error("comprehensions in kernels iterate at compile time; the "
                                 "iterable must be a range/tuple of constants")
        for item in (iterable.entries if isinstance(iterable, Matrix) else iterable):
            self.scopes.append({})
            self._bind_target(gen.target, item)
            if all(self._static_truth(c) for c in gen.ifs):
                self._comprehension(elt, generators[1:], out)
            self.scopes.pop()

    def _static_truth(self, node) -> bool:
        v = self.eval(node)
        if isinstance(v, Value):
            raise self.bld.error("comprehension conditions must be compile-time")
        return bool(v)

    def expr_JoinedStr(self, node: ast.JoinedStr):
        raise self.bld.error("f-strings are not supported in kernels")

    def expr_Call(self, node: ast.Call):
        fn = self.eval(node.func)
        args = []
        for a in node.args:
            if isinstance(a, ast.Starred):
                args.extend(self.eval(a.value))
            else:
                args.append(self.eval(a))
        kwargs = {k.arg: self.eval(k.value) for k in node.keywords if k.arg is not None}
        self._at(node)
        return self.call(fn, args, kwargs)

    def call(self, fn, args: list, kwargs: dict):
        from ..runtime.kernel import Kernel
        from .decorators import Func

        if isinstance(fn, Func):
            return inline_func(self.bld, fn, args, kwargs)
        if isinstance(fn, Kernel):
            raise self.bld.error(f"kernel '{fn.name}' cannot be called from inside a kernel; "
                                 "make it a @ti.func")
        if fn is print:
            raise self.bld.error("print() inside kernels is not supported yet; read values "
                                 "in Python scope after the kernel")
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


_PY_BUILTIN_MAP = {
    builtins.abs: lambda x: ops.abs(x),
    builtins.min: lambda *xs: ops.min(*xs),
    builtins.max: lambda *xs: ops.max(*xs),
    builtins.int: _py_int,
    builtins.float: _py_float,
    builtins.pow: lambda a, b: ops.pow(a, b),
    builtins.round: lambda x: ops.round(x),
}


def _as_value(x):
    """Load places so that a value, not a place, flows on."""
    if isinstance(x, Ref):
        return x.expr()
    if isinstance(x, Matrix):
        return x._values() if any(isinstance(e, Ref) for e in x.entries) else x
    if isinstance(x, list) and x and all(isinstance(e, Value | int | float) for e in x):
        return Vector(x)
    return x


def _is_place(x) -> bool:
    if isinstance(x, Ref):
        return True
    return isinstance(x, Matrix) and all(isinstance(e, Ref) for e in x.entries)


def _is_global(x) -> bool:
    from .values import GlobalRef

    if isinstance(x, Matrix):
        return all(isinstance(e, GlobalRef) for e in x.entries)
    return isinstance(x, GlobalRef)


def _is_reduction(x) -> bool:
    """A kernel-level variable updated inside a parallel loop (``s += v`` is a reduction)."""
    from .values import LocalRef

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

    def __getitem__(self, key):
        from ..runtime.field import kernel_element

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
        from ..runtime.field import assign

        assign(self[key], value)


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


def inline_func(bld: _b.Builder, fn, args: list, kwargs: dict):
    """Inline a ``@ti.func`` call: a fresh scope whose parameters are copies of the arguments
    (template parameters bind the object itself)."""
    parsed = parse_function(fn.pyfunc)
    sig = fn.signature
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise bld.error(f"bad arguments to func '{fn.pyfunc.__name__}': {e}") from None
    bound.apply_defaults()
    saved_loc = bld.loc
    tr = FunctionTransformer(bld, parsed, fn.pyfunc.__name__, is_kernel=False)
    for name, value in bound.arguments.items():
        ann = sig.parameters[name].annotation
        if isinstance(ann, Template) or not isinstance(value, Value | Matrix):
            tr.scopes[0][name] = value
        elif isinstance(value, Matrix) and not any(isinstance(e, Value) for e in value.entries):
            tr.scopes[0][name] = value  # a compile-time constant matrix
        else:
            tr.scopes[0][name] = tr.new_variable(_as_value(value))
    if len(bld.loop_stack) > 64:
        raise bld.error("func recursion is too deep (difftape inlines funcs)")
    tr.run_body(parsed.tree.body)
    bld.loc = saved_loc
    return tr.return_value


def build_kernel_body(bld: _b.Builder, kernel, args: tuple) -> None:
    """Bind a kernel's parameters for one specialization and transform its body."""
    parsed = parse_function(kernel.pyfunc)
    tr = FunctionTransformer(bld, parsed, kernel.name, is_kernel=True)
    bld.loc = (parsed.file, parsed.tree.lineno)
    for index, (p, value) in enumerate(zip(kernel.params, args, strict=True)):
        ann = p.annotation
        if isinstance(ann, Template):
            tr.scopes[0][p.name] = value
        elif isinstance(ann, NdarrayType):
            tr.scopes[0][p.name] = _ndarray_binding(bld, index, p.name, value)
        elif isinstance(ann, MatrixType):
            dt = ann.scalar_dtype
            entries = [Expr(bld.emit("arg", dt, (), bld.add_param(f"{p.name}[{k}]", dt)))
                       for k in range(ann.n * (ann.m if ann.ndim == 2 else 1))]
            tr.scopes[0][p.name] = Matrix._from_entries(entries, ann.n,
                                                        ann.m if ann.ndim == 2 else 1, ann.ndim)
            tr.kernel_args.add(p.name)
        else:
            dt = ops.resolve_dtype(ann)
            tr.scopes[0][p.name] = Expr(bld.emit("arg", dt, (), bld.add_param(p.name, dt)))
            tr.kernel_args.add(p.name)
    tr.run_body(parsed.tree.body)


def _ndarray_binding(bld: _b.Builder, index: int, name: str, value) -> NdarrayArg:
    """The kernel-side view of ndarray argument ``index``, from its launch description
    ``(dtype, ndim, element shape, has_grad, boundary)`` (see ``runtime.kernel``)."""
    dtype, field_ndim, esh, has_grad, boundary = value
    clamp = boundary == "clamp"
    buf = Buffer(("ndarray", index, "primal"), dtype, (None,) * field_ndim + esh, name, len(esh))
    grad = None
    if has_grad:
        grad = NdarrayArg(buf.with_role("grad"), field_ndim, clamp=clamp)
    return NdarrayArg(buf, field_ndim, grad, clamp)
