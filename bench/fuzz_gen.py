"""Random Taichi-API programs for differential testing (bench/fuzz_taichi.py, tests/core).

``program(seed)`` returns the source of a module with one function, ``run(ti)``, that
initialises ``ti`` (difftape or Taichi: the source only uses the API they share), builds fields,
an ndarray and kernels, launches them and returns a dict of NumPy arrays. Running the same source
on two implementations and comparing the dicts finds wrong results in either.

What the programs exercise (where compilers go wrong): parallel range-, struct- and ndrange-for
loops; nested serial loops with break/continue (range, while, ti.static unrolled); if/elif/else
chains; integer arithmetic in i32/i64/u32 with wrap-around, floor division and modulo of
negative operands, shifts, bit operations, casts between int and float types and narrowing
casts (i8/u8/i16); atomics (add/sub/min/max/and/or/xor, ``+=`` on fields) onto colliding
indices; local vectors and matrices (@, transpose, norm, dot, cross, element ops, dynamic
element reads and writes), local arrays; struct fields, grouped (one dense SNode) fields, offset
fields, bitmasked fields (struct-for over the active cells), dynamic fields (ti.append, length);
ti.func with early returns; ndarray and scalar arguments; f32/f64 and i32/i64 defaults.

Everything is well defined for both: divisors are never zero or -1 (no INT_MIN // -1), shift
amounts stay below 16, float-to-int casts are clamped first, parallel loops write only their
own element of an output (everything shared goes through atomics whose result does not depend on
order, or float atomic adds compared to a tolerance), while loops are bounded.

``gradient_program(seed)`` is the autodiff variant: a differentiable kernel over f64 inputs whose
``run(ti)`` returns the loss and the gradients from ``ti.ad.Tape`` and from ``kernel.grad()``.
"""
from __future__ import annotations

import random

N = 12  # elements of every 1-D field


class _Gen:
    """One program: a random walk over the grammar, tracking the variables in scope."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.seed = seed
        self.n = 0
        self.scopes: list[list[tuple[str, str, bool]]] = []  # (name, 'i' | 'f', writable)
        self.depth = 0
        self.loop_depth = 0  # serial loops enclosing the statement (break/continue allowed)
        self.funcs: list[tuple[str, int, int]] = []  # (name, int args, float args) -> float
        self.budget = 0
        self.iops = self.r.choice([["add", "sub"], ["min"], ["max"], ["and"], ["or"], ["xor"]])
        self.fop = self.r.choice(["add", "min", "max"])
        self.ip = "i32"  # the program's default_ip
        self.ctx = "k1"  # which leaves are visible: "k1", "k2" (kernels), "fn" (a ti.func)

    # ---------------------------------------------------------------------------- helpers
    def fresh(self, p: str) -> str:
        self.n += 1
        return f"{p}{self.n}"

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def vars(self, kind: str, writable: bool = False) -> list[str]:
        return [n for s in self.scopes for (n, k, w) in s if k == kind and (w or not writable)]

    # -------------------------------------------------------------------------- expressions
    def ileaf(self) -> str:
        r = self.r
        opts = {"k1": ["i", "ia[i]", "ia[(i + 3) % n]", "iu[i]", "il[i]", "s", "nd_i[i]"],
                "k2": ["i", "ia[i]", "iu[(i + 5) % n]", "il[i]", "s", "dyn.length()"],
                "fn": ["ia[1]", "iu[3]"]}[self.ctx] + [
                str(r.choice([0, 1, 2, 3, 5, 7, -1, -2, -9, 100, 65535, 2147483647, -2147483648,
                              123456789, -987654321]))]
        opts += self.vars("i") * 3
        v = r.choice(opts)
        if v == "-2147483648":
            v = "(-2147483647 - 1)"
        return v

    def fleaf(self) -> str:
        r = self.r
        opts = {"k1": ["fa[i]", "fa[(i + 1) % n]", "fb[i]", "x", "nd_f[i]", "sf[i].a"],
                "k2": ["fa[i]", "fb[(i + 7) % n]", "ga[i]", "sf.a[i]"],
                "fn": ["fa[2]", "fb[0]"]}[self.ctx] + [
                str(r.choice([0.0, 0.5, -1.25, 3.0, 1e-3, 2.5]))]
        opts += self.vars("f") * 3
        return r.choice(opts)

    def divisor(self, d: int) -> str:
        r = self.r
        c = r.random()
        if c < 0.3:
            return str(r.choice([3, -3, 7, -5, 16, 2, -2]))
        if c < 0.65:
            return f"(({self.iexpr(d)}) & 7) + 1"
        return f"-((({self.iexpr(d)}) & 7) + 2)"

    def iexpr(self, d: int = 0) -> str:
        r = self.r
        if d >= 3 or self.chance(0.3):
            return self.ileaf()
        d += 1
        k = r.randrange(24)
        a = self.iexpr(d)
        if k < 3:
            return f"({a} + {self.iexpr(d)})"
        if k < 5:
            return f"({a} - {self.iexpr(d)})"
        if k < 7:
            return f"({a} * {self.iexpr(d)})"
        if k == 7:
            return f"({a} // ({self.divisor(d)}))"
        if k == 8:
            return f"({a} % ({self.divisor(d)}))"
        if k == 9:
            return f"({a} << ({self.iexpr(d)} & 15))"
        if k == 10:
            return f"({a} >> ({self.iexpr(d)} & 15))"
        if k == 11:
            return f"({a} {r.choice(['&', '|', '^'])} {self.iexpr(d)})"
        if k == 12:
            return f"(~{a})" if self.chance(0.5) else f"(-{a})"
        if k == 13:
            return f"ti.{r.choice(['min', 'max'])}({a}, {self.iexpr(d)})"
        if k == 14:
            t = r.choice(["i32", "i64", "u32", "u8", "i8", "i16", "u16"])
            back = r.choice(["i32", "i64"])
            return f"ti.cast(ti.cast({a}, ti.{t}), ti.{back})" if t in ("u8", "i8", "i16",
                                                                         "u16") else \
                f"ti.cast({a}, ti.{t})"
        if k == 15:
            lo, hi = r.choice([(-1000.0, 1000.0), (-3e9, 3e9), (0.0, 4e9)])
            t = "i64" if hi > 2.1e9 and lo < 0 else ("u32" if lo == 0.0 else "i32")
            if t == "u32":
                return f"ti.cast(ti.math.clamp({self.fexpr(d)}, 0.0, 4000000000.0), ti.u32)"
            return f"ti.cast(ti.math.clamp({self.fexpr(d)}, {lo}, {hi}), ti.{t})"
        if k == 16:
            return f"ti.select({self.cond(d)}, {a}, {self.iexpr(d)})"
        if k == 17:
            return f"ti.cast({self.cond(d)}, ti.i32)"
        if k == 18:
            return f"ti.abs({a})"
        if k == 19:
            return f"({a} ** {r.choice([2, 3])})"
        if k == 20 and self.funcs and self.budget > 0:
            return f"ti.cast(ti.math.clamp({self.call(d)}, -1e6, 1e6), ti.i32)"
        if k == 21:
            return f"ti.cast({a}, ti.u32) {r.choice(['>>', '%', '//'])} {r.choice(['3', '5'])}"
        return f"({a} + {self.iexpr(d)})"

    def fexpr(self, d: int = 0) -> str:
        r = self.r
        if d >= 3 or self.chance(0.3):
            return self.fleaf()
        d += 1
        k = r.randrange(22)
        a = self.fexpr(d)
        if k < 3:
            return f"({a} + {self.fexpr(d)})"
        if k < 5:
            return f"({a} - {self.fexpr(d)})"
        if k < 7:
            return f"({a} * {self.fexpr(d)})"
        if k == 7:
            return f"({a} / (ti.abs({self.fexpr(d)}) + 0.5))"
        if k == 8:
            f = r.choice(["ti.sin({})", "ti.cos({})", "ti.tanh({})", "ti.exp(ti.min({}, 3.0))",
                          "ti.sqrt(ti.abs({}))", "ti.floor({})", "ti.ceil({})", "ti.abs({})",
                          "ti.round({})", "ti.atan2({}, 1.5)", "ti.log(ti.abs({}) + 1.0)"])
            return f.format(a)
        if k == 9:
            return f"ti.{r.choice(['min', 'max'])}({a}, {self.fexpr(d)})"
        if k == 10:
            t = r.choice(["f32", "f64"])
            return f"ti.cast({self.iexpr(d)}, ti.{t})"
        if k == 11:
            return f"ti.select({self.cond(d)}, {a}, {self.fexpr(d)})"
        if k == 12:
            return f"({a} % {r.choice(['1.7', '-0.6', '2.0'])})"
        if k == 13:
            return f"({a} // {r.choice(['0.7', '-1.5'])})"
        if k == 14:
            return f"({self.iexpr(d)} / ({self.divisor(d)}))"
        if k == 15:
            return f"(ti.tanh({a}) ** {r.choice(['2', '3'])})"
        if k == 16:
            return f"ti.cast({a}, ti.{r.choice(['f32', 'f64'])})"
        if k == 17 and self.funcs and self.budget > 0:
            return self.call(d)
        if k == 18:
            return f"ti.math.clamp({a}, -2.0, 2.0)"
        return f"({a} * 0.5)"

    def call(self, d: int) -> str:
        self.budget -= 1
        name, ni, nf = self.r.choice(self.funcs)
        args = [self.iexpr(3) for _ in range(ni)] + [self.fexpr(3) for _ in range(nf)]
        return f"{name}({', '.join(args)})"

    def cond(self, d: int = 0) -> str:
        r = self.r
        k = r.randrange(8)
        if k < 3:
            return f"({self.iexpr(d + 1)} {r.choice(['<', '<=', '>', '>=', '==', '!='])} " \
                   f"{self.iexpr(d + 1)})"
        if k < 5:
            bound = r.choice(["0.0", "0.5", "-1.0"])
            return f"({self.fexpr(d + 1)} {r.choice(['<', '>'])} {bound})"
        if k == 5:
            return f"({self.cond(d + 2)} {r.choice(['and', 'or'])} {self.cond(d + 2)})"
        if k == 6:
            return f"(not {self.cond(d + 2)})"
        return f"(({self.iexpr(d + 1)}) & {r.choice([1, 2, 4])} != 0)"

    # --------------------------------------------------------------------------- statements
    def block(self, out: list[str], ind: str, count: int) -> None:
        self.scopes.append([])
        for _ in range(count):
            self.stmt(out, ind)
        self.scopes.pop()

    def declare(self, out: list[str], ind: str) -> None:
        r = self.r
        if self.chance(0.5):
            name = self.fresh("k")
            c = r.random()
            if c < 0.6:
                out.append(f"{ind}{name} = {self.iexpr()}")
            else:
                t = r.choice(["i64", "u32", "i32"])
                out.append(f"{ind}{name} = ti.cast({self.iexpr()}, ti.{t})")
            self.scopes[-1].append((name, "i", True))
        else:
            name = self.fresh("g")
            if self.chance(0.8):
                out.append(f"{ind}{name} = {self.fexpr()}")
            else:
                out.append(f"{ind}{name} = ti.cast({self.fexpr()}, ti.{r.choice(['f32', 'f64'])})")
            self.scopes[-1].append((name, "f", True))

    def stmt(self, out: list[str], ind: str) -> None:
        r = self.r
        deep = self.depth >= 3
        k = r.randrange(20)
        if k < 4 or not any(self.scopes):
            return self.declare(out, ind)
        if k < 7:
            iv, fv = self.vars("i", True), self.vars("f", True)
            if iv and (self.chance(0.5) or not fv):
                v = r.choice(iv)
                op = r.choice(["=", "+=", "-=", "*=", "^=", "|=", "&=", "//=", "%=", "<<=", ">>="])
                if op in ("//=", "%="):
                    out.append(f"{ind}{v} {op} {self.divisor(1)}")
                elif op in ("<<=", ">>="):
                    out.append(f"{ind}{v} {op} ({self.iexpr(1)} & 7)")
                else:
                    out.append(f"{ind}{v} {op} {self.iexpr()}")
            elif fv:
                v = r.choice(fv)
                op = r.choice(["=", "+=", "-=", "*="])
                rhs = self.fexpr() if op != "*=" else f"ti.tanh({self.fexpr()})"
                out.append(f"{ind}{v} {op} {rhs}")
            return None
        if k < 9:
            if self.chance(0.5):
                out.append(f"{ind}io[i] = {self.iexpr()}")
            else:
                out.append(f"{ind}fo[i] = {self.fexpr()}")
            return None
        if k < 11:
            return self.atomic(out, ind)
        if k < 13 and not deep:
            return self.if_chain(out, ind)
        if k < 15 and not deep:
            return self.loop(out, ind)
        if k == 15 and self.loop_depth and self.chance(0.7):
            out.append(f"{ind}if {self.cond()}:")
            out.append(f"{ind}    {r.choice(['break', 'continue'])}")
            return None
        if k == 16:
            return self.matrix(out, ind)
        if k == 17:
            return self.local_array(out, ind)
        if k == 18:
            out.append(f"{ind}sf[i].b {r.choice(['=', '+=', '^='])} {self.iexpr()}")
            out.append(f"{ind}gb[i] = {self.iexpr()}")
            return None
        return self.declare(out, ind)

    def atomic(self, out: list[str], ind: str) -> None:
        r = self.r
        idx = f"ti.cast(({self.iexpr(1)}) % 4, ti.i32)"
        # One commutative op family per accumulator and program: mixing (add then or) would
        # make the result depend on the order the threads ran in.
        c = r.random()
        if c < 0.6:
            op = r.choice(self.iops)
            out.append(f"{ind}ti.atomic_{op}(acc_i[{idx}], {self.iexpr(1)})")
        elif c < 0.75:
            aug = {"add": "+=", "sub": "-=", "or": "|=", "xor": "^=", "and": "&="}
            out.append(f"{ind}acc_i[{idx}] {aug.get(self.iops[0], '+=')} {self.iexpr(1)}"
                       if self.iops[0] in aug else
                       f"{ind}ti.atomic_{self.iops[0]}(acc_i[{idx}], {self.iexpr(1)})")
        elif self.fop != "add":
            out.append(f"{ind}ti.atomic_{self.fop}(acc_f[{idx}], {self.fexpr(1)})")
        else:
            out.append(f"{ind}acc_f[{idx}] += ti.tanh({self.fexpr(1)})")

    def if_chain(self, out: list[str], ind: str) -> None:
        self.depth += 1
        out.append(f"{ind}if {self.cond()}:")
        self.block(out, ind + "    ", self.r.randint(1, 3))
        for _ in range(self.r.randint(0, 2)):
            out.append(f"{ind}elif {self.cond()}:")
            self.block(out, ind + "    ", self.r.randint(1, 2))
        if self.chance(0.6):
            out.append(f"{ind}else:")
            self.block(out, ind + "    ", self.r.randint(1, 2))
        self.depth -= 1

    def loop(self, out: list[str], ind: str) -> None:
        r = self.r
        self.depth += 1
        j = self.fresh("j")
        c = r.random()
        if c < 0.45:
            bound = r.choice(["3", "ia[i] & 3", "(s & 3) + 1", "i % 4", "-1"])
            if self.chance(0.3):
                out.append(f"{ind}for {j} in range({r.choice(['-2', '1'])}, {bound}):")
            else:
                out.append(f"{ind}for {j} in range({bound}):")
            self.loop_depth += 1
            self.scopes.append([(j, "i", False)])
            self.block(out, ind + "    ", r.randint(1, 4))
            self.scopes.pop()
            self.loop_depth -= 1
        elif c < 0.7:
            out.append(f"{ind}for {j} in ti.static(range({r.randint(1, 3)})):")
            saved = self.loop_depth
            self.loop_depth = 0  # break in a static loop is not a loop break
            self.scopes.append([(j, "i", False)])
            self.block(out, ind + "    ", r.randint(1, 3))
            self.scopes.pop()
            self.loop_depth = saved
        else:
            out.append(f"{ind}{j} = 0")
            out.append(f"{ind}while {j} < {r.choice(['3', '(ia[i] & 3)'])}:")
            out.append(f"{ind}    {j} += 1")
            self.loop_depth += 1
            self.scopes.append([(j, "i", False)])
            self.block(out, ind + "    ", r.randint(1, 3))
            self.scopes.pop()
            self.loop_depth -= 1
        self.depth -= 1

    def matrix(self, out: list[str], ind: str) -> None:
        r = self.r
        v, w, m = self.fresh("v"), self.fresh("w"), self.fresh("m")
        out.append(f"{ind}{v} = ti.Vector([{self.fexpr(2)}, {self.fexpr(2)}, {self.fexpr(2)}])")
        out.append(f"{ind}{m} = ti.Matrix([[{self.fexpr(2)}, {self.fexpr(2)}, 0.5], "
                   f"[{self.fexpr(2)}, 1.0, {self.fexpr(2)}], [-0.5, {self.fexpr(2)}, 2.0]])")
        c = r.randrange(6)
        if c == 0:
            out.append(f"{ind}{w} = {m} @ {v}")
        elif c == 1:
            out.append(f"{ind}{w} = {m}.transpose() @ {v} + {v} * 0.5")
        elif c == 2:
            out.append(f"{ind}{w} = ({m} @ {m}.transpose()) @ {v} - {v}.cross(ti.Vector([1.0, "
                       f"{self.fexpr(2)}, 0.0]))")
        elif c == 3:
            out.append(f"{ind}{w} = ti.abs({v}) + ti.max({v}, {v} * {v}) * ti.sin({v})")
        elif c == 4:
            out.append(f"{ind}{w} = {v} / ({v}.norm() + 1.0)")
        else:
            out.append(f"{ind}{w} = {v} + {m} @ ({v} * 2.0)")
        kk = f"ti.cast(({self.iexpr(2)}) % 3, ti.i32)"
        # Taichi 1.7.4 stops on a runtime 2-D index into a local matrix under default_ip=i64
        # (an assertion in its type_check): constant ones there, to compare the rest.
        mk = kk if self.ip != "i64" else str(r.randrange(3))
        if self.chance(0.5):
            out.append(f"{ind}{w}[{kk}] = {self.fexpr(2)}")
        if self.chance(0.4):
            col = f"ti.cast(({self.iexpr(2)}) % 3, ti.i32)" if self.ip != "i64" else "1"
            out.append(f"{ind}{m}[{mk}, {col}] += {w}[{kk}]")
        g = self.fresh("g")
        c = r.randrange(4)
        if c == 0:
            out.append(f"{ind}{g} = {w}.norm() + {v}.dot({w})")
        elif c == 1:
            out.append(f"{ind}{g} = {w}[{kk}] + {m}[{mk}, 2] + {m}.determinant()")
        elif c == 2:
            out.append(f"{ind}{g} = {w}.sum() + ({m} @ {w}).max() + {v}.norm_sqr()")
        else:
            out.append(f"{ind}{g} = {w}.min() - {m}.transpose()[1, {mk}]")
        self.scopes[-1].append((g, "f", True))
        if self.chance(0.5):
            out.append(f"{ind}vo[i] = {w}")

    def local_array(self, out: list[str], ind: str) -> None:
        r = self.r
        a = self.fresh("arr")
        out.append(f"{ind}{a} = ti.Vector([{', '.join(self.iexpr(2) for _ in range(4))}])")
        out.append(f"{ind}for {a}_t in range(4):")
        out.append(f"{ind}    {a}[ti.cast(({self.iexpr(2)} + {a}_t) % 4, ti.i32)] += "
                   f"{a}_t * {self.iexpr(2)}")
        k = self.fresh("k")
        pick = f"{a}[ti.cast(({self.iexpr(2)}) % 4, ti.i32)]"
        out.append(f"{ind}{k} = {pick} + {a}.sum()" if r.random() < 0.5 else
                   f"{ind}{k} = {pick} ^ {a}.max()")
        self.scopes[-1].append((k, "i", True))

    # ---------------------------------------------------------------------------- ti.funcs
    def func(self, out: list[str]) -> None:
        """A ti.real_func with early returns (typed parameters, as Taichi requires), or a
        ti.func whose one return is at the end (Taichi inlines those only)."""
        name = self.fresh("fn")
        ni, nf = self.r.randint(0, 2), self.r.randint(1, 2)
        real = self.chance(0.5)
        params = [f"p{q}" for q in range(ni)] + [f"q{q}" for q in range(nf)]
        if real:
            out.append("    @ti.real_func")
            sig = [f"p{q}: ti.i32" for q in range(ni)] + [f"q{q}: ti.f32" for q in range(nf)]
            out.append(f"    def {name}({', '.join(sig)}) -> ti.f32:")
        else:
            out.append("    @ti.func")
            out.append(f"    def {name}({', '.join(params)}):")
        saved = self.scopes
        self.ctx = "fn"
        self.scopes = [[(p, "i", False) for p in params[:ni]] +
                       [(q, "f", False) for q in params[ni:]]]
        body: list[str] = []
        for _ in range(self.r.randint(0, 2)):
            self.declare(body, "        ")
        if real:
            body.append(f"        if {self.cond(1)}:")
            body.append(f"            return {self.fexpr(1)}")
            if self.chance(0.5):
                body.append(f"        elif {self.cond(1)}:")
                body.append(f"            return ti.cast({self.iexpr(1)}, ti.f32)")
            body.append(f"        return {self.fexpr(1)}")
        else:
            body.append(f"        res = ti.cast({self.fexpr(1)}, ti.f32)")
            body.append(f"        if {self.cond(1)}:")
            body.append(f"            res = {self.fexpr(1)}")
            body.append("        return res")
        self.scopes = saved
        self.ctx = "k1"
        out.extend(body)
        self.funcs.append((name, ni, nf))


def program(seed: int) -> str:
    """The source of one random program (module with ``run(ti)``)."""
    g = _Gen(seed)
    r = g.r
    fp = r.choice(["f32", "f64"])
    ip = g.ip = r.choice(["i32", "i32", "i64"])
    lines = ["import numpy as np", "", "", "def run(ti, hook=None):",
             f"    ti.init(arch=ti.cpu, default_fp=ti.{fp}, default_ip=ti.{ip}, fast_math=False,"
             f" random_seed=1)",
             f"    n = {N}",
             f"    rng = np.random.default_rng({seed})",
             "    ia = ti.field(ti.i32, shape=n)",
             "    iu = ti.field(ti.u32, shape=n)",
             "    il = ti.field(ti.i64, shape=n)",
             f"    fa = ti.field(ti.{r.choice([fp, 'f32', 'f64'])}, shape=n)",
             "    fb = ti.field(ti.f32, shape=n)",
             "    io = ti.field(ti.i32, shape=n)" if r.random() < 0.6 else
             "    io = ti.field(ti.i64, shape=n)",
             "    fo = ti.field(ti.f64, shape=n)" if r.random() < 0.5 else
             "    fo = ti.field(ti.f32, shape=n)",
             "    vo = ti.Vector.field(3, ti.f32, shape=n)",
             "    acc_i = ti.field(ti.i32, shape=4)" if r.random() < 0.7 else
             "    acc_i = ti.field(ti.i64, shape=4)",
             "    acc_f = ti.field(ti.f64, shape=4)",
             "    sf = ti.Struct.field({'a': ti.f32, 'b': ti.i32}, shape=n)",
             "    ga = ti.field(ti.f32)",
             "    gb = ti.field(ti.i32)",
             "    ti.root.dense(ti.i, n).place(ga, gb)",
             "    off = ti.field(ti.i32, shape=n, offset=(-5,))",
             "    bm = ti.field(ti.i32)",
             "    ti.root.bitmasked(ti.i, n).place(bm)",
             "    dyn = ti.field(ti.i32)",
             "    ti.root.dynamic(ti.i, 64, chunk_size=4).place(dyn)",
             "    nd_i = ti.ndarray(ti.i32, shape=n)",
             "    nd_f = ti.ndarray(ti.f32, shape=n)",
             "    ia.from_numpy(rng.integers(-2**31, 2**31, n).astype(np.int32))",
             "    iu.from_numpy(rng.integers(0, 2**32, n).astype(np.uint32))",
             "    il.from_numpy(rng.integers(-2**40, 2**40, n).astype(np.int64))",
             "    fa.from_numpy(rng.uniform(-3, 3, n).astype(fa.to_numpy().dtype))",
             "    fb.from_numpy(rng.uniform(-3, 3, n).astype(np.float32))",
             "    nd_i.from_numpy(rng.integers(-50, 50, n).astype(np.int32))",
             "    nd_f.from_numpy(rng.uniform(-2, 2, n).astype(np.float32))",
             "    sf.a.from_numpy(rng.uniform(-2, 2, n).astype(np.float32))",
             "    acc_i.from_numpy(rng.integers(-1000, 1000, 4).astype(acc_i.to_numpy().dtype))",
             "    for q in rng.permutation(n)[: n // 2]:",
             "        bm[int(q)] = int(q) * 3 - 7",
             ""]
    for _ in range(r.randint(0, 2)):
        g.func(lines)
        lines.append("")
    # kernel 1: the main parallel loop
    g.budget = 3
    loop = r.choice(["range(n)", "io", "fo", "ti.ndrange(n)", "sf", "range(-2, n - 2)"])
    lines += ["    @ti.kernel",
              "    def k1(nd_i: ti.types.ndarray(dtype=ti.i32, ndim=1),"
              " nd_f: ti.types.ndarray(dtype=ti.f32, ndim=1), s: ti.i32, x: ti.f32):"]
    body: list[str] = []
    g.scopes = [[]]
    for _ in range(r.randint(2, 7)):
        g.stmt(body, "            ")
    if loop == "range(-2, n - 2)":
        lines.append(f"        for i0 in {loop}:")
        lines.append("            i = i0 + 2")
    else:
        lines.append(f"        for i in {loop}:")
    lines += body
    # kernel 2: sparse and offset fields, serial appends, a kernel-level reduction
    g.scopes = [[]]
    g.ctx = "k2"
    b2: list[str] = []
    for _ in range(r.randint(1, 3)):
        g.stmt(b2, "            ")
    lines += ["", "    @ti.kernel",
              "    def k2(s: ti.i32) -> ti.i32:",
              "        tot = 0",
              "        for q in bm:",
              f"            bm[q] = bm[q] * {r.choice([3, -5, 65537])} + ia[q] % 11",
              "            tot += bm[q] & 1023",
              "        for q in off:",
              "            off[q] = q * s + ia[q + 5] // 3",
              "        for q in range(n):",
              "            if (ia[q] & 3) != 0:",
              "                bm[q] += 1",
              "        ti.loop_config(serialize=True)",
              "        for q in range(n):",
              "            if ia[q] % 3 == 1:",
              "                dyn.append(ia[q] >> 4)",
              "        for i in range(n):",
              *b2,
              "        return tot + dyn.length()",
              "",
              "    dcopy = ti.field(ti.i32, shape=64)",
              "",
              "    @ti.kernel",
              "    def k3():",
              "        for q in range(dyn.length()):",
              "            dcopy[q] = dyn[q]",
              "",
              f"    s = {r.choice([0, 1, 3, -7, 2**31 - 1])}",
              f"    x = {r.choice([0.5, -1.5, 2.0])!r}",
              "    if hook is None:",
              "        k1(nd_i, nd_f, s, x)",
              "    else:  # tests/core/test_random_fuzz_programs.py: k1 against the interpreter",
              "        hook(k1, (nd_i, nd_f, s, x), [ia, iu, il, fa, fb, io, fo, vo, acc_i, acc_f,",
              "                                     sf.a, sf.b, ga, gb])",
              "    t = k2(s)",
              "    k3()",
              "    k1(nd_i, nd_f, s + 1, x * 0.5)" if r.random() < 0.3 else "",
              "    return {'io': io.to_numpy(), 'fo': fo.to_numpy(), 'vo': vo.to_numpy(),",
              "            'acc_i': acc_i.to_numpy(), 'acc_f': acc_f.to_numpy(),",
              "            'sfa': sf.a.to_numpy(), 'sfb': sf.b.to_numpy(), 'ga': ga.to_numpy(),",
              "            'gb': gb.to_numpy(), 'off': off.to_numpy(), 'bm': bm.to_numpy(),",
              "            'dyn': dcopy.to_numpy(),",
              "            'nd_f': nd_f.to_numpy(), 't': np.array([t])}",
              ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ gradients

_GUNARY = ["ti.sin({})", "ti.cos({})", "ti.tanh({})", "ti.exp(ti.tanh({}))", "({}) ** 2",
           "ti.sqrt(1.0 + ({}) ** 2)", "({}) / (1.0 + ({}) ** 2)", "ti.log(1.5 + ti.sin({}))",
           "-({})", "ti.atan2({}, 1.5)"]
_GBINARY = ["({}) + ({})", "({}) - ({})", "({}) * ({})", "({}) / (2.0 + ti.sin({}))",
            "ti.max({}, {}) * 0.5", "ti.math.mix({}, {}, 0.25)"]


def _gexpr(r: random.Random, leaves: list[str], d: int = 0) -> str:
    if d >= 3 or r.random() < 0.3:
        return r.choice(leaves)
    if r.random() < 0.45:
        a = _gexpr(r, leaves, d + 1)
        return r.choice(_GUNARY).replace("{}", a)
    return r.choice(_GBINARY).format(_gexpr(r, leaves, d + 1), _gexpr(r, leaves, d + 1))


def central_differences(base: str) -> list[str]:
    """Program lines computing ``fd``: the central difference of ``forward`` along every element
    of each array of ``base`` (a list expression of the program's input arrays), f64, h=1e-6."""
    return [f"    base = {base}",
            "    fd = []",
            "    h = 1e-6",
            "    for a in range(len(base)):",
            "        col = np.zeros(n)",
            "        for q in range(n):",
            "            up = [b.copy() for b in base]",
            "            dn = [b.copy() for b in base]",
            "            up[a][q] += h",
            "            dn[a][q] -= h",
            "            col[q] = (forward(*up) - forward(*dn)) / (2 * h)",
            "        fd.append(col)"]


def gradient_program(seed: int) -> str:
    """A differentiable f64 kernel (a parallel loop adding into ``loss``: inner serial loops
    carrying a float, ti.static loops, branches on inputs kept 0.05 from their threshold,
    local vectors and matrices, a ti.func, a struct field); ``run(ti)`` returns the loss, the
    gradients from ``ti.ad.Tape`` and from ``kernel.grad()``, and central finite differences
    of the forward kernel (step 1e-6) computed on the same implementation; and the loss's
    dual under ti.ad.FwdMode along a random seed of one input, with its directional central
    difference."""
    r = random.Random(seed)
    leaves = ["x[i]", "x[(i + 1) % n]", "y[i]", "t", "0.5", "1.25", "sx[i].w"]
    body = ["            t = x[i] * 0.5 + y[i]"]
    for _ in range(r.randint(1, 4)):
        c = r.randrange(6)
        if c == 0:
            bound = r.choice(["3", "ti.cast(i % 3, ti.i32) + 1"])
            step = _gexpr(r, leaves + ["ti.cast(j, ti.f64)"])
            body += [f"            for j in range({bound}):",
                     f"                t = t * 0.75 + {step}"]
        elif c == 1:
            body += ["            for j in ti.static(range(2)):",
                     f"                t += {_gexpr(r, leaves)} * (j + 1)"]
        elif c == 2:
            th = r.choice(["0.0", "0.4", "-0.4"])
            body += [f"            if y[i] > {th}:",
                     f"                t = {_gexpr(r, leaves)}",
                     f"            elif x[i] < {th}:",
                     f"                t += {_gexpr(r, leaves)}",
                     "            else:",
                     f"                t *= {_gexpr(r, leaves)}"]
        elif c == 3:
            body += [f"            v = ti.Vector([{_gexpr(r, leaves)}, {_gexpr(r, leaves)}, t])",
                     f"            m = ti.Matrix([[1.0, {_gexpr(r, leaves)}, 0.0], [0.5, t, 1.0],"
                     f" [{_gexpr(r, leaves)}, 0.0, 2.0]])",
                     "            t = " + r.choice(["(m @ v).dot(v) * 0.1", "v.norm()",
                                               "(m.transpose() @ v).sum()",
                                               "m.determinant() * 0.2 + v.norm_sqr()"])]
        elif c == 4:
            body += [f"            t = f(t, {_gexpr(r, leaves)})"]
        else:
            body += [f"            t = {_gexpr(r, leaves)}"]
    body += [f"            loss[None] += {_gexpr(r, leaves)}"]
    lines = [
        "import numpy as np", "", "", "def run(ti, hook=None):",
        "    ti.init(arch=ti.cpu, default_fp=ti.f64, fast_math=False)",
        "    n = 6",
        f"    rng = np.random.default_rng({seed})",
        "    x = ti.field(ti.f64, shape=n, needs_grad=True, needs_dual=True)",
        "    y = ti.field(ti.f64, shape=n, needs_grad=True, needs_dual=True)",
        "    sx = ti.Struct.field({'w': ti.f64}, shape=n, needs_grad=True, needs_dual=True)",
        "    loss = ti.field(ti.f64, shape=(), needs_grad=True, needs_dual=True)",
        "    xv = rng.uniform(-1.5, 1.5, n)",
        "    yv = (rng.integers(-7, 7, n) * 0.2 + 0.1) + rng.uniform(-0.03, 0.03, n)",
        "    wv = rng.uniform(-1, 1, n)",
        "",
        "    @ti.func",
        "    def f(a, b):",
        f"        return {_gexpr(r, ['a', 'b', '0.5'])}",
        "",
        "    @ti.kernel",
        "    def k():",
        "        for i in range(n):",
        *body,
        "",
        "    def forward(xa, ya, wa):",
        "        x.from_numpy(xa)",
        "        y.from_numpy(ya)",
        "        sx.w.from_numpy(wa)",
        "        loss[None] = 0.0",
        "        k()",
        "        return loss[None]",
        "",
        "    value = forward(xv, yv, wv)",
        "    with ti.ad.Tape(loss):",
        "        k()",
        "    tape = [x.grad.to_numpy(), y.grad.to_numpy(), sx.w.grad.to_numpy()]",
        "    forward(xv, yv, wv)",
        "    for g in (x.grad, y.grad, sx.w.grad):",
        "        g.fill(0.0)",
        "    loss.grad[None] = 1.0",
        "    k.grad()",
        "    manual = [x.grad.to_numpy(), y.grad.to_numpy(), sx.w.grad.to_numpy()]",
        # forward mode along a seed, checked against a directional central difference (the
        # parameter by the seed, not the generator's stream: older seeds keep their programs)
        "    sv = rng.uniform(-1, 1, n)",
        f"    which = {seed % 3}",
        "    for a, b in zip((x, y, sx.w), (xv, yv, wv), strict=True):",
        "        a.from_numpy(b)",
        "    loss[None] = 0.0",
        "    try:  # Taichi 1.7.4 aborts forward mode through most local vector arithmetic",
        "        with ti.ad.FwdMode(loss=loss, param=(x, y, sx.w)[which],",
        "                           seed=[float(v) for v in sv]):",
        "            k()",
        "        dual = {'dual': np.array([loss.dual[None]])}",
        "    except Exception as e:  # noqa: BLE001 - compared as a missing 'dual'",
        "        dual = {'_dual_error': repr(e)[:200]}",
        *central_differences("[xv, yv, wv]"),
        "    return {'loss': np.array([value]), 'tape': np.concatenate(tape),",
        "            'grad': np.concatenate(manual), '_fd': np.concatenate(fd), **dual,",
        "            '_fd_dir': np.array([(forward(*[b + 1e-6 * sv * (q == which) for q, b in",
        "                                            enumerate(base)]) -",
        "                                  forward(*[b - 1e-6 * sv * (q == which) for q, b in",
        "                                            enumerate(base)])) / 2e-6])}",
        ""]
    return "\n".join(lines)
