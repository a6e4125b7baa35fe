"""Readable reprs (a notebook shows them): what a field, kernel or func is, without values."""

import pytest

pytestmark = pytest.mark.difftape_only  # the wording is difftape's (Taichi: `<ti.field>`)


def test_field_reprs_name_kind_dtype_shape_and_flags(ti):
    x = ti.field(ti.f32, shape=(4, 5), needs_grad=True)
    v = ti.Vector.field(3, ti.f64, shape=7, offset=(-2,))
    m = ti.Matrix.field(2, 2, ti.i32, shape=3)
    s = ti.Struct.field({"a": ti.f32, "b": ti.math.vec2, "c": ti.types.struct(d=ti.i32)},
                        shape=3)
    label = x._label()
    assert repr(x) == f"<ti.field {label}: f32, shape (4, 5), needs_grad>"
    assert repr(x.grad) == f"<ti.field {label}.grad: f32, shape (4, 5)>"
    assert repr(v) == f"<ti.Vector.field(3) {v._label()}: f64, shape (7,), offset (-2,)>"
    assert repr(m) == f"<ti.Matrix.field(2, 2) {m._label()}: i32, shape (3,)>"
    assert repr(s) == "<ti.Struct.field: {a: f32, b: f32[2], c: {d: i32}}, shape (3,)>"
    sparse = ti.field(ti.f32)
    ti.root.pointer(ti.i, 4).place(sparse)
    assert repr(sparse).endswith(": f32, shape (4,), sparse>")


def test_kernel_and_func_reprs_show_their_signature(ti):
    @ti.kernel
    def k(a: ti.f32, t: ti.template(), arr: ti.types.ndarray(dtype=ti.f32, ndim=1)) -> ti.f32:
        return a

    @ti.func
    def f(a, b: ti.math.vec3):
        return a

    nd = "ndarray(dtype=f32, ndim=1, needs_grad=None, boundary='unsafe')"
    assert repr(k) == f"<ti.kernel k(a: f32, t: template(), arr: {nd}) -> f32>"
    assert repr(k.grad) == ("<ti.kernel k.grad: the adjoint of "
                            f"k(a: f32, t: template(), arr: {nd}) -> f32>")
    assert repr(f) == "<ti.func f(a, b: vector(3, float))>"

    @ti.data_oriented
    class Sim:
        @ti.kernel
        def step(self, dt: ti.f32):
            pass

    assert repr(Sim().step) == "<ti.kernel step(self, dt: f32) bound to a Sim>"
