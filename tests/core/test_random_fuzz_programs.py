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

bench/fuzz_areas.py's programs too: each primal kernel (bit_cast, casts across all widths,
shifts, atomics on every type, struct/matrix field copies, serialized loops) against the
interpreter, and the gradient programs (sparse intermediates, ndarray arguments, struct fields,
ti.math vector functions, grouped matrix fields) against central differences.
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
import fuzz_areas  # noqa: E402
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
            scale = max(1.0, float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)))
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


def _fields_in(namespace: dict) -> list:
    """The fields a generated program's ``run`` holds: fields, lists of fields, struct fields'
    members."""
    out, todo = [], list(namespace.values())
    while todo:
        v = todo.pop()
        if isinstance(v, ti.Field):
            out.append(v)
        elif isinstance(v, list | tuple):
            todo += v
        elif isinstance(v, ti.StructField):
            todo += [v.get_member_field(k) for k in v.keys]
    return out


AREAS = ["bitcast", "intcasts", "shifts", "atomics_all", "containers", "serial"]


@pytest.mark.parametrize("seed", range(4))
def test_areas_program_matches_the_interpreter(seed, tmp_path):
    src = fuzz_areas.program(seed, AREAS[seed % 3::3] + AREAS[(seed + 1) % 3::3][:1])
    path = tmp_path / f"areas_{seed}.py"
    path.write_text(src)
    namespace: dict = {}
    exec(compile(src, str(path), "exec"), namespace)
    launched = []

    def hook(kernel, ns):
        launched.append(kernel)
        _check_against_interpreter(kernel, (), _fields_in(ns))

    try:
        namespace["run"](ti, hook=hook)
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- program (seed {seed}):\n{src}") from None
    finally:
        ti.reset()
    assert launched


@pytest.mark.parametrize("seed", range(4))
def test_areas_gradients_match_finite_differences(seed, tmp_path):
    only = [fuzz_areas.GRAD_SNIPPETS[(2 * seed + q) % len(fuzz_areas.GRAD_SNIPPETS)]
            for q in range(2)]
    src = fuzz_areas.gradient_program(seed, only)
    path = tmp_path / f"areas_grad_{seed}.py"
    path.write_text(src)
    namespace: dict = {}
    exec(compile(src, str(path), "exec"), namespace)
    try:
        res = namespace["run"](ti)
    finally:
        ti.reset()
    fd = res["_fd"]
    scale = max(1.0, float(np.abs(fd).max()))
    for k in ("tape", "grad"):
        np.testing.assert_allclose(res[k], fd, rtol=1e-5, atol=1e-5 * scale,
                                   err_msg=f"{k}, seed {seed}:\n{src}")
    assert "_dual_error" not in res, res.get("_dual_error")
    if "dual" in res:  # FwdMode (even seeds without sparse or ndarray intermediates)
        np.testing.assert_allclose(res["dual"], res["_fd_dir"], rtol=1e-5, atol=1e-5)
