"""Inverse design with forward mode: the loads that make a hanging chain take a given shape.

Gaudí designed arches with hanging models: a chain loaded with weights hangs in pure tension,
and turned upside down it is an arch in pure compression. Here the design goes the other way:
given the arch (a circular segment), find the weights. A chain of ``n`` beads joined by stiff
springs hangs between two pins; bead ``i`` carries the load ``exp(theta_i)``. Its rest shape is
found by damped relaxation (one kernel that runs the whole relaxation), and the residuals are
the beads' heights above the target curve. Few parameters and as many outputs: the Jacobian
d(residuals)/d(theta) comes from forward mode, one ``FwdMode`` pass of the relaxation per
parameter (``ti.ad.jacobian(..., mode="forward")``; one request under ``arch=ti.remote``), and
Levenberg-Marquardt steps fit the loads.

Writes ``hanging_arch.gif`` (the chain at each iteration, then the arch it makes) and
``hanging_arch_loss.png``. Run: ``python examples/hanging_arch.py [--iters 15] [--beads 15]
[--out DIR] [--remote]``.
"""

from __future__ import annotations

import math

import numpy as np
import pictures

import difftape as ti

PIN_Y, LEFT, RIGHT = 0.85, 0.1, 0.9
RISE = 0.34  # the arch: a circular segment over the span, this high
STIFFNESS, DT, DRAG, RELAX_STEPS = 2000.0, 0.01, 0.03, 3000


def arch() -> tuple[float, float]:
    """The target circle's radius and its arc length between the pins."""
    half = (RIGHT - LEFT) / 2
    radius = (half ** 2 + RISE ** 2) / (2 * RISE)
    return radius, 2 * radius * math.asin(half / radius)


class Chain:
    """The beads, the relaxation kernel and the residuals of one design."""

    def __init__(self, beads: int) -> None:
        self.n = n = beads
        radius, length = arch()
        rest = 0.995 * length / (n + 1)  # a little short: the loads stretch it to fit
        mid = (LEFT + RIGHT) / 2
        vec = ti.types.vector(2, ti.f64)
        self.theta = theta = ti.field(ti.f64, shape=n, needs_dual=True)
        self.x = x = ti.Vector.field(2, ti.f64, shape=n, needs_dual=True)
        vel = ti.Vector.field(2, ti.f64, shape=n, needs_dual=True)
        self.residual = residual = ti.field(ti.f64, shape=n, needs_dual=True)

        @ti.func
        def bead(i):
            p = vec(LEFT, PIN_Y)
            if i == n:
                p = vec(RIGHT, PIN_Y)
            elif i >= 0:
                p = x[i]
            return p

        @ti.func
        def pull(a, b):
            """The force of the spring from ``a`` on the bead at ``b``."""
            d = a - b
            length_ = d.norm()
            return STIFFNESS * (length_ - rest) / length_ * d

        @ti.kernel
        def start():
            for i in range(n):  # a straight, slack start between the pins
                x[i] = vec(LEFT + (RIGHT - LEFT) * (i + 1) / (n + 1), PIN_Y - 1e-3)
                vel[i] = vec(0.0, 0.0)

        @ti.kernel
        def relax():
            ti.loop_config(serialize=True)
            for _ in range(RELAX_STEPS):
                for i in range(n):
                    f = pull(bead(i - 1), x[i]) + pull(bead(i + 1), x[i]) \
                        - vec(0.0, ti.exp(theta[i]))
                    vel[i] = (1 - DRAG) * vel[i] + DT * f
                for i in range(n):
                    x[i] += DT * vel[i]

        @ti.kernel
        def heights():
            for i in range(n):
                u = x[i][0] - mid
                depth = ti.sqrt(radius ** 2 - u ** 2) - (radius - RISE)
                residual[i] = x[i][1] - (PIN_Y - depth)

        def shape() -> None:
            start()
            relax()
            heights()

        self.shape = shape
        theta.fill(math.log(1.0 / n))  # equal loads: the chain hangs as a catenary

    def misfit(self) -> float:
        """Relax at the current loads; the sum of squared residuals."""
        self.shape()
        r = self.residual.to_numpy()
        return float(r @ r)

    def design(self, iters: int, on_iteration=None, tol: float = 1e-20) -> list[float]:
        """Levenberg-Marquardt on the log-loads, at most ``iters`` iterations or until the
        misfit is below ``tol``; returns the misfit before each iteration and at the end."""
        damping = 1e-3
        losses = []
        for it in range(iters + 1):
            loss = self.misfit()
            losses.append(loss)
            if on_iteration is not None:
                on_iteration(it)
            if it == iters or loss < tol:
                break
            r = self.residual.to_numpy()
            jac = ti.ad.jacobian(self.shape, self.theta, self.residual, mode="forward")
            theta0 = self.theta.to_numpy()
            jtj, jtr = jac.T @ jac, jac.T @ r
            while True:  # a step that lowers the misfit, more damped until one does
                step = np.linalg.solve(jtj + damping * np.diag(np.diag(jtj) + 1e-12), -jtr)
                self.theta.from_numpy(theta0 + step)
                if self.misfit() < loss or damping > 1e8:
                    damping = max(damping / 3, 1e-9)
                    break
                damping *= 4
        return losses

    def draw(self, gui: ti.GUI, caption: str, flip: bool = False) -> None:
        """The chain (beads sized by their loads) over the target curve; ``flip``: upside
        down, as the arch it designs."""
        radius, _ = arch()
        u = np.linspace(LEFT, RIGHT, 64)
        curve = np.stack([u, PIN_Y - (np.sqrt(radius ** 2 - (u - 0.5) ** 2) - (radius - RISE))],
                         1)
        x = self.x.to_numpy()
        pins = np.array([[LEFT, PIN_Y], [RIGHT, PIN_Y]])
        chain = np.concatenate([pins[:1], x, pins[1:]])
        loads = np.exp(self.theta.to_numpy())
        if flip:  # mirror about the pins' line, moved down to fit: the arch stands on them
            curve, chain = ([1, -1] * c + [0, 2 * PIN_Y - 0.7] for c in (curve, chain))
            pins = chain[[0, -1]]
        gui.lines(curve[:-1], curve[1:], radius=1, color=0x99AACC)
        gui.lines(chain[:-1], chain[1:], radius=2, color=0x555555)
        gui.circles(chain[1:-1], radius=np.sqrt(loads / loads.max()) * 9 + 2, color=0xB5533C)
        gui.circles(pins, radius=5, color=0x222222)
        gui.text(caption, (0.02, 0.98), font_size=18, color=0x222222)


def main(argv: list[str] | None = None) -> list[float]:
    ap = pictures.parser(__doc__, iters=15)
    ap.add_argument("--beads", type=int, default=15, help="beads on the chain")
    ap.add_argument("--res", type=int, default=320, help="frame size in pixels")
    args = ap.parse_args(argv)
    pictures.init(args.remote, default_fp=ti.f64)
    chain = Chain(args.beads)
    gui = ti.GUI("hanging arch", res=args.res, background_color=0xFFFFFF, show_gui=False)
    frames = pictures.Frames(args.out, "hanging_arch", fps=4)

    def snapshot(it: int) -> None:
        chain.draw(gui, f"iteration {it}")
        frames.add(gui)

    losses = chain.design(args.iters, snapshot)
    for caption, flip in [("designed loads", False)] * 3 + [("turned over: the arch", True)] * 6:
        chain.draw(gui, caption, flip)
        frames.add(gui)
    gif = frames.save()
    png = pictures.plot_losses(losses, f"{args.out}/hanging_arch_loss.png",
                               "hanging arch: squared distance from the target shape", log=True)
    print(f"misfit {losses[0]:.3g} -> {losses[-1]:.3g}; wrote {gif} and {png}")
    return losses


if __name__ == "__main__":
    main()
