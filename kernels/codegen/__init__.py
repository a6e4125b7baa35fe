"""Code generation: IR -> LLVM IR (``llvm_lowering``) -> native code (``cpu``, the target)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cpu import CPUTarget


def get_target() -> CPUTarget:
    """The CPU target (``cpu.get_target``), loaded on first use."""
    # Function-level: codegen.cpu loads LLVM (llvmlite), which `import difftape` does not need.
    from .cpu import get_target as cpu_target

    return cpu_target()
