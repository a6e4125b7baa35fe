"""The CUDA target (difftape/codegen/cuda.py) without a GPU.

Two kinds of checks. The PTX itself: ptxas accepts it, math is libdevice's and linked in, float
atomics are native, print appends records to the print buffer. And what the CUDA lowering
computes: its code, compiled for the host (codegen/simgrid.py), is launched by the
simulated-grid runtime (runtime/simgrid.py, ``ti.init(simulate_grid=(blocks, threads))``),
which runs every thread of the grid one after another and does what a GPU launcher must: the
per-thread stack pool and its overflow rerun, the error word, per-thread random states. The
results are compared with NumPy: the grid-stride loop covers every index once for any grid,
per-thread partial sums, serial tasks on thread 0, reverse-mode stacks from the pool, a rerun
that duplicates no side effect, and bounds checks that raise as on the CPU.
"""

import re
import shutil
import subprocess

import numpy as np
import pytest

import difftape as ti
from difftape.codegen import cpu, cuda, llvm_lowering, simgrid
from difftape.codegen.layout import ctx_layout
from difftape.errors import IndexOutOfRangeError, OptionError
from difftape.ir.nodes import task_blocks, walk
from difftape.ir.passes import run_pipeline
from difftape.runtime import grid as grid_runtime
from difftape.runtime import program

pytestmark = pytest.mark.difftape_only

_NEEDS_PTXAS = pytest.mark.skipif(shutil.which("ptxas") is None or cuda.find_libdevice() is None,
                                  reason="ptxas or libdevice (CUDA toolkit) not installed")


@pytest.fixture
def prog():
    ti.init(arch=ti.cpu)
    yield program.get()
    ti.reset()


def _simulate(blocks, threads, **options):
    ti.init(arch=ti.cpu, simulate_grid=(blocks, threads), **options)
    return program.get()


@pytest.fixture
def grid():
    """``grid(blocks, threads, **options)``: a program whose kernels run on that grid."""
    yield _simulate
    ti.reset()


def _ir(kernel, prog, variant="primal", debug=False):
    ir = kernel.build_ir(prog, (), variant)
    ir.debug = debug
    return run_pipeline(ir)


def _cuda_text(ir):
    return llvm_lowering.Lowering(ir, ctx_layout(ir), cuda.get_target()).module()


def _ptx(ir):
    return cuda.get_target().compile(_cuda_text(ir)).decode()


def _launched(kernel, variant="primal"):
    """The compiled instance (and so its GridKernel) a kernel's last launch used."""
    if variant == "grad":
        return next(iter(kernel.grad.instances.values()))
    return kernel._fast


@pytest.mark.parametrize("blocks,threads", [(1, 1), (3, 8), (64, 32)])
def test_grid_stride_loop_covers_every_index_once_for_any_grid(grid, blocks, threads):
    grid(blocks, threads)
    n = 1000
    x = ti.field(ti.f32, shape=n)
    y = ti.field(ti.f32, shape=n)
    hits = ti.field(ti.i32, shape=n)

    @ti.kernel
    def k():
        for i in x:
            y[i] = ti.sin(x[i]) * x[i]
            hits[i] += 1

    xs = np.linspace(-3, 3, n).astype(np.float32)
    x.from_numpy(xs)
    k()
    assert _launched(k).grid is not None  # launched over the simulated grid
    np.testing.assert_array_equal(hits.to_numpy(), 1)
    np.testing.assert_allclose(y.to_numpy(), np.sin(xs.astype(np.float64)) * xs, rtol=1e-6,
                               atol=1e-6)


def test_the_simulated_grid_runs_the_cuda_lowering(grid):
    """The same entry points as the PTX (one kernel per task, the grid-stride loop), with the
    special registers as parameters and a driver per task."""
    prog = grid(2, 4)
    x = ti.field(ti.f32, shape=8)

    @ti.kernel
    def k():
        for i in x:
            x[i] = 1.0

    ir = _ir(k, prog)
    text = llvm_lowering.Lowering(ir, ctx_layout(ir), simgrid.get_target()).module()
    assert "define internal void @k_task0(ptr noalias %ctx, i64 %gid, i64 %nthreads)" in text
    assert "define void @k_task0_grid(" in text and "read.ptx.sreg" not in text
    for shared in ("stack_init", "stack_push", "stack_pop", "private_copy", "rng_index"):
        assert getattr(simgrid.SimGridTarget, shared) is getattr(cuda.CUDATarget, shared)


def test_reduction_partials_per_thread_and_serial_task_on_thread_zero(grid):
    prog = grid(4, 16)
    n = 777
    x = ti.field(ti.f64, shape=n)
    s = ti.field(ti.f64, shape=())
    count = ti.field(ti.i32, shape=())

    @ti.kernel
    def k():
        count[None] += 1  # a serial task: once, whatever the grid
        for i in x:
            s[None] += x[i] * x[i]

    xs = np.random.default_rng(0).random(n)
    x.from_numpy(xs)
    assert [t.kind for t in _ir(k, prog).tasks] == ["serial", "range"]
    k()
    assert count[None] == 1
    assert s[None] == pytest.approx(float(np.sum(xs * xs)), rel=1e-12)


def test_threads_in_reverse_order_give_the_same_results(grid):
    """Threads run one after another; last-first is another valid schedule (no barriers)."""
    prog = grid(3, 5)
    n = 100
    x = ti.field(ti.i32, shape=n)
    hist = ti.field(ti.i32, shape=7)

    @ti.kernel
    def k():
        for i in x:
            x[i] = i * i
            hist[i % 7] += i

    k()
    inst = _launched(k)
    first = hist.to_numpy().copy()
    hist.fill(0)
    inst.grid.reverse = 1
    inst.launch(())
    np.testing.assert_array_equal(hist.to_numpy(), first)
    np.testing.assert_array_equal(first, [sum(i for i in range(n) if i % 7 == r)
                                          for r in range(7)])
    assert prog.rng.size >= 15


def _loop_kernel(n):
    x = ti.field(ti.f64, shape=n, needs_grad=True)
    y = ti.field(ti.f64, shape=n, needs_grad=True)
    reps = ti.field(ti.i32, shape=n)

    @ti.kernel
    def k():
        for i in x:
            v = x[i]
            j = 0
            while j < reps[i]:
                v = ti.sin(v)
                j += 1
            y[i] = v

    return x, y, reps, k


def _want(xs, rs):
    """d/dx of sin applied rs[i] times."""
    want = np.ones(len(xs))
    for i in range(len(xs)):
        v = xs[i]
        for _ in range(rs[i]):
            want[i] *= np.cos(v)
            v = np.sin(v)
    return want


def test_reverse_mode_stack_per_thread_from_the_pool(grid):
    prog = grid(2, 4)
    n = 50
    x, y, reps, k = _loop_kernel(n)
    xs = np.linspace(0.1, 1.5, n)
    rs = np.arange(n) % 7
    x.from_numpy(xs)
    reps.from_numpy(rs.astype(np.int32))
    ir = _ir(k, prog, "grad")
    assert any(s.op == "stack_push" for t in ir.tasks for b in task_blocks(t) for s in walk(b))
    y.grad.from_numpy(np.ones(n))
    k()
    k.grad()
    np.testing.assert_allclose(x.grad.to_numpy(), _want(xs, rs), rtol=1e-12)


def test_stack_overflow_reruns_with_a_larger_pool_and_accumulates_once(grid):
    """A thread that pushes past its slice sets the overflow flag; the task is rerun with the
    pool doubled, from a snapshot of what it writes: the gradient (which the adjoint adds
    into, on top of what was there) comes out as if the first attempt never happened."""
    grid(2, 4)
    n = 16
    x, y, reps, k = _loop_kernel(n)
    xs = np.linspace(0.2, 0.9, n)
    rs = np.full(n, 300, np.int32)  # ~300 pushes per index, 2 indices per thread
    x.from_numpy(xs)
    reps.from_numpy(rs)
    before = np.arange(n, dtype=np.float64)
    x.grad.from_numpy(before)
    y.grad.from_numpy(np.ones(n))
    k()
    k.grad()
    run = _launched(k, "grad").grid
    assert run.reruns >= 3 and run.cap >= 2 * 300  # started at 64 slots per thread
    np.testing.assert_allclose(x.grad.to_numpy(), before + _want(xs, rs), rtol=1e-12)
    # A second launch starts from the grown pool: no rerun, the same gradient again.
    reruns = run.reruns
    y.grad.from_numpy(np.ones(n))  # (the adjoint of the store y[i] = v consumed it)
    k.grad()
    assert run.reruns == reruns
    np.testing.assert_allclose(x.grad.to_numpy(), before + 2 * _want(xs, rs), rtol=1e-12)


def test_a_rerun_launch_equals_one_with_a_large_enough_pool(grid):
    """Under a Tape (the adjoint adds into .grad fields, a kernel-level scalar's gradient
    flows back through the launch context) an overflowed, rerun launch gives bit for bit the
    gradient of a launch whose pool was large enough from the start."""
    def run(first_slots):
        grid(2, 3)
        n = 12
        x, y, reps, k = _loop_kernel(n)
        total = ti.field(ti.f64, shape=(), needs_grad=True)

        @ti.kernel
        def loss():
            for i in y:
                total[None] += y[i] * y[i]

        x.from_numpy(np.linspace(0.3, 0.8, n))
        reps.from_numpy(np.full(n, 100, np.int32))
        saved, grid_runtime.FIRST_STACK_SLOTS = grid_runtime.FIRST_STACK_SLOTS, first_slots
        try:
            with ti.ad.Tape(loss=total):
                k()
                loss()
            reruns = _launched(k, "grad").grid.reruns
        finally:
            grid_runtime.FIRST_STACK_SLOTS = saved
        return x.grad.to_numpy(), reruns

    g1, reruns1 = run(4)
    g2, reruns2 = run(1 << 12)
    assert reruns1 > 0 and reruns2 == 0
    np.testing.assert_array_equal(g1, g2)
    assert np.all(g1 != 0)


def test_random_states_one_per_grid_thread(grid):
    prog = grid(16, 32, random_seed=3)
    assert prog.rng.size >= 512 and len(set(prog.rng.read()[:512].tolist())) == 512
    n = 1 << 14
    r = ti.field(ti.f64, shape=n)

    @ti.kernel
    def k():
        for i in r:
            r[i] = ti.random(ti.f64)

    k()
    v = r.to_numpy()
    assert len(np.unique(v)) == n  # no two threads share a state
    assert abs(v.mean() - 0.5) < 0.02 and 0 <= v.min() and v.max() < 1


def test_bounds_check_raises_as_on_the_cpu(grid):
    grid(2, 2, debug=True)
    x = ti.field(ti.f32, shape=8)

    @ti.kernel
    def k():
        for i in x:
            x[i + 1] = 1.0  # index 8 is out of range

    with pytest.raises(IndexOutOfRangeError, match=r"index 8 out of range for axis 0 of 'x'"
                                                   r"(.|\n)*x\[i \+ 1\] = 1.0"):
        k()
    np.testing.assert_array_equal(x.to_numpy()[1:], 1.0)  # every in-range store happened


def test_simulate_grid_option_and_environment(monkeypatch):
    ti.init(arch=ti.cpu, simulate_grid="2,8")
    assert program.get().config.simulate_grid == (2, 8)
    with pytest.raises(OptionError, match="simulate_grid"):
        ti.init(arch=ti.cpu, simulate_grid=(0, 4))
    monkeypatch.setenv("DIFFTAPE_SIMULATE_GPU", "1")
    ti.init(arch=ti.cpu)
    assert program.get().config.simulate_grid == program.DEFAULT_SIMULATED_GRID
    monkeypatch.setenv("DIFFTAPE_SIMULATE_GPU", "3,16")
    ti.init(arch=ti.cpu)
    assert program.get().config.simulate_grid == (3, 16)
    ti.init(arch=ti.cpu, simulate_grid=None)  # the option wins over the environment
    assert program.get().config.simulate_grid is None
    with pytest.raises(OptionError, match="simulate_grid.*arch=remote"):
        ti.init(arch=ti.remote, simulate_grid=(2, 2))
    monkeypatch.setenv("DIFFTAPE_SIMULATE_GPU", "yes")
    with pytest.raises(OptionError, match="DIFFTAPE_SIMULATE_GPU"):
        ti.init(arch=ti.cpu)
    monkeypatch.setenv("DIFFTAPE_SIMULATE_GPU", "0")
    ti.init(arch=ti.cpu)
    assert program.get().config.simulate_grid is None
    ti.reset()


def test_f16_math_calls_the_f32_function(prog):
    # libdevice has no half sine: widened to f32, __nv_sinf, rounded back once (as Taichi)
    x = ti.field(ti.f16, shape=4)

    @ti.kernel
    def k():
        for i in x:
            x[i] = ti.sin(x[i])

    text = _cuda_text(_ir(k, prog))
    assert "fpext half" in text and "call float @__nv_sinf(" in text
    assert "fptrunc float" in text


@_NEEDS_PTXAS
def test_ptx_uses_libdevice_native_atomics_and_print_records(prog, tmp_path):
    x = ti.field(ti.f32, shape=64)
    g = ti.field(ti.f32, shape=8)

    @ti.kernel
    def k(a: ti.f32):
        print("a =", a, ti.u8(7), ti.i64(-1), ti.f64(a))
        for i in x:
            g[i % 8] += ti.exp(x[i]) * ti.atan2(x[i], a)

    ptx = _ptx(_ir(k, prog))
    assert ".entry k_task0" in ptx and ".entry k_task1" in ptx
    assert "%nctaid.x" in ptx  # the grid-stride loop's step
    assert not re.search(r"\.extern \.func[^;]*__nv_", ptx)  # libdevice linked in
    assert re.search(r"(atom|red)(\.global)?\.add\.f32", ptx)  # native float atomics
    # print: a record reserved by an atomic add on the print buffer's cursor, no vprintf
    assert "vprintf" not in ptx and re.search(r"atom(\.global)?\.add\.u64", ptx)
    path = tmp_path / "k.ptx"
    path.write_text(ptx)
    r = subprocess.run(["ptxas", f"-arch={cuda.DEFAULT_ARCH}", str(path), "-o",
                        str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_architecture_is_checked():
    with pytest.raises(ValueError, match="sm_75"):
        cuda.CUDATarget("compute_75x")


def test_both_targets_supply_the_whole_target_interface():
    from difftape.codegen.target import Target

    members = [n for n in vars(Target) if not n.startswith("_")] + \
        list(Target.__annotations__)
    for target in (cpu.get_target(), cuda.get_target()):
        missing = [n for n in members if not hasattr(target, n)]
        assert not missing, (target.name, missing)


def _failing_everywhere(n, m, count):
    """A kernel in which every index fails a bounds check, even indices on axis 0 and odd
    ones on axis 1, each with an index that names it (``n + i`` / ``m + i``)."""
    x = ti.field(ti.f64, shape=(n, m))

    @ti.kernel
    def k():
        for i in range(count):
            if i % 2 == 0:
                x[n + i, 0] = 1.0
            else:
                x[0, m + i] = 1.0

    return k


def _reported(k) -> tuple[int, int]:
    with pytest.raises(IndexOutOfRangeError) as e:
        k()
    found = re.search(r"index (\d+) out of range for axis (\d) of 'x'", str(e.value))
    return int(found[2]), int(found[1])


def test_many_threads_failing_at_once_report_the_first_failure_whole(grid):
    """Every thread of the grid fails (two different checks, each index its own value): the
    error word is claimed by the first failure (compare-and-swap on the code) and only that
    thread writes its value, so the report is one failure, whole. The simulated grid runs
    thread 0 first: its index 0 is the first failure (a plain store let the last thread's
    code win, and on a GPU the code and the value from different threads)."""
    n, m = 5, 7
    grid(3, 4, debug=True)
    assert _reported(_failing_everywhere(n, m, 40)) == (0, n + 0)
    grid(1, 1, debug=True)  # one thread: indices in order, it stops at the first
    assert _reported(_failing_everywhere(n, m, 40)) == (0, n + 0)


def test_error_word_claimed_by_compare_and_swap_on_every_target(prog):
    """The shared lowering writes the error value only after winning the code: the CPU, the
    simulated grid and CUDA modules all carry it."""
    x = ti.field(ti.f64, shape=4)

    @ti.kernel
    def k():
        for i in x:
            x[i + 1] = 1.0

    ir = _ir(k, prog, debug=True)
    lay = ctx_layout(ir)
    for target in (cpu.get_target(), simgrid.get_target(), cuda.get_target()):
        text = llvm_lowering.Lowering(ir, lay, target).module()
        assert re.search(r"cmpxchg ptr %\w+, i64 0, i64 1 ", text), target.name
        claim, value = text.index("cmpxchg"), text.index("err_value")
        assert claim < value, target.name


def test_cpu_threads_failing_at_once_report_a_whole_failure():
    """The same race on the CPU's thread pool: whichever chunk wins, the axis and the index
    reported belong to one failure (even indices fail on axis 0, odd ones on axis 1)."""
    n, m, count = 5, 7, 1 << 14
    ti.init(arch=ti.cpu, debug=True, cpu_max_num_threads=4)
    try:
        k = _failing_everywhere(n, m, count)
        for _ in range(30):
            axis, index = _reported(k)
            i = index - (n if axis == 0 else m)
            assert 0 <= i < count and i % 2 == axis, (axis, index)
    finally:
        ti.reset()
