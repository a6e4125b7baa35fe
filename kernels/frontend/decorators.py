"""``@ti.kernel`` and ``@ti.func``."""

from __future__ import annotations

import functools
import inspect

from .kernel import Kernel, defined_in_class


class Func:
    """A ``@ti.func``: inlined at every call site inside a kernel (so it may take and return
    vectors, matrices and tuples, and be specialized by its arguments for free)."""

    def __init__(self, pyfunc) -> None:
        self.pyfunc = pyfunc
        self.signature = inspect.signature(pyfunc)
        # Defined in a class body (a method of a @ti.dataclass or @ti.data_oriented class):
        # its unannotated first parameter (`self`) is the object itself, as in Taichi.
        self.classfunc = defined_in_class(pyfunc)
        self.__name__ = pyfunc.__name__
        self.__doc__ = pyfunc.__doc__
        self.__wrapped__ = pyfunc

    def __call__(self, *args, **kwargs):
        from . import builder

        bld = builder.current()
        if bld is None:
            raise TypeError(f"@ti.func '{self.__name__}' can only be called from a kernel or "
                            "another func")
        from .transformer import inline_func

        return inline_func(bld, self, list(args), kwargs)

    def __get__(self, obj, objtype=None):
        """``obj.func`` (a method of a ``@ti.data_oriented`` object): the func with ``obj``
        as its first argument."""
        return self if obj is None else functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"<difftape func {self.__name__}>"


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


real_func = func
pyfunc = func


def data_oriented(cls: type) -> type:
    """``@ti.data_oriented``: a class whose methods may be kernels and funcs over the fields it
    holds (``self.x``). ``obj.kernel(...)`` passes ``obj`` as ``self``, bound at compile time
    like a ``ti.template()`` argument; objects of the class may be template arguments too."""
    cls._data_oriented = True
    return cls
