"""The ``difftape`` command line: ``demo``, ``info``, ``serve`` and ``token``.

Run ``difftape COMMAND --help`` for a command's options. A program runs on a difftape server
without an edit when DIFFTAPE_ARCH=remote, DIFFTAPE_SERVER=URL and DIFFTAPE_TOKEN=TOKEN are
set (TI_ARCH, Taichi's variable, is followed too; DIFFTAPE_ARCH comes first).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ._version import __version__
from .codegen import get_target
from .demo import main as demo_main
from .runtime import cache, program


def _demo(args: argparse.Namespace) -> int:
    if args.server and not args.remote:
        raise SystemExit("difftape demo: --server is for --remote (compare a run on that server "
                         "with a local one)")
    return demo_main(steps=args.steps, remote=args.remote, server=args.server,
                     token=args.token or os.environ.get("DIFFTAPE_TOKEN"))


def _info(args: argparse.Namespace) -> int:
    import llvmlite

    t = get_target()
    print(f"difftape {__version__}, llvmlite {llvmlite.__version__}")
    print(f"cpu: {t.cpu}, vector math: {t.vector_math}")
    print(f"threads: {program.get().num_threads}, cache: {cache.cache_dir()}")
    return 0


def _settings(**overrides):
    """The server's settings (flags over DIFFTAPE_* variables); a readable error, not a
    pydantic traceback, when a variable holds something the server cannot use."""
    from pydantic import ValidationError

    # Function-level: the server needs the optional `server` extra (FastAPI, uvicorn, ...).
    from .server.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        lines = [f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                 for err in e.errors()]
        raise _CliError("invalid server settings (flags or DIFFTAPE_* environment "
                        "variables):\n" + "\n".join(lines)) from None


class _CliError(Exception):
    """A message for the user (printed without a traceback, exit code 2)."""


def _serve(args: argparse.Namespace) -> int:
    # Flags override DIFFTAPE_* environment variables; unset flags leave them in charge.
    settings = _settings(host=args.host, port=args.port, arch=args.arch,
                         data_dir=args.data_dir, cluster=args.cluster)
    # Function-level: the server needs the optional `server` extra (FastAPI, uvicorn, ...).
    from .server.app import serve

    where = f", sessions on the Ray cluster {settings.cluster}" if settings.cluster else ""
    print(f"difftape server on http://{settings.host}:{settings.port} "
          f"(arch {settings.arch}, data {settings.data_dir}{where})", flush=True)
    try:
        serve(settings, log_level=args.log_level, access_log=args.access_log)
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C (SIGINT) it stopped on once the graceful stop is
        # over: the stop was orderly, so no traceback.
        pass
    return 0


def _database(args: argparse.Namespace):
    # Function-level: the server needs the optional `server` extra (FastAPI, uvicorn, ...).
    from .server.db import Database

    return Database(_settings(data_dir=args.data_dir).database)


def _token_create(args: argparse.Namespace) -> int:
    db = _database(args)
    try:
        if db.has_user(args.name):
            token = db.create_token(args.name)
            n = len(db.tokens(args.name))
            print(f"difftape: another token for {args.name!r} ({n} in all; "
                  f"`difftape token list` shows them)", file=sys.stderr)
        else:
            token = db.create_user(args.name)
            print(f"difftape: created user {args.name!r}", file=sys.stderr)
    except ValueError as e:
        raise _CliError(str(e)) from None
    print(token)  # shown once: only its hash is stored
    print("difftape: the token is shown only now; give it to the program as "
          "DIFFTAPE_TOKEN=<token> (or ti.init(arch=ti.remote, token=...))", file=sys.stderr)
    return 0


def _token_list(args: argparse.Namespace) -> int:
    tokens = _database(args).tokens(args.name)
    if not tokens:
        print("no tokens" + (f" for {args.name!r}" if args.name else "") +
              "; make one with `difftape token create NAME`", file=sys.stderr)
        return 0
    width = max(4, *(len(t.user) for t in tokens))
    print(f"{'ID':<15} {'USER':<{width}} {'STARTS WITH':<12} CREATED (UTC)")
    for t in tokens:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t.created))
        print(f"{t.id:<15} {t.user:<{width}} {t.prefix + '...':<12} {created}")
    return 0


def _token_rotate(args: argparse.Namespace) -> int:
    try:
        token, old = _database(args).rotate(args.token, user=args.user)
    except ValueError as e:
        raise _CliError(str(e)) from None
    print(token)
    print(f"difftape: new token for {old[0].user!r}; revoked {', '.join(t.id for t in old)} "
          f"(a running server refuses {'it' if len(old) == 1 else 'them'} within a second)",
          file=sys.stderr)
    return 0


def _token_revoke(args: argparse.Namespace) -> int:
    try:
        old = _database(args).revoke(args.token, user=args.user)
    except ValueError as e:
        raise _CliError(str(e)) from None
    print(f"difftape: revoked {', '.join(t.id for t in old)} of {old[0].user!r} (a running "
          f"server refuses {'it' if len(old) == 1 else 'them'} within a second)",
          file=sys.stderr)
    return 0


_DATA_DIR_HELP = ("the server's data dir, which holds its user database (default: "
                  "DIFFTAPE_DATA_DIR, else ~/.local/share/difftape-server)")


def _which_token(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("token", nargs="?", help="a token id from `difftape token list` (tk_...), "
                                            "or the token itself (dt_...)")
    g.add_argument("--user", metavar="NAME", help="every token of this user")
    p.add_argument("--data-dir", help=_DATA_DIR_HELP)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="difftape", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"difftape {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser("demo", help="run a small simulation and show what the compiler did")
    d.add_argument("--steps", type=int, default=200,
                   help="simulation steps to time (default 200)")
    d.add_argument("--remote", action="store_true",
                   help="start a loopback difftape server and run the demo through the client "
                        "(needs the 'server' extra)")
    d.add_argument("--server", metavar="URL",
                   help="with --remote: run against this running server (e.g. a container) "
                        "instead of starting one on loopback")
    d.add_argument("--token", help="with --server: the bearer token (default DIFFTAPE_TOKEN)")
    d.set_defaults(fn=_demo)
    i = sub.add_parser("info", help="show the compiler, CPU features and cache location")
    i.set_defaults(fn=_info)
    s = sub.add_parser("serve", help="run the compile-and-execute service",
                       description="Run the service. Every flag overrides its DIFFTAPE_* "
                                   "environment variable (see deploy/README.md for all).")
    s.add_argument("--host", help="bind address (default 127.0.0.1; DIFFTAPE_HOST)")
    s.add_argument("--port", type=int, help="port (default 8000; DIFFTAPE_PORT)")
    s.add_argument("--arch", choices=["cpu", "cuda"],
                   help="where kernels run (default cpu; DIFFTAPE_ARCH)")
    s.add_argument("--data-dir", help="database, compiled-code cache and saved sessions "
                                      "(DIFFTAPE_DATA_DIR)")
    s.add_argument("--cluster", metavar="ADDRESS",
                   help="run sessions' engines as Ray actors on this cluster: ray://HOST:PORT, "
                        "HOST:PORT (its GCS) or auto (needs the 'ray' extra; "
                        "DIFFTAPE_CLUSTER)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default info)")
    s.add_argument("--access-log", action="store_true",
                   help="uvicorn's plain-text access log too (the JSON one is "
                        "DIFFTAPE_ACCESS_LOG)")
    s.set_defaults(fn=_serve)
    t = sub.add_parser("token", help="manage the service's users and their tokens",
                       description="Users and their tokens, in the server's database (a "
                                   "server may be running: changes apply to it at once).")
    tsub = t.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    tc = tsub.add_parser("create", help="print a new token for a user (shown once), adding "
                                        "the user if new")
    tc.add_argument("name", help="the user's name")
    tc.add_argument("--data-dir", help=_DATA_DIR_HELP)
    tc.set_defaults(fn=_token_create)
    tl = tsub.add_parser("list", help="list tokens (ids and first characters, never tokens)")
    tl.add_argument("name", nargs="?", help="only this user's tokens")
    tl.add_argument("--data-dir", help=_DATA_DIR_HELP)
    tl.set_defaults(fn=_token_list)
    tr = tsub.add_parser("rotate", help="replace a token (or all of a user's) by a new one "
                                        "and print it")
    _which_token(tr)
    tr.set_defaults(fn=_token_rotate)
    tv = tsub.add_parser("revoke", help="delete a token (or all of a user's)")
    _which_token(tv)
    tv.set_defaults(fn=_token_revoke)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except _CliError as e:
        print(f"difftape: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
