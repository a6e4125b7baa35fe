"""Headless stand-in for matplotlib.pyplot (used only where matplotlib is not installed;
where it is, the harness forces the Agg backend instead): every call does nothing, except that
drawing calls are recorded where ``bench/taichi_examples.py`` records what a program draws."""

import sys

from _noop import Nothing


def use(*args, **kwargs):
    return None


#: Drawing functions whose data is recorded while ``_record`` records (bench/taichi_examples.py).
DRAWING = ("plot", "imshow", "scatter", "bar", "hist", "semilogx", "semilogy", "loglog",
           "contour", "contourf", "quiver", "matshow", "pcolormesh", "fill", "errorbar", "step")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    record = sys.modules.get("_record")
    if record is not None and name in DRAWING:
        return record.plot_call(name)
    return Nothing()
