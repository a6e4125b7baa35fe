"""The difftape exception hierarchy.

Every error difftape raises on purpose derives from :class:`DifftapeError`, so a user (or the
remote client, which re-raises server errors by name) can catch them all in one place. Each
class also derives from the builtin exception a Python (and Taichi) user expects: a type error
in a kernel is a ``TypeError``, a failed ``assert`` an ``AssertionError``, an index out of range
an ``IndexError``. Taichi's names (``TaichiCompilationError``, ``TaichiTypeError``, ...) are
aliases of the classes with the same meaning.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import FrameType, TracebackType

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep
                 for k in ("stdlib", "platstdlib")})


def user_line() -> str:
    """``file:line`` of the innermost frame outside difftape (its package, and its client
    and server, which an editable install keeps in folders of their own): the user's code,
    for messages that point there (a graph's capture, a field declared and never placed)."""
    f = sys._getframe(1)
    while f is not None and (os.path.abspath(f.f_code.co_filename).startswith(_PACKAGE) or
                             str(f.f_globals.get("__name__", "")).startswith("difftape.")):
        f = f.f_back
    if f is None:
        return "<unknown>"
    return f"{f.f_code.co_filename}:{f.f_lineno}"


def _internal(frame: FrameType) -> bool:
    """Is ``frame`` difftape's own code (its package; its client and server)?"""
    return (os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE) or
            str(frame.f_globals.get("__name__", "")).startswith("difftape."))


def _innermost_internal(tb: TracebackType | None) -> bool:
    """Was the exception of traceback ``tb`` raised by difftape's own code (or Python's,
    called from it)? An exception without a traceback counts as internal."""
    if tb is None:
        return True
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    return _internal(frame) or os.path.abspath(frame.f_code.co_filename).startswith(_STDLIB)


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without difftape's frames, and without the standard library's frames that
    difftape's called (``functools``, ``contextlib``): what is left is the user's code."""
    kept: list[TracebackType] = []
    dropped = False
    while tb is not None:
        frame = tb.tb_frame
        dropped = _internal(frame) or (
            dropped and os.path.abspath(frame.f_code.co_filename).startswith(_STDLIB))
        if not dropped:
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for t in reversed(kept):
        out = TracebackType(out, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return out


def trim_traceback(exc: BaseException) -> None:
    """Cut difftape's internal frames from ``exc``'s traceback (in place), as Taichi does
    unless ``ti.init(print_full_traceback=True)``: a compile error's traceback would otherwise
    show the ~50 frames of the compiler between the user's kernel call and the message, which
    already names each kernel and func line down to the failing expression. Called by the
    public entry points (a kernel's call, ``kernel.grad``, a Tape's exit, ...) on the
    :class:`DifftapeError` leaving them, which then re-raise it with a bare ``raise``, adding
    no frame of their own.

    Exceptions chained to it are judged by where they were raised: one raised by the user's
    Python code (a helper run at compile time) keeps its user frames; an implicit context
    raised inside difftape (a lookup that failed before the error was raised) is hidden; an
    explicit cause raised inside difftape that is not a difftape error (a bug) is kept
    whole, for its report."""
    seen: set[int] = set()

    def visit(e: BaseException) -> None:
        if id(e) in seen:
            return
        seen.add(id(e))
        e.__traceback__ = _user_frames(e.__traceback__)
        cause, context = e.__cause__, e.__context__
        if cause is not None:
            if isinstance(cause, DifftapeError) or not _innermost_internal(cause.__traceback__):
                visit(cause)
        elif context is not None and not e.__suppress_context__:
            if isinstance(context, DifftapeError) or not _innermost_internal(
                    context.__traceback__):
                visit(context)
            else:
                e.__suppress_context__ = True

    visit(exc)


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
        # Where the compiler was when it failed, outermost first (the kernel's line, then each
        # func call down to the failing expression), as Taichi lays them out: 'File "f.py",
        # line 7, in foo:', the source, carets under the expression. Added by the frontend
        # (see add_frame) as the error leaves each function it is building.
        self.frames: list[str] = []
        self.frame_owner: object = None
        super().__init__(self._render())

    def add_frame(self, frame: str, owner: object) -> None:
        """Put ``frame`` (a rendered source location) before the others; ``owner`` (the
        function being built there) adds no second one for an enclosing expression."""
        self.frames.insert(0, frame)
        self.frame_owner = owner
        text = self._render()
        self.args = (text,)
        if isinstance(self, SyntaxError):
            self.msg = text  # what SyntaxError's str() shows

    def _render(self) -> str:
        if self.frames:
            return "\n" + "".join(self.frames) + self.bare_message
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


class KernelSyntaxError(CompileError, SyntaxError):
    """Python syntax that kernels do not support (``try``, ``lambda``, ``for/else``, ...)."""


class KernelNameError(CompileError, NameError):
    """A kernel or func uses a name that is not defined."""


class KernelTypeError(CompileError, TypeError):
    """A value of the wrong type in a kernel: a float index, a bitwise op on floats, a vector
    where a scalar is needed, a runtime value where a compile-time one is needed."""


class KernelIndexError(CompileError, IndexError):
    """An index that is wrong at compile time: the wrong number of indices for a field, a
    constant index outside a vector; also an ndarray indexed from Python with the wrong number
    of indices (Taichi's ``TaichiIndexError`` in both places)."""


class GradientRuleError(CompileError, RuntimeError):
    """A kernel breaks a rule under which its gradient could be computed correctly. Also a
    ``RuntimeError``: Taichi reports what its autodiff cannot differentiate as one."""


class KernelRuntimeError(DifftapeError, RuntimeError):
    """A failure at run time rather than compile time: a kernel failed while running, or a
    Python-scope request cannot be carried out (a gradient for an integer field or ndarray,
    a custom gradient for a function that is not ``@ti.ad.grad_replaced``). Taichi raises its
    ``TaichiRuntimeError`` (a ``RuntimeError``) for these, which is this class."""


class KernelAssertionError(KernelRuntimeError, AssertionError):
    """A check inside a running kernel failed: an ``assert`` under ``debug=True``."""


class IndexOutOfRangeError(KernelAssertionError, IndexError):
    """An index out of range, caught by the bounds checks of ``debug=True``."""


class ArgumentError(CompileError, TypeError, ValueError):
    """A kernel was called with arguments that do not match its signature (or an annotation
    is malformed). It is also a ``TypeError`` and a ``ValueError``: Taichi raises one or the
    other for these mistakes, so code written against either keeps catching it."""


def error_location(exc: BaseException) -> dict | None:
    """Where a :class:`CompileError` points (``{"file", "line", "source_line"}``), as the
    service sends it beside the bare message, so that the client raises it naming the same
    line, with the same text, as the local compiler; None for other errors and for one
    that points nowhere."""
    if not isinstance(exc, CompileError) or not exc.file:
        return None
    return {"file": exc.file, "line": exc.line, "source_line": exc.source_line}


def location_arguments(data: object) -> dict:
    """``error_location``'s dict, as received, back into :class:`CompileError` keyword
    arguments; anything malformed is dropped (a message is never refused for it)."""
    if not isinstance(data, dict):
        return {}
    file, line, text = data.get("file"), data.get("line"), data.get("source_line")
    if not isinstance(file, str):
        return {}
    return {"file": file,
            "line": line if type(line) is int else None,
            "source_line": text if isinstance(text, str) else None}


def compile_error_class(exc: BaseException) -> type[CompileError]:
    """The CompileError subclass for a builtin exception that user Python code (run while a
    kernel compiles: ti.static expressions, helper functions) raised."""
    for builtin, cls in ((SyntaxError, KernelSyntaxError), (NameError, KernelNameError),
                         (IndexError, KernelIndexError), (TypeError, KernelTypeError)):
        if isinstance(exc, builtin):
            return cls
    return CompileError


class CallSignatureError(ArgumentError, KernelSyntaxError):
    """A kernel or func called with arguments its parameters cannot take: too many, one
    missing, an unknown keyword, or a value given twice. Also a syntax error, as Taichi
    reports these (``TaichiSyntaxError``)."""

    __str__ = Exception.__str__  # not SyntaxError's, which prints its (unset) ``msg``


class OptionError(DifftapeError, ValueError):
    """``ti.init`` was given an option value difftape cannot honour."""


class ArchUnavailableError(DifftapeError, RuntimeError):
    """The arch a program asked for cannot run here (no CUDA device, no driver, no backend)
    and ``ti.init(enable_fallback=False)`` forbids running on the CPU instead (Taichi raises
    RuntimeError)."""


class UnknownOptionError(OptionError, KeyError):
    """``ti.init`` was given a keyword that is not an option (Taichi raises KeyError)."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0]) if self.args else ""


class IRValidationError(DifftapeError):
    """Kernel IR received from a client (the service's wire format) is malformed or asks for
    something the compiler does not accept. The message starts with the path of the offending
    value in the JSON, e.g. ``body[3].blocks[0][2]: ...``; ``path`` holds it alone."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class ShapeError(DifftapeError, ValueError):
    """Array shapes do not match (e.g. ``from_numpy`` with the wrong shape)."""


class OutOfMemoryError(DifftapeError, MemoryError):
    """Storage larger than this machine can give: a field (difftape stores every field
    densely, a sparse one at its full capacity) or an ndarray."""


class SolverError(DifftapeError, RuntimeError):
    """A ``ti.linalg`` factorisation or solve that cannot give the right answer: the matrix is
    singular, or not symmetric / positive definite as the chosen solver requires (Taichi
    reports these through ``solver.info()`` and returns what the factorisation left)."""


class ImageError(DifftapeError, ValueError, AssertionError):
    """An image, colour or shape that ``ti.GUI`` or ``ti.tools`` cannot draw or write: a
    dtype with no pixel meaning, the wrong resolution or channel count, an unknown image file
    type. Taichi raises a ``ValueError`` for some of these and fails an ``assert`` for the
    others, so this is both."""


class MediaError(DifftapeError, RuntimeError):
    """Something a picture needs that this process does not have: a window (difftape draws
    headless: ``ti.GUI(show_gui=False)``), ffmpeg for MP4 video, Graphviz's ``dot`` for
    ``Tape.visualize``'s SVG, or an image file that cannot be read or written. Taichi raises a
    ``RuntimeError`` for these."""


class GraphError(DifftapeError, RuntimeError):
    """A captured graph (``ti.graph``) cannot be built, bound or replayed as asked: an input
    of another shape or type than the one captured, an input never given a value, a graph of
    a program that ``ti.init``/``ti.reset`` ended, a saved graph that fails validation. Also a
    ``RuntimeError``, as Taichi's graph errors are."""


class GraphCaptureError(GraphError):
    """Something inside ``ti.graph.capture()`` that a replay could not repeat: a read of
    device data on the host (``x[i]``, ``to_numpy``, a kernel's return value, Python
    branching on a field), Python arithmetic on a graph input. The message names the line."""


# Taichi's exception names (taichi/lang/exception.py), for programs that catch them.
TaichiCompilationError = CompileError
TaichiSyntaxError = KernelSyntaxError
TaichiNameError = KernelNameError
TaichiTypeError = KernelTypeError
TaichiIndexError = KernelIndexError
TaichiRuntimeError = KernelRuntimeError
TaichiAssertionError = KernelAssertionError
TaichiRuntimeTypeError = ArgumentError
