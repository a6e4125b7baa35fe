"""Integer overflow reports under ``ti.init(debug=True)``, as Taichi makes them.

With ``debug=True`` an integer ``+``, ``-``, ``*`` or ``<<`` whose exact result does not fit its
type prints "<Operation> overflow detected" and the source line (Taichi prints through the
kernel's printf, so the tests read file descriptor 1 with ``capfd``); the value is still the
wrapped-around one (two's complement, as without ``debug``). Without ``debug`` nothing is
printed.
"""

import numpy as np
import pytest

TYPES = ("i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64")
WORD = {"add": "Addition", "sub": "Subtraction", "mul": "Multiplication", "shl": "Shift left"}


def _limits(name):
    info = np.iinfo(np.dtype(name.replace("u", "uint") if name[0] == "u" else
                             name.replace("i", "int")))
    return int(info.min), int(info.max), info.bits


def _cases(name):
    """(op, a, b, overflows) for type ``name``: each op just past and just within the range."""
    lo, hi, bits = _limits(name)
    signed = lo < 0
    out = [("add", hi, 1, True), ("add", hi - 1, 1, False),
           ("sub", lo, 1, True), ("sub", lo + 1, 1, False),
           ("mul", hi // 2 + 1, 2, True), ("mul", hi // 2, 2, False),
           ("shl", 1 if signed else 2, bits - 1, True), ("shl", 1, bits - 2, False)]
    if signed:
        out += [("add", lo, -1, True), ("mul", lo, -1, True), ("mul", lo + 1, -1, False)]
    return out


def _exact(op, a, b):
    return a + b if op == "add" else a - b if op == "sub" else a * b if op == "mul" else a << b


def _wrapped(name, v):
    lo, hi, bits = _limits(name)
    v &= (1 << bits) - 1
    return v - (1 << bits) if lo < 0 and v > hi else v


def _kernels(ti, ty):
    @ti.kernel
    def add(a: ty, b: ty) -> ty:
        return a + b

    @ti.kernel
    def sub(a: ty, b: ty) -> ty:
        return a - b

    @ti.kernel
    def mul(a: ty, b: ty) -> ty:
        return a * b

    @ti.kernel
    def shl(a: ty, b: ty) -> ty:
        return a << b

    return {"add": add, "sub": sub, "mul": mul, "shl": shl}


LINES = {"add": "return a + b", "sub": "return a - b", "mul": "return a * b",
         "shl": "return a << b"}


@pytest.mark.parametrize("name", TYPES)
def test_overflow_is_reported_under_debug_and_the_value_wraps(backend, capfd, name):
    ti = backend
    ti.init(arch=ti.cpu, debug=True)
    try:
        ty = getattr(ti, name)
        kernels = _kernels(ti, ty)
        for op, a, b, overflows in _cases(name):
            capfd.readouterr()
            got = kernels[op](a, b)
            ti.sync()
            out = capfd.readouterr().out
            exact = _exact(op, a, b)
            assert (exact != _wrapped(name, exact)) == overflows  # the case is what it says
            assert got == _wrapped(name, exact), (op, a, b)
            message = f"{WORD[op]} overflow detected"
            assert (message in out) == overflows, (op, a, b, out)
            assert (LINES[op] in out) == overflows, (op, a, b, out)
    finally:
        ti.reset()


def test_no_report_without_debug(backend, capfd):
    ti = backend
    ti.init(arch=ti.cpu)
    try:
        @ti.kernel
        def add(a: ti.i32, b: ti.i32) -> ti.i32:
            return a + b

        capfd.readouterr()
        assert add(2**30, 2**30) == -(2**31)
        ti.sync()
        assert "overflow" not in capfd.readouterr().out
    finally:
        ti.reset()


@pytest.mark.difftape_only
def test_report_names_kernel_line_operands_and_type(backend, capfd):
    """Our report says where (kernel, file and line, the line's text) and what (the operands
    and the type they do not fit), for every overflow, also inside parallel loops and in
    augmented assignments."""
    ti = backend
    ti.init(arch=ti.cpu, debug=True)
    try:
        x = ti.field(ti.i16, shape=4)

        @ti.kernel
        def grow(k: ti.i16):
            for i in x:
                v = x[i]
                v *= k
                x[i] = v

        x.from_numpy(np.array([1, 300, -300, 2], np.int16))
        capfd.readouterr()
        grow(200)
        out = capfd.readouterr().out
        lines = [ln for ln in out.splitlines() if "overflow detected" in ln]
        assert sorted(lines) == sorted(
            f"Multiplication overflow detected in kernel 'grow' ({__file__}:{ln}): "
            f"{a} * 200 does not fit in i16" for a, ln in ((300, _line("v *= k")),
                                                           (-300, _line("v *= k"))))
        assert out.count("\n    v *= k\n") == 2
        np.testing.assert_array_equal(x.to_numpy(), (np.array([1, 300, -300, 2]) * 200)
                                      .astype(np.int16))
    finally:
        ti.reset()


@pytest.mark.difftape_only
def test_checks_follow_constant_folding(backend, capfd):
    """An overflow between constants is reported too (folding does not hide it)."""
    ti = backend
    ti.init(arch=ti.cpu, debug=True)
    try:
        @ti.kernel
        def k() -> ti.i32:
            a = ti.i32(1073741824)
            b = ti.i32(1073741824)
            return a + b

        capfd.readouterr()
        assert k() == -(2**31)
        out = capfd.readouterr().out
        assert "Addition overflow detected in kernel 'k'" in out
        assert "1073741824 + 1073741824 does not fit in i32" in out
    finally:
        ti.reset()


def _line(text: str) -> int:
    with open(__file__) as f:
        return next(n for n, ln in enumerate(f, 1) if ln.strip() == text)
