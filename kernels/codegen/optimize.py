"""LLVM's process-wide options, set per module: the module pipeline and code generation run
under one lock with the options the module's target asks for.

Some of LLVM's settings are command-line options of the whole process, not of a pass builder
or a target machine:

- ``-vectorizer-maximize-bandwidth``: the loop vectorizer's width by the narrowest type a loop
  loads or stores, not the widest (:meth:`.cpu.CPUTarget.module_options` says per module);
- ``-enable-misched``: the machine scheduler, which reorders each block's instructions before
  register allocation (:attr:`.cpu.CPUTarget.machine_scheduler`);
- ``-enable-masked-interleaved-mem-accesses``: the loop vectorizer's masked loads and stores
  of interleaved groups (the components of a vector field) in a loop whose remainder is
  folded into its vector body (:attr:`.cpu.CPUTarget.masked_interleaved`).

Each target says per module what it wants (:class:`ModuleOptions`), and the options are set
and the pipeline and object emission run under one lock (:func:`module_options`), so that a
module compiled on one thread never runs with another's setting, and one target never
inherits another's (the CUDA target keeps LLVM's defaults whatever the CPU chose).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import llvmlite.binding as llvm

_LOCK = threading.Lock()
#: The options last set (None: LLVM's own defaults, nothing set yet).
_current: ModuleOptions | None = None


@dataclass(frozen=True)
class ModuleOptions:
    """LLVM's process-wide options for compiling one module."""

    #: The loop vectorizer's width by the narrowest loaded or stored type (LLVM: widest).
    maximize_bandwidth: bool = False
    #: LLVM's machine scheduler before register allocation (LLVM's default: on).
    machine_scheduler: bool = True
    #: Masked wide loads and stores of interleaved groups in predicated loops (LLVM's
    #: default on x86: off, each member a gather or scatter).
    masked_interleaved: bool = False

    def flags(self) -> list[str]:
        """The options as LLVM's command line spells them."""
        return [f"-vectorizer-maximize-bandwidth={str(self.maximize_bandwidth).lower()}",
                f"-enable-misched={str(self.machine_scheduler).lower()}",
                "-enable-masked-interleaved-mem-accesses="
                f"{str(self.masked_interleaved).lower()}"]


@contextmanager
def module_options(options: ModuleOptions) -> Iterator[None]:
    """Hold the lock with ``options`` set: run a module's pipeline and emit its code inside."""
    global _current
    with _LOCK:
        if options != _current:
            for flag in options.flags():
                llvm.set_option("", flag)
            _current = options
        yield
