"""Logging levels under Taichi's names: ``ti.set_logging_level``, ``ti.is_logging_effective``,
``ti.init(log_level=...)`` and the constants ``ti.TRACE`` ... ``ti.CRITICAL``.

The level is that of Python's ``difftape`` logger (:mod:`logging`), the parent of every logger
difftape uses; those that do not set a level of their own (the service's do, from its
``--log-level``) follow it. Taichi's level names map onto Python's levels; ``trace`` is below
``debug`` and ``off`` above ``critical``, as in Taichi. The level starts at ``info``.
"""

from __future__ import annotations

import logging

from ..errors import OptionError

TRACE = "trace"
DEBUG = "debug"
INFO = "info"
WARN = "warn"
ERROR = "error"
CRITICAL = "critical"

#: Taichi's level names, least severe first, as Python logging levels.
LEVELS: dict[str, int] = {
    TRACE: 5, DEBUG: logging.DEBUG, INFO: logging.INFO, WARN: logging.WARNING,
    ERROR: logging.ERROR, CRITICAL: logging.CRITICAL, "off": logging.CRITICAL + 10,
}

#: What ``ti.init`` sets when it is not given ``log_level`` (Taichi's default).
DEFAULT = INFO

logger = logging.getLogger("difftape")
logger.setLevel(LEVELS[DEFAULT])


def level_name(level: str) -> str:
    """``level`` checked against Taichi's names; anything else is refused, as Taichi does."""
    if level not in LEVELS:
        raise OptionError(f"Unknown logging level [{level}]. Levels = {', '.join(LEVELS)}")
    return level


def set_logging_level(level: str) -> None:
    """``ti.set_logging_level(level)``: messages at ``level`` and more severe ones are shown
    (e.g. ``'warn'`` shows warnings, errors and critical messages). ``ti.init`` sets it again
    (to its ``log_level``, ``'info'`` by default), as in Taichi."""
    logger.setLevel(LEVELS[level_name(level)])


def is_logging_effective(level: str) -> bool:
    """``ti.is_logging_effective(level)``: would a message at ``level`` be shown now?"""
    return logger.isEnabledFor(LEVELS[level_name(level)])
