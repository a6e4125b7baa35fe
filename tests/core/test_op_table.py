"""The op table (``difftape.ir.ops``): every op fully declared, and each part checked.

* every op has an evaluator (or, for a structural op, the interpreter's own case), a derivative
  rule or an explicit ``NO_DERIVATIVE``/``STRUCTURAL``, and a lowering for every type its type
  rule admits;
* each evaluator agrees with the compiled lowering, op by op and type by type, on ordinary
  values and on the edges (zero divisors, extreme integers, infinities, NaN);
* each derivative rule agrees with central finite differences of the op's evaluator, in f64,
  in reverse mode and in forward mode; ops declared ``NO_DERIVATIVE`` give exact zeros;
* an op declared without a derivative is refused where a derivative would flow through it
  (never a silent zero), in both modes.

These kernels are built as IR directly, so each op is exercised exactly as declared (e.g. an
integer ``div``, which the frontend never emits).
"""

import dataclasses
import inspect
import math

import numpy as np
import pytest

import difftape as ti
from difftape import types as T
from difftape.autodiff.forward import forward_kernel
from difftape.autodiff.reverse import reverse_kernel
from difftape.codegen import cpu, llvm_lowering
from difftape.frontend.kernel import compile_ir
from difftape.ir import interpret
from difftape.ir.nodes import Buffer, KernelIR, Stmt
from difftape.ir.ops import NO_DERIVATIVE, OPS, STRUCTURAL, TYPE_RULES
from difftape.ir.passes import run_pipeline
from difftape.runtime import program

pytestmark = pytest.mark.difftape_only

FLOAT_RULES = {"float": "f", "real": "f", "farith": "f"}
INT_RULES = {"int", "cond", "bits", "shift", "logical", "overflow"}


@pytest.fixture
def prog():
    ti.init(arch=ti.cpu)
    yield program.get()
    ti.reset()


def _kinds(info) -> tuple[str, ...]:
    """The type kinds ("f", "i", "u") an op's type rule admits for its operands."""
    if info.types in FLOAT_RULES:
        return ("f",)
    if info.types in INT_RULES:
        return ("i", "u")
    return ("f", "i", "u")


def test_every_op_is_fully_declared():
    evaluator_source = inspect.getsource(interpret.Interpreter._stmt)
    for name, info in OPS.items():
        assert info.derivative is not None, f"{name}: no derivative and no NO_DERIVATIVE"
        assert callable(info.derivative) or info.derivative in (NO_DERIVATIVE, STRUCTURAL), name
        if info.derivative == STRUCTURAL or info.evaluate is None:
            assert f'"{name}"' in evaluator_source, f"{name}: the interpreter has no case"
        else:
            assert info.types in TYPE_RULES, f"{name}: no type rule"
        for kind in _kinds(info) if info.types else ("f", "i", "u"):
            key = info.lower.get(kind)
            assert key is not None, f"{name}: no lowering for type kind {kind!r}"
            if key == "stmt":
                assert hasattr(llvm_lowering.Lowering, "op_" + name), name
                continue
            form, what = key.split(":")
            assert form in ("inst", "fcmp", "icmp", "intrinsic", "libm", "method"), key
            if form == "method":
                assert hasattr(llvm_lowering.Lowering, "lower_" + what), key
            if form == "libm":
                assert what in cpu._LIBM_NAMES, key


# ---------------------------------------------------------------------------------------------
# building one-op kernels as IR

N_EDGE_FLOATS = [-7.25, -2.5, -1.0, -0.75, -0.5, -0.0, 0.0, 0.3, 0.5, 1.0, 1.5, 2.5, 3.0,
                 1e30, math.inf, -math.inf, math.nan]


def _int_samples(t):
    lo = -(1 << (t.bits - 1)) if t.is_signed else 0
    hi = (1 << (t.bits - 1 if t.is_signed else t.bits)) - 1
    small = [v for v in (-7, -3, -2, -1, 0, 1, 2, 3, 5, 7, 13) if lo <= v <= hi]
    return sorted({lo, lo + 1, hi, hi - 1, *small})


def _result_type(info, t):
    return T.i32 if info.types in ("cmp", "logical", "cond", "overflow") else t


def _one_op_kernel(name: str, inputs: list, out, out_t, in_types, cond=None) -> KernelIR:
    """``out[i] = name(inputs[0][i], ...)`` over the fields' extent, as IR. ``cond``: a field
    whose value is the first operand (select's condition)."""
    fields = ([cond] if cond is not None else []) + inputs + [out]
    types = ([T.i32] if cond is not None else []) + in_types + [out_t]
    buffers = [Buffer(("field", f.id, "primal"), t, (f.shape[0],), f"f{k}")
               for k, (f, t) in enumerate(zip(fields, types, strict=True))]
    i = Stmt("loop_index", T.i32, (), 1)
    loads = [Stmt("load", t, (i,), k) for k, t in enumerate(types[:-1])]
    op = Stmt(name, out_t, tuple(loads))
    store = Stmt("store", None, (i, op), len(fields) - 1)
    begin, end = Stmt("const", T.i32, (), 0), Stmt("const", T.i32, (), out.shape[0])
    loop = Stmt("range_for", None, (begin, end), (1, "parallel"), ([i, *loads, op, store],))
    return KernelIR(f"one_{name}", [], buffers, [begin, end, loop])


def _run(ir: KernelIR, prog) -> None:
    compile_ir(run_pipeline(ir), prog).launch(())


def _cases(name, info):
    """(operand dtype, result dtype, operand columns) to check ``name`` on."""
    if name == "cast":
        for src, dst in [(T.f64, T.i32), (T.f32, T.i64), (T.f64, T.u8), (T.i32, T.f32),
                         (T.i64, T.i8), (T.u32, T.i64), (T.i8, T.u16), (T.f64, T.f32)]:
            vals = N_EDGE_FLOATS + [3e9, -3e9, 255.9] if src.is_float else _int_samples(src)
            yield src, dst, [vals]
        return
    if name == "bit_cast":
        for src, dst in [(T.f32, T.i32), (T.i32, T.f32), (T.f64, T.i64), (T.u64, T.f64),
                         (T.i32, T.u32), (T.f64, T.u64)]:
            yield src, dst, [N_EDGE_FLOATS if src.is_float else _int_samples(src)]
        return
    n = 1 if info.nargs == 1 else 2
    if name == "select":
        n = 2
    types = [T.f32, T.f64] if "f" in _kinds(info) else []
    types += [T.i32, T.u32, T.i64, T.i8] if "i" in _kinds(info) else []
    for t in types:
        vals = N_EDGE_FLOATS if t.is_float else _int_samples(t)
        if name in ("shl", "shr", "shl_overflows"):
            # Shifts by the width or more are poison in LLVM; the overflow check defines them
            # (a nonzero value overflows), negative amounts included.
            amounts = list(range(t.bits))
            if name == "shl_overflows":
                amounts += [t.bits, t.bits + 3] + ([-1] if t.is_signed else [])
            yield t, _result_type(info, t), [[v for v in vals for _ in amounts],
                                             [s for _ in vals for s in amounts]]
            continue
        if n == 1:
            yield t, _result_type(info, t), [vals]
        else:
            yield t, _result_type(info, t), [[a for a in vals for _ in vals],
                                             [b for _ in vals for b in vals]]


VALUE_OPS = sorted(n for n, info in OPS.items() if info.evaluate is not None)


@pytest.mark.parametrize("name", VALUE_OPS)
def test_evaluator_agrees_with_the_compiled_lowering(prog, name):
    info = OPS[name]
    for src, dst, columns in _cases(name, info):
        n = len(columns[0])
        ins = [ti.field(src, n) for _ in columns]
        for f, col in zip(ins, columns, strict=True):
            f.from_numpy(np.array(col).astype(src.np))
        cond = None
        if name == "select":
            cond = ti.field(ti.i32, n)
            cond.from_numpy((np.arange(n) % 3 == 0).astype(np.int32))
        out = ti.field(dst, n)
        ir = _one_op_kernel(name, ins, out, dst, [src] * len(ins), cond)
        _run(ir, prog)
        # the reference evaluator on the same optimized IR
        ir = run_pipeline(_one_op_kernel(name, ins, out, dst, [src] * len(ins), cond))
        arrays = ([cond.to_numpy()] if cond is not None else []) + \
            [f.to_numpy() for f in ins] + [np.zeros(n, dst.np)]
        interpret.Interpreter(ir, arrays, []).run()
        got, want = out.to_numpy(), arrays[-1]
        what = f"{name} on {src} -> {dst}"
        if dst.is_float and any(k.startswith("libm") for k in info.lower.values()):
            np.testing.assert_allclose(got, want, rtol=4 * np.finfo(dst.np).eps, atol=0,
                                       equal_nan=True, err_msg=what)
        else:
            np.testing.assert_array_equal(got, want, err_msg=what)


# ---------------------------------------------------------------------------------------------
# derivatives against finite differences of the evaluator

_M = 9  # sample points per op


def _grid(lo, hi, shift=0.0123):
    return np.linspace(lo, hi, _M) + shift


# Sample domains (operand 0, operand 1) where the op is smooth; default (-2, 2) nudged off 0.
DOMAIN = {
    "log": [(0.1, 3)], "sqrt": [(0.1, 3)], "rsqrt": [(0.1, 3)], "asin": [(-0.9, 0.9)],
    "acos": [(-0.9, 0.9)], "tan": [(-1.2, 1.2)],
    "div": [(-2, 2), (0.3, 2)], "pow": [(0.2, 2), (-1.5, 1.5)],
    "mod": [(-1.9, 1.9), (0.61, 0.97)], "rem": [(-1.9, 1.9), (0.61, 0.97)],
    "atan2": [(-2, 2), (0.4, 2)],
    "min": [(-2, 2), (2.2, -1.8)], "max": [(-2, 2), (2.2, -1.8)],
}
DIFFERENTIABLE = sorted(n for n, info in OPS.items()
                        if callable(info.derivative) and "f" in _kinds(info))
ZERO_DERIVATIVE = sorted(n for n, info in OPS.items()
                         if info.derivative == NO_DERIVATIVE and info.evaluate is not None
                         and "f" in _kinds(info) and info.types not in ("cmp", "logical"))


def _operands(name):
    info = OPS[name]
    n = 1 if info.nargs == 1 else 2
    doms = DOMAIN.get(name, [(-2, 2)] * n)
    cols = [_grid(*doms[k], shift=0.0123 * (k + 1)) for k in range(n)]
    if name in ("mod", "rem"):  # keep a/b away from the integers (the jumps of floor/trunc)
        q = cols[0] / cols[1]
        assert np.all(np.abs(q - np.round(q)) > 1e-3)
    return cols


def _fd(name, cols, k, cond=None, src=T.f64):
    """Central differences of the evaluator in f64 along operand ``k``."""
    out = []
    for j in range(_M):
        x = [c[j] for c in cols]
        h = 1e-6 * max(1.0, abs(x[k]))
        hi, lo = list(x), list(x)
        hi[k] += h
        lo[k] -= h
        if cond is not None:
            hi, lo = [cond[j], *hi], [cond[j], *lo]
        ev = OPS[name].evaluate
        out.append((ev(tuple(hi), src, T.f64) - ev(tuple(lo), src, T.f64)) / (2 * h))
    return np.array(out)


def _derivatives(prog, name, cols, mode, cond_values=None, in_type=T.f64):
    """The op's partials at the sample points, by compiled ``mode`` autodiff: one column per
    operand."""
    ins = [ti.field(in_type, _M, needs_grad=True, needs_dual=True) for _ in cols]
    for f, c in zip(ins, cols, strict=True):
        f.from_numpy(c)
    out = ti.field(ti.f64, _M, needs_grad=True, needs_dual=True)
    cond = None
    if cond_values is not None:
        cond = ti.field(ti.i32, _M)
        cond.from_numpy(cond_values)
    make = lambda: _one_op_kernel(name, ins, out, T.f64, [in_type] * len(ins), cond)  # noqa: E731
    primal_slots = lambda buf: buf.key[0] == "field" and buf.key[1] != (  # noqa: E731
        cond.id if cond is not None else None)
    got = []
    if mode == "reverse":
        out.grad.from_numpy(np.ones(_M))
        _run(reverse_kernel(make(), primal_slots), prog)
        return [f.grad.to_numpy() for f in ins]
    for k in range(len(ins)):
        for j, f in enumerate(ins):
            f.dual.from_numpy(np.full(_M, 1.0 if j == k else 0.0))
        _run(forward_kernel(make(), primal_slots), prog)
        got.append(out.dual.to_numpy())
    return got


@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_derivative_matches_finite_differences(prog, name, mode):
    cond = (np.arange(_M) % 2).astype(np.int32) if name == "select" else None
    cols = _operands(name) if name not in ("select", "cast") else \
        [_grid(-2, 2), _grid(-1, 3)][: 2 if name == "select" else 1]
    # A cast between equal types folds away: cast f32 -> f64 (exact, so its derivative is 1).
    in_type = T.f32 if name == "cast" else T.f64
    if name == "cast":
        cols = [c.astype(np.float32).astype(np.float64) for c in cols]
    got = _derivatives(prog, name, cols, mode, cond, in_type)
    for k, g in enumerate(got):
        want = _fd(name, cols, k, cond, in_type)
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7,
                                   err_msg=f"d {name} / d operand {k} ({mode} mode)")


@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("name", ZERO_DERIVATIVE)
def test_declared_zero_derivatives_are_exact_zeros(prog, name, mode):
    cols = _operands(name)
    for g in _derivatives(prog, name, cols, mode):
        np.testing.assert_array_equal(g, np.zeros(_M), err_msg=f"{name} ({mode} mode)")


# ---------------------------------------------------------------------------------------------
# an op declared without a derivative


@pytest.fixture
def sin_undeclared(monkeypatch):
    monkeypatch.setitem(OPS, "sin", dataclasses.replace(OPS["sin"], derivative=None))


def test_an_op_without_a_derivative_is_refused_in_reverse_mode(prog, sin_undeclared):
    x = ti.field(ti.f64, 4, needs_grad=True)
    y = ti.field(ti.f64, 4, needs_grad=True)

    @ti.kernel
    def k():
        for i in x:
            y[i] = ti.sin(x[i]) * 2.0

    k()
    with pytest.raises(ti.GradientRuleError) as info:
        k.grad()
    text = str(info.value)
    assert "'sin'" in text and "kernel 'k'" in text and "ti.stop_grad" in text
    assert "y[i] = ti.sin(x[i]) * 2.0" in text


def test_an_op_without_a_derivative_is_refused_in_forward_mode(prog, sin_undeclared):
    x = ti.field(ti.f64, 4, needs_dual=True)
    y = ti.field(ti.f64, 4, needs_dual=True)

    @ti.kernel
    def k():
        for i in x:
            y[i] = ti.sin(x[i]) * 2.0

    with pytest.raises(ti.GradientRuleError, match="'sin'"):
        with ti.ad.FwdMode(loss=y, param=x, seed=[1.0] * 4):
            k()


def test_an_op_without_a_derivative_is_fine_where_no_derivative_flows(prog, sin_undeclared):
    x = ti.field(ti.f64, 4, needs_grad=True, needs_dual=True)
    y = ti.field(ti.f64, 4, needs_grad=True, needs_dual=True)
    n = ti.field(ti.f64, 4)  # no gradient storage

    @ti.kernel
    def k():
        for i in x:
            n[i] = ti.sin(x[i])  # into a field without derivative storage
            if ti.sin(x[i]) > 0.5:  # only a condition
                y[i] = 3.0 * x[i]
            y[i] += ti.sin(ti.stop_grad(x[i]))

    x.from_numpy(np.array([0.1, 0.7, 1.2, 2.0]))
    k()
    y.grad.from_numpy(np.ones(4))
    k.grad()
    want = np.where(np.sin(x.to_numpy()) > 0.5, 3.0, 0.0)
    np.testing.assert_allclose(x.grad.to_numpy(), want)
    with ti.ad.FwdMode(loss=y, param=x, seed=[1.0] * 4):
        k()
    np.testing.assert_allclose(y.dual.to_numpy(), want)
