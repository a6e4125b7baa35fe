"""The CPU's reverse-mode stacks counted in a program's stack budget
(``runtime/stackbudget.py``): each growth is added before it is allocated, a growth past the
limit asks the owner, whose refusal the launch raises (also from a graph replay), and stacks
within the limit ask nothing. The service's quota is built on it (tests/service)."""

import numpy as np
import pytest

from difftape.errors import DifftapeError
from difftape.runtime import program
from difftape.runtime.stackbudget import StackBudget

pytestmark = pytest.mark.difftape_only

N = 32


class Refused(DifftapeError):
    pass


def _program(ti, answer):
    """A program with a stack budget whose asks ``answer(kernel, nbytes)`` answers (a new
    limit, or raises), the asks it got, the field ``x`` and the kernel ``walk``, whose
    gradient reads ``y.grad`` (1, and 0 after each gradient launch: the adjoint of its
    store clears it) into ``x.grad``."""
    ti.init(arch=ti.cpu, cpu_max_num_threads=2)
    asks = []

    def ask(kernel, nbytes):
        asks.append((kernel, nbytes))
        return answer(kernel, nbytes)

    budget = program.get().stack_budget = StackBudget(ask)
    x = ti.field(ti.f32, shape=N, needs_grad=True)
    y = ti.field(ti.f32, shape=N, needs_grad=True)

    @ti.kernel
    def walk(n: ti.i32):
        for i in x:
            s = x[i]
            for _ in range(n):
                s = ti.sin(s)
            y[i] = s

    x.from_numpy(np.linspace(0.1, 1.5, N, dtype=np.float32))

    def grad(steps):
        y.grad.fill(1.0)
        walk.grad(steps)

    return budget, asks, x, grad


def test_growths_past_the_limit_ask_and_a_grant_covers_the_next_launches(ti):
    budget, asks, x, grad = _program(ti, lambda kernel, nbytes: 1 << 30)
    grad(5000)  # 5000 slots: a stack of 8192 (64 KiB) per thread
    assert asks and all(k == "walk_grad" for k, _ in asks)
    assert asks[0][1] == 256 * 8  # the first allocation of the first thread that grew
    assert budget.held == 0  # freed at the end of each chunk
    reference = x.grad.to_numpy()
    n = len(asks)
    x.grad.fill(0)
    grad(5000)
    assert len(asks) == n
    np.testing.assert_array_equal(x.grad.to_numpy(), reference)


def test_a_refusal_is_raised_by_the_launch_and_the_graph_replay(ti):
    limit = 64 * 1024

    def answer(kernel, nbytes):
        if budget.held > limit:
            raise Refused(f"no room for {nbytes} more bytes of {kernel}'s stacks")
        return limit

    budget, asks, x, grad = _program(ti, answer)
    with pytest.raises(Refused, match="of walk_grad's stacks") as info:
        grad(20_000)  # 160 KB per thread
    assert info.value.kernel == "walk_grad"
    assert budget.held == 0 and not x.grad.to_numpy().any()
    grad(1000)  # within the limit: runs
    assert x.grad.to_numpy().all()
    with ti.graph.capture() as g:
        grad(20_000)
    x.grad.fill(0)
    with pytest.raises(Refused, match="of walk_grad's stacks") as info:
        g.replay()
    assert info.value.kernel == "walk_grad"
    assert budget.held == 0 and not x.grad.to_numpy().any()
