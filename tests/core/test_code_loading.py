"""Loading the CPU target's object code: the small code model, linked by JITLink.

The CPU target emits position-independent code in the small code model (constants and calls
reached by 32-bit displacements), which is right only if each object's code lies within 2 GB
of its constants and of what it calls. These tests load many objects with large constant pools
and check every result, from several threads at once, and check that what cannot be linked is
refused with an error rather than run. They test difftape's own loader: difftape only."""

import ctypes
import math
import threading

import llvmlite.binding as llvm
import numpy as np
import pytest

import difftape as ti
from difftape.codegen.cpu import get_target
from difftape.errors import CompileError

pytestmark = pytest.mark.difftape_only

#: Doubles in each test module's constant table (256 KB: larger than a page, a small slab).
TABLE = 32768

FN = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_int64, ctypes.c_double)


def _table(k: int) -> np.ndarray:
    return np.arange(TABLE, dtype=np.float64) * 0.25 + k


def _module(k: int) -> str:
    """A module whose function ``f<k>(i, x)`` returns ``table[i] * x + sin(x) + c`` from a
    constant table of its own, libm's sine (a bound ``dt_`` symbol) and a float constant
    (from the constant pool)."""
    values = ", ".join(f"double {v!r}" for v in _table(k).tolist())
    c = float(np.float64(k) / 3.0)
    return f"""target triple = "{get_target().triple}"
@table{k} = internal constant [{TABLE} x double] [{values}]
declare double @dt_sin(double)
define double @f{k}(i64 %i, double %x) {{
  %p = getelementptr [{TABLE} x double], ptr @table{k}, i64 0, i64 %i
  %t = load double, ptr %p
  %m = fmul double %t, %x
  %s = call double @dt_sin(double %x)
  %a = fadd double %m, %s
  %r = fadd double %a, {_llvm_double(c)}
  ret double %r
}}
"""


def _llvm_double(v: float) -> str:
    """``v`` as LLVM IR's exact hexadecimal double."""
    return f"0x{int.from_bytes(np.float64(v).tobytes(), 'little'):016X}"


def _expected(k: int, i: int, x: float) -> float:
    return float(np.float64(_table(k)[i]) * x + math.sin(x) + np.float64(k) / 3.0)


def test_code_is_position_independent_in_the_small_code_model():
    """Constants are loaded RIP-relative and calls are ``call rel32``: no 64-bit absolute
    address is materialized (the large code model's ``movabs``); the cache key names the code
    model, so that an object emitted for another is never loaded."""
    target = get_target()
    asm = target.tm.emit_assembly(llvm.parse_assembly(_module(1)))
    assert "movabs" not in asm
    assert "table1(%rip)" in asm and "dt_sin@PLT" in asm
    assert f":{target.reloc}:{target.code_model}:" in target.fingerprint
    assert (target.reloc, target.code_model) == ("pic", "small")


def test_hundreds_of_modules_with_large_constant_pools_compute_right():
    """300 objects of 256 KB of constants each (75 MB of JIT memory), every one's function
    checked at both ends of its table: a constant out of reach of its code would read
    another module's table or fault."""
    target = get_target()
    obj = {k: target.compile(_module(k)) for k in range(3)}
    loaded = []
    for n in range(300):
        k = n % 3
        # The same object, with the name each was compiled for, loaded 100 times.
        engine, names = target.load(obj[k], [f"f{k}"])
        loaded.append((k, engine, FN(names[f"f{k}"])))
    for k, _, f in loaded:
        for i, x in ((0, 0.5), (TABLE - 1, -1.25), (12345, 3.0)):
            assert f(i, x) == _expected(k, i, x)


def test_loads_from_several_threads_at_once():
    """Objects are linked while other threads link theirs (the compile pool does)."""
    target = get_target()
    obj = target.compile(_module(7))
    errors, results = [], []

    def work():
        try:
            for _ in range(25):
                engine, names = target.load(obj, ["f7"])
                results.append((engine, FN(names["f7"])(100, 2.0)))
        except Exception as e:  # noqa: BLE001 -- reported by the test below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 200 and {r for _, r in results} == {_expected(7, 100, 2.0)}


def test_unloaded_code_leaves_later_loads_intact():
    """Each dropped object frees its code; loads after many such frees still compute."""
    target = get_target()
    obj = target.compile(_module(2))
    for _ in range(200):
        engine, names = target.load(obj, ["f2"])
        assert FN(names["f2"])(3, 1.0) == _expected(2, 3, 1.0)
        del engine


def test_an_unresolved_symbol_is_refused_at_load():
    """A call of a name nothing defines fails the load with an error naming the object
    (MCJIT loaded such an object without a word), never a wild jump at launch."""
    target = get_target()
    text = (f'target triple = "{target.triple}"\n'
            "declare double @dt_no_such_function(double)\n"
            "define double @g(double %x) {\n"
            "  %r = call double @dt_no_such_function(double %x)\n"
            "  ret double %r\n}\n")
    with pytest.raises(CompileError, match="JIT linker refused the object code of g"):
        target.load(target.compile(text), ["g"])


def test_a_symbol_bound_after_loads_resolves_and_keeps_its_address():
    target = get_target()
    text = (f'target triple = "{target.triple}"\n'
            "declare double @dt_test_cbrt(double)\n"
            "define double @h(double %x) {\n"
            "  %r = call double @dt_test_cbrt(double %x)\n"
            "  ret double %r\n}\n")
    obj = target.compile(text)
    cbrt = ctypes.cast(target.libm.cbrt, ctypes.c_void_p).value
    target.bind_symbol("dt_test_cbrt", cbrt)
    target.bind_symbol("dt_test_cbrt", cbrt)  # the same address again: nothing to do
    engine, names = target.load(obj, ["h"])
    assert ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_double)(names["h"])(27.0) == math.cbrt(27.0)
    with pytest.raises(ValueError, match="cannot rebind"):
        target.bind_symbol("dt_test_cbrt", ctypes.cast(target.libm.sqrt, ctypes.c_void_p).value)


def test_hundreds_of_kernels_compute_right():
    """200 kernels, each with constants of its own, compiled, loaded and launched (fields
    interleaved with code in memory), every result checked against NumPy."""
    ti.init(arch=ti.cpu, offline_cache=False)
    try:
        n = 64
        x = ti.field(ti.f32, shape=n)
        xs = np.linspace(-2.0, 2.0, n).astype(np.float32)
        x.from_numpy(xs)
        outs, kernels = [], []
        for k in range(200):
            y = ti.field(ti.f32, shape=n)
            a, b = np.float32(1.0 + k / 64.0), np.float32(0.1 * k - 3.0)

            @ti.kernel
            def kern(y: ti.template(), a: ti.template(), b: ti.template()):
                for i in x:
                    y[i] = ti.sin(x[i] * a) + b

            kernels.append(kern)
            outs.append((y, a, b))
            kern(y, float(a), float(b))
        for y, a, b in outs:
            want = np.sin(xs * a) + b
            np.testing.assert_allclose(y.to_numpy(), want, rtol=2e-6, atol=2e-6)
    finally:
        ti.reset()
