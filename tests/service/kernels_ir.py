"""Kernels built by the local frontend into IR, as a client would send them.

No ``from __future__ import annotations`` here: kernel annotations (``ti.i32``) are evaluated
in this module's globals.
"""

import difftape as ti
from difftape.ir import serialize
from difftape.runtime import program


class Kernels:
    """Kernels built by the local frontend into IR (what a client sends), over local fields
    whose ids the tests reuse on the server (IR buffers name fields by id)."""

    def __init__(self) -> None:
        ti.init(arch=ti.cpu)
        self.ti = ti
        self.prog = program.get()
        n = 16
        self.n = n
        self.x = ti.field(ti.f32, shape=n, needs_grad=True)
        self.y = ti.field(ti.f32, shape=n, needs_grad=True)
        self.loss = ti.field(ti.f32, shape=(), needs_grad=True)
        x, y, loss = self.x, self.y, self.loss

        @ti.kernel
        def double() -> None:
            for i in x:
                y[i] = 2.0 * x[i]

        @ti.kernel
        def square_sum() -> None:
            for i in x:
                loss[None] += x[i] * x[i]

        @ti.kernel
        def poke(k: ti.i32) -> None:
            y[k] = 1.0

        @ti.kernel
        def spin(steps: ti.i32) -> ti.f32:
            s = 0.0
            for _ in range(1):
                for _j in range(steps):
                    s = s * 0.999999 + 1.0
            return s

        @ti.kernel
        def endless(steps: ti.i32) -> ti.f32:
            # steps**2 iterations: with steps = 2**31 - 1, longer than any test runs.
            s = 0.0
            for _ in range(1):
                for _j in range(steps):
                    for _k in range(steps):
                        s = s * 0.999999 + 1.0
            return s

        @ti.kernel
        def total() -> ti.f32:
            s = 0.0
            for i in x:
                s += x[i]
            return s

        @ti.kernel
        def walk(steps: ti.i32) -> None:
            for i in x:
                s = x[i]
                for _ in range(steps):  # a dynamic loop: its adjoint takes a stack per thread,
                    s = ti.sin(s)       # 8 bytes per step
                y[i] = s

        @ti.kernel
        def say(k: ti.i32) -> None:
            print("k is", k)

        self.kernels = {k.name if hasattr(k, "name") else k.__name__: k
                        for k in (double, square_sum, poke, spin, endless, total, walk, say)}
        self.fields = {"x": x, "y": y, "loss": loss}

    def ir(self, name: str) -> dict:
        return serialize.encode(self.kernels[name].build_ir(self.prog, ()))

    def create_ops(self) -> list[dict]:
        """Batch ops creating the fields on a server with the local ids."""
        return [{"op": "create_field", "id": f.id, "dtype": f.dtype.name,
                 "shape": list(f.shape), "element_shape": list(f.element_shape),
                 "needs_grad": True, "name": name} for name, f in self.fields.items()]
