"""Field and ndarray storage behind the program's allocator (difftape/runtime/storage.py).

On the CPU storage is host memory: one NumPy array that kernels address and Python scope reads
and writes in place. On the simulated grid it is simulated device memory: separate blocks that
only kernels address, with host mirrors synchronised at explicit points and poisoned (NaN)
while stale, so a path that skips a sync point computes a wrong answer here, on the CPU, as it
would on a GPU. Each test checks values against NumPy."""

import numpy as np
import pytest

import difftape as ti
from difftape.runtime import program
from difftape.runtime.storage import HostStorage

pytestmark = pytest.mark.difftape_only


@pytest.fixture
def host():
    ti.init(arch=ti.cpu, simulate_grid=0)
    yield program.get()
    ti.reset()


def test_host_storage_is_the_array_kernels_address(host):
    x = ti.field(ti.f32, shape=5)
    assert isinstance(x.storage, HostStorage)
    assert x.storage.address == x.storage.array.ctypes.data

    @ti.kernel
    def k():
        for i in x:
            x[i] = i * 1.5

    k()
    np.testing.assert_array_equal(x.storage.read(), np.arange(5) * 1.5)
    assert x.storage.read() is x.storage.array  # no copy, no sync
