"""The program the PyTorch/JAX interop tests wrap, written once: local, remote, on the
simulated device and on a GPU they all differentiate the same two kernels.

y[i] = sin(x[i]) w[i]^2 + x[(i+1) % n] w[i];  s = sum(y^2)  (fields, f64). The shifted read
makes each output depend on two inputs, so a transposed or dropped adjoint shows.
"""


def sin_roll_program(ti, n: int):
    """``(program, inputs, outputs)``: a function launching the kernels, its input fields
    ``[x, w]`` and output fields ``[y, s]`` (all with gradients), under the current
    ``ti.init``."""
    x = ti.field(ti.f64, n, needs_grad=True)
    w = ti.field(ti.f64, n, needs_grad=True)
    y = ti.field(ti.f64, n, needs_grad=True)
    s = ti.field(ti.f64, (), needs_grad=True)

    @ti.kernel
    def compute():
        for i in x:
            y[i] = ti.sin(x[i]) * w[i] * w[i] + x[(i + 1) % n] * w[i]

    @ti.kernel
    def total():
        for i in y:
            s[None] += y[i] * y[i]

    def program():
        compute()
        total()

    return program, [x, w], [y, s]
