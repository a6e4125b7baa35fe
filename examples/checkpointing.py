"""Checkpointing: trade recomputation for memory with custom gradients.

A 1-D reaction-diffusion rollout of ``STEPS`` steps is differentiated twice:

* **naive**: every state is kept, ``u[t, i]`` for all ``t`` (memory grows with the steps);
* **checkpointed**: only every ``K``-th state is kept (``ck``) plus one ``K``-step scratch
  segment (``seg``). Each segment is a ``@ti.ad.grad_replaced`` function; its gradient,
  registered with ``@ti.ad.grad_for``, recomputes the segment's states from its checkpoint and
  back-propagates through them (as DiffTaichi's diffmpm does for its grid).

Both give the same gradient of the loss with respect to the initial state; the script prints
the field memory each needs. Run: ``python examples/checkpointing.py``.
"""

from __future__ import annotations

import argparse

import numpy as np

import difftape as ti


def simulate(n: int, steps: int, k: int, checkpointed: bool) -> tuple[np.ndarray, float, int]:
    """Gradient d loss / d u0, the loss, and the bytes of field storage used."""
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    alpha, dt = 0.2, 0.05
    loss = ti.field(float, (), needs_grad=True)

    def make(rows: int):
        return ti.field(float, (rows, n), needs_grad=True)

    @ti.func
    def update(u: ti.template(), t: ti.i32, i: ti.i32):
        left = u[t, (i + n - 1) % n]
        right = u[t, (i + 1) % n]
        c = u[t, i]
        return c + alpha * (left - 2.0 * c + right) - dt * c * c * c

    u0 = np.sin(np.linspace(0, 2 * np.pi, n, endpoint=False)) + 0.3

    if not checkpointed:
        u = make(steps + 1)

        @ti.kernel
        def step(t: ti.i32):
            for i in range(n):
                u[t + 1, i] = update(u, t, i)

        @ti.kernel
        def compute_loss():
            for i in range(n):
                loss[None] += u[steps, i] ** 2

        u.to_numpy()  # allocate
        arr = u.to_numpy()
        arr[0] = u0
        u.from_numpy(arr)
        with ti.ad.Tape(loss):
            for t in range(steps):
                step(t)
            compute_loss()
        return u.grad.to_numpy()[0], float(loss[None]), 2 * u.to_numpy().nbytes

    assert steps % k == 0, "the number of steps must be a multiple of the segment length"
    ck = make(steps // k + 1)  # checkpoints: every k-th state
    seg = make(k + 1)  # one segment of states, reused

    @ti.kernel
    def load_segment(c: ti.i32):
        for i in range(n):
            seg[0, i] = ck[c, i]

    @ti.kernel
    def seg_step(t: ti.i32):
        for i in range(n):
            seg[t + 1, i] = update(seg, t, i)

    @ti.kernel
    def save_segment(c: ti.i32):
        for i in range(n):
            ck[c + 1, i] = seg[k, i]

    @ti.kernel
    def compute_loss():
        for i in range(n):
            loss[None] += ck[steps // k, i] ** 2

    def run_segment(c: int) -> None:
        load_segment(c)
        for t in range(k):
            seg_step(t)
        save_segment(c)

    @ti.ad.grad_replaced
    def segment(c: int) -> None:
        run_segment(c)

    @ti.ad.grad_for(segment)
    def segment_grad(c: int) -> None:
        run_segment(c)  # recompute the k states this segment needs
        seg.grad.fill(0)
        save_segment.grad(c)
        for t in reversed(range(k)):
            seg_step.grad(t)
        load_segment.grad(c)

    arr = ck.to_numpy()
    arr[0] = u0
    ck.from_numpy(arr)
    with ti.ad.Tape(loss):
        for c in range(steps // k):
            segment(c)
        compute_loss()
    used = 2 * (ck.to_numpy().nbytes + seg.to_numpy().nbytes)
    return ck.grad.to_numpy()[0], float(loss[None]), used


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096, help="grid points")
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--k", type=int, default=32, help="steps per checkpoint segment")
    a = p.parse_args(argv)
    g_naive, l_naive, m_naive = simulate(a.n, a.steps, a.k, checkpointed=False)
    g_ck, l_ck, m_ck = simulate(a.n, a.steps, a.k, checkpointed=True)
    rel = float(np.max(np.abs(g_naive - g_ck)) / np.max(np.abs(g_naive)))
    print(f"loss: naive {l_naive:.12g}, checkpointed {l_ck:.12g}")
    print(f"gradient w.r.t. the initial state: max relative difference {rel:.1e}")
    print(f"field memory (values + gradients): naive {m_naive / 2**20:.1f} MiB, "
          f"checkpointed {m_ck / 2**20:.1f} MiB ({m_naive / m_ck:.1f}x less)")
    return {"rel": rel, "loss": (l_naive, l_ck), "memory": (m_naive, m_ck)}


if __name__ == "__main__":
    main()
