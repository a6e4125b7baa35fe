"""Quantized types beyond one field per bit range: shared exponents
(``BitpackedFields.place(..., shared_exponent=True)``), ``SNode.quant_array`` (elements packed
along axes into one word) and vector/matrix fields of quantized types.

Expected values come from the definitions of the encodings, computed here: a shared exponent is
the largest f32 exponent of the fields that share it, and each field keeps its value rounded
(half up, in magnitude) to its digit bits below that exponent; a quant_array element wraps at
its bits as a quant int field does; a fixed-point entry rounds half away from zero to a
multiple of its scale. Never values copied from a run."""

import math

import numpy as np
import pytest


def _shared(values, digit_bits, exp_bits):
    """What fields sharing one exponent read back after a store of ``values`` (every user's
    value, f32): the exponent is the largest f32 exponent among them (flushed to zero below
    the smallest the exponent bits hold), each value rounded half up to ``digit_bits`` digits
    below it (the leading one included), at most all ones."""
    vals = [float(np.float32(v)) for v in values]
    nonzero = [abs(v) for v in vals if v != 0]
    if not nonzero:
        return [0.0] * len(vals)
    top = max(math.frexp(v)[1] - 1 for v in nonzero)  # unbiased f32 exponent
    biased = top + 127
    if biased - (127 - (1 << (exp_bits - 1)) + 1) <= 0:  # below the smallest exponent
        return [0.0] * len(vals)
    out = []
    for v, db in zip(vals, digit_bits, strict=True):
        unit = 2.0 ** (top - db + 1)
        d = min(math.floor(abs(v) / unit + 0.5), 2 ** db - 1)
        out.append(math.copysign(d * unit, v) if d else 0.0)
    return out


def _shared_pair(ti, exp_bits, frac_a=10, frac_b=14, signed_b=False, shape=None):
    a = ti.field(dtype=ti.types.quant.float(exp=exp_bits, frac=frac_a, signed=False))
    b = ti.field(dtype=ti.types.quant.float(exp=exp_bits, frac=frac_b, signed=signed_b))
    bp = ti.BitpackedFields(max_num_bits=32)
    bp.place(a, b, shared_exponent=True)
    (ti.root.dense(ti.i, shape) if shape else ti.root).place(bp)
    return a, b, [frac_a, frac_b - int(signed_b)]


@pytest.mark.parametrize("exp_bits", [6, 8])
def test_shared_exponent_stores_round_below_the_largest(ti, exp_bits):
    a, b, db = _shared_pair(ti, exp_bits, signed_b=True)

    @ti.kernel
    def both(x: ti.f32, y: ti.f32):
        a[None] = x  # two stores of one word in a row: one store, one exponent for both
        b[None] = y

    pairs = [(3.2, 0.25), (1000.0, 1e-6), (0.1, -77.7), (5.5, -5.5), (1e-30, 1e-30),
             (0.0, 0.0), (2047.9, 0.001), (0.0, -3.0)]
    for x, y in pairs:
        both(x, y)
        assert [a[None], b[None]] == _shared([x, y], db, exp_bits), (x, y)

    # One field stored alone (Python scope): the other keeps its value, rounded again below
    # the new exponent.
    both(3.0, 0.8125)
    a[None] = 300.0
    want = _shared([300.0, _shared([3.0, 0.8125], db, exp_bits)[1]], db, exp_bits)
    assert [a[None], b[None]] == want
    b[None] = -0.5
    assert [a[None], b[None]] == _shared([want[0], -0.5], db, exp_bits)


def test_shared_exponent_store_fusion_stops_at_a_load(ti):
    a, b, db = _shared_pair(ti, 8)
    seen = ti.field(ti.f32, shape=())

    @ti.kernel
    def fused(x: ti.f32, y: ti.f32):
        a[None] = x
        b[None] = y

    @ti.kernel
    def apart(x: ti.f32, y: ti.f32):
        a[None] = x
        seen[None] = a[None]  # the word is read between the stores: two stores
        b[None] = y

    fused(1000.0, 1000.0)
    fused(1e-3, 1e-3)  # one exponent for both: both keep their value
    assert [a[None], b[None]] == _shared([1e-3, 1e-3], db, 8)
    fused(1000.0, 1000.0)
    apart(1e-3, 1e-3)  # a is stored beside b = 1000 first: its digits are shifted out
    first = _shared([1e-3, 1000.0], db, 8)
    assert seen[None] == first[0] == 0.0
    assert [a[None], b[None]] == _shared([first[0], 1e-3], db, 8)


def test_shared_exponent_atomics_and_parallel_stores(ti):
    n = 64
    a, b, db = _shared_pair(ti, 7, shape=n)

    @ti.kernel
    def fill():
        for i in range(n):  # parallel: each word by one iteration, both fields in one store
            a[i] = i * 1.5
            b[i] = 100.0 - i

    @ti.kernel
    def bump():
        for i in range(n):
            a[i] += 0.25  # decoded with the shared exponent, added, encoded with b's value
            b[i] -= 1.0

    fill()
    want = [_shared([i * 1.5, 100.0 - i], db, 7) for i in range(n)]
    assert [[a[i], b[i]] for i in range(n)] == want
    bump()
    for i in range(n):
        wa = _shared([want[i][0] + 0.25, want[i][1]], db, 7)
        assert [a[i], b[i]] == _shared([wa[0], wa[1] - 1.0], db, 7), i


@pytest.mark.difftape_only  # Taichi 1.7.4 demotes atomics on quant floats to plain
# read-modify-writes: in a parallel loop its threads overwrite each other's adds
def test_shared_exponent_parallel_atomics_into_one_word(ti):
    a, b, db = _shared_pair(ti, 8)

    @ti.kernel
    def many():
        for i in range(400):  # every iteration updates the same word
            if i % 2 == 0:
                a[None] += 1.0
            else:
                b[None] += 0.5

    many()
    # every partial sum is exact in the digits both fields keep (a <= 200, b <= 100)
    assert [a[None], b[None]] == [200.0, 100.0]


def test_shared_exponent_vector_field(ti):
    v = ti.Vector.field(3, dtype=ti.types.quant.float(exp=8, frac=12, signed=True))
    bp = ti.BitpackedFields(max_num_bits=64)
    bp.place(v, shared_exponent=True)  # the entries of a vector field share one exponent
    ti.root.dense(ti.i, 2).place(bp)

    @ti.kernel
    def store(i: ti.i32, x: ti.f32, y: ti.f32, z: ti.f32):
        v[i] = ti.Vector([x, y, z])

    store(0, 1.0, -100.0, 0.3)
    store(1, 1e-3, 2e-3, -4e-3)
    assert list(v[0]) == _shared([1.0, -100.0, 0.3], [11] * 3, 8)
    assert list(v[1]) == _shared([1e-3, 2e-3, -4e-3], [11] * 3, 8)


def _wrap(v: int, bits: int, signed: bool) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v


def test_quant_array_packs_elements_into_words(ti):
    n = 64
    x = ti.field(dtype=ti.types.quant.int(7, True))
    y = ti.field(ti.i32, shape=n)
    ti.root.dense(ti.i, n // 4).quant_array(ti.i, 4, max_num_bits=32).place(x)

    @ti.kernel
    def store():
        for i in range(n):  # parallel: neighbours in one word stored at the same time
            x[i] = i * 5 - 100

    @ti.kernel
    def load():
        for i in range(n):
            y[i] = x[i]

    store()
    load()
    assert y.to_numpy().tolist() == [_wrap(i * 5 - 100, 7, True) for i in range(n)]
    x[9] = 63  # Python scope: one element; its neighbours in the word are untouched
    x[10] = 64
    assert [x[i] for i in range(8, 12)] == [_wrap(v, 7, True) for v in
                                            (8 * 5 - 100, 63, 64, 11 * 5 - 100)]


def test_quant_array_parallel_atomics_into_neighbours(ti):
    x = ti.field(dtype=ti.types.quant.int(13, True))
    ti.root.quant_array(ti.i, 4, max_num_bits=64).place(x)
    start = [100, -200, 4000, 7]
    for i, v in enumerate(start):
        x[i] = v

    @ti.kernel
    def adds():
        for k in range(1000):
            x[k % 4] += k  # four elements of one word, updated by every iteration

    adds()
    sums = [sum(k for k in range(1000) if k % 4 == i) for i in range(4)]
    want = [_wrap(s + v, 13, True) for s, v in zip(sums, start, strict=True)]
    assert [x[i] for i in range(4)] == want


def test_quant_array_2d_and_fixed(ti):
    m, n = 6, 16
    q = ti.field(dtype=ti.types.quant.fixed(bits=4, signed=False, scale=0.25))
    # words of 2 x 4 elements (rows i, i+1 and four columns), 3 x 4 words
    ti.root.dense(ti.ij, (m // 2, n // 4)).quant_array(ti.ij, (2, 4), max_num_bits=32).place(q)
    assert q.shape == (m, n)

    @ti.kernel
    def store():
        for i, j in ti.ndrange(m, n):
            q[i, j] = (i * n + j) * 0.1

    store()
    for i in range(m):
        for j in range(n):
            v = np.float32((i * n + j) * 0.1) * np.float32(4)
            d = int(v + np.float32(0.5))  # round half away from zero, keep 4 bits
            assert q[i, j] == (d & 15) * 0.25, (i, j)


def test_quant_fixed_matrix_field_entries_in_two_words(ti):
    s = 1 / 256
    qfx = ti.types.quant.fixed(bits=16, scale=s)
    m = ti.Matrix.field(2, 2, dtype=qfx)
    for row in range(2):
        bp = ti.BitpackedFields(max_num_bits=32)
        bp.place(m.get_scalar_field(row, 0), m.get_scalar_field(row, 1))
        ti.root.place(bp)

    r = np.array([[0.5, -0.75], [0.25, 0.5]], np.float32)

    @ti.kernel
    def step():
        m[None] = m[None] @ ti.Matrix([[0.5, -0.75], [0.25, 0.5]])

    def fixed(a):  # round half away from zero to a multiple of s
        d = np.float32(a) / np.float32(s)
        return np.sign(d) * np.floor(np.abs(d) + 0.5) * s

    def values():
        return [[m[None][i, j] for j in range(2)] for i in range(2)]

    m[None] = [[1.0, 0.3], [-0.7, 2.0]]
    want = fixed(np.array([[1.0, 0.3], [-0.7, 2.0]], np.float32))
    assert values() == want.tolist()
    for _ in range(4):
        step()
        want = fixed(want.astype(np.float32) @ r)
        assert values() == want.tolist()
    m[None][1, 0] = 0.126  # one entry, through the element
    assert m[None][1, 0] == fixed(0.126) and m[None][0, 0] == want[0, 0]


def test_quant_vector_field_of_several_types(ti):
    qi = ti.types.quant.int(5, True)
    qj = ti.types.quant.int(9, True)
    v = ti.Vector.field(2, dtype=[qi, qj])
    bp = ti.BitpackedFields(max_num_bits=32)
    bp.place(v)
    ti.root.dense(ti.i, 3).place(bp)

    @ti.kernel
    def store():
        for i in range(3):
            v[i] = ti.Vector([i * 13 - 20, i * 130 + 5])

    store()
    assert [list(v[i]) for i in range(3)] == [[_wrap(i * 13 - 20, 5, True),
                                               _wrap(i * 130 + 5, 9, True)] for i in range(3)]


@pytest.mark.difftape_only  # Taichi's refusals of these come at compile time, in its C++ asserts
def test_quant_packing_refusals(ti):
    qf5 = ti.types.quant.float(exp=5, frac=10)
    qf6 = ti.types.quant.float(exp=6, frac=10)
    with pytest.raises(ti.DifftapeError, match="same exponent type"):
        ti.BitpackedFields(max_num_bits=32).place(ti.field(dtype=qf5), ti.field(dtype=qf6),
                                                 shared_exponent=True)
    with pytest.raises(ti.DifftapeError, match="quant float"):
        ti.BitpackedFields(max_num_bits=32).place(ti.field(dtype=ti.types.quant.int(4)),
                                                 ti.field(dtype=ti.types.quant.int(4)),
                                                 shared_exponent=True)
    with pytest.raises(ti.DifftapeError, match="do not fit"):
        ti.root.quant_array(ti.i, 8, max_num_bits=32).place(ti.field(dtype=ti.types.quant.int(5)))
    with pytest.raises(ti.DifftapeError, match="quant int or fixed"):
        ti.root.quant_array(ti.i, 2, max_num_bits=32).place(ti.field(dtype=qf5))
    with pytest.raises(ti.DifftapeError, match="exactly one field"):
        ti.root.quant_array(ti.i, 2, max_num_bits=32).place(
            ti.field(dtype=ti.types.quant.int(4)), ti.field(dtype=ti.types.quant.int(4)))
    with pytest.raises(ti.DifftapeError, match="no SNode can be placed under a quant_array"):
        ti.root.quant_array(ti.i, 2, max_num_bits=32).dense(ti.j, 2)
    with pytest.raises(RuntimeError, match="same compute type"):
        ti.Vector.field(2, dtype=[ti.types.quant.int(4), ti.types.quant.fixed(bits=4)])
    with pytest.raises(ti.DifftapeError, match="derivatives of quantized fields"):
        ti.Vector.field(2, dtype=qf5, needs_grad=True)
