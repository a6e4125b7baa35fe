"""``difftape demo``: a 2-D gravity simulation (the seed guide's case study), timed against the
same computation in NumPy so a new user sees the compiler at work, and the forces obtained by
reverse-mode autodiff of the potential energy checked against the hand-written ones.

``difftape demo --remote`` starts a difftape server on a loopback port (its own data dir and
token, as ``difftape serve`` and ``difftape token create`` would make them), runs the very same
program through the client (``ti.init(arch=ti.remote, ...)``) and compares it bit for bit with
a local run compiled with bounds checks, as the server compiles every kernel."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

import difftape as ti  # the demo is a user program: it uses the public API


def main(steps: int = 200, remote: bool = False, server: str | None = None,
         token: str | None = None) -> int:
    """Run the demo locally, or with ``remote`` through a server and compare with a local run.

    ``server``/``token`` name a running server (a container, a lab machine) to check instead of
    one started on loopback for the demo: the same remote == local comparison, against it."""
    if not remote:
        _report(_simulate(steps, dict(arch=None)), steps, where="locally")
        return 0
    with _no_arch_from_environment():
        with _given_or_local_server(server, token) as (url, token):
            there = _simulate(steps, dict(arch="remote", server=url, token=token))
        here = _simulate(steps, dict(arch=None, check_out_of_bound=True))
    _report(there, steps, where=f"on the server at {url}")
    same = np.array_equal(here["x"], there["x"])
    # The gradient scatters with atomics from all threads, so its rounding depends on their
    # interleaving, here as anywhere: compare it to rounding.
    grad_diff = float(np.abs(here["grad"] - there["grad"]).max() / np.abs(here["grad"]).max())
    print(f"  local run (bounds-checked, as on the server): {here['step_ms']:.3f} ms/step; "
          f"positions {'identical bit for bit' if same else 'DIFFER'}, autodiff forces "
          f"equal to {grad_diff:.1e} (relative)")
    return 0 if same and grad_diff < 1e-5 else 1


@contextlib.contextmanager
def _no_arch_from_environment():
    """``demo --remote`` compares a run on its own server with a local one: an arch from
    the environment (DIFFTAPE_ARCH, TI_ARCH), which would send both elsewhere, is set
    aside while it runs."""
    saved = {k: os.environ.pop(k) for k in ("DIFFTAPE_ARCH", "TI_ARCH") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def _given_or_local_server(server: str | None, token: str | None):
    if server is None:
        with _local_server() as found:
            yield found
        return
    if not token:
        raise SystemExit("difftape demo --remote --server URL needs a token: --token TOKEN or "
                         "DIFFTAPE_TOKEN (make one with `difftape token create NAME` on the "
                         "server's machine)")
    yield server.rstrip("/"), token


@contextlib.contextmanager
def _local_server():
    """A difftape server on a free loopback port with a fresh data dir and one user."""
    # Function-level: the server needs the optional `server` extra (FastAPI, uvicorn, ...).
    from .server import db, settings

    with tempfile.TemporaryDirectory(prefix="difftape-demo-") as data:
        token = db.Database(settings.Settings(data_dir=data).db_path).create_user("demo")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # Quiet: uvicorn at warnings, and without the per-request JSON access log (lines a
        # demo user cannot act on, the /readyz 503s of the start among them); errors still show.
        proc = subprocess.Popen([sys.executable, "-m", "difftape.server", "--port", str(port),
                                 "--data-dir", data, "--arch", "cpu", "--log-level",
                                 "warning"], env={**os.environ, "DIFFTAPE_ACCESS_LOG": "0"})
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, proc)
            yield url, token
        finally:
            proc.terminate()
            proc.wait(30)


def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the demo server exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError("the demo server did not become ready within 2 minutes")


def first_calls(*kernels) -> float:
    """Seconds for the first call of each (argument-less) kernel, compilation included:
    ``ti.sync()`` waits for the launches, which under ``arch=ti.remote`` are queued, sent on
    the next synchronisation and compiled by the server when they arrive."""
    t0 = time.perf_counter()
    for k in kernels:
        k()
    ti.sync()
    return time.perf_counter() - t0


def _simulate(steps: int, init: dict) -> dict:
    arch = ti.remote if init.pop("arch") == "remote" else ti.cpu
    ti.init(arch=arch, default_fp=ti.f32, **init)
    n = 1024
    dt = 1e-5
    x = ti.Vector.field(2, dtype=ti.f32, shape=n, needs_grad=True)
    v = ti.Vector.field(2, dtype=ti.f32, shape=n)
    force = ti.Vector.field(2, dtype=ti.f32, shape=n)
    energy = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def init():
        for i in x:
            v[i] = [0.0, 0.0]

    @ti.kernel
    def compute_energy():
        for i, j in ti.ndrange(n, n):
            r = x[i] - x[j]
            energy[None] += -1 / r.norm(1e-3)

    @ti.kernel
    def compute_force():
        for i in x:
            f = ti.Vector([0.0, 0.0])
            for j in range(n):
                r = x[i] - x[j]
                f += -r / (r.norm_sqr() + 1e-3) ** 1.5
            force[i] = f

    @ti.kernel
    def advance():
        for i in x:
            v[i] += dt * force[i]
            x[i] += dt * v[i]

    x.from_numpy(np.random.default_rng(0).random((n, 2), dtype=np.float32))
    compile_s = first_calls(init, compute_energy, compute_force, advance)
    energy[None] = 0.0
    compute_energy()
    e0 = energy[None]
    t0 = time.perf_counter()
    for _ in range(steps):
        compute_force()
        advance()
    ti.sync()
    sim_s = time.perf_counter() - t0
    energy[None] = 0.0
    compute_energy()
    out = {"n": n, "compile_ms": compile_s * 1e3, "step_ms": sim_s / steps * 1e3, "e0": e0,
           "e1": energy[None], "x": x.to_numpy()}

    xs = out["x"].astype(np.float64)
    t0 = time.perf_counter()
    r = xs[:, None, :] - xs[None, :, :]
    _ = (-r / ((r**2).sum(-1, keepdims=True) + 1e-3) ** 1.5).sum(1)
    out["numpy_ms"] = (time.perf_counter() - t0) * 1e3

    # Forces by autodiff: F_i = -dU/dx_i. U sums every pair twice, so -dU/dx_i = 2 * force[i].
    compute_force()
    t0 = time.perf_counter()
    with ti.ad.Tape(loss=energy):
        compute_energy()
    out["grad"] = x.grad.to_numpy()
    out["tape_ms"] = (time.perf_counter() - t0) * 1e3
    by_hand = force.to_numpy()
    out["ad_err"] = float(np.abs(-out["grad"] / 2 - by_hand).max() / np.abs(by_hand).max())
    ti.reset()
    return out


def _report(r: dict, steps: int, where: str) -> None:
    print(f"difftape demo: {r['n']} bodies, {steps} steps, {where}")
    print(f"  first calls of 4 kernels (compile or cache load, and launch): "
          f"{r['compile_ms']:.1f} ms")
    print(f"  simulation: {r['step_ms']:.3f} ms/step "
          f"(NumPy, one force evaluation: {r['numpy_ms']:.1f} ms)")
    print(f"  potential energy: {r['e0']:.6g} -> {r['e1']:.6g}")
    print(f"  centre of mass: {r['x'].mean(0)}")
    print(f"  forces by autodiff (ti.ad.Tape over the energy, {r['tape_ms']:.1f} ms incl. "
          f"compiling the adjoint): max deviation from the hand-written forces "
          f"{r['ad_err']:.1e} (relative)")
