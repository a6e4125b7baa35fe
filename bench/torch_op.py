"""Per-call overhead of a PyTorch operator wrapping a trivial kernel (``y = x * x``),
forward + backward, on 1-element and 1M-element f32 tensors: difftape's
``difftape.interop.torch.operator`` (ndarray storage: zero-copy) against Warp's documented
``wp.from_torch`` pattern (a ``torch.autograd.Function`` launching the kernel forward and, in
backward, with ``adjoint=True``), in the same run, on the CPU. Each call is
``op(x).backward(torch.ones(n))``: a fresh cotangent every time, since the adjoint launch of
Warp's pattern writes into the cotangent it is given.

Run: ``.venv/bin/pip install warp-lang && .venv/bin/python bench/torch_op.py``. Prints
microseconds per forward+backward (best of interleaved rounds) and the ratio difftape / Warp
(median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import difftape as ti


def difftape_op(n: int):
    from difftape.interop.torch import operator

    ti.init(arch=ti.cpu, default_fp=ti.f32)
    x = ti.ndarray(ti.f32, n, needs_grad=True)
    y = ti.ndarray(ti.f32, n, needs_grad=True)

    @ti.kernel
    def square(x: ti.types.ndarray(), y: ti.types.ndarray()):
        for i in x:
            y[i] = x[i] * x[i]

    return operator(lambda: square(x, y), inputs=[x], outputs=[y], name="square")


def warp_op(n: int):
    import warp as wp

    wp.config.quiet = True
    wp.init()

    @wp.kernel
    def square(x: wp.array(dtype=float), y: wp.array(dtype=float)):
        i = wp.tid()
        y[i] = x[i] * x[i]

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.x = wp.from_torch(x)
            ctx.y = wp.zeros(n, dtype=float, device="cpu", requires_grad=True)
            wp.launch(square, dim=n, inputs=[ctx.x], outputs=[ctx.y], device="cpu")
            return wp.to_torch(ctx.y)

        @staticmethod
        def backward(ctx, adj_y):
            ctx.x.grad = wp.zeros_like(ctx.x)
            ctx.y.grad = wp.from_torch(adj_y.contiguous())
            wp.launch(square, dim=n, inputs=[ctx.x], outputs=[ctx.y],
                      adj_inputs=[ctx.x.grad], adj_outputs=[ctx.y.grad], adjoint=True,
                      device="cpu")
            return wp.to_torch(ctx.x.grad)

    return Square.apply


def make_timer(op, n: int):
    """A function timing ``calls`` forward+backward calls (microseconds per call)."""
    x = torch.rand(n, requires_grad=True)

    def one() -> None:
        x.grad = None
        op(x).backward(torch.ones(n))

    for _ in range(3):  # compile, warm caches
        one()
    err = float((x.grad - 2 * x.detach()).abs().max())
    assert err < 1e-5, f"wrong gradient (max error {err}, n={n})"

    def timed(calls: int) -> float:
        t = time.perf_counter()
        for _ in range(calls):
            one()
        return (time.perf_counter() - t) / calls * 1e6

    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    print(f"{'elements':>10} {'difftape us':>12} {'warp us':>10} {'ratio':>7}  (best of "
          f"{args.rounds} interleaved rounds; ratio: median of the per-round ratios)")
    for n, calls in ((1, 100), (1 << 20, 5)):
        ours, theirs = make_timer(difftape_op(n), n), make_timer(warp_op(n), n)
        a, b = [], []
        for _ in range(args.rounds):  # interleaved: both see the same machine load
            a.append(ours(calls))
            b.append(theirs(calls))
        ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
        print(f"{n:>10} {min(a):>12.1f} {min(b):>10.1f} {ratio:>7.2f}")


if __name__ == "__main__":
    main()
