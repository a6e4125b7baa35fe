"""Progress bars where a user waits: a remote job, a long back-propagation, a Jacobian or
Hessian built column by column.

The bars are tqdm's (``tqdm.auto``: a widget in Jupyter, a text bar on a terminal's stderr),
an optional dependency: without tqdm nothing is shown, unless a caller asked for a bar
explicitly (``progress=True``), which is refused saying how to install it.
``DIFFTAPE_PROGRESS=0`` turns them all off. A bar appears only once its operation has run for
:data:`DELAY_S` seconds, so the short calls of a training loop print nothing.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import OptionError

#: Seconds an operation runs before its bar appears.
DELAY_S = 1.0
#: Seconds between two redraws of a bar.
REDRAW_S = 0.1


def enabled() -> bool:
    """Whether bars are on (``DIFFTAPE_PROGRESS``, default on)."""
    return os.environ.get("DIFFTAPE_PROGRESS", "1").strip().lower() not in (
        "0", "false", "no", "off")


class _NoBar:
    """What a bar's user calls, doing nothing."""

    n = 0
    total: int | None = None

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def bar(total: int | None, desc: str, *, show: bool | None = None, unit: str = "it",
        leave: bool = False) -> Any:
    """A tqdm bar of ``total`` steps (a context manager with ``update``), or one that shows
    nothing. ``show``: None follows :func:`enabled` and whether tqdm is installed; True
    insists (an :class:`OptionError` without tqdm); False shows nothing. ``leave``: keep the
    finished bar on screen."""
    if show is False or (show is None and not enabled()):
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if show:
            raise OptionError("progress=True draws its bar with tqdm, which is not installed: "
                              "pip install tqdm (or pass progress=False)") from None
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, leave=leave, delay=0 if show else DELAY_S,
                mininterval=REDRAW_S, dynamic_ncols=True)
