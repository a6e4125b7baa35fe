"""A reference evaluator of offloaded IR, one scalar at a time, for tests only.

It runs every task serially in Python with NumPy scalars of each statement's type, so a test can
tell a wrong lowering (compiled result differs from this) from a wrong frontend or gradient
transform (this differs from the truth). It is deliberately simple and slow: never on a hot path.
"""

from __future__ import annotations

import numpy as np

from .assertfmt import render
from .nodes import Block, KernelIR, Stmt
from .ops import OPS, evaluate
from .printf import python_format


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


class InterpreterAssertion(Exception):
    pass


def _py(v):
    return v.item() if isinstance(v, np.generic) else v


class Interpreter:
    """Evaluates a kernel's tasks against NumPy arrays bound to its buffer slots."""

    def __init__(self, ir: KernelIR, buffers: list[np.ndarray], args: list, *,
                 random=None) -> None:
        quant = [b.name for b in ir.buffers if b.quant is not None]
        if quant:  # its buffers would be the packed words: the encodings live in codegen/quant.py
            raise NotImplementedError(f"the reference interpreter does not evaluate quantized "
                                      f"fields ({', '.join(quant)}); run the compiled kernel")
        self.ir = ir
        self.buffers = buffers
        self.args = args
        self.temps: dict[int, object] = {}
        self.returns: dict[int, object] = {}
        self.random = random or np.random.default_rng(0).random

    def run(self) -> list:
        for t in self.ir.tasks:
            env: dict[Stmt, object] = {}
            self.stack: list = []
            if t.kind == "serial":
                self._block(t.body, env, {})
                continue
            self._block(t.bounds, env, {})
            begin, end = int(env[t.begin]), int(env[t.end])
            for slot, buf in enumerate(self.ir.buffers):
                if buf.key[0] == "private":  # a zeroed per-chunk copy (passes/scatter.py)
                    self.buffers[slot] = np.zeros(buf.shape, dtype=buf.dtype.np)
            self._block(t.prologue, env, {})
            for i in range(begin, end):
                try:
                    self._block(t.body, env, {t.loop_id: i})
                except _Continue:
                    pass
            self._block(t.epilogue, env, {})
        return [self.returns.get(k) for k in range(len(self.ir.returns))]

    def _block(self, block: Block, env: dict, loops: dict) -> None:
        for s in block:
            self._stmt(s, env, loops)

    def _index(self, s: Stmt, env: dict, n: int) -> tuple:
        return tuple(int(env[a]) for a in s.args[:n])

    def _stmt(self, s: Stmt, env: dict, loops: dict) -> None:  # noqa: C901 - one dispatch
        op, t = s.op, s.dtype
        a = [env.get(x) for x in s.args]
        if op == "const":
            env[s] = s.attr
        elif op == "arg":
            env[s] = t.wrap(self.args[s.attr])
        elif op == "buf_shape":
            env[s] = self.buffers[s.attr[0]].shape[s.attr[1]]
        elif op == "loop_index":
            env[s] = loops[s.attr]
        elif OPS[op].evaluate is not None:
            env[s] = evaluate(op, tuple(a), s.args[0].dtype, t)
        elif op == "random":
            env[s] = t.wrap(self.random()) if t.is_float else int(self.random() * 2**31)
        elif op == "load":
            env[s] = _py(self.buffers[s.attr][self._index(s, env, len(s.args))])
        elif op == "store":
            self.buffers[s.attr][self._index(s, env, len(s.args) - 1)] = a[-1]
        elif op == "atomic":
            slot, kind = s.attr
            idx = self._index(s, env, len(s.args) - 1)
            old = _py(self.buffers[slot][idx])
            self.buffers[slot][idx] = evaluate(kind, (old, a[-1]), t, t)
            env[s] = old
        elif op == "alloca":
            env[s] = [0]
        elif op == "local_load":
            env[s] = a[0][0]
        elif op == "local_store":
            a[0][0] = a[1]
        elif op == "local_atomic":
            env[s] = a[0][0]
            a[0][0] = evaluate(s.attr, (a[0][0], a[1]), t, t)
        elif op == "temp_atomic":
            slot, kind = s.attr
            old = self.temps.get(slot, 0)
            env[s] = old
            self.temps[slot] = evaluate(kind, (old, a[0]), t, t)
        elif op == "temp_load":
            env[s] = self.temps.get(s.attr, 0)
        elif op == "temp_store":
            self.temps[s.attr] = a[0]
        elif op == "stack_push":
            self.stack.append(a[0])
        elif op == "stack_pop":
            env[s] = self.stack.pop()
        elif op == "return":
            self.returns[s.attr] = a[0]
        elif op == "print":
            text = s.attr[0] + "".join(python_format(s.attr[2 * k + 1], v) + s.attr[2 * k + 2]
                                       for k, v in enumerate(a))
            print(text, end="")
        elif op == "assert":
            if not a[0]:
                raise InterpreterAssertion(render(s.attr, [v.dtype for v in s.args[1:]], a[1:]))
        elif op == "if":
            self._block(s.blocks[0] if a[0] else s.blocks[1], env, loops)
        elif op == "range_for":
            for i in range(int(a[0]), int(a[1])):
                try:
                    self._block(s.blocks[0], env, {**loops, s.attr[0]: i})
                except _Continue:
                    continue
                except _Break:
                    break
        elif op == "while":
            while True:
                try:
                    self._block(s.blocks[0], env, loops)
                except _Continue:
                    continue
                except _Break:
                    break
        elif op == "break":
            raise _Break
        elif op == "continue":
            raise _Continue
        else:
            raise KeyError(f"interpreter has no rule for op {op}")
