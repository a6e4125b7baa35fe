"""Run one Taichi program (or one function or benchmark class of it) on the CPU, the same way on
Taichi and on difftape, and save every field it created, and their gradients, to an .npz.

    PYTHON run_program.py OUT.npz PROGRAM.py FUNC [ARGS-JSON]

FUNC: ``__main__`` (the script itself; ``argv`` in ARGS), ``CLASS:Name`` (a taichi_benchmark
``TaichiBenchmark`` subclass: ``init(**ARGS)``, then ``run_iter()`` ``_iters`` times), or the
name of a function called with ``**ARGS``. Run by ``realprogs.py`` with Taichi's Python and with
difftape's (through the ``taichi`` alias, ``../taichi_compat/alias.py``), so everything here
must work on both. What makes the two runs comparable:

* ``ti.init`` always gets ``arch=ti.cpu, cpu_max_num_threads=1, fast_math=False`` (one thread:
  atomic float sums in one order; IEEE arithmetic on both compilers), GPU-only options dropped;
* ``ti.random()`` is replaced by a hash of a serial counter (the two backends' generators
  differ; one thread makes the sequence of calls the same);
* ``ti.GUI`` is a stand-in that ends the program after ``FRAMES`` (3) shown frames;
* the fields are those made through ``ti.field`` / ``ti.Vector.field`` / ``ti.Matrix.field``, in
  creation order (a ``@ti.dataclass`` field is not recorded: compare what the program writes).
"""

import importlib.util
import json
import os
import random
import runpy
import sys

import numpy as np
import taichi as ti

HERE = os.path.dirname(os.path.abspath(__file__))
out, path, func = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3]
args = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
created = []
counter = [None]
_init, _field = ti.init, ti.field


def init(arch=None, **kw):
    for k in ("device_memory_GB", "device_memory_fraction", "kernel_profiler", "offline_cache"):
        kw.pop(k, None)
    kw.update(cpu_max_num_threads=1, fast_math=False, random_seed=0)
    created.clear()
    r = _init(arch=ti.cpu, **kw)
    counter[0] = _field(ti.u32, shape=())
    return r


ti.init = init
if not hasattr(ti, "Tape"):  # Taichi 1.7.4 dropped ti.Tape; older programs use it
    ti.Tape = ti.ad.Tape


@ti.func
def _det_random():
    c = ti.atomic_add(counter[0][None], ti.u32(1))
    h = c * ti.u32(2654435761)
    h ^= h >> ti.u32(16)
    h *= ti.u32(0x85EBCA6B)
    h ^= h >> ti.u32(13)
    h *= ti.u32(0xC2B2AE35)
    h ^= h >> ti.u32(16)
    return ti.cast(h >> ti.u32(8), ti.f32) * (1.0 / 16777216.0)


def _random(dtype=None):
    r = _det_random()
    if dtype is not None and dtype not in (float, ti.f32, ti.f64):
        r = ti.cast(r * 4294967296.0, dtype)
    return r


ti.random = _random
depth = [0]


def _recorded(fn):
    def wrapper(*a, **k):
        depth[0] += 1
        try:
            f = fn(*a, **k)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            created.append(f)
        return f
    return wrapper


ti.field = _recorded(_field)
for cls in (ti.Vector, ti.Matrix):
    cls.field = _recorded(cls.field)


class _GUI:
    ESCAPE, SPACE, LMB, RMB = "Escape", " ", "LMB", "RMB"

    def __init__(self, *a, **k):
        self.frames = 0

    @property
    def running(self):
        return self.frames < int(os.environ.get("FRAMES", 3))

    @running.setter
    def running(self, v):
        pass

    def get_events(self, *a):
        return []

    def get_cursor_pos(self):
        return (0.5, 0.5)

    def is_pressed(self, *a):
        return False

    def show(self, *a, **k):
        self.frames += 1

    def __getattr__(self, name):
        return lambda *a, **k: None


ti.GUI = _GUI
sys.path.insert(0, os.path.dirname(path))
os.chdir(os.path.dirname(path))
np.random.seed(0)
random.seed(0)
if func == "__main__":
    sys.argv = [path] + list(args.get("argv", []))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit:
        pass
else:
    sys.path.insert(0, os.path.join(HERE, "stub"))  # taichi_benchmark's core.taichi
    spec = importlib.util.spec_from_file_location("program", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if func.startswith("CLASS:"):
        ti.init(arch=ti.cpu)
        bm = getattr(mod, func[6:])()
        iters = args.pop("_iters", 3)
        bm.init(**args)
        for _ in range(iters):
            bm.run_iter()
    else:
        getattr(mod, func)(**args)
res = {}
for n, f in enumerate(created):
    try:
        res[f"f{n}"] = f.to_numpy()
        if getattr(f, "grad", None) is not None:
            res[f"f{n}.grad"] = f.grad.to_numpy()
    except Exception as e:  # noqa: BLE001 - a field the program destroyed: say so, go on
        print("cannot read field", n, type(e).__name__, str(e)[:100])
np.savez(out, **res)
print("fields", len(res))
