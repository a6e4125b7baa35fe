"""The ``difftape`` command line: ``demo``, ``info``, ``serve`` and ``token create``."""

from __future__ import annotations

import argparse
import sys

from ._version import __version__
from .codegen import get_target
from .demo import main as demo_main
from .runtime import cache, program


def _demo(args: argparse.Namespace) -> int:
    return demo_main(steps=args.steps, remote=args.remote)


def _info(args: argparse.Namespace) -> int:
    import llvmlite

    t = get_target()
    print(f"difftape {__version__}, llvmlite {llvmlite.__version__}")
    print(f"cpu: {t.cpu}, vector math: {'libmvec ' + t.isa if t.mvec else 'scalar libm'}")
    print(f"threads: {program.get().num_threads}, cache: {cache.cache_dir()}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    # Flags override DIFFTAPE_* environment variables; unset flags leave them in charge.
    # Function-level: the server needs the optional `server` extra (FastAPI, uvicorn, ...).
    from .server import app
    from .server import settings as server_settings

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port),
                                   ("arch", args.arch), ("data_dir", args.data_dir))
                 if v is not None}
    settings = server_settings.Settings(**overrides)

    print(f"difftape server on http://{settings.host}:{settings.port} "
          f"(arch {settings.arch}, data {settings.data_dir})", flush=True)
    app.serve(settings, log_level=args.log_level, access_log=args.access_log)
    return 0


def _token_create(args: argparse.Namespace) -> int:
    # Function-level: the server needs the optional `server` extra (FastAPI, uvicorn, ...).
    from .server import db
    from .server import settings as server_settings

    settings = server_settings.Settings(**({"data_dir": args.data_dir} if args.data_dir else {}))
    try:
        token = db.Database(settings.db_path).create_user(args.name)
    except ValueError as e:
        print(f"difftape: {e}", file=sys.stderr)
        return 1
    print(token)  # shown once: only its hash is stored
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="difftape", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run a small simulation and show what the compiler did")
    d.add_argument("--steps", type=int, default=200)
    d.add_argument("--remote", action="store_true",
                   help="start a loopback difftape server and run the demo through the client "
                        "(needs the 'server' extra)")
    d.set_defaults(fn=_demo)
    i = sub.add_parser("info", help="show the compiler, CPU features and cache location")
    i.set_defaults(fn=_info)
    s = sub.add_parser("serve", help="run the compile-and-execute service")
    s.add_argument("--host", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default 8000)")
    s.add_argument("--arch", choices=["cpu", "cuda"])
    s.add_argument("--data-dir", help="database, compiled-code cache and saved sessions")
    s.add_argument("--log-level", default="info")
    s.add_argument("--access-log", action="store_true")
    s.set_defaults(fn=_serve)
    t = sub.add_parser("token", help="manage the service's users and their tokens")
    tsub = t.add_subparsers(dest="token_command", required=True)
    tc = tsub.add_parser("create", help="add a user and print their token (shown once)")
    tc.add_argument("name")
    tc.add_argument("--data-dir", help="the server's data dir (default: DIFFTAPE_DATA_DIR)")
    tc.set_defaults(fn=_token_create)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
