"""The difftape service on loopback: one diffmpm optimisation iteration through the client
vs the same iteration run locally, and a 4 MB field upload + download.

Starts a real server (``python -m difftape.server``, its own data dir and token) and runs
``bench/diffmpm.py``'s program unchanged three times in this process: locally
(``ti.init(arch=ti.cpu)``), locally with bounds checks (``debug=True``, what the server
compiles, to separate the cost of the checks from the cost of the wire), and through the
client (``ti.init(arch=ti.remote)``), where each iteration's ~380 launches (forward and
backward of a 64-step Tape) travel as one batch request. The three modes run in rounds;
the ratio is the median over rounds of (client / local) within a round.
"""

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import diffmpm
import numpy as np

NAME = "service_mpm"
TRANSFER_FLOATS = 1 << 20  # 4 MiB of f32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m difftape.server`` on a free loopback port with a fresh data dir."""

    def __init__(self, env: dict[str, str] | None = None, users: int = 1) -> None:
        """``env``: extra DIFFTAPE_* settings (e.g. DIFFTAPE_CLUSTER); ``users``: how many
        users (``tokens``, one each; ``token`` is the first's). Concurrent clients are
        several users, as in a lab: one user's sessions are capped by its quota."""
        import httpx

        from difftape.server.db import Database
        from difftape.server.settings import Settings

        self.data_dir = Path(tempfile.mkdtemp(prefix="bench-service-"))
        settings = Settings(data_dir=self.data_dir)
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        db = Database(settings.db_path)
        self.tokens = [db.create_user("bench" if i == 0 else f"bench{i}")
                       for i in range(users)]
        self.token = self.tokens[0]
        db.close()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.data_dir / "server.log", "wb")  # noqa: SIM115
        # No spare workers: a spare started in the background (a Python start-up and an LLVM
        # initialisation) would compete for the CPU with the measurements.
        env = {**os.environ, "DIFFTAPE_SPARE_WORKERS": "0", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "difftape.server", "--port", str(self.port), "--data-dir",
             str(self.data_dir), "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited: "
                                   + (self.data_dir / "server.log").read_text()[-2000:])
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def _transfer(ti, repeat: int) -> common.Timing:
    """Upload then download one 4 MiB f32 field (``from_numpy`` + ``to_numpy``)."""
    x = ti.field(ti.f32, shape=TRANSFER_FLOATS)
    a = np.random.default_rng(0).random(TRANSFER_FLOATS, dtype=np.float32)

    def roundtrip() -> None:
        x.from_numpy(a)
        roundtrip.last = x.to_numpy()

    t = common.time_it(roundtrip, repeat=repeat, warmup=3, sync=ti.sync)
    # checked outside the clock: comparing 4 MiB twice over is not part of the transfer
    assert roundtrip.last.tobytes() == a.tobytes()
    return t


def _launch_overhead(ti, repeat: int) -> common.Timing:
    """380 launches of a near-empty kernel and a sync: what the service adds per MPM
    iteration beyond the kernels' own work (client, HTTP, gateway, worker, engine)."""
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def tiny(i: ti.i32):
        x[i % 4] += 1.0

    def batch() -> None:
        for i in range(380):
            tiny(i)

    return common.time_it(batch, repeat=repeat, warmup=3, sync=ti.sync)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.backend != "difftape":
        raise common.Unsupported("the service is difftape's")
    ti = common.load_backend("difftape")
    cache_dir = tempfile.mkdtemp(prefix="bench-service-cache-")
    os.environ[common.DIFFTAPE_CACHE_ENV] = cache_dir
    server = Server()
    runs: dict[str, list[dict]] = {"local": [], "local_checked": [], "remote": []}
    try:
        # Rounds of the three modes, so that a change in machine load between modes shows up
        # as spread across rounds instead of as a bias in the ratio.
        for _ in range(max(1, args.rounds)):
            for mode in runs:
                if mode == "remote":
                    ti.init(arch=ti.remote, server=server.url, token=server.token)
                else:
                    ti.init(arch=ti.cpu, debug=mode == "local_checked")
                runs[mode].append(diffmpm.measure(ti, args))
                ti.reset()
        ti.init(arch=ti.remote, server=server.url, token=server.token)
        transfer = _transfer(ti, args.transfer_repeat)
        launches_remote = _launch_overhead(ti, args.transfer_repeat)
        ti.reset()
        ti.init(arch=ti.cpu)
        launches_local = _launch_overhead(ti, args.transfer_repeat)
        ti.reset()
    finally:
        server.stop()
        shutil.rmtree(cache_dir, ignore_errors=True)
    med = {m: statistics.median(r["iteration_s"] for r in rs) for m, rs in runs.items()}
    local, checked, remote = med["local"], med["local_checked"], med["remote"]
    ratios = [r["iteration_s"] / lo["iteration_s"] for r, lo in zip(runs["remote"],
                                                                    runs["local"], strict=True)]
    ratio = statistics.median(ratios)
    out = {m: rs[0] for m, rs in runs.items()}
    rows = [
        {"label": f"{NAME}: iteration, local", "value": local * 1e3, "unit": "ms"},
        {"label": f"{NAME}: iteration, local debug=True", "value": checked * 1e3,
         "unit": "ms"},
        {"label": f"{NAME}: iteration, through the client", "value": remote * 1e3,
         "unit": "ms"},
        {"label": f"{NAME}: ratio client/local (bar 1.3)", "value": ratio, "unit": "x"},
        {"label": f"{NAME}: 4 MiB upload + download (bar 20 ms)",
         "value": transfer.median * 1e3, "unit": "ms"},
        {"label": f"{NAME}: 380 tiny launches + sync, local", "value":
         launches_local.median * 1e3, "unit": "ms"},
        {"label": f"{NAME}: 380 tiny launches + sync, through the client", "value":
         launches_remote.median * 1e3, "unit": "ms"},
    ]
    notes = (f"client/local {ratio:.2f}x (per round: "
             f"{', '.join(f'{x:.2f}' for x in ratios)}), "
             f"client/local-checked {remote / checked:.2f}x; "
             f"loss local {out['local']['loss']:.6f} remote {out['remote']['loss']:.6f}; "
             f"grad local {out['local']['grad']} remote {out['remote']['grad']}; "
             f"first iteration (cold compile) local {out['local']['first_iteration_s']:.2f} s, "
             f"remote {out['remote']['first_iteration_s']:.2f} s")
    return common.result(NAME, args.backend, seconds=remote, rows=rows, notes=notes,
                         iteration_local_s=local, iteration_local_checked_s=checked,
                         iteration_remote_s=remote, ratio=ratio, ratios=ratios,
                         transfer_4mib_s=transfer.median, transfer_timing=transfer.as_dict(),
                         launches_380_local_s=launches_local.median,
                         launches_380_remote_s=launches_remote.median,
                         runs={m: [{k: v for k, v in r.items() if k != "rows"} for r in rs]
                               for m, rs in runs.items()})


if __name__ == "__main__":
    p = common.parser(__doc__.splitlines()[0], repeat=7)
    p.add_argument("--transfer-repeat", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="rounds of local/checked/remote")
    ns = p.parse_args()
    ns.backend = "difftape" if "--backend" not in sys.argv else ns.backend
    sys.exit(common.main(NAME, run, ns))
