"""Run DiffTaichi's examples on difftape and on Taichi 1.7.4, headless, and compare their output.

    .venv/bin/python bench/difftaichi.py --checkout /work/difftaichi --output /tmp/difftaichi

For each example in ``examples/*.py`` of a taichi-dev/difftaichi checkout it makes a temporary
copy of the examples directory, cuts the optimisation to a few iterations by rewriting the
example's known iteration constant (``EXAMPLES`` below: each rewrite must match exactly once,
so a changed example is reported instead of silently run in full), and runs it twice in fresh
processes: with Taichi (``--taichi-python``) and with difftape through the ``taichi`` ->
difftape alias (``bench/taichi_compat/alias.py``). Both runs are headless: ``ti.GUI`` is a
no-op object (``taichi_compat/headless/_noop.py``; with ``ti.rgb_to_hex``, its colour helper,
where the backend has none), ``ti.init`` runs on the CPU whatever arch
the example asks for (there is no GPU here, and Taichi 1.7.4 crashes while falling back from
``arch=ti.gpu``), matplotlib uses the Agg backend (or a
no-op stand-in where it is not installed), OpenCV / imageio are stand-ins that read PNGs and
write nothing; Python's ``random`` and NumPy's generator are seeded with 0.

The numbers each run prints (losses, gradient norms), minus timing lines, are compared in order:
relative tolerance ``F32_RTOL`` for f32 scenes; scenes marked chaotic in ``EXAMPLES`` (contacts
make tiny rounding differences grow) are run in f64 (``real = ti.f32`` rewritten to ``ti.f64``
in the copy) with ``ti.init(fast_math=False)`` on both backends (``STRICT``: the same IEEE
evaluation, so that what is compared is the program, not two compilers' rounding choices;
``--fast-math`` keeps the defaults) and compared with ``F64_RTOL``. Per example the verdict is:
agrees, differs (the first differing value), agrees within chaos (a chaotic scene that differs,
but only from the first value that Taichi itself cannot reproduce when every random number the
example draws is one ulp larger, and there by at most ``CHAOS_FACTOR`` times Taichi's own move:
a third run, on Taichi, made only in that case; later values are not judged), refused (difftape
raised one of its errors), error (any other exception), crash (a signal), hang (``--timeout``),
or baseline-fails (Taichi itself cannot run it headless here), with both wall times. difftape
runs first; where it stops with an error, Taichi is not run (its output could not change the
verdict) unless ``--always-baseline``. Writes OUTPUT.json and OUTPUT.md.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from program_runs import (  # noqa: E402  (bench/program_runs.py: what the harnesses share)
    ATOL,
    Run,
    add_arguments,
    compare,
    failed_fast,
    report_markdown,
    run_all,
    run_one,
    unfinished,
    write_runner,
)
from program_runs import result_lines as _result_lines  # noqa: E402

F32_RTOL = 1e-3
F64_RTOL = 1e-7
#: A chaotic scene whose values differ beyond ``F64_RTOL`` still agrees *within chaos* when every
#: value's difference is at most this many times the distance between two Taichi runs whose
#: random inputs differ by one ulp (see ``within_chaos``).
CHAOS_FACTOR = 10
#: What ``ti.init`` gets in a chaotic scene, on both backends: IEEE evaluation as written. By
#: default the two round differently (Taichi lets LLVM reassociate, difftape fuses
#: multiply-adds and takes transcendentals from libmvec), and a contact scene amplifies a last
#: bit into 1e-4 (rigid_body.py); with this, difftape's forward pass of rigid_body.py is bit for
#: bit Taichi's. ``--fast-math`` compares the defaults instead.
STRICT = {"fast_math": False}


@dataclass
class Example:
    """How to run one example briefly: ``argv``, source ``rewrites`` (old, new) applied to the
    temporary copy (``{iters}`` is the iteration count), whether it is ``chaotic`` (run in
    f64), and line filters for output that is not a result (``ignore``: regexes)."""

    argv: list[str] = field(default_factory=list)
    rewrites: list[tuple[str, str]] = field(default_factory=list)
    chaotic: bool = False
    ignore: list[str] = field(default_factory=list)


#: The examples this harness knows how to cut short. Iteration counts come from ``--iters``.
EXAMPLES: dict[str, Example] = {
    "billiards.py": Example(rewrites=[("for iter in range(200):", "for iter in range({iters}):")],
                            chaotic=True),
    "diffmpm.py": Example(argv=["--iters", "{iters}"], chaotic=True),
    "diffmpm3d.py": Example(argv=["--iters", "{iters}"], chaotic=True),
    "diffmpm_benchmark.py": Example(
        rewrites=[("iters = 100000", "iters = 2"), ("for i in range(30):",
                                                    "for i in range({iters}):")],
        chaotic=True),
    "diffmpm_checkpointing.py": Example(argv=["--iters", "{iters}"], chaotic=True),
    "diffmpm_simple.py": Example(rewrites=[("for i in range(30):", "for i in range({iters}):")],
                                 chaotic=True),
    "electric.py": Example(rewrites=[
        ("for iter in range(200000):", "for iter in range({iters}):"),
        ('# print(iter, "loss", loss[None])', 'print(iter, "loss", loss[None])')]),
    # liquid.py calls ti.clear_all_gradients(), which Taichi 1.7.4 has only as
    # ti.ad.clear_all_gradients() (the same rename diffmpm3d.py already has).
    "liquid.py": Example(rewrites=[("for iter in range(501):", "for iter in range({iters}):"),
                                   ("ti.clear_all_gradients()", "ti.ad.clear_all_gradients()")],
                         chaotic=True),
    "mass_spring.py": Example(argv=["0", "train", "--iters", "{iters}"], chaotic=True),
    "mass_spring_interactive.py": Example(argv=["0", "--iters", "{iters}"], chaotic=True,
                                          ignore=[r"^\S+\s+[12]$"]),
    "mass_spring_simple.py": Example(
        rewrites=[("for iter in range(25):", "for iter in range({iters}):")], chaotic=True),
    "rigid_body.py": Example(argv=["0", "train"],
                             rewrites=[("for iter in range(20):", "for iter in range({iters}):")],
                             chaotic=True),
    "smoke_taichi.py": Example(argv=["--iters", "{iters}"]),
    "smoke_taichi_cpu.py": Example(argv=["--iters", "{iters}"]),
    "smoke_taichi_gpu.py": Example(argv=["--iters", "{iters}"]),
    "wave.py": Example(argv=["--iters", "{iters}"]),
}

#: Files in examples/ that are not Taichi examples runnable here, and why.
NOT_RUN = {
    "adversarial.py": "PyTorch/torchvision program, no Taichi",
    "smoke_autograd.py": "autograd (NumPy AD) version of smoke, no Taichi",
    "smoke_jax.py": "JAX version of smoke, no Taichi",
    "smoke_pytorch.py": "PyTorch version of smoke, no Taichi",
    "plot_losses.py": "plots saved losses, no Taichi",
    "robot_config.py": "configuration module imported by rigid_body.py",
    "mass_spring_robot_config.py": "configuration module imported by mass_spring*.py",
    "volume_renderer.py": "downloads its data set over the network",
    "water_renderer.py": "imports adversarial.py (PyTorch, VGG weights)",
}

def prepare(checkout: Path, root: Path, backend: str, name: str, spec: Example,
            iters: int, strict: bool = True, gui: str = "noop") -> tuple[Path, list[str]]:
    """A temporary copy of examples/ with the rewrites applied to ``name``; the argv.
    ``strict``: a chaotic scene's ``ti.init`` gets ``fast_math=False`` (see ``STRICT``);
    ``gui``: which ``ti.GUI`` the run gets (``_launch.run``)."""
    work = root / backend / name[:-3]
    shutil.copytree(checkout / "examples", work)
    script = work / name
    src = script.read_text()
    rewrites = [(a, b.format(iters=iters)) for a, b in spec.rewrites]
    if spec.chaotic:
        rewrites.append(("real = ti.f32", "real = ti.f64"))
    for old, new in rewrites:
        count = src.count(old)
        if count != 1:
            raise RuntimeError(f"{name}: expected {old!r} once, found it {count} times; "
                               "update EXAMPLES in bench/difftaichi.py")
        src = src.replace(old, new)
    script.write_text(src)
    argv = [a.format(iters=iters) for a in spec.argv]
    write_runner(work, backend, script, argv, STRICT if spec.chaotic and strict else {},
                 gui=gui)
    return work, argv


def result_lines(stdout: str, spec: Example) -> list[tuple[str, list[float]]]:
    """The printed lines that carry results, with their numbers."""
    return _result_lines(stdout, spec.ignore)


@dataclass
class Chaos:
    """How difftape's output compares with Taichi's where Taichi's own output is unstable.

    ``horizon``: the first value (1-based, over all result values in order) that Taichi's run
    with its random inputs one ulp up moves beyond ``rtol``, or None; ``agree``: every value
    before the horizon within ``rtol`` and the value at it within ``CHAOS_FACTOR`` times Taichi's
    own move; ``outside``: the first value that is not; ``spread``: the largest relative move of
    Taichi's own values; ``unjudged``: values after the horizon (Taichi cannot reproduce them
    itself, so neither is difftape held to them)."""

    agree: bool
    outside: str = ""
    horizon: int | None = None
    spread: float = 0.0
    unjudged: int = 0


def within_chaos(a: list, b: list, nudged: list, rtol: float) -> Chaos:
    """Compare Taichi's (``a``) and difftape's (``b``) result lines up to Taichi's own
    predictability horizon, found from ``nudged`` (Taichi's output when every random input is one
    ulp larger); see :class:`Chaos`."""
    if not (len(a) == len(b) == len(nudged)):
        return Chaos(False, "the runs printed different numbers of result lines")
    out = Chaos(True)
    k = 0
    for i, ((la, na), (_, nb), (_, nn)) in enumerate(zip(a, b, nudged, strict=True)):
        if not (len(na) == len(nb) == len(nn)):
            return Chaos(False, f"line {i + 1}: the runs printed different numbers of values")
        for x, y, z in zip(na, nb, nn, strict=True):
            k += 1
            if out.horizon is not None:
                out.unjudged += 1
                continue
            if any(map(math.isnan, (x, y, z))):
                if math.isnan(x) and math.isnan(y) and math.isnan(z):
                    continue
                return Chaos(False, f"line {i + 1}: NaN in one run (`{la}`)")
            scale = max(abs(x), abs(y), ATOL)
            move = abs(x - z)
            out.spread = max(out.spread, move / scale)
            tol = max(rtol * scale, ATOL)
            if move > tol:
                out.horizon = k
                tol = CHAOS_FACTOR * move
            if abs(x - y) > tol:
                where = "before" if out.horizon is None else "at"
                return Chaos(False, f"line {i + 1}, {where} Taichi's horizon: Taichi {x!r} / "
                             f"difftape {y!r} / Taichi with inputs one ulp up {z!r}",
                             out.horizon, out.spread)
    if out.horizon is None:
        out.agree = False
        out.outside = "Taichi's output did not move with its inputs one ulp up"
    return out


def verdict(t: Run | None, d: Run, spec: Example, rtol: float) -> dict:
    out = unfinished(t, d)
    if "verdict" in out:
        return out
    ta, da = result_lines(t.stdout, spec), result_lines(d.stdout, spec)
    agree, first, worst = compare(ta, da, rtol)
    out.update(verdict="agrees" if agree else "differs", detail=first,
               values_compared=sum(len(n) for _, n in ta), max_rel_diff=worst)
    return out


def markdown(report: dict) -> str:
    return report_markdown(
        report, "DiffTaichi examples",
        f"{report['meta']['iters']} optimisation iterations, f32 scenes compared at rtol "
        f"{F32_RTOL:g}, chaotic scenes run in f64 at rtol {F64_RTOL:g}",
        " with ti.init(fast_math=False) on both (*f64 strict*)",
        [("precision", "precision"), ("verdict", "verdict"), ("values", "values_compared"),
         ("max rel diff", "max_rel_diff"), ("Taichi s", "taichi_seconds"),
         ("difftape s", "difftape_seconds"), ("detail", "detail")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, required=True,
                    help="a taichi-dev/difftaichi checkout (outside this repository)")
    ap.add_argument("--iters", type=int, default=3, help="optimisation iterations (default 3)")
    add_arguments(ap, timeout=600)
    ap.add_argument("--always-baseline", action="store_true",
                    help="run Taichi even where difftape already failed with an error")
    args = ap.parse_args(argv)

    checkout = args.checkout.resolve()
    names = sorted(p.name for p in (checkout / "examples").glob("*.py"))
    if args.only:
        names = [n for n in names if n in args.only]

    def one(name: str, root: Path) -> dict:
        if name in NOT_RUN or name not in EXAMPLES:
            return {"verdict": "not run", "detail": NOT_RUN.get(name, "not listed in EXAMPLES")}
        spec = EXAMPLES[name]
        runs: dict[str, Run] = {}
        for backend, python in (("difftape", args.difftape_python),
                                ("taichi", args.taichi_python)):
            if backend == "taichi" and not args.always_baseline and failed_fast(
                    runs["difftape"]):
                continue  # difftape stopped with an error: Taichi's output is not needed
            work, _ = prepare(checkout, root, backend, name, spec, args.iters,
                              not args.fast_math)
            runs[backend] = run_one(python, work, backend, args.timeout)
        rtol = F64_RTOL if spec.chaotic else F32_RTOL
        r = verdict(runs.get("taichi"), runs["difftape"], spec, rtol)
        if spec.chaotic and r["verdict"] == "differs":
            # Is the difference more than rounding amplified by the scene? Ask Taichi how
            # far its own output moves when its random inputs move by one ulp.
            work, _ = prepare(checkout, root, "taichi_nudged", name, spec, args.iters,
                              not args.fast_math)
            nudged = run_one(args.taichi_python, work, "taichi", args.timeout, nudge=True)
            r["taichi_nudged_seconds"] = round(nudged.seconds, 1)
            if nudged.rc == 0 and not nudged.timed_out:
                ta, da, na = (result_lines(x.stdout, spec)
                              for x in (runs["taichi"], runs["difftape"], nudged))
                c = within_chaos(ta, da, na, rtol)
                r["taichi_1ulp_rel_spread"] = c.spread
                if c.agree:
                    r["verdict"] = "agrees within chaos"
                    r["detail"] = (
                        f"equal to rtol up to value {c.horizon}, where a 1-ulp nudge of "
                        f"Taichi's random inputs moves Taichi itself; {c.unjudged} values "
                        f"after it not judged (Taichi's own 1-ulp spread {c.spread:.1e}, "
                        f"difftape vs Taichi {r['max_rel_diff']:.1e})")
                else:
                    r["detail"] += f"; against Taichi's own 1-ulp spread: {c.outside}"
        r["precision"] = ("f64" + ("" if args.fast_math else " strict")) if spec.chaotic \
            else "f32"
        if "taichi" not in runs:
            r["detail"] += " (Taichi not run: difftape stopped with an error)"
        r["output"] = {b: run.stdout[-3000:] for b, run in runs.items()}
        r["stderr_tail"] = {b: run.stderr_tail[-1500:] for b, run in runs.items()}
        return r

    return run_all(args, names, one, {"iters": args.iters, "fast_math": args.fast_math,
                                      "checkout": str(checkout)}, markdown, "difftaichi_")


if __name__ == "__main__":
    sys.exit(main())
