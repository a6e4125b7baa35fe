"""Random programs over the API features bench/fuzz_gen.py does not reach (bench/fuzz_taichi.py
``--kind features`` and ``--kind features_gradient``).

fuzz_gen's grammar walks scalar expressions and statements inside one big parallel loop. Real
Taichi programs also lean on things that grammar cannot produce, and each of them has its own
frontend and code generation path where a wrong result can hide:

- ti.func returning vectors, matrices and structs; nested funcs with template parameters,
  ti.static branches and ti.static loops;
- small-matrix algebra: transpose, @, inverse and determinant (2x2 to 4x4), norm, trace,
  outer_product, polar_decompose and svd (well-conditioned input: 3I + small entries, so the
  decompositions are unique up to the checks made: svd is compared through U diag(S) V^T and
  the sorted singular values, never U or V themselves);
- the value ti.atomic_* returns (serial loops, so the old values do not depend on thread order);
- ti.select on scalars and vectors of mixed types;
- unsigned arithmetic in u8/u16/u32/u64 (wrap-around, logical shifts by less than 8, ``//`` and
  ``%``, ``~``, casts between widths) and f16 fields;
- ndrange and grouped loops with negative or empty bounds, offset 2-D fields;
- struct-for over pointer and bitmasked SNodes after ti.deactivate, ti.is_active, dynamic
  SNodes with ti.append's return value, ti.length and deactivate_all;
- ti.math functions at the edges of their domains (0, -0.0, +-1 for asin/acos, exp overflow,
  huge sine arguments, rounding of halves, atan2 of zeros, log of 0).

``program(seed)`` picks a few of these snippets (each a kernel of its own with its own fields) and
returns the module source (``run(ti)`` returning a dict of arrays), as fuzz_gen.program does.
Nothing depends on thread order; shifts stay below every operand's width; divisors are nonzero.

``gradient_program(seed)``: two differentiable kernels (the first writes an intermediate vector
field, the second reduces it, with a func returning a vector and matrix algebra in either) run
under ti.ad.Tape, through ``k2.grad(); k1.grad()``, and under ti.ad.FwdMode (the loss's dual along
a random seed); the result carries central differences of the forward pass (``_fd`` for the
gradients, ``_fd_dir`` for the directional derivative) that bench/fuzz_taichi.py checks each
implementation against.
"""
from __future__ import annotations

import random

N = 8


def _fexpr(r: random.Random, leaves: list[str], d: int = 0) -> str:
    """A smooth float expression over ``leaves`` (bounded, no kinks, no division by ~0)."""
    if d >= 2 or r.random() < 0.35:
        return r.choice(leaves)
    a = _fexpr(r, leaves, d + 1)
    b = _fexpr(r, leaves, d + 1)
    return r.choice([f"({a} + {b})", f"({a} - {b})", f"({a} * {b})", f"ti.sin({a})",
                     f"ti.tanh({a}) * 1.5", f"({a}) / (1.0 + ({b}) ** 2)", f"ti.cos({a}) * {b}",
                     f"ti.exp(ti.tanh({a}))", f"ti.sqrt(1.0 + ({a}) ** 2)"])


class _Prog:
    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.seed = seed
        self.setup: list[str] = []  # field definitions and host-side filling
        self.code: list[str] = []  # funcs and kernels
        self.calls: list[str] = []  # launches
        self.outs: list[str] = []  # names of fields whose arrays are returned
        self.fp = "f32"

    def out(self, name: str) -> None:
        self.outs.append(name)

    # ------------------------------------------------------------------------------ snippets
    def func_returns(self, p: str) -> None:
        """ti.func returning a vector, a matrix (transposed on a branch) and a struct."""
        r = self.r
        lv = ["a", "b", "0.5", "1.5"]
        # The vector member holds the default float: Taichi 1.7.4 does not round a local
        # struct's f32 vector member (v=ti.types.vector(2, ti.f32)) to f32 under default_fp=f64
        # (its scalar members it does); difftape does.
        self.setup += [f"    {p}st = ti.types.struct(a=ti.f32, b=ti.i32, v=ti.types.vector(2, "
                       "float))",
                       f"    {p}o = ti.field(ti.f64, shape=(n, 4))",
                       f"    {p}oi = ti.field(ti.i32, shape=n)"]
        self.code += [
            "    @ti.func",
            f"    def {p}fv(a, b):",
            f"        return ti.Vector([{_fexpr(r, lv)}, {_fexpr(r, lv)}, {_fexpr(r, lv)}])",
            "",
            "    @ti.func",
            f"    def {p}fm(a):",
            f"        m = ti.Matrix([[a, 0.5], [{_fexpr(r, ['a', '2.0'])}, 1.0]])",
            f"        if a > {r.choice(['0.0', '0.3', '-0.7'])}:",
            "            m = m.transpose() * 2.0",
            "        return m",
            "",
            "    @ti.func",
            f"    def {p}fs(a, k):",
            f"        return {p}st(a=a * 2.0, b=k * {r.choice([3, -7])} + 1, v=ti.Vector([a, "
            f"{_fexpr(r, ['a', '0.25'])}]))",
            "",
            "    @ti.kernel",
            f"    def {p}k():",
            "        for i in range(n):",
            "            a = src[i]",
            "            b = src2[i]",
            f"            v = {p}fv(a, b)",
            f"            m = {p}fm(b)",
            f"            s = {p}fs(a, i)",
            f"            w = m @ ti.Vector([v[0], v[{r.randrange(3)}]])",
            f"            {p}o[i, 0] = v.sum() + s.a",
            f"            {p}o[i, 1] = w.norm() + {p}fm(a).determinant()",
            f"            {p}o[i, 2] = s.v.dot(w) + {p}fv(b, s.a).max()",
            f"            {p}o[i, 3] = ({p}fm(s.v[1]) @ m).trace()",
            f"            {p}oi[i] = s.b + ti.cast(s.v[0] > 0.0, ti.i32)"]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}o")
        self.out(f"{p}oi")

    def static_funcs(self, p: str) -> None:
        """Nested funcs with template parameters, ti.static if/else and ti.static loops."""
        r = self.r
        k1, k2 = r.randint(0, 3), r.randint(1, 4)
        self.setup += [f"    {p}o = ti.field(ti.f64, shape=n)", f"    {p}oi = ti.field(ti.i32,"
                       " shape=n)"]
        self.code += [
            "    @ti.func",
            f"    def {p}inner(x, K: ti.template()):",
            "        acc = x",
            "        for q in ti.static(range(K)):",
            f"            if ti.static(q % {r.choice([2, 3])} == 0):",
            f"                acc = acc * {r.choice(['0.5', '-0.75', '1.25'])} + q",
            "            else:",
            f"                acc = {r.choice(['ti.sin(acc)', 'acc - ti.cos(acc) * q'])}",
            "        return acc",
            "",
            "    @ti.func",
            f"    def {p}ipow(k, E: ti.template()):",
            "        res = 1",
            "        for _ in ti.static(range(E)):",
            "            res *= k",
            "        if ti.static(E > 2):",
            "            res = res ^ (k << 1)",
            "        return res",
            "",
            "    @ti.func",
            f"    def {p}outer(x, j):",
            f"        s = {p}inner(x, {k1}) + {p}inner(x * 2.0, {k2})",
            "        for t in range(j % 3):",
            f"            s += {p}inner(s * 0.1, 1)",
            "            if s > 5.0:",
            "                break",
            "        return s",
            "",
            "    @ti.kernel",
            f"    def {p}k():",
            "        for i in range(n):",
            f"            {p}o[i] = {p}outer(src[i], i)",
            f"            {p}oi[i] = {p}ipow(isrc[i] % 100, {r.randint(1, 4)})"]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}o")
        self.out(f"{p}oi")

    def matrices(self, p: str) -> None:
        """Inverse, determinant, norm, outer product, polar decomposition and SVD."""
        r = self.r
        d = r.choice([2, 3, 3, 4])
        dt = r.choice(["f32", "f64"])
        ents = ", ".join("[" + ", ".join(f"mi[i, {a * d + b}]" + (" + 3.0" if a == b else "")
                                          for b in range(d)) + "]" for a in range(d))
        self.setup += [f"    mi = ti.field(ti.{dt}, shape=(n, 16))",
                       "    mi.from_numpy(rng.uniform(-0.6, 0.6, (n, 16))"
                       f".astype(np.float{dt[1:]}))",
                       f"    {p}inv = ti.Matrix.field({d}, {d}, ti.{dt}, shape=n)",
                       f"    {p}o = ti.field(ti.{dt}, shape=(n, 6))",
                       f"    {p}pr = ti.Matrix.field({min(d, 3)}, {min(d, 3)}, ti.{dt}, shape=n)",
                       f"    {p}ps = ti.Matrix.field({min(d, 3)}, {min(d, 3)}, ti.{dt}, shape=n)",
                       f"    {p}us = ti.Matrix.field({min(d, 3)}, {min(d, 3)}, ti.{dt}, shape=n)",
                       f"    {p}sv = ti.Vector.field({min(d, 3)}, ti.{dt}, shape=n)"]
        e = min(d, 3)
        diag = [f"ti.abs(D[{q}, {q}])" for q in range(e)]
        sub = ", ".join("[" + ", ".join(f"M[{a}, {b}]" for b in range(e)) + "]" for a in range(e))
        self.code += [
            "    @ti.kernel",
            f"    def {p}k():",
            "        for i in range(n):",
            f"            M = ti.Matrix([{ents}], ti.{dt})",
            f"            v = ti.Vector([{', '.join(f'mi[i, {q}]' for q in range(d))}], ti.{dt})",
            f"            {p}inv[i] = M.inverse() {r.choice(['', '@ M.transpose()', '* 2.0'])}",
            f"            {p}o[i, 0] = M.determinant()",
            f"            {p}o[i, 1] = (M @ v).norm() + v.norm_sqr()",
            f"            {p}o[i, 2] = v.outer_product(M @ v).trace() + M.transpose()[0, {d - 1}]",
            f"            {p}o[i, 3] = (ti.math.inverse(M) @ v).dot(v)",
            f"            {p}o[i, 4] = M.norm() + M.sum() * 0.5 + M.max() - M.min()",
            f"            {p}o[i, 5] = (M @ M.inverse() - ti.Matrix.identity(ti.{dt}, {d})).norm()",
            f"            S = ti.Matrix([{sub}], ti.{dt})",
            "            R, P = ti.polar_decompose(S)",
            f"            {p}pr[i] = R",
            f"            {p}ps[i] = P",
            "            U, D, V = ti.svd(S)",
            f"            {p}us[i] = U @ D @ V.transpose()",
            f"            {p}sv[i] = ti.Vector([{', '.join(diag)}])"]
        self.calls.append(f"    {p}k()")
        for f in ("inv", "o", "pr", "ps", "us"):
            self.out(f"{p}{f}")
        self.outs.append(f"np.sort({p}sv.to_numpy(), axis=1)")

    def atomics(self, p: str) -> None:
        """The old values atomics return, in a serial loop, on fields and on locals."""
        r = self.r
        t = r.choice(["i32", "i64", "u32", "f32", "f64", "u64"])
        isf = t.startswith("f")
        ops = ["add", "sub", "min", "max"] + ([] if isf else ["and", "or", "xor"])
        val = ("ti.cast(src[j] * 4.0, ti.{t})" if isf else
               "ti.cast(isrc[j] % 1000 + 500, ti.{t})").format(t=t)
        body = []
        for q in range(r.randint(2, 4)):
            op = r.choice(ops)
            body += [f"            old = ti.atomic_{op}({p}acc[(j * {q + 1}) % 3], {val})",
                     f"            {p}old[j, {q}] = ti.cast(old, ti.f64)"]
        lop = r.choice(ops)
        self.setup += [f"    {p}acc = ti.field(ti.{t}, shape=3)",
                       f"    {p}old = ti.field(ti.f64, shape=(n, 5))",
                       f"    {p}par = ti.field(ti.{t}, shape=n)"]
        self.code += [
            "    @ti.kernel",
            f"    def {p}k():",
            f"        loc = ti.cast({r.choice([0, 7, 100])}, ti.{t})",
            "        ti.loop_config(serialize=True)",
            "        for j in range(n):",
            *body,
            f"            {p}old[j, 4] = ti.cast(ti.atomic_{lop}(loc, {val}), ti.f64)",
            "        for i in range(n):",
            f"            {p}par[i] = ti.cast({r.choice([1, 50, 600])}, ti.{t})",
            f"            o2 = ti.atomic_{r.choice(ops)}({p}par[i], "
            f"{val.replace('[j]', '[i]')})",
            f"            {p}par[i] += o2"]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}acc")
        self.out(f"{p}old")
        self.out(f"{p}par")

    def selects(self, p: str) -> None:
        """ti.select on scalars of mixed types and elementwise on vectors."""
        r = self.r
        self.setup += [f"    {p}o = ti.field(ti.f64, shape=(n, 5))"]
        self.code += [
            "    @ti.kernel",
            f"    def {p}k():",
            "        for i in range(n):",
            "            v = ti.Vector([src[i], src2[i], -src[i]])",
            "            w = ti.Vector([isrc[i] % 5, 2, -3])",
            f"            sv = ti.select(v > {r.choice(['0.0', '0.5'])}, v, w)",
            f"            sw = ti.select(w {r.choice(['<', '>='])} 0, w * 2, v)",
            f"            {p}o[i, 0] = sv.sum() + sw.sum()",
            f"            {p}o[i, 1] = ti.select(isrc[i] & {r.choice([1, 2])}, "
            f"{r.choice(['1', '-2'])}, {r.choice(['2.5', 'src[i]'])})",
            f"            {p}o[i, 2] = ti.select(src[i] > src2[i], ti.u32(3), -1)",
            f"            {p}o[i, 3] = ti.select(ti.Vector([1, 0, 1]), v, sv).dot(w)",
            f"            {p}o[i, 4] = ti.select(src[i] < 0, ti.i8(-5), ti.u8(250))"]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}o")

    def unsigned(self, p: str) -> None:
        """Unsigned wrap-around, logical shifts, division and casts between widths. (ti.max
        of two u8 or u16 values aborts Taichi 1.7.4's process: one operand is u32.)"""
        r = self.r
        ts = ["u8", "u16", "u32", "u64"]
        lines = []
        for q in range(4):
            a, b = r.sample(["ua[i]", "ub[i]", "uc[i]", "ud[i]", "ua[(i + 1) % n]"], 2)
            t = r.choice(ts)
            e = r.choice([f"{a} + {b}", f"{a} - {b}", f"{a} * {b}", f"{a} // ({b} | 1)",
                          f"{a} % ({b} | 1)", f"{a} << ({b} & 7)", f"{a} >> ({b} & 7)",
                          f"~{a}", f"{a} ^ {b}", f"-{a}", f"ti.max(ti.cast({a}, ti.u32), {b})",
                          f"{a} - {r.choice([1, 200, 70000])}", f"{a} * 3 + {b}",
                          f"ti.cast({a}, ti.{t}) - ti.cast({b}, ti.{t})",
                          f"ti.cast({a} < {b}, ti.u8) - ti.u8(1)", f"ti.abs({a} - {b})",
                          f"ti.cast(ti.cast({a}, ti.{t}) * ti.cast({b}, ti.{t}), ti.u64)",
                          f"{a} >> ti.cast({b} & 7, ti.u8)", f"ti.cast({a}, ti.f32) * 0.5"])
            lines.append(f"            {p}o[i, {q}] = ti.cast({e}, ti.{r.choice(['i64', 'u64'])})")
        self.setup += [
            "    ua = ti.field(ti.u8, shape=n)", "    ub = ti.field(ti.u16, shape=n)",
            "    uc = ti.field(ti.u32, shape=n)", "    ud = ti.field(ti.u64, shape=n)",
            "    ua.from_numpy(rng.integers(0, 256, n).astype(np.uint8))",
            "    ub.from_numpy(rng.integers(0, 65536, n).astype(np.uint16))",
            "    uc.from_numpy(rng.integers(0, 2**32, n).astype(np.uint32))",
            "    ud.from_numpy(rng.integers(0, 2**63, n).astype(np.uint64) * np.uint64(2) + "
            "np.uint64(1))",
            f"    {p}o = ti.field(ti.i64, shape=(n, 4))",
            f"    {p}w = ti.field(ti.{r.choice(ts)}, shape=n)"]
        w = r.choice(["ua[i] + ub[i]", "uc[i] * 7", "ud[i] - uc[i]", "ua[i] * ua[i]", "~ua[i]"])
        self.code += ["    @ti.kernel", f"    def {p}k():", "        for i in range(n):", *lines,
                      f"            {p}w[i] = {w}",
                      f"            {p}w[i] += {r.choice(['250', '65535', '1', 'ua[i]'])}"]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}o")
        self.out(f"{p}w")

    def promotion(self, p: str) -> None:
        """Binary operations on every pair of scalar types (and with literals): the result type
        each implementation picks shows in the stored value (wrap-around, signedness of a
        comparison, float vs integer division)."""
        r = self.r
        ints = ["i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64"]
        floats = ["f16", "f32", "f64"]
        lines = []
        for q in range(6):
            ta, tb = r.choice(ints + floats), r.choice(ints + floats + ["lit"])
            # integers come from i32 (an int-to-int cast wraps, as defined; a float out of
            # an integer type's range converts to different values in the two)
            def val(t: str) -> str:
                v = f"pv[i, {r.randrange(4)}]"
                return f"ti.cast({v}, ti.{t})" if t in floats else \
                    f"ti.cast(ti.cast({v}, ti.i32), ti.{t})"
            a = val(ta)
            b = str(r.choice([-1, 3, 300, 70000, -5, 2.5, -0.75])) if tb == "lit" else val(tb)
            isint = ta in ints and (tb in ints or (tb == "lit" and "." not in b))
            ops = ["+", "-", "*", "<", ">=", "==", "/"] + (["&", "|", "^"] if isint else [])
            op = r.choice(ops + ["//", "%"])
            if op in ("//", "%"):  # a divisor that is never 0 in any of the types
                b = "3" if tb == "lit" else f"((({b}) & 3) + 1)" if isint else "1.75"
            e = f"({a} {op} {b})"
            small = ("i8", "i16", "u8", "u16")
            if r.random() < 0.3 and not (ta in small and tb in small + ("lit",)):
                # (ti.min/ti.max of two 8- or 16-bit integers aborts Taichi 1.7.4's process)
                e = f"ti.{r.choice(['max', 'min'])}({a}, {b})"
            lines.append(f"            {p}o[i, {q}] = ti.cast({e}, ti.f64)")
        self.setup += [f"    {p}o = ti.field(ti.f64, shape=(n, 6))",
                       "    pv = ti.field(ti.f64, shape=(n, 4))",
                       "    pv.from_numpy(np.round(rng.uniform(-300, 300, (n, 4))) + "
                       "rng.choice([0.0, 0.25, 0.5], (n, 4)))"]
        self.code += ["    @ti.kernel", f"    def {p}k():", "        for i in range(n):", *lines]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}o")

    def half(self, p: str) -> None:
        """f16 fields: stored at half precision, read back and mixed with f32/f64."""
        r = self.r
        self.setup += [f"    {p}h = ti.field(ti.f16, shape=n)", f"    {p}o = ti.field(ti.f32,"
                       " shape=n)"]
        self.code += [
            "    @ti.kernel",
            f"    def {p}k():",
            "        for i in range(n):",
            f"            {p}h[i] = ti.cast(src[i] * {r.choice(['1.0', '100.0', '3000.0'])}, "
            "ti.f16)",
            f"            {p}h[i] += ti.cast(src2[i], ti.f16)",
            f"            {p}o[i] = ti.cast({p}h[i], ti.f32) * 0.5 + ti.sin({p}h[i])"]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}h")
        self.out(f"{p}o")

    def ranges(self, p: str) -> None:
        """ndrange with negative and empty bounds, grouped loops, a 2-D offset field."""
        r = self.r
        a0, a1 = r.choice([(-2, 3), (0, 4), (1, 1), (3, 1), (-4, -1)])
        b0, b1 = r.choice([(1, 4), (-3, 0), (0, 2)])
        o0, o1 = r.choice([(-3, 2), (0, -1), (-5, -5)])
        self.setup += [f"    {p}f = ti.field(ti.i32, shape=(6, 5), offset=({o0}, {o1}))",
                       f"    {p}c = ti.field(ti.i32, shape=4)",
                       f"    {p}g = ti.field(ti.i32, shape=(8, 8))"]
        self.code += [
            "    @ti.kernel",
            f"    def {p}k():",
            f"        for I in ti.grouped({p}f):",
            f"            {p}f[I] = I[0] * 10 + I[1]",
            f"        for i, j in ti.ndrange(({a0}, {a1}), ({b0}, {b1})):",
            f"            {p}g[i + 4, j + 4] += i * 3 - j",
            f"            ti.atomic_add({p}c[0], 1)",
            f"        for I in ti.grouped(ti.ndrange({r.choice(['3', '(1, 4)', '(-2, 0)'])}, "
            f"({b0}, {b1}))):",
            f"            {p}g[I + 3] += I.sum() * 100",
            f"            ti.atomic_add({p}c[1], 1)",
            f"        for i, j in {p}f:",
            f"            if (i + j) % {r.choice([2, 3])} == 0:",
            f"                ti.atomic_add({p}c[2], {p}f[i, j])",
            f"        for i in range({r.choice(['-3', '2'])}, {r.choice(['1', '5', '-4'])}):",
            f"            ti.atomic_add({p}c[3], i * i + 1)"]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}f")
        self.out(f"{p}c")
        self.out(f"{p}g")

    def sparse(self, p: str) -> None:
        """Pointer and bitmasked SNodes: activate, deactivate, struct-for, is_active; dynamic
        SNodes: append's return value, length, deactivate_all."""
        r = self.r
        kind = r.choice(["pointer", "bitmasked"])
        inner = r.choice(["dense", "bitmasked", "pointer"])
        # Only pointer cells are deactivated: Taichi 1.7.4 leaves a deactivated bitmasked
        # cell's old value readable (README: difftape reads 0, as Taichi documents), and the
        # cells of a dense SNode cannot be deactivated (difftape refuses, Taichi ignores it).
        deacts = ([f"ti.deactivate({p}blk, [i // 4])"] if kind == "pointer" else []) + (
            [f"ti.deactivate({p}x.snode.parent(), [i])"] if inner == "pointer" else [])
        if not deacts:
            kind = "pointer"
            deacts = [f"ti.deactivate({p}blk, [i // 4])"]
        deact = r.choice(deacts)
        cond = r.choice(["x[i] % 3 == 0", "i % 5 == 1", "x[i] > 20"])
        self.setup += [
            f"    {p}x = ti.field(ti.i32)",
            f"    {p}blk = ti.root.{kind}(ti.i, 4)",
            f"    {p}blk.{inner}(ti.i, 4).place({p}x)",
            f"    {p}d = ti.field(ti.i32)",
            f"    ti.root.dynamic(ti.i, 32, chunk_size={r.choice([2, 4, 8])}).place({p}d)",
            f"    {p}o = ti.field(ti.i32, shape=(4, 16))",
            f"    {p}c = ti.field(ti.i32, shape=8)",
            f"    for q in sorted(rng.permutation(16)[: {r.randint(3, 12)}]):",
            f"        {p}x[int(q)] = int(q) * 3 + 1"]
        self.code += [
            "    @ti.kernel",
            f"    def {p}k1():",
            f"        for i in {p}x:",
            f"            {p}o[0, i] = {p}x[i]",
            f"            ti.atomic_add({p}c[0], 1)",
            "        for i in range(16):",
            f"            {p}o[1, i] = ti.cast(ti.is_active({p}blk, [i // 4]), ti.i32)",
            "",
            "    @ti.kernel",
            f"    def {p}k2():",
            f"        for i in {p}x:",
            f"            if {cond.replace('x[', p + 'x[')}:",
            f"                {deact}",
            "",
            "    @ti.kernel",
            f"    def {p}k3():",
            f"        for i in {p}x:",
            f"            {p}o[2, i] = {p}x[i] + 1000",
            f"            ti.atomic_add({p}c[1], 1)",
            "        for i in range(16):",
            f"            {p}o[3, i] = ti.cast(ti.is_active({p}blk, [i // 4]), ti.i32) * 10"
            f" + {p}x[i]",
            "        ti.loop_config(serialize=True)",
            "        for i in range(12):",
            f"            if i % {r.choice([2, 3])} != 0:",
            f"                {p}c[2] += ti.append({p}d.parent(), [], i * 7) * 100",
            f"        {p}c[3] = ti.length({p}d.parent(), [])",
            "",
            "    @ti.kernel",
            f"    def {p}k4():",
            f"        {p}c[4] = ti.length({p}d.parent(), [])",
            f"        for i in {p}x:",
            f"            ti.atomic_add({p}c[5], {p}x[i] + 1)",
            f"        for j in {p}d:",
            f"            ti.atomic_add({p}c[6], {p}d[j])"]
        self.calls += [f"    {p}k1()", f"    {p}k2()", f"    {p}k3()",
                       f"    {p}x[{r.randrange(16)}] = 5",
                       f"    {p}d.parent().deactivate_all()" if r.random() < 0.5 else
                       f"    {p}d[{r.randrange(3)}] = 9",
                       f"    {p}k4()"]
        self.out(f"{p}o")
        self.out(f"{p}c")
        self.out(f"{p}x")

    def math_edges(self, p: str) -> None:
        """ti.math at the edges of the domains, on f32 and f64."""
        r = self.r
        dt = r.choice(["f32", "f64"])
        fns = ["ti.sqrt(ti.abs(x))", "ti.exp(x)", "ti.log(ti.abs(x))", "ti.asin(ti.math.clamp(x,"
               " -1.0, 1.0))", "ti.acos(ti.math.clamp(x, -1.0, 1.0))", "ti.atan2(x, y)",
               "ti.atan2(y, x)", "ti.floor(x)", "ti.ceil(x)", "ti.round(x)", "ti.math.fract(x)",
               "ti.math.sign(x)", "ti.math.step(y, x)", "ti.math.smoothstep(-1.0, 1.0, x)",
               "ti.math.log2(ti.abs(x))", "ti.math.mod(x, y)", "ti.pow(x, 2.0)",
               "ti.pow(ti.abs(x), 0.5)", "ti.pow(x, 3)", "x ** -1", "ti.tan(x)", "ti.sin(x)",
               "ti.cos(x)", "ti.tanh(x)", "ti.math.degrees(x)", "ti.cast(ti.math.isnan(x / y), "
               "ti.f32)", "ti.cast(ti.math.isinf(x * y), ti.f32)", "ti.math.clamp(x, y, 1.0)",
               "x % y", "x // y", "ti.math.mix(x, y, 0.3)", "ti.abs(x)", "ti.max(x, y)",
               "ti.min(x, -y)", "ti.cast(ti.cast(ti.math.clamp(x, -1e9, 1e9), ti.i32), ti.f64)",
               "ti.math.length(ti.Vector([x, y]))", "ti.math.normalize(ti.Vector([x, 1.0]))[0]"]
        picked = r.sample(fns, 8)
        vals = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, -2.5, 2.5, 1e-30, -1e-30, 88.0, 89.0,
                -100.0, 710.0, 1e30, -1e30, 1e5, 3.14159265, 1e-7, 0.49999997, 123456.5]
        self.setup += [f"    {p}x = ti.field(ti.{dt}, shape={len(vals)})",
                       f"    {p}x.from_numpy(np.array({vals!r}, dtype=np.float{dt[1:]}))",
                       f"    {p}o = ti.field(ti.{dt}, shape=({len(vals)}, {len(picked)}))"]
        body = [f"            {p}o[i, {q}] = {f}" for q, f in enumerate(picked)]
        self.code += ["    @ti.kernel", f"    def {p}k():", f"        for i in range({len(vals)}):",
                      f"            x = {p}x[i]", f"            y = {p}x[({len(vals)} - 1 - i)]",
                      *body]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}o")


SNIPPETS = ["func_returns", "static_funcs", "matrices", "atomics", "selects", "unsigned", "half",
            "ranges", "sparse", "math_edges", "promotion"]


def program(seed: int, only: list[str] | None = None) -> str:
    """The source of one random program built from 2-4 snippets (``only``: these snippets)."""
    g = _Prog(seed)
    r = g.r
    g.fp = r.choice(["f32", "f64"])
    ip = r.choice(["i32", "i32", "i64"])
    picks = only or r.sample(SNIPPETS, r.randint(2, 4))
    for q, name in enumerate(picks):
        getattr(g, name)(f"s{q}_")
    lines = [*primal_header(g.fp, ip, seed, f32_source=True), *g.setup, "", *g.code, "",
             *g.calls, *result_lines(g.outs, lambda o: o.startswith("np."))]
    return "\n".join(lines)


def primal_header(fp: str, ip: str, seed: int, *, f32_source: bool) -> list[str]:
    """The first lines of a primal program: ``run(ti, hook)``, ``ti.init``, ``n`` and the
    random source fields ``src`` (of ``fp``), ``src2`` (f32, with ``f32_source``), ``isrc``."""
    two = f32_source
    return ["import numpy as np", "", "", "def run(ti, hook=None):",
            f"    ti.init(arch=ti.cpu, default_fp=ti.{fp}, default_ip=ti.{ip}, fast_math=False,"
            " random_seed=1)",
            f"    n = {N}",
            f"    rng = np.random.default_rng({seed})",
            f"    src = ti.field(ti.{fp}, shape=n)",
            *(["    src2 = ti.field(ti.f32, shape=n)"] if two else []),
            "    isrc = ti.field(ti.i32, shape=n)",
            f"    src.from_numpy(rng.uniform(-2, 2, n).astype(np.float{fp[1:]}))",
            *(["    src2.from_numpy(rng.uniform(-2, 2, n).astype(np.float32))"] if two else []),
            "    isrc.from_numpy(rng.integers(-10**6, 10**6, n).astype(np.int32))"]


def result_lines(outs: list[str], is_array) -> list[str]:
    """The program's last lines: ``res`` of every output, as NumPy (``is_array(o)``: ``o``
    already is one; else a field read back with ``to_numpy``)."""
    return ["    res = {}",
            *[f"    res['{q}'] = {o if is_array(o) else o + '.to_numpy()'}"
              for q, o in enumerate(outs)],
            "    return res", ""]


# ------------------------------------------------------------------------------ gradients

def gradient_program(seed: int) -> str:
    """Two kernels under Tape, kernel.grad() in reverse order, and FwdMode (see the module
    docstring); ``run(ti)`` returns the loss, both gradients, the FwdMode dual and the central
    differences of each implementation's own forward pass."""
    r = random.Random(seed)
    lv = ["x[i]", "y[i]", "x[(i + 1) % n]", "0.5", "a", "b"]
    d = r.choice([2, 3])
    mat = ", ".join("[" + ", ".join(
        (f"{_fexpr(r, ['a', 'b', '0.7'])} * 0.2" + (" + 2.0" if p == q else "")) for q in range(d))
        + "]" for p in range(d))
    vec = ", ".join(_fexpr(r, ["a", "b", "x[i]"]) for _ in range(d))
    red = r.choice(["(M.inverse() @ v).sum()", "M.determinant() * v.norm()",
                    "v.outer_product(M @ v).trace() * 0.1", "(M.transpose() @ M @ v).dot(v) * 0.1",
                    "v.norm_sqr() + M.inverse().determinant()", "ti.math.inverse(M)[0, 1] + v[0]"])
    fparts = [_fexpr(r, ["p", "q", "0.5"]) for _ in range(d)]
    tail = []
    for _ in range(r.randint(0, 2)):
        c = r.randrange(3)
        if c == 0:
            tail += ["        for j in ti.static(range(2)):",
                     f"            zz[j] = zz[j] * 0.5 + {_fexpr(r, lv)}"]
        elif c == 1:
            # A scalar carries the serial loop: Taichi 1.7.4 aborts (an assertion in its
            # UnaryOpStmt) on reverse mode through a local vector element written in one.
            c0 = r.randrange(d)
            tail += [f"        c = zz[{c0}]",
                     "        for j in range(3):",
                     f"            c = ti.sin(c) + {_fexpr(r, lv)} * 0.3",
                     f"        zz[{c0}] = c"]
        else:
            tail += [f"        if y[i] > {r.choice(['0.0', '0.4'])}:",
                     f"            zz = zz * {_fexpr(r, lv)}",
                     "        else:",
                     f"            zz += fv(a, {_fexpr(r, lv)})"]
    lines = [
        "import numpy as np", "", "", "def run(ti, hook=None):",
        "    ti.init(arch=ti.cpu, default_fp=ti.f64, fast_math=False)",
        "    n = 5",
        f"    rng = np.random.default_rng({seed})",
        "    x = ti.field(ti.f64, shape=n, needs_grad=True, needs_dual=True)",
        "    y = ti.field(ti.f64, shape=n, needs_grad=True, needs_dual=True)",
        f"    z = ti.Vector.field({d}, ti.f64, shape=n, needs_grad=True, needs_dual=True)",
        "    loss = ti.field(ti.f64, shape=(), needs_grad=True, needs_dual=True)",
        "    xv = rng.uniform(-1.2, 1.2, n)",
        "    yv = (rng.integers(-5, 5, n) * 0.2 + 0.1) + rng.uniform(-0.03, 0.03, n)",
        "    sv = rng.uniform(-1, 1, n)",
        "",
        "    @ti.func",
        "    def fv(p, q):",
        f"        return ti.Vector([{', '.join(fparts)}])",
        "",
        "    @ti.func",
        "    def fm(a, b):",
        f"        M = ti.Matrix([{mat}])",
        "        return M",
        "",
        "    @ti.kernel",
        "    def k1():",
        "        for i in range(n):",
        "            a = x[i]",
        f"            b = {_fexpr(r, lv[:3])}",
        "            zz = fv(a, b)",
        *["    " + t for t in tail],
        "            z[i] = zz",
        "",
        "    @ti.kernel",
        "    def k2():",
        "        for i in range(n):",
        "            a = z[i][0]",
        f"            b = z[i][{d - 1}] + x[i]",
        "            M = fm(a, b)",
        f"            v = ti.Vector([{vec}])",
        f"            loss[None] += {red} * {r.choice(['1.0', '0.5', 'y[i]'])}",
        "",
        "    def forward(xa, ya):",
        "        x.from_numpy(xa)",
        "        y.from_numpy(ya)",
        "        loss[None] = 0.0",
        "        k1()",
        "        k2()",
        "        return loss[None]",
        "",
        "    value = forward(xv, yv)",
        "    with ti.ad.Tape(loss):",
        "        k1()",
        "        k2()",
        "    tape = [x.grad.to_numpy(), y.grad.to_numpy()]",
        "    forward(xv, yv)",
        "    for g in (x.grad, y.grad, z.grad):",
        "        g.fill(0.0)",
        "    loss.grad[None] = 1.0",
        "    k2.grad()",
        "    k1.grad()",
        "    manual = [x.grad.to_numpy(), y.grad.to_numpy()]",
        "    x.from_numpy(xv)",
        "    y.from_numpy(yv)",
        "    loss[None] = 0.0",
        f"    param = {r.choice(['x', 'y'])}",
        "    try:  # Taichi 1.7.4 aborts forward mode through most local vector arithmetic",
        "        with ti.ad.FwdMode(loss=loss, param=param, seed=[float(s) for s in sv]):",
        "            k1()",
        "            k2()",
        "        dual = {'dual': np.array([loss.dual[None]])}",
        "    except Exception as e:  # noqa: BLE001 - compared as a missing 'dual'",
        "        dual = {'_dual_error': repr(e)[:200]}",
        "    fd = []",
        "    base = [xv, yv]",
        "    h = 1e-6",
        "    for a in range(2):",
        "        col = np.zeros(n)",
        "        for q in range(n):",
        "            up = [b.copy() for b in base]",
        "            dn = [b.copy() for b in base]",
        "            up[a][q] += h",
        "            dn[a][q] -= h",
        "            col[q] = (forward(*up) - forward(*dn)) / (2 * h)",
        "        fd.append(col)",
        "    k = 0 if param is x else 1",
        "    up = [b.copy() for b in base]",
        "    dn = [b.copy() for b in base]",
        "    up[k] += h * sv",
        "    dn[k] -= h * sv",
        "    fd_dir = (forward(*up) - forward(*dn)) / (2 * h)",
        "    return {'loss': np.array([value]), 'tape': np.concatenate(tape),",
        "            'grad': np.concatenate(manual), '_fd': np.concatenate(fd),",
        "            '_fd_dir': np.array([fd_dir]), **dual}",
        ""]
    return "\n".join(lines)
