"""``str`` of a Python-scope vector or matrix (``print(x[i])``, f-strings) is NumPy's text of
its values, as in Taichi, whose programs print field elements that way."""

import numpy as np


def test_str_of_field_elements_and_vectors_is_numpys(ti):
    v = ti.Vector.field(2, ti.f32, shape=(), needs_grad=True)
    m = ti.Matrix.field(2, 3, ti.i32, shape=4)
    v[None] = [-0.5, 0.25]
    m[1] = [[1, 2, 3], [4, 5, 6]]
    assert str(v[None]) == str(np.array([-0.5, 0.25], dtype=np.float32))
    assert f"{v.grad[None]}" == str(np.zeros(2, dtype=np.float32))
    assert str(m[1]) == str(np.arange(1, 7).reshape(2, 3))
    assert str(ti.Vector([1.5, 2.0])) == str(np.array([1.5, 2.0]))
    assert str(ti.Matrix([[1, 2], [3, 4]])) == str(np.array([[1, 2], [3, 4]]))
