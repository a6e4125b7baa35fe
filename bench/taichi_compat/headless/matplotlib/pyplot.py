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


def _drawing(name):
    """A drawing function that records while ``_record`` records; else None."""
    record = sys.modules.get("_record")
    return record.plot_call(name) if record is not None and name in DRAWING else None


class _Axes(Nothing):
    """Axes whose drawing methods record like pyplot's (``ax = plt.gca(); ax.plot(...)``)."""

    def __getattr__(self, name):
        return _drawing(name) or super().__getattr__(name)


def gca(*args, **kwargs):
    return _Axes()


subplot = axes = gca


def subplots(*args, **kwargs):
    """(figure, axes) of one plot; a grid of plots has no headless stand-in."""
    if args or {"nrows", "ncols"} & set(kwargs):
        return Nothing(), Nothing()
    return Nothing(), _Axes()


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _drawing(name) or Nothing()
