"""Compiler internals: the pass pipeline, the op table, serialization, codegen properties and
the on-disk cache. These check difftape's own machinery, so they run on difftape only."""

import ctypes
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace

import llvmlite.binding as llvm
import numpy as np
import pytest

import difftape as ti
from difftape.codegen import llvm_lowering
from difftape.codegen.cpu import defined_shift_lanes, get_target
from difftape.codegen.layout import ctx_layout
from difftape.codegen.optimize import module_options
from difftape.ir import serialize
from difftape.ir.nodes import walk
from difftape.ir.passes import run_pipeline
from difftape.ir.printer import format_kernel
from difftape.ir.verify import verify
from difftape.runtime import program


@pytest.fixture
def prog():
    ti.init(arch=ti.cpu)
    yield program.get()
    ti.reset()


def _ir(kernel, prog, spec=()):
    return run_pipeline(kernel.build_ir(prog, spec))


def test_pipeline_output_verifies_and_round_trips(prog):
    x = ti.field(ti.f32, shape=64)
    s = ti.field(ti.f32, shape=())

    @ti.kernel
    def k(a: ti.f32) -> ti.f32:
        t = a * 2
        for i in x:
            v = x[i]
            if v > t:
                x[i] = ti.sin(v)
            else:
                j = 0
                while j < 3:
                    v += 1.0
                    j += 1
                x[i] = v
        for i in x:
            s[None] += x[i]
        return t

    ir = _ir(k, prog)
    verify(ir)
    kinds = [t.kind for t in ir.tasks]
    assert kinds == ["serial", "range", "range", "serial"]  # the return is serial
    data = serialize.encode(ir)
    again = serialize.encode(serialize.decode(json.loads(json.dumps(data))))
    assert again == data
    assert "task 1 range" in format_kernel(ir)


def test_reduction_is_privatized_and_vectorized(prog):
    x = ti.field(ti.f32, shape=1 << 12)
    s = ti.field(ti.f32, shape=())

    @ti.kernel
    def k():
        for i in x:
            s[None] += 0.5 * x[i] ** 2

    ir = _ir(k, prog)
    task = ir.tasks[-1]
    assert not any(st.op == "atomic" for st in walk(task.body))
    assert any(st.op == "atomic" for st in task.epilogue)
    text = llvm_lowering.Lowering(ir, ctx_layout(ir), get_target()).module()
    opt = get_target().optimized_ir(text)
    assert "<4 x double>" in opt or "<8 x double>" in opt or "<2 x double>" in opt


def test_conditional_expression_selects_on_pure_values_and_branches_around_loads(prog):
    x = ti.field(ti.f32, shape=1 << 12)
    y = ti.field(ti.f32, shape=1 << 12)

    @ti.kernel
    def pure():
        for i in x:
            v = x[i]
            y[i] = v * 2.0 if v > 0 else ti.sin(v) - v

    @ti.kernel
    def guarded():
        for i in x:
            y[i] = x[i - 1] if i > 0 else 0.0

    ir = _ir(pure, prog)
    ops = [s.op for s in walk(ir.tasks[-1].body)]
    assert "select" in ops and "if" not in ops  # both arms computed, no branch: vectorizes
    opt = get_target().optimized_ir(llvm_lowering.Lowering(ir, ctx_layout(ir), get_target())
                                    .module())
    assert re.search(r"<(4|8|16) x float>", opt)
    body = _ir(guarded, prog).tasks[-1].body
    loads = [s for s in walk(body) if s.op == "load"]
    assert len(loads) == 1 and not any(s.op == "load" for s in body)  # only inside the `if`
    branch = next(s for s in body if s.op == "if")
    assert loads[0] in list(walk(branch.blocks[0]))


def _task_body(opt: str, name: str) -> str:
    start = opt.index(f"@{name}_task0_body(")
    return opt[start:opt.index("\n}\n", start)]


def test_branches_on_values_vectorize_and_branches_around_memory_do_not(prog):
    """A grid update with boundary conditions (branches that only choose values, as MPM's
    grid_op) vectorizes, primal and adjoint, and computes what NumPy computes; a branch
    around a store keeps the loop scalar (masked stores were measured slower)."""
    n = 64
    m = ti.field(ti.f32, shape=(n, n), needs_grad=True)
    v = ti.field(ti.f32, shape=(n, n), needs_grad=True)
    out = ti.field(ti.f32, shape=(n, n), needs_grad=True)

    @ti.kernel
    def grid(g: ti.f32):
        for i, j in ti.ndrange(n, n):
            u = v[i, j] / (m[i, j] + 1e-10) - g
            if j < 3 and u < 0:
                lit = ti.abs(u) + 1e-10
                if lit + 0.5 * u <= 0:
                    u = 0.0
                else:
                    u = (1.0 + 0.5 * u / lit) * u
            if i > n - 3 and u > 0:
                u = 0.0
            out[i, j] = u

    @ti.kernel
    def guarded():
        for i, j in ti.ndrange(n, n):
            if v[i, j] > 0:
                out[i, j] = v[i, j]

    target = get_target()
    for kernel, variant in ((grid, "primal"), (grid, "grad")):
        ir = run_pipeline(kernel.build_ir(prog, (None,), variant))
        opt = target.optimized_ir(llvm_lowering.Lowering(ir, ctx_layout(ir), target).module())
        assert re.search(r"<(4|8|16) x float>", _task_body(opt, ir.name)), variant
    opt = target.optimized_ir(llvm_lowering.Lowering(_ir(guarded, prog), ctx_layout(
        _ir(guarded, prog)), target).module())
    assert not re.search(r"<(4|8|16) x float>", _task_body(opt, "guarded"))

    rng = np.random.default_rng(3)
    mass = rng.uniform(0.5, 2.0, (n, n)).astype(np.float32)
    vel = rng.uniform(-1.0, 1.0, (n, n)).astype(np.float32)
    m.from_numpy(mass)
    v.from_numpy(vel)
    g = np.float32(0.25)
    grid(g)
    u = vel / (mass + np.float32(1e-10)) - g
    jj = np.arange(n)[None, :]
    ii = np.arange(n)[:, None]
    floor = (jj < 3) & (u < 0)
    lit = np.abs(u) + np.float32(1e-10)
    stop = lit + np.float32(0.5) * u <= 0
    with np.errstate(all="ignore"):
        slid = (np.float32(1.0) + np.float32(0.5) * u / lit) * u
    u = np.where(floor, np.where(stop, np.float32(0.0), slid), u)
    u = np.where((ii > n - 3) & (u > 0), np.float32(0.0), u).astype(np.float32)
    np.testing.assert_allclose(out.to_numpy(), u, rtol=2e-7, atol=0)


def test_atomic_adds_into_the_two_halves_of_8_bytes_are_one_atomic(prog):
    """On the CPU a float atomic add is a compare-exchange loop; the two components 2k,
    2k + 1 of a field whose last axis has an even extent are one aligned 8-byte unit, so
    one 64-bit compare-exchange adds both (a particle-to-grid scatter of velocities makes
    half as many). A 3-vector's first two components may straddle 8 bytes: not paired.
    (tests/lang/test_random_atomics.py checks the sums with many threads.)"""
    side = 160
    idx = ti.field(ti.i32, shape=(64, 2))
    val = ti.Vector.field(4, ti.f32, shape=64)
    g2 = ti.Vector.field(2, ti.f32, shape=(side, side))
    g3 = ti.Vector.field(3, ti.f32, shape=(side, side))
    g4 = ti.Vector.field(4, ti.f32, shape=(side, side))

    @ti.kernel
    def scatter():
        for p in range(64):
            i, j = idx[p, 0], idx[p, 1]
            v = val[p]
            g2[i, j] += ti.Vector([v[0], v[1]])
            g3[i, j] -= ti.Vector([v[0], v[1], v[2]])
            g4[i, j] += v

    ir = _ir(scatter, prog)
    body = _task_body(get_target().optimized_ir(
        llvm_lowering.Lowering(ir, ctx_layout(ir), get_target()).module()), "scatter")
    pairs = len(re.findall(r"atomicrmw fadd ptr [^,]+, <2 x float>", body))  # g2, g4 x2
    singles = len(re.findall(r"atomicrmw fsub ptr [^,]+, float", body))  # g3
    assert pairs == singles > 0  # 3 and 3 per iteration (LLVM may unroll the loop)
    assert not re.search(r"atomicrmw fadd ptr [^,]+, float", body)


def test_float_to_int_casts_vectorize_without_the_saturating_intrinsic(prog):
    # x86 has no saturating conversion: LLVM expands llvm.fptosi.sat lane by lane (MPM's
    # g2p spent a fifth of its time there); the cast is written out as compares and selects
    # around a plain conversion, which vectorize. (Values: test_robustness.py.)
    x = ti.field(ti.f32, shape=1 << 12)
    n = ti.field(ti.i32, shape=1 << 12)

    @ti.kernel
    def k():
        for i in x:
            n[i] = ti.cast(x[i] * 128.0 - 0.5, ti.i32)

    ir = _ir(k, prog)
    opt = get_target().optimized_ir(llvm_lowering.Lowering(ir, ctx_layout(ir), get_target())
                                    .module())
    assert "fptosi.sat" not in opt
    assert re.search(r"fptosi <(4|8|16) x float>", opt)


def test_stencil_addresses_are_not_packed_into_vector_registers(prog):
    # A 3x3 gather from a grid of 2-vectors at a data-dependent cell (MPM's grid-to-particle
    # transfer). With the field's index in i64, LLVM's SLP vectorizer computed the nine
    # addresses in a vector register and extracted each one (g2p 69 -> 61 us per launch).
    g = ti.Vector.field(2, ti.f32, shape=(4, 64, 64))
    x = ti.Vector.field(2, ti.f32, shape=(4, 256))
    v = ti.Vector.field(2, ti.f32, shape=(4, 256))
    c = ti.Matrix.field(2, 2, ti.f32, shape=(4, 256))

    @ti.kernel
    def gather(f: ti.i32):
        for p in range(256):
            base = ti.cast(x[f, p] * 64.0 - 0.5, ti.i32)
            fx = x[f, p] * 64.0 - ti.cast(base, ti.f32)
            w = [0.5 * (1.5 - fx) ** 2, 0.75 - (fx - 1.0) ** 2, 0.5 * (fx - 0.5) ** 2]
            new_v = ti.Vector([0.0, 0.0])
            new_c = ti.Matrix([[0.0, 0.0], [0.0, 0.0]])
            for i in ti.static(range(3)):
                for j in ti.static(range(3)):
                    dpos = ti.Vector([float(i), float(j)]) - fx
                    gv = g[f, base[0] + i, base[1] + j]
                    weight = w[i][0] * w[j][1]
                    new_v += weight * gv
                    new_c += weight * gv.outer_product(dpos)
            v[f + 1, p] = new_v
            c[f + 1, p] = new_c

    ir = _ir(gather, prog, (None,))
    opt = get_target().optimized_ir(llvm_lowering.Lowering(ir, ctx_layout(ir), get_target())
                                    .module())
    assert not re.search(r"extractelement <\d+ x i64>", opt)
    rng = np.random.default_rng(3)
    gv = rng.standard_normal((4, 64, 64, 2)).astype(np.float32)
    xv = rng.uniform(0.1, 0.9, (4, 256, 2)).astype(np.float32)
    g.from_numpy(gv)
    x.from_numpy(xv)
    gather(1)
    xs = xv[1].astype(np.float64) * 64.0
    b = (xs - 0.5).astype(np.int32)
    fx = xs - b
    w = [0.5 * (1.5 - fx) ** 2, 0.75 - (fx - 1.0) ** 2, 0.5 * (fx - 0.5) ** 2]
    want_v, want_c = 0.0, 0.0
    for i in range(3):
        for j in range(3):
            gij = gv[1, b[:, 0] + i, b[:, 1] + j].astype(np.float64)
            weight = (w[i][:, 0] * w[j][:, 1])[:, None]
            want_v = want_v + weight * gij
            dpos = np.array([i, j]) - fx
            want_c = want_c + weight[:, :, None] * gij[:, :, None] * dpos[:, None, :]
    np.testing.assert_allclose(v.to_numpy()[2], want_v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(c.to_numpy()[2], want_c, rtol=1e-4, atol=1e-5)


def test_a_parallel_loops_field_accesses_carry_no_dependence_between_iterations(prog):
    """A parallel loop's field loads and stores are one access group the loop declares
    parallel. MPM's adjoint particle-to-grid transfer (a gather from the grid, read-modify-
    writes of every component of per-particle gradients, row ``f + 1`` read and row ``f``
    written) vectorizes, and without run-time overlap checks: LLVM checked the interleaved
    address ranges of one field's components against each other, which always overlap, so
    every launch ran the scalar loop (and gathers were kept scalar besides): p2g.grad 251 ->
    67 us on one thread. A serial loop and a chunk's private copy of a scattered-into field
    carry no group: their iterations do depend on each other."""
    n, side = 256, 64
    g = ti.Vector.field(2, ti.f32, shape=(4, side, side))
    x = ti.Vector.field(2, ti.f32, shape=(4, n))
    a = ti.Matrix.field(2, 2, ti.f32, shape=(4, n))
    total = ti.field(ti.f32, shape=side)

    @ti.kernel
    def adjoint_like(f: ti.i32):
        for p in range(n):
            base = ti.cast(x[f, p] * 64.0 - 0.5, ti.i32)
            acc = ti.Vector([0.0, 0.0])
            for i in ti.static(range(3)):
                for j in ti.static(range(3)):
                    acc += g[f, base[0] + i, base[1] + j] * float(i + j + 1)
            x[f, p] += acc
            a[f, p] += a[f + 1, p] * acc[0]

    @ti.kernel
    def serial_prefix(f: ti.i32):
        ti.loop_config(serialize=True)
        for p in range(1, n):
            x[f, p] += x[f, p - 1]

    @ti.kernel
    def histogram(f: ti.i32):
        for p in range(n):
            total[ti.cast(x[f, p][0] * 63.0, ti.i32)] += 1.0

    target = get_target()
    texts = {}
    for kernel in (adjoint_like, serial_prefix, histogram):
        ir = _ir(kernel, prog, (None,))
        texts[kernel] = llvm_lowering.Lowering(ir, ctx_layout(ir), target).module()
    body = _task_body(target.optimized_ir(texts[adjoint_like]), "adjoint_like")
    assert "vector.body" in body and "found.conflict" not in body  # loop-vectorized, no checks
    assert "llvm.loop.parallel_accesses" in texts[adjoint_like]
    assert "llvm.access.group" not in texts[serial_prefix]
    assert any(b.key[0] == "private" for b in _ir(histogram, prog, (None,)).buffers)
    lines = texts[histogram].splitlines()
    grouped = [line for line in lines if "llvm.access.group" in line]
    assert len(grouped) == 1 and "load float" in grouped[0]  # x's, not the private copy's
    assert any("store float" in line and "llvm.access.group" not in line for line in lines)

    rng = np.random.default_rng(11)
    gv = rng.standard_normal((4, side, side, 2)).astype(np.float32)
    xv = rng.uniform(0.1, 0.9, (4, n, 2)).astype(np.float32)
    av = rng.standard_normal((4, n, 2, 2)).astype(np.float32)
    g.from_numpy(gv)
    x.from_numpy(xv)
    a.from_numpy(av)
    adjoint_like(1)
    b = (xv[1] * np.float32(64.0) - np.float32(0.5)).astype(np.int32)
    acc = np.zeros((n, 2), np.float64)
    for i in range(3):
        for j in range(3):
            acc += gv[1, b[:, 0] + i, b[:, 1] + j].astype(np.float64) * (i + j + 1)
    np.testing.assert_allclose(x.to_numpy()[1], xv[1] + acc, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.to_numpy()[1], av[1] + av[2] * acc[:, :1, None],
                               rtol=1e-5, atol=1e-5)
    serial_prefix(2)
    np.testing.assert_allclose(x.to_numpy()[2], np.cumsum(xv[2], axis=0), rtol=1e-5)


def test_cpu_code_is_emitted_without_llvm_machine_scheduler(prog):
    """LLVM's machine scheduler reorders each block before register allocation; on MPM's
    particle kernels (long unrolled 3x3 stencils) it made one-thread launches slower (p2g.grad
    4-7%), so the CPU target emits with it off (``CPUTarget.machine_scheduler``). The option is
    LLVM's process-wide ``-enable-misched``: it is set per module under the lock of
    ``codegen.optimize``, so a module (the CUDA target's) that asks for it still gets it."""
    g = ti.Vector.field(2, ti.f32, shape=(64, 64))
    x = ti.Vector.field(2, ti.f32, shape=256)
    c = ti.Matrix.field(2, 2, ti.f32, shape=256)

    @ti.kernel
    def gather():
        for p in range(256):
            base = ti.cast(x[p] * 64.0 - 0.5, ti.i32)
            fx = x[p] * 64.0 - ti.cast(base, ti.f32)
            w = [0.5 * (1.5 - fx) ** 2, 0.75 - (fx - 1.0) ** 2, 0.5 * (fx - 0.5) ** 2]
            new_c = ti.Matrix([[0.0, 0.0], [0.0, 0.0]])
            for i in ti.static(range(3)):
                for j in ti.static(range(3)):
                    dpos = ti.Vector([float(i), float(j)]) - fx
                    new_c += w[i][0] * w[j][1] * g[base[0] + i, base[1] + j].outer_product(dpos)
            c[p] = new_c

    target = get_target()
    ir = _ir(gather, prog)
    text = llvm_lowering.Lowering(ir, ctx_layout(ir), target).module()

    def emit(scheduler: bool) -> bytes:
        mod = llvm.parse_assembly(text)
        with module_options(replace(target.module_options(text), machine_scheduler=scheduler)):
            target._optimize(mod)
            return target.tm.emit_object(mod)

    scheduled, unscheduled = emit(True), emit(False)
    assert scheduled != unscheduled  # the option reaches code generation
    assert target.compile(text) == unscheduled
    assert emit(True) == scheduled  # set back for a module that asks for the scheduler
    rng = np.random.default_rng(5)
    gv = rng.standard_normal((64, 64, 2)).astype(np.float32)
    xv = rng.uniform(0.1, 0.9, (256, 2)).astype(np.float32)
    g.from_numpy(gv)
    x.from_numpy(xv)
    gather()
    xs = xv.astype(np.float64) * 64.0
    b = (xs - 0.5).astype(np.int32)
    fx = xs - b
    w = [0.5 * (1.5 - fx) ** 2, 0.75 - (fx - 1.0) ** 2, 0.5 * (fx - 0.5) ** 2]
    want = 0.0
    for i in range(3):
        for j in range(3):
            gij = gv[b[:, 0] + i, b[:, 1] + j].astype(np.float64)
            dpos = np.array([i, j]) - fx
            want = want + (w[i][:, 0] * w[j][:, 1])[:, None, None] * gij[:, :, None] \
                * dpos[:, None, :]
    np.testing.assert_allclose(c.to_numpy(), want, rtol=1e-4, atol=1e-5)


def test_reduction_accuracy_f32(prog):
    n = 1 << 22
    x = ti.field(ti.f32, shape=n)
    s = ti.field(ti.f32, shape=())
    rng = np.random.default_rng(0)
    data = rng.random(n, dtype=np.float32)
    x.from_numpy(data)

    @ti.kernel
    def k():
        for i in x:
            s[None] += x[i]

    k()
    exact = data.astype(np.float64).sum()
    assert abs(s[None] - exact) / exact < 1e-6


@pytest.mark.skipif(get_target().mvec is None, reason="no glibc libmvec on this machine")
def _widest_vector(opt: str) -> int:
    return max((int(n) for n in re.findall(r"<(\d+) x ", opt)), default=1)


def test_vector_width_is_bounded_by_32_bit_lanes_when_bytes_are_stored(prog):
    """Activating a block of a ``bitmasked`` field from a 2D ``ndrange`` (Taichi's example
    taichi_bitmasked.py) stores an f32 and an activation byte per cell, at a stride of a row
    in the parallel (outer) index once LLVM has unrolled the short inner loop. Chosen by the
    byte, the vectorizer's width was 64 lanes (AVX-512): each store became 64 scalar stores
    or a 64-lane scatter, 5,700 instructions from a 100-line kernel and seconds of object
    emission. No loop runs more lanes than 32-bit values fill; an f32 loop with an f64
    accumulator (no bytes) still runs that many f32 lanes, not as many as f64 values fill."""
    target = get_target()
    if not target.lanes:
        pytest.skip("no vector instruction set on this CPU: nothing is vectorized")
    n = 256
    x = ti.field(ti.f32)
    ti.root.bitmasked(ti.ij, (n, n)).place(x)

    @ti.kernel
    def activate():
        for i, j in ti.ndrange((100, 125), (100, 125)):
            x[i, j] = 233

    ir = _ir(activate, prog)
    opt = target.optimized_ir(llvm_lowering.Lowering(ir, ctx_layout(ir), target).module())
    assert _widest_vector(_task_body(opt, ir.name)) <= target.lanes[32]
    activate()
    want = np.zeros((n, n), np.float32)
    want[100:125, 100:125] = 233
    np.testing.assert_array_equal(x.to_numpy(), want)

    y = ti.field(ti.f32, shape=1 << 12)
    s = ti.field(ti.f64, shape=())

    @ti.kernel
    def mixed():
        for i in y:
            s[None] += ti.f64(y[i] * y[i])

    ir = _ir(mixed, prog)
    opt = target.optimized_ir(llvm_lowering.Lowering(ir, ctx_layout(ir), target).module())
    assert f"<{target.lanes[32]} x float>" in _task_body(opt, ir.name)


def test_transcendentals_call_vector_math(prog):
    x = ti.field(ti.f32, shape=1 << 10)

    @ti.kernel
    def k():
        for i in x:
            x[i] = ti.sin(x[i]) * ti.exp(x[i])

    ir = _ir(k, prog)
    opt = get_target().optimized_ir(
        llvm_lowering.Lowering(ir, ctx_layout(ir), get_target()).module())
    assert "_ZGV" in opt and "sinf" in opt


def test_constant_folding_and_dce(prog):
    x = ti.field(ti.i32, shape=4)

    @ti.kernel
    def k():
        for i in x:
            unused = x[i] * 3  # noqa: F841 - dead on purpose
            x[i] = ti.cast(2.5, ti.i32) * 4 + 1

    ir = _ir(k, prog)
    ops = [s.op for s in walk(ir.tasks[-1].body)]
    assert "load" not in ops and "mul" not in ops and "cast" not in ops
    k()
    assert list(x.to_numpy()) == [9] * 4


def test_big_parallel_loop_uses_the_pool_and_is_correct(prog):
    n = 1 << 20
    hist = ti.field(ti.i32, shape=16)

    @ti.kernel
    def k():
        for i in range(n):
            hist[i % 16] += 1

    k()
    assert list(hist.to_numpy()) == [n // 16] * 16


def test_disk_cache_skips_llvm_in_a_second_process(tmp_path):
    script = textwrap.dedent("""
        import json, sys
        import difftape as ti
        ti.init(arch=ti.cpu)
        x = ti.field(ti.f32, shape=8)

        @ti.kernel
        def k(a: ti.f32):
            for i in x:
                x[i] = ti.sqrt(a + i)

        k(2.0)
        st = k._fast and k.last_compile
        print(json.dumps({"hit": st.cache_hit, "x": float(x[3])}))
    """)
    path = tmp_path / "prog.py"
    path.write_text(script)
    env = dict(os.environ, DIFFTAPE_CACHE_DIR=str(tmp_path / "cache"))
    runs = [json.loads(subprocess.run([sys.executable, str(path)], env=env, check=True,
                                      capture_output=True, text=True).stdout)
            for _ in range(2)]
    assert runs[0]["hit"] is False and runs[1]["hit"] is True
    assert runs[0]["x"] == runs[1]["x"] == pytest.approx(np.sqrt(5.0))
    assert list((tmp_path / "cache").rglob("*.o"))




def test_adjoint_sums_add_no_zeros(prog):
    # An adjoint kernel sums contributions into locals that start at zero, and a selection's
    # untaken side contributes zero. Starting from +0.0 those adds stay in the machine code
    # (x + 0.0 is not x when x is -0.0); from -0.0, the exact identity, LLVM drops them
    # (MPM's p2g.grad had 281 of its 426 float additions adding a zero).
    n = 1 << 10
    x = ti.field(ti.f32, shape=n, needs_grad=True)
    y = ti.field(ti.f32, shape=n, needs_grad=True)

    @ti.kernel
    def k():
        for i in x:
            v = x[i]
            w = ti.max(v, 0.5) * v
            for _ in ti.static(range(3)):
                w = w * 0.5 + ti.sin(v) * ti.min(v, 0.25)
            y[i] = w

    data = np.linspace(-2.0, 2.0, n, dtype=np.float32)
    x.from_numpy(data)
    y.grad.fill(1.0)
    k.grad()
    ck = k.instance((), "grad")
    opt = get_target().optimized_ir(llvm_lowering.Lowering(ck.ir, ck.layout, get_target())
                                    .module())
    adds = re.findall(r"= fadd [^\n]*", opt)
    assert adds and not [a for a in adds if re.search(r"zeroinitializer|0\.000000e\+00", a)]

    v = data.astype(np.float64)
    dw = np.where(v >= 0.5, 2 * v, 0.5)  # d(max(v, 0.5) v)
    dt = np.cos(v) * np.minimum(v, 0.25) + np.sin(v) * (v <= 0.25)  # d(sin(v) min(v, .25))
    for _ in range(3):
        dw = dw * 0.5 + dt
    np.testing.assert_allclose(x.grad.to_numpy(), dw, rtol=1e-5, atol=1e-6)


#: A blend of an ``and`` and an ``ashr`` whose unused lanes shift by more than the element
#: width (as SLP makes of ``zext(trunc)`` and ``sext(trunc)``), the shift also read alone.
_BLEND_OF_SHIFT = """
define void @blend(ptr noalias %p, ptr noalias %q, ptr noalias %e) {
  %x = load <4 x i64>, ptr %p, align 8
  %a = and <4 x i64> %x, <i64 255, i64 poison, i64 4294967295, i64 poison>
  %s = ashr exact <4 x i64> %x, <i64 255, i64 56, i64 4294967295, i64 32>
  %r = shufflevector <4 x i64> %a, <4 x i64> %s, <4 x i32> <i32 0, i32 5, i32 2, i32 7>
  store <4 x i64> %r, ptr %q, align 8
  %s1 = extractelement <4 x i64> %s, i64 1
  store i64 %s1, ptr %e, align 8
  ret void
}
"""


def test_out_of_range_shift_lanes_never_leak_into_a_blend():
    """LLVM 22's x86 backend took the poison lanes of a shift by a constant >= the width
    for zeros and made the blend an OR; the shift instruction fills them with the sign, so the
    ``and``'s lanes came out -1 for negative inputs (AVX-512: vpsravq + vpternlogq). The
    compiled code must blend: those lanes are made shifts by 0 before code generation."""
    target = get_target()
    obj = target.compile(f'target triple = "{target.triple}"\n' + _BLEND_OF_SHIFT)
    engine, names = target.load(obj, ["blend"])
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(names["blend"])
    x = np.array([-5, -7 << 56, -9, -11 << 32], np.int64)
    out, lane1 = np.zeros(4, np.int64), np.zeros(1, np.int64)
    fn(x.ctypes.data, out.ctypes.data, lane1.ctypes.data)
    assert out.tolist() == [x[0] & 0xFF, -7, x[2] & 0xFFFFFFFF, -11]
    assert lane1[0] == -7


def test_defined_shift_lanes_rewrites_only_out_of_range_constant_lanes():
    text = ("  %a = shl nuw <2 x i32> <i32 1, i32 2>, <i32 3, i32 -1>\n"
            "  %b = lshr <2 x i8> %x, <i8 7, i8 poison>\n"
            "  %c = ashr exact <2 x i16> splat (i16 3), <i16 16, i16 15>, !dbg !4\n"
            "  %d = ashr <2 x i64> %y, %z\n")
    assert defined_shift_lanes(text) == text.replace("i32 -1>", "i32 0>").replace(
        "<i16 16,", "<i16 0,")
    assert defined_shift_lanes(text.replace("i32 -1", "i32 31").replace("i16 16", "i16 0")) \
        is None
