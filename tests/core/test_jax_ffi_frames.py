"""The XLA FFI handler of difftape.interop.jax on the CUDA platform, without a GPU: XLA's call
frame is built here as XLA builds it (c_api.h: argument and result buffers over device memory
of the pycuda stand-in or of the simulated grid, the ``target``/``stage`` attributes, an API
table whose ``XLA_FFI_Stream_Get`` names XLA's stream, a deferred stream of the simulation).
Everything after the frame is the real path: the handler reads the frame, borrows XLA's
buffers in place and orders the pass with XLA's stream by events. Because streams are
deferred, a result we wrote is in memory only after XLA's stream runs: a missing stream
dependency, or a host wait we should not make, fails a test. Results are checked bit for bit
against the same passes on host arrays and against the analytic derivatives."""

import ctypes

import numpy as np
import pytest
from cuda_standin import FakeDriver, use

import difftape as ti
from difftape.runtime import program
from difftape.runtime.storage import SimulatedStream

jax = pytest.importorskip("jax", reason="the [jax] extra (JAX) is not installed")
interop = pytest.importorskip("difftape.interop.jax")
xlaffi = pytest.importorskip("difftape.interop.xlaffi")

pytestmark = pytest.mark.difftape_only

N = 6


class FakeXla:
    """XLA's side of a call on the CUDA platform: device buffers, its stream, the API
    table (error creation recorded)."""

    def __init__(self, drv) -> None:
        self.drv = drv
        self.stream = SimulatedStream()
        self.errors: list[str] = []
        self._keep: list = []

        @xlaffi.ERROR_CREATE
        def error_create(args):
            self.errors.append(args.contents.message.decode())
            return 0xE0  # (an opaque XLA_FFI_Error*)

        @xlaffi.STREAM_GET
        def stream_get(args):
            args.contents.stream = self.stream.handle
            return None

        self.api = xlaffi.Api(ctypes.sizeof(xlaffi.Api), None, xlaffi.ApiVersion(), None,
                              error_create, None, None, None, stream_get)

    def buffer(self, values) -> tuple[np.ndarray, int]:
        """Device memory holding ``values`` (written now, as a finished copy), and a host view
        of it (never read before the stream has run)."""
        values = np.asarray(values)
        n = max(1, values.nbytes)
        if self.drv is not None:
            address = int(self.drv.mem_alloc(n))
        else:
            address = program.get().allocator.memory.alloc(n)
        view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address))
        view = view[:values.nbytes].view(values.dtype).reshape(values.shape)
        view[...] = values
        return view, address

    def _list(self, views: list[tuple[np.ndarray, int]]) -> xlaffi.List:
        bufs = []
        for view, address in views:
            dims = (ctypes.c_int64 * max(1, view.ndim))(*view.shape)
            b = xlaffi.CBuffer(ctypes.sizeof(xlaffi.CBuffer), None,
                               xlaffi.CODES[view.dtype], address, view.ndim, dims)
            self._keep += [dims, b]
            bufs.append(b)
        types = (ctypes.c_int * max(1, len(bufs)))(*[1] * len(bufs))
        items = (ctypes.c_void_p * max(1, len(bufs)))(*[ctypes.addressof(b) for b in bufs])
        self._keep += [types, items]
        return xlaffi.List(ctypes.sizeof(xlaffi.List), None, len(bufs), types, items)

    def call(self, target: int, stage: int, args: list, rets: list) -> int:
        """Call the CUDA handler as XLA does; its return (0: success)."""
        names, values, types = [], [], []
        for name, value in sorted({"stage": np.int32(stage), "target": np.int64(target)}
                                  .items()):
            raw = ctypes.create_string_buffer(value.tobytes())
            span = xlaffi.ByteSpan(ctypes.cast(ctypes.c_char_p(name.encode()),
                                               ctypes.c_void_p), len(name))
            scalar = xlaffi.Scalar(xlaffi.CODES[value.dtype], ctypes.addressof(raw))
            self._keep += [raw, span, scalar, name.encode()]
            names.append(ctypes.pointer(span))
            values.append(ctypes.addressof(scalar))
            types.append(3)
        attrs = xlaffi.Attrs(ctypes.sizeof(xlaffi.Attrs), None, len(names),
                             (ctypes.c_int * 2)(*types),
                             (ctypes.POINTER(xlaffi.ByteSpan) * 2)(*names),
                             (ctypes.c_void_p * 2)(*values))
        frame = xlaffi.CallFrame(ctypes.sizeof(xlaffi.CallFrame), None,
                                 ctypes.pointer(self.api), None, 3, self._list(args),
                                 self._list(rets), attrs)
        return xlaffi.handler["cuda"](ctypes.pointer(frame)) or 0


@pytest.fixture(params=["cuda-standin", "simulated-grid"])
def xla(request, monkeypatch):
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    if request.param == "cuda-standin":
        drv = use(monkeypatch, FakeDriver())
        ti.init(arch=ti.cuda, default_fp=ti.f64)
    else:
        drv = None
        ti.init(arch=ti.cpu, simulate_grid=(2, 32), default_fp=ti.f64)
    yield FakeXla(drv)
    ti.reset()
    jax.config.update("jax_enable_x64", previous)


@ti.kernel
def cube(a: ti.types.ndarray(), b: ti.types.ndarray()):
    for i in a:
        b[i] = a[i] * a[i] * a[i]


def _values(seed, n=N):
    return np.random.default_rng(seed).uniform(0.5, 1.5, n)


def test_cuda_frame_runs_in_place_on_xlas_stream(xla):
    a = ti.ndarray(ti.f64, N, needs_grad=True)
    b = ti.ndarray(ti.f64, N, needs_grad=True)
    f = interop.function(lambda: cube(a, b), inputs=[a], outputs=[b])
    key = f.passes.key
    bound = []  # where the storage was when each pass ended
    unbind = f.program.unbind
    f.program.unbind = lambda: (bound.append((a.storage.address, b.storage.address,
                                              a.grad.storage.address)), unbind())
    xv, uv = _values(0), _values(1)
    x, u = xla.buffer(xv), xla.buffer(uv)
    y, token = xla.buffer(np.full(N, np.nan)), xla.buffer(np.int32(-1))
    assert xla.call(key, interop.RUN_RECORDED, [x], [y, token]) == 0, xla.errors
    assert bound[-1][:2] == (x[1], y[1])  # XLA's memory itself
    assert np.isnan(y[0]).all()  # nobody waited on the host...
    xla.stream.synchronize()  # ...XLA's next operation on its stream sees the result
    np.testing.assert_array_equal(y[0], xv * xv * xv)
    assert token[0] == 0  # (on CUDA the backward pass runs the program again)
    g = xla.buffer(np.full(N, np.nan))
    assert xla.call(key, interop.VJP, [token, x, y, u], [g]) == 0, xla.errors
    assert bound[-1][2] == g[1]  # accumulated in XLA's result buffer
    assert np.isnan(g[0]).all()
    xla.stream.synchronize()
    np.testing.assert_allclose(g[0], 3 * xv ** 2 * uv, rtol=1e-15)
    np.testing.assert_array_equal(u[0], uv)
    # after the calls nothing of ours points at XLA's buffers
    assert not {a.storage.address, b.storage.address, a.grad.storage.address} & \
        {x[1], y[1], g[1], u[1]}
    # the same passes on host arrays: the same kernels, bit for bit
    p = f.program
    np.testing.assert_array_equal(y[0], p.run([xv.copy()], record=False)[1][0])
    np.testing.assert_array_equal(g[0], p.vjp(None, [xv.copy()], [uv])[0])


def _field_function(mode):
    x = ti.field(ti.f64, N, needs_grad=True)
    w = ti.field(ti.f64, N, needs_grad=True)
    y = ti.field(ti.f64, N, needs_grad=True)
    s = ti.field(ti.f64, (), needs_grad=True)

    @ti.kernel
    def compute():
        for i in x:
            y[i] = ti.sin(x[i]) * w[i] * w[i] + x[(i + 1) % N] * w[i]

    @ti.kernel
    def total():
        for i in y:
            s[None] += y[i] * y[i]

    def run():
        compute()
        total()

    return interop.function(run, [x, w], [y, s], mode=mode)


def test_cuda_frame_second_order_and_forward_mode(xla):
    f, g = _field_function("reverse"), _field_function("forward")
    xv, wv, uv, sv, tx, tw = (_values(k) for k in range(2, 8))
    sv = np.float64(sv[0])
    x, w, u, s = xla.buffer(xv), xla.buffer(wv), xla.buffer(uv), xla.buffer(sv)
    ax, aw = xla.buffer(tx), xla.buffer(tw)
    second = [xla.buffer(np.full(N, np.nan)), xla.buffer(np.float64(np.nan)),
              xla.buffer(np.full(N, np.nan)), xla.buffer(np.full(N, np.nan))]
    assert xla.call(f.passes.key, interop.SECOND, [x, w, u, s, ax, aw], second) == 0, \
        xla.errors
    tangents = [xla.buffer(np.full(N, np.nan)), xla.buffer(np.float64(np.nan)),
                xla.buffer(np.full(N, np.nan)), xla.buffer(np.float64(np.nan))]
    assert xla.call(g.passes.key, interop.JVP, [x, w, ax, aw], tangents) == 0, xla.errors
    assert all(np.isnan(v).all() for v, _ in second + tangents)  # no host wait
    xla.stream.synchronize()
    d_us, d_xs = f.program.vjp_derivative([xv, wv], [uv, np.array(sv)], [tx, tw])
    for (got, _), want in zip(second, [*d_us, *d_xs], strict=True):
        np.testing.assert_array_equal(got, want)
    outs, touts = g.program.jvp([xv, wv], [tx, tw])
    for (got, _), want in zip(tangents, [*outs, *touts], strict=True):
        np.testing.assert_array_equal(got, want)
    # forward mode against the analytic derivative of y
    dy = np.cos(xv) * tx * wv * wv + np.roll(tx, -1) * wv \
        + (2 * np.sin(xv) * wv + np.roll(xv, -1)) * tw
    np.testing.assert_allclose(tangents[2][0], dy, rtol=1e-13)


def test_cuda_frame_on_a_host_program_is_an_error_xla_raises(monkeypatch):
    """A CUDA call on a program whose storage is host memory: refused through XLA's error
    (JAX raises it), saying what to do."""
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    try:
        xla = FakeXla(None)
        a = ti.ndarray(ti.f64, N, needs_grad=True)
        b = ti.ndarray(ti.f64, N, needs_grad=True)
        f = interop.function(lambda: cube(a, b), inputs=[a], outputs=[b])
        host = [np.zeros(N), np.zeros(N)]
        views = [(v, v.ctypes.data) for v in host]
        assert xla.call(f.passes.key, interop.RUN, views[:1], views[1:]) == 0xE0
        assert "not device memory" in xla.errors[0]
        assert not host[1].any()  # nothing written
    finally:
        ti.reset()


def test_unknown_target_is_an_error(xla):
    out = xla.buffer(np.zeros(N))
    assert xla.call(0, interop.RUN, [], [out]) == 0xE0
    assert "no longer exists" in xla.errors[0]


def test_cuda_frame_arguments_are_read_only(xla):
    """XLA's argument buffers are JAX arrays: a kernel writing one is refused."""
    a = ti.ndarray(ti.f64, N, needs_grad=True)
    b = ti.ndarray(ti.f64, N, needs_grad=True)

    @ti.kernel
    def scale_in_place(a: ti.types.ndarray(), b: ti.types.ndarray()):
        for i in a:
            a[i] = 2 * a[i]
            b[i] = a[i]

    f = interop.function(lambda: scale_in_place(a, b), inputs=[a], outputs=[b])
    xv = _values(13)
    x, y = xla.buffer(xv), xla.buffer(np.full(N, np.nan))
    assert xla.call(f.passes.key, interop.RUN, [x], [y]) == 0xE0
    assert "read-only" in xla.errors[0]
    xla.stream.synchronize()
    np.testing.assert_array_equal(x[0], xv)
