"""The differential fuzzer's programs (bench/fuzz_gen.py), bounded for CI: the compiled kernel
agrees with the reference interpreter (difftape.ir.interpret) element for element.

bench/fuzz_taichi.py runs the same generated programs on difftape and on Taichi 1.7.4 for hours
(frontend, typing and semantics against the reference implementation); this test needs no
Taichi. For a fixed set of seeds it runs each program, and at the launch of its main kernel
(parallel loops with nested serial loops, break/continue, ti.static, if/elif chains, i32/i64/u32
wrap-around, floor division and modulo of negative numbers, shifts and bit operations, casts,
atomics onto colliding indices, local vectors, matrices and arrays with runtime indices, struct
and grouped fields, ti.real_func with early returns, ndarray and scalar arguments) it also
evaluates the kernel's optimized IR with the interpreter on copies of every buffer: integers
must agree exactly, floats to rounding (the interpreter's NumPy transcendentals and serial
atomic order differ from the compiled code's in the last bits). Then the rest of the program
(sparse, offset and dynamic fields) runs to completion without an error.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

import difftape as ti
from difftape.ir.interpret import Interpreter
from difftape.ir.passes import run_pipeline
from difftape.runtime import program

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fuzz_gen  # noqa: E402

SEEDS = range(12)


def _check_against_interpreter(kernel, args, fields):
    prog = program.get()
    _key, spec = kernel._specialize(args)
    ir = run_pipeline(kernel.build_ir(prog, spec))
    by_id = {f.id: f for f in fields}
    arrays = []
    for buf in ir.buffers:
        kind, ident, role = buf.key
        assert role == "primal", buf.key
        if kind == "private":  # a per-chunk scatter copy (passes/scatter.py): the interpreter
            arrays.append(np.zeros(buf.shape, dtype=buf.dtype.np))  # zeroes it per task
        elif kind == "field":
            arrays.append(by_id[ident].to_numpy().copy())
        else:
            arrays.append(args[ident].to_numpy().copy())
    scalars = [a for a in args if isinstance(a, int | float)]  # the IR's params: scalars only
    Interpreter(ir, arrays, scalars).run()
    kernel(*args)
    f32 = prog.config.default_fp == ti.f32
    for buf, want in zip(ir.buffers, arrays, strict=True):
        kind, ident, _ = buf.key
        if kind == "private":
            continue
        got = by_id[ident].to_numpy() if kind == "field" else args[ident].to_numpy()
        if want.dtype.kind in "iub":
            np.testing.assert_array_equal(got, want, err_msg=buf.name)
        else:
            rtol = 1e-4 if f32 or want.dtype == np.float32 else 1e-9
            scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
            np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=buf.name)


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_program_matches_the_interpreter(seed, tmp_path):
    src = fuzz_gen.program(seed)
    path = tmp_path / f"prog_{seed}.py"
    path.write_text(src)
    namespace: dict = {}
    exec(compile(src, str(path), "exec"), namespace)  # difftape reads the kernels' source file
    try:
        result = namespace["run"](ti, hook=_check_against_interpreter)
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- program (seed {seed}):\n{src}") from None
    finally:
        ti.reset()
    assert set(result) >= {"io", "fo", "acc_i", "dyn"}
