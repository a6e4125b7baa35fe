"""First contact (issue 18, item 4): the ``difftape`` command through its real entry point,
running an unchanged program remotely from environment variables, authentication failures
that say what to do, several tokens per user (list, rotate, revoke), compile metrics, the
demo's figures, and an orderly shutdown without a traceback."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import numpy as np

import difftape as ti

from .conftest import REPO, start_server
from .test_gateway_restart import metric

BIN = Path(sys.executable).parent
DIFFTAPE = str(BIN / "difftape")  # the console script pip installed: the real entry point


def cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([DIFFTAPE, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DIFFTAPE_ARCH", "TI_ARCH", "DIFFTAPE_SERVER", "DIFFTAPE_TOKEN")}
    env.update(extra)
    return env


# ---------------------------------------------------------------------- the command itself
def test_version_from_the_command_and_python_m_difftape():
    import difftape

    out = cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"difftape {difftape.__version__}"
    out = subprocess.run([sys.executable, "-m", "difftape", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"difftape {difftape.__version__}"
    out = subprocess.run([sys.executable, "-m", "difftape", "token", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for action in ("create", "list", "rotate", "revoke"):
        assert action in out.stdout


def test_every_option_has_help_text():
    import argparse

    from difftape.cli import parser

    missing = []

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                helps = {c.dest: c.help for c in a._choices_actions}
                for name, sub in a.choices.items():
                    if not helps.get(name):
                        missing.append(f"{path} {name}")
                    walk(sub, f"{path} {name}")
            elif not a.help or a.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(a.option_strings) or a.dest}")

    walk(parser(), "difftape")
    assert not missing, missing
    # ... and the real command shows it
    out = cli("serve", "--help")
    assert out.returncode == 0 and "DIFFTAPE_ARCH" in out.stdout and "log level" in out.stdout


# ---------------------------------------------------------------------- tokens
def _status(url: str, token: str) -> int:
    return httpx.get(url + "/v1/sessions", headers={"Authorization": f"Bearer {token}"},
                     timeout=30).status_code


def _until_refused(url: str, token: str, within: float = 5.0) -> float:
    """Seconds until the server refuses ``token`` (a revocation reaches it within a
    second); fails the test past ``within``."""
    t0 = time.monotonic()
    while _status(url, token) != 401:
        assert time.monotonic() - t0 < within, "the revoked token still works"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_tokens_create_list_rotate_revoke_on_a_running_server(tmp_path):
    data = tmp_path / "data"
    server = start_server(data, users=())
    try:
        d = ("--data-dir", str(data))
        first = cli("token", "create", "carol", *d)
        assert first.returncode == 0 and "created user 'carol'" in first.stderr, first.stderr
        assert "DIFFTAPE_TOKEN" in first.stderr
        second = cli("token", "create", "carol", *d)
        assert second.returncode == 0 and "another token for 'carol' (2 in all" in \
            second.stderr, second.stderr
        t1, t2 = first.stdout.strip(), second.stdout.strip()
        assert t1 != t2 and t1.startswith("dt_") and t2.startswith("dt_")
        assert _status(server.url, t1) == 200 and _status(server.url, t2) == 200

        listed = cli("token", "list", *d)
        assert listed.returncode == 0
        rows = [line.split() for line in listed.stdout.splitlines()[1:]]
        assert [r[1] for r in rows] == ["carol", "carol"]
        assert [r[2] for r in rows] == [t1[:8] + "...", t2[:8] + "..."]
        assert t1 not in listed.stdout and t2 not in listed.stdout
        id1 = rows[0][0]

        out = cli("token", "revoke", id1, *d)  # by id
        assert out.returncode == 0 and id1 in out.stderr
        assert _until_refused(server.url, t1) < 3.0
        assert _status(server.url, t2) == 200  # the other token of the same user still works

        out = cli("token", "rotate", t2, *d)  # by the token itself
        assert out.returncode == 0, out.stderr
        t3 = out.stdout.strip()
        assert t3.startswith("dt_") and t3 not in (t1, t2)
        _until_refused(server.url, t2)
        assert _status(server.url, t3) == 200
        assert cli("token", "list", "carol", *d).stdout.count("carol") == 1

        out = cli("token", "revoke", "--user", "carol", *d)
        assert out.returncode == 0
        _until_refused(server.url, t3)

        for args, says in ((("revoke", "tk_000000000000"), "no token 'tk_000000000000'"),
                           (("rotate", "--user", "nobody"), "no user named 'nobody'"),
                           (("revoke", "--user", "carol"), "has no tokens")):
            out = cli("token", *args, *d)
            assert out.returncode == 2 and says in out.stderr, out.stderr
            assert "Traceback" not in out.stderr
    finally:
        server.stop()


OLD_USERS = """CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,
    token_sha256 TEXT NOT NULL UNIQUE, created REAL NOT NULL,
    job_seconds REAL NOT NULL DEFAULT 0)"""


def test_a_database_with_one_token_per_user_keeps_its_tokens(tmp_path):
    """Databases made before several tokens per user had the hash in the users table."""
    import hashlib

    data = tmp_path / "data"
    data.mkdir()
    token = "dt_" + "x" * 43
    with sqlite3.connect(str(data / "difftape.sqlite3")) as db:
        db.execute(OLD_USERS)
        db.execute("INSERT INTO users (name, token_sha256, created, job_seconds) VALUES "
                   "('olga', ?, 1.0, 7.5)", (hashlib.sha256(token.encode()).hexdigest(),))
    db.close()
    server = start_server(data, users=("olga",), tokens={"olga": token})
    try:
        assert _status(server.url, token) == 200
        listed = cli("token", "list", "--data-dir", str(data))
        assert listed.returncode == 0 and "olga" in listed.stdout, listed.stderr
        more = cli("token", "create", "olga", "--data-dir", str(data))
        assert more.returncode == 0 and _status(server.url, more.stdout.strip()) == 200
        with server.db() as db:
            cols = [r[1] for r in db.execute("PRAGMA table_info(users)")]
            (seconds,) = db.execute("SELECT job_seconds FROM users WHERE name = 'olga'"
                                    ).fetchone()
        assert "token_sha256" not in cols and seconds == 7.5
    finally:
        server.stop()


# ---------------------------------------------------------------------- running remotely
PROGRAM = textwrap.dedent("""
    import numpy as np
    import difftape as ti
    from difftape.runtime import program

    ti.init(arch=ti.cpu)  # not edited: the environment decides where it runs
    x = ti.field(ti.f32, shape=8, needs_grad=True)
    loss = ti.field(ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def square():
        for i in x:
            loss[None] += x[i] * x[i]

    x.from_numpy(np.arange(8, dtype=np.float32))
    with ti.ad.Tape(loss=loss):
        square()
    remote = program.get().remote
    print("where", remote.session_id if remote is not None else "here")
    print("loss", loss[None], "grad", x.grad.to_numpy().tolist())
""")


def run_program(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / "prog.py"
    path.write_text(PROGRAM)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=120, env=clean_env(**env))


def test_an_unchanged_program_runs_on_the_server_from_environment_variables(service,
                                                                           tmp_path):
    out = run_program(tmp_path, DIFFTAPE_ARCH="remote", DIFFTAPE_SERVER=service.url,
                      DIFFTAPE_TOKEN=service.tokens["alice"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith("where s_"), out.stdout
    assert f"loss 140.0 grad {[2.0 * i for i in range(8)]}" in out.stdout
    local = run_program(tmp_path)
    assert local.returncode == 0 and local.stdout.splitlines()[0] == "where here"
    assert local.stdout.splitlines()[1] == out.stdout.splitlines()[1]


def test_authentication_failures_say_what_to_do(service, tmp_path):
    out = run_program(tmp_path, DIFFTAPE_ARCH="remote", DIFFTAPE_SERVER=service.url)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert "AuthenticationError" in last and "missing bearer token" in last, last
    assert "DIFFTAPE_TOKEN" in last and "difftape token create" in last, last

    out = run_program(tmp_path, DIFFTAPE_ARCH="remote", DIFFTAPE_SERVER=service.url,
                      DIFFTAPE_TOKEN="dt_not-a-token")
    last = out.stderr.strip().splitlines()[-1]
    assert "AuthenticationError" in last and "invalid token" in last, last
    assert "revoked" in last and "DIFFTAPE_TOKEN" in last and "difftape token create" in last

    # Any HTTP client gets the same guidance, in the problem body.
    r = httpx.get(service.url + "/v1/sessions", timeout=30)
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["detail"]


def test_serve_refuses_an_arch_meant_for_programs(tmp_path):
    out = cli("serve", "--data-dir", str(tmp_path), env=clean_env(DIFFTAPE_ARCH="remote"))
    assert out.returncode == 2 and "unset DIFFTAPE_ARCH" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------------- the server
def _compiles(client: httpx.Client) -> tuple[float, float]:
    n = (metric(client, "difftape_compile_cache_hits_total")
         + metric(client, "difftape_compile_cache_misses_total"))
    return n, metric(client, "difftape_compile_seconds_total")


def test_compile_metrics_count_a_session_that_ended_before_any_scrape(service, alice):
    n0, s0 = _compiles(alice)
    ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"])
    try:
        x = ti.field(ti.f32, shape=16)

        @ti.kernel
        def ramp_for_metrics(a: ti.f32):
            for i in x:
                x[i] = a * i + 0.25

        ramp_for_metrics(3.0)
        np.testing.assert_array_equal(x.to_numpy(), np.float32(3.0) * np.arange(16) + 0.25)
    finally:
        ti.reset()  # deletes the session: its worker stops
    n1, s1 = _compiles(alice)
    assert n1 >= n0 + 1 and s1 > s0, (n0, n1, s0, s1)


def test_demo_first_calls_figure_includes_the_server_compiling(service, alice):
    """Launches under arch=ti.remote are queued: the demo's clock must run until the server
    has compiled and run them, not stop once they are queued."""
    from difftape.demo import first_calls

    ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"])
    try:
        y = ti.field(ti.f32, shape=16)

        @ti.kernel
        def fill_for_demo_figure():
            for i in y:
                y[i] = ti.sqrt(i * 2.0) + 0.125

        n0, _ = _compiles(alice)
        seconds = first_calls(fill_for_demo_figure)
        n1, _ = _compiles(alice)  # the session is idle now: the scrape asks its worker
        assert n1 >= n0 + 1, "the kernel was not compiled within the timed first call"
        assert seconds > 0
    finally:
        ti.reset()


def test_orderly_shutdown_right_after_a_client_left_logs_no_traceback(tmp_path):
    server = start_server(tmp_path / "data", users=("alice",))
    try:
        with server.client() as c:
            sid = c.post("/v1/sessions", json={}).json()["session_id"]
            assert c.delete(f"/v1/sessions/{sid}").status_code == 204
            c.post("/v1/sessions", json={})  # one left open: saved at the stop
    finally:
        server.proc.send_signal(signal.SIGINT)
        server.proc.wait(60)
    log = server.log()
    assert server.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log and "Error" not in log.replace("ERROR: ", ""), log[-3000:]
