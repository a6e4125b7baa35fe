"""What a code-generation target supplies to the shared lowering (:mod:`.llvm_lowering`).

The shared lowering turns offloaded IR (tasks of statements) into LLVM IR text; everything
that depends on where the code runs is asked of the target through this interface, so a new
target is one module (``cpu.py``, ``cuda.py``) rather than branches through the compiler:

- the module header: ``triple`` and ``datalayout``;
- the task ABI: :meth:`Target.task_functions` writes each task's entry points (their
  signatures, how a thread finds its indices: chunks on the CPU, a grid-stride loop on a GPU)
  around the shared body lowering (``Lowering.begin_task``, ``range_body``, ``finish_task``);
- the thread's identity for per-thread state (:meth:`Target.rng_index`);
- math calls (:meth:`Target.math_call`);
- scratch memory: per-chunk private copies of privatized scatter targets and the reverse-mode
  stack (``private_copy``/``release_private``, ``stack_*``);
- loop hints (:meth:`Target.loop_hint`: the CPU turns the vectorizer off for some loops);
- waiting for an ordered chunk's turn, ``print``;
- compiling the module text and loading the result (``compile``, ``load``).

Launching is the runtime's part (``runtime/kernel.py`` for the CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..ir.nodes import Block, Task
from ..types import DType

if TYPE_CHECKING:
    from .llvm_lowering import Lowering


class Target(Protocol):
    name: str
    #: LLVM target triple and data layout written at the head of every module
    triple: str
    datalayout: str
    #: Lower two f32 atomic adds into the components of one aligned 8-byte pair as one
    #: 64-bit atomic (where float atomics are compare-exchange loops anyway: the CPU).
    paired_atomics: bool
    #: ``llvm.fpto[su]i.sat`` is one instruction: float-to-int casts use it (else they are
    #: written out as compares and selects that vectorize).
    native_saturating_casts: bool
    #: Declare a parallel loop's field and ndarray accesses free of dependences between its
    #: iterations (an LLVM access group), so that the loop vectorizer needs no run-time
    #: overlap checks between them (``Lowering.range_body``).
    parallel_access_groups: bool

    @property
    def fingerprint(self) -> str:
        """Everything about the target that changes the code it makes (for cache keys)."""

    # ---------------------------------------------------------------- task entry points
    def task_functions(self, low: Lowering, k: int, task: Task) -> list[str]:
        """The LLVM functions (text) that run task ``k``: its entry points and their index
        mapping, with the body lowered by ``low``."""

    def entry_names(self, low: Lowering) -> list[str]:
        """The symbols of the module's entry points, in the order the launcher wants them."""

    def rng_index(self, low: Lowering) -> str:
        """An i64 value: which random-number state this thread of the task uses."""

    # ---------------------------------------------------------------- code inside a body
    def error_reported(self, low: Lowering, code: int, values: tuple) -> None:
        """Code after a failed check has written the launch context's error report
        (``values``: the statements of the values its message shows); nothing on the CPU."""

    def math_call(self, low: Lowering, name: str, t: DType, args: list[str],
                  paired: bool = False) -> str:
        """The value of transcendental ``name`` (see ``llvm_lowering.TRANSCENDENTAL``)."""

    def loop_hint(self, low: Lowering, body: Block, group: int | None = None) -> str:
        """Text appended to a counted loop's back edge (``, !llvm.loop !N``) or ``""``."""

    def private_copy(self, low: Lowering, elements: int, elem_bytes: int) -> str:
        """A pointer to zeroed scratch memory for one chunk's private copy of a buffer."""

    def release_private(self, low: Lowering, ptr: str) -> None:
        """Give back memory from :meth:`private_copy` (on every exit of the task)."""

    def stack_init(self, low: Lowering) -> None:
        """Set up this task's reverse-mode stack of 64-bit slots (at the task's entry)."""

    def stack_push(self, low: Lowering, bits: str) -> None:
        """Push the i64 ``bits``."""

    def stack_pop(self, low: Lowering) -> str:
        """Pop the top i64."""

    def stack_release(self, low: Lowering) -> None:
        """Free what :meth:`stack_init` and pushes took (on every exit of the task)."""

    def pause(self, low: Lowering) -> None:
        """One turn of a spin-wait (an ordered chunk waiting for its predecessor)."""

    def print_call(self, low: Lowering, fmt: str, args: list[str], line: int) -> None:
        """Print one line: ``fmt`` is a C format string constant (a global's name),
        ``args`` typed C-varargs operands (floats as double, small integers as i32),
        ``line`` the line's number among the kernel's (``ir.printf.print_formats``)."""

    def module_trailer(self, low: Lowering) -> list[str]:
        """Extra module-level text (globals, metadata) after the functions."""

    # ---------------------------------------------------------------- compile and load
    def compile(self, text: str) -> bytes:
        """Machine code (or assembly) for a module's text."""

    def load(self, obj: bytes, names: list[str]) -> tuple[object, dict[str, int]]:
        """Load compiled code: (an owner that keeps it alive, entry name -> address)."""
