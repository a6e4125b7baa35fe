"""Quantized types (ti.types.quant.int/fixed/float in ti.BitpackedFields): stores round, wrap
and flush as Taichi's encodings say, in kernels and in Python scope, and atomics update the
packed word without touching the other fields' bits. Expected values are computed here from
the encodings' definitions (two's complement, round half away from zero, f32 rounded to the
fraction bits), never copied from a run."""

import numpy as np
import pytest


def _wrap(v: int, bits: int, signed: bool) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v


def _packed(ti, *qtypes, shape=None, max_num_bits=32):
    fields = [ti.field(dtype=q) for q in qtypes]
    bp = ti.BitpackedFields(max_num_bits=max_num_bits)
    bp.place(*fields)
    (ti.root.dense(ti.i, shape) if shape else ti.root).place(bp)
    return fields


def test_quant_int_wraps_and_shares_the_word(ti):
    x, y, z = _packed(ti, ti.types.quant.int(13, True), ti.types.quant.int(14, False),
                      ti.types.quant.int(5, True), shape=8)
    vals = np.array([-5000, 4095, -4096, 5000, 9000, -1, 0, 123])

    @ti.kernel
    def store(a: ti.types.ndarray()):
        for i in range(8):
            x[i] = a[i]
            y[i] = a[i] * 3
            z[i] = a[i]

    store(vals)
    assert [x[i] for i in range(8)] == [_wrap(int(v), 13, True) for v in vals]
    assert [y[i] for i in range(8)] == [_wrap(int(v) * 3, 14, False) for v in vals]
    assert [z[i] for i in range(8)] == [_wrap(int(v), 5, True) for v in vals]
    x[2] = 7000  # Python scope wraps as kernels do, and leaves y and z alone
    assert x[2] == _wrap(7000, 13, True)
    assert y[2] == _wrap(-4096 * 3, 14, False) and z[2] == _wrap(-4096, 5, True)


def test_quant_int_atomics_wrap_at_their_bits(ti):
    x, y, z = _packed(ti, ti.types.quant.int(13, True), ti.types.quant.int(5, True),
                      ti.types.quant.int(2, False))
    x[None], y[None], z[None] = 4000, 2, 0

    @ti.kernel
    def foo():
        for _i in range(100):  # parallel: compare-and-swap on the shared word
            x[None] += 3
        for _j in range(5):
            y[None] -= 1
        for _k in range(5):
            z[None] += 1

    foo()
    assert x[None] == _wrap(4000 + 300, 13, True)
    assert y[None] == -3
    assert z[None] == _wrap(5, 2, False)


def test_quant_fixed_rounds_half_away_from_zero(ti):
    scale = 0.1
    x, = _packed(ti, ti.types.quant.fixed(bits=13, signed=True, scale=scale))
    for v in [0.7, -0.7, 0.04, 0.06, -0.06, 12.34, -409.6]:
        x[None] = v
        d = np.float32(v) * np.float32(1 / scale)
        d = int(d + np.float32(0.5)) if d > 0 else int(d - np.float32(0.5))
        assert x[None] == pytest.approx(d * scale, rel=1e-6, abs=1e-7)

    @ti.kernel
    def acc():
        for _ in range(10):
            x[None] -= 0.44  # every add rounds to a multiple of the scale: -0.4 each

    x[None] = 0.7
    acc()
    assert x[None] == pytest.approx(0.7 - 10 * 0.4, abs=1e-5)


def test_quant_float_rounds_to_its_fraction_bits(ti):
    x, u = _packed(ti, ti.types.quant.float(exp=6, frac=13, signed=True),
                   ti.types.quant.float(exp=5, frac=2, signed=False))
    for v in [0.0, 0.125, -6.0, 9.0, 1024.0, -1 / 1024]:
        x[None] = v
        assert x[None] == v
    # 1.625 = 1.101b: 2 fraction bits round it up to 1.75 (halves go up); 1.6 rounds to 1.5
    for v, want in [(1.625, 1.75), (1.6, 1.5), (1.75, 1.75), (3.5, 3.5)]:
        u[None] = v
        assert u[None] == want
    x[None] = np.float32(np.pi)  # 12 fraction bits: pi to within 2**-12 relative
    assert x[None] != np.float32(np.pi) and x[None] == pytest.approx(np.pi, rel=2.0 ** -12)
    x[None] = 1e-30  # below the smallest 6-bit exponent: flushed to zero
    assert x[None] == 0

    @ti.kernel
    def inc():
        for _ in range(1):
            u[None] += 1

    u[None] = 0
    inc()
    inc()
    assert u[None] == 2


def test_quant_fields_in_kernels_read_their_rounded_values(ti):
    x, f = _packed(ti, ti.types.quant.int(10, True), ti.types.quant.fixed(bits=16, max_value=2),
                   shape=4)
    out = ti.field(ti.f32, shape=4)

    @ti.kernel
    def run():
        for i in range(4):
            x[i] = 10.7 * i  # cast to the compute type first (truncation), then wrapped
            f[i] = 0.3 * i
        for i in range(4):
            out[i] = x[i] + f[i]

    run()
    scale = 2 / 2 ** 15
    want = [int(10.7 * i) + round(np.float32(0.3 * i) / scale) * scale for i in range(4)]
    assert out.to_numpy() == pytest.approx(want, rel=1e-6)


@pytest.mark.difftape_only  # Taichi 1.7.4's to_numpy/from_numpy fail on packed fields
def test_quant_to_and_from_numpy_encode_each_element(ti):
    x, y = _packed(ti, ti.types.quant.int(7, True), ti.types.quant.fixed(bits=8, max_value=2),
                   shape=5)
    x.from_numpy(np.array([1, 63, 64, -65, 200], np.int32))
    y.fill(0.3)
    assert x.to_numpy().tolist() == [_wrap(v, 7, True) for v in [1, 63, 64, -65, 200]]
    assert y.to_numpy() == pytest.approx([round(0.3 * 64) / 64] * 5)
    x.fill(3)  # the other field of the word is untouched
    assert y.to_numpy() == pytest.approx([round(0.3 * 64) / 64] * 5)


@pytest.mark.difftape_only  # what difftape does not implement is refused by name
def test_unsupported_quantized_features_are_refused(ti):
    qf = ti.types.quant.float(exp=5, frac=10)
    a, b = ti.field(dtype=qf), ti.field(dtype=qf)
    with pytest.raises(ti.DifftapeError, match="derivatives of quantized fields"):
        ti.field(dtype=ti.types.quant.fixed(bits=8), needs_grad=True)
    with pytest.raises(ti.DifftapeError, match="do not fit"):
        ti.BitpackedFields(max_num_bits=16).place(a, b)
    with pytest.raises(ti.DifftapeError, match="BitpackedFields"):
        ti.root.place(ti.field(dtype=ti.types.quant.int(4)))
