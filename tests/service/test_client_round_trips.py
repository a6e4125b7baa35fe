"""What a remote program costs in round trips (issue 18), counted by the client
(``ti.remote_stats()``), against a real server: derivative helpers that loop over launches
and reads locally (``ti.ad.jacobian``, ``hessian``, ``hvp``, ``newton``,
``Tape(grad_check=...)``) are
one request each, with results equal bit for bit to the local ones.
"""

import numpy as np
import pytest

import difftape as ti

from .test_client_programs import same


def run_local(program):
    """The same program locally (bounds checks on, as the server compiles)."""
    ti.init(arch=ti.cpu, check_out_of_bound=True, default_fp=ti.f64)
    try:
        return program()
    finally:
        ti.reset()


@pytest.fixture
def remote(service):
    def run(program):
        ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"],
                default_fp=ti.f64)
        try:
            return program()
        finally:
            ti.reset()

    return run


def chain():
    """A small mass-spring energy (examples/newton.py's) over 3 points, plus a vector map."""
    x = ti.Vector.field(2, ti.f64, shape=3, needs_grad=True)
    energy = ti.field(ti.f64, shape=(), needs_grad=True)
    y = ti.field(ti.f64, shape=4)

    @ti.kernel
    def compute_energy():
        for s in range(2):
            d = (x[s + 1] - x[s]).norm()
            energy[None] += 0.5 * 30.0 * (d - 0.3) ** 2
        for i in x:
            energy[None] += 0.1 * x[i].y * x[i].x

    def run():
        energy.fill(0)
        compute_energy()

    @ti.kernel
    def vmap():
        for i in y:
            y[i] = 0
        for i in x:
            y[i % 4] += ti.sin(x[i][0]) * x[i][1] + x[i][0] ** 2

    x.from_numpy(np.array([[0.0, 0.1], [0.35, -0.2], [0.7, 0.05]]))
    return x, energy, y, run, vmap


def trips(f):
    before = ti.remote_stats()["round_trips"]
    out = f()
    return out, ti.remote_stats()["round_trips"] - before


def derivative_program():
    x, energy, y, run, vmap = chain()
    ti.sync()
    out, cost = {}, {}
    out["hessian"], cost["hessian"] = trips(lambda: ti.ad.hessian(run, energy, x))
    v = np.linspace(-1, 1, 6).reshape(3, 2)
    out["hvp"], cost["hvp"] = trips(lambda: ti.ad.hvp(run, energy, x, v))
    out["grad_after_hvp"] = x.grad.to_numpy()
    for mode in ("forward", "reverse"):
        out[mode], cost[mode] = trips(lambda mode=mode: ti.ad.jacobian(vmap, x, y, mode=mode))
    out["energy"] = energy[None]
    return out, cost


def test_derivative_helpers_are_one_round_trip_each(remote):
    """Each helper one request (before: a Hessian of 6 parameters took 12 and more, each
    forward-over-reverse pass and each read its own), results bit for bit the local ones."""
    here, free = run_local(derivative_program)
    there, cost = remote(derivative_program)
    assert free == {k: 0 for k in free}  # a local program has no round trips
    assert cost == {"hessian": 1, "hvp": 1, "forward": 1, "reverse": 1}
    same(here, there)
    h = here["hessian"]
    np.testing.assert_allclose(h, h.T, rtol=1e-12, atol=1e-12)  # sanity: a Hessian
    np.testing.assert_allclose(here["hvp"].reshape(-1), h @ np.linspace(-1, 1, 6),
                               rtol=1e-12, atol=1e-12)


def hanging_chain(n_free: int = 4):
    """examples/newton.py's problem, small: a chain pinned at both ends, sagging under
    gravity; a strict minimum, so Newton converges quadratically."""
    n = n_free + 2
    x = ti.Vector.field(2, ti.f64, shape=n_free, needs_grad=True)
    energy = ti.field(ti.f64, shape=(), needs_grad=True)
    rest = 0.8 / (n - 1)

    @ti.func
    def pos(k):
        p = ti.Vector([0.0, 0.0])
        if k == n - 1:
            p = ti.Vector([1.0, 0.0])
        elif k > 0:
            p = x[k - 1]
        return p

    @ti.kernel
    def compute_energy():
        for s in range(n - 1):
            d = (pos(s + 1) - pos(s)).norm()
            energy[None] += 0.5 * 200.0 * (d - rest) ** 2
        for i in x:
            energy[None] += 9.81 * 0.01 * x[i].y

    def run():
        energy.fill(0)
        compute_energy()

    t = np.linspace(0, 1, n)[1:-1]
    x.from_numpy(np.stack([t, np.zeros_like(t)], axis=1))
    return x, energy, run


def newton_program():
    x, energy, run = hanging_chain()
    ti.sync()
    result, cost = trips(lambda: ti.ad.newton(run, energy, x, tol=1e-11))
    return {"x": x.to_numpy(), "iterations": result.iterations, "loss": result.loss,
            "grad_norm": result.grad_norm, "converged": result.converged}, cost


def test_newton_solve_is_one_round_trip(remote):
    """``ti.ad.newton`` (gradient, dense Hessian, solve and line search, every iteration) is
    one request, and takes exactly the local solve's steps: same iterations, same result bit
    for bit (the server runs the same iteration function over the recorded programs)."""
    here, free = run_local(newton_program)
    there, cost = remote(newton_program)
    assert free == 0 and cost == 1
    same(here, there)
    assert here["converged"] and 2 <= here["iterations"] < 50


def test_grad_check_is_one_round_trip(remote):
    """``Tape(grad_check=[x])``: snapshot, recording, back-propagation and the finite-difference
    replays (2 per element) in one request; a wrong custom gradient is still caught."""

    def program():
        x = ti.field(ti.f64, 5, needs_grad=True)
        loss = ti.field(ti.f64, (), needs_grad=True)

        @ti.kernel
        def f():
            for i in x:
                loss[None] += x[i] ** 3 - ti.cos(x[i])

        @ti.ad.grad_replaced
        def forward():
            f()

        @ti.ad.grad_for(forward)
        def backward():  # deliberately wrong
            f.grad()
            f.grad()

        x.from_numpy(np.linspace(0.5, 1.5, 5))
        ti.sync()

        def checked():
            with ti.ad.Tape(loss, grad_check=[x]):
                f()

        _, n = trips(checked)
        right = x.grad.to_numpy()
        with pytest.raises(ti.ad.GradientCheckError, match=r"x\[0\]"):
            with ti.ad.Tape(loss, grad_check=[x]):
                forward()
        return {"trips": n, "right": right, "x": x.to_numpy(), "loss": loss[None]}

    here, there = run_local(program), remote(program)
    assert there["trips"] == 1
    here.pop("trips")
    there.pop("trips")
    same(here, there)


def test_launch_and_read_is_one_round_trip(remote):
    """The counters themselves: a launch followed by a scalar read is one request; bytes
    are counted both ways."""

    def program():
        x = ti.field(ti.f32, shape=())

        @ti.kernel
        def step():
            x[None] += 1.0

        step()
        ti.sync()
        s0 = ti.remote_stats()
        step()
        v = x[None]
        s1 = ti.remote_stats()
        return v, {k: s1[k] - s0[k] for k in s0}

    v, d = remote(program)
    assert v == 2.0
    assert d["round_trips"] == 1 and d["ops"] == 2
    assert d["bytes_sent"] > 0 and d["bytes_received"] > 0


def test_a_function_that_reads_falls_back_to_the_loop(remote):
    """A function that needs a value from the server while it runs cannot be recorded:
    the helper runs its loop through the client instead (right result, more requests)."""

    def program():
        x, energy, y, run, vmap = chain()

        def reads():
            run()
            _ = energy[None]  # a read mid-function

        ti.sync()
        h, n = trips(lambda: ti.ad.hessian(reads, energy, x))
        return h, n

    (h, n), (h_local, _) = remote(program), run_local(program)
    same(h_local, h)
    assert n > 1


def test_read_ahead_saves_round_trips_and_never_goes_stale(remote):
    """Small fields the program reads as arrays are read again at the end of each request
    that waits for an answer: an optimisation step (Tape, read the loss, read the gradient,
    update) then costs one round trip, not three. Anything queued that could change a field
    (a launch, an element write, a fill, a clear) makes the next read go to the server."""

    def program():
        x = ti.field(ti.f64, shape=6, needs_grad=True)
        loss = ti.field(ti.f64, shape=(), needs_grad=True)

        @ti.kernel
        def f():
            for i in x:
                loss[None] += (x[i] - 0.1 * i) ** 2

        @ti.kernel
        def bump():
            for i in x:
                x[i] += 1.0

        x.from_numpy(np.linspace(1, 2, 6))
        seen, cost = [], []
        for _ in range(4):
            def step():
                with ti.ad.Tape(loss):
                    f()
                value, g = loss[None], x.grad.to_numpy()
                x.from_numpy(x.to_numpy() - 0.25 * g)
                return value, g

            (value, g), n = trips(step)
            seen.append((value, g))
            cost.append(n)
        # Stale reads would show here: each change is seen by the next read.
        a = x.to_numpy()
        bump()
        b = x.to_numpy()
        x[2] = -7.0
        c = x.to_numpy()
        x.fill(3.0)
        d = x.to_numpy()
        ti.ad.clear_all_gradients()
        e = x.grad.to_numpy()
        return {"seen": seen, "a": a, "b": b, "c": c, "d": d, "e": e, "cost": cost}

    here, there = run_local(program), remote(program)
    cost = there.pop("cost")
    here.pop("cost")
    same(here, there)
    assert cost[-1] == 1, cost  # warmed up: the loss read carries the gradient and x
    np.testing.assert_array_equal(there["b"], there["a"] + 1)
    assert there["c"][2] == -7.0 and (there["d"] == 3.0).all() and (there["e"] == 0).all()
