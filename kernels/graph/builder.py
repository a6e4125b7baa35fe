"""Taichi's ``ti.graph`` API on difftape's graphs: ``GraphBuilder``, ``Arg``, ``ArgKind``.

``g = ti.graph.GraphBuilder(); g.dispatch(kernel, *args); graph = g.compile();
graph.run({"name": value, ...})``. Each ``dispatch`` records the kernel launch into a
:class:`~.core.Graph` as ``ti.graph.capture()`` does; ``ti.graph.Arg`` objects are its named
inputs. As in Taichi, an ndarray argument fixes its element type and number of dimensions,
not its shape: ``run`` binds arrays of any shape (their extents are written into the launch
contexts with their address). Dispatch checks the arguments against the kernel's annotations
with Taichi's words; textures do not exist here.
"""

from __future__ import annotations

import enum

from .. import types as T
from ..errors import ArgumentError, GraphError
from ..frontend.annotations import NdarrayType
from ..frontend.kernel import BoundKernel, Kernel
from ..frontend.matrix import MatrixType
from ..frontend.ndarray import Ndarray
from ..frontend.ops import resolve_dtype
from ..runtime import program
from .core import Graph, Placeholder, _Input, _Recorder, memory, refuse_program


class ArgKind(enum.Enum):
    """What a graph argument is (Taichi's ``ti.graph.ArgKind``)."""

    SCALAR = 0
    NDARRAY = 1
    MATRIX = 2
    TEXTURE = 3
    RWTEXTURE = 4


_POSITIONAL = ("tag", "name", "dtype", "ndim", "field_dim", "element_shape", "channel_format",
               "shape", "num_channels")


class Arg:
    """``ti.graph.Arg(kind, name, dtype, ndim=...)``: a named argument of a graph."""

    def __init__(self, *args, **kwargs) -> None:
        if len(args) > len(_POSITIONAL):
            raise GraphError(f"Unexpected {len(_POSITIONAL)}th positional argument")
        kwargs.update(zip(_POSITIONAL, args, strict=False))
        if "field_dim" in kwargs:  # Taichi's deprecated name for ndim
            if "ndim" in kwargs:
                raise GraphError("field_dim is deprecated, please do not specify field_dim "
                                 "and ndim at the same time.")
            kwargs["ndim"] = kwargs.pop("field_dim")
        tag = kwargs.pop("tag", None)
        if not isinstance(tag, ArgKind):
            raise GraphError(f"tag must be a ArgKind variant, but found {type(tag)}.")
        if tag in (ArgKind.TEXTURE, ArgKind.RWTEXTURE):
            raise GraphError("ti.graph texture arguments are not supported: difftape has no "
                             "textures")
        name = kwargs.pop("name", None)
        if not isinstance(name, str):
            raise GraphError(f"name must be a string, but found {type(name)}.")
        allowed = {ArgKind.SCALAR: {"dtype"}, ArgKind.MATRIX: {"dtype"},
                   ArgKind.NDARRAY: {"dtype", "ndim"}}[tag]
        unknown = set(kwargs) - allowed
        if unknown:
            raise GraphError(f"Invalid argument: {sorted(unknown)[0]}, you can only create a "
                             f"graph argument with: {['tag', 'name', *sorted(allowed)]}")
        dtype = kwargs.get("dtype")
        self.tag, self.name = tag, name
        self.element_shape: tuple = ()
        self.ndim = kwargs.get("ndim")
        if tag == ArgKind.SCALAR:
            if isinstance(dtype, MatrixType):
                raise GraphError("Tag ArgKind.SCALAR must specify a scalar type, but found "
                                 f"{type(dtype)}.")
            self.dtype = resolve_dtype(dtype)
        elif tag == ArgKind.MATRIX:
            if not isinstance(dtype, MatrixType):
                raise GraphError(f"Tag ArgKind.MATRIX must specify matrix type, but got "
                                 f"{dtype}.")
            self.dtype = dtype
        else:
            if self.ndim is None:
                raise GraphError(f"ti.graph.Arg '{name}': an ndarray argument needs ndim=")
            if isinstance(dtype, MatrixType):
                self.element_shape = dtype.element_shape
                dtype = dtype.scalar_dtype
            self.dtype = resolve_dtype(dtype)

    def _spec(self) -> tuple:
        return (self.tag, self.dtype if self.tag != ArgKind.MATRIX else
                (self.dtype.element_shape, self.dtype.scalar_dtype), self.element_shape,
                self.ndim)

    def __repr__(self) -> str:
        return f"<ti.graph.Arg {self.tag.name} '{self.name}'>"


class GraphBuilder:
    """Taichi's graph builder: ``dispatch`` kernels, then ``compile()`` the graph."""

    def __init__(self) -> None:
        if program.get().remote is not None:
            # Its stand-in arrays are local memory; ti.graph.capture() records the same
            # launches under arch=ti.remote (named inputs by g.input) and replays them there.
            raise GraphError("ti.graph.GraphBuilder is not available under arch=ti.remote: "
                             "record the launches with `with ti.graph.capture() as g:` (inputs "
                             "by g.input(name, value)) and run them with g.run({...})")
        refuse_program(program.get(), "ti.graph.GraphBuilder()")
        self._graph = Graph()
        self._specs: dict[str, tuple] = {}
        self._values: dict[str, object] = {}  # name -> the placeholder or stand-in array
        self._compiled = False

    def dispatch(self, kernel_fn, *args) -> None:
        """Add a launch of ``kernel_fn`` with ``args`` (``Arg``s are bound at ``run``)."""
        self._launch(self._prepare(kernel_fn, args))

    def create_sequential(self) -> Sequential:
        return Sequential(self)

    def append(self, node: Sequential) -> None:
        """Add the launches of a ``Sequential`` node, in order."""
        if not isinstance(node, Sequential):
            raise GraphError("GraphBuilder.append takes a Sequential "
                             "(GraphBuilder.create_sequential())")
        for call in node._calls:
            self._launch(call)

    def compile(self) -> Graph:
        """The graph, ready to ``run({...})``."""
        if self._compiled:
            raise GraphError("this GraphBuilder was already compiled")
        self._compiled = True
        self._graph._finish(program.get())
        return self._graph

    # ------------------------------------------------------------------ internals
    def _prepare(self, kernel_fn, args: tuple) -> tuple:
        """Check ``args`` against the kernel's annotations; the call to record."""
        if self._compiled:
            raise GraphError("this GraphBuilder was already compiled")
        kernel = kernel_fn.kernel if isinstance(kernel_fn, BoundKernel) else kernel_fn
        if not isinstance(kernel, Kernel):
            raise GraphError(f"dispatch takes a @ti.kernel, got {type(kernel_fn).__name__}")
        params = kernel.params[1:] if isinstance(kernel_fn, BoundKernel) else kernel.params
        if len(args) != len(params):
            raise ArgumentError(f"kernel '{kernel.name}' takes {len(params)} argument(s), "
                                f"dispatch got {len(args)}", kernel=kernel.name)
        concrete = []
        for p, a in zip(params, args, strict=True):
            if isinstance(a, Arg):
                _check_arg(kernel.name, p.name, p.annotation, a)
                a = self._value(a)
            concrete.append(a)
        return kernel_fn, tuple(concrete)

    def _value(self, arg: Arg):
        """The placeholder (scalar/matrix) or stand-in array (ndarray) of ``arg``."""
        spec = arg._spec()
        seen = self._specs.get(arg.name)
        if seen is not None:
            if seen != spec:
                raise GraphError(f"ti.graph.Arg '{arg.name}' is used with two different kinds "
                                 "or types; give each argument its own name")
            return self._values[arg.name]
        self._specs[arg.name] = spec
        g = self._graph
        if arg.tag == ArgKind.NDARRAY:
            # A one-element-per-axis stand-in: the kernel compiles for its kind, and run()
            # binds the real array's address and extents wherever the stand-in's are.
            stand_in = Ndarray(arg.dtype, (1,) * arg.ndim, arg.element_shape)
            inp = _Input(arg.name, "array", example=stand_in, dtype=arg.dtype,
                         element_shape=arg.element_shape, shape=None, ndim=arg.ndim)
            g._inputs[arg.name] = inp
            g._storage[id(memory(stand_in.storage))] = (arg.name, "primal")
            value = stand_in
        else:
            kind = "matrix" if arg.tag == ArgKind.MATRIX else "scalar"
            g._inputs[arg.name] = _Input(arg.name, kind, dtype=arg.dtype)
            value = Placeholder(arg.name, arg.dtype, g)
        self._values[arg.name] = value
        return value

    def _launch(self, call: tuple) -> None:
        kernel_fn, args = call
        prog = program.get()
        if prog.capture is not None:
            raise GraphError("GraphBuilder.dispatch inside ti.graph.capture()")
        prog.capture = _Recorder(self._graph, prog)
        self._graph._capturing = True
        try:
            kernel_fn(*args)
        finally:
            prog.capture = None
            self._graph._capturing = False


class Sequential:
    """A sequence of launches added to a graph together (``GraphBuilder.append``)."""

    def __init__(self, builder: GraphBuilder) -> None:
        self._builder = builder
        self._calls: list[tuple] = []

    def dispatch(self, kernel_fn, *args) -> None:
        self._calls.append(self._builder._prepare(kernel_fn, args))


def _check_arg(kernel: str, param: str, ann, arg: Arg) -> None:
    """Refuse an ``Arg`` whose kind or type does not fit the parameter (Taichi's words)."""
    def refuse(what: str) -> ArgumentError:
        return ArgumentError(f"kernel '{kernel}': argument '{param}': {what}", kernel=kernel)

    if arg.tag == ArgKind.NDARRAY:
        if not isinstance(ann, NdarrayType):
            raise refuse(f"ti.graph.Arg '{arg.name}' is an ndarray but the parameter is not "
                         "annotated ti.types.ndarray()")
        if ann.ndim is not None and ann.ndim != arg.ndim:
            raise refuse(f"Mismatch ndim {arg.ndim} of graph argument '{arg.name}': it "
                         f"doesn't match kernel's annotated ndim={ann.ndim}")
        want = ann.dtype
        if isinstance(want, MatrixType):
            if want.element_shape != arg.element_shape or (
                    want.dtype is not None and resolve_dtype(want.dtype) != arg.dtype):
                raise refuse(f"Mismatch dtype of graph argument '{arg.name}': it doesn't match "
                             f"kernel's annotated dtype={want!r}")
        elif want is not None and (resolve_dtype(want) != arg.dtype or arg.element_shape):
            raise refuse(f"Mismatch dtype {arg.dtype} of graph argument '{arg.name}': it "
                         f"doesn't match kernel's annotated dtype={resolve_dtype(want)}")
    elif arg.tag == ArgKind.SCALAR:
        if isinstance(ann, NdarrayType | MatrixType) or ann is None:
            raise refuse(f"ti.graph.Arg '{arg.name}' is a scalar but the parameter is "
                         f"annotated {ann!r}")
        want = ann if isinstance(ann, T.DType) else resolve_dtype(ann)
        if want != arg.dtype:
            raise refuse(f"Mismatch dtype {arg.dtype} of graph argument '{arg.name}': it "
                         f"doesn't match kernel's annotated dtype={want}")
    else:
        if not isinstance(ann, MatrixType) or ann.element_shape != arg.dtype.element_shape:
            raise refuse(f"Mismatch dtype of graph argument '{arg.name}' (a "
                         f"{arg.dtype.element_shape} matrix): it doesn't match kernel's "
                         f"annotated dtype={ann!r}")
