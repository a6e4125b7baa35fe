"""Compile time: first call of a ~30-line kernel, cold and from the on-disk offline cache.

Measures what a user waits for the first time a kernel runs: tracing, optimisation and
machine-code generation (cold, empty cache directory), and, in a second fresh process that
reuses the same cache directory, how much of that the offline cache saves.

Run standalone without ``--cache-dir`` it drives itself: for each of ``--repeat`` pairs it
makes a fresh temporary cache directory and starts the cold and the warm process, exactly as
``run.py`` does. ``ti.init`` and field allocation are timed separately and excluded.
"""

import argparse
import sys
import time
from typing import Any

import common

NAME = "compile"
N = 4096


def run_phase(args: argparse.Namespace) -> dict[str, Any]:
    """One process of the pair: time the first and second call of ``step``."""
    if args.backend == "numpy":
        raise common.Unsupported("no numpy version: nothing is compiled")
    t0 = time.perf_counter()
    ti = common.load_backend(args.backend)
    import_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    common.init(ti, **common.offline_cache_kwargs(args.backend, args.cache_dir))
    init_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    pos = ti.Vector.field(3, ti.f32, N)
    vel = ti.Vector.field(3, ti.f32, N)
    mass = ti.field(ti.f32, N)
    energy = ti.field(ti.f32, ())
    hist = ti.field(ti.i32, 16)
    ti.sync()  # In Taichi this materialises (allocates) the fields; kept out of the timing.
    alloc_s = time.perf_counter() - t0

    @ti.kernel
    def step(dt: ti.f32):
        for i in range(N):
            p = pos[i]
            v = vel[i]
            acc = ti.Vector([0.0, -9.8, 0.0])
            r = p.norm(1e-6)
            if r > 1.0:
                acc -= p / (r * r * r)
            else:
                acc += ti.Vector([ti.sin(p[0]), ti.cos(p[1]), ti.tanh(p[2])])
            for j in range(8):
                d = pos[(i + j + 1) % N] - p
                dist = d.norm(1e-6)
                if dist < 0.5:
                    acc += 0.01 * d / (dist * dist * dist)
            if p[1] < -2.0:
                v[1] = ti.abs(v[1])
            elif p[1] > 2.0:
                v[1] = -ti.abs(v[1])
            v += dt * acc
            p += dt * v
            pos[i] = p
            vel[i] = v
            e = 0.5 * mass[i] * v.dot(v) + mass[i] * 9.8 * p[1]
            energy[None] += e * ti.exp(-r)
            b = ti.min(ti.max(ti.cast(ti.sqrt(ti.abs(e)) * 4.0, ti.i32), 0), 15)
            hist[b] += 1

    t0 = time.perf_counter()
    step(0.01)
    ti.sync()
    first_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    step(0.01)
    ti.sync()
    second_s = time.perf_counter() - t0

    count = int(hist.to_numpy().sum())
    notes = f"{args.phase} cache; hist count {count}" + ("" if count == 2 * N else " (WRONG)")
    return common.result(
        NAME,
        args.backend,
        seconds=first_s,
        notes=notes,
        phase=args.phase,
        first_s=first_s,
        second_s=second_s,
        import_s=import_s,
        init_s=init_s,
        alloc_s=alloc_s,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """A single phase when given ``--cache-dir``; otherwise drive a cold+warm pair."""
    if args.cache_dir:
        return run_phase(args)
    if args.backend == "numpy":
        raise common.Unsupported("no numpy version: nothing is compiled")
    return common.run_cache_pairs(NAME, args.backend, pairs=args.repeat)


if __name__ == "__main__":
    p = common.parser(__doc__.splitlines()[0], repeat=3, warmup=0)  # repeat = cache pairs
    p.add_argument("--cache-dir", default=None, help="offline cache directory for this process")
    p.add_argument("--phase", choices=("cold", "warm"), default="cold", help="label only")
    sys.exit(common.main(NAME, run, p.parse_args()))
