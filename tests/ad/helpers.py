"""Shared helpers of the reverse-mode tests: float64 finite differences with NumPy, tolerances,
and the check for programs that break Taichi's global data access rules."""

import os
import re

import numpy as np

# Fourth-order central differences: error ~ h**4 * f^(5) / 30 + eps * |f| / h, i.e. about 1e-11
# relative with h = 1e-4 for the smooth functions used here.
_STENCIL = ((-2.0, 1.0), (-1.0, -8.0), (1.0, 8.0), (2.0, -1.0))

# Finite differences are accurate to about 1e-10 relative, so f64 comparisons against them
# use this floor instead of the f64 rtol of the conftest.
FD_RTOL = 1e-9


def fd_grad(f, *args, h=1e-4):
    """Gradient of the scalar float64 function ``f(*args)`` with respect to every argument.

    Each argument is an array (or number) converted to float64; the result is a list of arrays
    with the arguments' shapes. Fourth-order central differences with step ``h`` (scaled by
    ``max(1, |x|)`` per coordinate).
    """
    arrays = [np.array(a, dtype=np.float64) for a in args]
    grads = []
    for k, a in enumerate(arrays):
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            step = h * max(1.0, abs(a[idx]))
            total = 0.0
            for offset, weight in _STENCIL:
                moved = [b.copy() for b in arrays]
                moved[k][idx] += offset * step
                total += weight * float(f(*moved))
            g[idx] = total / (12.0 * step)
        grads.append(g)
    return grads


def weights(shape, seed=0):
    """Deterministic random weights in [0.5, 1.5) with random signs, for seeding output grads."""
    rng = np.random.default_rng(seed)
    return rng.uniform(0.5, 1.5, size=shape) * rng.choice([-1.0, 1.0], size=shape)


def close(got, want, rtol, atol=None, err_msg=""):
    """assert_allclose with an absolute floor of ``rtol * max(1, max|want|)`` by default."""
    want = np.asarray(want, dtype=np.float64)
    if atol is None:
        atol = rtol * max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=rtol, atol=atol,
                               err_msg=err_msg)


def source_line_of(path, key):
    """1-based number and code (without the comment) of the only line of ``path`` that ends with
    ``# marker: <key>``."""
    with open(path, encoding="utf-8") as source:
        lines = source.read().splitlines()
    tag = f"# marker: {key}"
    hits = [n for n, text in enumerate(lines, 1) if text.rstrip().endswith(tag)]
    assert len(hits) == 1, f"{tag!r} must end exactly one line of {path}: {hits}"
    return hits[0], lines[hits[0] - 1].split("#")[0].strip()


def assert_message_quotes(message, path, keys):
    """``message`` quotes the code of one of the lines marked with ``keys`` and its number."""
    quoted = []
    for key in keys:
        line, text = source_line_of(path, key)
        quoted.append(bool(re.search(rf"\b{line}\b", message)) and text in message)
    assert any(quoted), f"none of the lines marked {keys} is quoted in: {message}"


def assert_true_gradient_or_rule_error(ti, run, check, kernel_name, path, keys):
    """A program breaking a global data access rule must not give a silently wrong gradient.

    ``run()`` runs the forward and backward passes; ``check()`` asserts the true gradient. The
    outcome must be either: ``run()`` succeeds and ``check()`` passes, or ``run()`` raises
    ``ti.GradientRuleError`` whose message names the kernel and the file, and quotes one of the
    offending lines (those of ``path`` marked ``# marker: <key>`` for a key in ``keys``) with its
    number. Returns "error" or "gradient", whichever happened.
    """
    try:
        run()
    except ti.GradientRuleError as error:
        assert issubclass(ti.GradientRuleError, ti.CompileError)
        assert issubclass(ti.GradientRuleError, ti.DifftapeError)
        message = str(error)
        assert kernel_name in message, message
        assert os.path.basename(path) in message, message
        assert_message_quotes(message, path, keys)
        return "error"
    check()
    return "gradient"


def check_loss_gradient(x, loss, run, ref, rtol, args=()):
    """Seeds ``loss.grad`` with 1, runs ``run(*args)`` and ``run.grad(*args)``, and compares
    ``loss[None]`` with ``ref(x)`` and ``x.grad`` with the float64 finite differences of ``ref``,
    both at ``x``'s values as float64, with relative tolerance ``rtol``."""
    loss.grad[None] = 1
    run(*args)
    run.grad(*args)
    xv = x.to_numpy().astype(np.float64)
    close(loss[None], ref(xv), rtol=rtol)
    close(x.grad.to_numpy(), fd_grad(ref, xv)[0], rtol=rtol)
