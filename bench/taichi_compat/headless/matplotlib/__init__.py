"""Headless stand-in for matplotlib (used only where matplotlib is not installed; where it is,
the harness forces the Agg backend instead): every call does nothing."""

from _noop import Nothing


def use(*args, **kwargs):
    return None


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return Nothing()
