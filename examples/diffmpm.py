"""A jelly robot learns to crawl: differentiable MPM with an actuation controller.

A soft body of elastic particles (a block on four legs) is simulated with the moving
least squares material point method (MLS-MPM; DiffTaichi's diffmpm is the model). Each leg is
a muscle: a periodic controller (weights on sine waves of the time, through ``tanh``) sets the
stress it adds along its vertical axis. The loss is minus the distance the body's centre of
mass moved to the right; ``ti.ad.Tape`` differentiates it through every particle-to-grid,
grid and grid-to-particle step of the rollout to the controller's weights. Particle and grid
states are indexed by time step, so no kernel overwrites what an earlier one read.

Writes ``diffmpm.gif`` (the first gait, then the trained one) and ``diffmpm_loss.png``.
Run: ``python examples/diffmpm.py [--iters 40] [--steps 512] [--grid 48] [--out DIR]
[--remote]``.
"""

from __future__ import annotations

import math

import numpy as np
import pictures

import difftape as ti

DT, GRAVITY, E_MOD, ACT_STRENGTH = 2e-3, 3.8, 10.0, 4.0
N_SIN, OMEGA = 4, 20.0
BOUND, FRICTION = 3, 0.5  # grid cells of wall; Coulomb friction of the floor


def jelly(dx: float) -> tuple[np.ndarray, np.ndarray]:
    """Particle positions and their muscle (-1: none): a block on four legs standing on the
    floor (``BOUND`` cells up), two particles per grid cell in each direction."""
    rects = [(0.0, 0.1, 0.3, 0.1, -1), (0.0, 0.0, 0.05, 0.1, 0), (0.05, 0.0, 0.05, 0.1, 1),
             (0.2, 0.0, 0.05, 0.1, 2), (0.25, 0.0, 0.05, 0.1, 3)]
    pos, muscle = [], []
    for x, y, w, h, m in rects:
        nw, nh = max(1, round(w / dx)) * 2, max(1, round(h / dx)) * 2
        for i in range(nw):
            for j in range(nh):
                pos.append((0.1 + x + (i + 0.5) * w / nw, BOUND * dx + y + (j + 0.5) * h / nh))
                muscle.append(m)
    return np.asarray(pos, np.float32), np.asarray(muscle, np.int32)


class Jelly:
    """Fields and kernels of the MPM rollout and its controller."""

    def __init__(self, steps: int, n_grid: int, seed: int = 0) -> None:
        dx = 1 / n_grid
        inv_dx = float(n_grid)
        x0, muscle_np = jelly(dx)
        self.steps, self.n_grid, self.n = steps, n_grid, len(x0)
        n = self.n
        self.x0, self.muscle = x0, muscle_np
        n_act = 4
        vec, mat = ti.types.vector(2, ti.f32), ti.types.matrix(2, 2, ti.f32)
        self.x = x = ti.Vector.field(2, ti.f32, shape=(steps, n), needs_grad=True)
        v = ti.Vector.field(2, ti.f32, shape=(steps, n), needs_grad=True)
        C = ti.Matrix.field(2, 2, ti.f32, shape=(steps, n), needs_grad=True)
        F = ti.Matrix.field(2, 2, ti.f32, shape=(steps, n), needs_grad=True)
        grid_v = ti.Vector.field(2, ti.f32, shape=(steps, n_grid, n_grid), needs_grad=True)
        grid_m = ti.field(ti.f32, shape=(steps, n_grid, n_grid), needs_grad=True)
        grid_out = ti.Vector.field(2, ti.f32, shape=(steps, n_grid, n_grid), needs_grad=True)
        self.act = act = ti.field(ti.f32, shape=(steps, n_act), needs_grad=True)
        weights = ti.field(ti.f32, shape=(n_act, N_SIN), needs_grad=True)
        bias = ti.field(ti.f32, shape=n_act, needs_grad=True)
        muscle = ti.field(ti.i32, shape=n)
        self.loss = loss = ti.field(ti.f32, shape=(), needs_grad=True)
        muscle.from_numpy(muscle_np)
        p_vol, mu, la = 1.0, E_MOD, E_MOD

        @ti.kernel
        def controller(t: ti.i32):
            for a in range(n_act):
                s = bias[a]
                for j in ti.static(range(N_SIN)):
                    s += weights[a, j] * ti.sin(OMEGA * t * DT + 2 * math.pi / N_SIN * j)
                act[t, a] = ti.tanh(s)

        @ti.kernel
        def p2g(t: ti.i32):
            for p in range(n):
                base = ti.cast(x[t, p] * inv_dx - 0.5, ti.i32)
                fx = x[t, p] * inv_dx - ti.cast(base, ti.f32)
                w = [0.5 * (1.5 - fx) ** 2, 0.75 - (fx - 1) ** 2, 0.5 * (fx - 0.5) ** 2]
                new_F = (ti.Matrix.identity(ti.f32, 2) + DT * C[t, p]) @ F[t, p]
                F[t + 1, p] = new_F
                J = new_F.determinant()
                r, _ = ti.polar_decompose(new_F)
                a = 0.0
                if muscle[p] >= 0:
                    a = act[t, muscle[p]] * ACT_STRENGTH
                stress = 2 * mu * (new_F - r) @ new_F.transpose() \
                    + ti.Matrix.diag(2, la * (J - 1) * J) \
                    + new_F @ mat(0.0, 0.0, 0.0, a) @ new_F.transpose()
                affine = -(DT * p_vol * 4 * inv_dx * inv_dx) * stress + C[t, p]
                for i, j in ti.static(ti.ndrange(3, 3)):
                    offset = ti.Vector([i, j])
                    dpos = (ti.cast(offset, ti.f32) - fx) * dx
                    weight = w[i][0] * w[j][1]
                    grid_v[t, base + offset] += weight * (v[t, p] + affine @ dpos)
                    grid_m[t, base + offset] += weight

        @ti.kernel
        def grid_op(t: ti.i32):
            for i, j in ti.ndrange(n_grid, n_grid):
                out = grid_v[t, i, j] / (grid_m[t, i, j] + 1e-10)
                out[1] -= DT * GRAVITY
                if (i < BOUND and out[0] < 0) or (i > n_grid - BOUND and out[0] > 0) \
                        or (j > n_grid - BOUND and out[1] > 0):
                    out = vec(0.0, 0.0)
                if j < BOUND and out[1] < 0:  # the floor: Coulomb friction
                    tangent = ti.abs(out[0]) + 1e-10
                    out = vec(ti.max(0.0, 1 + FRICTION * out[1] / tangent) * out[0], 0.0)
                grid_out[t, i, j] = out

        @ti.kernel
        def g2p(t: ti.i32):
            for p in range(n):
                base = ti.cast(x[t, p] * inv_dx - 0.5, ti.i32)
                fx = x[t, p] * inv_dx - ti.cast(base, ti.f32)
                w = [0.5 * (1.5 - fx) ** 2, 0.75 - (fx - 1.0) ** 2, 0.5 * (fx - 0.5) ** 2]
                new_v = vec(0.0, 0.0)
                new_C = mat(0.0, 0.0, 0.0, 0.0)
                for i, j in ti.static(ti.ndrange(3, 3)):
                    dpos = ti.cast(ti.Vector([i, j]), ti.f32) - fx
                    g = grid_out[t, base[0] + i, base[1] + j]
                    weight = w[i][0] * w[j][1]
                    new_v += weight * g
                    new_C += 4 * inv_dx * weight * g.outer_product(dpos)
                v[t + 1, p] = new_v
                C[t + 1, p] = new_C
                x[t + 1, p] = x[t, p] + DT * new_v

        @ti.kernel
        def compute_loss():
            for p in range(n):
                loss[None] -= (x[steps - 1, p][0] - x[0, p][0]) / n

        @ti.kernel
        def clear():
            for t, i, j in grid_m:
                grid_v[t, i, j] = vec(0.0, 0.0)
                grid_m[t, i, j] = 0.0

        @ti.kernel
        def descend(rate: ti.f32):
            for a, j in weights:
                weights[a, j] -= rate * weights.grad[a, j]
            for a in bias:
                bias[a] -= rate * bias.grad[a]

        def reset() -> None:
            clear()
            x.from_numpy(np.broadcast_to(x0, (steps, n, 2)).copy())
            v.fill(0)
            C.fill(0)
            F.from_numpy(np.broadcast_to(np.eye(2, dtype=np.float32), (steps, n, 2, 2)).copy())
            loss[None] = 0

        self._kernels = controller, p2g, grid_op, g2p, compute_loss, descend, reset
        rng = np.random.default_rng(seed)
        weights.from_numpy((rng.standard_normal((n_act, N_SIN)) * 0.01).astype(np.float32))

    def rollout(self) -> None:
        """Reset, simulate ``steps`` steps and compute the loss."""
        controller, p2g, grid_op, g2p, compute_loss, _, reset = self._kernels
        reset()
        for t in range(self.steps - 1):
            controller(t)
            p2g(t)
            grid_op(t)
            g2p(t)
        compute_loss()

    def train(self, iters: int, rate: float = 1.0) -> list[float]:
        """``iters`` steps of gradient descent on the controller; the loss of each."""
        descend = self._kernels[5]
        losses = []
        for _ in range(iters):
            with ti.ad.Tape(self.loss):
                self.rollout()
            losses.append(float(self.loss[None]))
            descend(rate)
        return losses

    def draw(self, frames: pictures.Frames, gui: ti.GUI, caption: str, every: int) -> None:
        """The last rollout, every ``every``-th step, as frames."""
        xs, acts = self.x.to_numpy(), self.act.to_numpy()  # one read each
        view = pictures.window(gui.res, 0.0, 0.0, 0.8)
        floor = float(view([0.0, BOUND / self.n_grid])[1])
        for t in range(0, self.steps - 1, every):
            a = np.where(self.muscle >= 0, acts[t, np.maximum(self.muscle, 0)], 0.0)
            rgb = np.stack([0.5 - 0.5 * a, 0.5 - 0.5 * np.abs(a), 0.5 + 0.5 * a])
            colors = np.where(self.muscle >= 0, ti.rgb_to_hex(rgb), 0x333333)
            gui.line((0, floor), (1, floor), radius=2, color=0x444444)
            gui.circles(view(xs[t]), radius=2, color=colors.astype(np.uint32))
            gui.text(f"{caption}   t = {t * DT:.2f} s", (0.02, 0.97), font_size=18,
                     color=0x222222)
            frames.add(gui)


def main(argv: list[str] | None = None) -> list[float]:
    ap = pictures.parser(__doc__, iters=40)
    ap.add_argument("--steps", type=int, default=512, help="steps of the rollout")
    ap.add_argument("--grid", type=int, default=48, help="grid cells along each axis")
    ap.add_argument("--width", type=int, default=400, help="frame width in pixels")
    args = ap.parse_args(argv)
    pictures.init(args.remote, default_fp=ti.f32)
    jelly_ = Jelly(args.steps, args.grid)
    gui = ti.GUI("diffmpm", res=(args.width, args.width // 2),
                 background_color=0xFFFFFF, show_gui=False)
    frames = pictures.Frames(args.out, "diffmpm")
    every = max(1, args.steps // 30)
    jelly_.rollout()
    jelly_.draw(frames, gui, "first gait", every)
    losses = jelly_.train(args.iters)
    jelly_.rollout()
    jelly_.draw(frames, gui, f"after {args.iters} iterations", every)
    gif = frames.save()
    png = pictures.plot_losses(losses, f"{args.out}/diffmpm_loss.png",
                               "MPM jelly: minus the distance crawled")
    print(f"loss {losses[0]:.4g} -> {losses[-1]:.4g}; wrote {gif} and {png}")
    return losses


if __name__ == "__main__":
    main()
