"""Structs: ti.types.struct, ti.Struct, struct fields, @ti.dataclass, struct locals, struct
arguments and returns of funcs and kernels, and gradients through struct fields."""

import numpy as np
import pytest


def test_struct_field_members_and_numpy(ti, fp, rtol):
    vec3 = ti.types.vector(3, float)
    x = ti.Struct.field({"a": float, "v": vec3, "k": ti.i32}, shape=5)
    assert x.keys == ["a", "v", "k"] and x.shape == (5,)

    @ti.kernel
    def run():
        for i in x:
            x[i].a = i * 0.5
            x.k[i] = i * i                 # the same element, through the member field
            x[i].v = ti.Vector([1.0, 2.0, 3.0]) * x[i].a + x[i].k

    run()
    a = np.arange(5) * 0.5
    k = np.arange(5) ** 2
    got = x.to_numpy()
    assert set(got) == {"a", "v", "k"}
    np.testing.assert_allclose(got["a"], a, rtol=rtol)
    np.testing.assert_array_equal(got["k"], k)
    np.testing.assert_allclose(got["v"], np.outer(a, [1, 2, 3]) + k[:, None], rtol=rtol)
    # Python scope: elements read and write through to the member fields.
    assert x[3].k == 9 and x.a[3] == pytest.approx(1.5)
    x[2].a = 7.0
    x[4] = ti.Struct(a=1.0, v=[4.0, 5.0, 6.0], k=3)
    assert x.a[2] == 7.0 and x.k[4] == 3
    np.testing.assert_allclose(x.v.to_numpy()[4], [4, 5, 6])
    x.from_numpy({"a": np.ones(5), "v": np.zeros((5, 3)), "k": np.full(5, 2)})
    np.testing.assert_array_equal(x.k.to_numpy(), [2] * 5)
    x.fill(3)
    np.testing.assert_allclose(x.v.to_numpy(), np.full((5, 3), 3.0))
    np.testing.assert_array_equal(x.k.to_numpy(), [3] * 5)


def test_nested_struct_types_and_implicit_casts(ti, fp, rtol):
    vec3 = ti.types.vector(3, float)
    line = ti.types.struct(dir=vec3, length=float)
    item = ti.types.struct(line=line, idx=ti.i32)
    x = item.field(shape=4)

    @ti.kernel
    def run():
        for i in x:
            seg = line(dir=vec3(1.0, 2.0, 2.0), length=i + 0.75)  # keyword members
            x[i] = item(seg, i * 2.7)                             # positional, cast to i32

    run()
    d = x.to_numpy()
    np.testing.assert_array_equal(d["idx"], [int(i * 2.7) for i in range(4)])
    np.testing.assert_allclose(d["line"]["length"], np.arange(4) + 0.75, rtol=rtol)
    np.testing.assert_allclose(d["line"]["dir"], np.tile([1, 2, 2], (4, 1)), rtol=rtol)
    assert x[3].line.length == pytest.approx(3.75)
    # Python scope: members cast like in kernels; missing members are zero.
    s = item(idx=2.9)
    assert s.idx == 2 and s.line.length == 0.0
    np.testing.assert_allclose(s.line.dir.to_numpy(), [0, 0, 0])


def test_struct_locals_copy_and_member_assignment(ti):
    pair = ti.types.struct(a=ti.i32, b=ti.i32)
    f = pair.field(shape=())
    out = ti.field(ti.i32, shape=6)

    @ti.kernel
    def run():
        f[None] = pair(2, 3)
        s = f[None]          # a copy: changing it leaves the field alone
        s.a = 10
        t = s
        t.b += 5
        out[0], out[1] = s.a, s.b
        out[2], out[3] = t.a, t.b
        out[4], out[5] = f[None].a, f[None].b

    run()
    np.testing.assert_array_equal(out.to_numpy(), [10, 3, 10, 8, 2, 3])


def test_dataclass_methods_and_func_struct_arguments(ti, fp, rtol):
    vec2 = ti.types.vector(2, float)

    @ti.dataclass
    class Particle:
        pos: vec2
        mass: float

        @ti.func
        def momentum_norm(self, vel: vec2):
            return (vel * self.mass).norm()

        @ti.func
        def push(self, dx: vec2):  # a method's `self` is the struct itself: writes stay
            self.pos += dx

    @ti.func
    def heavier(p, dm):  # a plain func gets a copy
        p.mass += dm
        return p.mass

    ps = Particle.field(shape=3)
    out = ti.field(float, shape=(3, 2))

    @ti.kernel
    def run():
        for i in ps:
            ps[i] = Particle(pos=vec2(i, 0.0), mass=i + 1.0)
            ps[i].push(vec2(0.5, 1.0))
            out[i, 0] = ps[i].momentum_norm(vec2(3.0, 4.0))
            out[i, 1] = heavier(ps[i], 10.0)

    run()
    m = np.arange(3) + 1.0
    np.testing.assert_allclose(out.to_numpy(), np.stack([5 * m, m + 10], axis=1), rtol=rtol)
    np.testing.assert_allclose(ps.mass.to_numpy(), m, rtol=rtol)  # the copy changed, not ps
    np.testing.assert_allclose(ps.pos.to_numpy(), np.stack([np.arange(3) + 0.5, np.ones(3)], 1),
                               rtol=rtol)


def test_struct_annotated_func_and_kernel_arguments_and_returns(ti, fp, rtol):
    vec2 = ti.types.vector(2, float)
    box = ti.types.struct(lo=vec2, hi=vec2, tag=ti.i32)

    @ti.func
    def grow(b: box, d: float) -> box:
        return box(b.lo - d, b.hi + d, b.tag + 1)

    @ti.kernel
    def area(b: box, d: float) -> float:
        g = grow(b, d)
        e = g.hi - g.lo
        return e.x * e.y * g.tag

    @ti.kernel
    def grown(b: box, d: float) -> box:
        return grow(b, d)

    b = box(lo=[0.0, 1.0], hi=[2.0, 4.0], tag=1)
    assert area(b, 0.5) == pytest.approx(3.0 * 4.0 * 2, rel=rtol)
    g = grown(b, 0.25)
    np.testing.assert_allclose(g.lo.to_numpy(), [-0.25, 0.75], rtol=rtol)
    np.testing.assert_allclose(g.hi.to_numpy(), [2.25, 4.25], rtol=rtol)
    assert g.tag == 2


def test_struct_fields_placed_by_root_and_looped(ti):
    s = ti.Struct.field({"a": ti.i32, "b": ti.types.vector(2, ti.i32)})
    ti.root.dense(ti.ij, (3, 2)).place(s)
    assert s.shape == (3, 2)

    @ti.kernel
    def run():
        for i, j in s:
            s[i, j].a = i * 10 + j
            s[i, j].b = ti.Vector([i, j])

    run()
    i, j = np.meshgrid(np.arange(3), np.arange(2), indexing="ij")
    np.testing.assert_array_equal(s.a.to_numpy(), i * 10 + j)
    np.testing.assert_array_equal(s.b.to_numpy(), np.stack([i, j], -1))


def test_gradients_through_struct_fields(ti, fp):
    """L = sum_i |v_i|^2 + a_i^3 with v_i = (1, 2, 3) * a_i: dL/da_i = 28 a_i + 3 a_i^2."""
    y = ti.Struct.field({"a": float, "v": ti.types.vector(3, float)}, shape=4, needs_grad=True)
    loss = ti.field(float, shape=(), needs_grad=True)
    a = np.array([0.5, -1.0, 2.0, 0.25])
    y.a.from_numpy(a)

    @ti.kernel
    def compute():
        for i in y:
            y[i].v = ti.Vector([1.0, 2.0, 3.0]) * y[i].a
        for i in y:
            loss[None] += y[i].v.norm_sqr() + y[i].a ** 3

    with ti.ad.Tape(loss):
        compute()
    rtol = 1e-5 if fp == ti.f32 else 1e-12
    np.testing.assert_allclose(loss[None], np.sum(14 * a**2 + a**3), rtol=rtol)
    np.testing.assert_allclose(y.grad.a.to_numpy(), 28 * a + 3 * a**2, rtol=rtol)
    np.testing.assert_allclose(y.grad.to_numpy()["a"], 28 * a + 3 * a**2, rtol=rtol)


def test_dataclass_refuses_default_values(ti):
    with pytest.raises(ti.TaichiSyntaxError, match="Default value"):
        @ti.dataclass
        class Foo:
            a: int
            b: float = 3.14


def test_struct_members_named_like_struct_attributes(ti):
    @ti.dataclass
    class Foo:
        keys: int
        items: int
        entries: int

    @ti.kernel
    def total() -> int:
        x = Foo(1, 20, 300)
        return x.keys + x.items + x.entries

    assert total() == 321


@pytest.mark.difftape_only
def test_struct_assignment_with_other_members_is_refused(ti):
    a = ti.types.struct(x=ti.i32, y=ti.i32)
    f = a.field(shape=())

    @ti.kernel
    def run():
        f[None] = ti.Struct(x=1, z=2)

    with pytest.raises(ti.CompileError, match="members"):
        run()


@pytest.mark.parametrize("center", [2, 4])
def test_struct_argument_with_a_member_of_the_wrong_shape_is_refused(ti, center):
    """A 2-vector (failed inside the launch with an IndexError) or a 4-vector (its last entry
    silently dropped) where the parameter's struct has a 3-vector: refused as an argument
    type error; the right struct still works."""
    sphere = ti.types.struct(center=ti.math.vec3, radius=float)
    other = ti.types.struct(center=ti.types.vector(center, ti.f32), radius=float)

    @ti.kernel
    def foo(s: sphere) -> float:
        return s.center[0] + s.center[1] * 10 + s.center[2] * 100 + s.radius

    assert foo(sphere(center=ti.math.vec3([1, 2, 3]), radius=0.5)) == pytest.approx(321.5)
    with pytest.raises(ti.TaichiRuntimeTypeError):
        foo(other(center=ti.Vector(list(range(1, center + 1)), ti.f32), radius=0.5))


def test_argpack_of_scalars_vectors_and_structs(ti):
    s2 = ti.types.struct(a=ti.i32, c=ti.f32)
    inner = ti.types.argpack(p=ti.i32, q=ti.f32)
    pack_t = ti.types.argpack(a=ti.i32, flag=bool, v=ti.types.vector(3, ti.f32), s=s2, n=inner)

    @ti.kernel
    def combine(pack: pack_t, scale: ti.f32) -> ti.f32:
        out = 0.0
        if pack.flag:
            out = pack.a + pack.v[1] * scale + pack.s.c + pack.n.q
        else:
            out = pack.a * pack.v[2] - pack.s.a * pack.n.p
        return out

    p1 = pack_t(a=3, flag=True, v=[1.0, 2.0, 4.0], s=s2(a=5, c=0.25), n=inner(p=7, q=0.5))
    p2 = pack_t(a=3, flag=False, v=[1.0, 2.0, 4.0], s=s2(a=5, c=0.25), n=inner(p=7, q=0.5))
    assert combine(p1, 10.0) == pytest.approx(3 + 2.0 * 10 + 0.25 + 0.5)
    assert combine(p2, 10.0) == pytest.approx(3 * 4.0 - 5 * 7)


def test_argpack_with_ndarrays(ti):
    arr = ti.ndarray(dtype=ti.math.vec3, shape=(4, 4))
    vals = np.arange(48, dtype=np.float32).reshape(4, 4, 3)
    arr.from_numpy(vals)
    out = ti.ndarray(ti.f32, shape=4)
    pack_t = ti.types.argpack(src=ti.types.ndarray(dtype=ti.math.vec3, ndim=2), k=ti.i32)
    outer_t = ti.types.argpack(inner=pack_t, dst=ti.types.ndarray(ti.f32, ndim=1))

    @ti.kernel
    def column(p: outer_t):
        for i in range(4):
            p.dst[i] = p.inner.src[i, p.inner.k][1]

    column(outer_t(inner=pack_t(src=arr, k=2), dst=out))
    np.testing.assert_array_equal(out.to_numpy(), vals[:, 2, 1])


def test_argpack_is_no_struct_member_nor_kernel_return(ti):
    pack_t = ti.types.argpack(a=ti.i32, b=bool)
    with pytest.raises(ValueError, match="Invalid data type <ti.ArgPackType a=i32, b=u1>"):
        ti.types.struct(element=pack_t)

    @ti.kernel
    def back(pack: pack_t) -> pack_t:
        return pack

    with pytest.raises(ti.TaichiCompilationError):
        back(pack_t(a=1, b=True))


@pytest.mark.difftape_only
def test_argpack_argument_must_be_a_pack_of_its_type(ti):
    pack_t = ti.types.argpack(a=ti.i32, b=ti.f32)
    other_t = ti.types.argpack(x=ti.i32, y=ti.f32)

    @ti.kernel
    def total(pack: pack_t) -> ti.f32:
        return pack.a + pack.b

    with pytest.raises(ti.ArgumentError, match="must be a"):
        total(other_t(x=1, y=2.0))
    with pytest.raises(ti.ArgumentError, match="must be a"):
        total(1)
    with pytest.raises(ti.ArgumentError, match="no value for member"):
        pack_t(a=1)
    assert total(pack_t(a=1, b=2.5)) == 3.5


def test_kernel_returns_a_struct_of_its_annotated_type(ti):
    """As Taichi: a kernel annotated `-> sphere` returns a sphere, not a struct of another
    type converted member by member (other shapes, or an int radius for a float one)."""
    sphere = ti.types.struct(center=ti.math.vec3, radius=float)
    circle = ti.types.struct(center=ti.math.vec2, radius=float)
    int_sphere = ti.types.struct(center=ti.math.vec3, radius=int)

    @ti.kernel
    def from_circle() -> sphere:
        return circle(center=ti.math.vec2([1, 2]), radius=2)

    @ti.kernel
    def from_int_sphere() -> sphere:
        return int_sphere(center=ti.math.vec3([1, 2, 3]), radius=2)

    @ti.kernel
    def fine() -> sphere:
        s = sphere(center=ti.math.vec3([1, 2, 3]), radius=2.5)
        s.radius *= 2
        return s

    for k in (from_circle, from_int_sphere):
        with pytest.raises(ti.TaichiCompilationError):
            k()
    got = fine()
    np.testing.assert_array_equal(got.center.to_numpy(), [1, 2, 3])
    assert got.radius == 5.0


def test_real_func_returns_an_element_of_a_struct_field(ti):
    # Taichi's real_func cornell_box.py: raycast(...) -> (SDFObject, vec3, bool) returns
    # objects[index], an element of an SDFObject struct field: a struct of that type.
    P = ti.types.struct(a=ti.f32, v=ti.math.vec2)
    ps = P.field(shape=3)
    ps[1] = P(a=2.5, v=ti.math.vec2(1, 2))

    @ti.real_func
    def pick(i: ti.i32) -> P:
        return ps[i]

    @ti.kernel
    def run() -> ti.f32:
        p = pick(1)
        return p.a + p.v.y

    assert run() == 4.5


def test_a_pyfunc_method_runs_in_python_scope_and_in_kernels(ti):
    # GeoTaichi's BaseStruct.py: @ti.pyfunc methods of a @ti.dataclass, called on a struct
    # field's element in Python scope (`scene.wall[i].add_materialID(m)`), write the field
    # through the element's members; ti.pyfunc was ti.func there, which refused the call
    @ti.dataclass
    class Wall:
        materialID: ti.i32
        norm: ti.types.vector(3, ti.f32)

        @ti.pyfunc
        def add_materialID(self, matID):
            self.materialID = matID

        @ti.pyfunc
        def scaled(self, k):
            return self.norm * k

    walls = Wall.field(shape=3)
    walls[1].add_materialID(7)
    walls[2].norm = [1.0, 2.0, 3.0]

    @ti.kernel
    def run() -> ti.f32:
        walls[0].add_materialID(walls[1].materialID + 1)
        return walls[2].scaled(2.0).sum()

    assert run() == 12.0
    np.testing.assert_array_equal(walls.materialID.to_numpy(), [8, 7, 0])
    np.testing.assert_array_equal(walls[2].scaled(3.0), [3.0, 6.0, 9.0])
