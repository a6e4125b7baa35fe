"""The IR verifier: run between passes in tests (and with ``DIFFTAPE_VERIFY_IR=1``).

Checks that every op is known, has the right number of operands and blocks, that operands are
defined before use in the same or an enclosing block (structured dominance), that loop control
sits inside a loop, and that types agree where the op demands it.
"""

from __future__ import annotations

from ..errors import DifftapeError
from .nodes import OPS, Block, KernelIR, Stmt


class IRVerificationError(DifftapeError):
    """The compiler produced malformed IR: a difftape bug, not a user error."""


def _check_block(block: Block, visible: set[Stmt], loops: int, where: str) -> None:
    local = set(visible)
    for s in block:
        info = OPS.get(s.op)
        if info is None:
            raise IRVerificationError(f"{where}: unknown op {s.op}")
        if info.nargs is not None and len(s.args) != info.nargs:
            raise IRVerificationError(f"{where}: {s.op} takes {info.nargs} operands, "
                                      f"has {len(s.args)}")
        if len(s.blocks) != info.nblocks:
            raise IRVerificationError(f"{where}: {s.op} takes {info.nblocks} blocks")
        for a in s.args:
            if a not in local:
                raise IRVerificationError(f"{where}: {s!r} uses {a!r} which does not dominate it")
        if s.op in ("break", "continue") and loops == 0:
            raise IRVerificationError(f"{where}: {s.op} outside a loop")
        if s.op in ("local_load", "local_store", "local_atomic") and s.args[0].op != "alloca":
            raise IRVerificationError(f"{where}: {s.op} of a non-alloca {s.args[0]!r}")
        if s.op in ("add", "sub", "mul", "div", "min", "max") and \
                s.args[0].dtype != s.args[1].dtype:
            raise IRVerificationError(f"{where}: {s!r} mixes {s.args[0].dtype} and "
                                      f"{s.args[1].dtype}")
        inner_loops = loops + (1 if s.op in ("range_for", "while") else 0)
        for b in s.blocks:
            _check_block(b, local, inner_loops, where)
        local.add(s)


def verify(ir: KernelIR) -> KernelIR:
    if ir.tasks is None:
        _check_block(ir.body, set(), 0, f"kernel {ir.name}")
        return ir
    for k, t in enumerate(ir.tasks):
        where = f"kernel {ir.name} task {k}"
        _check_block(t.bounds, set(), 0, where + " bounds")
        pro = set(t.prologue)
        _check_block(t.prologue, set(), 0, where + " prologue")
        _check_block(t.body, pro, 1 if t.kind == "range" else 0, where + " body")
        _check_block(t.epilogue, pro, 0, where + " epilogue")
        if t.kind == "range" and (t.begin not in t.bounds or t.end not in t.bounds):
            raise IRVerificationError(f"{where}: range bounds are not computed in its bounds")
    return ir
