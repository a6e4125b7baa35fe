"""A PyTorch controller trained through a difftape simulation.

``B`` point masses start at random places in a bumpy potential field with quadratic drag;
a small PyTorch network reads each mass's position and velocity and pushes it, step after
step, and is trained so that after ``STEPS`` steps every mass rests at the target. Each
physics step is a difftape kernel made a PyTorch operator (``difftape.interop.torch``), so
``loss.backward()`` runs reverse mode through the whole rollout: PyTorch's autograd for the
network, difftape's adjoint kernels for the physics, chained step by step.

Writes the loss curve (iteration, loss) as CSV and prints the first and last loss.
The physics state lives in fields (copied in and out once per step), so the same script runs
against a difftape server with one flag: the PyTorch network stays here, each step's forward
and backward pass is one request to the server.

Run: ``python examples/torch_controller.py [--iters 150] [--out torch_controller_loss.csv]``;
``--remote`` (or ``DIFFTAPE_ARCH=remote``) with ``DIFFTAPE_SERVER`` and ``DIFFTAPE_TOKEN`` set
runs the simulation on that server.
"""

from __future__ import annotations

import argparse
import csv

import torch

import difftape as ti
from difftape.interop.torch import operator

B, STEPS, DT = 64, 40, 0.05
DRAG, BUMPS = 0.5, 2.0
TARGET = (1.0, -0.5)
VEC = ti.types.vector(2, ti.f32)


def make_step():
    """The physics step as a PyTorch operator: (pos, vel, force) -> (pos', vel')."""
    pos, vel, force, pos2, vel2 = (ti.Vector.field(2, ti.f32, shape=B, needs_grad=True)
                                   for _ in range(5))

    @ti.kernel
    def step():
        for i in pos:
            x, v = pos[i], vel[i]
            bump = ti.Vector([ti.cos(2.0 * x[0]), ti.cos(2.0 * x[1])])
            a = force[i] - DRAG * v.norm() * v - BUMPS * bump
            vel2[i] = v + DT * a
            pos2[i] = x + DT * vel2[i]

    return operator(step, inputs=[pos, vel, force], outputs=[pos2, vel2], name="physics_step")


def rollout(step, net: torch.nn.Module, x0: torch.Tensor) -> torch.Tensor:
    target = torch.tensor(TARGET)
    x, v = x0, torch.zeros_like(x0)
    effort = 0.0
    for _ in range(STEPS):
        f = net(torch.cat([x - target, v], dim=1))
        effort = effort + (f * f).mean()
        x, v = step(x, v, f)
    return ((x - target) ** 2).sum(dim=1).mean() + ((v ** 2).sum(dim=1)).mean() \
        + 1e-4 * effort / STEPS


def train(iters: int, seed: int = 0, **init) -> list[float]:
    """The loss of each iteration. ``init``: ``ti.init``'s arguments (default
    ``arch=ti.cpu``; ``arch=ti.remote`` runs the physics on a difftape server)."""
    ti.init(**{"arch": ti.cpu, **init}, default_fp=ti.f32, random_seed=seed)
    torch.manual_seed(seed)
    step = make_step()
    net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    x0 = torch.rand(B, 2) * 3.0 - 1.5
    losses = []
    for _ in range(iters):
        opt.zero_grad()
        loss = rollout(step, net, x0)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=150)
    ap.add_argument("--out", default="torch_controller_loss.csv")
    ap.add_argument("--remote", action="store_true",
                    help="run the physics on a difftape server (DIFFTAPE_SERVER, "
                         "DIFFTAPE_TOKEN)")
    args = ap.parse_args()
    losses = train(args.iters, **({"arch": ti.remote} if args.remote else {}))
    with open(args.out, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["iteration", "loss"])
        w.writerows(enumerate(losses))
    print(f"loss {losses[0]:.4g} -> {losses[-1]:.4g} ({losses[0] / losses[-1]:.1f}x lower); "
          f"curve in {args.out}")
    trips = ti.remote_stats()["round_trips"]  # zero locally
    if trips:
        print(f"{trips} round trips to the server ({trips / args.iters:.0f} per iteration)")


if __name__ == "__main__":
    main()
