# ruff: noqa: UP031 - printf-style (%) assert messages in kernels are what is tested
"""Assert messages with run-time values (``debug=True``), formatted as Taichi formats them.

``assert cond, "x[%d] = %d" % (i, x[i])`` and ``assert cond, f"x[{i}] = {x[i]}"``: when the
assertion fails, the message shows the values of the first failing thread: integers in
decimal, floats in the shortest form that reads back to the same value of their type
(Taichi's ``%f``: ``0.5``, ``1``, ``1e+20``). Expected texts are made here with NumPy and
Python from the values the kernel saw.
"""

import re

import numpy as np
import pytest


def _shortest(v: float, np_type=np.float32) -> str:
    """Taichi's text of a float (fmt's ``{}``): the shortest digits that read back to the
    same value of its type, fixed notation between 1e-4 and 1e16, no trailing ``.0``."""
    text = repr(float(np.format_float_scientific(np_type(v), unique=True)))
    return text[:-2] if text.endswith(".0") else text


def _message(info) -> str:
    """The failed assertion's message (Taichi starts it with a newline)."""
    return str(info.value).strip()


def test_percent_formatted_message_shows_the_failing_values(ti):
    """Taichi's test_assert.py::test_assert_message_formatted."""
    ti.init(arch=ti.cpu, debug=True)
    x = ti.field(dtype=int, shape=16)
    x[10] = 42

    @ti.kernel
    def assert_formatted():
        for i in x:
            assert x[i] == 0, "x[%d] expect=%d got=%d" % (i, 0, x[i])

    @ti.kernel
    def assert_float():
        y = 0.5
        assert y < 0, "y = %f" % y

    with pytest.raises(AssertionError) as info:
        assert_formatted()
    assert _message(info).startswith("x[10] expect=0 got=42")
    with pytest.raises(AssertionError) as info:
        assert_float()
    assert _message(info).startswith("y = 0.5")
    x[10] = 0
    assert_formatted()  # the success case


def test_fstring_message_shows_the_failing_values(ti):
    """Taichi's test_assert.py::test_assert_message_formatted_fstring."""
    ti.init(arch=ti.cpu, debug=True)
    x = ti.field(dtype=int, shape=16)
    x[10] = 42

    @ti.kernel
    def assert_formatted():
        for i in x:
            assert x[i] == 0, f"x[{i}] expect={0} got={x[i]}"

    @ti.kernel
    def assert_float():
        y = 0.5
        assert y < 0, f"y = {y}"

    with pytest.raises(AssertionError) as info:
        assert_formatted()
    assert _message(info).startswith("x[10] expect=0 got=42")
    with pytest.raises(AssertionError) as info:
        assert_float()
    assert _message(info).startswith("y = 0.5")
    x[10] = 0
    assert_formatted()


@pytest.mark.parametrize("v", [0.1, 1.0, 100000.0, 1e20, 123456789.0, 1.5e-7, -2.5, 1e-4,
                               1e15, 1e16, 3.4e38, float("inf")])
def test_floats_are_shown_shortest_as_taichi_does(ti, v):
    ti.init(arch=ti.cpu, debug=True)

    @ti.kernel
    def check(a: ti.f32):
        assert a != a, "a=%f" % a

    with pytest.raises(AssertionError) as info:
        check(v)
    assert _message(info).splitlines()[0] == f"a={_shortest(v)}"


def test_one_value_not_in_a_tuple_and_padding_stripped(ti):
    """``"..." % v`` and ``"..." % (v,)``; the message is stripped, as Taichi's is."""
    ti.init(arch=ti.cpu, debug=True)

    @ti.kernel
    def one(v: ti.i32):
        assert v < 0, "  v=%d  " % v

    @ti.kernel
    def one_tuple(v: ti.i32):
        assert v < 0, "v=%d w=%d" % (v, v + 1)

    with pytest.raises(AssertionError) as info:
        one(7)
    assert _message(info).splitlines()[0] == "v=7"
    with pytest.raises(AssertionError) as info:
        one_tuple(7)
    assert _message(info).splitlines()[0] == "v=7 w=8"


@pytest.mark.difftape_only  # Taichi reads every value as a 32-bit int or float
@pytest.mark.parametrize("dtype, value", [("i8", -100), ("u8", 200), ("i16", -30000),
                                          ("u32", 4_000_000_000), ("i64", -(2 ** 40) - 3),
                                          ("u64", 2 ** 64 - 5)])
def test_integers_of_every_width(ti, dtype, value):
    ti.init(arch=ti.cpu, debug=True)
    t = getattr(ti, dtype)

    @ti.kernel
    def check(a: t):
        assert a == 0, "a=%d" % a

    with pytest.raises(ti.KernelAssertionError) as info:
        check(value)
    assert _message(info).splitlines()[0] == f"a={value}"


@pytest.mark.difftape_only  # Taichi reads an f64 as the low half of its bits
@pytest.mark.parametrize("v", [0.1, 1.0 / 3.0, 1234.5678, -1e-300])
def test_f64_and_f16_values(ti, v):
    ti.init(arch=ti.cpu, debug=True)

    @ti.kernel
    def check(a: ti.f64):
        assert a == 0, f"a={a} h={ti.cast(a, ti.f16)}"

    with pytest.raises(ti.KernelAssertionError) as info:
        check(v)
    assert _message(info).splitlines()[0] == \
        f"a={_shortest(v, np.float64)} h={_shortest(v, np.float16)}"


@pytest.mark.difftape_only  # Taichi ignores an f-string's spec and refuses %.2f, %x, vectors
def test_specs_literal_percent_and_vectors(ti):
    """A spec is applied as Python applies it (``%.2f``, ``%5d``, ``%x``, ``{:.3f}``,
    ``{:>6}``); a ``%`` in an f-string's text or a message without ``%`` arguments is text;
    a vector shows its entries bracketed, as print() shows it."""
    ti.init(arch=ti.cpu, debug=True)

    @ti.kernel
    def check(a: ti.f32, n: ti.i32):
        v = ti.Vector([a, 2 * a])
        assert n < 0, "%.2f|%5d|%-4d|%x|%+.1e|%%|%s" % (a, n, n, n, a, n)
        assert a < 0, f"{a:.3f}|{n:>6}|{n:04d}|100% {n}|{v}"
        assert a < 0, "100%d"

    with pytest.raises(ti.KernelAssertionError) as info:
        check(0.25, 255)
    assert _message(info).splitlines()[0] == \
        "%.2f|%5d|%-4d|%x|%+.1e|%%|%s" % (0.25, 255, 255, 255, 0.25, 255)
    with pytest.raises(ti.KernelAssertionError) as info:
        check(0.25, -1)
    assert _message(info).splitlines()[0] == "0.250|    -1|-001|100% -1|[0.25, 0.5]"


@pytest.mark.difftape_only  # difftape's messages name the kernel and the line
def test_the_first_failing_thread_reports_all_its_values(ti):
    """Many threads fail at once: the values shown are those of one of them (never one
    thread's index with another's value)."""
    ti.init(arch=ti.cpu, debug=True)
    n = 100_000
    x = ti.field(ti.i32, shape=n)
    y = ti.field(ti.f32, shape=n)
    x.from_numpy(np.arange(n, dtype=np.int32) * 3)
    y.from_numpy(np.arange(n, dtype=np.float32) * 0.5)

    @ti.kernel
    def check():
        for i in x:
            assert x[i] < 0, f"i={i} x={x[i]} y={y[i]}"  # marker: formatted assert

    for _ in range(5):
        with pytest.raises(ti.KernelAssertionError) as info:
            check()
        first = _message(info).splitlines()[0]
        m = re.fullmatch(r"i=(\d+) x=(-?\d+) y=(\S+)", first)
        assert m, first
        i = int(m.group(1))
        assert int(m.group(2)) == 3 * i and m.group(3) == _shortest(0.5 * i)
        assert "check" in str(info.value) and "marker: formatted assert" in str(info.value)


@pytest.mark.difftape_only  # difftape's compile errors
def test_unformattable_messages_are_refused_at_compile_time(ti):
    ti.init(arch=ti.cpu, debug=True)

    @ti.kernel
    def too_few(a: ti.i32):
        assert a < 0, "%d %d" % (a,)  # noqa: F507 - the refusal is tested

    @ti.kernel
    def int_spec_of_float(a: ti.f32):
        assert a < 0, "%d" % a

    fmt33 = " ".join(["%d"] * 33)

    @ti.kernel
    def too_many(a: ti.i32):
        assert a < 0, fmt33 % (a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a,
                               a, a, a, a, a, a, a, a, a, a, a, a, a)

    @ti.kernel
    def mapping_key(a: ti.i32):
        assert a < 0, "%(a)d" % {"a": a}

    @ti.kernel
    def huge_width(a: ti.i32):
        assert a < 0, "%200d" % a

    @ti.kernel
    def none_arg(a: ti.i32):
        assert a < 0, "%d %d" % (a, None)

    for k, words in ((too_few, "not enough arguments"), (int_spec_of_float, "f32"),
                     (too_many, "at most 32"), (mapping_key, "%(name)"),
                     (huge_width, "at most 2 digits"), (none_arg, "not NoneType")):
        with pytest.raises(ti.CompileError, match=re.escape(words)):
            k(1)


@pytest.mark.difftape_only
def test_without_debug_the_message_is_not_checked_at_run_time(ti):
    """Asserts are compiled under debug=True only (as in Taichi); the message's values cost
    nothing otherwise."""
    ti.init(arch=ti.cpu, debug=False)
    x = ti.field(ti.i32, shape=4)

    @ti.kernel
    def check():
        for i in x:
            assert x[i] > 0, f"x[{i}] = {x[i]}"
            x[i] += 1

    check()
    assert x.to_numpy().tolist() == [1, 1, 1, 1]

