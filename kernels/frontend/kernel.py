"""Kernels: specialization, compilation (through the cache) and launching.

``Kernel.__call__`` is the hot path. It finds the compiled instance for the argument kinds,
writes scalar arguments into the launch context (a NumPy view over one ctypes array), and calls
the compiled tasks: serial ones and small ranges inline on the calling thread, large ranges in
chunks on the thread pool. Nothing per element happens in Python.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import numbers
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import types as T
from .._version import __version__
from ..autodiff import validation
from ..autodiff.lost import NO_FLOW, lost_flow
from ..autodiff.validation import NOT_WITH_FORWARD_MODE
from ..codegen import get_target
from ..codegen.layout import CtxLayout, ctx_layout
from ..codegen.llvm_lowering import Lowering, notify_compiled
from ..errors import (
    ArgumentError,
    CallSignatureError,
    CompileError,
    DifftapeError,
    KernelSyntaxError,
)
from ..ir import serialize
from ..ir.assertfmt import assert_messages
from ..ir.nodes import Buffer, KernelIR, task_blocks, walk
from ..ir.passes import run_pipeline
from ..ir.printer import format_kernel
from ..runtime import cache, program
from ..runtime.devicearrays import (
    call_with_device_arrays,
    is_device_array,
    shares_device_memory,
)
from ..runtime.foreign import ArrayExchange, call_with_arrays
from ..runtime.grid import GridKernel
from ..runtime.launch import raise_error_word
from ..runtime.storage import BorrowedStorage, DeviceStorage, Storage
from . import builder as _b
from .annotations import (
    NdarrayType,
    SparseMatrixBuilderType,
    Template,
    _element_matches,
    _element_text,
    _resolve_annotation,
    signature_text,
)
from .argpack import ArgPack, ArgPackType
from .field import refuse_unplaced
from .matrix import Matrix, MatrixType
from .ndarray import Ndarray, tensor_with_grad
from .ops import resolve_dtype
from .sparse import finish_struct_fors, sparse_levels
from .struct import Struct, StructType
from .transformer import build_kernel_body, call_mismatch, defined_in_class, parse_function

TASK_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32)
BOUNDS_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
# Below this many (iterations x statements) a range runs on the calling thread: waking the
# pool costs tens of microseconds, more than small loops take.
INLINE_WORK = 1 << 15
#: Deterministic mode: an ordered task's range is cut into at most this many chunks, of at
#: least MIN_CHUNK_WORK (iterations x statements) each, so chunk boundaries depend on the range
#: and the task alone, never on the thread count (enough chunks to balance 16 threads).
DETERMINISTIC_CHUNKS = 64
MIN_CHUNK_WORK = 1 << 12
_ANY, _SERIAL, _ORDERED = 0, 1, 2
#: An "any" task with per-chunk partial sums (passes/reduce.py's epilogue): its result depends
#: on the chunk boundaries, so its chunks run whole (ThreadPool.run's ``whole``), never in
#: grains another thread may take over, which would move the boundaries with the timing and
#: make a reduction's last bits differ from run to run far more often (local != remote).
_WHOLE = 3
_SCHEDULES = {"any": _ANY, "serial": _SERIAL, "ordered": _ORDERED}
#: ndarray arguments taken as they are; others (tensors) go through runtime/foreign.py
#: (Storage: a CUDA array's memory, runtime/devicearrays.py).
_NATIVE_ARRAYS = (np.ndarray, Ndarray, Storage)
#: Derivative variants whose launches are checked for derivatives lost through storage without
#: a companion (autodiff/lost.py), and the companion they need.
LOST_ROLE = {"fwd": "dual", "grad": "grad", "grad_fwd": "grad"}


def deterministic_chunk(n: int, weight: int) -> int:
    """The fixed chunk size of an ordered task over ``n`` iterations of ``weight``."""
    return max(-(-n // DETERMINISTIC_CHUNKS), -(-MIN_CHUNK_WORK // weight))


@dataclass
class _Param:
    name: str
    annotation: object


@dataclass
class CompileStats:
    frontend_s: float = 0.0
    passes_s: float = 0.0
    llvm_s: float = 0.0
    load_s: float = 0.0
    cache_hit: bool = False


class Kernel:
    """A ``@ti.kernel``: compiled on first call for each kind of argument, then launched."""

    #: Marks kernel objects for the transformer, which refuses calling one inside a kernel.
    _kernel_object = True

    def __init__(self, pyfunc) -> None:
        self.pyfunc = pyfunc
        self.name = pyfunc.__name__
        self.__doc__ = pyfunc.__doc__
        self.__name__ = self.name
        self.__wrapped__ = pyfunc
        sig = inspect.signature(pyfunc)
        # The parameters as declared (what callers pass) ...
        self.arg_params = [_Param(p.name, _resolve_annotation(p.annotation, pyfunc))
                           for p in sig.parameters.values()]
        # Defined in a class body (a method of a @ti.data_oriented class): its unannotated
        # first parameter (`self`) is the object, bound at compile time like a template.
        self.method = defined_in_class(pyfunc)
        if self.method and self.arg_params and self.arg_params[0].annotation is None:
            self.arg_params[0].annotation = Template()
        # ... and as compiled and launched: an argument pack parameter is one parameter per
        # member (frontend/argpack.py); the same list when the kernel takes no pack.
        self._packs = any(isinstance(p.annotation, ArgPackType) for p in self.arg_params)
        self.params = [_Param(name, ann) for p in self.arg_params
                       for name, ann in (p.annotation.leaves(p.name)
                                         if isinstance(p.annotation, ArgPackType)
                                         else [(p.name, p.annotation)])]
        self.return_annotation = _resolve_annotation(sig.return_annotation, pyfunc)
        self._instances: dict = {}
        self._ndarray_descs: dict = {}
        self._generation = -1
        self._fast: CompiledKernel | None = None
        self._simple = all(not isinstance(p.annotation, Template | NdarrayType)
                           for p in self.params)
        # ti.types.ndarray() parameters: tensors of other libraries passed there are viewed
        # as NumPy arrays first (runtime/foreign.py).
        self._array_args = tuple(k for k, p in enumerate(self.params)
                                 if isinstance(p.annotation, NdarrayType)
                                 and not isinstance(p.annotation, SparseMatrixBuilderType))
        self.last_compile: CompileStats | None = None
        self.no_grad = False  # set by @ti.ad.no_grad: a Tape runs it but never differentiates
        self._adjoint: AdjointKernel | None = None
        self._variants: dict[str, dict] = {}  # other compiled variants ("validate")

    def __get__(self, obj, objtype=None):
        """``obj.kernel``: the kernel with ``obj`` as its first argument (``self``)."""
        if obj is None:
            return self
        if not getattr(type(obj), "_data_oriented", False):
            raise KernelSyntaxError(f"kernel '{self.name}' is a method of class "
                                    f"{type(obj).__name__}: decorate the class with "
                                    "@ti.data_oriented", kernel=self.name)
        return BoundKernel(self, obj)

    def __call__(self, *args, **kwargs):
        # (zero-cost unless raised) difftape's errors leave with the user's frames only
        try:
            if kwargs:
                args = self._bind_kwargs(args, kwargs)
            if self._packs:
                args = self.flatten_packs(args)
            if self._array_args and len(args) == len(self.params):
                for k in self._array_args:
                    if not isinstance(args[k], _NATIVE_ARRAYS):
                        return self.foreign_call(self.__call__, args)
            prog = program.get()
            if prog.await_passes is not None:  # (a JAX call's passes still to run)
                prog.await_passes()
            if prog.unplaced:  # fields not placed (Taichi refuses at materialization)
                refuse_unplaced(prog, self.name)
            if prog.generation != self._generation:
                self._reset_instances(prog)
            if prog.remote is not None:  # arch=ti.remote: queued for the server (difftape.client)
                return prog.remote.call_kernel(self, args)
            if prog.fwd is not None and (self.no_grad or prog.no_tangents):
                # An empty derivative in forward mode: what the kernel writes gets tangent zero
                # (leaving the .dual as it was would pass on a stale tangent).
                return self.instance(args, "fwd_const").launch(args)
            if (prog.tape is not None or prog.fwd is not None) and not self.no_grad:
                return self._call_differentiated(prog, args)
            if self._simple:
                inst = self._fast
                if inst is None:
                    inst = self._fast = self._compile(prog, args, ())
                return inst.launch(args)
            key, spec = self._specialize(args)
            inst = self._instances.get(key)
            if inst is None:
                inst = self._instances[key] = self._compile(prog, args, spec)
            return inst.launch(args)
        except DifftapeError as e:
            program.user_error(e)
            raise

    def flatten_packs(self, args: tuple) -> tuple:
        """The arguments as the compiled kernel takes them: each argument pack replaced by its
        members (arguments already so, e.g. a recorded launch replayed by a Tape, are kept)."""
        if len(args) == len(self.params) and not any(isinstance(a, ArgPack) for a in args):
            return args
        if len(args) != len(self.arg_params):
            raise self._arg_count_error(args)
        out: list = []
        for p, a in zip(self.arg_params, args, strict=True):
            ann = p.annotation
            if not isinstance(ann, ArgPackType):
                out.append(a)
            elif not isinstance(a, ArgPack):
                raise ArgumentError(f"kernel '{self.name}': argument '{p.name}' must be a "
                                    f"{ann!r}, got a {type(a).__name__}", kernel=self.name)
            else:
                out.extend(a.flat(ann, f"kernel '{self.name}': argument '{p.name}'"))
        return tuple(out)

    def foreign_call(self, call: Callable, args: tuple):
        """``call(*args)`` with the PyTorch/JAX/DLPack arrays among the ndarray arguments
        viewed as NumPy arrays (see runtime/foreign.py), or, on a grid program, CUDA arrays
        as their device memory (runtime/devicearrays.py)."""
        if len(args) != len(self.params):
            raise self._arg_count_error(args)
        names = [p.name for p in self.params]
        allocator = program.get().allocator
        if shares_device_memory(allocator):
            # (fields and ndarrays are not taken for ndarray parameters, as on the CPU)
            device = [k for k in self._array_args if is_device_array(args[k])
                      and not isinstance(args[k], ArrayExchange)]
            if device:
                def host_arrays(*a):
                    return call_with_arrays(call, self.name, names, a, self._array_args)
                return call_with_device_arrays(host_arrays, self.name, names, args, device,
                                               allocator)
        return call_with_arrays(call, self.name, names, args, self._array_args)

    def bind_tensor_grads(self, args: tuple) -> tuple:
        """``args`` with each PyTorch tensor that carries a gradient (``requires_grad`` or a
        ``.grad``) replaced by an Ndarray over its memory and its ``.grad``'s, for the adjoint
        kernel: it adds into ``tensor.grad``, as Taichi's does (see
        :func:`~.ndarray.tensor_with_grad`)."""
        out = list(args)
        for i in self._array_args:
            p = self.params[i]
            nd = tensor_with_grad(args[i], p.annotation,
                                  f"kernel '{self.name}': argument '{p.name}'")
            if nd is not None:
                out[i] = nd
        return tuple(out)

    def _call_differentiated(self, prog, args: tuple):
        """A launch inside a Tape (recorded) and/or forward mode (the tangent variant)."""
        tape = prog.tape
        if tape is not None:
            tape.record(self, args)
            if tape.validation and not tape._suspended:
                if prog.fwd is not None:
                    raise DifftapeError(NOT_WITH_FORWARD_MODE)
                return self.instance(args, "validate").launch(args)
        if prog.fwd is None:
            return self.instance(args, "primal").launch(args)
        inst = self.instance(args, "fwd")
        prog.fwd.lost.launch(self.name, inst.lost, args)
        return inst.launch(args)

    def _reset_instances(self, prog) -> None:
        self._instances.clear()
        self._ndarray_descs.clear()  # float/int annotations follow the new default_fp/ip
        self._fast = None
        if self._adjoint is not None:
            self._adjoint.instances.clear()
        self._variants.clear()
        self._generation = prog.generation

    def instance(self, args: tuple, variant: str = "primal") -> CompiledKernel:
        """The compiled ``variant`` for these arguments: "primal", "grad" (reverse mode),
        "fwd" (forward mode), "grad_fwd" (forward-over-reverse), "fwd_const" (forward mode of a
        no_grad kernel: zero tangents for what it writes) or "validate"."""
        if len(args) != len(self.params):
            raise self._arg_count_error(args)
        prog = program.get()
        if prog.generation != self._generation:
            self._reset_instances(prog)
        # A kernel without template or ndarray parameters has one specialization: nothing to
        # look at per call (a launch inside a Tape asks here twice, and again for its .grad).
        key, spec = ((), ()) if self._simple else self._specialize(args)
        if variant == "primal":
            if self._simple:
                if self._fast is None:
                    self._fast = self._compile(prog, args, ())
                return self._fast
            table = self._instances
        elif variant == "grad":
            table = self.grad.instances
        else:
            table = self._variants.setdefault(variant, {})
        # Derivative variants depend on which .grad/.dual storage exists when they are built.
        key = (key, prog.storage_epoch)
        inst = table.get(key)
        if inst is None:
            inst = table[key] = self._compile(prog, args, spec, variant)
        return inst

    def _bind_kwargs(self, args: tuple, kwargs: dict) -> tuple:
        names = [p.name for p in self.arg_params]
        self._check_call(len(args), kwargs)
        out = list(args) + [None] * (len(names) - len(args))
        for k, v in kwargs.items():
            out[names.index(k)] = v
        return tuple(out)

    def _check_call(self, nargs: int, keywords) -> None:
        """Refuse a call whose arguments do not fit the parameters (none has a default)."""
        names = [p.name for p in self.arg_params]
        labels = [f"{p.name} : {p.annotation}" if p.annotation is not None else p.name
                  for p in self.arg_params]
        why = call_mismatch(names, labels, set(names), nargs, keywords)
        if why is not None:
            raise CallSignatureError(f"kernel '{self.name}': {why} (parameters: "
                                     f"{', '.join(names) or 'none'})", kernel=self.name)

    def _specialize(self, args: tuple) -> tuple[tuple, tuple]:
        if len(args) != len(self.params):
            raise self._arg_count_error(args)
        key = []
        spec = []
        for index, (p, a) in enumerate(zip(self.params, args, strict=True)):
            ann = p.annotation
            if isinstance(ann, Template):
                if isinstance(a, Ndarray):
                    raise ArgumentError(f"kernel '{self.name}': argument '{p.name}' is a "
                                        "ti.ndarray: Ndarray shouldn't be passed in via "
                                        "ti.template(); annotate the parameter "
                                        "ti.types.ndarray()",
                                        kernel=self.name)
                k = ("t", id(a)) if not isinstance(a, numbers.Number | str | tuple) else ("v", a)
                key.append(k)
                spec.append(a)
            elif isinstance(ann, NdarrayType):
                # The checks run on every call; their verdict is cached per kind of array.
                kind = (index, _ndarray_kind(ann, a))
                desc = self._ndarray_descs.get(kind)
                if desc is None:
                    desc = _ndarray_desc(self.name, p.name, ann, a)
                    if kind[1] is not None:
                        self._ndarray_descs[kind] = desc
                key.append(desc)
                spec.append(desc)
            else:
                key.append(None)
                spec.append(None)
        return tuple(key), tuple(spec)

    def _arg_count_error(self, args: tuple) -> ArgumentError:
        try:
            self._check_call(len(args), {})
        except CallSignatureError as e:
            return e
        return ArgumentError(f"kernel '{self.name}' takes {len(self.arg_params)} argument(s) "
                             f"but {len(args)} were given", kernel=self.name)

    # ------------------------------------------------------------------ compilation
    def build_ir(self, prog, spec: tuple, variant: str = "primal") -> KernelIR:
        """The kernel's IR for one specialization and variant, before the pass pipeline."""
        ir = self._frontend_ir(prog, spec, adjoint=variant in ("grad", "grad_fwd"))
        has = lambda buf, role: has_storage(prog, spec, buf, role)
        if variant == "validate":
            # Function-level: the autodiff transforms (~15 ms of import) load with the first
            # derivative compiled, not with `import difftape`.
            from ..autodiff.reverse import ReverseAD

            ad = ReverseAD(self._frontend_ir(prog, spec, adjoint=True),
                           lambda buf: has(buf, "grad"))
            ad.build()
            return validation.instrument(ir, prog, ad.mattering)
        role = LOST_ROLE.get(variant)
        flow = lost_flow(ir, lambda buf: has(buf, role)) if role is not None else None
        ir = derive(ir, variant, has, lambda buf: sparse_levels(prog, buf))
        ir.lost = flow
        return ir

    def _frontend_ir(self, prog, spec: tuple, adjoint: bool) -> KernelIR:
        """The IR the frontend builds; ``adjoint``: the source of reverse mode (writes do
        not activate sparse cells there, see frontend/sparse.py)."""
        cfg = prog.config
        parsed = parse_function(self.pyfunc)
        bld = _b.Builder(self.name, parsed.file, default_fp=cfg.default_fp,
                         default_ip=cfg.default_ip, debug=cfg.debug)
        rt = self.return_annotation
        if isinstance(rt, ArgPackType):
            raise KernelSyntaxError(f"kernel '{self.name}' is annotated to return an argument "
                                    "pack: a pack is a kind of parameter, not a value; return "
                                    "a struct (ti.types.struct) instead", kernel=self.name)
        if rt is not None:
            if isinstance(rt, MatrixType | StructType | tuple):
                bld.return_type = _return_leaf_types(rt, cfg)
                bld.return_annotation = rt
            else:
                bld.return_type = _scalar_dtype(rt, cfg)
        if not self._simple and len(spec) != len(self.params):
            raise self._arg_count_error(spec)
        bld.adjoint = adjoint
        with _b.activate(bld):
            build_kernel_body(bld, self, spec if spec else (None,) * len(self.params))
            if not adjoint:
                finish_struct_fors(bld, (parsed.file, self.name))
        returns = bld.return_type if isinstance(bld.return_type, list) else (
            [bld.return_type] if bld.return_type is not None else [])
        return KernelIR(self.name, bld.params, bld.buffers, bld.body, returns=returns,
                        file=parsed.file, debug=cfg.debug or cfg.check_out_of_bound)

    def _compile(self, prog, args: tuple, spec: tuple, variant: str = "primal") -> CompiledKernel:
        if self._simple and len(args) != len(self.params):
            raise self._arg_count_error(args)
        stats = CompileStats()
        t0 = time.perf_counter()
        ir = self.build_ir(prog, spec, variant)
        ir.deterministic = prog.config.deterministic
        ir.fast_math = prog.config.fast_math
        ir.overflow_checks = prog.config.debug
        lost = ir.lost
        t1 = time.perf_counter()
        ir = run_pipeline(ir)
        t2 = time.perf_counter()
        if prog.config.print_ir:  # ti.init(print_ir=True): the IR that is compiled
            print(format_kernel(ir))
        inst = compile_ir(ir, prog, stats, [p.name for p in self.params])
        stats.frontend_s, stats.passes_s = t1 - t0, t2 - t1
        self.last_compile = stats
        prog.compile_seconds += time.perf_counter() - t0
        if lost is not None:
            inst.lost = lost
        inst.return_type = compound_return_type(self.return_annotation)
        inst.arg_shapes = {k: p.annotation.element_shape for k, p in enumerate(self.params)
                           if isinstance(p.annotation, MatrixType)}
        inst.arg_structs = {k: p.annotation for k, p in enumerate(self.params)
                            if isinstance(p.annotation, StructType)}
        inst.origin = (self, spec, variant)
        return inst

    @property
    def grad(self) -> AdjointKernel:
        """``kernel.grad(*args)``: the adjoint kernel, built from this kernel's IR by reverse-mode
        autodiff, compiled and cached like any kernel. It adds into the ``.grad`` of every field
        the kernel reads, given the ``.grad`` of the fields it writes."""
        if self._adjoint is None:
            self._adjoint = AdjointKernel(self)
        return self._adjoint

    def __repr__(self) -> str:
        return f"<ti.kernel {self.name}{signature_text(self.pyfunc)}>"


class BoundKernel:
    """``obj.kernel`` of a ``@ti.data_oriented`` object: calls the kernel with ``obj`` first;
    ``.grad`` is its adjoint, bound the same way."""

    __slots__ = ("kernel", "obj")

    def __init__(self, kernel: Kernel, obj) -> None:
        self.kernel = kernel
        self.obj = obj

    def __call__(self, *args, **kwargs):
        try:
            return self.kernel(self.obj, *args, **kwargs)
        except DifftapeError as e:
            program.user_error(e)
            raise

    @property
    def grad(self):
        return functools.partial(self.kernel.grad, self.obj)

    @property
    def __name__(self) -> str:
        return self.kernel.name

    def __repr__(self) -> str:
        return (f"<ti.kernel {self.kernel.name}{signature_text(self.kernel.pyfunc)} bound to "
                f"a {type(self.obj).__name__}>")


class AdjointKernel:
    """The callable behind ``kernel.grad``."""

    def __init__(self, primal: Kernel) -> None:
        self.primal = primal
        self.instances: dict = {}
        self.__name__ = primal.name + ".grad"

    def __call__(self, *args, **kwargs):
        try:
            k = self.primal
            if kwargs:
                args = k._bind_kwargs(args, kwargs)
            if k._packs:
                args = k.flatten_packs(args)
            if k.no_grad:  # @ti.ad.no_grad: an empty gradient, as in Taichi
                return None
            if k._array_args and len(args) == len(k.params):
                args = k.bind_tensor_grads(args)
                for i in k._array_args:
                    if not isinstance(args[i], _NATIVE_ARRAYS):
                        return k.foreign_call(self.__call__, args)
            # Under forward mode the adjoint runs with tangents: forward-over-reverse, which puts
            # Hessian-vector products into the .grad.dual of the inputs.
            prog = program.get()
            if prog.await_passes is not None:
                prog.await_passes()
            if prog.unplaced:
                refuse_unplaced(prog, self.__name__)
            variant = "grad_fwd" if prog.fwd is not None else "grad"
            if prog.remote is not None:  # arch=ti.remote: queued for the server (difftape.client)
                return prog.remote.launch(k, args, variant)
            return k.instance(args, variant).launch(args)
        except DifftapeError as e:
            program.user_error(e)
            raise

    def __repr__(self) -> str:
        return (f"<ti.kernel {self.primal.name}.grad: the adjoint of "
                f"{self.primal.name}{signature_text(self.primal.pyfunc)}>")


def derive(ir: KernelIR, variant: str, storage: Callable[[Buffer, str], bool],
           activity: Callable[[Buffer], list] | None = None) -> KernelIR:
    """The IR of one compiled variant of a kernel, from its frontend IR (before the pass
    pipeline). ``storage(buf, role)`` says whether ``buf`` has a ``.grad``/``.dual``
    allocated: derivatives flow only into storage that exists. This is a pure IR transform,
    so the service runs it on IR a client sent, exactly as the local runtime does."""
    if variant == "primal":
        return ir
    if variant in ("grad", "grad_fwd"):
        # Function-level: the autodiff transforms (~15 ms of import) load with the first
        # derivative compiled, not with `import difftape`.
        from ..autodiff.reverse import reverse_kernel

        ir = reverse_kernel(ir, lambda buf: storage(buf, "grad"), activity)
        if variant == "grad":
            return ir
    if variant in ("fwd", "grad_fwd", "fwd_const"):
        # Function-level: the autodiff transforms (~15 ms of import) load with the first
        # derivative compiled, not with `import difftape`.
        from ..autodiff.forward import forward_kernel

        return forward_kernel(ir, lambda buf: storage(buf, "dual"),
                              inputs=variant != "fwd_const")
    raise ValueError(f"unknown kernel variant {variant!r}")


def has_storage(prog, spec: tuple, buf, role: str) -> bool:
    """Does the buffer behind ``buf`` have ``role`` ("grad"/"dual") storage allocated? For a
    ``.grad`` buffer, "dual" asks for ``x.grad.dual``."""
    kind, ident, base = buf.key
    if kind == "field":
        f = prog.fields.get(ident)
        return f is not None and f.companion(role if base == "primal" else
                                             f"{base}_{role}") is not None
    desc = spec[ident] if ident < len(spec) else None
    return bool(desc and desc[3] if role == "grad" and base == "primal" else False)


def compile_ir(ir: KernelIR, prog, stats: CompileStats | None = None,
               arg_names: list[str] | None = None,
               fields: dict | None = None) -> CompiledKernel:
    """Object code for offloaded IR (from the cache when possible), loaded and ready.
    ``fields``: the fields the IR's field ids name, when not the program's own (a saved
    graph loaded in another process, difftape.graph)."""
    stats = stats or CompileStats()
    # A grid target (the simulated grid, CUDA) compiles with its launcher's code generator and
    # loads through it; the CPU's own launch otherwise.
    launcher = prog.launcher
    target = get_target() if launcher is None else launcher.target
    layout = ctx_layout(ir)
    key = serialize.fingerprint(ir, target.fingerprint, __version__, _codegen_source_hash(),
                                locations=False)
    directory = cache.cache_dir(prog.config.offline_cache_file_path) \
        if prog.config.offline_cache else None
    low = Lowering(ir, layout, target)
    names = target.entry_names(low)
    t0 = time.perf_counter()
    obj = cache.load(key, directory)
    if obj is None:
        text = low.module()
        try:
            obj = target.compile(text)
        except RuntimeError as e:  # LLVM rejected our IR: a compiler bug, show the module
            raise CompileError(f"internal error: LLVM rejected the generated code: {e}",
                               kernel=ir.name) from e
        cache.store(key, obj, directory)
    else:
        stats.cache_hit = True
    t1 = time.perf_counter()
    engine, addresses = (target if launcher is None else launcher).load(obj, names)
    stats.llvm_s, stats.load_s = t1 - t0, time.perf_counter() - t1
    notify_compiled(ir, layout, stats.cache_hit)  # e.g. the PTX check, cached code too
    return CompiledKernel(ir, layout, engine, addresses, low, prog, arg_names, fields)


def kernel_prints(ir: KernelIR) -> bool:
    """Does the kernel have a ``print`` statement? (Offloaded into tasks or not yet.)"""
    blocks = [ir.body] if ir.tasks is None else [b for t in ir.tasks for b in task_blocks(t)]
    return any(s.op == "print" for b in blocks for s in walk(b))


@functools.cache
def _codegen_source_hash() -> str:
    """A hash of the code generator's own source. The cache key covers the IR after the
    passes, the target and the version; a change to the lowering alone (which makes different
    machine code from the same IR) must not pick up objects it did not make."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    # The op table holds each op's lowering key: part of the code generator.
    for f in sorted((root / "codegen").glob("*.py")) + [root / "ir" / "ops.py"]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


class CompiledKernel:
    """One loaded specialization: a launch context and the task entry points."""

    def __init__(self, ir: KernelIR, layout: CtxLayout, engine, addresses: dict, low,
                 prog, arg_names: list[str] | None = None, fields: dict | None = None) -> None:
        self.ir = ir
        self.layout = layout
        self._engine = engine  # keeps the code alive
        self.prog = prog
        self.fields = prog.fields if fields is None else fields  # by the IR's field ids
        self.origin: tuple | None = None  # (Kernel, spec, variant), set by Kernel._compile
        self.tasks = []
        self.grid = None
        if prog.launcher is not None:
            # Each task is launched over the grid (runtime/grid.py): called like a serial
            # task, after the same argument packing into the host's launch context, which
            # each launch uploads into one of its contexts in device memory; asynchronous
            # unless it returns a value, prints or may overflow its stacks.
            self.grid = GridKernel(ir, layout, [addresses[n] for n in low.target.entry_names(low)],
                                   prog.launcher, prog.rng, assert_messages(ir),
                                   sync_errors=prog.config.debug, code=engine)
            self.ctx = None
            self.ctx_addr = self.grid.ring[0].block.address
            self.ctx_i64 = self.grid.host
            self.tasks = [(False, run, None, 1, _ANY, 0) for run in self.grid.tasks]
        else:
            self.ctx = (ctypes.c_int64 * max(1, layout.size))()
            self.ctx_addr = ctypes.addressof(self.ctx)
            self.ctx_i64 = np.frombuffer(self.ctx, dtype=np.int64)
            self.ctx_i64[layout.rng] = prog.rng.address
            if prog.print_sink is not None and kernel_prints(ir):
                self.ctx_i64[layout.print_sink] = prog.print_sink.address
            if prog.stack_budget is not None:  # (read only by tasks that push)
                self.ctx_i64[layout.stack_budget] = prog.stack_budget.address
                prog.stack_budget.attach(self.ctx_addr, ir.name)
        self.ctx_f64 = self.ctx_i64.view(np.float64)
        for k, t in enumerate(ir.tasks if self.grid is None else ()):
            address = addresses[low.task_name(k)]
            bounds = BOUNDS_FN(addresses[low.bounds_name(k)]) if t.kind == "range" else None
            schedule = _SCHEDULES[t.schedule]
            if schedule == _ANY and t.epilogue:
                schedule = _WHOLE
            self.tasks.append((t.kind == "range", TASK_FN(address), bounds, max(1, t.weight),
                               schedule, address))
        self.return_type: MatrixType | StructType | tuple | None = None
        self.lost = NO_FLOW  # set by Kernel._compile for derivative variants
        self.bounds_out = (ctypes.c_int64 * 2)()
        self.bounds_addr = ctypes.addressof(self.bounds_out)
        self.messages = assert_messages(ir)
        self._ndarray_slots = []
        written = _written_slots(ir)
        # (device memory: what a launch makes stale; weakly, since the fields own their
        # storage: SNodeTree.destroy() frees it, and this kernel then recompiles)
        written_fields: list[weakref.ref[Storage]] = []
        quant: list[tuple[weakref.ref[Storage], bool]] = []
        for slot, buf in enumerate(ir.buffers):
            if buf.key[0] == "private":  # per-chunk copies the generated code allocates
                continue
            if buf.key[0] == "field":
                f = (prog.fields if fields is None else fields).get(buf.key[1])
                if f is None:
                    raise CompileError(f"field '{buf.name}' does not belong to the current "
                                       "program (was it created before ti.init/ti.reset?)",
                                       kernel=ir.name)
                storage = f.companion(buf.key[2])
                if storage is None:
                    raise CompileError(f"'{buf.name}' is used but was never allocated: create "
                                       f"the field with needs_{buf.key[2]}=True or place "
                                       f"'{buf.name}'", kernel=ir.name)
                self.ctx_i64[layout.buffer_ptr[slot]] = storage.storage.address
                if slot in written:
                    written_fields.append(weakref.ref(storage.storage))
                if buf.quant is not None:
                    quant.append((weakref.ref(storage.storage), slot in written))
            else:
                extents = [layout.buffer_extent.get((slot, a)) for a in range(buf.ndim)]
                self._ndarray_slots.append((slot, buf.key[1], buf.key[2], extents,
                                            slot in written))
        # Scalar parameters: (ctx slot, how to write it): _FLOAT, _INT, or the bit width of
        # an unsigned type (written as its two's complement bit pattern).
        self._writers = []
        for k, p in enumerate(ir.params):
            kind = _FLOAT if p.dtype.is_float else _INT if p.dtype.is_signed else p.dtype.bits
            self._writers.append((layout.params[k], kind))
        self._returns = [(slot, _FLOAT if t.is_float else _INT if t.is_signed or t.bits < 64
                          else _U64) for t, slot in zip(ir.returns, layout.returns, strict=True)]
        self._arg_map = param_arg_map(ir, arg_names or [p.name for p in ir.params])
        # Vector/matrix parameter shapes by argument index (set by Kernel._compile).
        self.arg_shapes: dict[int, tuple[int, ...]] = {}
        # Struct parameter types by argument index (set by Kernel._compile).
        self.arg_structs: dict[int, StructType] = {}
        # Wrappers are instance attributes: no cost for kernels that need none.
        self._inner_launch = self.launch
        if kernel_prints(ir):
            if prog.print_sink is None:
                self._inner_launch = self.launch = self._printing_launch
            # else the lines go to the sink, set in the context (__init__)
        if not prog.allocator.host:  # storage in device memory: see _device_launch
            self._written_fields = written_fields
            self._host_launch = self._inner_launch
            self._inner_launch = self.launch = self._device_launch
        if quant:  # quantized fields: Python scope's values around a launch (see _quant_launch)
            self._quant = quant
            self._unquant_launch = self._inner_launch
            self._inner_launch = self.launch = self._quant_launch
        if prog.config.kernel_profiler:
            self.launch = self._profiled_launch

    def _printing_launch(self, args: tuple):
        """``launch`` of a kernel that prints: Python's buffered output first, then the
        kernel's lines (C's printf), flushed when the launch ends, so output keeps its order
        (also when stdout is a pipe or file)."""
        sys.stdout.flush()
        try:
            return CompiledKernel.launch(self, args)
        finally:
            _libc().fflush(None)

    def _device_launch(self, args: tuple):
        """``launch`` when the program's storage is device memory (``runtime/storage.py``):
        the sync points around a launch. Host writes are uploaded first and NumPy arguments
        staged into device memory; afterwards (also when the launch raises) what it wrote is
        marked changed on the device, so host reads download it, and staged arguments it
        wrote are copied back."""
        staged = self._stage_arrays(args) if self._ndarray_slots else None
        if staged is not None:
            args = staged[0]
        self.prog.allocator.sync()
        if self.grid is not None:
            self.grid.begin()  # the launch context is packed next; the first task uploads it
        try:
            return self._host_launch(args)
        finally:
            for ref in self._written_fields:
                storage = ref()
                if storage is not None:
                    storage.device_written()
            for _, arg_index, role, _, writes in self._ndarray_slots:
                if writes:
                    _ndarray_storage(args[arg_index], role).device_written()
            if staged is not None:
                for original, storage in staged[1]:
                    np.copyto(original, storage.read())

    def _quant_launch(self, args: tuple):
        """``launch`` of a kernel that uses quantized fields (frontend/quant.py): the values
        Python scope wrote to them are encoded first; afterwards (also when the launch raises)
        the decoded copies of those it wrote are stale."""
        for ref, _ in self._quant:
            storage = ref()
            if storage is not None:
                storage.group.flush()
        try:
            return self._unquant_launch(args)
        finally:
            for ref, writes in self._quant:
                storage = ref()
                if writes and storage is not None:
                    storage.device_written()

    def _stage_arrays(self, args: tuple) -> tuple[tuple, list] | None:
        """Under device memory: each NumPy array argument replaced by device storage holding
        a copy, and the (array, storage) pairs to copy back after the launch (those the
        kernel writes). None when there are none."""
        out = None
        back = []
        done: dict[int, Storage] = {}
        for _, arg_index, _, _, writes in self._ndarray_slots:
            a = args[arg_index]
            if not isinstance(a, np.ndarray):
                store = a.storage if isinstance(a, Ndarray) else None
                if store is not None and store.host:
                    raise ArgumentError(f"kernel '{self.ir.name}': argument {arg_index + 1} "
                                        "is a ti.ndarray in host memory (made under an earlier "
                                        "program?) but this program's storage is device "
                                        "memory: make it again after ti.init",
                                        kernel=self.ir.name)
                continue
            if writes and not a.flags.writeable:
                self._staged(a, arg_index, writes, None)  # raises: read-only
            storage = done.get(id(a))
            if storage is None:
                storage = done[id(a)] = self.prog.allocator.storage(a.shape, a.dtype)
                np.copyto(storage.write(), a)
            if out is None:
                out = list(args)
            out[arg_index] = storage
            if writes:
                back.append((a, storage))
        return None if out is None else (tuple(out), back)

    def _profiled_launch(self, args: tuple):
        """``launch``, timed into the program's profile (ti.init(kernel_profiler=True))."""
        start = time.perf_counter()
        try:
            out = self._inner_launch(args)
            if self.grid is not None:  # asynchronous on a grid: time it to its end
                self.grid.queue.synchronize()
            return out
        finally:
            self.prog.profile.append((self.ir.name, start,
                                      (time.perf_counter() - start) * 1000.0))

    def launch(self, args: tuple):
        capture = self.prog.capture
        if capture is not None:  # inside ti.graph.capture(): recorded, not run (difftape.graph)
            return capture.launch(self, args)
        keep, copies = self.pack(args)
        ctx_i64 = self.ctx_i64
        ctx = self.ctx_addr
        pool = None
        for is_range, fn, bounds, weight, schedule, address in self.tasks:
            if is_range:
                bounds(ctx, self.bounds_addr)
                begin, end = self.bounds_out[0], self.bounds_out[1]
                if end <= begin:
                    continue
                if schedule == _ORDERED:
                    chunk = deterministic_chunk(end - begin, weight)
                    if chunk >= end - begin:
                        fn(ctx, begin, end, 0)
                    else:
                        pool = pool or self.prog.pool
                        pool.run_chunks(fn, ctx, begin, end, chunk,
                                        (end - begin) * weight >= INLINE_WORK, address)
                elif (end - begin) * weight < INLINE_WORK or self.prog.num_threads == 1 \
                        or schedule == _SERIAL:
                    fn(ctx, begin, end, 0)
                else:
                    pool = pool or self.prog.pool
                    pool.run(fn, ctx, begin, end, weight, address, schedule == _WHOLE)
            else:
                fn(ctx, 0, 0, 0)
            if ctx_i64[self.layout.err_code]:
                self._copy_back(copies)
                self._raise_assertion()
        self._copy_back(copies)
        if self._returns:
            ctx_f64 = self.ctx_f64
            out = [float(ctx_f64[slot]) if kind is _FLOAT else
                   int(ctx_i64[slot]) if kind is _INT else int(ctx_i64[slot]) & _U64_MASK
                   for slot, kind in self._returns]
            rt = self.return_type
            if rt is not None:
                return compound_return(rt, out)
            return out[0] if len(out) == 1 else out
        return None

    def pack(self, args: tuple) -> tuple[list, dict | None]:
        """Write ``args`` into the launch context: scalars into their slots, array pointers
        and extents. Returns the arrays to keep alive during the launch and the staged copies
        to copy back after it (see :meth:`_staged`)."""
        ctx_f64, ctx_i64 = self.ctx_f64, self.ctx_i64
        entries = None
        for (slot, kind), (arg_index, comp) in zip(self._writers, self._arg_map, strict=True):
            v = args[arg_index]
            if comp is not None:  # one scalar of a vector/matrix/struct argument
                if len(comp) == 1 and not isinstance(v, Struct | dict):
                    if entries is None:
                        entries = {}
                    flat = entries.get(arg_index)
                    if flat is None:
                        flat = entries[arg_index] = self._matrix_entries(v, arg_index)
                    v = flat[comp[0]]
                else:
                    if entries is None:
                        entries = {}
                    if arg_index not in entries and arg_index in self.arg_structs:
                        entries[arg_index] = self._check_struct(v, arg_index)
                    v = arg_component(v, comp)
            t = type(v)
            try:
                if kind is _FLOAT:
                    if t is not float and not _is_real(v):
                        raise TypeError
                    ctx_f64[slot] = v
                else:
                    if t is not int and not _is_integer(v):
                        raise TypeError
                    if kind is _INT:
                        ctx_i64[slot] = v
                    else:
                        ctx_i64[slot] = self._unsigned_bits(v, kind, arg_index)
            except ArgumentError:
                raise
            except (TypeError, ValueError, OverflowError):
                want = "a number" if kind is _FLOAT else "an integer"
                # Taichi's words first (programs match them): the argument's path, 0-based.
                dtype = self.ir.params[self._writers.index((slot, kind))].dtype
                path = (arg_index, *(comp or ()))
                raise ArgumentError(f"Argument {path} (type={type(v)}) cannot be converted "
                                    f"into required type {dtype}: kernel '{self.ir.name}': "
                                    f"argument {arg_index + 1} must be {want}, got "
                                    f"{type(v).__name__} ({v!r:.40})",
                                    kernel=self.ir.name) from None
        keep = []
        copies = None
        for slot, arg_index, role, extents, writes in self._ndarray_slots:
            arr = _ndarray_storage(args[arg_index], role)
            if isinstance(arr, DeviceStorage):  # device memory (see _device_launch)
                if writes and arr.__class__ is BorrowedStorage and arr.readonly:
                    raise ArgumentError(f"kernel '{self.ir.name}' writes argument "
                                        f"{arg_index + 1}, but it is read-only (its owner "
                                        "forbids writes: a JAX array, a read-only export)",
                                        kernel=self.ir.name)
                ctx_i64[self.layout.buffer_ptr[slot]] = arr.address
            else:
                flags = arr.flags
                if not (flags.c_contiguous and flags.aligned) or \
                        (writes and not flags.writeable):
                    arr, copies = self._staged(arr, arg_index, writes, copies)
                ctx_i64[self.layout.buffer_ptr[slot]] = arr.ctypes.data
            keep.append(arr)
            for axis, s in enumerate(extents):
                if s is not None:
                    ctx_i64[s] = arr.shape[axis]
        return keep, copies

    def argument_slots(self) -> tuple[list, list]:
        """Where :meth:`pack` puts each argument in the launch context (for ti.graph, which
        binds named inputs there): scalars as ``(ctx slot, kind, argument index, path)``
        (kind: "f", "i" or an unsigned width; path as :func:`param_path`'s), arrays as
        ``(pointer slot, argument index, role, extent slots by axis)``."""
        scalars = [(slot, kind, arg_index, comp) for (slot, kind), (arg_index, comp)
                   in zip(self._writers, self._arg_map, strict=True)]
        arrays = [(self.layout.buffer_ptr[slot], arg_index, role, extents)
                  for slot, arg_index, role, extents, _ in self._ndarray_slots]
        return scalars, arrays

    def written_pointer_slots(self) -> set[int]:
        """The launch-context slots of the pointers to the fields and ndarrays the kernel
        writes (for ti.graph on a grid, which marks their storage changed after a replay)."""
        return {self.layout.buffer_ptr[slot] for slot in _written_slots(self.ir)
                if self.ir.buffers[slot].key[0] != "private"}

    def field_storage(self) -> list[tuple[int, Storage]]:
        """``(pointer slot, storage)`` of each field storage the kernel addresses."""
        out = []
        for slot, buf in enumerate(self.ir.buffers):
            if buf.key[0] == "field":
                f = self.fields[buf.key[1]]
                out.append((self.layout.buffer_ptr[slot], f.companion(buf.key[2]).storage))
        return out

    def _matrix_entries(self, v, arg_index: int) -> list:
        """The entries of a vector/matrix argument, row-major, after checking its shape against
        the parameter's (``arg_shapes``, when the kernel's annotations are known)."""
        if isinstance(v, Matrix):
            shape, flat = v.shape, v.entries
        else:
            try:
                a = np.asarray(v)
            except ValueError:  # ragged nesting
                a = np.asarray(None)
            shape, flat = a.shape, a.ravel().tolist()
        want = self.arg_shapes.get(arg_index)
        if (shape != want) if want is not None else not shape:
            what = f"a vector/matrix of shape {want}" if want else "a vector/matrix"
            raise ArgumentError(f"kernel '{self.ir.name}': argument {arg_index + 1} must be "
                                f"{what}, got {type(v).__name__} of shape {shape}",
                                kernel=self.ir.name)
        return flat

    def _check_struct(self, v, arg_index: int) -> None:
        """A struct argument must have its parameter's members, each vector/matrix member of
        its shape: a 2-vector for a 3-vector member failed reading the third entry, and a
        longer one had its extra entries dropped."""
        why = _struct_mismatch(self.arg_structs[arg_index], v)
        if why is not None:
            raise ArgumentError(f"kernel '{self.ir.name}': argument {arg_index + 1} must be a "
                                f"{self.arg_structs[arg_index]!r}: {why}", kernel=self.ir.name)

    def _unsigned_bits(self, v, bits: int, arg_index: int) -> int:
        """An unsigned argument as the int64 bit pattern of its value. Values wrap modulo
        2**bits (as in Taichi); negative values are refused, as Taichi does."""
        if bits == 1:  # u1: "is nonzero", as a cast to u1
            return 1 if v else 0
        v = int(v)
        if v < 0:
            raise ArgumentError(f"kernel '{self.ir.name}': argument {arg_index + 1} is unsigned "
                                f"(u{bits}) but got {v}", kernel=self.ir.name)
        v &= (1 << bits) - 1
        return v - (1 << 64) if v >= 1 << 63 else v

    def _staged(self, arr: np.ndarray, arg_index: int, writes: bool, copies: dict | None):
        """A C-ordered, aligned copy of a Fortran-ordered (as Taichi makes one) or misaligned
        NumPy argument, copied back after the launch when the kernel writes it. One copy per
        array per launch, so an array passed twice stays one array. A read-only array the
        kernel writes is refused."""
        if writes and not arr.flags.writeable:
            raise ArgumentError(f"kernel '{self.ir.name}' writes argument {arg_index + 1}, but "
                                "it is read-only (a read-only NumPy array, or a JAX array: "
                                "those are immutable)", kernel=self.ir.name)
        copies = {} if copies is None else copies
        entry = copies.get(id(arr))
        if entry is None:
            entry = copies[id(arr)] = [arr, np.array(arr, order="C"), False]
        entry[2] = entry[2] or writes
        return entry[1], copies

    @staticmethod
    def _copy_back(copies: dict | None) -> None:
        if copies:
            for original, staged, writes in copies.values():
                if writes:
                    np.copyto(original, staged)

    def _raise_assertion(self) -> None:
        lay = self.layout
        code = int(self.ctx_i64[lay.err_code])
        words = self.ctx_i64[lay.err_value:lay.err_value + lay.err_values].tolist()
        self.ctx_i64[lay.err_code] = 0
        raise_error_word(self.messages, code, words, self.ir.name, self.prog.stack_budget,
                         self.ctx_addr)


_FLOAT, _INT, _U64 = "f", "i", "u64"
_U64_MASK = (1 << 64) - 1


def _written_slots(ir: KernelIR) -> set[int]:
    """The buffer slots the kernel stores into (so a staged copy must be copied back)."""
    out = set()
    blocks = [b for t in ir.tasks for b in task_blocks(t)] if ir.tasks else [ir.body]
    for block in blocks:
        for s in walk(block):
            if s.op == "store":
                out.add(s.attr)
            elif s.op == "atomic":
                out.add(s.attr[0])
    return out


def written_arrays(ir: KernelIR) -> frozenset[int]:
    """The ndarray arguments (by index) whose data the kernel stores into: what a remote
    launch copies back into the caller's NumPy array (``difftape.client``)."""
    out = set()
    for slot in _written_slots(ir):
        kind, index, role = ir.buffers[slot].key
        if kind == "ndarray" and role == "primal":
            out.add(index)
    return frozenset(out)


def compound_return_type(rt) -> MatrixType | StructType | tuple | None:
    """A kernel's return annotation if its value is made of several scalars (a vector/matrix,
    a struct or a tuple of values), else None."""
    return rt if isinstance(rt, MatrixType | StructType | tuple) else None


def _return_leaf_types(rt, cfg) -> list[T.DType]:
    """The scalars a compound kernel return is made of, in order."""
    if isinstance(rt, tuple):
        return [dt for r in rt for dt in _return_leaf_types(r, cfg)]
    if isinstance(rt, MatrixType):
        return [rt.scalar_dtype] * (rt.n * (rt.m if rt.ndim == 2 else 1))
    if isinstance(rt, StructType):
        return [dt for _, dt in rt.leaves()]
    return [_scalar_dtype(rt, cfg)]


def compound_return(rt: MatrixType | StructType | tuple, values: list):
    """A kernel's vector/matrix, struct or tuple return value from its scalars."""
    if isinstance(rt, tuple):
        it = iter(values)

        def take(r):
            if isinstance(r, tuple):
                return tuple(take(x) for x in r)
            if isinstance(r, MatrixType):
                return compound_return(r, [next(it) for _ in range(
                    r.n * (r.m if r.ndim == 2 else 1))])
            if isinstance(r, StructType):
                return r.from_leaves([next(it) for _ in r.leaves()])
            return next(it)

        return take(rt)
    if isinstance(rt, StructType):
        return rt.from_leaves(values)
    return Matrix._from_entries(values, rt.n, rt.m, rt.ndim)


def param_path(name: str) -> tuple[str, tuple | None]:
    """A scalar param's kernel argument and where in it the scalar is: ``x`` -> ("x", None),
    ``v[2]`` -> ("v", (2,)), ``s.line.dir[0]`` -> ("s", ("line", "dir", 0)). Vector and
    struct arguments are flattened into such params."""
    cut = min((k for k in (name.find("."), name.find("[")) if k >= 0), default=len(name))
    base, rest = name[:cut], name[cut:]
    if not rest:
        return base, None
    path: list = []
    for part in rest.replace("[", ".[").split(".")[1:]:
        path.append(int(part[1:-1]) if part.startswith("[") else part)
    return base, tuple(path)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def param_arg_map(ir: KernelIR, arg_names: list[str]) -> list[tuple[int, tuple | None]]:
    """For each scalar param: (kernel argument index, path to the scalar or None); the one
    map from IR params to arguments, also the remote client's. A caller may also name the
    vector parts of a struct as arguments of their own (``s.v`` for ``s.v[0]``: the
    service's engine groups wire arguments so)."""
    out = []
    for p in ir.params:
        head, _, comp = p.name.partition("[")
        if head in arg_names:
            out.append((arg_names.index(head), (int(comp[:-1]),) if comp else None))
            continue
        # The longest argument name the param's starts with: a member of an argument pack is
        # an argument of its own (``pack.s``), a struct one's scalars are ``pack.s.a``.
        base = max((n for n in arg_names if p.name.startswith(n) and
                    p.name[len(n):len(n) + 1] in (".", "[")), key=len, default=None)
        if base is None:
            base, path = param_path(p.name)
        else:
            path = param_path("_" + p.name[len(base):])[1]
        out.append((arg_names.index(base), path))
    return out


def _is_real(v) -> bool:
    """A value a float parameter takes: a real number (Python, NumPy or 0-d array), not a
    string or a sequence (NumPy would convert those silently)."""
    if isinstance(v, np.ndarray):
        return v.ndim == 0 and v.dtype.kind in "biuf"
    return isinstance(v, numbers.Real | np.bool_)


def _is_integer(v) -> bool:
    """A value an integer parameter takes: an integer (floats are refused, as in Taichi)."""
    if isinstance(v, np.ndarray):
        return v.ndim == 0 and v.dtype.kind in "biu"
    return isinstance(v, numbers.Integral | np.bool_)


def _struct_mismatch(stype: StructType, v) -> str | None:
    """How ``v`` (a Struct or dict) differs from ``stype`` in members or member shapes."""
    if not isinstance(v, Struct | dict):
        return f"got {type(v).__name__}"
    names = list(v._entries) if isinstance(v, Struct) else list(v)
    if names != list(stype.members):
        return f"members {list(stype.members)} needed, got {names}"
    for k, dt in stype.members.items():
        m = v[k]
        if isinstance(dt, StructType):
            why = _struct_mismatch(dt, m)
            if why is not None:
                return f"member '{k}': {why}"
        elif isinstance(dt, MatrixType):
            shape = m.shape if isinstance(m, Matrix) else np.shape(m)
            if tuple(shape) != tuple(dt.element_shape):
                return f"member '{k}' must have shape {tuple(dt.element_shape)}, got {shape}"
        elif isinstance(m, Matrix | Struct | dict) or np.ndim(m) != 0:
            return f"member '{k}' is a scalar, got {type(m).__name__}"
    return None


def arg_component(v, path: tuple):
    """The scalar at ``path`` in a vector/matrix/struct argument (see :func:`param_path`)."""
    for k in path:
        if isinstance(k, str):
            v = v[k] if isinstance(v, Struct | dict) else getattr(v, k)
        elif isinstance(v, Matrix):
            v = v.entries[k]
        else:
            v = np.asarray(v).ravel()[k]
    return v


def _ndarray_storage(a, role: str) -> np.ndarray | Storage:
    """What a launch addresses for an array argument: a NumPy array (the argument itself,
    or the array of host storage), or device storage (``runtime/storage.py``)."""
    if isinstance(a, np.ndarray):
        return a
    if isinstance(a, Ndarray):
        s = (a if role == "primal" else getattr(a, role)).storage
    elif isinstance(a, Storage):  # a NumPy argument staged in device memory (_device_launch)
        s = a
    else:
        s = a._triplets.storage  # a SparseMatrixBuilder (checked by _ndarray_desc)
    return s.array if s.host else s


def _taichi_element_type(esh: tuple, dtype) -> str:
    """An ndarray element type as Taichi's messages write it: ``VectorType[2, i32]``,
    ``MatrixType[2,3, i32]``, or the scalar type."""
    dt = "any" if dtype is None else _resolve(dtype)
    if len(esh) == 1:
        return f"VectorType[{esh[0]}, {dt}]"
    if len(esh) == 2:
        return f"MatrixType[{esh[0]},{esh[1]}, {dt}]"
    return str(dt)


def _ndarray_desc(kernel: str, name: str, ann: NdarrayType, a) -> tuple:
    """What a kernel is compiled for, given one ndarray argument: ``(dtype, ndim, element
    shape, has_grad, boundary)``. Everything the generated code assumes about the array is
    checked here, before any launch: the code indexes element components with constants and
    the array axes with the extents passed at launch, so an array whose trailing axes are not
    the element shape would be read and written out of bounds."""
    def refuse(msg: str) -> ArgumentError:
        return ArgumentError(f"kernel '{kernel}': argument '{name}' {msg}", kernel=kernel)

    if isinstance(ann, SparseMatrixBuilderType):
        store = getattr(a, "_triplets", None)
        if not isinstance(store, Ndarray):
            raise refuse(f"must be a ti.linalg.SparseMatrixBuilder (it is annotated "
                         f"ti.types.sparse_matrix_builder()), got {type(a).__name__}")
        return (store.dtype, 1, (), False, "unsafe")
    want = ann.dtype
    if isinstance(a, Ndarray):
        # (its shape, not its .storage: a remote ndarray's storage is on the server)
        axes, dtype, esh = len(a.shape) + len(a.element_shape), a.dtype, a.element_shape
        if isinstance(want, MatrixType):
            if not _element_matches(want, esh, dtype):
                what = f"{esh} elements of {dtype}" if esh else f"scalar elements of {dtype}"
                raise refuse(f"must have {_element_text(want)} elements, got an ndarray with "
                             f"{what} (Invalid value for argument {name} - required element "
                             f"type: {_taichi_element_type(want.element_shape, want.dtype)}, "
                             f"but {_taichi_element_type(esh, dtype)} is provided)")
        elif want is not None:
            if esh or _resolve(want) != dtype:
                what = f"{esh} elements of {dtype}" if esh else f"{dtype} elements"
                tensor = f"[Tensor ({', '.join(map(str, esh))}) {dtype}]" if esh else dtype
                raise refuse(f"must have {_resolve(want)} elements, got an ndarray with {what} "
                             f"(Expect element type {_resolve(want)} for argument {name}, but "
                             f"get {tensor})")
        if ann.needs_grad and a.grad is None:
            raise refuse("needs a gradient (needs_grad=True): create it with "
                         "ti.ndarray(..., needs_grad=True)")
        has_grad = a.grad is not None if ann.needs_grad is None else bool(ann.needs_grad)
    elif isinstance(a, np.ndarray | Storage):
        # A NumPy array, or device memory of a foreign CUDA array (runtime/devicearrays.py,
        # C-contiguous and native-endian: checked there)
        arr = a
        axes = arr.ndim
        try:
            dtype = T.from_numpy(arr.dtype)
        except TypeError as e:
            raise refuse(f"has NumPy dtype {arr.dtype}: {e}") from None
        if not arr.dtype.isnative:
            raise refuse(f"has non-native byte order ({arr.dtype.str}): convert it with "
                         f"arr.astype(arr.dtype.newbyteorder('='))")
        esh = ()
        if isinstance(want, MatrixType):
            # Taichi: the trailing axes of a NumPy array are the element's (its dtype wins).
            edim = want.ndim
            if arr.ndim < edim + (ann.ndim or 0):
                taichi = ("" if ann.ndim is None else
                          f" (Invalid value for argument {name} - required array has "
                          f"ndim={ann.ndim} element_dim={edim}, array with {arr.ndim} "
                          "dimensions is provided)")
                raise refuse(f"must have {_element_text(want)} elements"
                             f"{'' if ann.ndim is None else f' in {ann.ndim} dimension(s)'}: "
                             f"the array has only {arr.ndim} axes (shape {arr.shape}){taichi}")
            esh = arr.shape[arr.ndim - edim:]
            if not _element_matches(want, esh, None):
                raise refuse(f"must have {_element_text(want)} elements (Invalid value for "
                             f"argument {name} - required element_shape={want.element_shape}, "
                             f"array with element shape of {esh}): the array's trailing axes "
                             f"are {esh} (shape {arr.shape})")
        elif want is not None and _resolve(want) != dtype:
            raise refuse(f"must be an array of {_resolve(want)} (Invalid value for argument "
                         f"{name} - required array has dtype={_resolve(want)}), got NumPy "
                         f"dtype {arr.dtype} (convert it with .astype(np.{_resolve(want).np}))")
        if isinstance(arr, np.ndarray) and not (arr.flags.c_contiguous or
                                                arr.flags.f_contiguous):
            raise refuse("is a strided view of a NumPy array: Non contiguous numpy arrays are "
                         "not supported; pass np.ascontiguousarray(arr), and copy the result "
                         "back if the kernel writes it")
        if ann.needs_grad:
            raise refuse("needs a gradient (needs_grad=True), but NumPy arrays have none: "
                         "pass ti.ndarray(..., needs_grad=True)")
        has_grad = False
    else:
        raise ArgumentError(f"kernel '{kernel}': Invalid type for argument {name}, got "
                            f"{a!r:.60}: argument '{name}' must be an array (NumPy, "
                            f"ti.ndarray, or one exporting __dlpack__ or __array_interface__: "
                            f"PyTorch, JAX), got {type(a).__name__}", kernel=kernel)
    ndim = axes - len(esh)
    if ann.ndim is not None and ann.ndim != ndim:
        detail = (f"Invalid value for argument {name} - required ndim={ann.ndim}, but "
                  f"{ndim}d ndarray with shape "
                  f"{a.shape} is provided" if isinstance(a, Ndarray) else
                  f"Invalid value for argument {name} - required array has ndim={ann.ndim}, "
                  f"array with {ndim} dimensions is provided; shape {a.shape[:ndim]}")
        raise refuse(f"must have ndim={ann.ndim} ({detail})")
    return (dtype, ndim, tuple(esh), has_grad, ann.boundary)


def _ndarray_kind(ann: NdarrayType, a) -> tuple | None:
    """Everything :func:`_ndarray_desc` looks at, as a cheap key (None: not an array)."""
    if isinstance(ann, SparseMatrixBuilderType):
        store = getattr(a, "_triplets", None)
        return ("triplets", store.dtype) if isinstance(store, Ndarray) else None
    if isinstance(a, Ndarray):
        return (a.dtype, a.element_shape, len(a.shape), a.grad is not None)
    if isinstance(a, np.ndarray):
        flags = a.flags
        edim = ann.dtype.ndim if isinstance(ann.dtype, MatrixType) else 0
        return (a.dtype, a.ndim, a.shape[a.ndim - edim:] if edim else (),
                flags.c_contiguous or flags.f_contiguous)
    if isinstance(a, Storage):  # a foreign CUDA array's memory (C-contiguous)
        edim = ann.dtype.ndim if isinstance(ann.dtype, MatrixType) else 0
        return (a.dtype, a.ndim, a.shape[a.ndim - edim:] if edim else (), True)
    return None


def _resolve(dtype) -> T.DType:
    return resolve_dtype(dtype)


def _scalar_dtype(ann, cfg):
    if ann is bool:  # Taichi: u1, returned as 0 or 1
        return T.u1
    if ann is float:
        return cfg.default_fp
    if ann is int:
        return cfg.default_ip
    if isinstance(ann, T.DType):
        return ann
    raise CompileError(f"unsupported return annotation {ann!r}")
