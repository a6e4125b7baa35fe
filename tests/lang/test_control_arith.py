"""Branches, selects, augmented assignment, local typing, int/float promotion and casts.

Integer operands here come from kernel arguments or fields on purpose: Taichi 1.7.4 folds
``//`` and ``%`` on *compile-time constant* negative integers with C semantics (-7 // 2 == -3),
but evaluates them at run time with Python's floor semantics (-7 // 2 == -4). Only the run-time
(Python) semantics is a contract.
"""

import numpy as np
import pytest


def test_if_elif_else_per_element(ti, fp, rtol):
    n = 21
    x = ti.field(float, shape=n)
    y = ti.field(float, shape=n)

    @ti.kernel
    def classify():
        for i in x:
            v = x[i]
            if v < -1.0:
                y[i] = -v
            elif v < 0.0:
                y[i] = v * v
            elif v == 0.0:
                y[i] = 42.0
            else:
                y[i] = ti.sqrt(v)

    xs = np.linspace(-2, 2, n)
    x.from_numpy(xs)
    classify()
    want = np.select([xs < -1, xs < 0, xs == 0], [-xs, xs * xs, 42.0], np.sqrt(np.abs(xs)))
    np.testing.assert_allclose(y.to_numpy(), want, rtol=rtol, atol=rtol)


def test_conditional_expression_and_select(ti, fp, rtol):
    n = 11
    x = ti.field(float, shape=n)
    a = ti.field(float, shape=n)
    b = ti.field(float, shape=n)
    c = ti.Vector.field(2, float, shape=n)

    @ti.kernel
    def run():
        for i in x:
            v = x[i]
            a[i] = v * 2 if v > 0.3 else -v
            b[i] = ti.select(v > 0.3, v * 2, -v)
            c[i] = ti.select(v > 0.3, ti.Vector([v, 1.0]), ti.Vector([0.0, -v]))

    xs = np.linspace(-1, 1, n)
    x.from_numpy(xs)
    run()
    want = np.where(xs > 0.3, xs * 2, -xs)
    np.testing.assert_allclose(a.to_numpy(), want, rtol=rtol)
    np.testing.assert_allclose(b.to_numpy(), want, rtol=rtol)
    want_c = np.where(
        (xs > 0.3)[:, None], np.stack([xs, np.ones(n)], 1), np.stack([0 * xs, -xs], 1)
    )
    np.testing.assert_allclose(c.to_numpy(), want_c, rtol=rtol)


def test_comparisons_and_logic(ti):
    @ti.kernel
    def run(a: ti.i32, b: ti.i32) -> ti.types.vector(7, ti.i32):
        return ti.Vector(
            [0 < a < b, a == b, a != b, a >= b, not a, (a > 0) and (b > 0), (a > 0) or (b > 9)]
        )

    for a, b in [(3, 5), (0, 5), (5, 5), (-1, 2), (7, 2)]:
        want = [0 < a < b, a == b, a != b, a >= b, not a, a > 0 and b > 0, a > 0 or b > 9]
        np.testing.assert_array_equal(run(a, b), np.array(want, dtype=np.int32))


def test_and_or_on_integers_return_an_operand_like_python(ti):
    @ti.kernel
    def run(a: ti.i32, b: ti.i32) -> ti.types.vector(2, ti.i32):
        return ti.Vector([a and b, a or b])

    for a, b in [(3, 5), (0, 5), (3, 0), (0, 0)]:
        np.testing.assert_array_equal(run(a, b), [a and b, a or b])


def test_integer_augmented_assignments(ti):
    @ti.kernel
    def run(a: ti.i32, b: ti.i32) -> ti.types.vector(11, ti.i32):
        r0 = a
        r0 += b
        r1 = a
        r1 -= b
        r2 = a
        r2 *= b
        r3 = a
        r3 //= b
        r4 = a
        r4 %= b
        r5 = a
        r5 &= b
        r6 = a
        r6 |= b
        r7 = a
        r7 ^= b
        r8 = a
        r8 <<= 2
        r9 = a
        r9 >>= 1
        r10 = a
        r10 **= 3
        return ti.Vector([r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10])

    for a, b in [(17, 5), (-17, 5), (17, -5), (-17, -5), (6, 3)]:
        want = [a + b, a - b, a * b, a // b, a % b, a & b, a | b, a ^ b, a << 2, a >> 1, a**3]
        np.testing.assert_array_equal(run(a, b), want)


def test_float_augmented_assignments(ti, fp, npfp, rtol):
    @ti.kernel
    def run(a: float, b: float) -> ti.types.vector(7, float):
        r0 = a
        r0 += b
        r1 = a
        r1 -= b
        r2 = a
        r2 *= b
        r3 = a
        r3 /= b
        r4 = a
        r4 //= b
        r5 = a
        r5 %= b
        r6 = ti.abs(a)
        r6 **= b
        return ti.Vector([r0, r1, r2, r3, r4, r5, r6])

    for a, b in [(7.5, 2.0), (-7.5, 2.0), (7.5, -2.0), (-7.25, -0.5), (2.0, 0.5)]:
        want = [a + b, a - b, a * b, a / b, a // b, a % b, abs(a) ** b]
        np.testing.assert_allclose(run(a, b), want, rtol=rtol)


def test_augmented_assignment_on_field_elements(ti):
    x = ti.field(ti.i32, shape=6)

    @ti.kernel
    def run(a: ti.i32, b: ti.i32):
        x[0] = a
        x[0] += b
        x[1] = a
        x[1] -= b
        x[2] = a
        x[2] *= b
        x[3] = a
        x[3] //= b
        x[4] = a
        x[4] %= b
        x[5] = a
        x[5] <<= b

    run(-7, 2)
    np.testing.assert_array_equal(x.to_numpy(), [-5, -9, -14, -4, 1, -28])


def test_local_type_is_fixed_at_first_assignment(ti, fp):
    @ti.kernel
    def int_local(a: float) -> float:
        x = 0  # i32
        x = a  # truncated toward zero (Taichi warns about precision loss)
        return x

    @ti.kernel
    def int_local_aug(a: float) -> ti.i32:
        x = 1
        x += a  # computed in float, then truncated back to the int local
        y = 10
        y *= a
        return x * 1000 + y

    @ti.kernel
    def float_local(a: ti.i32) -> float:
        x = 0.0
        x = a
        return x / 2

    assert int_local(2.7) == 2.0
    assert int_local(-2.7) == -2.0
    assert int_local_aug(2.75) == 3 * 1000 + 27
    assert float_local(7) == 3.5


def test_int_float_promotion(ti, fp, npfp):
    @ti.kernel
    def run(a: ti.i32, b: ti.f32) -> ti.types.vector(3, ti.f64):
        c = a + b  # i32 + f32 -> f32
        d = a / 4  # true division -> default float type
        e = a * 0.1  # i32 * float literal -> default float type
        return ti.Vector([c, d, e])

    got = run(1, 0.1)
    assert got[0] == float(np.float32(1) + np.float32(0.1))
    assert got[1] == 0.25
    assert got[2] == float(npfp(0.1))


def test_unsigned_beats_signed_of_the_same_width(ti):
    """As in Taichi (and C): u32 + 1 is a u32, so 4e9 + 1 does not wrap to a negative i32;
    u8 + 1 is an i32 (the wider type)."""

    @ti.kernel
    def run(u: ti.u32, b: ti.u8, i: ti.i32) -> ti.types.vector(3, ti.i64):
        return ti.Vector([ti.cast(u + 1, ti.i64), ti.cast(b + 1, ti.i64),
                          ti.cast(u - i, ti.i64)])

    got = run(4000000000, 255, 5)
    assert list(got) == [4000000001, 256, 3999999995]


def test_integer_true_division_gives_float(ti, fp, rtol):
    @ti.kernel
    def div(a: ti.i32, b: ti.i32) -> float:
        return a / b

    for a, b in [(7, 2), (-7, 2), (1, 3), (10, -4), (0, 5)]:
        np.testing.assert_allclose(div(a, b), a / b, rtol=rtol)


def test_true_division_turns_integer_operands_into_default_fp_first(ti):
    # As Taichi: an integer operand of `/` becomes default_fp before the promotion, so an
    # i32 over an f32 is an f64 division under default_fp=f64, and an integer over an f16 is
    # an f32 one under f32 (difftape promoted first: an f32, an f16 that overflowed to inf)
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    f = ti.field(ti.f32, shape=())
    f[None] = 3.0

    @ti.kernel
    def run(a: ti.i32) -> ti.types.vector(3, ti.f64):
        return ti.Vector([a / f[None], f[None] / (a + 4), a / 3])

    np.testing.assert_array_equal(run(1), [1 / 3, 3 / 5, 1 / 3])  # f64 divisions, exact

    ti.init(arch=ti.cpu, default_fp=ti.f32)
    h = ti.field(ti.f16, shape=())
    h[None] = 3.0

    @ti.kernel
    def half(a: ti.i32) -> ti.f64:
        return ti.cast(a / h[None], ti.f64)

    assert half(100000) == np.float32(100000 / 3)

    @ti.kernel
    def raw(a: ti.i32, b: ti.f32) -> ti.f64:  # C's division: promotion only (f32)
        return ti.raw_div(a, b)

    ti.init(arch=ti.cpu, default_fp=ti.f64)
    assert raw(1, 3.0) == np.float32(1) / np.float32(3)


def test_integer_floor_division_and_modulo_follow_python(ti):
    @ti.kernel
    def run(a: ti.i32, b: ti.i32) -> ti.types.vector(2, ti.i32):
        return ti.Vector([a // b, a % b])

    for a, b in [(7, 2), (-7, 2), (7, -2), (-7, -2), (6, 3), (-6, 4), (0, -3), (-1, 5)]:
        np.testing.assert_array_equal(run(a, b), [a // b, a % b], err_msg=f"{a}, {b}")


def test_float_floor_division_and_modulo_follow_python(ti, fp, rtol):
    @ti.kernel
    def run(a: float, b: float) -> ti.types.vector(2, float):
        return ti.Vector([a // b, a % b])

    for a, b in [(7.5, 2.0), (-7.5, 2.0), (7.5, -2.0), (-7.5, -2.0), (5.25, 0.5)]:
        np.testing.assert_allclose(run(a, b), [a // b, a % b], rtol=rtol)


def test_i32_arithmetic_wraps_around(ti):
    @ti.kernel
    def run(a: ti.i32) -> ti.types.vector(2, ti.i32):
        return ti.Vector([a * 2, a + 1])

    np.testing.assert_array_equal(run(2**30), [-(2**31), 2**30 + 1])
    np.testing.assert_array_equal(run(2**31 - 1), [-2, -(2**31)])


def test_shifts_are_arithmetic(ti):
    @ti.kernel
    def run(a: ti.i32) -> ti.types.vector(2, ti.i32):
        return ti.Vector([a >> 2, a << 3])

    np.testing.assert_array_equal(run(-16), [-4, -128])
    np.testing.assert_array_equal(run(37), [9, 296])


def test_bit_shr_is_a_logical_shift_in_the_operands_width(ti):
    """``ti.bit_shr`` fills with zeros; a signed value's bits are shifted as unsigned ones,
    within its own width (an i8 -128 is 0x80), and the result keeps its type."""
    @ti.kernel
    def shr32(a: ti.i32, n: ti.i32) -> ti.i32:
        return ti.bit_shr(a, n)

    @ti.kernel
    def shr8(a: ti.i8, n: ti.i32) -> ti.i8:
        return ti.bit_shr(a, n)

    @ti.kernel
    def shr_u16(a: ti.u16, n: ti.i32) -> ti.u16:
        return ti.bit_shr(a, n)

    @ti.kernel
    def shr_vec(a: ti.i32) -> ti.types.vector(2, ti.i32):
        return ti.bit_shr(ti.Vector([a, -a]), ti.Vector([1, 3]))

    for a in (-256, -1, 7, 2**31 - 1, -(2**31)):
        for n in (0, 1, 5, 31):
            assert shr32(a, n) == np.int32(np.uint32(a % 2**32) >> np.uint32(n))
    assert shr8(-128, 1) == 64 and shr8(-1, 4) == 15 and shr8(100, 2) == 25
    assert shr_u16(65535, 4) == 4095
    np.testing.assert_array_equal(shr_vec(8), [4, (2**32 - 8) >> 3])


@pytest.mark.difftape_only
def test_bit_shr_needs_integers_in_a_kernel(ti):
    @ti.kernel
    def bad(a: ti.f32) -> ti.i32:
        return ti.bit_shr(a, 1)

    with pytest.raises(ti.KernelTypeError, match="bit_shr takes integers, got f32"):
        bad(1.0)
    with pytest.raises(ti.DifftapeError, match="kernels only"):
        ti.bit_shr(8, 1)


def test_cast_and_int_float_builtins(ti):
    @ti.kernel
    def run(a: ti.f64) -> ti.types.vector(5, ti.f64):
        return ti.Vector(
            [ti.cast(a, ti.f32), ti.cast(a, ti.i32), int(a), float(int(a)), ti.cast(a, ti.i64)]
        )

    for a in [0.1, -3.7, 2.5, -2.5, 1e10]:
        got = run(a)
        assert got[0] == float(np.float32(a))
        if abs(a) < 2**31:
            assert got[1] == np.trunc(a)
            assert got[2] == np.trunc(a)
            assert got[3] == np.trunc(a)
        assert got[4] == np.trunc(a)


def test_bool_builtin_of_runtime_integers(ti):
    """bool(x) of a runtime integer is "x is nonzero" (Taichi's cast to u1; Taichi's own
    test_bool_type_conv), usable in arithmetic and returned from a func annotated bool; it
    was refused as a runtime value used where Python needs a compile-time bool."""
    @ti.func
    def f(x: ti.u32) -> bool:
        return bool(x)

    @ti.kernel
    def run(x: ti.u32, y: ti.i8, z: ti.i32) -> ti.types.vector(4, ti.i32):
        return ti.Vector([f(x), bool(y) * 10, bool(z) + bool(z - z) * 100, bool(3) * 7])

    for x, y, z in [(1000, -128, 256), (0, 0, 0), (4_294_967_295, 1, -1), (2, 0, 2)]:
        want = [int(bool(x)), int(bool(y)) * 10, int(bool(z)), 7]
        assert run(x, y, z).to_numpy().tolist() == want

    @ti.kernel
    def half(x: ti.i32) -> ti.f32:
        return bool(x) / 2

    assert half(5) == 0.5 and half(0) == 0.0


@pytest.mark.difftape_only
def test_bool_builtin_of_runtime_floats_and_vectors(ti):
    """bool() of a float is "nonzero" too, as in Python (NaN is true, -0.0 false; Taichi
    aborts compiling it), and of a vector per entry."""
    @ti.kernel
    def run(a: ti.f32, b: ti.f32, c: ti.i32) -> ti.types.vector(4, ti.i32):
        v = bool(ti.Vector([c, 0, a]))
        return ti.Vector([bool(a), bool(b), v[0] + 2 * v[1], v[2]])

    for a, b, c in [(0.5, -0.0, 3), (0.0, float("nan"), 0), (-1e-30, 0.0, -5)]:
        want = [int(bool(a)), int(bool(b)), int(bool(c)), int(bool(a))]
        assert run(a, b, c).to_numpy().tolist() == want


def test_cast_between_integer_widths_and_to_f32(ti):
    @ti.kernel
    def narrow(a: ti.i64) -> ti.i32:
        return ti.cast(a, ti.i32)  # keeps the low 32 bits

    @ti.kernel
    def to_f32(a: ti.i64) -> ti.f32:
        return ti.cast(a, ti.f32)

    assert narrow(2**32 + 5) == 5
    assert narrow(2**31) == -(2**31)
    assert to_f32(2**32 + 5) == float(np.float32(2**32 + 5))


# ----------------------------------------------------------------- evaluation order and laziness


def test_tuple_assignment_evaluates_the_whole_right_side_first(ti):
    a = ti.field(ti.f32, shape=())
    b = ti.field(ti.f32, shape=())
    out = ti.field(ti.i32, shape=12)

    @ti.kernel
    def swap_fields():
        a[None], b[None] = b[None], a[None]

    @ti.kernel
    def swap_locals(x: ti.i32, y: ti.i32, z: ti.i32):
        x_, y_, z_ = x, y, z
        x_, y_ = y_, x_
        out[0], out[1] = x_, y_
        x_, y_, z_ = y_, z_, x_  # a rotation
        out[2], out[3], out[4] = x_, y_, z_
        v = ti.Vector([x, y, z])
        v[0], v[2] = v[2], v[0]
        out[5], out[6] = v[0], v[2]
        p = ti.Vector([x, y])
        q = ti.Vector([z, x])
        p, q = q, p
        out[7], out[8] = p[0], q[0]
        m = ti.Matrix([[x, y], [z, x + y]])
        m[0, 1], m[1, 0] = m[1, 0], m[0, 1]
        out[9], out[10] = m[0, 1], m[1, 0]
        out[11] = m[1, 1]

    a[None], b[None] = 1.5, -2.0
    swap_fields()
    assert (a[None], b[None]) == (-2.0, 1.5)
    swap_locals(1, 2, 3)
    np.testing.assert_array_equal(out.to_numpy(), [2, 1, 1, 3, 2, 3, 1, 3, 1, 3, 2, 3])


def test_and_or_chains_on_integers(ti):
    @ti.kernel
    def run(a: ti.i32, b: ti.i32, c: ti.i32) -> ti.types.vector(4, ti.i32):
        return ti.Vector([a and b and c, a or b or c, a and (b or c), (a or b) and c])

    for a, b, c in [(3, 5, 7), (0, 5, 7), (3, 0, 7), (3, 5, 0), (0, 0, 0), (0, 0, 4)]:
        want = [a and b and c, a or b or c, a and (b or c), (a or b) and c]
        np.testing.assert_array_equal(run(a, b, c), want)


def test_and_or_on_integer_vectors_are_elementwise_truth_values(ti):
    out = ti.Vector.field(4, ti.i32, shape=4)

    @ti.kernel
    def run(a: ti.types.vector(4, ti.i32), b: ti.types.vector(4, ti.i32), s: ti.i32):
        out[0] = a and b
        out[1] = a or b
        out[2] = a and s
        out[3] = s or a

    a = np.array([2, 0, 3, 0])
    b = np.array([5, 4, 0, 0])
    for s in (0, 7):
        run(a, b, s)
        want = [(a != 0) & (b != 0), (a != 0) | (b != 0), (a != 0) & (s != 0),
                (a != 0) | (s != 0)]
        np.testing.assert_array_equal(out.to_numpy(), np.array(want, dtype=np.int32))


def test_and_or_do_not_evaluate_the_right_operand_when_the_left_decides(ti):
    ti.init(arch=ti.cpu, debug=True)  # an out-of-range read would raise
    n = 6
    x = ti.field(ti.i32, shape=n)
    both = ti.field(ti.i32, shape=n)
    either = ti.field(ti.i32, shape=n)

    @ti.kernel
    def run():
        for i in x:
            both[i] = i > 0 and x[i - 1] > 2
            either[i] = i == n - 1 or x[i + 1] > 2

    xs = np.array([5, 1, 3, 4, 0, 9], dtype=np.int32)
    x.from_numpy(xs)
    run()
    prev = np.concatenate([[0], xs[:-1]])
    nxt = np.concatenate([xs[1:], [0]])
    idx = np.arange(n)
    np.testing.assert_array_equal(both.to_numpy(), (idx > 0) & (prev > 2))
    np.testing.assert_array_equal(either.to_numpy(), (idx == n - 1) | (nxt > 2))


def test_conditional_expression_evaluates_only_the_taken_branch(ti, fp, rtol):
    ti.init(arch=ti.cpu, default_fp=fp, debug=True)  # an out-of-range read would raise
    n = 7
    a = ti.field(float, shape=n)
    b = ti.field(float, shape=n)
    c = ti.field(float, shape=n)
    d = ti.field(float, shape=n)

    @ti.func
    def left(i):
        return a[i - 1] * 2.0 if i > 0 else -1.0

    @ti.kernel
    def run():
        for i in a:
            b[i] = a[i - 1] if i > 0 else 0.0
            c[i] = a[i - 1] if i > 0 else (a[i + 1] if i < n - 1 else 0.5)  # nested
            d[i] = left(i)

    xs = np.linspace(-1, 2, n)
    a.from_numpy(xs)
    run()
    prev = np.concatenate([[0.0], xs[:-1]])
    np.testing.assert_allclose(b.to_numpy(), prev, rtol=rtol)
    np.testing.assert_allclose(c.to_numpy(), np.concatenate([[xs[1]], xs[:-1]]), rtol=rtol)
    np.testing.assert_allclose(d.to_numpy(), np.concatenate([[-1.0], 2 * xs[:-1]]), rtol=rtol)


@pytest.mark.difftape_only  # Taichi 1.7.4 selects between vector branches: it reads v[-1]
def test_conditional_expression_with_vector_branches_reads_only_the_taken_one(ti, fp, rtol):
    ti.init(arch=ti.cpu, default_fp=fp, debug=True)  # an out-of-range read would raise
    n = 5
    v = ti.Vector.field(2, float, shape=n)
    w = ti.Vector.field(2, float, shape=n)

    @ti.kernel
    def run():
        for i in v:
            w[i] = v[i - 1] if i > 0 else ti.Vector([0.0, 3.0])

    vs = np.stack([np.arange(n) - 1.5, np.arange(n) ** 2], 1)
    v.from_numpy(vs)
    run()
    np.testing.assert_allclose(w.to_numpy(), np.concatenate([[[0.0, 3.0]], vs[:-1]]),
                               rtol=rtol)


def test_conditional_expression_with_vector_branches_and_scalar_condition(ti, fp, rtol):
    @ti.kernel
    def run(c: ti.i32, x: float) -> ti.types.vector(3, float):
        v = ti.Vector([x, 2 * x, 3.0])
        return v if c > 0 else 0.5 if c == 0 else -v

    for c in (1, 0, -1):
        want = [1.25, 2.5, 3.0] if c > 0 else [0.5] * 3 if c == 0 else [-1.25, -2.5, -3.0]
        np.testing.assert_allclose(run(c, 1.25), want, rtol=rtol)


@pytest.mark.difftape_only  # Taichi inlines func calls eagerly, so it runs both branches' calls
def test_conditional_expression_runs_a_func_call_only_in_the_taken_branch(ti):
    count = ti.field(ti.i32, shape=())
    out = ti.field(ti.i32, shape=())

    @ti.func
    def counted(k):
        count[None] += 1
        return k * 2

    @ti.kernel
    def run(c: ti.i32):
        out[None] = counted(c) if c > 0 else (counted(-c) + 1 if c < -5 else 0)

    for c, calls, value in [(3, 1, 6), (0, 0, 0), (-1, 0, 0), (-7, 1, 15)]:
        count[None] = 0
        run(c)
        assert (count[None], out[None]) == (calls, value)


def test_list_entries_swapped_inside_a_runtime_if(ti):
    """test_implicit_fem's pattern: a Python list of values read from a field, two entries
    swapped under a runtime condition. The entries are variables (as in Taichi), so the swap
    happens only where the condition holds, and the field is not written."""
    F = ti.Vector.field(4, ti.i32, shape=6)
    out = ti.field(ti.i32, shape=(6, 3))

    @ti.kernel
    def reorder(flip_odd: ti.i32):
        for c in F:
            verts = [F[c][(j + 1) % 4] for j in range(3)]
            if flip_odd and c % 2 == 1:
                tmp = verts[1]
                verts[1] = verts[2]
                verts[2] = tmp
            for k in ti.static(range(3)):
                out[c, k] = verts[k]

    data = np.arange(24, dtype=np.int32).reshape(6, 4) * 3
    F.from_numpy(data)
    reorder(1)
    want = data[:, [1, 2, 3]].copy()
    want[1::2] = want[1::2][:, [0, 2, 1]]
    np.testing.assert_array_equal(out.to_numpy(), want)
    np.testing.assert_array_equal(F.to_numpy(), data)
    reorder(0)
    np.testing.assert_array_equal(out.to_numpy(), data[:, [1, 2, 3]])


def test_list_of_variables_holds_copies(ti):
    @ti.kernel
    def copies(flag: ti.i32) -> ti.i32:
        a = 1
        b = 2
        lst = [a, b]
        if flag > 0:
            lst[0] = 7
        lst[1] += 10
        return a * 1000 + b * 100 + lst[0] * 10 + lst[1] - 12

    assert copies(0) == 1000 + 200 + 10
    assert copies(1) == 1000 + 200 + 70


@pytest.mark.difftape_only
def test_compile_time_list_entry_replaced_in_a_runtime_if_is_refused(ti):
    x = ti.field(ti.f32, shape=2)
    y = ti.field(ti.f32, shape=2)

    @ti.kernel
    def pick(c: ti.i32):
        fields = [x, y]
        if c > 0:
            fields[0] = y  # a compile-time choice made under a runtime condition
        fields[0][0] = 1.0

    with pytest.raises(ti.CompileError, match="cannot be replaced inside a runtime if"):
        pick(1)

    @ti.kernel
    def pick_static():
        fields = [x, y]
        fields[0] = y  # straight-line: a compile-time rebinding, as in Python
        fields[0][1] = 2.0

    pick_static()
    assert x[1] == 0.0 and y[1] == 2.0


@pytest.mark.difftape_only  # Taichi 1.7.4 folds x + 0.0 to x: -0.0 + 0.0 gives -0.0 there
def test_adding_zero_keeps_ieee_signed_zeros(ti):
    """``x + 0.0`` is not ``x`` when x is -0.0 (IEEE: +0.0, as NumPy); ``x + -0.0`` and
    ``x - 0.0`` are. Constant folding used to drop all three (Python's -0.0 == 0)."""
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def k():
        x[0] = x[0] + 0.0
        x[1] = x[1] - 0.0
        x[2] = x[2] + -0.0
        x[3] = 0.0 + x[3]

    x.from_numpy(np.full(4, -0.0, np.float32))
    k()
    got = x.to_numpy()
    want = np.array([np.float32(-0.0) + np.float32(0.0), np.float32(-0.0) - np.float32(0.0),
                     np.float32(-0.0) + np.float32(-0.0), np.float32(0.0) + np.float32(-0.0)])
    assert np.array_equal(np.signbit(got), np.signbit(want)), (got, want)
