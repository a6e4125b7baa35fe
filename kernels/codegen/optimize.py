"""Running LLVM's module pipeline with the loop vectorizer's process-wide width option.

LLVM's "maximize bandwidth" (``-vectorizer-maximize-bandwidth``: a loop's vector width by the
narrowest type it loads or stores, not the widest) is a command-line option of the whole
process, not of a pass builder. Each target says per module whether it wants it
(:meth:`.cpu.CPUTarget._optimize`), and the option is set and the pipeline run under one lock,
so that a module compiled on one thread never runs with another's setting.
"""

from __future__ import annotations

import threading

import llvmlite.binding as llvm

_LOCK = threading.Lock()


def run_module_pipeline(mod: llvm.ModuleRef, pb: llvm.PassBuilder,
                        maximize_bandwidth: bool) -> None:
    """``pb``'s module pipeline on ``mod``, with the loop vectorizer maximizing bandwidth or
    not."""
    with _LOCK:
        llvm.set_option("", f"-vectorizer-maximize-bandwidth={str(maximize_bandwidth).lower()}")
        pb.getModulePassManager().run(mod, pb)
