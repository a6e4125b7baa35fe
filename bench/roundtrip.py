"""What one round trip to the difftape service costs, against the floor HTTP itself sets.

In the same run, on loopback, with one ``httpx.Client`` per server over a kept-alive
connection:

* **floor**: a minimal ASGI application (it answers ``ok``) served by uvicorn exactly as
  ``difftape serve`` serves the gateway (same loop and HTTP implementations), called with a
  POST carrying the same JSON body a launch + read sends;
* **difftape**: one kernel launch followed by a scalar read (``k(); x[None]``) through the
  real client (``ti.init(arch=ti.remote)``), i.e. one ``/batch`` request with the launch and
  the item read, through the gateway and the session's worker process.

Requests alternate between the two so that a change in machine load hits both; the load
average is printed with the figures (this machine has 2 cores shared with other work, so
repeat and compare runs made at similar load). The goal (issue 18): difftape p50 <= 1.5x
the floor's p50.

    .venv/bin/python bench/roundtrip.py                  # 5 rounds x 400 requests each
    .venv/bin/python bench/roundtrip.py --rounds 3 --n 200 --json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


async def minimal_app(scope, receive, send) -> None:
    """The floor: read the body, answer ``ok``."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, path: str) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"{url} did not come up")


def start_minimal() -> tuple[subprocess.Popen, str]:
    port = free_port()
    code = ("import sys, uvicorn; sys.path.insert(0, sys.argv[2]); import roundtrip; "
            "uvicorn.run(roundtrip.minimal_app, host='127.0.0.1', port=int(sys.argv[1]), "
            "log_level='warning', access_log=False)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(port), str(REPO / "bench")])
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc, "/")
    return proc, url


def start_difftape(data_dir: Path, server_path: str | None = None
                   ) -> tuple[subprocess.Popen, str, str]:
    """A server as deployed (access log on, its default), with a token. ``server_path``: a
    folder holding another ``difftape`` package to serve (an older version, to compare)."""
    token = subprocess.run([sys.executable, "-m", "difftape.cli", "token", "create", "bench",
                            "--data-dir", str(data_dir)], check=True, capture_output=True,
                           text=True).stdout.strip()
    port = free_port()
    env = dict(os.environ, DIFFTAPE_WORKER_THREADS="1")
    if server_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [server_path,
                                                          env.get("PYTHONPATH")]))
    log = open(data_dir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen([sys.executable, "-m", "difftape.server", "--port", str(port),
                             "--data-dir", str(data_dir)], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc, "/readyz")
    return proc, url, token


def newton_solve(repeats: int, server_pid: int | None = None, **init) -> dict:
    """examples/newton.py's Newton solve (not its gradient-descent comparison), timed after
    one warm-up solve (compilation), ``repeats`` times; median seconds and round trips."""
    import difftape as ti

    sys.path.insert(0, str(REPO / "examples"))
    import newton

    ti.init(default_fp=ti.f64, **init)
    try:
        x, energy, run, start = newton.build()
        start()
        newton.newton(x, energy, run)
        if server_pid is not None:
            settle(server_pid)
        times, trips = [], []
        for _ in range(repeats):
            start()
            ti.sync()
            s0 = ti.remote_stats()["round_trips"]
            t0 = time.perf_counter()
            iters = newton.newton(x, energy, run)
            rest = x.to_numpy()
            times.append(time.perf_counter() - t0)
            trips.append(ti.remote_stats()["round_trips"] - s0)
        return {"median_s": float(np.median(times)), "iterations": iters,
                "round_trips": trips[-1], "rest": rest}
    finally:
        ti.reset()


def cpu_seconds(root: int) -> dict[int, float]:
    """CPU seconds (user + system) of ``root`` and its descendants, by pid (/proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            stats[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid][1]
            todo += [c for c, (ppid, _) in stats.items() if ppid == pid]
    return out


def settle(root: int, timeout: float = 60.0) -> None:
    """Wait until the server's processes are idle (the spare worker the gateway starts
    after a session takes one loads LLVM for a second or so: not part of any request)."""
    deadline = time.monotonic() + timeout
    last = cpu_seconds(root)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = cpu_seconds(root)
        if cpu_delta(last, now) < 0.02 and now.keys() == last.keys():
            return
        last = now


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


def percentiles(samples: list[float]) -> dict:
    a = np.array(samples) * 1e3
    return {"p50_ms": round(float(np.percentile(a, 50)), 3),
            "p90_ms": round(float(np.percentile(a, 90)), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=400, help="requests per round and server")
    ap.add_argument("--newton", type=int, default=5,
                    help="timed Newton solves each way (0: skip)")
    ap.add_argument("--server-path", help="serve the difftape package found in this folder "
                    "(e.g. an older version assembled as <dir>/difftape with its server/ and "
                    "client/ inside) instead of this checkout's")
    ap.add_argument("--json", action="store_true", help="print one JSON line at the end")
    args = ap.parse_args()

    import httpx

    import difftape as ti

    tmp = Path(tempfile.mkdtemp(prefix="difftape-roundtrip-"))
    procs = []
    try:
        mproc, murl = start_minimal()
        procs.append(mproc)
        dproc, durl, token = start_difftape(tmp, args.server_path)
        procs.append(dproc)

        ti.init(arch=ti.remote, server=durl, token=token)
        x = ti.field(ti.f32, shape=())

        @ti.kernel
        def step():
            x[None] += 1.0

        step()
        assert x[None] == 1.0
        # The body a launch + read sends, for the floor's POST.
        rt_obj = __import__("difftape.runtime.program", fromlist=["get"]).get().remote
        body = json.dumps({"ops": [
            {"op": "launch", "kernel_id": next(iter(rt_obj._kernels.values())).kid,
             "variant": "primal", "args": []},
            {"op": "get_item", "id": x.id, "role": "primal", "index": []}]},
            separators=(",", ":")).encode()
        settle(dproc.pid)
        floor = httpx.Client(base_url=murl, headers={"Authorization": "Bearer x" * 8})
        for _ in range(50):  # warm both connections
            floor.post("/", content=body, headers={"Content-Type": "application/json"})
            step()
            _ = x[None]

        f_all: list[float] = []
        d_all: list[float] = []
        f_cpu = d_cpu = 0.0  # this process's CPU time in each kind of request
        cpu0 = (cpu_seconds(mproc.pid), cpu_seconds(dproc.pid))
        rounds = []
        expected = float(x[None])
        before = ti.remote_stats()
        for r in range(args.rounds):
            load = os.getloadavg()[0]
            fs, ds = [], []
            for _ in range(args.n):  # interleaved, so that both see the same load
                c0 = time.process_time()
                t0 = time.perf_counter()
                floor.post("/", content=body, headers={"Content-Type": "application/json"})
                t1 = time.perf_counter()
                c1 = time.process_time()
                step()
                v = x[None]
                t2 = time.perf_counter()
                c2 = time.process_time()
                fs.append(t1 - t0)
                ds.append(t2 - t1)
                f_cpu += c1 - c0
                d_cpu += c2 - c1
                expected += 1.0
                assert v == expected, (v, expected)
            f_all += fs
            d_all += ds
            fp, dp = percentiles(fs), percentiles(ds)
            rounds.append({"round": r + 1, "load1": round(load, 2), "floor": fp, "difftape": dp,
                           "ratio_p50": round(dp["p50_ms"] / fp["p50_ms"], 2)})
            if not args.json:
                print(f"round {r + 1}: load {load:.2f}  floor p50 {fp['p50_ms']:.3f} ms "
                      f"p90 {fp['p90_ms']:.3f} ms | launch+read p50 {dp['p50_ms']:.3f} ms "
                      f"p90 {dp['p90_ms']:.3f} ms | ratio p50 {rounds[-1]['ratio_p50']:.2f}",
                      flush=True)
        after = ti.remote_stats()
        total = args.rounds * args.n
        srv_f = cpu_delta(cpu0[0], cpu_seconds(mproc.pid)) / total
        srv_d = cpu_delta(cpu0[1], cpu_seconds(dproc.pid)) / total
        # CPU per request hardly depends on the load: the figure to compare across runs.
        cpu = {"floor_us": round((f_cpu / total + srv_f) * 1e6, 1),
               "difftape_us": round((d_cpu / total + srv_d) * 1e6, 1),
               "floor_server_us": round(srv_f * 1e6, 1),
               "difftape_server_us": round(srv_d * 1e6, 1)}
        cpu["ratio"] = round(cpu["difftape_us"] / cpu["floor_us"], 2)
        trips = after["round_trips"] - before["round_trips"]
        fp, dp = percentiles(f_all), percentiles(d_all)
        res = {"rounds": rounds, "floor": fp, "difftape": dp, "cpu_per_request": cpu,
               "ratio_p50": round(dp["p50_ms"] / fp["p50_ms"], 2),
               "ratio_p90": round(dp["p90_ms"] / fp["p90_ms"], 2),
               "round_trips_per_launch_read": trips / (args.rounds * args.n),
               "load1_end": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
        floor.close()
        ti.reset()
        if args.newton:
            load = os.getloadavg()[0]
            local = newton_solve(args.newton, arch=ti.cpu)
            there = newton_solve(args.newton, dproc.pid, arch=ti.remote, server=durl,
                                 token=token)
            local2 = newton_solve(args.newton, arch=ti.cpu)
            base = min(local["median_s"], local2["median_s"])
            res["newton"] = {
                "load1": round(load, 2), "local_s": round(base, 4),
                "remote_s": round(there["median_s"], 4),
                "ratio": round(there["median_s"] / base, 2),
                "iterations": there["iterations"], "round_trips": there["round_trips"],
                "same_rest_shape": bool(np.array_equal(local["rest"], there["rest"]))}
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    if args.json:
        print(json.dumps(res))
    else:
        print(f"all: floor p50 {fp['p50_ms']:.3f} ms p90 {fp['p90_ms']:.3f} ms | launch+read "
              f"p50 {dp['p50_ms']:.3f} ms p90 {dp['p90_ms']:.3f} ms | ratio p50 "
              f"{res['ratio_p50']:.2f} p90 {res['ratio_p90']:.2f} | "
              f"{res['round_trips_per_launch_read']:.2f} round trips each | load "
              f"{res['load1_end']} on {res['cpus']} cpus")
        c = res["cpu_per_request"]
        print(f"CPU per request (client + server processes): floor {c['floor_us']:.0f} us "
              f"(server {c['floor_server_us']:.0f}), launch+read {c['difftape_us']:.0f} us "
              f"(server: gateway + worker {c['difftape_server_us']:.0f}), ratio {c['ratio']:.2f}")
        if "newton" in res:
            nw = res["newton"]
            print(f"newton ({nw['iterations']} iterations): local {nw['local_s'] * 1e3:.1f} ms, "
                  f"remote {nw['remote_s'] * 1e3:.1f} ms in {nw['round_trips']} round trips, "
                  f"ratio {nw['ratio']:.2f} (same result: {nw['same_rest_shape']}; load "
                  f"{nw['load1']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
