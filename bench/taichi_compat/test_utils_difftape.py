"""Our stand-in for Taichi's ``tests/test_utils.py`` when Taichi's tests run on difftape.

``bench/taichi_suite.py`` copies it into a temporary ``tests`` package as ``test_utils.py``
(Taichi's tests do ``from tests import test_utils``). Written from the behaviour Taichi's
tests rely on, not from its code:

* ``test(arch=, exclude=, require=, **options)`` runs the test once, on the CPU, with
  ``ti.init(arch=ti.cpu, **options)`` (done by ``suite_plugin``'s fixture, as Taichi's conftest
  does), under the same test id Taichi gives a single-arch run (``[arch=x64]``) so results of
  the two runs line up. It skips, with a reason starting ``needs other arch``, a test whose
  ``arch=`` list names no CPU arch or whose ``exclude=`` names the CPU on this platform, and
  with ``needs extension`` one that requires an extension Taichi 1.7.4 lacks on the CPU (only
  ``bls``): the same tests Taichi skips on a CPU-only run.
* ``approx`` / ``allclose`` / ``get_rel_eps``: pytest.approx with relative tolerance at least
  1e-6 (Taichi's CPU value); a bool expectation compares truthiness.
* ``make_temp_file``, ``mkdir_p``, ``expected_archs`` (the CPU), ``verify_image`` (via
  ``ti.tools``, so it fails where difftape has no ``ti.tools``), ``torch_op`` (skips: difftape
  has no PyTorch interop).
"""

import os
import pathlib
import platform
from tempfile import NamedTemporaryFile, mkstemp

import numpy as np
import pytest
import taichi as ti

#: Extensions Taichi 1.7.4 reports as supported on the CPU (``is_extension_supported``).
CPU_EXTENSIONS = {"sparse", "quant", "mesh", "quant_basic", "data64", "adstack", "assertion",
                  "extfunc"}


def _flatten(archs):
    if archs is None:
        return []
    if not isinstance(archs, (list, tuple, set)):
        archs = [archs]
    out = []
    for a in archs:
        out.extend(_flatten(a) if isinstance(a, (list, tuple, set)) else [a])
    return out


def _is_cpu(arch) -> bool:
    return any(arch is a for a in (ti.cpu, ti.x64, ti.arm64))


def _cpu_excluded(exclude) -> bool:
    if exclude is None:
        return False
    if not isinstance(exclude, (list, tuple)):
        exclude = [exclude]
    system = platform.system()
    for entry in exclude:
        if isinstance(entry, (list, tuple)):
            arch = entry[0] if entry else None
            plat = entry[1] if len(entry) > 1 else None
        else:
            arch, plat = entry, None
        arch_hit = arch is None or any(_is_cpu(a) for a in _flatten(arch))
        plat_hit = plat is None or plat == system
        if arch_hit and plat_hit and (arch is not None or plat is not None):
            return True
    return False


def test(arch=None, exclude=None, require=None, **options):
    """Decorator: run the test once on the CPU with ``ti.init(**options)``, or skip it."""
    archs = _flatten(arch)
    reason = None
    if archs and not any(_is_cpu(a) for a in archs):
        reason = f"needs other arch: {archs}"
    elif _cpu_excluded(exclude):
        reason = f"needs other arch: CPU excluded by {exclude}"
    else:
        missing = [r for r in _flatten(require) if str(r) not in CPU_EXTENSIONS]
        if missing:
            reason = f"needs extension not on Taichi's CPU: {missing}"

    def decorator(func):
        func.__ti_test__ = True
        if reason is not None:
            return pytest.mark.skip(reason=reason)(func)
        return pytest.mark.parametrize("req_arch,req_options", [(ti.cpu, dict(options))],
                                       ids=["arch=x64"])(func)

    return decorator


def get_rel_eps():
    return 1e-6


def approx(expected, **kwargs):
    if isinstance(expected, bool):

        class _Truthy:
            def __eq__(self, other):
                return bool(other) == expected

            def __ne__(self, other):
                return bool(other) != expected

            def __repr__(self):
                return f"truthy({expected})"

        return _Truthy()
    kwargs["rel"] = max(kwargs.get("rel", 1e-6), get_rel_eps())
    return pytest.approx(expected, **kwargs)


def allclose(x, y, **kwargs):
    return x == approx(y, **kwargs)


def make_temp_file(*args, **kwargs):
    fd, name = mkstemp(*args, **kwargs)
    os.close(fd)
    return name


def mkdir_p(dir_path):
    os.makedirs(dir_path, exist_ok=True)


def expected_archs():
    return [ti.cpu]


def verify_image(image, image_name, tolerance=0.1, regerate_groundtruth_images=False):
    truth = ti.tools.imread(str(pathlib.Path(__file__).parent / "python" / "expected"
                                / f"{image_name}.png"))
    with NamedTemporaryFile(suffix=".png") as fp:
        name = fp.name
    ti.tools.imwrite(image, name)
    actual = ti.tools.imread(name)
    os.remove(name)
    assert truth.shape == actual.shape
    diff = truth.astype(np.float64) - actual
    assert np.mean(diff * diff) <= tolerance


def torch_op(*, output_shapes=((1,),)):
    def inner(f):
        def wrapper(*args, **kwargs):
            pytest.skip("difftape has no PyTorch interop")

        return wrapper

    return inner


__all__ = ["test"]
