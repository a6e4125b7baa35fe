"""``difftape demo``: a 2-D gravity simulation (the seed guide's case study), timed against the
same computation in NumPy so a new user sees the compiler at work, and the forces obtained by
reverse-mode autodiff of the potential energy checked against the hand-written ones."""

from __future__ import annotations

import time

import numpy as np


def main(steps: int = 200) -> int:
    import difftape as ti

    ti.init(arch=ti.cpu, default_fp=ti.f32)
    n = 1024
    dt = 1e-5
    x = ti.Vector.field(2, dtype=ti.f32, shape=n, needs_grad=True)
    v = ti.Vector.field(2, dtype=ti.f32, shape=n)
    force = ti.Vector.field(2, dtype=ti.f32, shape=n)
    energy = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def init():
        for i in x:
            x[i] = [ti.random(), ti.random()]
            v[i] = [0.0, 0.0]

    @ti.kernel
    def compute_energy():
        for i, j in ti.ndrange(n, n):
            r = x[i] - x[j]
            energy[None] += -1 / r.norm(1e-3)

    @ti.kernel
    def compute_force():
        for i in x:
            f = ti.Vector([0.0, 0.0])
            for j in range(n):
                r = x[i] - x[j]
                f += -r / (r.norm_sqr() + 1e-3) ** 1.5
            force[i] = f

    @ti.kernel
    def advance():
        for i in x:
            v[i] += dt * force[i]
            x[i] += dt * v[i]

    t0 = time.perf_counter()
    init()
    compute_energy()
    compute_force()
    advance()
    compile_s = time.perf_counter() - t0
    energy[None] = 0.0
    compute_energy()
    e0 = energy[None]
    t0 = time.perf_counter()
    for _ in range(steps):
        compute_force()
        advance()
    sim_s = time.perf_counter() - t0
    energy[None] = 0.0
    compute_energy()

    xs = x.to_numpy().astype(np.float64)
    t0 = time.perf_counter()
    r = xs[:, None, :] - xs[None, :, :]
    _ = (-r / ((r**2).sum(-1, keepdims=True) + 1e-3) ** 1.5).sum(1)
    numpy_step = time.perf_counter() - t0

    # Forces by autodiff: F_i = -dU/dx_i. U sums every pair twice, so -dU/dx_i = 2 * force[i].
    compute_force()
    t0 = time.perf_counter()
    with ti.ad.Tape(loss=energy):
        compute_energy()
    tape_s = time.perf_counter() - t0
    by_ad = -x.grad.to_numpy() / 2
    by_hand = force.to_numpy()
    ad_err = float(np.abs(by_ad - by_hand).max() / np.abs(by_hand).max())

    print(f"difftape demo: {n} bodies, {steps} steps")
    print(f"  first calls (compile or cache load of 4 kernels): {compile_s * 1e3:.1f} ms")
    print(f"  simulation: {sim_s / steps * 1e3:.3f} ms/step "
          f"(NumPy, one force evaluation: {numpy_step * 1e3:.1f} ms)")
    print(f"  potential energy: {e0:.6g} -> {energy[None]:.6g}")
    print(f"  centre of mass: {x.to_numpy().mean(0)}")
    print(f"  forces by autodiff (ti.ad.Tape over the energy, {tape_s * 1e3:.1f} ms incl. "
          f"compiling the adjoint): max deviation from the hand-written forces "
          f"{ad_err:.1e} (relative)")
    return 0
