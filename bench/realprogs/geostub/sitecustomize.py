"""Stub every module under a few roots that GeoTaichi imports at load time but the driven
examples never use (open3d, meshio, matplotlib...): on PYTHONPATH, Python imports this
sitecustomize at start-up (bench/realprogs/realprogs.py puts it there for GeoTaichi only)."""
import importlib.abc
import importlib.machinery
import sys
import types

ROOTS = {'open3d', 'meshio', 'skimage', 'matplotlib', 'mpl_toolkits', 'pyevtk',
         'numba', 'warp', 'jax_fem', 'gmsh', 'PIL', 'pynvml'}

#: single modules: trimesh 4 no longer has trimesh.interfaces.gmsh (sdf/BasicShape.py imports it)
MODULES = {'trimesh.interfaces.gmsh'}


class _Dummy:
    def __call__(self, *a, **k): return self
    def __getattr__(self, n): return self
    def __mro_entries__(self, bases): return (object,)


class _Mod(types.ModuleType):
    def __getattr__(self, n):
        if n.startswith('__'):
            raise AttributeError(n)
        return _Dummy()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ROOTS or name in MODULES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Mod(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
