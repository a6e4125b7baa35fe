"""A ``taichi`` package that is difftape: lets unmodified Taichi programs and tests run on it.

The bench harnesses (``bench/taichi_suite.py``, ``bench/difftaichi.py``) copy this file into a
temporary directory as ``taichi/__init__.py`` and put that directory first on ``sys.path``, so
``import taichi as ti`` inside a Taichi program yields this module. It is measuring equipment,
not part of difftape: it must not make difftape look better or worse than it is, so it adds
nothing to the language. What it does:

* ``ti.X`` is ``difftape.X``, looked up on every access (nothing is snapshotted).
  ``taichi.X`` submodules (``taichi.math``, ``taichi.ad``, ``taichi.types`` ...) are the
  ``difftape.X`` module objects themselves, registered under the ``taichi`` name.
* Names difftape lacks raise ``AttributeError`` / ``ModuleNotFoundError`` saying so: those
  are difftape gaps and are reported as such.
* A few names that only *select or label* things in Taichi's tests get stand-ins when
  difftape has none, so that a whole test file is not lost to one decorator argument:
  the arch constants difftape does not define (``ti.gles``, ``ti.dx11``, ``ti.amdgpu``:
  inert objects that are simply not the CPU), ``ti.extension`` (names for ``require=``),
  and Taichi's exception classes (``ti.TaichiCompilationError`` ...), which map onto
  difftape's error classes (compile-time errors -> ``CompileError``, runtime ->
  ``DifftapeError``, ``TaichiRuntimeTypeError`` -> ``ArgumentError``, ``TaichiAssertionError``
  -> ``KernelAssertionError``), so a test that expects a refusal passes when difftape refuses
  at the same place with its own error.
* Taichi's implementation (``taichi.lang.*``, ``taichi._lib``, ``ti._anything``) does not
  exist in difftape. Touching it raises :class:`TaichiInternalsUsed`, which the harness counts
  apart from difftape failures. Exceptions: ``taichi.lang.misc.get_host_arch_list`` (the
  CPU), ``taichi.lang.util.has_pytorch/has_paddle/has_clangpp`` (False), ``to_numpy_type``,
  ``taichi.lang.exception`` (the mapping above) and ``taichi.lang.impl.current_cfg()`` (a view
  of difftape's ``ti.init`` configuration: arch, default_fp, default_ip, debug),
  ``taichi.lang.impl.get_runtime().prog.get_total_compilation_time()``,
  ``taichi._lib.core.with_cuda()`` (whether difftape can run CUDA here) and
  ``with_vulkan()``, ``with_metal()`` ... (False: difftape has no such backend), which Taichi's
  examples ask to choose an arch, and ``GGUI_AVAILABLE`` (difftape's ``ti.ui.GGUI_AVAILABLE``:
  False, it has no GGUI); names in
  ``taichi.lang.*`` that difftape has at top level (``static``, ``loop_unique``...) are
  forwarded.
"""

# Every module-level name here is an attribute of ``taichi`` and would shadow difftape's
# (``import types`` once made ``ti.types`` the standard library's): imports are private.
import importlib as _importlib
import importlib.abc as _abc
import importlib.machinery as _machinery
import sys as _sys
import types as _types

import difftape as _dt


class TaichiInternalsUsed(Exception):
    """A Taichi program or test reached into Taichi's implementation, which difftape does not
    reproduce; the harness reports such tests separately, not as difftape failures."""


class _ForeignArch:
    """An arch constant difftape does not define (``ti.gles`` ...): never the CPU."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_FOREIGN_ARCHS = {n: _ForeignArch(n) for n in ("gles", "dx11", "dx12", "amdgpu", "cc", "wasm")}

_extension = _types.SimpleNamespace(**{n: n for n in (
    "sparse", "quant", "mesh", "quant_basic", "data64", "adstack", "bls", "assertion",
    "extfunc")})

_EXCEPTIONS = {
    "TaichiCompilationError": _dt.CompileError,
    "TaichiSyntaxError": _dt.CompileError,
    "TaichiNameError": _dt.CompileError,
    "TaichiTypeError": _dt.CompileError,
    "TaichiIndexError": _dt.CompileError,
    "TaichiRuntimeError": _dt.DifftapeError,
    "TaichiRuntimeTypeError": _dt.ArgumentError,
    "TaichiAssertionError": _dt.KernelAssertionError,
}


def _internal(qualname: str) -> TaichiInternalsUsed:
    return TaichiInternalsUsed(f"{qualname} is part of Taichi's implementation; difftape has "
                               "no counterpart")


#: Taichi 1.7.4's modules under ``taichi/lang`` (reached as attributes: ``ti.lang.matrix``).
_LANG_MODULES = frozenset((
    "_ndarray", "_ndrange", "_texture", "_wrap_inspect", "any_array", "argpack", "ast",
    "common_ops", "enums", "exception", "expr", "field", "impl", "kernel_arguments",
    "kernel_impl", "matrix", "matrix_ops", "matrix_ops_utils", "mesh", "misc", "ops",
    "runtime_ops", "shell", "simt", "snode", "source_builder", "struct", "util"))


def _internals_module(name: str, provided: dict | None = None) -> _types.ModuleType:
    """A module under ``taichi.lang`` / ``taichi._*``: the ``provided`` names, then difftape's
    top-level names, else :class:`TaichiInternalsUsed`."""
    mod = _types.ModuleType(name)
    mod.__path__ = []  # a package, so that deeper internal imports resolve here too
    mod.__dict__.update(provided or {})

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if hasattr(_dt, attr):
            return getattr(_dt, attr)
        if name == "taichi.lang" and attr in _LANG_MODULES:
            # `ti.lang.matrix.Vector` (GeoTaichi): the submodule, as `import taichi.lang.matrix`
            # gives it (difftape's top-level names, else TaichiInternalsUsed)
            full = f"{name}.{attr}"
            return _sys.modules.get(full) or _sys.modules.setdefault(full,
                                                                     _internals_module(full))
        raise _internal(f"{name}.{attr}")

    mod.__getattr__ = __getattr__
    return mod


class _RuntimeView:
    """``taichi.lang.impl.get_runtime()``, as far as DiffTaichi's smoke_taichi_gpu.py reads it:
    ``.prog.get_total_compilation_time()`` (difftape's seconds spent compiling kernels)."""

    @property
    def prog(self) -> _types.SimpleNamespace:
        from difftape.runtime import program

        return _types.SimpleNamespace(
            get_total_compilation_time=lambda: program.get().compile_seconds)

    def __getattr__(self, attr: str):
        raise _internal(f"taichi.lang.impl.get_runtime().{attr}")


class _ConfigView:
    """``taichi.lang.impl.current_cfg()``: difftape's ``ti.init`` settings under Taichi's names."""

    _FIELDS = ("arch", "default_fp", "default_ip", "debug", "print_ir", "random_seed")

    def __getattr__(self, attr: str):
        if attr in self._FIELDS:
            from difftape.runtime import program

            return getattr(program.get().config, attr)
        raise _internal(f"taichi.lang.impl.current_cfg().{attr}")


def _to_numpy_type(dtype):
    """``taichi.lang.util.to_numpy_type``: the tests' helper from a dtype to NumPy's."""
    import numpy as np

    return np.dtype(dtype.np).type if hasattr(dtype, "np") else np.dtype(dtype).type


def _with_cuda() -> bool:
    """``taichi._lib.core.with_cuda()``: whether difftape can run CUDA here."""
    from difftape.runtime import cuda

    return cuda.why_unavailable() is None


def _make_shims() -> dict[str, _types.ModuleType]:
    false = lambda: False  # noqa: E731
    shims = {
        "taichi.lang.misc": _internals_module(
            "taichi.lang.misc", {"get_host_arch_list": lambda: [_dt.cpu]}),
        "taichi.lang.util": _internals_module(
            "taichi.lang.util", {"has_pytorch": false, "has_paddle": false,
                                 "has_clangpp": false, "to_numpy_type": _to_numpy_type}),
        "taichi.lang.exception": _internals_module("taichi.lang.exception", dict(_EXCEPTIONS)),
        "taichi.lang.impl": _internals_module(
            "taichi.lang.impl", {"current_cfg": lambda: _ConfigView(),
                                 "get_runtime": lambda: _RuntimeView()}),
    }
    lang = _internals_module("taichi.lang", {k.rsplit(".", 1)[1]: m for k, m in shims.items()})
    shims["taichi.lang"] = lang
    core = {f"with_{b}": false for b in ("vulkan", "metal", "opengl", "gles", "amdgpu", "dx11",
                                          "dx12")}
    core["with_cuda"] = _with_cuda
    # Whether ti.ui's GGUI (Window, Scene, ...) works: difftape's ti.ui has the names but no
    # GGUI (they raise saying so), so Taichi's tests and examples take their no-GGUI paths.
    core["GGUI_AVAILABLE"] = getattr(getattr(_dt, "ui", None), "GGUI_AVAILABLE", False)
    shims["taichi._lib.core"] = _internals_module("taichi._lib.core", core)
    shims["taichi._lib"] = _internals_module("taichi._lib", {"core": shims["taichi._lib.core"]})
    return shims


_SHIMS = _make_shims()


class _Finder(_abc.MetaPathFinder, _abc.Loader):
    """Resolves ``taichi.<sub>``: shims, internals, or the ``difftape.<sub>`` module itself."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("taichi."):
            return None
        parent = _sys.modules.get(fullname.rpartition(".")[0])
        if parent is not None and parent.__name__ != "taichi" and getattr(
                getattr(parent, "__spec__", None), "loader", None) is not self:
            return None  # a package put under taichi.* by someone else: its own path finds it
        module = self._resolve(fullname)
        spec = _machinery.ModuleSpec(fullname, self,
                                              is_package=hasattr(module, "__path__"))
        spec.loader_state = module
        return spec

    @staticmethod
    def _resolve(name: str) -> _types.ModuleType:
        if name in _SHIMS:
            return _SHIMS[name]
        top = name.split(".")[1]
        if top == "lang" or top.startswith("_"):
            return _internals_module(name)
        target = "difftape." + name.split(".", 1)[1]
        try:
            return _importlib.import_module(target)
        except ModuleNotFoundError:
            raise ModuleNotFoundError(f"No module named {name!r} (difftape has no {target})",
                                      name=name) from None

    def create_module(self, spec):
        return spec.loader_state

    def exec_module(self, module):
        pass  # already complete: a shim or an imported difftape module


if not any(isinstance(f, _Finder) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _Finder())

__version__ = _dt.__version__
__all__ = list(_dt.__all__)


def __getattr__(name: str):
    if hasattr(_dt, name):
        return getattr(_dt, name)
    if name == "lang":
        return _SHIMS["taichi.lang"]
    if name in _FOREIGN_ARCHS:
        return _FOREIGN_ARCHS[name]
    if name == "extension":
        return _extension
    if name in _EXCEPTIONS:
        return _EXCEPTIONS[name]
    if name.startswith("_") and not name.startswith("__"):
        return _importlib.import_module(f"taichi.{name}")
    raise AttributeError(f"module 'taichi' (difftape alias) has no attribute {name!r}: "
                         f"difftape has no ti.{name}")


def __dir__() -> list[str]:
    return sorted(set(dir(_dt)) | set(globals()))
