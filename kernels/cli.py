"""The ``difftape`` command line: ``difftape demo`` and ``difftape info``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(steps=args.steps)


def _info(args: argparse.Namespace) -> int:
    import llvmlite

    from . import __version__
    from .codegen.cpu import get_target
    from .runtime import cache, program

    t = get_target()
    print(f"difftape {__version__}, llvmlite {llvmlite.__version__}")
    print(f"cpu: {t.cpu}, vector math: {'libmvec ' + t.isa if t.mvec else 'scalar libm'}")
    print(f"threads: {program.get().num_threads}, cache: {cache.cache_dir()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="difftape", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run a small simulation and show what the compiler did")
    d.add_argument("--steps", type=int, default=200)
    d.set_defaults(fn=_demo)
    i = sub.add_parser("info", help="show the compiler, CPU features and cache location")
    i.set_defaults(fn=_info)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
