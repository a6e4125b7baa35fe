"""Unsigned integers (u8..u64): kernel arguments and returns over their full range, field
storage, arithmetic with unsigned semantics (division, remainder, shifts, comparisons, casts to
float) and Taichi's promotion rule (unsigned wins at equal width), checked against NumPy."""

import numpy as np
import pytest


def _bits(name: str) -> int:
    return int(name[1:])


def test_u64_return_and_argument_cover_the_full_range(ti):
    @ti.kernel
    def all_ones() -> ti.u64:
        return ti.cast(-1, ti.u64)

    @ti.kernel
    def echo(x: ti.u64) -> ti.u64:
        return x

    @ti.kernel
    def half(x: ti.u64) -> ti.u64:
        return x // 2

    assert all_ones() == 2**64 - 1
    for v in (0, 1, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1):
        assert echo(v) == v
        assert half(v) == v // 2


@pytest.mark.parametrize("name", ("u8", "u16", "u32"))
def test_narrow_unsigned_arguments_and_returns(ti, name):
    dt = getattr(ti, name)
    top = 2 ** _bits(name) - 1

    @ti.kernel
    def echo(x: dt) -> dt:
        return x

    @ti.kernel
    def widen(x: dt) -> ti.i64:
        return x

    assert echo(top) == top and echo(0) == 0
    assert widen(top) == top


def test_negative_unsigned_arguments_are_refused(ti):
    @ti.kernel
    def echo(x: ti.u32) -> ti.u32:
        return x

    with pytest.raises(TypeError):
        echo(-1)


# Taichi 1.7.4 itself gets u8 floor division wrong (it returns 0/1), hence difftape_only there.
@pytest.mark.parametrize("name", [pytest.param("u8", marks=pytest.mark.difftape_only),
                                  "u16", "u32", "u64"])
def test_unsigned_arithmetic_matches_numpy(ti, name):
    dt = getattr(ti, name)
    npdt = np.dtype(f"uint{_bits(name)}")
    rng = np.random.default_rng(_bits(name))
    n = 64
    top = np.iinfo(npdt).max
    a_np = rng.integers(0, top, n, dtype=npdt, endpoint=True)
    b_np = rng.integers(1, top, n, dtype=npdt, endpoint=True)
    a_np[:4] = [top, top - 1, top // 2 + 1, 0]
    b_np[:4] = [3, top, 1, 7]
    a, b = ti.field(dt, n), ti.field(dt, n)
    a.from_numpy(a_np)
    b.from_numpy(b_np)
    quo, rem, shr, prod, tot = (ti.field(dt, n) for _ in range(5))
    cmp = ti.field(ti.i32, n)
    flt = ti.field(ti.f64, n)

    @ti.kernel
    def run():
        for i in a:
            quo[i] = a[i] // b[i]
            rem[i] = a[i] % b[i]
            shr[i] = a[i] >> 3
            prod[i] = a[i] * b[i]
            tot[i] = a[i] + b[i]
            cmp[i] = (a[i] < b[i]) + 2 * (a[i] >= b[i] // 2) + 4 * (a[i] > 1)
            flt[i] = ti.cast(a[i], ti.f64)

    run()
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(quo.to_numpy(), a_np // b_np)
        np.testing.assert_array_equal(rem.to_numpy(), a_np % b_np)
        np.testing.assert_array_equal(shr.to_numpy(), a_np >> npdt.type(3))
        np.testing.assert_array_equal(prod.to_numpy(), a_np * b_np)
        np.testing.assert_array_equal(tot.to_numpy(), a_np + b_np)
    want = (a_np < b_np).astype(int) + 2 * (a_np >= b_np // 2) + 4 * (a_np > 1)
    np.testing.assert_array_equal(cmp.to_numpy(), want)
    np.testing.assert_array_equal(flt.to_numpy(), a_np.astype(np.float64))
    assert quo.to_numpy().dtype == npdt


@pytest.mark.parametrize("name", ("u32", "u64"))
def test_unsigned_wins_promotion_at_equal_width(ti, name):
    dt = getattr(ti, name)
    signed = getattr(ti, f"i{_bits(name)}")
    top = 2 ** _bits(name) - 1

    @ti.kernel
    def mix(a: dt, b: signed) -> dt:
        return a + b  # unsigned: wraps modulo 2**bits

    @ti.kernel
    def less(a: dt, b: signed) -> ti.i32:
        return b < a  # compared as unsigned: -1 is the largest value

    assert mix(top, -1) == top - 1
    assert mix(0, -1) == top
    assert less(5, -1) == 0


def test_unsigned_field_python_scope_round_trip(ti):
    x = ti.field(ti.u64, 3)
    x[0] = 2**64 - 1
    x.from_numpy(np.array([2**64 - 1, 2**63, 5], dtype=np.uint64))
    assert [x[i] for i in range(3)] == [2**64 - 1, 2**63, 5]
    assert x.to_numpy().dtype == np.uint64
    nd = ti.ndarray(ti.u32, 2)
    nd[1] = 2**32 - 1
    assert nd[1] == 2**32 - 1


def test_type_predicates(ti):
    assert ti.types.is_signed(ti.i8) and not ti.types.is_signed(ti.u8)
    assert ti.types.is_integral(ti.u16) and ti.types.is_integral(ti.i64)
    assert not ti.types.is_integral(ti.f32)
    assert ti.types.is_real(ti.f64) and not ti.types.is_real(ti.u32)


def test_u1_is_a_one_bit_unsigned_type(ti):
    """u1 stores NumPy bools; arithmetic wraps modulo 2; converting to u1 means "nonzero"."""
    flags = ti.field(ti.u1, 4)
    out = ti.field(ti.i32, 3)

    @ti.kernel
    def run(a: ti.u1, b: ti.u1):
        out[0] = a + b
        out[1] = a * b
        out[2] = ti.cast(a, ti.i32) + 5
        flags[0] = a + b
        flags[1] = 6  # nonzero: true (not the low bit)
        flags[2] = a

    for a, b in ((1, 1), (1, 0), (0, 0)):
        run(a, b)
        assert out.to_numpy().tolist() == [(a + b) % 2, a * b, a + 5]
        assert flags.to_numpy().tolist() == [bool((a + b) % 2), True, bool(a), False]
    assert flags.to_numpy().dtype == np.bool_
    assert ti.ndarray(ti.u1, 2).to_numpy().dtype == np.bool_
    flags.from_numpy(np.array([0, 2, 1, 0]))
    assert flags.to_numpy().tolist() == [False, True, True, False]

    @ti.kernel
    def count(m: ti.types.ndarray(), out: ti.types.ndarray()):
        for i in m:
            out[i] = m[i] + 1

    mask = np.array([True, False, True])
    counted = np.zeros(3, np.int32)
    count(mask, counted)
    assert counted.tolist() == [2, 1, 2]


@pytest.mark.difftape_only
def test_u1_casts_from_float_and_refuses_atomics(ti):
    @ti.kernel
    def nonzero(x: ti.f32) -> ti.u1:
        return ti.cast(x, ti.u1)

    @ti.kernel
    def folded() -> ti.i32:
        return ti.cast(0.25, ti.u1) + 2 * ti.cast(-3, ti.u1) + 4 * ti.cast(0.0, ti.u1)

    assert [nonzero(v) for v in (0.5, 0.0, -2.0)] == [1, 0, 1]
    assert folded() == 3
    flags = ti.field(ti.u1, 2)

    @ti.kernel
    def bump():
        for i in range(4):
            flags[i % 2] += 1

    with pytest.raises(ti.CompileError, match="u1"):
        bump()


@pytest.mark.parametrize("n", (3, 8, 64))
def test_narrow_cast_products_in_short_loops(ti, n):
    """Truncating casts and products at several widths side by side, stored to i64 columns
    (bench/fuzz_areas.py, seed 154). LLVM's SLP vectorizer packs ``zext(trunc)`` (an ``and``)
    and ``sext(trunc)`` (an ``ashr``) of one iteration into one vector each and blends them; on
    AVX-512 the x86 backend turned the blend into an OR, and the sign fill of the shift's
    unused lanes leaked into the u8 product (-1 wherever the i64 product was negative) in
    loops too short for the loop vectorizer (n = 3, 8)."""
    iv = ti.field(ti.i64, shape=(n, 3))
    o = ti.field(ti.i64, shape=(n, 7))

    @ti.kernel
    def casts():
        for i in range(n):
            o[i, 2] = ti.cast(ti.cast(ti.cast(iv[i, 0], ti.u16), ti.u8) * ti.cast(iv[i, 2], ti.u8),
                              ti.i64)
            o[i, 3] = ti.cast(ti.cast(ti.cast(iv[i, 2], ti.i32), ti.i8), ti.i64)
            o[i, 4] = ti.cast(ti.cast(iv[i, 2], ti.u32) * ti.cast(iv[i, 2], ti.u32), ti.i64)
            o[i, 5] = ti.cast(ti.cast(iv[i, 0], ti.i32) * ti.cast(iv[i, 1], ti.i32), ti.i64)
            o[i, 6] = ti.cast(ti.cast(iv[i, 2], ti.i8), ti.i64) * iv[i, 2]

    rng = np.random.default_rng(154)
    x = rng.integers(-(2**40), 2**40, size=(n, 3), dtype=np.int64)
    # Products of both signs in every column: x0 < 0, x2 cycling through both signs.
    x[:, 0] = -np.abs(x[:, 0]) - 1
    x[:, 2] = np.resize(np.array([-200, 200, -7, 3, 1000, -1000, 77, -300]), n)
    iv.from_numpy(x)
    casts()
    x0, x1, x2 = x[:, 0], x[:, 1], x[:, 2]
    want = np.zeros((n, 7), np.int64)
    want[:, 2] = (x0.astype(np.uint16).astype(np.uint8) * x2.astype(np.uint8)).astype(np.int64)
    want[:, 3] = x2.astype(np.int32).astype(np.int8)
    want[:, 4] = x2.astype(np.uint32) * x2.astype(np.uint32)
    want[:, 5] = x0.astype(np.int32) * x1.astype(np.int32)
    want[:, 6] = x2.astype(np.int8).astype(np.int64) * x2
    assert (want[:, 6] < 0).any() and (want[:, 6] > 0).any()
    np.testing.assert_array_equal(o.to_numpy(), want)
