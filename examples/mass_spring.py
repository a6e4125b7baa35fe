"""A mass-spring robot learns to walk: a neural-network controller trained by reverse mode
through the whole rollout.

The robot is a lattice of point masses joined by springs (DiffTaichi's mass-spring robots are
the model). Its leg springs are muscles: at every step a small network reads sine waves of the
time and each mass's offset from the robot's centre and its velocity, and sets each muscle's
rest length. The loss is minus the distance the centre travelled to the right after ``steps``
steps; ``ti.ad.Tape`` differentiates it through every step of the rollout (three kernels a
step, each reading step ``t`` and writing step ``t + 1`` of time-indexed fields, so nothing a
kernel read is overwritten) back to the network's weights, and a normalised gradient step
updates them, in a kernel too: an iteration reads one number (the loss) from the device.
Walking is chaotic and the springs' impulses are float atomics added in whatever order the
threads come, so two runs learn slightly different gaits (``ti.init(deterministic=True)``
makes a local run repeatable).

Writes ``mass_spring.gif`` (the untrained robot, then the trained one) and
``mass_spring_loss.png``. Run: ``python examples/mass_spring.py [--iters 100] [--steps 600]
[--out DIR] [--remote]``.
"""

from __future__ import annotations

import math

import numpy as np
import pictures

import difftape as ti

DT, GRAVITY, DAMPING, GROUND = 0.004, -4.8, 15.0, 0.1
STIFFNESS, MUSCLE = 3.0e4, 0.15  # spring stiffness; how far a muscle changes its length
N_SIN, N_HIDDEN, OMEGA = 8, 24, 10.0
CELL = 0.05
VIEW = 0.6  # the width of the world the frames show


def robot() -> tuple[list[tuple[float, float]], list[tuple[int, int, float, float]]]:
    """Masses and springs ``(a, b, rest length, actuation)``: a body of four cells on two
    two-cell legs; the legs' vertical springs are the muscles."""
    cells = [(0, 0, 1), (0, 1, 1), (3, 0, 1), (3, 1, 1),
             (0, 2, 0), (1, 2, 0), (2, 2, 0), (3, 2, 0)]
    index: dict[tuple[int, int], int] = {}
    masses: list[tuple[float, float]] = []
    springs: dict[tuple[int, int], tuple[int, int, float, float]] = {}

    def point(i: int, j: int) -> int:
        if (i, j) not in index:
            index[i, j] = len(masses)
            masses.append((0.1 + i * CELL, GROUND + j * CELL))
        return index[i, j]

    for i, j, act in cells:
        a, b, c, d = point(i, j), point(i, j + 1), point(i + 1, j), point(i + 1, j + 1)
        for p, q in ((a, b), (c, d), (a, c), (b, d), (a, d), (b, c)):
            key = (min(p, q), max(p, q))
            muscle = act * MUSCLE if (p, q) in ((a, b), (c, d)) else 0.0
            old = springs.get(key)
            if old is None or muscle > old[3]:
                (xa, ya), (xb, yb) = masses[p], masses[q]
                springs[key] = (key[0], key[1], math.hypot(xa - xb, ya - yb), muscle)
    return masses, list(springs.values())


class Robot:
    """The fields, kernels and training loop of one robot and its controller."""

    def __init__(self, steps: int, seed: int = 0) -> None:
        masses, springs = robot()
        self.steps, n, ns = steps, len(masses), len(springs)
        self.n_masses, self.n_springs = n, ns
        self.n_in = N_SIN + 4 * n
        vec = ti.types.vector(2, ti.f32)
        self.x = x = ti.Vector.field(2, ti.f32, shape=(steps, n), needs_grad=True)
        self.v = v = ti.Vector.field(2, ti.f32, shape=(steps, n), needs_grad=True)
        v_inc = ti.Vector.field(2, ti.f32, shape=(steps, n), needs_grad=True)
        self.act = act = ti.field(ti.f32, shape=(steps, ns), needs_grad=True)
        hidden = ti.field(ti.f32, shape=(steps, N_HIDDEN), needs_grad=True)
        self.w1 = w1 = ti.field(ti.f32, shape=(N_HIDDEN, self.n_in), needs_grad=True)
        self.b1 = b1 = ti.field(ti.f32, shape=N_HIDDEN, needs_grad=True)
        self.w2 = w2 = ti.field(ti.f32, shape=(ns, N_HIDDEN), needs_grad=True)
        self.b2 = b2 = ti.field(ti.f32, shape=ns, needs_grad=True)
        self.loss = loss = ti.field(ti.f32, shape=(), needs_grad=True)
        grad_sq = ti.field(ti.f32, shape=())
        s = np.asarray(springs, np.float64)
        self.anchors = s[:, :2].astype(np.int32)
        self.muscle = s[:, 3]
        anchor_a, anchor_b = ti.field(ti.i32, shape=ns), ti.field(ti.i32, shape=ns)
        rest, muscle = ti.field(ti.f32, shape=ns), ti.field(ti.f32, shape=ns)
        anchor_a.from_numpy(self.anchors[:, 0])
        anchor_b.from_numpy(self.anchors[:, 1])
        rest.from_numpy(s[:, 2].astype(np.float32))
        muscle.from_numpy(s[:, 3].astype(np.float32))
        self.x0 = np.asarray(masses, np.float32)

        @ti.func
        def center(t):
            c = vec(0.0, 0.0)
            for i in range(n):
                c += x[t, i]
            return c / n

        @ti.kernel
        def controller(t: ti.i32):
            for k in range(N_HIDDEN):
                c = center(t)
                h = b1[k]
                for j in ti.static(range(N_SIN)):
                    h += w1[k, j] * ti.sin(OMEGA * t * DT + 2 * math.pi / N_SIN * j)
                for i in ti.static(range(n)):
                    off = x[t, i] - c
                    h += 0.05 * (w1[k, N_SIN + 4 * i] * off[0] + w1[k, N_SIN + 4 * i + 1]
                                 * off[1] + w1[k, N_SIN + 4 * i + 2] * v[t, i][0]
                                 + w1[k, N_SIN + 4 * i + 3] * v[t, i][1])
                hidden[t, k] = ti.tanh(h)

        @ti.kernel
        def springs_(t: ti.i32):
            for i in range(ns):
                a = b2[i]
                for k in ti.static(range(N_HIDDEN)):
                    a += w2[i, k] * hidden[t, k]
                act[t, i] = ti.tanh(a)
                d = x[t, anchor_a[i]] - x[t, anchor_b[i]]
                length = d.norm() + 1e-4
                target = rest[i] * (1.0 + muscle[i] * act[t, i])
                impulse = DT * STIFFNESS * (length - target) / length * d
                v_inc[t + 1, anchor_a[i]] -= impulse
                v_inc[t + 1, anchor_b[i]] += impulse

        @ti.kernel
        def advance(t: ti.i32):
            for i in range(n):
                old_v = math.exp(-DT * DAMPING) * v[t - 1, i] + DT * GRAVITY * vec(0.0, 1.0) \
                    + v_inc[t, i]
                old_x = x[t - 1, i]
                toi, new_v = 0.0, old_v
                if old_x[1] + DT * old_v[1] < GROUND and old_v[1] < -1e-4:
                    # the mass meets the ground within this step: it moves until the time of
                    # impact and stops there (a plastic impact with friction); the position
                    # depends smoothly on the time of impact, which keeps gradients useful
                    toi = -(old_x[1] - GROUND) / old_v[1]
                    new_v = vec(0.0, 0.0)
                v[t, i] = new_v
                x[t, i] = old_x + toi * old_v + (DT - toi) * new_v

        @ti.kernel
        def compute_loss():
            loss[None] = -(center(steps - 1)[0] - center(0)[0])

        @ti.kernel
        def clear():
            for t, i in v_inc:
                v_inc[t, i] = vec(0.0, 0.0)

        weights = (w1, w2, b1, b2)

        @ti.kernel
        def gradient_norm():
            for w in ti.static(weights):
                for k in ti.grouped(w):
                    grad_sq[None] += w.grad[k] ** 2

        @ti.kernel
        def descend(rate: ti.f32):
            scale = rate / (ti.sqrt(grad_sq[None]) + 1e-6)
            for w in ti.static(weights):
                for k in ti.grouped(w):
                    w[k] -= scale * w.grad[k]

        self._kernels = controller, springs_, advance, compute_loss, clear
        self._step = gradient_norm, descend, grad_sq
        rng = np.random.default_rng(seed)
        w1.from_numpy((rng.standard_normal((N_HIDDEN, self.n_in))
                       * math.sqrt(2 / (N_HIDDEN + self.n_in)) * 2).astype(np.float32))
        w2.from_numpy((rng.standard_normal((ns, N_HIDDEN))
                       * math.sqrt(2 / (N_HIDDEN + ns)) * 3).astype(np.float32))

    def rollout(self) -> None:
        """Simulate ``steps`` steps from the state ``reset`` set and compute the loss."""
        controller, springs_, advance, compute_loss, _ = self._kernels
        for t in range(1, self.steps):
            controller(t - 1)
            springs_(t - 1)
            advance(t)
        compute_loss()

    def reset(self) -> None:
        """The rest pose at step 0, no velocity, no spring impulses accumulated."""
        clear = self._kernels[4]
        clear()
        self.x.from_numpy(np.broadcast_to(self.x0, self.x.shape + (2,)).copy())
        self.v.fill(0)

    def train(self, iters: int, rate: float = 0.2) -> list[float]:
        """``iters`` iterations of normalised gradient descent; the loss of each."""
        gradient_norm, descend, grad_sq = self._step
        losses = []
        for _ in range(iters):
            self.reset()
            with ti.ad.Tape(self.loss):
                self.rollout()
            losses.append(float(self.loss[None]))
            grad_sq.fill(0)
            gradient_norm()
            descend(rate)
        return losses

    def draw(self, frames: pictures.Frames, gui: ti.GUI, caption: str, every: int) -> None:
        """The last rollout, every ``every``-th step, as frames (a window of the world
        ``VIEW`` wide, starting left of the robot and a little below the ground)."""
        view = pictures.window(gui.res, 0.0, GROUND - 0.02, VIEW)
        xs, acts = self.x.to_numpy(), self.act.to_numpy()  # one read each
        start = float(view(self.x0.mean(axis=0))[0])
        for t in range(0, self.steps, every):
            ground = float(view(np.array([0.0, GROUND]))[1])
            gui.line((0, ground), (1, ground), radius=2, color=0x444444)
            gui.line((start, ground - 0.05), (start, ground), radius=1, color=0x888888)
            a, b = xs[t, self.anchors[:, 0]], xs[t, self.anchors[:, 1]]
            colors = np.array([
                0x555555 if m == 0 else ti.rgb_to_hex((0.5 + 0.5 * u, 0.5 - 0.5 * abs(u),
                                                       0.5 - 0.5 * u))
                for m, u in zip(self.muscle, acts[t], strict=True)], np.uint32)
            gui.lines(view(a), view(b), radius=2, color=colors)
            gui.circles(view(xs[t]), radius=4, color=0x3C8C8C)
            gui.text(f"{caption}   t = {t * DT:.2f} s", (0.02, 0.96), font_size=18,
                     color=0x222222)
            frames.add(gui)


def main(argv: list[str] | None = None) -> list[float]:
    ap = pictures.parser(__doc__, iters=100)
    ap.add_argument("--steps", type=int, default=600, help="steps of the rollout")
    ap.add_argument("--width", type=int, default=400, help="frame width in pixels")
    args = ap.parse_args(argv)
    pictures.init(args.remote, default_fp=ti.f32, random_seed=0)
    bot = Robot(args.steps)
    gui = ti.GUI("mass-spring robot", res=(args.width, args.width // 2),
                 background_color=0xFFFFFF, show_gui=False)
    frames = pictures.Frames(args.out, "mass_spring")
    every = max(1, args.steps // 30)
    bot.reset()
    bot.rollout()
    bot.draw(frames, gui, "untrained", every)
    losses = bot.train(args.iters)
    bot.reset()
    bot.rollout()
    bot.draw(frames, gui, f"after {args.iters} iterations", every)
    gif = frames.save()
    png = pictures.plot_losses(losses, f"{args.out}/mass_spring_loss.png",
                             "mass-spring robot: minus the distance walked")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; wrote {gif} and {png}")
    return losses


if __name__ == "__main__":
    main()
