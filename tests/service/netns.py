"""A real network between a difftape client and server: two network namespaces joined by a
veth pair, with delay added on the path.

The server runs in one namespace, the client program in the other; they talk over the veth
pair (addresses 10.231.N.1 and .2), never over loopback. Delay is added one of two ways:

``netem``  ``tc qdisc ... netem delay D`` on both ends of the veth pair: the kernel holds
           every packet D each way, TCP handshakes and ACKs included (the real thing).
``relay``  for kernels built without netem: a TCP relay in the server's namespace holds the
           bytes of each direction D before passing them on (so each request/response
           exchange costs 2 D, like a round trip; a new connection's handshake is not
           delayed, which keep-alive clients pay once).

Making namespaces needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2;
:func:`unavailable` says exactly what is missing, for a test to skip with that reason.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_ids = itertools.count()


def _run(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = [*(["ip", "netns", "exec", ns] if ns else []), *cmd]
    out = subprocess.run(full, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(full)}: {(out.stderr or out.stdout).strip()}")
    return out


_probe: dict[str, str | None] = {}


def unavailable(mechanism: str) -> str | None:
    """None if this machine can build the pair with ``mechanism`` ("netem" or "relay"),
    else the exact reason it cannot (the failing command and what it said)."""
    if mechanism in _probe:
        return _probe[mechanism]
    reason = None
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            reason = f"`{tool}` is not installed (iproute2: apt-get install iproute2)"
    if reason is None:
        try:
            with _pair(mechanism="none", probe=True) as pair:
                if mechanism == "netem":
                    out = _run("tc", "qdisc", "add", "dev", pair.server_dev, "root", "netem",
                               "delay", "1ms", ns=pair.server_ns, check=False)
                    if out.returncode != 0:
                        reason = (f"the kernel has no netem qdisc: `tc qdisc add dev ... root "
                                  f"netem delay 1ms` said {out.stderr.strip()!r}")
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            reason = f"cannot make network namespaces joined by a veth pair: {e}"
    _probe[mechanism] = reason
    return reason


@dataclass
class NetPair:
    """Two namespaces joined by a veth pair; ``one_way_s`` of delay each way."""

    server_ns: str
    client_ns: str
    server_dev: str
    client_dev: str
    server_ip: str
    client_ip: str
    mechanism: str
    one_way_s: float
    _procs: list[subprocess.Popen] = field(default_factory=list)

    def in_server(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.server_ns, *cmd]

    def in_client(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.client_ns, *cmd]

    def expose(self, port: int) -> int:
        """The port a client connects to for the server's ``port``: the same one under
        netem (or no delay), a delaying relay's under ``relay``."""
        if self.mechanism != "relay" or self.one_way_s <= 0:
            return port
        front = port + 1  # the server namespace has nothing else listening
        proc = subprocess.Popen(self.in_server(
            [sys.executable, str(Path(__file__).with_name("delay_relay.py")), "--listen",
             f"{self.server_ip}:{front}", "--to", f"127.0.0.1:{port}", "--delay",
             str(self.one_way_s)]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._procs.append(proc)
        line = proc.stdout.readline().decode()  # "ready" once it listens
        if "ready" not in line:
            raise RuntimeError(f"the delay relay did not start: {line}")
        return front

    def close(self) -> None:
        for p in self._procs:
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        self._procs.clear()


@contextlib.contextmanager
def _pair(*, mechanism: str, one_way_s: float = 0.0, probe: bool = False
          ) -> Iterator[NetPair]:
    n = next(_ids)
    tag = f"{os.getpid() % 100000}{'p' if probe else ''}{n}"
    sub = (os.getpid() + n) % 250 + 1
    pair = NetPair(server_ns=f"dts{tag}", client_ns=f"dtc{tag}", server_dev=f"dvs{tag}"[:15],
                   client_dev=f"dvc{tag}"[:15], server_ip=f"10.231.{sub}.1",
                   client_ip=f"10.231.{sub}.2", mechanism=mechanism, one_way_s=one_way_s)
    made: list[str] = []
    try:
        for ns in (pair.server_ns, pair.client_ns):
            _run("ip", "netns", "add", ns)
            made.append(ns)
        _run("ip", "link", "add", pair.server_dev, "netns", pair.server_ns, "type", "veth",
             "peer", "name", pair.client_dev, "netns", pair.client_ns)
        for ns, dev, ip in ((pair.server_ns, pair.server_dev, pair.server_ip),
                            (pair.client_ns, pair.client_dev, pair.client_ip)):
            _run("ip", "addr", "add", f"{ip}/24", "dev", dev, ns=ns)
            _run("ip", "link", "set", dev, "up", ns=ns)
            _run("ip", "link", "set", "lo", "up", ns=ns)
            if mechanism == "netem" and one_way_s > 0:
                _run("tc", "qdisc", "add", "dev", dev, "root", "netem", "delay",
                     f"{one_way_s * 1000:g}ms", ns=ns)
        yield pair
    finally:
        pair.close()
        for ns in made:
            _run("ip", "netns", "del", ns, check=False)


@contextlib.contextmanager
def net_pair(mechanism: str, rtt_s: float) -> Iterator[NetPair]:
    """A fresh pair with ``rtt_s`` of round-trip delay added (half each way)."""
    with _pair(mechanism=mechanism, one_way_s=rtt_s / 2) as pair:
        yield pair


@dataclass
class NsServer:
    """A difftape server in the pair's server namespace."""

    url: str  # as the client namespace reaches it
    token: str
    user: str
    data_dir: Path
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def requests(self, user: str | None = None) -> int:
        """Requests the server has answered for ``user`` (its JSON access log): the round
        trips a client made, counted where they arrive."""
        import json

        n = 0
        for line in self.log().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    if json.loads(line).get("user") == (user or self.user):
                        n += 1
        return n

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(pair: NetPair, data_dir: Path, user: str = "net", **settings) -> NsServer:
    """``python -m difftape.server`` inside the server namespace, listening on its veth
    address (and loopback, for a relay); ready when the client namespace gets 200 from
    /readyz through the (delayed) path."""
    from difftape.server.db import Database

    data_dir.mkdir(parents=True, exist_ok=True)
    db = Database(data_dir / "difftape.sqlite3")
    token = db.create_user(user)
    db.close()
    port = 8000
    env = {**os.environ, "DIFFTAPE_ALLOWED_HOSTS": f"{pair.server_ip},127.0.0.1",
           "DIFFTAPE_WORKER_THREADS": "2", "DIFFTAPE_ACCESS_LOG": "true"}
    env.update({f"DIFFTAPE_{k.upper()}": str(v) for k, v in settings.items()})
    for k in ("DIFFTAPE_ARCH", "TI_ARCH"):
        env.pop(k, None)
    log_path = data_dir / "server.log"
    logf = open(log_path, "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(pair.in_server(
        [sys.executable, "-m", "difftape.server", "--host", "0.0.0.0", "--port", str(port),
         "--data-dir", str(data_dir), "--log-level", "warning"]), env=env, stdout=logf,
        stderr=subprocess.STDOUT, cwd=REPO)
    front = pair.expose(port)
    url = f"http://{pair.server_ip}:{front}"
    server = NsServer(url, token, user, data_dir, proc, log_path)
    wait = ("import sys, time, httpx\n"
            "deadline = time.monotonic() + 120\n"
            "while time.monotonic() < deadline:\n"
            "    try:\n"
            "        if httpx.get(sys.argv[1] + '/readyz', timeout=2).status_code == 200:\n"
            "            sys.exit(0)\n"
            "    except httpx.HTTPError:\n"
            "        pass\n"
            "    time.sleep(0.1)\n"
            "sys.exit(1)\n")
    out = subprocess.run(pair.in_client([sys.executable, "-c", wait, url]), timeout=150)
    if out.returncode != 0 or proc.poll() is not None:
        server.stop()
        raise RuntimeError(f"the server in {pair.server_ns} did not become ready:\n"
                           f"{server.log()[-3000:]}")
    return server


def client_env(server: NsServer, **extra: str) -> dict[str, str]:
    """The environment that runs an unchanged program on ``server``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TI_ARCH",)}
    env.update(DIFFTAPE_ARCH="remote", DIFFTAPE_SERVER=server.url, DIFFTAPE_TOKEN=server.token)
    env.update(extra)
    return env


def measure_rtt(pair: NetPair, url: str, n: int = 5) -> float:
    """The median time of ``GET /livez`` from the client namespace over one kept-alive
    connection: the round trip the client sees, plus the server's (tiny) handling."""
    code = ("import statistics, sys, time, httpx\n"
            "c = httpx.Client()\n"
            "c.get(sys.argv[1] + '/livez')\n"
            "ts = []\n"
            "for _ in range(int(sys.argv[2])):\n"
            "    t0 = time.perf_counter(); c.get(sys.argv[1] + '/livez')\n"
            "    ts.append(time.perf_counter() - t0)\n"
            "print(statistics.median(ts))\n")
    out = subprocess.run(pair.in_client([sys.executable, "-c", code, url, str(n)]),
                         capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip())


RUNNER = """
import json, runpy, sys, time
import difftape
from difftape.runtime import program
mod = runpy.run_path(sys.argv[1], run_name="example")
args = json.loads(sys.argv[2])
t0 = time.perf_counter()
mod["main"](args) if isinstance(args, list) else mod["main"](**args)
difftape.sync()
elapsed = time.perf_counter() - t0
remote = program.get().remote is not None
difftape.reset()  # the session's deletion is part of the run (and of its round trips)
print("RESULT " + json.dumps({"elapsed": elapsed, "remote": remote}))
"""


def run_example(pair: NetPair, server: NsServer | None, path: str, args,
                timeout: float = 600) -> dict:
    """Run an examples/ program's ``main`` (``args``: a list is its argv, a dict its keyword
    arguments) in the client namespace, unchanged: on ``server`` through the environment,
    or locally (``DIFFTAPE_ARCH=cpu``) without one. Its time around ``main``, its round
    trips (requests the server answered for the run's user) and its output."""
    import json

    env = client_env(server) if server is not None else {**os.environ, "DIFFTAPE_ARCH": "cpu"}
    before = server.requests() if server is not None else 0
    out = subprocess.run(pair.in_client([sys.executable, "-c", RUNNER, str(REPO / path),
                                         json.dumps(args)]),
                         capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"{path} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    lines = out.stdout.splitlines()
    result = json.loads(lines[-1].removeprefix("RESULT "))
    if result["remote"] != (server is not None):
        raise RuntimeError(f"{path} ran {'remotely' if result['remote'] else 'locally'}")
    result["output"] = "\n".join(lines[:-1])
    result["round_trips"] = server.requests() - before if server is not None else 0
    return result


__all__ = ["RUNNER", "NetPair", "NsServer", "client_env", "measure_rtt", "net_pair",
           "run_example", "start_server", "unavailable"]


if __name__ == "__main__":  # what this machine allows
    for m in ("netem", "relay"):
        print(m, unavailable(m) or "available")
