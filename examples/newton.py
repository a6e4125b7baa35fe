"""Newton's method with difftape's Hessians: the rest shape of a hanging mass-spring chain.

A chain of point masses joined by springs hangs between two fixed pins under gravity. Its rest
shape minimises the potential energy E(x) = sum_springs k/2 (|x_a - x_b| - L)^2 + sum_i m g y_i.
The energy is one difftape kernel; ``ti.ad.newton`` minimises it with Newton's method: the exact
Hessian by forward-over-reverse (``ti.ad.hessian``: one Hessian-vector product per coordinate)
and a backtracking line search converge in a handful of iterations. Gradient descent with the best
fixed step this problem allows needs hundreds to thousands for the same tolerance, because the
stiff springs and the soft sagging mode differ in curvature by orders of magnitude.

Run: ``python examples/newton.py`` (prints both methods' iteration counts).
"""

from __future__ import annotations

import numpy as np

import difftape as ti


def build(n_free: int = 12, stiffness: float = 200.0):
    """Fields and the energy program for a chain of ``n_free`` movable masses."""
    n = n_free + 2  # with the two pins
    x = ti.Vector.field(2, ti.f64, shape=n_free, needs_grad=True)
    energy = ti.field(ti.f64, shape=(), needs_grad=True)
    span = 1.0
    rest = 0.8 * span / (n - 1)  # springs are stretched between the pins
    pin_l, pin_r = ti.Vector([0.0, 0.0]), ti.Vector([span, 0.0])

    @ti.func
    def pos(k):
        p = pin_l
        if k == n - 1:
            p = pin_r
        elif k > 0:
            p = x[k - 1]
        return p

    @ti.kernel
    def compute_energy():
        for s in range(n - 1):
            d = (pos(s + 1) - pos(s)).norm()
            energy[None] += 0.5 * stiffness * (d - rest) ** 2
        for i in x:
            energy[None] += 9.81 * 0.01 * x[i].y  # mass 0.01 each

    def start() -> None:
        t = np.linspace(0, span, n)[1:-1]
        x.from_numpy(np.stack([t, np.zeros_like(t)], axis=1))

    def run() -> None:
        energy.fill(0)
        compute_energy()

    return x, energy, run, start


def value_and_grad(x, energy, run) -> tuple[float, np.ndarray]:
    with ti.ad.Tape(energy):
        run()
    return float(energy[None]), x.grad.to_numpy().ravel()


def newton(x, energy, run, tol: float = 1e-10, max_iter: int = 50) -> int:
    """Newton's method: each iteration a gradient (Tape), the exact Hessian
    (``ti.ad.hessian``), a linear solve and a backtracking line search; this is what
    ``ti.ad.newton`` does, in one request for the whole solve under ``arch=ti.remote``."""
    result = ti.ad.newton(run, energy, x, tol=tol, max_iter=max_iter)
    return result.iterations


def gradient_descent(x, energy, run, tol: float = 1e-10, max_iter: int = 20000) -> int:
    # The largest stable fixed step is 2 / lambda_max; use 1 / lambda_max from the Hessian.
    lam = float(np.linalg.eigvalsh(ti.ad.hessian(run, energy, x)).max())
    for it in range(max_iter):
        _, g = value_and_grad(x, energy, run)
        if np.linalg.norm(g) < tol:
            return it
        x.from_numpy(x.to_numpy() - (g / lam).reshape(x.shape + (2,)))
    return max_iter


def main(n_free: int = 12) -> dict[str, int]:
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    x, energy, run, start = build(n_free)
    start()
    it_newton = newton(x, energy, run)
    rest_newton = x.to_numpy().copy()
    start()
    it_gd = gradient_descent(x, energy, run)
    gap = float(np.abs(x.to_numpy() - rest_newton).max())
    print(f"newton:           {it_newton} iterations")
    print(f"gradient descent: {it_gd} iterations (same rest shape to {gap:.1e})")
    return {"newton": it_newton, "gradient_descent": it_gd}


if __name__ == "__main__":
    main()
