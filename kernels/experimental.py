"""``ti.experimental``: what Taichi 1.7.4 still has there, for programs that use it.

``ti.experimental.real_func`` is ``ti.real_func`` (Taichi moved it out of experimental and
deprecated the old name: programs keep working, with Taichi's DeprecationWarning).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from .frontend.decorators import real_func as _real_func


def real_func(func: Callable) -> Callable:
    """``ti.real_func``, under its deprecated name."""
    warnings.warn("ti.experimental.real_func is deprecated because it is no longer experimental. "
                  "Use ti.real_func instead.", DeprecationWarning, stacklevel=2)
    return _real_func(func)


__all__ = ["real_func"]
