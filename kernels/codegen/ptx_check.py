"""Check that every kernel compiled in this process also compiles to PTX that ``ptxas``
accepts, without a GPU (the test suite turns it on: ``DIFFTAPE_CHECK_PTX``, see
tests/conftest.py).

:func:`install` registers an observer of compilation (``llvm_lowering.notify_compiled``): each
kernel compiled for the CPU (primal, adjoint and forward variants alike, whether its object
code was made now or loaded from the offline or in-memory cache, so a warm cache checks as much
as a cold one) is lowered again for the CUDA target in the calling process (cheap: Python
string building), and the module text, if not seen before, goes to worker
processes that compile it to PTX (LLVM's NVPTX backend, libdevice linked; batches of modules
linked into one PTX file, so libdevice, the pass pipeline and ptxas's start-up are paid once
per batch) and run ``ptxas`` on it. :meth:`PTXCheck.finish` waits for them and lists every
kernel that could not be lowered, compiled or assembled, with the reason.

With a ``verdicts`` directory, a module that this same toolchain (ptxas version, target arch,
libdevice, llvmlite) accepted before is not compiled and assembled again: its verdict is kept
as an empty file named by the hash of the toolchain and the module text, so any change to the
CUDA lowering makes new text and a new check. Only acceptances are kept; a failure is
re-checked every time.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import subprocess
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DifftapeError
from . import llvm_lowering
from .cuda import DEFAULT_ARCH, find_libdevice, find_ptxas, get_target

__all__ = ["DEFAULT_ARCH", "Failure", "PTXCheck", "available", "install"]


@dataclass
class Failure:
    kernel: str
    stage: str  # "lowering", "llvm" or "ptxas"
    reason: str

    def __str__(self) -> str:
        return f"{self.kernel}: {self.stage}: {self.reason}"


def _check_batch(batch: list[tuple[str, str, str]], arch: str, ptxas: str,
                 directory: str, verdicts: str | None) -> tuple[list[Failure], float]:
    """In a worker process: modules ``(kernel name, text, verdict key)`` compiled to one PTX
    file (written to ``directory``) and assembled by ptxas; where that fails, each module
    alone, to name the kernels at fault. Accepted modules leave their verdict in
    ``verdicts``. The failures and the seconds it took."""
    start = time.perf_counter()
    modules = [(name, text) for name, text, _ in batch]
    if _assemble(modules, arch, ptxas, directory) is None:
        failures, accepted = [], batch
    else:
        failures, accepted = [], []
        for m in batch:
            f = _assemble([m[:2]], arch, ptxas, directory)
            if f is None:
                accepted.append(m)
            else:
                failures.append(f)
    if verdicts is not None:
        for _, _, key in accepted:
            Path(verdicts, key).touch()
    return failures, time.perf_counter() - start


def _assemble(batch: list[tuple[str, str]], arch: str, ptxas: str,
              directory: str) -> Failure | None:
    name = batch[0][0] if len(batch) == 1 else f"batch{len(batch)}"
    digest = hashlib.sha1("".join(t for _, t in batch).encode()).hexdigest()[:12]
    base = Path(directory) / f"{name}_{digest}"
    try:
        ptx = get_target(arch).compile_many([t for _, t in batch])
    except Exception as e:  # noqa: BLE001 - any failure is the finding; report it
        base.with_suffix(".ll").write_text("\n".join(t for _, t in batch))
        return Failure(name, "llvm", f"{type(e).__name__}: {e}".strip())
    base.with_suffix(".ptx").write_bytes(ptx)
    r = subprocess.run([ptxas, f"-arch={arch}", str(base.with_suffix(".ptx")), "-o",
                        os.devnull], capture_output=True, text=True)
    if r.returncode != 0:
        base.with_suffix(".ll").write_text("\n".join(t for _, t in batch))
        return Failure(name, "ptxas", (r.stderr or r.stdout).strip()[:2000])
    return None


@dataclass
class PTXCheck:
    """The state of one checking session (see :func:`install`)."""

    arch: str
    ptxas: str
    directory: str
    jobs: int
    kernels: int = 0  # kernels observed (compiled for the CPU, or loaded from the cache)
    cached: int = 0  # of which loaded from the cache
    modules: int = 0  # distinct CUDA modules checked (assembled now, or accepted before)
    known: int = 0  # of which accepted by this toolchain in an earlier run (``verdicts``)
    verdicts: str | None = None  # where acceptances are kept (None: check everything)
    toolchain: str = ""  # what a verdict depends on besides the module text
    failures: list[Failure] = field(default_factory=list)
    worker_s: float = 0.0  # time the workers spent compiling and assembling
    _seen: set[str] = field(default_factory=set)
    batch: int = 32  # modules per PTX file
    _futures: list[Future] = field(default_factory=list)
    _pending: list[tuple[str, str]] = field(default_factory=list)
    _pool: ProcessPoolExecutor | None = None

    def __call__(self, ir, layout, cached: bool = False) -> None:
        self.kernels += 1
        self.cached += cached
        try:
            text = llvm_lowering.Lowering(ir, layout, get_target(self.arch)).module()
        except DifftapeError as e:
            self.failures.append(Failure(ir.name, "lowering", str(e).splitlines()[0]))
            return
        except Exception as e:  # noqa: BLE001 - a lowering bug: report, do not stop the run
            self.failures.append(Failure(ir.name, "lowering", f"{type(e).__name__}: {e}"))
            return
        digest = hashlib.sha1(text.encode()).digest()
        if digest in self._seen:
            return
        self._seen.add(digest)
        self.modules += 1
        key = hashlib.sha1((self.toolchain + "\0" + text).encode()).hexdigest()
        if self.verdicts is not None and os.path.exists(os.path.join(self.verdicts, key)):
            self.known += 1
            return
        # Linked with others into one PTX file: the kernel's symbols made unique.
        unique = text.replace(f"@{ir.name}_", f"@{ir.name}__{self.modules}_")
        self._pending.append((ir.name, unique, key))
        if len(self._pending) >= self.batch:
            self._submit()

    def _submit(self) -> None:
        if not self._pending:
            return
        if self._pool is None:
            # Spawned, not forked: the parent has threads (its own thread pool).
            self._pool = ProcessPoolExecutor(self.jobs,
                                             mp_context=multiprocessing.get_context("spawn"))
        self._futures.append(self._pool.submit(_check_batch, self._pending, self.arch,
                                               self.ptxas, self.directory, self.verdicts))
        self._pending = []

    def finish(self) -> list[Failure]:
        """Wait for every module; the failures (also kept in ``self.failures``)."""
        self._submit()
        for f in self._futures:
            try:
                failures, seconds = f.result()
                self.worker_s += seconds
            except Exception as e:  # noqa: BLE001 - a worker died: that is a failure too
                failures = [Failure("?", "worker", f"{type(e).__name__}: {e}")]
            self.failures += failures
        self._futures.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self in llvm_lowering.observers:
            llvm_lowering.observers.remove(self)
        return self.failures


def available() -> str | None:
    """Why the check cannot run here (no ptxas, no libdevice), or None when it can."""
    if find_ptxas() is None:
        return "ptxas not found (the PATH, the CUDA toolkit, the nvidia-cuda-nvcc wheel)"
    if find_libdevice() is None:
        return "libdevice.10.bc not found"
    return None


def _toolchain(arch: str, ptxas: str) -> str:
    """What a verdict depends on besides the module: ptxas's version, the arch, libdevice and
    the LLVM that makes the PTX."""
    import llvmlite

    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    lib = Path(find_libdevice())
    st = lib.stat()
    return "\0".join([arch, version.strip(), str(lib), str(st.st_size), str(st.st_mtime_ns),
                      llvmlite.__version__])


def install(arch: str = DEFAULT_ARCH, directory: str | None = None,
            jobs: int | None = None, verdicts: str | None = None) -> PTXCheck:
    """Start checking every kernel lowered from now on; ``finish()`` on the result.
    ``verdicts``: a directory where acceptances are kept across runs (see the module)."""
    why = available()
    if why is not None:
        raise RuntimeError(f"cannot check PTX: {why}")
    ptxas = find_ptxas()
    if verdicts is not None:
        os.makedirs(verdicts, exist_ok=True)
    check = PTXCheck(arch=arch, ptxas=ptxas,
                     directory=directory or tempfile.mkdtemp(prefix="difftape-ptx-"),
                     jobs=jobs or max(1, (os.cpu_count() or 2) // 2), verdicts=verdicts,
                     toolchain=_toolchain(arch, ptxas))
    llvm_lowering.observers.append(check)
    return check
