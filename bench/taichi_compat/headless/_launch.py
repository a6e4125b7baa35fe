"""Runs a Taichi program in this process as the harnesses want it (``bench/program_runs.py``
writes the ``_run_example.py`` that calls :func:`run`).

Python's ``random`` and NumPy's generator are seeded with 0 (with ``DIFFTAICHI_NUDGE`` in the
environment every float they draw is one ulp larger: ``bench/difftaichi.py``'s chaos probe);
``ti.init`` runs on the CPU whatever arch the program asks for, with ``init`` added to its
options; ``ti.GUI`` is, by ``gui``: ``"noop"`` a no-op (``_noop.NoGUI``), ``"real"`` the
backend's own, ``"record"`` the recording stand-ins of ``_record`` (``ti.GUI`` and ``ti.ui``),
which end the program after ``frames`` shown frames and write what was drawn to ``record``;
``examples``: a directory that is the package ``taichi.examples`` (Taichi's examples import
each other from there: ``from taichi.examples.patterns import taichi_logo``);
``compile_log``: a file to which each kernel compilation is appended as a JSON line (kernel,
variant, seconds: :func:`_log_compiles`, for ``bench/compile_times.py``).
"""

import json
import os
import random
import runpy
import sys
import types

import numpy as np


def _nudge() -> None:
    """Every float NumPy's and ``random``'s draws return is one ulp larger."""
    def nudged(draw):
        def wrapper(*args, **kwargs):
            r = draw(*args, **kwargs)
            up = np.nextafter(r, np.inf)
            return float(up) if isinstance(r, float) else up
        return wrapper

    for name in ("randn", "rand", "random", "random_sample", "uniform", "normal"):
        setattr(np.random, name, nudged(getattr(np.random, name)))
    random.random = nudged(random.random)
    random.uniform = nudged(random.uniform)


def _log_compiles(ti, path: str) -> None:
    """Append one JSON line per kernel compilation to ``path``: ``{"kernel", "variant",
    "seconds"}``. difftape: the whole of ``Kernel._compile`` (frontend, passes, LLVM, load).
    Taichi: ``Kernel.materialize`` (the AST to Taichi IR) plus the ``prog.compile_kernel`` of
    the first launch of each compiled instance (passes, LLVM, loading), which is called once
    more here, ahead of the launch, so that the launch's own call finds it compiled and the
    kernel's run time is not counted."""
    import time

    def log(kernel: str, variant: str, seconds: float) -> None:
        with open(path, "a") as f:
            f.write(json.dumps({"kernel": kernel, "variant": variant,
                                "seconds": seconds}) + "\n")

    if hasattr(ti, "DifftapeError"):
        from difftape.frontend.kernel import Kernel

        compile_ = Kernel._compile

        def timed(self, prog, args, spec, variant="primal"):
            t0 = time.perf_counter()
            try:
                return compile_(self, prog, args, spec, variant)
            finally:
                log(self.name, variant, time.perf_counter() - t0)

        Kernel._compile = timed
        return
    from taichi.lang import impl, kernel_impl

    materialize, launch = kernel_impl.Kernel.materialize, kernel_impl.Kernel.launch_kernel
    pending: dict[int, float] = {}  # id(compiled kernel) -> materialize seconds
    done: set[int] = set()

    def variant(k) -> str:
        return {"NONE": "primal", "REVERSE": "grad", "FORWARD": "fwd"}.get(
            k.autodiff_mode.name, k.autodiff_mode.name.lower())

    def timed_materialize(self, key=None, args=None, arg_features=None):
        known = key in self.compiled_kernels if key is not None else True
        t0 = time.perf_counter()
        materialize(self, key, args, arg_features)
        if not known and key in self.compiled_kernels:
            pending[id(self.compiled_kernels[key])] = time.perf_counter() - t0

    def timed_launch(self, t_kernel, *args):
        if id(t_kernel) not in done:
            done.add(id(t_kernel))
            prog = impl.get_runtime().prog
            t0 = time.perf_counter()
            prog.compile_kernel(prog.config(), prog.get_device_caps(), t_kernel)
            log(self.func.__name__, variant(self),
                pending.pop(id(t_kernel), 0.0) + time.perf_counter() - t0)
        return launch(self, t_kernel, *args)

    kernel_impl.Kernel.materialize = timed_materialize
    kernel_impl.Kernel.launch_kernel = timed_launch


def run(script: str, argv: list, init: dict, gui: str = "noop", frames: int = 0,
        record: str = "", examples: str = "", compile_log: str = "") -> None:
    random.seed(0)
    np.random.seed(0)
    if os.environ.get("DIFFTAICHI_NUDGE"):
        _nudge()
    import taichi as ti

    if compile_log:
        _log_compiles(ti, compile_log)
    recorder = None
    if gui == "noop":
        import _noop

        ti.GUI = _noop.NoGUI
        if not hasattr(ti, "rgb_to_hex"):
            ti.rgb_to_hex = _noop.rgb_to_hex
    elif gui == "record":
        import _record

        recorder = _record.install(ti, frames)
    backend_init = ti.init

    def cpu_init(arch=None, **kwargs):
        kwargs.update(init)
        return backend_init(arch=ti.cpu, **kwargs)

    ti.init = cpu_init
    if examples:
        package = types.ModuleType("taichi.examples")
        package.__path__ = [examples]
        sys.modules["taichi.examples"] = ti.examples = package
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script, *argv]
    if recorder is None:
        runpy.run_path(script, run_name="__main__")
        return
    complete = False
    try:
        runpy.run_path(script, run_name="__main__")
        complete = True
    except _record.FramesDone:
        pass
    finally:
        recorder.save(record, complete)
