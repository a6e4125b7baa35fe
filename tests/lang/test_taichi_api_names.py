"""Small parts of Taichi's Python API that programs and Taichi's own tests use: type names,
field and SNode names, an ndarray's element type, the error of a mis-indexed ndarray."""

import pytest


def test_dtype_to_string(ti):
    for ty in [ti.u8, ti.u16, ti.u32, ti.u64, ti.i8, ti.i16, ti.i32, ti.f32, ti.f64]:
        assert ty.to_string() == str(ty)
    assert ti.f32.to_string() == "f32"


def test_field_and_place_snode_names(ti):
    a = ti.field(dtype=ti.f32, shape=(2, 3), name="a")
    b = ti.field(ti.math.vec3, shape=(2, 3), name="b")
    assert (a._name, b._name, b.snode._name) == ("a", "b", "b")


def test_ndarray_element_type(ti):
    b = ti.ndarray(ti.types.vector(3, ti.i32), shape=(4, 4))
    assert b.element_type.element_type() == ti.i32
    assert b.element_type.shape() == [3]
    c = ti.ndarray(ti.types.matrix(3, 4, ti.f32), shape=(2,))
    assert (c.element_type.element_type(), c.element_type.shape()) == (ti.f32, [3, 4])


def test_ndarray_indexed_with_the_wrong_number_of_indices(ti):
    x = ti.ndarray(dtype=ti.f32, shape=(4, 4))
    # (difftape's ti.TaichiIndexError is an IndexError, as Taichi's taichi.lang.exception one)
    with pytest.raises(getattr(ti, "TaichiIndexError", IndexError),
                       match=r"2d ndarray indexed with 1d indices"):
        x[0]
    with pytest.raises(IndexError, match=r"2d ndarray indexed with 3d indices"):
        x[0, 0, 0]
