"""Billiards: aim the cue ball so that a ball it never touches directly ends on a spot.

A cue ball is shot into a triangle of balls; only collisions move the others, so the loss,
the distance of the last ball of the triangle from a target spot when the time is up, depends
on the cue ball's start and velocity only through a chain of collisions. Collisions are
impulses with a time-of-impact correction (DiffTaichi's billiards is the model), which keeps
the positions continuous in the parameters, so ``ti.ad.Tape`` gives a useful gradient through
every contact; plain gradient descent on the cue ball's start and velocity does the aiming.

Writes ``billiards.gif`` (the first shot, then the last) and ``billiards_loss.png``.
Run: ``python examples/billiards.py [--iters 60] [--steps 512] [--out DIR] [--remote]``.
"""

from __future__ import annotations

import numpy as np
import pictures

import difftape as ti

LAYERS, RADIUS, ELASTICITY = 3, 0.03, 0.8
DURATION = 3.0  # seconds of play
GOAL = (0.9, 0.75)
CUE_X, CUE_V = (0.1, 0.5), (0.3, 0.0)


class Table:
    """The balls' time-indexed state, the kernels of one shot and the gradient step."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.n = n = 1 + LAYERS * (LAYERS + 1) // 2
        dt = DURATION / steps
        vec = ti.types.vector(2, ti.f32)
        self.x = x = ti.Vector.field(2, ti.f32, shape=(steps, n), needs_grad=True)
        v = ti.Vector.field(2, ti.f32, shape=(steps, n), needs_grad=True)
        x_inc = ti.Vector.field(2, ti.f32, shape=(steps, n), needs_grad=True)
        impulse = ti.Vector.field(2, ti.f32, shape=(steps, n), needs_grad=True)
        self.init_x = init_x = ti.Vector.field(2, ti.f32, shape=(), needs_grad=True)
        self.init_v = init_v = ti.Vector.field(2, ti.f32, shape=(), needs_grad=True)
        self.loss = loss = ti.field(ti.f32, shape=(), needs_grad=True)
        goal = vec(*GOAL)

        @ti.func
        def collide_pair(t, i, j):
            imp, shift = vec(0.0, 0.0), vec(0.0, 0.0)
            dist = (x[t, i] + dt * v[t, i]) - (x[t, j] + dt * v[t, j])
            d = dist.norm()
            rel_v = v[t, i] - v[t, j]
            if d < 2 * RADIUS:
                normal = dist.normalized(1e-6)
                approach = normal.dot(rel_v)
                if approach < 0:
                    imp = -(1 + ELASTICITY) * 0.5 * approach * normal
                    toi = (d - 2 * RADIUS) / ti.min(-1e-3, approach)  # time of impact
                    shift = ti.min(toi - dt, 0.0) * imp
            x_inc[t + 1, i] += shift
            impulse[t + 1, i] += imp

        @ti.kernel
        def collide(t: ti.i32):
            for i in range(n):
                for j in range(n):
                    if i != j:
                        collide_pair(t, i, j)

        @ti.kernel
        def advance(t: ti.i32):
            for i in range(n):
                v[t, i] = v[t - 1, i] + impulse[t, i]
                x[t, i] = x[t - 1, i] + dt * v[t, i] + x_inc[t, i]

        @ti.kernel
        def rack():
            x[0, 0] = init_x[None]
            v[0, 0] = init_v[None]
            for t, i in x_inc:
                x_inc[t, i] = vec(0.0, 0.0)
                impulse[t, i] = vec(0.0, 0.0)

        @ti.kernel
        def compute_loss():
            loss[None] = (x[steps - 1, n - 1] - goal).norm_sqr()

        @ti.kernel
        def descend(rate: ti.f32):
            init_x[None] -= rate * init_x.grad[None]
            init_v[None] -= rate * init_v.grad[None]

        self._kernels = rack, collide, advance, compute_loss, descend
        start = [(0.0, 0.0)] + [(0.5 + 2 * RADIUS * i, 0.5 + 2 * RADIUS * j - RADIUS * i * 0.7)
                                for i in range(LAYERS) for j in range(i + 1)]
        x0 = np.broadcast_to(np.asarray(start, np.float32), (steps, n, 2)).copy()
        x.from_numpy(x0)
        v.fill(0)
        init_x[None] = CUE_X
        init_v[None] = CUE_V

    def shot(self) -> None:
        """Play the shot from the cue ball's start and velocity, and compute the loss."""
        rack, collide, advance, compute_loss, _ = self._kernels
        rack()
        for t in range(1, self.steps):
            collide(t - 1)
            advance(t)
        compute_loss()

    def train(self, iters: int, rate: float = 0.01) -> list[float]:
        """``iters`` steps of gradient descent on the shot; the loss of each."""
        descend = self._kernels[4]
        losses = []
        for _ in range(iters):
            with ti.ad.Tape(self.loss):
                self.shot()
            losses.append(float(self.loss[None]))
            descend(rate)
        return losses

    def draw(self, frames: pictures.Frames, gui: ti.GUI, caption: str, every: int) -> None:
        """The last shot, every ``every``-th step, as frames."""
        xs = self.x.to_numpy()  # one read
        px = RADIUS * gui.res[0]
        colors = np.array([0xEEEEEE] + [0xD02A2A] * (self.n - 2) + [0x3344CC], np.uint32)
        for t in list(range(0, self.steps, every)) + [self.steps - 1]:
            gui.circle(GOAL, 0x1C3F20, px + 4)
            gui.circle(GOAL, 0x3C733F, px)
            gui.circles(xs[t], radius=px, color=colors)
            gui.text(caption, (0.02, 0.98), font_size=18, color=0xFFFFFF)
            frames.add(gui)


def main(argv: list[str] | None = None) -> list[float]:
    ap = pictures.parser(__doc__, iters=60)
    ap.add_argument("--steps", type=int, default=512, help="steps of a shot")
    ap.add_argument("--res", type=int, default=320, help="frame size in pixels")
    args = ap.parse_args(argv)
    pictures.init(args.remote, default_fp=ti.f32)
    table = Table(args.steps)
    gui = ti.GUI("billiards", res=args.res, background_color=0x3C733F, show_gui=False)
    frames = pictures.Frames(args.out, "billiards")
    every = max(1, args.steps // 30)
    table.shot()
    table.draw(frames, gui, "first shot", every)
    losses = table.train(args.iters)
    table.shot()
    table.draw(frames, gui, f"after {args.iters} iterations", every)
    gif = frames.save()
    png = pictures.plot_losses(losses, f"{args.out}/billiards_loss.png",
                               "billiards: squared distance of the blue ball from the spot",
                               log=True)
    print(f"loss {losses[0]:.4g} -> {losses[-1]:.4g}; wrote {gif} and {png}")
    return losses


if __name__ == "__main__":
    main()
