"""A stand-in for ``pycuda.driver``: the one the CUDA runtime's tests share (no GPU needed).

Its "device memory" is host memory and it records what it is asked (the context stack, on
which thread, limits, launches, synchronisations, loaded images). What a "loaded module" does
depends on the image it is given:

- the simulated grid's host object code (the CUDA target's lowering compiled for the host:
  :func:`use`'s ``code="simgrid"``): a "cuLaunchKernel" (``prepared_async_call``) runs the
  grid thread by thread when its stream reaches it, so results can be checked against the
  CPU's;
- real device code (a cubin from ptxas, or PTX, :func:`use`'s ``code="cuda"``): the image is
  recorded (:attr:`FakeDriver.images`: ``"cubin"`` or ``"ptx"``, the latter being the driver's
  JIT) and a launch does nothing, for tests of compiling, caching and loading.

Streams are deferred (the simulated grid's :class:`SimulatedStream`): nothing enqueued runs
until the host synchronises, so a read that skips a sync point sees stale memory; copies from
page-locked host memory read it when the stream runs them, copies from pageable memory when
they are called, as the real driver does. A stream waits for an event of another stream
(``wait_for_event``; the raw driver calls of ``runtime/cuda.py``'s ``CudaDriverApi``, as
:attr:`FakeDriver.api`, find streams by handle) by running that stream up to the event when
it gets there: a missing dependency between streams shows as an unseen write.

CUDA graphs (the raw driver calls ``runtime/cuda.py``'s ``CudaGraphExec`` makes through
:attr:`FakeDriver.api`) are deferred too: between ``begin_capture`` and ``end_capture`` what is
enqueued on the stream is recorded, not run (a synchronisation there fails, as CUDA's does); an
instantiated graph is a copy of those operations with the addresses they were captured with,
which ``launch_graph`` enqueues as one operation on a stream, and which only ``exec_update``
changes. So a replay that skips the update after an address changed, or the upload of the
launch contexts its kernels read, computes a wrong answer. :attr:`FakeDriver.graph_calls`
counts the calls.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from difftape.codegen import cuda as cuda_codegen
from difftape.codegen import simgrid as simgrid_codegen
from difftape.runtime import cuda as cuda_runtime
from difftape.runtime.simgrid import GRID_FN
from difftape.runtime.storage import SimulatedDriverApi, SimulatedStream

SMS = 2  # multiprocessors of the stand-in device: a grid of SMS * 4 blocks of 128 threads
TOTAL_MEMORY = 8 << 30


class FakeDriver:
    """The part of pycuda.driver CudaLauncher and DeviceAllocator call, recording it."""

    class device_attribute:  # noqa: N801 - pycuda's name
        MULTIPROCESSOR_COUNT = "MULTIPROCESSOR_COUNT"

    class limit:  # noqa: N801 - pycuda's name
        MALLOC_HEAP_SIZE = "MALLOC_HEAP_SIZE"

    def __init__(self, devices: int = 1, driver_version: int = 13000,
                 capability: tuple[int, int] = (9, 0)) -> None:
        self.blocks: dict[int, np.ndarray] = {}
        self.launches: list[tuple] = []
        self.captured_launches: list[tuple] = []  # recorded into CUDA graphs
        self.limits: dict[str, int] = {}
        self.current: dict[int, list[object]] = {}  # thread id -> its context stack
        self.streams: list[object] = []
        self.pinned: set[int] = set()  # host addresses of page-locked arrays
        self.syncs = 0  # stream synchronisations
        self.fail_next_sync = None
        self.detached = 0
        self.images: list[str] = []  # "cubin", "ptx" or "host" per module_from_buffer
        self.loaded: list[bytes] = []  # the images themselves
        self.refuse_cubins = False  # module_from_buffer refuses cubins (an older driver)
        self.driver_version = driver_version
        self.allocated_on: dict[int, int] = {}  # address -> device ordinal
        self.stream_waits = 0  # cuStreamWaitEvent calls (raw, and pycuda's wait_for_event)
        #: CUDA graph calls by name (begin_capture, end_capture, instantiate, exec_update,
        #: launch_graph, destroy_graph, destroy_exec)
        self.graph_calls: dict[str, int] = {}
        #: the raw driver calls pycuda lacks (runtime/cuda.py's CudaDriverApi), over these
        #: blocks and the deferred streams by handle
        self.api = _CountingApi(self)
        outer = self

        class Stream(SimulatedStream):
            """A stream whose operations run only when the host synchronises."""

            def __init__(self, flags=0):
                outer.require_context()
                super().__init__()
                self.captured = None  # the operations recorded while capturing
                self.for_capture = False
                outer.streams.append(self)

            def enqueue(self, op):
                if self.captured is not None:
                    self.captured.append(op)
                else:
                    super().enqueue(op)

            def synchronize(self):
                outer.require_context()
                assert self.captured is None, "cuStreamSynchronize on a capturing stream"
                outer.syncs += 1
                if outer.fail_next_sync:
                    e, outer.fail_next_sync = outer.fail_next_sync, None
                    raise e
                super().synchronize()

            def wait_for_event(self, event):
                """(pycuda's, taking an Event, or the simulation's raw point in a stream:
                ``cuStreamWaitEvent``, deferred.)"""
                outer.require_context()
                outer.stream_waits += 1
                super().wait_for_event(getattr(event, "mark", event))

        class Event:
            def record(self, stream=None):
                self.mark = stream.record()
                return self

            def query(self):
                return self.mark.query()

            def synchronize(self):
                self.mark.synchronize()
                return self

        self.Stream, self.Event = Stream, Event

        class Context:
            def __init__(self, ordinal=0):
                self.ordinal = ordinal

            def push(self):
                outer.stack().append(self)

            def detach(self):
                outer.detached += 1

            @staticmethod
            def pop():
                outer.stack().pop()

            @staticmethod
            def set_limit(which, value):
                outer.require_context()
                outer.limits[which] = value

            @staticmethod
            def synchronize():
                raise AssertionError("the launcher synchronises its stream, not the context")

        class Device:
            def __init__(self, ordinal):
                self.ordinal = ordinal

            @staticmethod
            def count():
                return devices

            def name(self):
                return "Stand-in GPU"

            def compute_capability(self):
                return capability

            def total_memory(self):
                return TOTAL_MEMORY

            def get_attribute(self, attr):
                assert attr == FakeDriver.device_attribute.MULTIPROCESSOR_COUNT
                return SMS

            def retain_primary_context(self):
                return Context(self.ordinal)

        self.Context, self.Device = Context, Device

    @classmethod
    def without_devices(cls) -> FakeDriver:
        return cls(devices=0)

    # ------------------------------------------------------------------ contexts
    def stack(self) -> list[object]:
        """The calling thread's context stack (CUDA's current context is per thread)."""
        return self.current.setdefault(threading.get_ident(), [])

    @property
    def contexts(self) -> list[object]:
        """Every context made current and not popped yet, on any thread."""
        return [c for s in self.current.values() for c in s]

    def require_context(self) -> None:
        """What the real driver requires of every call below: a context current on the
        calling thread (else CUDA_ERROR_INVALID_CONTEXT)."""
        assert self.stack(), "no CUDA context is current on this thread"

    def get_driver_version(self) -> int:
        return self.driver_version

    # ------------------------------------------------------------------ memory
    def mem_get_info(self) -> tuple[int, int]:
        self.require_context()
        return TOTAL_MEMORY - sum(b.nbytes for b in self.blocks.values()), TOTAL_MEMORY

    def mem_alloc(self, n):
        self.require_context()
        outer = self
        block = np.full(n, 0xAB, np.uint8)  # not zeroed: the allocator must
        self.blocks[block.ctypes.data] = block
        self.allocated_on[block.ctypes.data] = self.stack()[-1].ordinal

        class Handle(int):
            def free(self):
                del outer.blocks[int(self)]
                del outer.allocated_on[int(self)]

        return Handle(block.ctypes.data)

    def memset_d8_async(self, address, value, n, stream):
        self.require_context()
        stream.enqueue(lambda: ctypes.memset(address, value, n))

    def pagelocked_empty(self, shape, dtype):
        a = np.empty(shape, dtype)
        self.pinned.add(a.ctypes.data)
        return a

    def memcpy_htod_async(self, address, host, stream):
        self.require_context()
        if host.ctypes.data in self.pinned:  # copied when the stream runs it: keep it intact
            src, n = host.ctypes.data, host.nbytes
            stream.enqueue(lambda: ctypes.memmove(address, src, n))
        else:  # pageable: staged by the driver before the call returns
            data = host.tobytes()
            stream.enqueue(lambda: ctypes.memmove(address, data, len(data)))

    def memcpy_dtoh(self, host, address):
        self.require_context()
        ctypes.memmove(host.ctypes.data, address, host.nbytes)

    def memcpy_dtod_async(self, dst, src, n, stream):
        self.require_context()
        stream.enqueue(lambda: ctypes.memmove(dst, src, n))

    def in_device_memory(self, address) -> bool:
        return any(a <= address < a + b.nbytes for a, b in self.blocks.items())

    # ------------------------------------------------------------------ modules
    def module_from_buffer(self, image):
        self.require_context()
        outer = self
        if cuda_runtime.is_cubin(image):
            if self.refuse_cubins:
                raise RuntimeError("cuModuleLoadData failed: device kernel image is invalid")
            kind = "cubin"
        else:
            assert image.endswith(b"\0")  # cuModuleLoadData takes NUL-terminated PTX
            kind = "ptx" if b".target" in image else "host"
        self.images.append(kind)
        self.loaded.append(bytes(image))

        class Function:
            def __init__(self, name):
                self.name = name
                self.fn = None
                if kind == "host":  # the simulated grid's object code: runs on the CPU
                    self.engine, addresses = simgrid_codegen.get_target().load(image, [name])
                    self.fn = GRID_FN(addresses[name])
                self.arg_types = None

            def prepare(self, arg_types):
                self.arg_types = list(arg_types)

            def prepared_async_call(self, grid, block, stream, *args):
                outer.require_context()
                assert self.arg_types == [np.uintp] and len(args) == 1
                # the current program's stream, or a capture
                assert stream.captured is not None or stream is \
                    [s for s in outer.streams if not s.for_capture][-1]
                (outer.launches if stream.captured is None else outer.captured_launches
                 ).append((self.name, grid, block, args[0]))
                if self.fn is not None:
                    # The queued launch holds its function, so the code (``self.engine``)
                    # stays loaded until it has run, as a device keeps a module that work
                    # queued on it uses: a kernel collected before the stream was drained
                    # (a failed synchronize, then reset) had its code freed under the launch.
                    stream.enqueue(lambda: self.fn(args[0], grid[0], block[0], 0))

        class Module:
            def get_function(self, name):
                return Function(name)

        return Module()


class _CountingApi(SimulatedDriverApi):
    """``CudaDriverApi`` for the stand-in: the simulated device's, over the driver's blocks
    (each on the device whose context allocated it), counting the stream waits."""

    def __init__(self, drv: FakeDriver) -> None:
        super().__init__(drv.blocks, lambda address: drv.allocated_on[
            self.address_range(address)[0]])
        self.drv = drv
        self.objects: dict[int, object] = {}  # graph and executable handles -> their ops
        self.next_handle = 0x5000

    def wait_stream(self, waiting: int, on: int) -> None:
        self.drv.require_context()
        self.drv.stream_waits += 1
        super().wait_stream(waiting, on)

    # ------------------------------------------------------------------ CUDA graphs
    def _count(self, name: str) -> None:
        self.drv.require_context()
        self.drv.graph_calls[name] = self.drv.graph_calls.get(name, 0) + 1

    def begin_capture(self, stream: int) -> None:
        self._count("begin_capture")
        s = SimulatedStream.resolve(stream)
        assert s.captured is None, "capture begun twice"
        s.captured, s.for_capture = [], True

    def end_capture(self, stream: int) -> int:
        self._count("end_capture")
        s = SimulatedStream.resolve(stream)
        ops, s.captured = s.captured, None
        return self._handle(("graph", tuple(ops)))

    def instantiate(self, graph: int) -> int:
        self._count("instantiate")
        return self._handle(["exec", self.objects[graph][1]])

    def exec_update(self, exe: int, graph: int) -> bool:
        self._count("exec_update")
        ops = self.objects[graph][1]
        if len(ops) != len(self.objects[exe][1]):
            return False  # (CUDA: the topology changed)
        self.objects[exe][1] = ops
        return True

    def launch_graph(self, exe: int, stream: int) -> None:
        self._count("launch_graph")
        ops = self.objects[exe][1]  # as instantiated or updated now

        def run():
            for op in ops:
                op()
        SimulatedStream.resolve(stream).enqueue(run)

    def destroy_graph(self, graph: int) -> None:
        self._count("destroy_graph")
        assert self.objects.pop(graph)[0] == "graph"

    def destroy_exec(self, exe: int) -> None:
        self._count("destroy_exec")
        assert self.objects.pop(exe)[0] == "exec"

    def _handle(self, obj) -> int:
        self.next_handle += 1
        self.objects[self.next_handle] = obj
        return self.next_handle


def use(monkeypatch, drv: FakeDriver, code: str = "simgrid") -> FakeDriver:
    """Make ``ti.init(arch=ti.cuda)`` (and the server's engines) find ``drv``.

    ``code="simgrid"``: kernels compile to the simulated grid's host code, which the stand-in
    runs (there is no PTX, so no ptxas: the launcher takes the JIT path). ``code="cuda"``: the
    real CUDA target for the device's architecture, PTX assembled by the real ptxas."""
    for var in ("TI_ARCH", "DIFFTAPE_ARCH", "DIFFTAPE_SIMULATE_GPU", cuda_runtime.DEVICE_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cuda_runtime, "load_driver", lambda: drv)
    monkeypatch.setattr(cuda_runtime, "load_driver_api", lambda: drv.api)
    if code == "simgrid":
        monkeypatch.setenv("DIFFTAPE_PTXAS", "")
        monkeypatch.setattr(cuda_codegen, "get_target",
                            lambda arch: simgrid_codegen.get_target())
    else:
        assert code == "cuda", code
    return drv
