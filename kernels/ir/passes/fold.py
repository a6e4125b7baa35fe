"""Constant folding and algebraic simplification.

Folds operations on constants with the op table's evaluators (:func:`..ops.evaluate`, which
rounds and wraps to the result type, so f32 folds round like f32 code), removes identities
(x+0 for integers, x + -0.0 and x - 0.0 for floats, x*1, casts to the same type), and
resolves ``if``/``select`` on constant conditions.
Runs in place on a freshly built IR.
"""

from __future__ import annotations

import math

from ..nodes import Block, KernelIR, Stmt
from ..ops import OPS, evaluate


def _fold(s: Stmt):
    """The folded Python value of ``s`` if all its operands are constants and its op folds
    (``OpInfo.fold``: exact in the target's arithmetic), else None."""
    if not s.args or s.blocks or not OPS[s.op].fold or any(a.op != "const" for a in s.args):
        return None
    return evaluate(s.op, tuple(a.attr for a in s.args), s.args[0].dtype, s.dtype)


def _is_const(s: Stmt, value) -> bool:
    return s.op == "const" and s.attr == value


def _is_identity_zero(s: Stmt, sign: float) -> bool:
    """``s`` is a zero that leaves every operand as it is: any integer zero; for floats only
    the zero of sign ``sign`` (``x + -0.0`` and ``x - +0.0`` are ``x``, but ``-0.0 + 0.0`` is
    ``+0.0``, so ``x + 0.0`` is not ``x``; Python's ``-0.0 == 0`` hides the difference)."""
    if not _is_const(s, 0):
        return False
    return not (s.dtype is not None and s.dtype.is_float) or \
        math.copysign(1.0, s.attr) == sign


def _simplify(s: Stmt) -> Stmt | None:
    """An existing statement equal to ``s``, or None."""
    if s.op == "cast" and s.args[0].dtype == s.dtype:
        return s.args[0]
    if s.op in ("add", "bit_or", "bit_xor"):
        a, b = s.args
        if _is_identity_zero(b, -1.0):
            return a
        if _is_identity_zero(a, -1.0):
            return b
    if s.op == "sub" and _is_identity_zero(s.args[1], 1.0):
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
