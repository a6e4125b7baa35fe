"""The CUDA target (difftape/codegen/cuda.py) without a GPU.

Two kinds of checks. The PTX itself: ptxas accepts it, math is libdevice's and linked in,
float atomics are native, print is vprintf. And what the CUDA lowering computes: its LLVM IR,
before the NVPTX backend, is run on the CPU under a simulated grid. The special registers
(thread and block index and counts) become globals that the test sets before calling each
thread's kernel entry, one thread after another (a valid interleaving: our kernels have no
barriers), and libdevice's ``__nv_*`` calls become the CPU's libm. The results are compared
with NumPy: the grid-stride loop covers every index once for any grid, per-thread partial
sums, serial tasks on thread 0, per-thread reverse-mode stacks from a pool (and its overflow
flag), and bounds checks that set the error word instead of faulting.
"""

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

import difftape as ti
from difftape.codegen import cpu, cuda, llvm_lowering
from difftape.codegen.layout import ctx_layout
from difftape.errors import CompileError
from difftape.ir.nodes import task_blocks, walk
from difftape.ir.passes import run_pipeline
from difftape.runtime import program

pytestmark = pytest.mark.difftape_only

_NEEDS_PTXAS = pytest.mark.skipif(shutil.which("ptxas") is None or cuda.find_libdevice() is None,
                                  reason="ptxas or libdevice (CUDA toolkit) not installed")
_SREGS = ("tid.x", "ntid.x", "ctaid.x", "nctaid.x")


@pytest.fixture
def prog():
    ti.init(arch=ti.cpu)
    yield program.get()
    ti.reset()


def _ir(kernel, prog, variant="primal", debug=False):
    ir = kernel.build_ir(prog, (), variant)
    ir.debug = debug
    return run_pipeline(ir)


def _cuda_text(ir):
    return llvm_lowering.Lowering(ir, ctx_layout(ir), cuda.get_target()).module()


def _ptx(ir):
    return cuda.get_target().compile(_cuda_text(ir)).decode()


class SimulatedGrid:
    """A kernel's CUDA entry points compiled for the CPU and run thread by thread."""

    def __init__(self, ir, prog, pool_slots=4096):
        self.ir, self.prog = ir, prog
        self.layout = ctx_layout(ir)
        host = cpu.get_target()
        text = _cuda_text(ir)
        text = re.sub(r'target (triple|datalayout) = ".*"\n', "", text)
        text = f'target triple = "{host.triple}"\n' + text.replace("ptx_kernel ", "")
        for reg in _SREGS:
            text = text.replace(f"declare i32 @llvm.nvvm.read.ptx.sreg.{reg}()",
                                f"@sim.{reg} = global i32 0")
            text = text.replace(f"call i32 @llvm.nvvm.read.ptx.sreg.{reg}()",
                                f"load i32, ptr @sim.{reg}")
        text = re.sub(r"@__nv_(\w+)", r"@dt_\1", text)  # libdevice -> the CPU's libm
        text = text.replace("@malloc(", "@dt_malloc(").replace("@free(", "@dt_free(")
        names = [f"{ir.name}_task{k}" for k in range(len(ir.tasks))]
        self.engine, addrs = host.load(host.compile(text), names)
        self.fns = [ctypes.CFUNCTYPE(None, ctypes.c_void_p)(addrs[n]) for n in names]
        self.sreg = {r: ctypes.c_int32.from_address(
            self.engine.get_global_value_address(f"sim.{r}")) for r in _SREGS}
        self.ctx = np.zeros(self.layout.size, np.int64)
        for slot, buf in enumerate(ir.buffers):
            storage = prog.fields[buf.key[1]].companion(buf.key[2])
            self.ctx[self.layout.buffer_ptr[slot]] = storage.arr.ctypes.data
        self.pool_slots = pool_slots

    def launch(self, blocks, threads):
        """Every task over a ``blocks`` x ``threads`` grid; the error code and overflow flag."""
        n = blocks * threads
        pool = np.zeros(self.pool_slots * n, np.int64)
        rng = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        lay = self.layout
        self.ctx[lay.stack_pool] = pool.ctypes.data
        self.ctx[lay.stack_cap] = self.pool_slots
        self.ctx[lay.rng] = rng.ctypes.data
        self.ctx[lay.err_code] = self.ctx[lay.overflow] = 0
        self.sreg["ntid.x"].value, self.sreg["nctaid.x"].value = threads, blocks
        for fn in self.fns:
            for b in range(blocks):
                for t in range(threads):
                    self.sreg["ctaid.x"].value, self.sreg["tid.x"].value = b, t
                    fn(self.ctx.ctypes.data)
        return int(self.ctx[lay.err_code]), int(self.ctx[lay.overflow])


@pytest.fixture(autouse=True, scope="module")
def _libc_malloc():
    import llvmlite.binding as llvm

    libc = ctypes.CDLL(None)
    for name in ("malloc", "free"):
        llvm.add_symbol(f"dt_{name}", ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)


@pytest.mark.parametrize("blocks,threads", [(1, 1), (3, 8), (64, 32)])
def test_grid_stride_loop_covers_every_index_once_for_any_grid(prog, blocks, threads):
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
    grid = SimulatedGrid(_ir(k, prog), prog)
    assert grid.launch(blocks, threads) == (0, 0)
    np.testing.assert_array_equal(hits.to_numpy(), 1)
    np.testing.assert_allclose(y.to_numpy(), np.sin(xs.astype(np.float64)) * xs, rtol=1e-6,
                               atol=1e-6)


def test_reduction_partials_per_thread_and_serial_task_on_thread_zero(prog):
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
    ir = _ir(k, prog)
    assert [t.kind for t in ir.tasks] == ["serial", "range"]
    assert SimulatedGrid(ir, prog).launch(4, 16) == (0, 0)
    assert count[None] == 1
    assert s[None] == pytest.approx(float(np.sum(xs * xs)), rel=1e-12)


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


def test_reverse_mode_stack_per_thread_from_the_pool(prog):
    n = 50
    x, y, reps, k = _loop_kernel(n)
    xs = np.linspace(0.1, 1.5, n)
    rs = np.arange(n) % 7
    x.from_numpy(xs)
    reps.from_numpy(rs.astype(np.int32))
    ir = _ir(k, prog, "grad")
    assert any(s.op == "stack_push" for t in ir.tasks for b in task_blocks(t) for s in walk(b))
    y.grad.from_numpy(np.ones(n))
    assert SimulatedGrid(ir, prog, pool_slots=64).launch(2, 4) == (0, 0)
    want = np.ones(n)
    for i in range(n):  # d/dx of sin applied rs[i] times
        v = xs[i]
        for _ in range(rs[i]):
            want[i] *= np.cos(v)
            v = np.sin(v)
    np.testing.assert_allclose(x.grad.to_numpy(), want, rtol=1e-12)


def test_reverse_mode_stack_overflow_sets_the_flag_and_stays_in_the_pool(prog):
    n = 16
    x, y, reps, k = _loop_kernel(n)
    x.from_numpy(np.full(n, 0.5))
    reps.from_numpy(np.full(n, 40, np.int32))  # 40 pushes per index, 4 slots per thread
    y.grad.from_numpy(np.ones(n))
    grid = SimulatedGrid(_ir(k, prog, "grad"), prog, pool_slots=4)
    assert grid.launch(2, 4) == (0, 1)  # (the pool is exactly 4 x 8 slots: no write past it)


def test_bounds_check_sets_the_error_word(prog):
    x = ti.field(ti.f32, shape=8)

    @ti.kernel
    def k():
        for i in x:
            x[i + 1] = 1.0  # index 8 is out of range

    ir = _ir(k, prog, debug=True)
    grid = SimulatedGrid(ir, prog)
    code, overflow = grid.launch(2, 2)
    messages = llvm_lowering.assert_messages(ir)
    assert overflow == 0 and code >= 1
    assert "out of range for axis 0 of 'x'" in messages[code - 1]
    assert int(grid.ctx[grid.layout.err_value]) == 8
    np.testing.assert_array_equal(x.to_numpy()[1:], 1.0)  # every in-range store happened


def test_f16_math_is_refused(prog):
    x = ti.field(ti.f16, shape=4)

    @ti.kernel
    def k():
        for i in x:
            x[i] = ti.sin(x[i])

    ir = _ir(k, prog)
    with pytest.raises(CompileError, match="f16"):
        _cuda_text(ir)


@_NEEDS_PTXAS
def test_ptx_uses_libdevice_native_atomics_and_vprintf(prog, tmp_path):
    x = ti.field(ti.f32, shape=64)
    g = ti.field(ti.f32, shape=8)

    @ti.kernel
    def k(a: ti.f32):
        print("a =", a)
        for i in x:
            g[i % 8] += ti.exp(x[i]) * ti.atan2(x[i], a)

    ptx = _ptx(_ir(k, prog))
    assert ".entry k_task0" in ptx and ".entry k_task1" in ptx
    assert "%nctaid.x" in ptx  # the grid-stride loop's step
    assert not re.search(r"\.extern \.func[^;]*__nv_", ptx)  # libdevice linked in
    assert re.search(r"(atom|red)(\.global)?\.add\.f32", ptx)  # native float atomics
    assert "vprintf" in ptx
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
