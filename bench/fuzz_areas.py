"""Random programs over the areas neither bench/fuzz_gen.py nor bench/fuzz_features.py reaches
(bench/fuzz_taichi.py ``--kind areas`` and ``--kind areas_gradient``).

Gradient programs (``gradient_program(seed)``): two to four snippets, each its own kernels that
read the inputs and add into one loss, run under ti.ad.Tape and through ``kernel.grad()`` in
reverse launch order (and, for half the seeds, ti.ad.FwdMode along a random seed of x, which
Taichi 1.7.4 mostly refuses); ``run(ti)`` returns the loss, both gradients and the central
differences of the implementation's own forward pass (``_fd``, ``_fd_dir``), which
bench/fuzz_taichi.py checks:

- sparse intermediates with needs_grad: a pointer or bitmasked SNode (and dynamic) written by one
  kernel (a fixed activation pattern) and reduced by a struct-for in the next, or read cell by
  cell, inactive ones too (Taichi 1.7.4 cannot differentiate a kernel calling ti.is_active or
  ti.length);
- ti.ndarray arguments with needs_grad (an input ndarray and an intermediate one);
- ti.types.struct / ti.Struct.field intermediates written whole from a func returning a struct;
- ti.math vector functions: normalize, cross, reflect, smoothstep, clamp, mix, length, distance;
- matrix fields written by ``ti.grouped`` loops and read by ndrange loops;
- ``ti.loop_config(serialize=True)`` recurrences through a field, block_dim;
- ti.static loops over Python lists of fields.

Primal programs (``program(seed)``): ti.bit_cast between floats and integers, casts across every
integer width and to and from floats, shifts by every amount below the width, wrap-around of
+ - * in every integer type, parallel atomics of every kind on fields of every type (values for
which the order does not matter), ``fill``/``copy_from``/``to_numpy``/``from_numpy`` on struct,
matrix and offset fields, ti.static loops over lists of fields, serialized loops whose result
depends on the order (running sums, while loops with break and continue).
"""
from __future__ import annotations

import random
import re

from fuzz_features import _fexpr, _Prog, primal_header, result_lines
from fuzz_gen import central_differences

INTS = ["i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64"]
BITS = {"i8": 8, "i16": 16, "i32": 32, "i64": 64, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
        "f16": 16, "f32": 32, "f64": 64}


class _Grad:
    """One gradient program under construction: inputs, fields, kernels and their launches."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.setup: list[str] = []
        self.code: list[str] = []
        self.launches: list[str] = []  # kernel calls, in order ("k()" or "k(a, b)")
        self.inputs: list[tuple[str, str]] = [("x", "field"), ("y", "field")]
        self.grads: list[str] = []  # intermediate fields and ndarrays whose .grad is zeroed
        self.leaves = ["x[i]", "y[i]", "x[(i + 1) % n]", "0.5"]

    def e(self, leaves: list[str] | None = None) -> str:
        return _fexpr(self.r, leaves or self.leaves)

    def kernel(self, name: str, body: list[str], args: str = "") -> None:
        self.code += ["    @ti.kernel", f"    def {name}({args}):", *body, ""]

    # ------------------------------------------------------------------------------ snippets
    def sparse(self, p: str) -> None:
        r = self.r
        kind = r.choice(["pointer", "bitmasked"])
        inner = r.choice(["dense", "bitmasked"])
        cond = r.choice(["i % 3 != 1", "i < 5", "i // 4 == 1", "i % 2 == 0"])
        self.setup += [f"    {p}s = ti.field(ti.f64, needs_grad=True)",
                       f"    {p}blk = ti.root.{kind}(ti.i, 2)",
                       f"    {p}blk.{inner}(ti.i, 4).place({p}s, {p}s.grad)"]
        use_dyn = r.random() < 0.5
        if use_dyn:
            self.setup += [f"    {p}d = ti.field(ti.f64, needs_grad=True)",
                           f"    ti.root.dynamic(ti.i, 16, chunk_size={r.choice([2, 4])})"
                           f".place({p}d, {p}d.grad)"]
        self.grads.append(f"{p}s")
        body = ["        for i in range(n):", f"            if {cond}:",
                f"                {p}s[i] = {self.e()}"]
        if use_dyn:
            self.grads.append(f"{p}d")
            body += ["        for i in range(n):", f"            {p}d[i] = {self.e()}"]
        self.kernel(f"{p}k1", body)
        red = r.choice([f"{p}s[i] * {p}s[i]", f"ti.sin({p}s[i]) * x[i]", f"{p}s[i] * y[i]",
                        f"ti.exp(ti.tanh({p}s[i]))"])
        body = [f"        for i in {p}s:", f"            loss[None] += {red}"]
        if r.random() < 0.5:  # every cell, inactive ones (read as 0) too
            body += ["        for i in range(n):",
                     f"            loss[None] += {p}s[i] * {r.choice(['0.5', 'y[i]'])}"]
        if use_dyn:
            body += [f"        for j in {p}d:",
                     f"            loss[None] += {p}d[j] * ti.cast(j + 1, ti.f64) * 0.1"]
        self.kernel(f"{p}k2", body)
        self.launches += [f"{p}k1()", f"{p}k2()"]

    def ndarray(self, p: str) -> None:
        r = self.r
        vec = r.random() < 0.5
        self.setup += [f"    {p}a = ti.ndarray(ti.f64, shape=n, needs_grad=True)",
                       f"    {p}av = rng.uniform(-1, 1, n)"]
        self.inputs.append((f"{p}a", "ndarray"))
        if vec:
            self.setup.append(f"    {p}b = ti.ndarray(ti.types.vector(2, ti.f64), shape=n, "
                              "needs_grad=True)")
            store = [f"            b[i] = ti.Vector([{self.e(['a[i]', 'x[i]', '0.5'])}, "
                     f"{self.e(['a[i]', 'y[i]'])}])"]
            use = r.choice(["b[i].norm()", "b[i][0] * b[i][1]", "b[i].dot(ti.Vector([x[i], 1.0]))"])
        else:
            self.setup.append(f"    {p}b = ti.ndarray(ti.f64, shape=n, needs_grad=True)")
            store = [f"            b[i] = {self.e(['a[i]', 'x[i]', 'y[i]', '0.5'])}"]
            use = r.choice(["b[i] * b[i]", "ti.sin(b[i]) * y[i]", "b[i] * a[(i + 1) % n]"])
        self.grads.append(f"{p}b")
        self.kernel(f"{p}k1", ["        for i in range(n):", *store],
                    "a: ti.types.ndarray(), b: ti.types.ndarray()")
        self.kernel(f"{p}k2", ["        for i in range(n):", f"            loss[None] += {use}"],
                    "a: ti.types.ndarray(), b: ti.types.ndarray()")
        self.launches += [f"{p}k1({p}a, {p}b)", f"{p}k2({p}a, {p}b)"]

    def struct(self, p: str) -> None:
        r = self.r
        if r.random() < 0.5:
            self.setup += [f"    {p}st = ti.types.struct(a=ti.f64, v=ti.types.vector(2, ti.f64))",
                           f"    {p}sf = {p}st.field(shape=n, needs_grad=True)"]
            mk = f"{p}st"
        else:
            self.setup += [f"    {p}sf = ti.Struct.field({{'a': ti.f64, 'v': ti.types.vector(2,"
                           f" ti.f64)}}, shape=n, needs_grad=True)",
                           f"    {p}st = ti.types.struct(a=ti.f64, v=ti.types.vector(2, ti.f64))"]
            mk = f"{p}st"
        self.grads.append(f"{p}sf")
        lv = ["p", "q", "0.5"]
        self.code += ["    @ti.func", f"    def {p}mk(p, q):",
                      f"        return {mk}(a={_fexpr(r, lv)}, v=ti.Vector([{_fexpr(r, lv)}, "
                      f"{_fexpr(r, lv)}]))", ""]
        how = r.choice(["whole", "members", "local"])
        if how == "whole":
            store = [f"            {p}sf[i] = {p}mk(x[i], y[i])"]
        elif how == "members":
            store = [f"            s = {p}mk(x[i], y[i])", f"            {p}sf[i].a = s.a",
                     f"            {p}sf.v[i] = s.v"]
        else:
            store = [f"            s = {p}mk(x[i], y[i])", "            s.a = s.a * s.v[1]",
                     f"            {p}sf[i] = s"]
        self.kernel(f"{p}k1", ["        for i in range(n):", *store])
        use = r.choice([f"{p}sf[i].a * {p}sf[i].v[0]", f"{p}sf[i].v.norm_sqr() + {p}sf.a[i]",
                        f"ti.sin({p}sf[i].a) + {p}sf[i].v.dot(ti.Vector([x[i], y[i]]))"])
        self.kernel(f"{p}k2", ["        for i in range(n):", f"            loss[None] += {use}"])
        self.launches += [f"{p}k1()", f"{p}k2()"]

    def mathvec(self, p: str) -> None:
        r = self.r
        terms = ["ti.math.normalize(u).dot(w)", "ti.math.cross(u, w).norm()",
                 "ti.math.cross(u, w)[1]", "ti.math.reflect(u, ti.math.normalize(w)).sum()",
                 "ti.math.smoothstep(-0.4, 0.6, y[i])", "ti.math.smoothstep(-1.0, 1.0, u)[0]",
                 "ti.math.clamp(y[i], -0.4, 0.4) * x[i]",
                 "ti.math.clamp(ti.Vector([x[i], y[i]]), -0.6, 0.6).sum()",
                 "ti.math.mix(u, w, 0.3).dot(u)", "ti.math.mix(x[i], y[i], x[i])",
                 "ti.math.length(u - w)", "ti.math.distance(u, w)", "ti.math.dot(u, w)",
                 "ti.math.normalize(ti.math.cross(u, w)).sum()", "ti.math.fract(x[i] * 0.5 + 10.5)",
                 "ti.math.log2(1.5 + x[i])", "ti.math.sign(y[i]) * x[i]"]
        picked = r.sample(terms, 3)
        # y is kept 0.07 away from multiples of 0.2 (see the inputs), so the clamps' kinks
        # (-0.4, 0.4 on y) are outside the finite differences' stencil. clamp(u) on x: x is
        # kept 0.05 away from +-0.6 too.
        self.kernel(f"{p}k", [
            "        for i in range(n):",
            f"            u = ti.Vector([x[i], y[i], {self.e()}])",
            f"            w = ti.Vector([{self.e()}, 1.0 + y[i] * 0.3, x[i] * x[i] + 0.5])",
            f"            loss[None] += {' + '.join(picked)}"])
        self.launches.append(f"{p}k()")

    def matfield(self, p: str) -> None:
        r = self.r
        off = r.choice(["", ", offset=(-2, 1)"])
        o0, o1 = (-2, 1) if off else (0, 0)
        self.setup.append(f"    {p}m = ti.Matrix.field(2, 2, ti.f64, shape=(n, 2), "
                          f"needs_grad=True{off})")
        self.grads.append(f"{p}m")
        lv = ["x[k]", "y[k]", "0.5", "c"]
        ent = [[self.e(lv), self.e(lv)], [self.e(lv), self.e(lv)]]
        loop = r.choice([f"        for I in ti.grouped({p}m):",
                         f"        for I in ti.grouped(ti.ndrange(({o0}, {o0} + n), ({o1}, "
                         f"{o1} + 2))):"])
        self.kernel(f"{p}k1", [
            loop, f"            k = I[0] - ({o0})",
            f"            c = ti.cast(I[1] - ({o1}), ti.f64) + 1.0",
            f"            {p}m[I] = ti.Matrix([[{ent[0][0]}, {ent[0][1]}], [{ent[1][0]}, "
            f"{ent[1][1]}]])"])
        use = r.choice([f"({p}m[i, j] @ {p}m[i, j]).trace()", f"{p}m[i, j].determinant()",
                        f"({p}m[i, j].transpose() @ ti.Vector([x[i - ({o0})], 1.0])).sum()",
                        f"{p}m[i, j].norm()", f"{p}m[i, j][j - ({o1}), 0] * y[i - ({o0})]"])
        self.kernel(f"{p}k2", [f"        for i, j in ti.ndrange(({o0}, {o0} + n), ({o1}, "
                               f"{o1} + 2)):", f"            loss[None] += {use}"])
        self.launches += [f"{p}k1()", f"{p}k2()"]

    def serial(self, p: str) -> None:
        r = self.r
        self.setup.append(f"    {p}c = ti.field(ti.f64, shape=n, needs_grad=True)")
        self.grads.append(f"{p}c")
        cfg = r.choice(["ti.loop_config(serialize=True)", "ti.loop_config(block_dim=16)",
                        "ti.loop_config(parallelize=2)", "ti.loop_config(serialize=True)"])
        self.kernel(f"{p}k1", ["        for i in range(n):", f"            {p}c[i] = {self.e()}"])
        body = [f"        {cfg}", "        for i in range(n):"]
        if "serialize" in cfg:
            # a recurrence through the field: each element read after it is final
            body += ["            if i > 0:",
                     f"                loss[None] += {p}c[i - 1] * {r.choice(['0.5', 'x[i]'])}",
                     f"            loss[None] += ti.sin({p}c[i])"]
        else:
            body += [f"            loss[None] += {p}c[i] * {self.e()}"]
        self.kernel(f"{p}k2", body)
        self.launches += [f"{p}k1()", f"{p}k2()"]

    def staticlist(self, p: str) -> None:
        r = self.r
        self.setup += [f"    {p}f{q} = ti.field(ti.f64, shape=n, needs_grad=True)" for q in
                       range(3)]
        self.grads += [f"{p}f{q}" for q in range(3)]
        fl = f"[{p}f0, {p}f1, {p}f2]"
        self.kernel(f"{p}k1", [
            "        for i in range(n):",
            f"            for q, f in ti.static(enumerate({fl})):",
            f"                f[i] = {self.e(self.leaves + ['ti.cast(q, ti.f64)'])}"])
        self.kernel(f"{p}k2", [
            "        for i in range(n):",
            f"            for f in ti.static({fl}{r.choice(['', '[1:]', '[::-1]'])}):",
            f"                loss[None] += f[i] * {r.choice(['f[i]', 'x[i]', '0.3'])}"])
        self.launches += [f"{p}k1()", f"{p}k2()"]


GRAD_SNIPPETS = ["sparse", "ndarray", "struct", "mathvec", "matfield", "serial", "staticlist"]


def gradient_program(seed: int, only: list[str] | None = None, fwd: bool | None = None) -> str:
    """A program of 2-4 gradient snippets (``only``: these); see the module docstring.
    ``fwd``: also the loss's dual under ti.ad.FwdMode (param x), with ``_fd_dir`` (None: by
    the seed, for programs without sparse or ndarray intermediates, which carry no duals)."""
    g = _Grad(seed)
    picks = only or g.r.sample(GRAD_SNIPPETS, g.r.randint(2, 4))
    if fwd is None:
        fwd = seed % 2 == 0 and not {"sparse", "ndarray"} & set(picks)
    for q, name in enumerate(picks):
        getattr(g, name)(f"s{q}_")
    names = [n for n, _ in g.inputs]
    vals = ["xv", "yv"] + [f"{n}v" for n in names[2:]]
    calls = [f"        {c}" for c in g.launches]
    grads = [f"{n}.grad.to_numpy()" for n in names]
    dual = ", needs_dual=True" if fwd else ""
    if fwd:  # the intermediates carry duals too
        g.setup = [ln.replace("needs_grad=True", "needs_grad=True, needs_dual=True")
                   if "ndarray" not in ln else ln for ln in g.setup]
    lines = [
        "import numpy as np", "", "", "def run(ti, hook=None):",
        "    ti.init(arch=ti.cpu, default_fp=ti.f64, fast_math=False)",
        "    n = 8",
        f"    rng = np.random.default_rng({seed})",
        f"    x = ti.field(ti.f64, shape=n, needs_grad=True{dual})",
        f"    y = ti.field(ti.f64, shape=n, needs_grad=True{dual})",
        f"    loss = ti.field(ti.f64, shape=(), needs_grad=True{dual})",
        "    xv = rng.uniform(-0.55, 0.55, n)",
        "    yv = (rng.integers(-5, 5, n) * 0.2 + 0.1) + rng.uniform(-0.03, 0.03, n)",
        *g.setup, "", *g.code,
        f"    def forward({', '.join(vals)}):",
        *[f"        {n}.from_numpy({v})" for n, v in zip(names, vals, strict=True)],
        "        loss[None] = 0.0",
        *calls,
        "        return loss[None]",
        "",
        f"    value = forward({', '.join(vals)})",
        "    with ti.ad.Tape(loss):",
        *calls,
        f"    tape = [{', '.join(grads)}]",
        f"    forward({', '.join(vals)})",
        f"    for g in ({', '.join(f'{n}.grad' for n in names + g.grads)},):",
        "        g.fill(0.0)",
        "    loss.grad[None] = 1.0",
        *[f"    {c.replace('(', '.grad(', 1)}" for c in reversed(g.launches)],
        f"    manual = [{', '.join(grads)}]",
        *central_differences(f"[{', '.join(vals)}]"),
        "    return {'loss': np.array([value]), 'tape': np.concatenate(tape),",
        "            'grad': np.concatenate(manual), '_fd': np.concatenate(fd)}",
        ""]
    if fwd:  # forward mode along a seed of x, against the directional central difference
        lines[-3:-3] = [
            "    sv = rng.uniform(-1, 1, n)",
            f"    for a, b in zip(({', '.join(names)},), base, strict=True):",
            "        a.from_numpy(b)",
            "    loss[None] = 0.0",
            "    try:  # Taichi 1.7.4 aborts forward mode through some local vector arithmetic",
            "        with ti.ad.FwdMode(loss=loss, param=x, seed=[float(v) for v in sv]):",
            *[f"    {c}" for c in calls],
            "        dual = {'dual': np.array([loss.dual[None]])}",
            "    except Exception as e:  # noqa: BLE001 - compared as a missing 'dual'",
            "        dual = {'_dual_error': repr(e)[:200]}",
            "    up = [b.copy() for b in base]",
            "    dn = [b.copy() for b in base]",
            "    up[0] += h * sv",
            "    dn[0] -= h * sv",
            "    dual['_fd_dir'] = np.array([(forward(*up) - forward(*dn)) / (2 * h)])"]
        lines[-2] = "            'grad': np.concatenate(manual), '_fd': np.concatenate(fd), **dual}"
    return "\n".join(lines)


# ------------------------------------------------------------------------------ primal

def _holds(t: str) -> list[str]:
    """The integer types holding every value of integer type ``t`` (a float converted to an
    integer type out of its range is undefined: LLVM's fptosi gives poison)."""
    return [u for u in INTS if (u[0] == t[0] and BITS[u] >= BITS[t]) or
            (u[0] == "i" and t[0] == "u" and BITS[u] > BITS[t])]


class _Prim(_Prog):
    """The primal snippets (fuzz_features' program skeleton: ``src``, ``src2``, ``isrc``)."""

    def bitcast(self, p: str) -> None:
        """ti.bit_cast between f32 and i32/u32, f64 and i64/u64, f16 and i16/u16; the bits of
        a float changed as an integer and cast back."""
        r = self.r
        # No subnormal data: Taichi's flush-to-zero mode also holds for NumPy in its process
        # (np.array([1e-40], np.float32) is 0 there); subnormals come from bit_cast in kernels.
        vals = [0.0, -0.0, 1.0, -1.5, 3.0e38, -1e-30, 1.2e-38, float("inf"), -float("inf"), 0.1,
                65504.0, 2.0**-14, 123.456, -7.0e-3]
        arr = repr(vals).replace("inf", "np.inf")
        bt = r.choice(["i32", "u32"])  # b's type: literals are default_ip (i64 widens b ^ 1)
        lines = [
            f"            {p}o[i, 0] = ti.cast(ti.bit_cast({p}f[i], ti.i32), ti.i64)",
            f"            {p}o[i, 1] = ti.cast(ti.bit_cast({p}f[i], ti.u32), ti.i64)",
            f"            {p}o[i, 2] = ti.bit_cast({p}d[i], ti.i64)",
            f"            {p}o[i, 3] = ti.cast(ti.bit_cast({p}d[i], ti.u64) >> "
            f"{r.choice([1, 20, 52, 63])}, ti.i64)",
            f"            {p}o[i, 4] = ti.cast(ti.bit_cast(ti.cast({p}f[i], ti.f16), ti.i16), "
            "ti.i64)",
            f"            {p}o[i, 5] = ti.cast(ti.bit_cast(ti.cast({p}f[i], ti.f16), ti.u16), "
            "ti.i64)",
            # a subnormal constant moved (x * 1.0 and -x are flushed where Taichi folds them
            # and not where it computes them: not compared)
            f"            t = ti.bit_cast(ti.i32({r.choice([5, -7, 1 << 22])}), ti.f32)",
            f"            t2 = ti.bit_cast(ti.i32({r.choice([9, -2**31 + 3])}), ti.f32)",
            f"            {p}o[i, 6] = ti.cast(ti.bit_cast(ti.select(i % 2 == 0, t, t2), ti.i32), "
            "ti.i64)"]
        mod = r.choice(["b + 1", "b - 1", "b ^ 0x40000000", "b & 0x7FFFFFFF", "b | 1", "~b",
                        "b >> 1"])
        self.setup += [f"    {p}f = ti.field(ti.f32, shape={len(vals)})",
                       f"    {p}d = ti.field(ti.f64, shape={len(vals)})",
                       f"    {p}f.from_numpy(np.array({arr}, dtype=np.float32))",
                       f"    {p}d.from_numpy(np.array({arr}) * {r.choice(['1.0', '-3.0'])})",
                       f"    {p}o = ti.field(ti.i64, shape=({len(vals)}, 7))",
                       f"    {p}g = ti.field(ti.f32, shape={len(vals)})",
                       f"    {p}h = ti.field(ti.f64, shape={len(vals)})"]
        self.code += [
            "    @ti.kernel", f"    def {p}k():", f"        for i in range({len(vals)}):", *lines,
            f"            b = ti.bit_cast({p}f[i], ti.{bt})",
            f"            {p}g[i] = ti.bit_cast(ti.cast({mod}, ti.{bt}), ti.f32)",
            f"            {p}h[i] = ti.bit_cast(ti.bit_cast({p}d[i], ti.i64) ^ "
            f"ti.i64({r.choice(['1', '1 << 62', '1 << 52', '-1'])}), ti.f64)"]
        self.calls.append(f"    {p}k()")
        for f in ("o", "g", "h"):
            self.out(f"{p}{f}")

    def intcasts(self, p: str) -> None:
        """Chains of casts across every integer width and the floats; + - * wrapping in each
        integer type; float to integer only for values in the target's range."""
        r = self.r
        lines = []
        for q in range(8):
            t1, t2 = r.choice(INTS), r.choice(INTS)
            a = f"ti.cast(ti.cast(iv[i, {r.randrange(3)}], ti.{t1}), ti.{t2})"
            b = f"ti.cast(iv[i, {r.randrange(3)}], ti.{t2})"
            e = r.choice([a, f"{a} + {b}", f"{a} - {b}", f"{a} * {b}", f"-{a}", f"{a} * {a}",
                          f"ti.cast({a}, ti.{r.choice(['f32', 'f64'])})",
                          f"ti.cast(ti.cast({a}, ti.f64), ti.{r.choice(_holds(t2))})"
                          if BITS[t2] < 53 else a,
                          f"ti.cast(ti.cast(fv[i] * {r.choice([1, 100, 30000])}, ti.i32), "
                          f"ti.{t2})",
                          f"ti.cast(ti.abs(fv[i]) * {r.choice([1, 100, 200])}, ti.{t2})"
                          if BITS[t2] > 8 else a,
                          f"ti.cast(ti.cast(fv[i] * 1e5, ti.{r.choice(['f16', 'f32'])}), "
                          "ti.f64)"])
            if "ti.f32)" in e or "ti.f64)" in e or "f16" in e:
                lines.append(f"            {p}of[i, {q}] = ti.cast({e}, ti.f64)")
            else:
                lines.append(f"            {p}o[i, {q}] = ti.cast({e}, ti.i64)")
        self.setup += [
            "    iv = ti.field(ti.i64, shape=(n, 3))",
            "    iv.from_numpy(np.stack([rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64), "
            "rng.integers(-300, 300, n), rng.integers(-2**31, 2**31, n)], axis=1))",
            "    fv = ti.field(ti.f64, shape=n)",
            "    fv.from_numpy(rng.uniform(-1, 1, n))",
            f"    {p}o = ti.field(ti.i64, shape=(n, 8))",
            f"    {p}of = ti.field(ti.f64, shape=(n, 8))"]
        self.code += ["    @ti.kernel", f"    def {p}k():", "        for i in range(n):", *lines]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}o")
        self.out(f"{p}of")

    def shifts(self, p: str) -> None:
        """<<, >> (arithmetic on signed types) and ti.bit_shr by every amount below the width,
        constant and from data."""
        r = self.r
        lines = []
        for q in range(8):
            t = r.choice(INTS)
            w = BITS[t]
            a = f"ti.cast(iv2[i], ti.{t})"
            s = r.choice([str(r.randrange(w)), f"(iv2[(i + 1) % n] & {w - 1})", str(w - 1)])
            op = r.choice([f"{a} << {s}", f"{a} >> {s}", f"ti.bit_shr({a}, {s})",
                           f"({a} << {s}) >> {s}", f"ti.cast({a} >> {s}, ti.{r.choice(INTS)})"])
            lines.append(f"            {p}o[i, {q}] = ti.cast({op}, ti.i64)")
        self.setup += [
            "    iv2 = ti.field(ti.i64, shape=n)",
            "    iv2.from_numpy(rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64))",
            f"    {p}o = ti.field(ti.i64, shape=(n, 8))"]
        self.code += ["    @ti.kernel", f"    def {p}k():", "        for i in range(n):", *lines]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}o")

    def atomics_all(self, p: str) -> None:
        """Parallel atomics onto colliding cells of fields of every type (the result does not
        depend on the order: integer operations, float min/max, float adds of small integers),
        as ti.atomic_* calls and as augmented assignments."""
        r = self.r
        for q in range(r.randint(2, 3)):
            t = r.choice(INTS + ["f32", "f64", "f16"])
            isf = t.startswith("f")
            ops = ["add", "min", "max"] + ([] if isf else ["sub", "and", "or", "xor"])
            op = r.choice(ops)
            val = (f"ti.cast(isrc[i % n] % 7 - 3, ti.{t})" if isf or op in ("add", "sub") else
                   f"ti.cast(isrc[i % n] * {r.choice([1, 13, 1001])} + i, ti.{t})")
            how = r.choice(["call", "aug"]) if op in ("add", "sub", "and", "or", "xor") else "call"
            sym = {"add": "+=", "sub": "-=", "and": "&=", "or": "|=", "xor": "^="}.get(op)
            stmt = (f"ti.atomic_{op}({p}a{q}[i % 5], {val})" if how == "call" else
                    f"{p}a{q}[i % 5] {sym} {val}")
            init = r.choice(["0", "1", "-1", "100"]) if not t.startswith("u") else \
                r.choice(["0", "1", "100"])
            self.setup += [f"    {p}a{q} = ti.field(ti.{t}, shape=5)",
                           f"    {p}a{q}.fill({init})"]
            self.code += ["    @ti.kernel", f"    def {p}k{q}():",
                          f"        {r.choice(['', 'ti.loop_config(block_dim=8)'])}",
                          f"        for i in range({r.choice([8, 40, 300])}):",
                          f"            {stmt}"]
            self.calls.append(f"    {p}k{q}()")
            self.out(f"{p}a{q}")

    def containers(self, p: str) -> None:
        """fill, copy_from, to_numpy and from_numpy on struct, matrix and offset fields;
        ti.static loops over a list of fields in a kernel."""
        r = self.r
        off = r.random() < 0.5
        self.setup += [
            f"    {p}s = ti.Struct.field({{'a': ti.f32, 'b': ti.i32, 'v': ti.types.vector(2, "
            f"ti.f64)}}, shape=4)",  # (Taichi 1.7.4's Struct.field refuses every offset)
            f"    {p}s2 = ti.Struct.field({{'a': ti.f32, 'b': ti.i32, 'v': ti.types.vector(2, "
            "ti.f64)}, shape=4)",
            f"    {p}m = ti.Matrix.field(2, 3, ti.{r.choice(['f32', 'f64', 'i32'])}, shape=(3, 2)"
            f"{', offset=(-1, 3)' if off else ''})",
            f"    {p}m2 = ti.Matrix.field(2, 3, ti.{r.choice(['f32', 'f64', 'i32'])}, "
            "shape=(3, 2))",
            f"    {p}l = [ti.field(ti.{r.choice(['i32', 'f32', 'u8'])}, shape=4) for _ in "
            "range(3)]"]
        self.code += [
            "    @ti.kernel", f"    def {p}k():",
            f"        for q, f in ti.static(enumerate({p}l)):",
            "            for i in range(4):",
            f"                f[i] += ti.cast(i * (q + 1) + {p}s2[i].b, f.dtype)",
            f"        for I in ti.grouped({p}m):",
            f"            {p}m[I][1, 2] += ti.cast(I[0] * 10 + I[1], {p}m.dtype)",
            f"        for i in {p}s:",
            f"            {p}s[i].v += ti.Vector([{p}s[i].a, ti.cast({p}s[i].b, ti.f64)])"]
        fillm = r.choice(["1.5", "[[1, 2, 3], [4, 5, 6]]", "ti.Matrix([[1, -2, 3], [0, 5, 7]])",
                          "-3"])
        self.calls += [
            f"    {p}s2.from_numpy({{'a': rng.uniform(-1, 1, 4).astype(np.float32), "
            "'b': rng.integers(-50, 50, 4).astype(np.int32), 'v': rng.uniform(-1, 1, (4, 2))})",
            f"    {p}s.fill({r.choice(['2', '-1.5', '0'])})",
            f"    {p}s.copy_from({p}s2)" if r.random() < 0.6 else f"    {p}s.b.fill(7)",
            f"    {p}m.fill({fillm})",
            f"    {p}m2.from_numpy((rng.uniform(-5, 5, (3, 2, 2, 3)) * 4).astype("
            f"{p}m2.to_numpy().dtype))",
            f"    {p}m.copy_from({p}m2)" if r.random() < 0.5 else
            f"    {p}m[{r.randrange(3) - off}, {r.randrange(2) + 3 * off}] = [[9, 8, 7], [6, 5,"
            " 4]]",
            f"    for f in {p}l:",
            f"        f.fill({r.choice(['1', '3', '0'])})",
            f"    {p}k()"]
        self.outs += [f"{p}s.a.to_numpy()", f"{p}s.b.to_numpy()", f"{p}s.v.to_numpy()",
                      f"{p}s.to_numpy()['v']", f"{p}m.to_numpy(dtype=np.float64)",
                      f"{p}m.to_numpy(keep_dims=True)", f"{p}m2.to_numpy()",
                      f"np.stack([f.to_numpy() for f in {p}l])"]

    def serial(self, p: str) -> None:
        """Serialized loops whose result depends on the order (running sums, a carried state),
        with while loops, break and continue inside the range-for."""
        r = self.r
        self.setup += [f"    {p}o = ti.field(ti.i32, shape=n)",
                       f"    {p}c = ti.field(ti.i32, shape=4)"]
        self.code += [
            "    @ti.kernel", f"    def {p}k():",
            "        acc = 0",
            "        ti.loop_config(serialize=True)",
            "        for i in range(n):",
            f"            acc = acc * {r.choice([3, -2, 5])} + isrc[i] % 97",
            f"            if acc % {r.choice([2, 3, 5])} == 0:",
            "                continue",
            f"            {p}o[i] = acc",
            "            j = 0",
            f"            while j < {r.choice([5, 10, 40])}:",
            "                j += 1",
            f"                if (acc + j) % {r.choice([3, 4, 7])} == 0:",
            "                    continue",
            f"                {p}c[0] += j",
            f"                if {p}c[0] > {r.choice([50, 200, 1000])}:",
            "                    break",
            f"            if i > {r.choice([3, 5, 9])} and acc % {r.choice([2, 4])} == 1:",
            "                break",
            f"            {p}c[1] = i",
            f"        {p}c[2] = acc",
            "        for i in range(3, n):",
            "            for j in range(i):",
            "                if j % 3 == 2:",
            "                    continue",
            f"                if j * j > i + {r.choice([0, 5])}:",
            "                    break",
            f"                ti.atomic_add({p}c[3], j)"]
        self.calls.append(f"    {p}k()")
        self.out(f"{p}o")
        self.out(f"{p}c")


PRIM_SNIPPETS = ["bitcast", "intcasts", "shifts", "atomics_all", "containers", "serial"]


def program(seed: int, only: list[str] | None = None) -> str:
    """The source of one program of 2-4 primal snippets (``only``: these snippets)."""
    g = _Prim(seed)
    r = g.r
    g.fp = r.choice(["f32", "f64"])
    ip = r.choice(["i32", "i32", "i64"])
    picks = only or r.sample(PRIM_SNIPPETS, r.randint(2, 4))
    for q, name in enumerate(picks):
        getattr(g, name)(f"s{q}_")
    lines = [*primal_header(g.fp, ip, seed, f32_source=False),
             # hook(kernel, namespace): tests/core/test_random_fuzz_programs.py launches the
             # kernels itself, checking each against the reference interpreter
             "    launch = hook or (lambda k, _ns: k())",
             *g.setup, "", *g.code, "",
             *[re.sub(r"^    (s\d+_k\d*)\(\)$", r"    launch(\1, locals())", c) for c in g.calls],
             *result_lines(g.outs, lambda o: "(" in o)]
    return "\n".join(lines)
