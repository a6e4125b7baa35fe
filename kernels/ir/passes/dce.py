"""Dead-code elimination: drop pure statements nobody uses, locals never read, empty ifs."""

from __future__ import annotations

from collections import Counter

from ..nodes import Block, KernelIR, Stmt, walk


def _uses(blocks: list[Block]) -> Counter:
    uses: Counter = Counter()
    for blk in blocks:
        for s in walk(blk):
            for a in s.args:
                uses[a] += 1
    return uses


def _sweep(block: Block, uses: Counter, reads: Counter, dead_allocas: set
           ) -> tuple[Block, bool]:
    """One backward pass. ``reads``: loads left per local, kept current as loads go, so a
    chain of dead locals (``b = a; c = b; ...``) goes in one pass, not one pass per local.
    An alloca itself goes only when it was dead at the start (``dead_allocas``): a store
    to it already passed may remain until the next pass."""
    changed = False
    out: Block = []
    for s in reversed(block):
        if s.blocks:
            new_blocks = []
            for b in s.blocks:
                nb, c = _sweep(b, uses, reads, dead_allocas)
                new_blocks.append(nb)
                changed |= c
            s.blocks = tuple(new_blocks)
        removable = (s.info.pure and uses[s] == 0) or \
            (s.op == "alloca" and s in dead_allocas) or \
            (s.op == "local_store" and reads[s.args[0]] == 0) or \
            (s.op == "if" and not s.blocks[0] and not s.blocks[1])
        if removable:
            for a in s.args:
                uses[a] -= 1
            if s.op == "local_load":
                reads[s.args[0]] -= 1
            changed = True
            continue
        out.append(s)
    out.reverse()
    return out, changed


def _reads(blocks: list[Block]) -> tuple[Counter, set[Stmt]]:
    """Loads (and atomic updates, which read) per local, and the locals never read."""
    reads: Counter = Counter()
    allocas = set()
    for blk in blocks:
        for s in walk(blk):
            if s.op == "alloca":
                allocas.add(s)
            elif s.op in ("local_load", "local_atomic"):
                reads[s.args[0]] += 1
    return reads, {a for a in allocas if reads[a] == 0}


def eliminate_blocks(blocks: list[Block], roots: tuple[Stmt, ...] = ()) -> list[Block]:
    """DCE over a group of blocks that see each other's values (e.g. a task's parts);
    ``roots`` are statements used from outside the blocks (a task's loop bounds)."""
    changed = True
    while changed:
        uses = _uses(blocks)
        for r in roots:
            uses[r] += 1
        reads, dead = _reads(blocks)
        changed = False
        new = []
        for b in blocks:
            nb, c = _sweep(b, uses, reads, dead)
            new.append(nb)
            changed |= c
        blocks = new
    return blocks


def dead_code_elimination(ir: KernelIR) -> KernelIR:
    (ir.body,) = eliminate_blocks([ir.body])
    return ir
