"""Runs a Taichi program in this process as the harnesses want it (``bench/program_runs.py``
writes the ``_run_example.py`` that calls :func:`run`).

Python's ``random`` and NumPy's generator are seeded with 0 (with ``DIFFTAICHI_NUDGE`` in the
environment every float they draw is one ulp larger: ``bench/difftaichi.py``'s chaos probe);
``ti.init`` runs on the CPU whatever arch the program asks for, with ``init`` added to its
options; ``ti.GUI`` is, by ``gui``: ``"noop"`` a no-op (``_noop.NoGUI``), ``"real"`` the
backend's own, ``"record"`` the recording stand-ins of ``_record`` (``ti.GUI`` and ``ti.ui``),
which end the program after ``frames`` shown frames and write what was drawn to ``record``;
``examples``: a directory that is the package ``taichi.examples`` (Taichi's examples import
each other from there: ``from taichi.examples.patterns import taichi_logo``).
"""

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


def run(script: str, argv: list, init: dict, gui: str = "noop", frames: int = 0,
        record: str = "", examples: str = "") -> None:
    random.seed(0)
    np.random.seed(0)
    if os.environ.get("DIFFTAICHI_NUDGE"):
        _nudge()
    import taichi as ti

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
