"""``@ti.kernel`` and ``@ti.func`` (the ``Func`` object lives with the transformer that
inlines it)."""

from __future__ import annotations

from .kernel import Kernel
from .transformer import Func


def kernel(fn=None, **_options):
    """Compile ``fn`` as a kernel: its outermost loops run in parallel on all cores."""
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


def func(fn=None, **_options):
    """Mark ``fn`` as a func callable from kernels (inlined)."""
    if fn is None:
        return lambda f: Func(f)
    return Func(fn)


def real_func(fn=None, **_options):
    """``@ti.real_func``: a func whose parameters and return are annotated (checked as Taichi
    checks them); inlined like ``@ti.func``, which gives the same results."""
    if fn is None:
        return lambda f: Func(f, real=True)
    return Func(fn, real=True)


def pyfunc(fn=None, **_options):
    """``@ti.pyfunc``: a func (inlined into kernels) that Python scope may call too, where it
    runs as the plain Python function it is."""
    if fn is None:
        return lambda f: Func(f, python=True)
    return Func(fn, python=True)


def data_oriented(cls: type) -> type:
    """``@ti.data_oriented``: a class whose methods may be kernels and funcs over the fields it
    holds (``self.x``). ``obj.kernel(...)`` passes ``obj`` as ``self``, bound at compile time
    like a ``ti.template()`` argument; objects of the class may be template arguments too."""
    cls._data_oriented = True
    return cls
