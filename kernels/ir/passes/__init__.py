"""The compilation pipeline, top to bottom. Each pass takes a KernelIR and returns it.

Set ``DIFFTAPE_PRINT_IR=1`` to print the IR after every pass, ``DIFFTAPE_VERIFY_IR=1`` to run
the verifier between passes (the test suite does).
"""

from __future__ import annotations

import os
import sys

from ..nodes import KernelIR
from ..printer import format_kernel
from ..verify import verify
from .bounds import insert_bounds_checks
from .dce import dead_code_elimination, eliminate_blocks
from .determinism import schedule_deterministically
from .fold import constant_fold
from .offload import offload
from .overflow import insert_overflow_checks
from .owned import demote_owned_atomics
from .reduce import privatize_reductions
from .scatter import privatize_scatters


def _task_dce(ir: KernelIR) -> KernelIR:
    for t in ir.tasks or []:
        t.bounds, t.prologue, t.body, t.epilogue = eliminate_blocks(
            [t.bounds, t.prologue, t.body, t.epilogue],
            roots=tuple(x for x in (t.begin, t.end) if x is not None))
    ir.tasks = [t for t in ir.tasks if t.kind == "range" or t.body]
    return ir


PIPELINE = [
    insert_overflow_checks,
    constant_fold,
    dead_code_elimination,
    insert_bounds_checks,
    offload,
    privatize_reductions,
    demote_owned_atomics,
    privatize_scatters,
    _task_dce,
    schedule_deterministically,
]


def run_pipeline(ir: KernelIR, passes=PIPELINE) -> KernelIR:
    show = os.environ.get("DIFFTAPE_PRINT_IR") == "1"
    check = os.environ.get("DIFFTAPE_VERIFY_IR") == "1"
    if check:
        verify(ir)
    for p in passes:
        ir = p(ir)
        if show:
            print(f"--- after {p.__name__.lstrip('_')} ---\n{format_kernel(ir)}", file=sys.stderr)
        if check:
            verify(ir)
    return ir
