"""Derivatives of ``@ti.func``s as ``@ti.func``s: ``ti.ad.grad(f)``, ``ti.ad.jvp(f)``,
``ti.ad.vjp(f)`` (the seed issue's ``dfdx = forward(f)``).

The derivative is built at compile time, at each call site: the func is inlined into a scratch
block, the forward-mode transform (the same one that makes forward-mode kernels) adds tangent
code seeded at the argument values, and the block is spliced into the kernel. A gradient of a
function of ``n`` scalars uses ``n`` seeded copies (one per input direction); LLVM merges the
shared primal computation, so for the small functions this is meant for it costs about what a
hand-written derivative would.
"""

from __future__ import annotations

from ..autodiff.forward import tangents_of_block
from ..ir.nodes import Stmt
from . import builder as _b
from .matrix import Matrix
from .transformer import _as_value
from .values import Expr, Value


def _flatten(bld: _b.Builder, v) -> tuple[list[Stmt], object]:
    """Scalar statements of a func argument/result and a function rebuilding its shape."""
    v = _as_value(v)
    if isinstance(v, Matrix):
        stmts = [_scalar(bld, e) for e in v.entries]
        n, m, nd = v.n, v.m, v.ndim
        return stmts, lambda xs: Matrix._from_entries([Expr(x) for x in xs], n, m, nd)
    if isinstance(v, tuple):
        parts = [_flatten(bld, x) for x in v]
        sizes = [len(p[0]) for p in parts]

        def rebuild(xs):
            out, k = [], 0
            for (_, r), n in zip(parts, sizes, strict=True):
                out.append(r(xs[k:k + n]))
                k += n
            return tuple(out)

        return [s for p in parts for s in p[0]], rebuild
    return [_scalar(bld, v)], lambda xs: Expr(xs[0])


def _scalar(bld: _b.Builder, v) -> Stmt:
    if isinstance(v, Value):
        s = v.expr().stmt
        if not s.dtype.is_float:
            s = bld.emit("cast", bld.default_fp, (s,))
        return s
    if isinstance(v, bool | int | float):
        return bld.emit("const", bld.default_fp, (), bld.default_fp.wrap(float(v)))
    raise bld.error(f"differentiated funcs take numbers, vectors and matrices, got "
                    f"{type(v).__name__}")


def _zero(bld: _b.Builder, like: Stmt) -> Stmt:
    return bld.emit("const", like.dtype, (), 0.0)


class _Linearized:
    """One inlined call with tangents: primal result statements and their tangents."""

    def __init__(self, bld: _b.Builder, func, args: list, seeds: dict[Stmt, Stmt]) -> None:
        with bld.block() as blk:
            result = func(*args)
            out, self.rebuild = _flatten(bld, result)
        new_blk, tan = tangents_of_block(blk, seeds, bld.kernel_name, bld.file)
        bld._blocks[-1].extend(new_blk)
        self.out = out
        self.tan = [tan.get(s) for s in out]


class DerivedFunc:
    """A func computing a derivative of ``func``; callable inside kernels like the func."""

    def __init__(self, func, kind: str, argnums: int | tuple[int, ...] = 0) -> None:
        self.func = func
        self.kind = kind
        self.argnums = argnums
        self.__name__ = f"{kind}({getattr(func, '__name__', 'func')})"

    def __call__(self, *args):
        bld = _b.current()
        if bld is None:
            raise TypeError(f"ti.ad.{self.kind}(f) is a func: call it from a kernel or another "
                            "func")
        return getattr(self, "_" + self.kind)(bld, list(args))

    def _args(self, bld: _b.Builder, args: list) -> tuple[list, list[list[Stmt]]]:
        """Arguments as values whose scalars are statements (seeds attach to them)."""
        vals, scalars = [], []
        for a in args:
            stmts, rebuild = _flatten(bld, a)
            vals.append(rebuild(stmts))
            scalars.append(stmts)
        return vals, scalars

    def _lanes(self, bld: _b.Builder, vals: list, inputs: list[Stmt]) -> list[_Linearized]:
        """One linearization per input scalar, seeded with 1 in that direction."""
        lanes = []
        for x in inputs:
            one = bld.emit("const", x.dtype, (), 1.0)
            lanes.append(_Linearized(bld, self.func, vals, {x: one}))
        return lanes

    def _grad(self, bld: _b.Builder, args: list):
        """``grad(f)(*args)``: the gradient of a scalar-valued f with respect to the arguments
        in ``argnums`` (shaped like them; a tuple when argnums is a tuple)."""
        nums = (self.argnums,) if isinstance(self.argnums, int) else tuple(self.argnums)
        vals, scalars = self._args(bld, args)
        results = []
        for k in nums:
            if k >= len(args):
                raise bld.error(f"{self.__name__}: argnum {k} but only {len(args)} arguments")
            lanes = self._lanes(bld, vals, scalars[k])
            if lanes and len(lanes[0].out) != 1:
                raise bld.error(f"{self.__name__}: f must return a scalar (use ti.ad.jvp or "
                                "ti.ad.vjp for vector-valued funcs)")
            entries = [ln.tan[0] if ln.tan[0] is not None else _zero(bld, ln.out[0])
                       for ln in lanes]
            _, rebuild = _flatten(bld, vals[k])
            results.append(rebuild(entries))
        return results[0] if isinstance(self.argnums, int) else tuple(results)

    def _jvp(self, bld: _b.Builder, args: list):
        """``jvp(f)(*primals, *tangents) -> (f(primals), J @ tangents)``."""
        n = len(args) // 2
        if len(args) != 2 * n or n == 0:
            raise bld.error(f"{self.__name__} takes the primals and then one tangent per "
                            f"primal, got {len(args)} arguments")
        vals, scalars = self._args(bld, args[:n])
        _, tscalars = self._args(bld, args[n:])
        seeds = {}
        for xs, ts in zip(scalars, tscalars, strict=True):
            if len(xs) != len(ts):
                raise bld.error(f"{self.__name__}: a tangent must have its primal's shape")
            for x, t in zip(xs, ts, strict=True):
                seeds[x] = t if t.dtype == x.dtype else bld.emit("cast", x.dtype, (t,))
        lin = _Linearized(bld, self.func, vals, seeds)
        tangents = [t if t is not None else _zero(bld, o) for o, t in zip(lin.out, lin.tan,
                                                                           strict=True)]
        return lin.rebuild(lin.out), lin.rebuild(tangents)

    def _vjp(self, bld: _b.Builder, args: list):
        """``vjp(f)(*primals, cotangent) -> (f(primals), *cotangents of the primals)``."""
        if len(args) < 2:
            raise bld.error(f"{self.__name__} takes the primals and then the output cotangent")
        vals, scalars = self._args(bld, args[:-1])
        cot, _ = _flatten(bld, args[-1])
        out_value = None
        results = []
        for k, xs in enumerate(scalars):
            lanes = self._lanes(bld, vals, xs)
            entries = []
            for ln in lanes:
                if len(ln.out) != len(cot):
                    raise bld.error(f"{self.__name__}: the cotangent must have the shape of "
                                    "f's result")
                acc = None
                for u, t in zip(cot, ln.tan, strict=True):
                    if t is None:
                        continue
                    u = u if u.dtype == t.dtype else bld.emit("cast", t.dtype, (u,))
                    p = bld.emit("mul", t.dtype, (u, t))
                    acc = p if acc is None else bld.emit("add", t.dtype, (acc, p))
                entries.append(acc if acc is not None else _zero(bld, xs[0]))
                if out_value is None:
                    out_value = ln.rebuild(ln.out)
            _, rebuild = _flatten(bld, vals[k])
            results.append(rebuild(entries))
        if out_value is None:  # no scalar inputs at all
            lin = _Linearized(bld, self.func, vals, {})
            out_value = lin.rebuild(lin.out)
        return (out_value, *results)
