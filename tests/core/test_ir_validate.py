"""Decoding IR from an untrusted client: ``difftape.ir.validate.decode_untrusted``.

Round trips: every kernel of a representative set (each op the frontend emits, every
control-flow shape, vector/matrix/0-D/2-D fields, .grad buffers, integer types, returns,
asserts, an MPM-style scatter with svd and polar decomposition; plus random programs from
test_random_programs' generator) encodes, decodes and re-encodes to the same JSON, compiles,
and computes what the local kernel does. Targeted rejections: one malformed input per rule,
each refused with its reason and the path of the offending value, and the shapes that would
make a pass superlinear. A fuzzer: hypothesis mutates valid encodings (statements dropped,
duplicated, swapped, moved across blocks; ops, operands, attributes, dtypes and JSON types
changed; tables edited; deep nesting) and checks that ``decode_untrusted`` either raises
IRValidationError or returns IR that goes through derive (as the service does for grad/fwd),
the pass pipeline, compile_ir and, where that is safe, a launch, raising nothing but
DifftapeError subclasses (and never an LLVM rejection). A generator of random well-typed IR
checks the other direction: what the rules allow is accepted, compiles and runs.

Both searches are derandomized; ``DIFFTAPE_FUZZ_RANDOM=1`` with ``DIFFTAPE_FUZZ_EXAMPLES`` /
``DIFFTAPE_GEN_EXAMPLES`` runs a longer, random search.
"""

import copy
import itertools
import json
import linecache
import math
import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_random_programs import _compile, _expr

import difftape as ti
from difftape.errors import DifftapeError, IRValidationError
from difftape.frontend.kernel import compile_ir, derive, has_storage
from difftape.ir import serialize
from difftape.ir.nodes import ATOMIC_KINDS, OPS, walk
from difftape.ir.passes import run_pipeline
from difftape.ir.validate import (
    DEPTH_CEILING,
    INTERNAL_OPS,
    argument_names,
    decode_untrusted,
)
from difftape.runtime import program

pytestmark = pytest.mark.difftape_only

N = 8


def _wire(data):
    """What the server receives: the client's encoding through real JSON."""
    return json.loads(json.dumps(data))


def _compile_decoded(ir):
    ir = run_pipeline(ir)
    return compile_ir(ir, program.get(), arg_names=argument_names(ir))


# ----------------------------------------------------------------------------- the kernels


def _kernels():
    """(name, kernel, launch arguments) covering what the frontend emits."""
    x = ti.field(ti.f32, shape=N, needs_grad=True)
    y = ti.field(ti.f32, shape=N)
    d = ti.field(ti.f64, shape=(N, 3))
    n = ti.field(ti.i32, shape=N)
    u = ti.field(ti.u32, shape=N)
    b = ti.field(ti.i8, shape=N)
    w = ti.field(ti.i64, shape=())
    h = ti.field(ti.f16, shape=N)
    s = ti.field(ti.f32, shape=())
    v = ti.Vector.field(3, ti.f32, shape=N)
    m = ti.Matrix.field(2, 2, ti.f64, shape=N)

    @ti.kernel
    def unary(a: ti.f32):
        for i in x:
            t = x[i] + a
            y[i] = (ti.sin(t) + ti.cos(t) + ti.tan(t) + ti.asin(t * 0.1) + ti.acos(t * 0.1)
                    + ti.atan(t) + ti.tanh(t) + ti.exp(t * 0.01) + ti.log(ti.abs(t) + 1.0)
                    + ti.sqrt(ti.abs(t)) + ti.rsqrt(ti.abs(t) + 1.0) + ti.floor(t) + ti.ceil(t)
                    + ti.round(t) + (-t) + ti.stop_grad(t))

    @ti.kernel
    def binary(a: ti.f64, k: ti.i32) -> ti.f64:
        acc = 0.0
        for i in range(N):
            p = d[i, 0]
            q = d[i, 1] + a
            acc += p + q - p * q + p / (ti.abs(q) + 1.0) + p // (ti.abs(q) + 1.0)
            acc += ti.min(p, q) + ti.max(p, q) + ti.atan2(p, q) + ti.abs(p) ** 2.5 + p % 1.5
            acc += ti.select(p < q, p, q) + ti.cast(p <= q, ti.f64) + ti.cast(p > q, ti.f64)
            j = n[i] + k
            c = (j * 3 - 1) // 2 + j % 5 + ti.min(j, 4) + ti.max(j, 1) + ti.abs(j) + j ** 3
            c += (j & 6) | (j ^ 3) + (j << 2) + (j >> 1) + ~j
            c += ti.cast(ti.logical_and(j >= 2, j != 3), ti.i32) + ti.cast(not (j == 7), ti.i32)
            c += ti.cast(ti.logical_or(j > 5, j < 1), ti.i32) - ti.cast(q, ti.i32)
            c += ti.raw_div(j, 3) + ti.raw_mod(j, 4) + ti.math.clz(j) + ti.bit_cast(p, ti.i64)
            acc += ti.raw_mod(p, 0.7)
            acc += ti.cast(c, ti.f64)
        return acc

    @ti.kernel
    def integers(z: ti.u32):
        for i in u:
            u[i] = u[i] * z + ti.u32(4000000000) + u[i] // ti.u32(3) + (u[i] >> 2)
            b[i] = ti.cast(n[i], ti.i8) + ti.i8(-128)
            w[None] += ti.cast(n[i], ti.i64) * 9000000000

    @ti.kernel
    def halves():
        for i in h:
            h[i] = h[i] * ti.f16(0.5) + ti.cast(y[i], ti.f16)

    @ti.kernel
    def control() -> ti.i32:
        total = 0
        for _ in range(N):
            j = 0
            while j < 10:
                j += 1
                if j % 2 == 0:
                    continue
                if j > 6:
                    break
                total += j
        for i, k in ti.ndrange(N, 3):
            if d[i, k] > 0.5:
                d[i, k] = 0.0
            elif d[i, k] < -0.5:
                d[i, k] = 1.0
            else:
                d[i, k] *= 2.0
        ti.loop_config(serialize=True)
        for i in range(1, N):
            n[i] += n[i - 1]
        return total

    @ti.kernel
    def atomics():
        for i in x:
            ti.atomic_add(s[None], x[i])
            ti.atomic_sub(y[i], 1.0)
            ti.atomic_min(x[i], 0.5)
            ti.atomic_max(y[i], -0.5)
            ti.atomic_and(n[i], 6)
            ti.atomic_or(n[i], 1)
            ti.atomic_xor(u[i], ti.u32(5))
            ti.atomic_mul(y[(i + 1) % N], 1.5)
            ti.atomic_min(n[(i + 1) % N], 3)
            x.grad[i] += 2.0 * y[i]

    @ti.kernel
    def reductions() -> ti.f32:
        total = 0.0
        hi = -float("inf")
        for i in x:
            total += x[i]
            hi = ti.max(hi, x[i])
            ti.atomic_max(s[None], x[i])
        return total + hi

    @ti.kernel
    def vectors(a: ti.types.vector(3, ti.f32)) -> ti.types.vector(2, ti.f32):
        for i in v:
            v[i] = v[i] * 2.0 + a
            m[i] = m[i] @ m[i].transpose() + ti.Matrix.identity(ti.f64, 2)
            v[i][1] += v[i].norm()
        r = ti.Vector([v[0].dot(a), m[1][0, 1]], ti.f32)
        return r

    @ti.kernel
    def checks(k: ti.i32):
        assert k >= 0, "k must be non-negative"
        for i in x:
            assert x[i] < 1e6
            x[i] = ti.random(ti.f32) + ti.cast(ti.random(ti.i32) % 2, ti.f32) + x[(i + k) % N]

    pos = ti.Vector.field(2, ti.f32, shape=N, needs_grad=True)
    grad_f = ti.Matrix.field(2, 2, ti.f32, shape=N)
    grid = ti.Vector.field(2, ti.f32, shape=(16, 16))
    mass = ti.field(ti.f32, shape=(16, 16))

    @ti.kernel
    def scatter(dt: ti.f32):
        """A particle-to-grid transfer in the style of MLS-MPM (the service's workload)."""
        for p in pos:
            cell = ti.cast(pos[p] * 12.0 + 1.0, ti.i32)
            frac = pos[p] * 12.0 + 1.0 - ti.cast(cell, ti.f32)
            wts = [0.5 * (1.5 - frac) ** 2, 0.75 - (frac - 1.0) ** 2, 0.5 * (frac - 0.5) ** 2]
            fm = grad_f[p] + dt * ti.Matrix.identity(ti.f32, 2)
            rot, _ = ti.polar_decompose(fm)
            u, sig, vt = ti.svd(fm)
            stress = (fm - rot) @ fm.transpose() * 2.0 + u @ sig @ vt.transpose() * 0.01
            for a in ti.static(range(3)):
                for c in ti.static(range(3)):
                    wt = wts[a][0] * wts[c][1]
                    offset = (ti.Vector([float(a), float(c)]) - frac) / 12.0
                    grid[cell[0] + a - 1, cell[1] + c - 1] += wt * (stress @ offset)
                    mass[cell[0] + a - 1, cell[1] + c - 1] += wt

    rng = np.random.default_rng(0)
    pos.from_numpy(rng.uniform(0.2, 0.8, (N, 2)).astype(np.float32))
    grad_f.from_numpy(np.tile(np.eye(2, dtype=np.float32), (N, 1, 1)))
    x.from_numpy(rng.uniform(-1, 1, N).astype(np.float32))
    d.from_numpy(rng.uniform(-1, 1, (N, 3)))
    n.from_numpy(rng.integers(-5, 5, N).astype(np.int32))
    m.from_numpy(rng.uniform(-1, 1, (N, 2, 2)))
    return [("unary", unary, (0.25,)), ("binary", binary, (0.5, 2)),
            ("integers", integers, (3,)), ("control", control, ()),
            ("atomics", atomics, ()), ("reductions", reductions, ()),
            ("vectors", vectors, ((1.0, 2.0, 3.0),)), ("checks", checks, (1,)),
            ("scatter", scatter, (0.01,)), ("halves", halves, ())]


@pytest.fixture(scope="module")
def corpus():
    """name -> (kernel, args, wire encoding of its frontend IR), in a debug program (asserts
    emitted, as the service compiles everything with bounds checks)."""
    ti.init(arch=ti.cpu, debug=True, offline_cache=False)
    out = {name: (k, args, _wire(serialize.encode(k.build_ir(program.get(), ()))))
           for name, k, args in _kernels()}
    yield out
    ti.reset()


# The fuzzer starts from the small ones (scatter is large: slow to compile many times).
KERNEL_NAMES = ["unary", "binary", "integers", "control", "atomics", "reductions", "vectors",
                "checks"]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", KERNEL_NAMES + ["scatter", "halves"])
def test_round_trip_and_compile(corpus, name):
    kernel, args, data = corpus[name]
    if name == "halves":
        with pytest.raises(IRValidationError, match=r"buffers\[\d\]\[1\]: f16 is not accepted"):
            decode_untrusted(data, allow_f16=False)
    ir = decode_untrusted(data)
    assert serialize.encode(ir) == data
    assert _wire(serialize.encode(ir)) == data
    compiled = _compile_decoded(ir)
    if name in ("binary", "control", "reductions"):  # results that do not depend on history
        local = kernel(*args)
        remote = compiled.launch(args)
        assert remote == pytest.approx(local, rel=1e-6)


def _locations(ir):
    return [s.loc for s in walk(ir.body)]


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_statements_keep_their_locations_through_the_wire(corpus, name):
    """Every statement's file, line and text survive encode -> JSON -> decode (trusted and
    untrusted): what a server's message quotes is what the client's would."""
    kernel, _, data = corpus[name]
    built = kernel.build_ir(program.get(), ())
    want = _locations(built)
    assert all(loc is not None and loc.file == __file__ and loc.text for loc in want)
    assert all(loc.text == linecache.getline(loc.file, loc.line).strip() for loc in want)
    assert _locations(decode_untrusted(data)) == want
    assert _locations(serialize.decode(data)) == want
    # One table entry per source line, not per statement; runs cover every statement.
    locs = data["locations"]
    assert len(locs["lines"]) == len(set(want)) and sum(locs["runs"][1::2]) == len(want)


def test_locations_are_part_of_a_kernels_identity_but_not_of_its_code():
    """Two kernels that differ only in where they are written: different ids on the service
    (their messages differ), one object code in the compile cache."""
    x = ti.field(ti.f32, shape=4)

    def make():
        @ti.kernel
        def k():
            for i in x:
                x[i] += 1.0

        return k

    a, b = make(), make()
    ir_a = a.build_ir(program.get(), ())
    ir_b = b.build_ir(program.get(), ())
    for s in walk(ir_b.body):  # as if the same kernel stood 10 lines lower
        s.loc = s.loc._replace(line=s.loc.line + 10)
    assert serialize.fingerprint(ir_a) != serialize.fingerprint(ir_b)
    assert serialize.fingerprint(ir_a, locations=False) == \
        serialize.fingerprint(ir_b, locations=False)


def test_every_frontend_op_is_covered(corpus):
    """The corpus exercises every op a client may send (the fuzzer starts from it)."""
    seen = set()
    for _, _, data in corpus.values():
        stack = [data["body"]]
        while stack:
            for op, _, _, _, blocks in stack.pop():
                seen.add(op)
                stack.extend(blocks)
    internal = set(INTERNAL_OPS)  # refused from clients
    internal.add("print")  # tested below (a corpus kernel that prints would print here)
    # buf_shape is ndarray-only (tested below).
    assert set(OPS) - internal - {"buf_shape"} <= seen, set(OPS) - internal - seen


def _with_print(corpus, conversion: str) -> dict:
    """A corpus kernel with ``print("v =", 7)`` (an i32 constant) appended."""
    _, _, data = corpus["integers"]
    data = json.loads(json.dumps(data))
    count, stack = 0, [data["body"]]  # statements are numbered in order, nested ones too
    while stack:
        for _, _, _, _, blocks in stack.pop():
            count += 1
            stack.extend(blocks)
    data.pop("locations", None)
    data["body"].append(["const", "i32", [], 7, []])
    data["body"].append(["print", None, [count], {"t": ["v = ", conversion, "\n"]}, []])
    return data


def test_print_is_accepted_with_printf_conversions_only(corpus):
    """print() runs on the server (its lines go back to the client): the wire format takes
    it, with the conversion the operand's type allows and nothing else; a conversion that
    would make C's printf read memory (%s, %n) or the wrong register is refused."""
    ir = decode_untrusted(_with_print(corpus, "%d"))
    assert any(s.op == "print" for s in walk(ir.body))
    for bad in ("%s", "%n", "%f", "%lld", "%*d", "d"):
        with pytest.raises(IRValidationError):
            decode_untrusted(_with_print(corpus, bad))


def test_ndarray_buffers_are_a_parameter(corpus):
    @ti.kernel
    def scale(a: ti.types.ndarray(), k: ti.f32):
        for i in range(a.shape[0]):
            a[i] *= k

    arr = np.ones(4, np.float32)
    _, spec = scale._specialize((arr, 2.0))
    data = _wire(serialize.encode(scale.build_ir(program.get(), spec)))
    with pytest.raises(IRValidationError, match=r"buffers\[0\]\[0\]: .*ndarray arguments are "
                                                r"not accepted"):
        decode_untrusted(data)
    ir = decode_untrusted(data, allow_ndarray=True)
    assert serialize.encode(ir) == data
    _compile_decoded(ir).launch((arr, 3.0))
    np.testing.assert_array_equal(arr, 3.0)


def test_field_offsets_travel_with_their_buffers(corpus):
    """A field's offset= is part of its buffer on the wire (the IR indexes from 0; the
    bounds checks compiled where it arrives report the user's index with it)."""
    x = ti.field(ti.f32, shape=8, offset=-4)
    y = ti.Vector.field(2, ti.f32, shape=(2, 3), offset=(0, 7))
    z = ti.field(ti.f32, shape=8)

    @ti.kernel
    def poke(i: ti.i32):
        x[i] = z[i % 8] + y[1, 9][1]

    data = _wire(serialize.encode(poke.build_ir(program.get(), ())))
    assert {b[3]: b[4:] for b in data["buffers"]} == {"x": [0, [-4]], "z": [0],
                                                      "y": [1, [0, 7]]}
    ir = decode_untrusted(data)
    assert {b.name: b.offset for b in ir.buffers} == {"x": (-4,), "z": (), "y": (0, 7)}
    assert serialize.encode(ir) == data
    assert serialize.decode(data).buffers == ir.buffers
    compiled = _compile_decoded(ir)
    compiled.launch((-4,))
    with pytest.raises(ti.IndexOutOfRangeError, match=r"index 4 out of range for axis 0 of "
                                                      r"'x' with shape \(8,\) and offset "
                                                      r"\(-4,\)"):
        compiled.launch((4,))
    nd = copy.deepcopy(data)
    (k,) = [k for k, b in enumerate(nd["buffers"]) if b[3] == "x"]
    nd["buffers"][k][0]["t"][:2] = ["ndarray", 0]
    nd["buffers"][k][2] = [None]
    with pytest.raises(IRValidationError, match=rf"buffers\[{k}\]\[5\]: only a field's "
                                                "buffer has an offset"):
        decode_untrusted(nd, allow_ndarray=True)


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(expr=_expr(), shape=st.sampled_from(["line", "branch", "loop"]))
def test_random_programs_round_trip(corpus, tmp_path_factory, expr, shape):
    text, _ = expr
    body = {"line": [f"out[i] = {text}"],
            "branch": ["if b[i] > 0.0:", f"    out[i] = {text}", "else:", f"    out[i] = -{text}"],
            "loop": ["acc = 0.0", "for k in range(3):", f"    acc += {text}", "    t += 0.1",
                     "out[i] = acc"]}[shape]
    src = "\n".join(["import difftape as ti", "", "def make(a, b, c, out):", "    @ti.kernel",
                     "    def k():", "        for i in out:", "            t = a[i] * 0.5",
                     *("            " + line for line in body), "    return k", ""])
    ns = _compile(src, tmp_path_factory.mktemp("prog"), "prog")
    kernel = ns["make"](*(ti.field(ti.f32, shape=N) for _ in range(4)))
    data = _wire(serialize.encode(kernel.build_ir(program.get(), ())))
    ir = decode_untrusted(data)
    assert serialize.encode(ir) == data
    _compile_decoded(ir)


# ----------------------------------------------------------------------------- rejections


@pytest.fixture
def base(corpus):
    """A small valid encoding to break: ``for i in x: y[i] = x[i] * a`` and an int field."""
    x, y = ti.field(ti.f32, shape=N), ti.field(ti.f32, shape=N)
    n = ti.field(ti.i32, shape=N)

    @ti.kernel
    def k(a: ti.f32) -> ti.f32:
        for i in x:
            y[i] = x[i] * a
            n[i] += 1
        return a

    return _wire(serialize.encode(k.build_ir(program.get(), ())))


def _loop_body(data):
    return next(st for st in data["body"] if st[0] == "range_for")[4][0]


def _index(data, op, block=None):
    block = data["body"] if block is None else block
    return next(k for k, st in enumerate(block) if st[0] == op)


def _body_pos(data, op):
    """Absolute statement number and in-block index of the first ``op`` in the loop body."""
    top = _index(data, "range_for")
    k = _index(data, op, _loop_body(data))
    return top + 1 + k, k


def _set(data, where, value):
    """Set ``data`` at a path given as a tuple of keys/indices."""
    if not isinstance(where, tuple):
        where = (where,)
    obj = data
    for key in where[:-1]:
        obj = obj[key]
    obj[where[-1]] = value


def _mutations():
    """(description, mutate(data) -> data or None, expected path, reason regex, options)."""
    L = lambda data: _loop_body(data)
    loop = lambda d: _index(d, "range_for")

    def body_stmt(d, op):
        return L(d)[_index(d, op, L(d))]

    def top_stmt(d, op):
        return d["body"][_index(d, op)]

    def stmt_path(d, op):
        return rf"body\[{loop(d)}\]\.blocks\[0\]\[{_index(d, op, L(d))}\]"

    out = []

    def case(desc, fn, path, reason, **opts):
        out.append((desc, fn, path, reason, opts))

    case("not an object", lambda d: [d], r"\$", "must be a JSON object")
    case("offloaded form", lambda d: {**d, "tasks": []}, r"\$", "offloaded IR .* not accepted")
    case("missing key", lambda d: {k: v for k, v in d.items() if k != "returns"}, r"\$",
         "missing key 'returns'")
    case("unknown key", lambda d: {**d, "exec": "x"}, r"\$", "unknown key 'exec'")
    case("name injects LLVM", lambda d: {**d, "name": "k(ptr %c) {\nret void\n}"}, "name",
         "unprintable|ASCII identifier")
    case("name not ASCII", lambda d: {**d, "name": "k é"}, "name", "ASCII identifier")
    case("name too long", lambda d: {**d, "name": "k" * 500}, "name", "1 to 128 characters")
    case("debug not bool", lambda d: {**d, "debug": 1}, "debug", "must be a boolean")
    case("unknown dtype", lambda d: _set(d, ("params", 0, 1), "f128"), r"params\[0\]\[1\]",
         "unknown dtype 'f128'")
    case("param name", lambda d: _set(d, ("params", 0, 0), "a b"), r"params\[0\]\[0\]",
         "ASCII identifier")
    case("param components", lambda d: _set(d, "params", [["v[1]", "f32"]]),
         r"params\[0\]\[0\]", "out of order")
    case("param repeated", lambda d: _set(d, "params", [["a", "f32"], ["a", "f32"]]),
         r"params\[1\]\[0\]", "repeats a name")
    case("too many params", lambda d: _set(d, "params", [[f"p{k}", "f32"] for k in range(9)]),
         "params", "9 parameters, at most 8", max_params=8)
    case("ndarray buffer", lambda d: _set(d, ("buffers", 0, 0, "t", 0), "ndarray"),
         r"buffers\[0\]\[0\]", "ndarray arguments are not accepted")
    case("internal role", lambda d: _set(d, ("buffers", 0, 0, "t", 2), "grad_dual"),
         r"buffers\[0\]\[0\]", "role 'grad_dual'")
    case("float marks", lambda d: _set(d, ("buffers", 0, 0, "t", 2), "mark"),
         r"buffers\[0\]\[1\]", "a .mark buffer holds i8, not f32")
    case("field id 0", lambda d: _set(d, ("buffers", 0, 0, "t", 1), 0), r"buffers\[0\]\[0\]",
         "field id must be an integer >= 1")
    case("field id bool", lambda d: _set(d, ("buffers", 0, 0, "t", 1), True),
         r"buffers\[0\]\[0\]", "field id must be an integer")
    case("key as list", lambda d: _set(d, ("buffers", 0, 0), ["field", 1, "primal"]),
         r"buffers\[0\]\[0\]", "a buffer key is")
    case("duplicate buffer", lambda d: _set(d, ("buffers", 1, 0), d["buffers"][0][0]),
         r"buffers\[1\]\[0\]", "appears twice")
    case("grad of ints", lambda d: _set(d, ("buffers", 2, 0, "t", 2), "grad"),
         r"buffers\[2\]\[1\]", "holds floats")
    case("zero extent", lambda d: _set(d, ("buffers", 0, 2), [0]), r"buffers\[0\]\[2\]\[0\]",
         "extents are integers 1 to")
    case("float extent", lambda d: _set(d, ("buffers", 0, 2), [8.0]), r"buffers\[0\]\[2\]\[0\]",
         "extents are integers")
    case("too many elements", lambda d: _set(d, ("buffers", 0, 2), [1 << 20, 1 << 20]),
         r"buffers\[0\]\[2\]", "more than 2147483648 elements")
    case("element_ndim", lambda d: _set(d, ("buffers", 0, 4), 3), r"buffers\[0\]\[4\]",
         "element_ndim must be an integer 0 to 2")
    case("element_ndim > ndim", lambda d: _set(d, ("buffers", 0, 4), 2), r"buffers\[0\]\[2\]",
         "element_ndim 2")
    # A field's offset= (the index of its first element), a sixth entry where there is one.
    case("offset", lambda d: d["buffers"][0].append([-4]), None, None)  # allowed
    case("offset zeros", lambda d: d["buffers"][0].append([0]), r"buffers\[0\]\[5\]",
         "an offset of zeros is written as none")
    case("offset axes", lambda d: d["buffers"][0].append([1, 2]), r"buffers\[0\]\[5\]",
         r"one entry per field axis \(1\), got 2")
    case("offset float", lambda d: d["buffers"][0].append([1.5]), r"buffers\[0\]\[5\]\[0\]",
         "offsets are integers")
    case("offset past i32", lambda d: d["buffers"][0].append([2**31 - 8]),
         r"buffers\[0\]\[5\]\[0\]", r"keeping the indices i32 \(extent 8\)")
    case("offset below i32", lambda d: d["buffers"][0].append([-2**31 - 1]),
         r"buffers\[0\]\[5\]\[0\]", "keeping the indices i32")
    case("seven entries", lambda d: d["buffers"][0].extend([[1], 0]), r"buffers\[0\]",
         "a buffer is .* got 7 entries")
    case("too many buffers", lambda d: _set(d, "buffers", d["buffers"] * 2), "buffers",
         "6 buffers, at most 4", max_buffers=4)
    case("statement shape", lambda d: L(d).append(["load", "f32"]),
         r"body\[\d+\]\.blocks\[0\]\[\d+\]", r"a statement is \[op, dtype, args, attr, blocks\]")
    case("unknown op", lambda d: _set(body_stmt(d, "mul"), 0, "system"), None,
         "unknown op 'system'")
    case("internal op", lambda d: _set(body_stmt(d, "mul"), 0, "stack_pop"), None,
         "op 'stack_pop' is internal to the compiler")
    case("temp op", lambda d: _set(body_stmt(d, "store"), 0, "temp_store"), None,
         "op 'temp_store' is internal")
    case("arity", lambda d: _set(body_stmt(d, "mul"), 2, body_stmt(d, "mul")[2][:1]), None,
         "op 'mul' takes 2 operands, got 1")
    case("arity 1", lambda d: _set(body_stmt(d, "mul"), 0, "neg"), None,
         "op 'neg' takes 1 operand, got 2")
    case("blocks", lambda d: _set(top_stmt(d, "range_for"), 4, []), r"body\[\d+\]",
         "op 'range_for' takes 1 block, got 0")
    case("later operand", lambda d: _set(body_stmt(d, "mul"), 2, [10_000, 0]), None,
         r"operand 0 \(10000\) must be the number of an earlier statement")
    case("negative operand", lambda d: _set(body_stmt(d, "mul"), 2, [-1, 0]), None,
         "operand 0 .* earlier statement")
    case("bool operand", lambda d: _set(body_stmt(d, "mul"), 2, [True, 0]), None,
         "operand 0 .* earlier statement")
    case("out of scope", lambda d: d["body"].append(
        ["neg", "f32", [_body_pos(d, "mul")[0]], None, []]), r"body\[\d+\]",
         r"operand 0 \(body\[\d+\]\.blocks\[0\]\[\d+\]\) does not dominate")
    case("store as operand", lambda d: L(d).append(
        ["neg", "f32", [_body_pos(d, "store")[0]], None, []]),
         r"body\[\d+\]\.blocks\[0\]\[\d+\]", r"op 'store'\) has no value")
    case("alloca as value", lambda d: (d["body"].insert(0, ["alloca", "f32", [], None, []]),
                                       d["body"].insert(1, ["neg", "f32", [0], None, []])),
         None, "operand 0 is an alloca", renumber=True)
    case("load index count", lambda d: _set(body_stmt(d, "load"), 2,
                                            body_stmt(d, "load")[2] * 2), None,
         r"op 'load' takes 1 index per buffer axis \('x' has 1\), got 2")
    case("load slot", lambda d: _set(body_stmt(d, "load"), 3, 7), None,
         r"buffer slot 7 out of range \(the kernel has 3 buffers\)")
    case("load slot type", lambda d: _set(body_stmt(d, "load"), 3, "0"), None,
         "buffer slot '0' out of range")
    case("load dtype", lambda d: _set(body_stmt(d, "load"), 1, "f64"), None,
         r"op 'load' on 'x' \(f32\) gives f64")
    case("store value dtype", lambda d: _set(body_stmt(d, "mul"), 1, "i32"), None,
         "op 'mul' mixes f32 and f32 and i32")
    case("index dtype", lambda d: _set(body_stmt(d, "loop_index"), 1, "i64"), None,
         "loop indices are i32, not i64")
    case("atomic kind", lambda d: _set(body_stmt(d, "atomic"), 3, {"t": [2, "div"]}), None,
         "atomic kind 'div' is not one of")
    case("float bit atomic", lambda d: _set(body_stmt(d, "atomic"), 3, {"t": [2, "bit_and"]}),
         None, "atomic bit_and needs an integer type", retype_atomic="f32")
    case("u1 atomic", _u1_atomic, None, "atomics on u1 are not supported")
    case("atomic attr", lambda d: _set(body_stmt(d, "atomic"), 3, 2), None,
         r"atomic takes \(buffer slot, kind\)")
    case("attr list", lambda d: _set(body_stmt(d, "atomic"), 3, [2, "add"]), None,
         "an attribute is null, a number, a string or .*, got an array")
    case("attr object", lambda d: _set(body_stmt(d, "atomic"), 3, {"u": 1}), None,
         r'a tuple attribute is \{"t": \[scalars\]\}')
    case("loop_index outside", lambda d: d["body"].append(["loop_index", "i32", [], 0, []]),
         r"body\[\d+\]", "loop_index of loop 0, which does not enclose it")
    case("arg index", lambda d: _set(top_stmt(d, "arg"), 3, 5), r"body\[0\]",
         r"argument index 5 out of range \(the kernel has 1 parameters\)")
    case("arg dtype", lambda d: _set(top_stmt(d, "arg"), 1, "f64"), r"body\[0\]",
         "argument 0 is f32, read as f64")
    case("return slot", lambda d: _set(top_stmt(d, "return"), 3, 1), r"body\[\d+\]",
         r"return slot 1 out of range \(the kernel returns 1 values\)")
    case("return dtype", lambda d: _set(d, "returns", ["i32"]), r"body\[\d+\]",
         "return slot 0 is i32, given f32")
    case("nested return", lambda d: L(d).append(["return", None, [0], 0, []]), None,
         "return is at the top level")
    case("int const type", lambda d: _set(top_stmt(d, "const"), 3, 1.0), r"body\[\d+\]",
         r"a i32 constant is an integer in \[-2147483648, 2147483648\), got 1.0")
    case("int const range", lambda d: _set(top_stmt(d, "const"), 3, 1 << 40), r"body\[\d+\]",
         "a i32 constant is an integer in")
    case("bool const", lambda d: _set(top_stmt(d, "const"), 3, True), r"body\[\d+\]",
         "got a boolean")
    case("float const type", lambda d: L(d).append(["const", "f32", [], 1, []]), None,
         "a f32 constant is a number with a decimal point, got 1")
    case("f32 range", lambda d: L(d).append(["const", "f32", [], 1e39, []]), None,
         "1e[+]?39 is out of range for f32")
    case("f16 exact", lambda d: L(d).append(["const", "f16", [], 0.1, []]), None,
         "0.1 is not exactly representable in f16", allow_f16=True)
    case("f16 refused", lambda d: L(d).append(["const", "f16", [], 0.5, []]),
         r"body\[\d+\]\.blocks\[0\]\[\d+\]\.dtype", "f16 is not accepted", allow_f16=False)
    case("nan refused", lambda d: L(d).append(["const", "f32", [], math.nan, []]), None,
         "non-finite constant nan", allow_nonfinite=False)
    case("const attr string", lambda d: L(d).append(["const", "f32", [], "1.0", []]), None,
         "a f32 constant is a number")
    case("assert message", lambda d: L(d).append(
        ["assert", None, [_body_pos(d, "loop_index")[0]], 7, []]), None,
         "an assert message is .* around its 0 values")
    # A message with values: template (text, spec, text, ...) around the operands after the
    # condition (ir/assertfmt.py); specs of a strict grammar, bounded, of the value's kind.
    case("assert values", lambda d: L(d).append(
        ["assert", None, [_body_pos(d, "loop_index")[0]] * 2, {"t": ["i=", "%5d", "!"]}, []]),
         None, None)  # allowed
    case("assert template length", lambda d: L(d).append(
        ["assert", None, [_body_pos(d, "loop_index")[0]] * 2, {"t": ["i=", "", "!", "", ""]},
         []]), None, "around its 1 values")
    case("assert spec grammar", lambda d: L(d).append(
        ["assert", None, [_body_pos(d, "loop_index")[0]] * 2, {"t": ["i=", "{0.__class__}", ""]},
         []]), None, "not a supported conversion")
    case("assert spec width", lambda d: L(d).append(
        ["assert", None, [_body_pos(d, "loop_index")[0]] * 2, {"t": ["i=", "%999999d", ""]},
         []]), None, "not a supported conversion")
    case("assert spec kind", lambda d: L(d).append(
        ["assert", None, [_body_pos(d, "loop_index")[0], _body_pos(d, "load")[0]],
         {"t": ["x=", "%x", ""]}, []]), None, "shows an integer, the value is f32")
    case("assert too many values", lambda d: L(d).append(
        ["assert", None, [_body_pos(d, "loop_index")[0]] * 34, {"t": [""] * 67}, []]), None,
         "op 'assert' takes at most 33 operands")
    case("assert float cond", lambda d: L(d).append(["assert", None, [_body_pos(d, "load")[0]],
                                                     "m", []]), None,
         "an assert condition must be an integer")
    case("long message", lambda d: L(d).append(["assert", None, [_body_pos(d, "loop_index")[0]],
                                                "m" * 5000, []]), None,
         "attribute string longer than 1024")
    case("break outside loop", lambda d: d["body"].append(["break", None, [], None, []]),
         r"body\[\d+\]", "break outside a loop")
    case("break parallel", lambda d: L(d).append(["break", None, [], None, []]), None,
         "`break` out of a parallel loop")
    case("continue attr", lambda d: L(d).append(["continue", None, [], None, []]), None,
         None)  # allowed
    case("nested parallel", lambda d: L(d).append(
        ["range_for", None, [0, 0], {"t": [9, "parallel"]}, [[]]]), None,
         "only top-level loops are parallel", const_bounds=True)
    case("loop flags", lambda d: _set(top_stmt(d, "range_for"), 3, {"t": [0, "gpu"]}),
         r"body\[\d+\]", r"range_for takes \(loop id, one of parallel, serial, inner\)")
    case("duplicate loop id", lambda d: L(d).append(
        ["range_for", None, [0, 0], {"t": [0, "inner"]}, [[]]]), None,
         "loop id 0 is used by another loop", const_bounds=True)
    case("float loop bound", lambda d: L(d).append(
        ["range_for", None, [_body_pos(d, "load")[0]] * 2, {"t": [5, "inner"]}, [[]]]), None,
         "range bound 0 is f32; loop bounds are i32")
    # ti.raw_div of integers; the lowering never traps (a zero divisor gives 0)
    case("int div", lambda d: L(d).append(["div", "i32", [_body_pos(d, "loop_index")[0]] * 2,
                                           None, []]), None, None)  # allowed
    case("float if", lambda d: L(d).append(["if", None, [_body_pos(d, "load")[0]], None,
                                            [[], []]]), None,
         "an if condition must be an integer")
    case("sin of int", lambda d: L(d).append(["sin", "i32", [_body_pos(d, "loop_index")[0]],
                                              None, []]), None,
         "op 'sin' needs a float operand, not i32")
    case("cmp result", lambda d: L(d).append(["lt", "f32", [_body_pos(d, "load")[0]] * 2, None,
                                              []]), None, "op 'lt' gives i32, not f32")
    case("binary attr", lambda d: _set(body_stmt(d, "mul"), 3, "reassoc"), None,
         r"op 'mul' takes no attribute \(null\), got 'reassoc'")
    case("if attr", lambda d: L(d).append(["if", None, [_body_pos(d, "loop_index")[0]], 0,
                                           [[], []]]), None, "op 'if' takes no attribute")
    case("constant shift", lambda d: (L(d).append(["const", "i32", [], 40, []]), L(d).append(
        ["shl", "i32", [_body_pos(d, "loop_index")[0], _body_pos(d, "loop_index")[0] +
                        len(L(d)) - 1 - _body_pos(d, "loop_index")[1]], None, []])), None,
         "shift by 40: a i32 shifts by 0 to 31")
    case("no result type", lambda d: _set(body_stmt(d, "mul"), 1, None), None,
         "op 'mul' needs a result type")
    case("store result type", lambda d: _set(body_stmt(d, "store"), 1, "f32"), None,
         "op 'store' must have no result type")
    case("too many statements", lambda d: None, r"body\[\d+\]",
         "more than 3 statements", max_stmts=3)
    case("too deep", lambda d: _set(d, "body", _nest(d["body"], 10)),
         r"body(\[0\]\.blocks\[0\]){8}", "blocks nested deeper than 8", max_depth=8)
    return out


def _u1_atomic(data):
    """The atomic on n (i32) becomes an atomic on a u1 buffer (LLVM has no 1-bit atomics)."""
    data["buffers"][2][1] = "u1"
    for st_ in _loop_body(data):
        if st_[0] == "atomic":
            st_[1] = "u1"
        if st_[0] == "const" and st_[1] == "i32" and st_[3] == 1:
            st_[1] = "u1"


def _nest(block, depth):
    """``block`` inside ``depth`` while loops (numbering is unchanged: each while adds one
    statement before the block, so operand numbers shift; the depth check comes first)."""
    for _ in range(depth):
        block = [["while", None, [], None, [block]]]
    return block


MUTATIONS = _mutations()


@pytest.mark.parametrize("desc, fn, path, reason, opts", MUTATIONS,
                         ids=[m[0] for m in MUTATIONS])
def test_malformed_input_is_rejected_with_its_reason(base, desc, fn, path, reason, opts):
    data = copy.deepcopy(base)
    options = {k: v for k, v in opts.items()
               if k in ("max_stmts", "max_depth", "max_buffers", "max_params",
                        "allow_nonfinite", "allow_f16")}
    if opts.get("const_bounds"):
        top = _index(data, "range_for")
        data["body"][top][2] = [0, 1]  # the loop bounds are statements 0 and 1 (consts)
    if opts.get("retype_atomic"):  # the atomic on n (i32) becomes a float atomic
        data["buffers"][2][1] = opts["retype_atomic"]
        for st_ in _loop_body(data):
            if st_[0] == "atomic":
                st_[1] = "f32"
            if st_[0] == "const" and st_[1] == "i32" and st_[3] == 1:
                st_[1], st_[3] = "f32", 1.0
    result = fn(data)
    if isinstance(result, dict | list):
        data = result
    if opts.get("renumber"):
        data = _renumber_after_insert(base, data)
    # The edits add or remove statements, which the location table's runs would no longer
    # cover (test_locations_* test the table).
    if isinstance(data, dict):
        data.pop("locations", None)
    if reason is None:
        decode_untrusted(data, **options)
        return
    with pytest.raises(IRValidationError) as info:
        decode_untrusted(data, **options)
    msg = str(info.value)
    assert re.search(reason, msg), msg
    if path is not None:
        assert re.match(path + ":", msg), msg
        assert info.value.path is not None and re.fullmatch(path, info.value.path), msg


def _renumber_after_insert(base, data):
    """Two statements were inserted at the front of the body: shift the old operands."""
    def shift(block):
        for st_ in block:
            st_[2] = [a + 2 for a in st_[2]]
            for b in st_[4]:
                shift(b)
    shift(data["body"][2:])
    return data


def test_limits_are_checked_before_recursing():
    deep = {"name": "k", "params": [], "buffers": [], "returns": [], "debug": True,
            "body": _nest([], 5000)}
    with pytest.raises(IRValidationError, match="nested deeper than 64"):
        decode_untrusted(deep)
    with pytest.raises(ValueError):
        decode_untrusted(deep, max_depth=DEPTH_CEILING + 1)
    # The deepest nesting accepted goes through the (recursive) passes and the lowering.
    ok = {**deep, "body": _nest([], 63)}
    _compile_decoded(decode_untrusted(ok))
    wide = {**deep, "body": [["if", None, [0], None, [[], []]]] * 10}
    with pytest.raises(IRValidationError, match=r"body\[0\]: operand 0 \(0\) must be"):
        decode_untrusted(wide)


def _with_parallel_use(body, value):
    """``body`` followed by ``for i in x: x[i] = <statement value>`` (x: buffer 0)."""
    n = len(body)
    return body + [["const", "i32", [], 0, []], ["const", "i32", [], N, []],
                   ["range_for", None, [n, n + 1], {"t": [0, "parallel"]},
                    [[["loop_index", "i32", [], 0, []], ["store", None, [n + 3, value], 0, []]]]]]


def test_a_flood_of_assert_messages_is_refused(base):
    data = copy.deepcopy(base)
    data["buffers"], data["params"], data["returns"] = data["buffers"][:1], [["a", "f32"]], []
    data["body"] = [["const", "i32", [], 1, []]] + [
        ["assert", None, [0], f"message {k}", []] for k in range(1100)]
    with pytest.raises(IRValidationError, match=r"body\[1025\]: more than 1024 distinct"):
        decode_untrusted(data)


@pytest.mark.parametrize("shape", ["doubling", "chain", "locals"])
def test_shapes_that_were_superlinear_compile_in_linear_time(base, shape):
    """Offload once recomputed top-level expressions by an unmemoized recursive walk (a
    doubling chain took 2**30 calls, a 3000-op chain overflowed Python's stack) and DCE took
    one round per dead local (quadratic); the validator refused these shapes. Now both passes
    are linear in them: accepted, compiled, and right."""
    data = copy.deepcopy(base)
    data["buffers"], data["params"], data["returns"] = data["buffers"][:1], [["a", "f32"]], []
    del data["locations"]  # of the statements replaced here
    arg = ["arg", "f32", [], 0, []]
    if shape == "doubling":  # x = x + x, 30 times
        body = [arg] + [["add", "f32", [k, k], None, []] for k in range(30)]
        data["body"] = _with_parallel_use(body, 30)
        expected = 2.0 ** 30
    elif shape == "chain":  # x = x * a, 3000 times
        body = [arg] + [["mul", "f32", [k, 0], None, []] for k in range(3000)]
        data["body"] = _with_parallel_use(body, 3000)
        expected = 1.0
    else:  # a = arg; b = a; c = b; ... 5000 locals, then x[i] = the last
        body = [arg]
        for _ in range(5000):
            body += [["alloca", "f32", [], None, []],
                     ["local_store", None, [len(body), len(body) - 1], None, []],
                     ["local_load", "f32", [len(body)], None, []]]
        data["body"] = _with_parallel_use(body, len(body) - 1)
        expected = 1.0
    ir = decode_untrusted(data)
    buffer = program.get().fields[ir.buffers[0].key[1]]
    kernel = _compile_decoded(ir)
    kernel.launch((1.0,))
    assert (buffer.to_numpy() == expected).all()


def _deep(depth):
    """A list nested ``depth`` deep (built iteratively; json.loads stops near 1000, a caller
    handing over Python objects need not)."""
    x = []
    for _ in range(depth):
        x = [x]
    return x


@pytest.mark.parametrize("where", [("body", 0, 0), ("body", 0, 1), ("body", 0, 2),
                                   ("body", 0, 3), ("body", 0, 4), ("buffers", 0, 0),
                                   ("buffers", 0, 2), ("params", 0, 1), ("returns", 0),
                                   ("name",), ("unknown",)])
def test_deeply_nested_values_anywhere_are_rejected_without_recursion(base, where):
    """Messages never ``repr`` a client's container or huge integer (a RecursionError or
    ValueError there would escape as a crash)."""
    for bad in (_deep(100_000), 10**5000):
        data = copy.deepcopy(base)
        _set(data, where, bad)
        with pytest.raises(IRValidationError):
            decode_untrusted(data)
    with pytest.raises(IRValidationError, match="unknown key 'xxxx"):
        decode_untrusted({**base, "x" * 10**6: 1})


def test_component_indices_must_be_constants_in_range(corpus):
    data = copy.deepcopy(corpus["vectors"][2])
    slot = next(k for k, b in enumerate(data["buffers"]) if b[4] == 1)

    def first_load(block):
        for st_ in block:
            if st_[0] == "load" and st_[3] == slot:
                return st_
            for b in st_[4]:
                found = first_load(b)
                if found:
                    return found
        return None

    load = first_load(data["body"])
    load[2][1] = load[2][0]  # the component index becomes the loop index
    with pytest.raises(IRValidationError, match="selects a vector/matrix component of 'v': "
                                                r"it must be a constant in \[0, 3\)"):
        decode_untrusted(data)


# ----------------------------------------------------------------------------- the fuzzer
#
# Mutations work on a tree whose operands are references to statement nodes, re-numbered when
# flattened back to JSON: a duplicated or moved statement keeps pointing at its operands, so
# many mutants stay well-formed enough to reach the verifier's type and scope rules and the
# compiler behind them. Raw JSON mutations (wrong types, dangling numbers) come on top.

ATTRS = [None, 0, 1, 2, -1, 7, 1 << 40, 0.5, -0.0, math.inf, "add", "bit_and", "parallel",
         "x" * 1100, True, [], [0], {}, {"t": [0, "parallel"]}, {"t": [0, "inner"]},
         {"t": [1, "add"]}, {"t": [0, "bit_or"]}, {"t": [0, 0]}, {"t": [3, "min"]},
         {"t": [0, "bogus"]}, {"t": [[1], 2]}, {"t": [0, 1, 2, 3, 4, 5]}, {"t": 5}]
DTYPES = ["f32", "f64", "f16", "i32", "i64", "i8", "u32", "u64", "u8", "u16", "i16"]
BAD_DTYPES = [None, "bool", 3, ""]
JSON_VALUES = [None, 0, -1, 1.5, "s", True, [], [[]], {}, {"t": []}, [None] * 5]
CONSTS = [0, 1, -1, 127, -128, 255, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1, -(2**63),
          2**64 - 1, 0.0, -0.0, 1.0, 0.5, 65504.0, 3.4028234663852886e38, 1e300, 1e-45, math.inf,
          -math.inf, math.nan]
SAME_KIND = [("unary", "neg abs logical_not bit_not sin sqrt floor round exp stop_grad cast"),
             ("binary", "add sub mul div floordiv mod pow min max atan2 bit_and bit_or bit_xor "
                        "shl shr logical_and logical_or"),
             ("cmp", "lt le gt ge eq ne"), ("mem", "load store atomic"),
             ("local", "local_load local_store local_atomic"), ("loop", "range_for while"),
             ("ctl", "break continue")]


def _tree(data):
    """Nodes ``[op, dtype, args (nodes), attr, blocks (lists of nodes)]`` from an encoding."""
    numbered = []

    def block(items):
        out = []
        for op, dtype, args, attr, blocks in items:
            node = [op, dtype, [numbered[a] for a in args], attr, None]
            numbered.append(node)
            node[4] = [block(b) for b in blocks]
            out.append(node)
        return out

    return block(data["body"])


_END = object()


def _flatten(body):
    """Back to an encoding: nodes numbered in order; operands that are gone (dropped) keep a
    stale number, as a client's bad arithmetic would. Iterative: mutants nest deeply."""
    ids = {}
    stack = [iter(body)]
    while stack:
        node = next(stack[-1], _END)
        if node is _END:
            stack.pop()
            continue
        if isinstance(node, list) and len(node) == 5 and id(node) not in ids:
            ids[id(node)] = len(ids)
            if isinstance(node[4], list):
                stack.append(itertools.chain.from_iterable(
                    b for b in node[4] if isinstance(b, list)))
    out: list = []
    work = [(body, out)]
    while work:
        items, dest = work.pop()
        for node in items:
            if not isinstance(node, list) or len(node) != 5:
                dest.append(node)
                continue
            op, dtype, args, attr, blocks = node
            if isinstance(args, list):
                args = [ids.get(id(a), len(ids) // 2) if isinstance(a, list) else a
                        for a in args]
            if isinstance(blocks, list):
                copies = []
                for b in blocks:
                    copies.append([] if isinstance(b, list) else b)
                    if isinstance(b, list):
                        work.append((b, copies[-1]))
                blocks = copies
            dest.append([op, dtype, args, attr, blocks])
    return out


def _nodes(body):
    """Every (block, index) of the tree, iteratively."""
    out, stack, seen = [], [body], set()
    while stack:
        blk = stack.pop()
        if id(blk) in seen:
            continue
        seen.add(id(blk))
        for k, node in enumerate(blk):
            if isinstance(node, list) and len(node) == 5:
                out.append((blk, k))
                if isinstance(node[4], list):
                    stack.extend(b for b in node[4] if isinstance(b, list))
    return out


def _inside(node, block):
    """Is ``block`` one of ``node``'s blocks, at any depth? (Moving a node there would make the
    tree a cycle.)"""
    stack = [node]
    while stack:
        n = stack.pop()
        for b in n[4] if isinstance(n[4], list) else ():
            if b is block:
                return True
            if isinstance(b, list):
                stack.extend(x for x in b if isinstance(x, list) and len(x) == 5)
    return False


def _wrap(node, kind, depth, cond):
    for level in range(depth):
        node = {"while": ["while", None, [], None, [[node]]],
                "if": ["if", None, [cond], None, [[node], []]],
                "range_for": ["range_for", None, [cond, cond],
                              {"t": [1000 + level, "inner"]}, [[node]]]}[kind]
    return node


def _mutate_tree(body, enc, draw):
    sites = _nodes(body)
    if not sites:
        return
    blk, k = draw(st.sampled_from(sites))
    node = blk[k]
    values = [b[i] for b, i in sites if b[i][1] is not None and b[i][0] != "alloca"]
    what = draw(st.sampled_from(["drop", "dup", "dup", "swap", "move", "op", "op", "operand",
                                 "operand", "operand", "dtype", "const", "attr", "wrap", "args",
                                 "table", "table"]))
    if what == "drop":
        del blk[k]
    elif what == "dup":
        blk.insert(k + 1, copy.copy(node))
    elif what == "swap":
        j = draw(st.integers(0, len(blk) - 1))
        blk[k], blk[j] = blk[j], blk[k]
    elif what == "move":
        target, j = draw(st.sampled_from(sites))
        if not _inside(node, target):
            moved = blk.pop(k)
            target.insert(min(j, len(target)), moved)
    elif what == "op":
        group = next((ops.split() for _, ops in SAME_KIND if node[0] in ops.split()), None)
        node[0] = draw(st.sampled_from(group if group and draw(st.booleans()) else sorted(OPS)))
    elif what == "operand" and values:
        if node[2]:
            node[2][draw(st.integers(0, len(node[2]) - 1))] = draw(st.sampled_from(values))
        else:
            node[2] = [draw(st.sampled_from(values))]
    elif what == "dtype":
        node[1] = draw(st.sampled_from(DTYPES + BAD_DTYPES))
    elif what == "const":
        node[0] = "const" if draw(st.booleans()) else node[0]
        node[1] = draw(st.sampled_from(DTYPES)) if draw(st.booleans()) else node[1]
        node[2], node[3], node[4] = [], draw(st.sampled_from(CONSTS)), []
    elif what == "attr":
        node[3] = draw(st.sampled_from(ATTRS + list(ATOMIC_KINDS)))
    elif what == "wrap":
        kind = draw(st.sampled_from(["while", "if", "range_for"]))
        depth = draw(st.sampled_from([1, 2, 5, 62, 63, 64, 300]))
        cond = draw(st.sampled_from(values)) if values else None
        blk[k] = _wrap(node, kind, depth, cond)
    elif what == "args":
        if node[2] and draw(st.booleans()):
            node[2].pop()
        elif values:
            node[2].append(draw(st.sampled_from(values)))
    elif what == "table":
        key = draw(st.sampled_from(["params", "buffers", "returns"]))
        table = enc[key]
        if not table:
            return
        j = draw(st.integers(0, len(table) - 1))
        if key == "buffers":
            field = draw(st.integers(0, 4))
            table[j][field] = draw(st.sampled_from(
                {0: [{"t": ["field", 1, "grad"]}, {"t": ["field", 10**6, "primal"]},
                     {"t": ["field", 1, "dual"]}],
                 1: DTYPES, 2: [[N], [1], [N, 3], [N, 2, 2], [], [2**31 - 1], [3]],
                 3: ["x", "a long name" * 5, "ü"], 4: [0, 1, 2]}[field]))
        elif key == "params":
            table[j][1] = draw(st.sampled_from(DTYPES))
        else:
            table[j] = draw(st.sampled_from(DTYPES))


def _mutate_json(enc, draw):
    what = draw(st.sampled_from(["stmt", "top", "table"]))
    if what == "top":
        enc[draw(st.sampled_from(list(enc)))] = draw(st.sampled_from(JSON_VALUES + ["k x"]))
        return
    if what == "table":
        table = enc[draw(st.sampled_from(["params", "buffers", "returns"]))]
        if table:
            j = draw(st.integers(0, len(table) - 1))
            if isinstance(table[j], list) and table[j] and draw(st.booleans()):
                table[j][draw(st.integers(0, len(table[j]) - 1))] = draw(
                    st.sampled_from(JSON_VALUES + BAD_DTYPES))
            else:
                table[j] = draw(st.sampled_from(JSON_VALUES))
        return
    sites = _nodes(enc["body"])
    if sites:
        blk, k = draw(st.sampled_from(sites))
        j = draw(st.integers(0, 4))
        blk[k][j] = draw(st.sampled_from(JSON_VALUES + [[-1], [10**6], [0.0], ["0"]]))


@settings(max_examples=int(os.environ.get("DIFFTAPE_FUZZ_EXAMPLES", "1200")), deadline=None,
          derandomize=os.environ.get("DIFFTAPE_FUZZ_RANDOM") != "1", database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_fuzzed_encodings_are_rejected_or_compile(corpus, data):
    name = data.draw(st.sampled_from(KERNEL_NAMES))
    enc = copy.deepcopy(corpus[name][2])
    body = _tree(enc)
    for _ in range(data.draw(st.sampled_from([1, 1, 2, 3]))):
        _mutate_tree(body, enc, data.draw)
    enc["body"] = _flatten(body)
    if data.draw(st.integers(0, 7)) == 0:
        _mutate_json(enc, data.draw)
    try:
        ir = decode_untrusted(enc, max_stmts=5000)
    except IRValidationError as e:
        event(f"rejected: {str(e).partition(': ')[2][:30]}")
        return
    ir.debug = data.draw(st.booleans())
    launch = _launch_args(ir)
    variant = data.draw(st.sampled_from(VARIANTS))
    try:
        if variant != "primal":  # what the service compiles for kernel.grad / forward mode
            ir = derive(ir, variant, lambda buf, role: has_storage(program.get(), (), buf, role))
        compiled = _compile_decoded(ir)
        event("accepted and compiled")
        if launch is not None:
            compiled.launch(launch)
            event("launched")
    except DifftapeError as e:
        assert "LLVM rejected" not in str(e), str(e)  # accepted IR the lowering cannot handle
        event(f"accepted, {type(e).__name__}: {str(e)[:50]}")


VARIANTS = os.environ.get("DIFFTAPE_FUZZ_VARIANTS", "primal,primal,grad,fwd,grad_fwd").split(",")


def _launch_args(ir):
    """Arguments for launching ``ir`` when that is safe in the test process: bounds checks on
    (as the service compiles), every buffer exactly a field of the program (the service checks
    that against the session's fields), and run time bounded statically (no ``while``, constant
    loop bounds, at most 10**5 iterations in all). None otherwise."""
    if not ir.debug:
        return None
    fields = program.get().fields
    for buf in ir.buffers:
        f = fields.get(buf.key[1])
        f = f if f is None or buf.key[2] == "primal" else getattr(f, buf.key[2], None)
        if f is None or f.dtype != buf.dtype or f.storage.shape != buf.shape:
            return None
    stack = [(ir.body, 1)]
    while stack:
        block, trips = stack.pop()
        for s_ in block:
            inner = trips
            if s_.op == "while":
                return None
            if s_.op == "range_for":
                if any(a.op != "const" for a in s_.args):
                    return None
                inner = trips * max(0, s_.args[1].attr - s_.args[0].attr)
                if inner > 10**5:
                    return None
            stack.extend((b, inner) for b in s_.blocks)
    args = {}
    for p in ir.params:
        base, _, comp = p.name.partition("[")
        value = 0.5 if p.dtype.is_float else 1
        if comp:
            args.setdefault(base, []).append(value)
        else:
            args[base] = value
    return tuple(args[name] for name in argument_names(ir))


# ----------------------------------------------------------------------------- random valid IR
#
# The mutants above stay close to what the frontend emits. This generator writes well-typed IR
# directly, in every dtype and op combination the rules allow (u8 shifts, i16 atomics, casts
# between any two types, selects on u64 conditions, locals updated atomically, loops inside
# branches...), which the frontend rarely or never produces. Each program must be accepted (the
# rules are not stricter than they say), compile without LLVM rejecting the generated code, and
# launch (bounds checks on; bounded loops) raising nothing but DifftapeError subclasses.

GEN_DTYPES = ["f32", "f64", "i32", "i8", "u8", "i16", "u16", "i64", "u32", "u64"]
INT_CONSTS = {"i": [0, 1, 2, 3, -1, -7], "u": [0, 1, 2, 3, 7, 200]}
FLOAT_CONSTS = [0.0, 1.5, -2.25, 0.5, 3.0, -0.0]
UNARY_INT = ["neg", "abs", "bit_not", "stop_grad"]
UNARY_REAL = ["neg", "abs", "stop_grad", "sin", "cos", "tan", "atan", "tanh", "exp", "sqrt",
              "floor", "ceil", "round", "rsqrt", "log", "asin", "acos"]
BINARY_INT = ["add", "sub", "mul", "min", "max", "pow", "bit_and", "bit_or", "bit_xor", "shl",
              "shr", "floordiv", "mod"]
BINARY_REAL = ["add", "sub", "mul", "div", "min", "max", "pow", "atan2", "floordiv", "mod"]


@pytest.fixture(scope="module")
def gen_fields(corpus):
    """One 1-D field per dtype, a 2-D field and a vector field with a .grad, for generated IR."""
    out = [ti.field(getattr(ti, t), shape=N) for t in GEN_DTYPES]
    out.append(ti.field(ti.f32, shape=(N, 3), needs_grad=True))
    out.append(ti.Vector.field(2, ti.f64, shape=N, needs_grad=True))
    buffers = []
    for f in out:
        buffers.append([{"t": ["field", f.id, "primal"]}, f.dtype.name,
                        list(f.shape + f.element_shape), f"g{f.id}", len(f.element_shape)])
        if f.has_grad:
            buffers.append([{"t": ["field", f.id, "grad"]}, f.dtype.name,
                            list(f.shape + f.element_shape), f"g{f.id}.grad",
                            len(f.element_shape)])
    return buffers


class _IRGen:
    """Writes one random, well-typed kernel body in the wire encoding."""

    def __init__(self, draw, buffers, params, returns):
        self.draw = draw
        self.buffers = buffers
        self.params = params
        self.returns = returns
        self.n = 0  # statements numbered so far (pre-order, as serialize.encode numbers)
        self.scopes = [[]]  # per open block: (number, dtype) of its values
        self.locals = [[]]  # per open block: (alloca number, dtype)
        self.loops = []  # enclosing loops: "parallel", "serial", "inner", "while"
        self.loop_ids = []
        self.next_loop = 0
        self.budget = draw(st.integers(5, 60))

    def pick(self, options):
        return self.draw(st.sampled_from(options))

    def emit(self, block, op, dtype, args=(), attr=None):
        node = [op, dtype, list(args), attr, []]
        block.append(node)
        num = self.n
        self.n += 1
        self.budget -= 1
        if dtype is not None and op != "alloca":
            self.scopes[-1].append((num, dtype))
        return num, node

    def nested(self, node, nblocks, loop=None, loop_id=None):
        node[4] = []
        for _ in range(nblocks):
            self.scopes.append([])
            self.locals.append([])
            if loop:
                self.loops.append(loop)
            if loop_id is not None:
                self.loop_ids.append(loop_id)
            block = []
            self.block(block)
            node[4].append(block)
            self.scopes.pop()
            self.locals.pop()
            if loop:
                self.loops.pop()
            if loop_id is not None:
                self.loop_ids.pop()
        return node[4]

    # -- values --------------------------------------------------------------------------------
    def const(self, block, t):
        if t[0] == "f":
            return self.emit(block, "const", t, (), self.pick(FLOAT_CONSTS))[0]
        return self.emit(block, "const", t, (), self.pick(INT_CONSTS[t[0]]))[0]

    def value(self, block, t):
        """A value of dtype ``t``: one in scope, or a new const, argument, load or cast."""
        have = [num for scope in self.scopes for num, dt in scope if dt == t]
        if have and self.draw(st.integers(0, 3)) > 0:
            return self.pick(have)
        how = self.pick(["const", "const", "arg", "load", "cast", "loop"])
        if how == "arg" and t in self.params:
            return self.emit(block, "arg", t, (), self.params.index(t))[0]
        if how == "load":
            slots = [k for k, b in enumerate(self.buffers) if b[1] == t]
            if slots:
                return self.load(block, self.pick(slots))
        if how == "cast":
            src = self.pick(GEN_DTYPES)
            if src != t:
                return self.emit(block, "cast", t, (self.value(block, src),))[0]
        if how == "loop" and t == "i32" and self.loop_ids:
            return self.emit(block, "loop_index", "i32", (), self.pick(self.loop_ids))[0]
        return self.const(block, t)

    def cond(self, block):
        """An integer value to branch on: a comparison, or an integer of any width."""
        if self.draw(st.booleans()):
            t = self.pick(GEN_DTYPES)
            a, b = self.value(block, t), self.value(block, t)
            return self.emit(block, self.pick(list(COMPARE_OPS)), "i32", (a, b))[0]
        return self.value(block, self.pick([t for t in GEN_DTYPES if t[0] != "f"]))

    def indices(self, block, slot):
        _, _, shape, _, endim = self.buffers[slot]
        out = []
        for axis, extent in enumerate(shape):
            if axis >= len(shape) - endim or self.draw(st.integers(0, 5)) == 0:
                out.append(self.emit(block, "const", "i32", (),
                                     self.draw(st.integers(0, extent - 1)))[0])
            else:
                out.append(self.value(block, "i32"))
        return out

    def load(self, block, slot):
        idx = self.indices(block, slot)
        return self.emit(block, "load", self.buffers[slot][1], idx, slot)[0]

    # -- statements ----------------------------------------------------------------------------
    def block(self, block):
        while self.budget > 0 and self.draw(st.integers(0, 5)) > 0:
            self.statement(block)

    def statement(self, block):  # noqa: C901 - one case per kind of statement
        kind = self.pick(["unary", "binary", "binary", "cmp", "select", "cast", "store",
                          "store", "atomic", "local", "local", "if", "range_for", "while",
                          "loopctl", "assert", "random", "return", "buf_shape"])
        t = self.pick(GEN_DTYPES)
        is_float = t[0] == "f"
        top = len(self.scopes) == 1
        if kind == "unary":
            op = self.pick(UNARY_REAL if is_float else UNARY_INT + ["logical_not"])
            self.emit(block, op, "i32" if op == "logical_not" else t, (self.value(block, t),))
        elif kind == "binary":
            op = self.pick(BINARY_REAL if is_float else BINARY_INT + ["logical_and",
                                                                      "logical_or"])
            a = self.value(block, t)
            if op in ("floordiv", "mod") and not is_float and self.draw(st.booleans()):
                # 0 and -1 included: the lowering guards them (no SIGFPE)
                b = self.emit(block, "const", t, (), self.pick([2, 3, 7, 0, -1] if t[0] == "i"
                                                               else [2, 3, 7, 0]))[0]
            elif op in ("shl", "shr"):  # a constant amount is in range; else a run-time one
                if self.draw(st.booleans()):
                    bits = int(t[1:])
                    b = self.emit(block, "const", t, (), self.draw(st.integers(0, bits - 1)))[0]
                else:
                    b = self.load(block, next(k for k, buf in enumerate(self.buffers)
                                              if buf[1] == t))
            else:
                b = self.value(block, t)
            out = "i32" if op in ("logical_and", "logical_or") else t
            self.emit(block, op, out, (a, b))
        elif kind == "cmp":
            self.emit(block, self.pick(list(COMPARE_OPS)), "i32",
                      (self.value(block, t), self.value(block, t)))
        elif kind == "select":
            c = self.cond(block)
            self.emit(block, "select", t, (c, self.value(block, t), self.value(block, t)))
        elif kind == "cast":
            self.emit(block, "cast", t, (self.value(block, self.pick(GEN_DTYPES)),))
        elif kind in ("store", "atomic"):
            slot = self.draw(st.integers(0, len(self.buffers) - 1))
            bt = self.buffers[slot][1]
            idx = self.indices(block, slot)
            v = self.value(block, bt)
            if kind == "store":
                self.emit(block, "store", None, idx + [v], slot)
            else:
                kinds = ["add", "sub", "min", "max"] + ([] if bt[0] == "f" else
                                                        ["bit_and", "bit_or", "bit_xor"])
                self.emit(block, "atomic", bt, idx + [v], {"t": [slot, self.pick(kinds)]})
        elif kind == "local":
            mine = [x for scope in self.locals for x in scope]
            if mine and self.draw(st.booleans()):
                a, at = self.pick(mine)
                what = self.pick(["local_load", "local_store", "local_atomic"])
                if what == "local_load":
                    self.emit(block, "local_load", at, (a,))
                elif what == "local_store":
                    self.emit(block, "local_store", None, (a, self.value(block, at)))
                else:
                    kinds = ["add", "sub", "min", "max"] + ([] if at[0] == "f" else ["bit_xor"])
                    self.emit(block, "local_atomic", at, (a, self.value(block, at)),
                              self.pick(kinds))
            else:
                a, _ = self.emit(block, "alloca", t)
                self.emit(block, "local_store", None, (a, self.value(block, t)))
                self.locals[-1].append((a, t))
        elif kind == "if":
            c = self.cond(block)
            _, node = self.emit(block, "if", None, (c,))
            self.nested(node, 2)
        elif kind == "range_for" and len(self.scopes) < 4:
            b = self.emit(block, "const", "i32", (), self.draw(st.integers(0, 2)))[0]
            e = self.emit(block, "const", "i32", (), self.draw(st.integers(0, N)))[0]
            flags = self.pick(["parallel", "serial", "inner"] if top else ["serial", "inner"])
            loop_id = self.next_loop
            self.next_loop += 1
            _, node = self.emit(block, "range_for", None, (b, e), {"t": [loop_id, flags]})
            self.nested(node, 1, loop=flags, loop_id=loop_id)
        elif kind == "while" and len(self.scopes) < 4:
            # A counter bounds it: c = c + 1 and `if c > 3: break` come first, so a
            # `continue` generated later in the body cannot skip them.
            c, _ = self.emit(block, "alloca", "i32")
            zero = self.emit(block, "const", "i32", (), 0)[0]
            self.emit(block, "local_store", None, (c, zero))
            _, node = self.emit(block, "while", None)
            body = []
            node[4] = [body]
            self.scopes.append([])
            self.locals.append([])
            self.loops.append("while")
            old = self.emit(body, "local_load", "i32", (c,))[0]
            one = self.emit(body, "const", "i32", (), 1)[0]
            new = self.emit(body, "add", "i32", (old, one))[0]
            self.emit(body, "local_store", None, (c, new))
            three = self.emit(body, "const", "i32", (), 3)[0]
            done = self.emit(body, "gt", "i32", (new, three))[0]
            _, brk = self.emit(body, "if", None, (done,))
            brk[4] = [[["break", None, [], None, []]], []]
            self.n += 1
            self.block(body)
            self.scopes.pop()
            self.locals.pop()
            self.loops.pop()
        elif kind == "loopctl" and self.loops:
            if self.loops[-1] != "parallel" and self.draw(st.booleans()):
                self.emit(block, "break", None)
            else:
                self.emit(block, "continue", None)
        elif kind == "assert":
            # A message without values, or showing one value of any type (ir/assertfmt.py).
            cond = self.cond(block)
            if self.draw(st.booleans()):
                self.emit(block, "assert", None, (cond,), {"t": ["generated"]})
            else:
                t = self.pick(GEN_DTYPES)
                self.emit(block, "assert", None, (cond, self.value(block, t)),
                          {"t": ["generated ", self.pick(["", "%5e" if t[0] == "f" else "%x"]),
                                 "!"]})
        elif kind == "random":
            self.emit(block, "random", t)
        elif kind == "return" and top and self.returns:
            slot = self.draw(st.integers(0, len(self.returns) - 1))
            self.emit(block, "return", None, (self.value(block, self.returns[slot]),), slot)
        elif kind == "buf_shape":
            slot = self.draw(st.integers(0, len(self.buffers) - 1))
            axis = self.draw(st.integers(0, len(self.buffers[slot][2]) - 1))
            self.emit(block, "buf_shape", "i32", (), {"t": [slot, axis]})


COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")


@settings(max_examples=int(os.environ.get("DIFFTAPE_GEN_EXAMPLES", "300")), deadline=None,
          derandomize=os.environ.get("DIFFTAPE_FUZZ_RANDOM") != "1", database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_generated_ir_is_accepted_compiles_and_runs(gen_fields, data):
    params = data.draw(st.lists(st.sampled_from(GEN_DTYPES), max_size=3))
    returns = data.draw(st.lists(st.sampled_from(GEN_DTYPES), max_size=2))
    gen = _IRGen(data.draw, gen_fields, params, returns)
    body = []
    gen.block(body)
    enc = {"name": "generated", "params": [[f"p{k}", t] for k, t in enumerate(params)],
           "buffers": gen_fields, "returns": returns, "debug": True, "body": body}
    ir = decode_untrusted(_wire(enc))
    assert serialize.encode(ir) == _wire(enc)
    args = _launch_args(ir)
    variant = data.draw(st.sampled_from(VARIANTS))
    try:
        if variant != "primal":
            ir = derive(ir, variant, lambda buf, role: has_storage(program.get(), (), buf, role))
        compiled = _compile_decoded(ir)
        event(f"{variant}: compiled")
        if args is not None:
            compiled.launch(args)
            event(f"{variant}: launched")
    except DifftapeError as e:
        assert "LLVM rejected" not in str(e), str(e)
        event(f"{variant}: {type(e).__name__}: {str(e)[:40]}")
