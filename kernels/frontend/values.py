"""Runtime values inside a kernel being compiled.

``Expr`` is an IR value; ``LocalRef`` and ``GlobalRef`` are places (a local variable, a buffer
element) that load when used as values and can be stored to. All of them overload Python's
operators by emitting IR, so library code such as ``Matrix.norm`` is ordinary Python.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ir.nodes import Stmt
from ..types import DType
from . import builder as _b


class Value:
    """Something with a runtime scalar value in a kernel."""

    dtype: DType

    def expr(self) -> Expr:
        raise NotImplementedError  # every concrete subclass defines it

    # Arithmetic is implemented in ops (imported lazily: ops imports this module).
    def __add__(self, o):
        return _ops().binary("add", self, o)

    def __radd__(self, o):
        return _ops().binary("add", o, self)

    def __sub__(self, o):
        return _ops().binary("sub", self, o)

    def __rsub__(self, o):
        return _ops().binary("sub", o, self)

    def __mul__(self, o):
        return _ops().binary("mul", self, o)

    def __rmul__(self, o):
        return _ops().binary("mul", o, self)

    def __truediv__(self, o):
        return _ops().binary("div", self, o)

    def __rtruediv__(self, o):
        return _ops().binary("div", o, self)

    def __floordiv__(self, o):
        return _ops().binary("floordiv", self, o)

    def __rfloordiv__(self, o):
        return _ops().binary("floordiv", o, self)

    def __mod__(self, o):
        return _ops().binary("mod", self, o)

    def __rmod__(self, o):
        return _ops().binary("mod", o, self)

    def __pow__(self, o):
        return _ops().pow(self, o)

    def __rpow__(self, o):
        return _ops().pow(o, self)

    def __and__(self, o):
        return _ops().binary("bit_and", self, o)

    def __rand__(self, o):
        return _ops().binary("bit_and", o, self)

    def __or__(self, o):
        return _ops().binary("bit_or", self, o)

    def __ror__(self, o):
        return _ops().binary("bit_or", o, self)

    def __xor__(self, o):
        return _ops().binary("bit_xor", self, o)

    def __rxor__(self, o):
        return _ops().binary("bit_xor", o, self)

    def __lshift__(self, o):
        return _ops().binary("shl", self, o)

    def __rshift__(self, o):
        return _ops().binary("shr", self, o)

    def __lt__(self, o):
        return _ops().binary("lt", self, o)

    def __le__(self, o):
        return _ops().binary("le", self, o)

    def __gt__(self, o):
        return _ops().binary("gt", self, o)

    def __ge__(self, o):
        return _ops().binary("ge", self, o)

    def __eq__(self, o):  # type: ignore[override]
        return _ops().binary("eq", self, o)

    def __ne__(self, o):  # type: ignore[override]
        return _ops().binary("ne", self, o)

    def __neg__(self):
        return _ops().unary("neg", self)

    def __pos__(self):
        return self

    def __abs__(self):
        return _ops().unary("abs", self)

    def __invert__(self):
        return _ops().unary("bit_not", self)

    def __bool__(self):
        raise _b.require().error(
            "a runtime value was used where Python needs a compile-time bool; inside kernels, "
            "branch with `if` on the value (not in a Python helper), or wrap a compile-time "
            "condition in ti.static(...)")

    __hash__ = object.__hash__


class Expr(Value):
    """The value of one IR statement."""

    __slots__ = ("stmt",)

    def __init__(self, stmt: Stmt) -> None:
        self.stmt = stmt

    @property
    def dtype(self) -> DType:
        return self.stmt.dtype

    def expr(self) -> Expr:
        return self

    def __repr__(self) -> str:
        return f"Expr({self.stmt!r}: {self.dtype})"


class Ref(Value):
    """A place: loads when used as a value."""

    def store(self, value) -> None:
        raise NotImplementedError  # every concrete subclass defines it

    def atomic(self, kind: str, value) -> Expr:
        """Read-modify-write; returns the old value. Locals are private, so a plain sequence."""
        old = self.expr()
        self.store(_ops().binary(kind, old, value))
        return old


class LocalRef(Ref):
    """A local variable (an ``alloca``)."""

    __slots__ = ("alloca",)

    def __init__(self, alloca: Stmt) -> None:
        self.alloca = alloca

    @property
    def dtype(self) -> DType:
        return self.alloca.dtype

    def expr(self) -> Expr:
        return Expr(_b.require().emit("local_load", self.dtype, (self.alloca,)))

    def store(self, value) -> None:
        v = _ops().to_expr(value, self.dtype)
        _b.require().emit("local_store", None, (self.alloca, v.stmt))

    def atomic(self, kind: str, value) -> Expr:
        bld = _b.require()
        if not bld.is_reduction_target(self.alloca):
            return super().atomic(kind, value)
        v = _ops().to_expr(value, self.dtype)
        return Expr(bld.emit("local_atomic", self.dtype, (self.alloca, v.stmt), kind))


class GlobalRef(Ref):
    """One scalar element of a buffer (field, field.grad, ndarray)."""

    __slots__ = ("slot", "indices", "_dtype", "on_write")

    def __init__(self, slot: int, indices: tuple[Expr, ...], dtype: DType,
                 on_write: Callable[[], None] | None = None) -> None:
        self.slot = slot
        self.indices = indices
        self._dtype = dtype
        # Emits what a write implies beyond the store: activating the cells of sparse SNodes.
        self.on_write = on_write

    @property
    def dtype(self) -> DType:
        return self._dtype

    def _args(self) -> tuple[Stmt, ...]:
        return tuple(i.stmt for i in self.indices)

    def expr(self) -> Expr:
        return Expr(_b.require().emit("load", self.dtype, self._args(), self.slot))

    def store(self, value) -> None:
        v = _ops().to_expr(value, self.dtype)
        _b.require().emit("store", None, self._args() + (v.stmt,), self.slot)
        if self.on_write is not None:
            self.on_write()

    def atomic(self, kind: str, value) -> Expr:
        if self.dtype.bits == 1:
            raise _b.require().error("atomic operations on u1 are not supported (hardware "
                                     "atomics are at least 8 bits wide): use a u8 or i32 "
                                     "field, or assign instead of +=")
        v = _ops().to_expr(value, self.dtype)
        old = Expr(_b.require().emit("atomic", self.dtype, self._args() + (v.stmt,),
                                     (self.slot, kind)))
        if self.on_write is not None:
            self.on_write()
        return old


#: The ``ops`` module (which builds on this one): it registers itself when it loads
#: (:func:`bind_ops`), so ``Expr``'s operators reach it without an upward import.
_ops_module = None


def bind_ops(module) -> None:
    """Registration point for ``ops`` (called once by ops.py)."""
    global _ops_module
    _ops_module = module


def _ops():
    return _ops_module
