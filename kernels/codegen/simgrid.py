"""The simulated grid: the CUDA target's lowering compiled for the host CPU.

A GPU launch is verified without a GPU by running exactly what the CUDA target makes of a
kernel (one entry per task, the grid-stride loop, serial tasks on thread 0, per-thread
reverse-mode stacks from a pool with an overflow flag, private copies from a heap, errors in
the launch context's error word, random state ``g`` for thread ``g``) on the CPU, one thread
after another (as Triton's interpreter does). Only what is CUDA-only is swapped for the
host's equivalent (:class:`SimGridTarget` overrides just these):

- the thread's identity: the special registers (``tid``/``ntid``/``ctaid``/``nctaid``) become
  the entry's parameters ``%gid`` (global thread index) and ``%nthreads`` (grid size);
- math: the CPU target's libm/libmvec calls instead of libdevice's ``__nv_*``;
- a spin-wait's pause: ``sched_yield``;
- the device heap: libc's ``malloc``/``free`` (bound as ``dt_malloc``/``dt_free``);
- the module's triple and data layout, compiling and loading: the CPU target's.

Each task also gets a driver, ``void @<kernel>_task<k>_grid(ptr %ctx, i64 %blocks, i64
%threads, i64 %reverse)``, that runs the task for every thread of the grid in order
(``reverse``: last thread first; both are valid schedules, as our kernels have no barriers).
The launch protocol around it (pool sizing and the overflow rerun, the error word, random
states, all in device memory) is ``runtime/grid.py``'s, shared with CUDA; ``runtime/simgrid.py``
calls the driver.
"""

from __future__ import annotations

import functools

from ..ir.nodes import Block, Task
from ..types import DType
from .cpu import CPUTarget
from .cpu import get_target as cpu_target
from .cuda import CUDATarget
from .llvm_lowering import Lowering


class SimGridTarget(CUDATarget):
    """:class:`.cuda.CUDATarget`'s lowering with the host's triple, math and loader."""

    name = "simgrid"
    malloc_symbol = "dt_malloc"
    free_symbol = "dt_free"

    def __init__(self, host: CPUTarget) -> None:  # no NVPTX target machine: not CUDA's init
        self.host = host
        self.triple = host.triple
        self.datalayout = host.datalayout
        self.arch = "simgrid"

    @functools.cached_property
    def fingerprint(self) -> str:
        return f"simgrid:{self.host.fingerprint}"

    # ------------------------------------------------------------------ task entry points
    def entry_header(self, low: Lowering, k: int) -> str:
        return (f"define internal void @{low.task_name(k)}(ptr noalias %ctx, i64 %gid, "
                f"i64 %nthreads) {self.host.body_attributes(low)}")

    def global_thread(self, low: Lowering) -> tuple[str, str]:
        return "%gid", "%nthreads"

    def task_functions(self, low: Lowering, k: int, task: Task) -> list[str]:
        """CUDA's kernel for task ``k`` (an internal function here) and its grid driver."""
        name = low.task_name(k)
        enter, leave = self.host.flush_to_zero(low)  # as the CPU's tasks run
        driver = f"""define void @{name}_grid(ptr %ctx, i64 %blocks, i64 %threads, i64 %reverse) {{
entry:
{enter}
  %n = mul i64 %blocks, %threads
  %last = sub i64 %n, 1
  %rev = icmp ne i64 %reverse, 0
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %next, %body ]
  %more = icmp ult i64 %i, %n
  br i1 %more, label %body, label %done
body:
  %back = sub i64 %last, %i
  %g = select i1 %rev, i64 %back, i64 %i
  call void @{name}(ptr %ctx, i64 %g, i64 %n)
  %next = add i64 %i, 1
  br label %loop
done:
{leave}
  ret void
}}
"""
        return super().task_functions(low, k, task) + [driver]

    def entry_names(self, low: Lowering) -> list[str]:
        return [f"{low.task_name(k)}_grid" for k in range(len(low.ir.tasks))]

    # ------------------------------------------------------------------ the host's versions
    def math_call(self, low: Lowering, name: str, t: DType, args: list[str],
                  paired: bool = False) -> str:
        return self.host.math_call(low, name, t, args, paired)

    def loop_hint(self, low: Lowering, body: Block, group: int | None = None) -> str:
        return self.host.loop_hint(low, body, group)

    def pause(self, low: Lowering) -> None:
        self.host.pause(low)

    def module_trailer(self, low: Lowering) -> list[str]:
        return self.host.module_trailer(low)

    def compile(self, text: str) -> bytes:
        return self.host.compile(text)

    def load(self, obj: bytes, names: list[str]) -> tuple[object, dict[str, int]]:
        return self.host.load(obj, names)


@functools.cache
def get_target() -> SimGridTarget:
    return SimGridTarget(cpu_target())
