"""A captured step replayed as CUDA graphs on a real device (runtime/gridgraph.py, cuda.py).

The MPM rollout of tests/ad/test_mpm_modes.py under a ``ti.ad.Tape`` with a gradient step,
captured once under ``ti.init(arch=ti.cuda)`` and replayed with a changed learning rate: every
field, gradient and tangent must have the bytes the eager step leaves on the same device
(``deterministic=True``: the scatter atomics in a fixed order), the device segments must be
instantiated once (stream capture, ``cuGraphInstantiateWithFlags``, ``cuGraphLaunch``) and a
copy into another field applied by ``cuGraphExecUpdate``. Skipped, with the reason, where
there is no device (conftest.py's ``cuda`` fixture). Not run yet: no GPU was lent to the
session that wrote it.
"""

import numpy as np
import pytest

import difftape as ti
from difftape.runtime import cuda as cuda_runtime
from difftape.runtime import program
from tests.lang.test_graph import assert_replay_matches_eager

pytestmark = pytest.mark.difftape_only


@pytest.fixture
def device(cuda, monkeypatch):
    for var in ("TI_ARCH", "DIFFTAPE_ARCH", "DIFFTAPE_SIMULATE_GPU"):
        monkeypatch.delenv(var, raising=False)
    ti.init(arch=ti.cuda, default_fp=ti.f64, deterministic=True)
    assert isinstance(program.get().launcher, cuda_runtime.CudaLauncher)
    yield
    ti.reset()


def test_mpm_tape_step_replays_as_cuda_graphs_bit_for_bit(device):
    from tests.ad.test_mpm_modes import descent_step

    step, declare, init_v, other = descent_step(ti)
    g = assert_replay_matches_eager(ti, step, declare=declare,
                                    replays=[{"lr": 0.05}, {"lr": 0.02}, {"lr": 0.1}])
    assert np.all(np.abs(init_v.grad.to_numpy()) > 1e-3)
    segments = g.instantiations
    assert segments >= 1 and g.updates == 0
    g.replay(lr=0.01, keep=other)  # the copy's destination moved: cuGraphExecUpdate
    np.testing.assert_array_equal(other.to_numpy(), init_v.to_numpy())
    assert (g.instantiations, g.updates) == (segments, 1)


def test_an_out_of_range_index_in_a_replay_is_raised_at_the_next_sync(cuda, monkeypatch):
    for var in ("TI_ARCH", "DIFFTAPE_ARCH", "DIFFTAPE_SIMULATE_GPU"):
        monkeypatch.delenv(var, raising=False)
    ti.init(arch=ti.cuda, check_out_of_bound=True)
    try:
        x = ti.field(ti.f32, shape=4)

        @ti.kernel
        def poke(i: ti.i32):
            x[i] = 1.0

        with ti.graph.capture() as g:
            poke(g.input("i", 0))
        g.replay(i=7)
        with pytest.raises(ti.IndexOutOfRangeError, match="poke"):
            ti.sync()
        g.replay(i=2)
        np.testing.assert_array_equal(x.to_numpy(), [0, 0, 1, 0])
    finally:
        ti.reset()
