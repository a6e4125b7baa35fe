"""Per-call overhead of a PyTorch operator wrapping a trivial kernel (``y = x * x``),
forward + backward, on 1-element and 1M-element f32 tensors: difftape's
``difftape.interop.torch.operator`` (ndarray storage: zero-copy) against Warp's documented
``wp.from_torch`` pattern (a ``torch.autograd.Function`` launching the kernel forward and, in
backward, with ``adjoint=True``), in the same run, on the CPU. Each call is
``op(x).backward(torch.ones(n))``: a fresh cotangent every time, since the adjoint launch of
Warp's pattern writes into the cotangent it is given.

Run: ``.venv/bin/pip install warp-lang && .venv/bin/python bench/torch_op.py``. Prints
microseconds per forward+backward (median of repeats) and the ratio difftape / Warp.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
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


def per_call_us(op, n: int, repeats: int, calls: int) -> tuple[float, np.ndarray]:
    x = torch.rand(n, requires_grad=True)
    for _ in range(3):  # compile, warm caches
        x.grad = None
        op(x).backward(torch.ones(n))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            x.grad = None
            op(x).backward(torch.ones(n))
        times.append((time.perf_counter() - t) / calls * 1e6)
    err = float((x.grad - 2 * x.detach()).abs().max())
    assert err < 1e-5, f"wrong gradient (max error {err}, n={n})"
    return statistics.median(times), x.grad.numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"{'elements':>10} {'difftape us':>12} {'warp us':>10} {'ratio':>7}")
    for n, calls in ((1, 200), (1 << 20, 10)):
        ours, _ = per_call_us(difftape_op(n), n, args.repeats, calls)
        theirs, _ = per_call_us(warp_op(n), n, args.repeats, calls)
        print(f"{n:>10} {ours:>12.1f} {theirs:>10.1f} {ours / theirs:>7.2f}")


if __name__ == "__main__":
    main()
