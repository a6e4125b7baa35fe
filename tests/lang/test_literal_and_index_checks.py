"""Values that do not fit: integer literals out of their type's range, indices out of a local
vector's or matrix's range. Each is an error (at compile time for constants, at run time under
``debug=True`` for runtime indices), never a silently wrapped number or a dropped write.

Where Taichi 1.7.4 raises too, the tests run on it with its error classes; where it accepts the
program and does something else (drops the write, crashes), they are difftape-only.
"""

import numpy as np
import pytest


def _compile_error(ti):
    return getattr(ti, "CompileError", None) or ti.TaichiCompilationError


def _assertion_error(ti):
    return getattr(ti, "KernelAssertionError", None) or ti.TaichiAssertionError


# ------------------------------------------------------------------ integer literals


def test_int_literal_out_of_default_ip_range_is_an_error(ti):
    @ti.kernel
    def assigned() -> ti.i32:
        b = 0x80000000
        return b

    @ti.kernel
    def in_an_i32_sum() -> ti.i32:
        b = 5
        b = b + 0x80000000
        return b

    @ti.kernel
    def annotated_i32() -> ti.i32:
        b: ti.i32 = 3000000000
        return b

    @ti.kernel
    def u8_constructor() -> ti.i32:
        return ti.u8(300)

    for k in (assigned, in_an_i32_sum, annotated_i32, u8_constructor):
        with pytest.raises(_compile_error(ti), match="literal"):
            k()


def test_int_literal_out_of_range_is_a_type_error_naming_the_range(ti):
    """Taichi's class and words: a TypeError-kind error, 'exceeded the range of default_ip'
    for a bare literal, '... of specified dtype' for one given a type."""
    @ti.kernel
    def bare():
        b = 0x80000000  # noqa: F841

    @ti.kernel
    def typed():
        b = ti.u16(-1)  # noqa: F841

    with pytest.raises(ti.TaichiTypeError, match="exceeded the range of default_ip"):
        bare()
    with pytest.raises(ti.TaichiTypeError, match="exceeded the range of specified dtype"):
        typed()


def test_a_primitive_type_takes_exactly_one_value(ti):
    """ti.i64(1, 2) and ti.f64(1, x=2) in a kernel are refused (extra values were a Python
    TypeError from the constructor's signature); ti.i64(7) still casts."""
    @ti.kernel
    def two() -> ti.i64:
        return ti.i64(1, 2)

    @ti.kernel
    def keyword() -> ti.f64:
        return ti.f64(1, x=2)

    @ti.kernel
    def one() -> ti.i64:
        return ti.i64(7)

    for k in (two, keyword):
        with pytest.raises(ti.TaichiSyntaxError,
                           match="A primitive type can only decorate a single expression"):
            k()
    assert one() == 7


def test_a_primitive_type_annotates_a_literal_of_its_kind(ti):
    """ti.f32(x) of a Python number annotates a literal (as in Taichi): an int literal given a
    float type, or a float literal an int type, is refused (ti.cast converts); a kernel value
    is cast; a vector is refused; a NumPy array only when it is not 0-d."""
    N = 3

    @ti.kernel
    def float_as_i32():
        a = ti.i32(0.0)  # noqa: F841

    @ti.kernel
    def int_as_f32():
        a = ti.f32(0)  # noqa: F841

    @ti.kernel
    def global_int_as_f32() -> ti.f32:
        return ti.f32(N)

    @ti.kernel
    def vector():
        a = ti.Vector([1])
        b = ti.f16(a)  # noqa: F841

    @ti.kernel
    def array_1d() -> ti.f32:
        return ti.f32(np.array([2.0]))

    @ti.kernel
    def fine() -> ti.types.vector(4, ti.f64):
        i = 7
        x = 2.75
        return ti.Vector([ti.f64(i), ti.i32(x), ti.f64(1.5), ti.f64(np.array(0.25))],
                         dt=ti.f64)

    with pytest.raises(ti.TaichiTypeError, match="Floating-point literals must be annotated "
                       "with a floating-point type. For type casting, use `ti.cast`"):
        float_as_i32()
    for k in (int_as_f32, global_int_as_f32):
        with pytest.raises(ti.TaichiTypeError, match="Integer literals must be annotated with "
                           "a integer type. For type casting, use `ti.cast`"):
            k()
    with pytest.raises(ti.TaichiSyntaxError, match="A primitive type cannot decorate an "
                       "expression with a compound type"):
        vector()
    with pytest.raises(ti.TaichiTypeError, match="Only 0-dimensional numpy array"):
        array_1d()
    np.testing.assert_array_equal(fine().to_numpy(), [7.0, 2.0, 1.5, 0.25])


def test_rounding_and_trigonometry_of_integers_are_refused(ti):
    """As Taichi: floor/ceil/round and sin/cos/tan/asin/acos/tanh take real inputs only (an
    integer is most likely a missing cast); sqrt/exp/log of one work in default_fp."""
    @ti.kernel
    def floor_int() -> ti.f32:
        a = 1
        return ti.floor(a)

    @ti.kernel
    def sin_int() -> ti.f32:
        a = 1
        return ti.sin(a)

    @ti.kernel
    def fine() -> ti.types.vector(3, ti.f32):
        a = 4
        return ti.Vector([ti.sqrt(a), ti.floor(2.5), ti.sin(ti.cast(a, ti.f32))])

    with pytest.raises(ti.TaichiTypeError, match="'floor' takes real inputs only"):
        floor_int()
    with pytest.raises(ti.TaichiTypeError, match="'sin' takes real inputs only"):
        sin_int()
    np.testing.assert_allclose(fine().to_numpy(), [2.0, 2.0, np.sin(4.0)], rtol=1e-6)


def test_int_literals_in_range_keep_their_value(ti):
    u8f = ti.field(ti.u8, shape=2)

    @ti.kernel
    def values() -> ti.types.vector(5, ti.i64):
        u8f[0] = 300  # an i32 300 stored into a u8: converted as a C cast, as in Taichi
        return ti.Vector([-2147483648, ti.u32(4294967295), ti.i64(3000000000),
                          ti.cast(-1, ti.u8), ti.i8(-128)], dt=ti.i64)

    got = values().to_numpy()
    np.testing.assert_array_equal(got, [-2147483648, 4294967295, 3000000000, 255, -128])
    assert u8f[0] == 300 % 256


@pytest.mark.difftape_only  # Taichi makes every literal an i32 first and refuses these
def test_wide_int_literal_in_a_wide_context(ti):
    i64f = ti.field(ti.i64, shape=1)

    @ti.kernel
    def wide() -> ti.i64:
        b: ti.i64 = 3000000000
        i64f[0] = 3000000001
        return b + i64f[0] + b * 3000000000  # next to an i64, the literal is an i64

    @ti.kernel
    def in_a_float_sum() -> ti.f64:
        x = ti.f64(0.5)
        return x + 3000000000

    assert wide() == 6000000001 + 3000000000 * 3000000000
    assert i64f[0] == 3000000001
    assert in_a_float_sum() == 3000000000.5


# ------------------------------------------------------------------ local vector indices


@pytest.mark.difftape_only  # Taichi drops the write, and crashes on the read
def test_constant_index_out_of_a_local_vector_is_an_error(ti):
    @ti.kernel
    def write() -> ti.f32:
        v = ti.Vector([1.0, 2.0])
        v[2] = 1.0
        return v[0]

    @ti.kernel
    def read() -> ti.f32:
        v = ti.Vector([1.0, 2.0])
        return v[2]

    @ti.kernel
    def matrix_column() -> ti.f32:
        m = ti.Matrix([[1.0, 2.0], [3.0, 4.0]])
        m[1, 2] = 0.0
        return m[0, 0]

    @ti.kernel
    def matrix_row() -> ti.f32:
        m = ti.Matrix([[1.0, 2.0], [3.0, 4.0]])
        r = m[2, :]  # (m[2] is refused for its one index, as in Taichi)
        return r[0]

    @ti.kernel
    def component() -> ti.f32:
        v = ti.Vector([1.0, 2.0])
        v.z = 3.0
        return v[0]

    for k in (write, read, matrix_column, matrix_row, component):
        with pytest.raises(ti.CompileError, match="out of range|only has attributes"):
            k()


def test_negative_constant_index_of_a_local_vector_is_an_error(ti):
    @ti.kernel
    def last() -> ti.f32:
        v = ti.Vector([1.0, 2.0])
        return v[-1]

    with pytest.raises(_compile_error(ti), match="[Nn]egative"):
        last()


def test_runtime_index_out_of_a_local_vector_raises_in_debug_mode(ti):
    ti.init(arch=ti.cpu, debug=True)

    @ti.kernel
    def write(i: ti.i32) -> ti.f32:
        v = ti.Vector([1.0, 2.0])
        v[i] = 5.0
        return v[0] + 10 * v[1]

    @ti.kernel
    def read(i: ti.i32) -> ti.f32:
        v = ti.Vector([1.0, 2.0, 3.0])
        return v[i]

    @ti.kernel
    def matrix(i: ti.i32, j: ti.i32) -> ti.f32:
        m = ti.Matrix([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        return m[i, j]

    assert write(0) == 25.0 and write(1) == 51.0
    assert [read(i) for i in range(3)] == [1.0, 2.0, 3.0]
    assert matrix(1, 2) == 6.0
    for call in (lambda: write(2), lambda: write(-1), lambda: read(3), lambda: read(-1),
                 lambda: matrix(2, 0), lambda: matrix(-1, 1)):
        with pytest.raises(_assertion_error(ti)):
            call()


@pytest.mark.difftape_only  # Taichi checks the flattened index only: m[0, 3] reads m[1, 0]
def test_runtime_column_index_out_of_a_local_matrix_raises_in_debug_mode(ti):
    ti.init(arch=ti.cpu, debug=True)

    @ti.kernel
    def matrix(i: ti.i32, j: ti.i32) -> ti.f32:
        m = ti.Matrix([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        m[i, j] = 10.0
        return m[0, 0] + m[1, 0]

    assert matrix(1, 0) == 11.0
    with pytest.raises(ti.KernelAssertionError, match="column"):
        matrix(0, 3)


# ------------------------------------------------------------------ float literals


def test_float_literal_is_a_default_fp_value_next_to_an_f64(ti):
    """With ``default_fp=ti.f32`` a float literal is an f32 (Taichi's rule) also where it meets
    an f64 and is promoted: ``x64 * 0.1`` multiplies by f32(0.1). difftape kept the literal's
    unrounded Python value in the f32 constant, so promoting it gave 0.1 exactly, and
    ``x64 % 1.7`` of a large ``x64`` was far off Taichi's. (The ``ti`` fixture: f32 default.)"""
    x = ti.field(ti.f64, shape=())
    out = ti.field(ti.f64, shape=4)
    x[None] = 1374389514243.75

    @ti.kernel
    def k():
        out[0] = x[None] * 0.1
        out[1] = x[None] % 1.7
        a = 0.1  # an f32 local: the same value as the literal
        out[2] = ti.cast(a, ti.f64)
        out[3] = (x[None] * 0.0 + 1.0) - 0.3

    k()
    f32 = lambda v: np.float64(np.float32(v))  # noqa: E731
    xv = np.float64(1374389514243.75)
    mod = xv - f32(1.7) * np.floor(xv / f32(1.7))  # Taichi's float %, not an exact fmod
    want = [xv * f32(0.1), mod, f32(0.1), 1.0 - f32(0.3)]
    np.testing.assert_array_equal(out.to_numpy(), want)


def test_float_literal_given_an_f64_destination_is_still_a_default_fp_value(ti):
    """Stored into an f64 field, assigned to an f64 local, cast (``ti.cast(0.1, ti.f64)``) or
    a module-level Python float (``ti.math.pi``), a float literal is the default_fp (here f32)
    value, as in Taichi; only a typed literal, ``ti.f64(0.1)``, keeps the f64 value. difftape
    gave the literal the destination's type directly, so ``o[0] = 0.1`` differed from
    ``o[0] = x * 0.1`` with ``x == 1``."""
    out = ti.field(ti.f64, shape=6)

    @ti.kernel
    def k():
        out[0] = ti.cast(0.1, ti.f64)
        out[1] = ti.f64(0.1)
        a: ti.f64 = 0.1
        out[2] = a
        out[3] = 0.1
        b = ti.cast(0.0, ti.f64)
        b = 0.1
        out[4] = b
        out[5] = ti.math.pi

    k()
    f32 = lambda v: float(np.float32(v))  # noqa: E731
    np.testing.assert_array_equal(out.to_numpy(), [f32(0.1), 0.1, f32(0.1), f32(0.1), f32(0.1),
                                                   f32(np.pi)])
