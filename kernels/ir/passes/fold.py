"""Constant folding and algebraic simplification.

Folds operations on constants with the target's arithmetic (NumPy scalars of the same width,
so f32 folds round like f32 code), removes identities (x+0, x*1, casts to the same type),
and resolves ``if``/``select`` on constant conditions. Runs in place on a freshly built IR.
"""

from __future__ import annotations

import math

import numpy as np

from ..nodes import Block, KernelIR, Stmt

_FOLD_BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "min": lambda a, b: min(a, b), "max": lambda a, b: max(a, b),
    "bit_and": lambda a, b: a & b, "bit_or": lambda a, b: a | b, "bit_xor": lambda a, b: a ^ b,
    "lt": lambda a, b: int(a < b), "le": lambda a, b: int(a <= b), "gt": lambda a, b: int(a > b),
    "ge": lambda a, b: int(a >= b), "eq": lambda a, b: int(a == b), "ne": lambda a, b: int(a != b),
    "logical_and": lambda a, b: int(bool(a) and bool(b)),
    "logical_or": lambda a, b: int(bool(a) or bool(b)),
}


def _scalar(value, dtype):
    # u1 folds in u8 and wraps (NumPy's bool arithmetic is logical, not modular).
    return (np.uint8 if dtype.bits == 1 else dtype.np.type)(value)


def _const_value(s: Stmt):
    return s.attr if s.op == "const" else None


def _fold(s: Stmt):
    """The folded Python value of ``s`` if all its operands are constants, else None."""
    if not s.args or any(a.op != "const" for a in s.args) or s.blocks:
        return None
    vals = [a.attr for a in s.args]
    with np.errstate(all="ignore"):
        if s.op == "cast":
            v = vals[0]
            if s.dtype.bits == 1:  # u1: "is nonzero"
                return 1 if v else 0
            if s.dtype.is_int and isinstance(v, float):
                if not math.isfinite(v):
                    return None
                v = int(v)  # truncation toward zero, as the generated code does
            return _normalize(_scalar(v, s.dtype).item() if s.dtype.is_float else v, s.dtype)
        if s.op in _FOLD_BINARY:
            t = s.args[0].dtype
            r = _FOLD_BINARY[s.op](_scalar(vals[0], t), _scalar(vals[1], t))
            return _normalize(r.item() if hasattr(r, "item") else r, s.dtype)
        if s.op == "neg":
            return _normalize((-_scalar(vals[0], s.dtype)).item(), s.dtype)
        if s.op == "select":
            return None
    return None


def _normalize(v, dtype):
    if dtype.is_float:
        return float(v)
    v = int(v)
    bits = dtype.bits
    v &= (1 << bits) - 1
    if dtype.is_signed and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def _is_const(s: Stmt, value) -> bool:
    return s.op == "const" and s.attr == value


def _simplify(s: Stmt) -> Stmt | None:
    """An existing statement equal to ``s``, or None."""
    if s.op == "cast" and s.args[0].dtype == s.dtype:
        return s.args[0]
    if s.op in ("add", "bit_or", "bit_xor"):
        a, b = s.args
        if _is_const(b, 0):
            return a
        if _is_const(a, 0):
            return b
    if s.op == "sub" and _is_const(s.args[1], 0):
        return s.args[0]
    if s.op == "mul":
        a, b = s.args
        if _is_const(b, 1):
            return a
        if _is_const(a, 1):
            return b
    if s.op == "div" and _is_const(s.args[1], 1):
        return s.args[0]
    if s.op == "select":
        c, a, b = s.args
        if c.op == "const":
            return a if c.attr else b
        if a is b:
            return a
    return None


def fold_block(block: Block, mapping: dict[Stmt, Stmt]) -> Block:
    out: Block = []
    for s in block:
        if s.args:
            s.args = tuple(mapping.get(a, a) for a in s.args)
        if s.blocks:
            s.blocks = tuple(fold_block(b, mapping) for b in s.blocks)
        if s.op == "if" and s.args[0].op == "const":
            out.extend(s.blocks[0] if s.args[0].attr else s.blocks[1])
            continue
        folded = _fold(s)
        if folded is not None:
            s.op, s.args, s.attr = "const", (), folded
        else:
            same = _simplify(s)
            if same is not None:
                mapping[s] = same
                continue
        out.append(s)
    return out


def constant_fold(ir: KernelIR) -> KernelIR:
    ir.body = fold_block(ir.body, {})
    return ir
