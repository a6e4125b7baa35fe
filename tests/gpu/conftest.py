"""The GPU suite: what needs a real NVIDIA device, marked ``gpu``.

Every test here asks for the ``cuda`` fixture; where CUDA cannot be used (pycuda missing, no
driver, no device) the test is skipped with the exact reason runtime/cuda.py gives. Run it on
a machine with a GPU as ``pytest -m gpu tests/gpu`` (README.md beside this file says how to
carry pycuda to a machine without network).
"""

import pytest

from difftape.runtime import cuda as cuda_runtime


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent.name == "gpu":
            item.add_marker(pytest.mark.gpu)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu)")


@pytest.fixture(scope="session")
def cuda():
    """(pycuda.driver, DeviceInfo) with the device's primary context current."""
    try:
        drv = cuda_runtime.load_driver()
        device = cuda_runtime.select_device(drv)
    except cuda_runtime.CudaUnavailable as e:
        pytest.skip(f"no CUDA device: {e}")
    context = drv.Device(device.ordinal).retain_primary_context()
    context.push()
    yield drv, device
    context.pop()
