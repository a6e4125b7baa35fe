"""The difftape exception hierarchy.

Every error difftape raises on purpose derives from :class:`DifftapeError`, so a user (or the
remote client, which re-raises server errors by name) can catch them all in one place.
"""

from __future__ import annotations


class DifftapeError(Exception):
    """Base class of all difftape errors."""


class CompileError(DifftapeError):
    """A kernel could not be compiled: unsupported syntax, a type error, wrong arguments.

    The message names the kernel, the file and the line, and quotes the source line, because
    the traceback itself points into the compiler rather than at the user's code.
    """

    def __init__(self, message: str, *, kernel: str | None = None, file: str | None = None,
                 line: int | None = None, source_line: str | None = None) -> None:
        self.bare_message = message
        self.kernel = kernel
        self.file = file
        self.line = line
        self.source_line = source_line
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.kernel:
            where.append(f"in kernel '{self.kernel}'")
        if self.file:
            where.append(f"{self.file}:{self.line}" if self.line else self.file)
        text = self.bare_message
        if where:
            text = f"{text}\n  {', '.join(where)}"
        if self.source_line:
            text = f"{text}\n    {self.source_line.strip()}"
        return text


class GradientRuleError(CompileError):
    """A kernel breaks a rule under which its gradient could be computed correctly."""


class KernelAssertionError(DifftapeError):
    """A check inside a running kernel failed (e.g. an index out of range with debug=True)."""


class ArgumentError(CompileError, TypeError, ValueError):
    """A kernel was called with arguments that do not match its signature (or an annotation
    is malformed). It is also a ``TypeError`` and a ``ValueError``: Taichi raises one or the
    other for these mistakes, so code written against either keeps catching it."""


class IRValidationError(DifftapeError):
    """Kernel IR received from a client (the service's wire format) is malformed or asks for
    something the compiler does not accept. The message starts with the path of the offending
    value in the JSON, e.g. ``body[3].blocks[0][2]: ...``; ``path`` holds it alone."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class ShapeError(DifftapeError, ValueError):
    """Array shapes do not match (e.g. ``from_numpy`` with the wrong shape)."""
