"""What a Tape recorded, as a picture: ``tape.visualize("tape.svg")``.

A ball is thrown with velocity ``v0`` and moves under gravity for a few steps; the loss is its
squared distance to a target. The Tape records one ``launch``, the ``step`` kernels and the
``distance``; the graph shows each launch (a box, in recording order) and each version of the
fields it reads and writes (ellipses): back-propagation walks it against the arrows. Drawing
the SVG needs Graphviz's ``dot`` program (``apt install graphviz``); without it, the DOT text
is written and the SVG refused, saying so.

    python examples/tape_graph.py                 # examples/images/tape.svg (+ tape.dot)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import difftape as ti

IMAGES = Path(__file__).resolve().parent / "images"


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="time steps recorded")
    ap.add_argument("--out", default=str(IMAGES / "tape.svg"),
                    help="the picture (.svg) or the DOT text (.dot)")
    args = ap.parse_args(argv)

    ti.init(arch=ti.cpu, default_fp=ti.f64)
    v0 = ti.Vector.field(2, float, (), needs_grad=True)
    x = ti.Vector.field(2, float, (), needs_grad=True)
    v = ti.Vector.field(2, float, (), needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)
    dt, target = 0.1, ti.Vector([2.0, 0.0])

    @ti.kernel
    def launch():
        x[None] = ti.Vector([0.0, 0.0])
        v[None] = v0[None]

    @ti.kernel
    def step():
        v[None] += dt * ti.Vector([0.0, -9.8])
        x[None] += dt * v[None]

    @ti.kernel
    def distance():
        loss[None] = (x[None] - target).norm_sqr()

    v0[None] = [3.0, 2.0]
    with ti.ad.Tape(loss) as tape:
        launch()
        for _ in range(args.steps):
            step()
        distance()
    print(f"loss {loss[None]:.4f}, d loss / d v0 = {v0.grad[None]}")
    files = tape.visualize(args.out)
    print("wrote", ", ".join(files))
    return files


if __name__ == "__main__":
    main()
