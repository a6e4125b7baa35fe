"""The difftape service with sessions on a Ray cluster (``difftape serve --cluster``), on
loopback: a Ray-backed gateway against the local-worker gateway and the local runtime.

Starts Ray's own multi-node test cluster on this machine (``ray.cluster_utils.Cluster``: a
head with one CPU and two worker nodes, each its own raylet) and three gateways (one with
local worker processes, two whose sessions are Ray actors; every gateway is a driver on the
head), then measures in the same run:

* **MPM**: one diffmpm optimisation iteration (``bench/diffmpm.py``, ~380 launches as one
  batch) through the Ray-backed gateway vs the same iteration run locally; median over
  rounds of the per-round ratio (bar: <= 1.4x);
* **transfer**: a 4 MiB f32 field upload + download through the client, Ray-backed gateway
  vs local-worker gateway (bar: <= 2x), with the session's actor on the gateway's node (its
  sessions ask 0.1 CPU: they go there while it has room, and share its object store) and,
  for comparison, on another node (a gateway whose sessions ask 1.5 CPUs, more than the
  head has: every payload is copied between raylets);
* **load**: N concurrent clients (threads, one session each) x M launches of a small kernel
  through the Ray-backed gateway, raw HTTP: errors (bar: 0), p50/p99 latency, launches/s.

The load average is printed with the figures: this machine has 2 cores shared with other
work. ``--tiny`` runs every part at a token size (what bench/test_harnesses.py checks).

    .venv/bin/python bench/service_ray.py             # 20 clients x 200 launches
    .venv/bin/python bench/service_ray.py --tiny --json
"""

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# Read when ray is first imported: one machine, every Ray address on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import common  # noqa: E402
import diffmpm  # noqa: E402
import numpy as np  # noqa: E402
from service_mpm import TRANSFER_FLOATS, Server  # noqa: E402

NAME = "service_ray"
STORE = 100 * 2**20  # object store per node


#: CPUs of the head, the gateways' node: room for ten 0.1-CPU sessions, none of 1.5 CPUs.
HEAD_CPUS = 1
#: What a session of the across-nodes gateway asks: more than the head has.
REMOTE_SESSION_CPUS = 1.5


def start_cluster(cpus_per_node: int):
    """Ray's test cluster: a head with ``HEAD_CPUS`` (where the gateways run) and two worker
    nodes."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": HEAD_CPUS, "object_store_memory": STORE, "include_dashboard": False,
        "node_ip_address": "127.0.0.1"})
    for _ in range(2):
        cluster.add_node(num_cpus=cpus_per_node, object_store_memory=STORE,
                         node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    del ray
    return cluster


def _transfer(ti, repeat: int, n: int) -> common.Timing:
    x = ti.field(ti.f32, shape=n)
    a = np.random.default_rng(0).random(n, dtype=np.float32)

    def roundtrip() -> None:
        x.from_numpy(a)
        roundtrip.last = x.to_numpy()

    t = common.time_it(roundtrip, repeat=repeat, warmup=2, sync=ti.sync)
    assert roundtrip.last.tobytes() == a.tobytes()
    return t


def _load(server: Server, clients: int, launches: int) -> dict[str, Any]:
    """``clients`` threads, each a user of its own (``server.tokens``) with its own session,
    each launching a kernel that returns its argument doubled ``launches`` times (checked);
    latency per launch. A client whose session could not be set up counts one error and
    makes none of its launches (``done`` says how many were made)."""
    import httpx

    import difftape as ti
    from difftape.ir import serialize
    from difftape.runtime import program

    ti.init(arch=ti.cpu)

    @ti.kernel
    def twice(k: ti.i32) -> ti.i32:
        return 2 * k

    ir = serialize.encode(twice.build_ir(program.get(), ()))
    ti.reset()
    lat: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(i: int) -> None:
        mine, bad = [], []
        token = server.tokens[i % len(server.tokens)]
        with httpx.Client(base_url=server.url, timeout=300,
                          headers={"Authorization": f"Bearer {token}"}) as c:
            try:
                sid = c.post("/v1/sessions", json={}).raise_for_status().json()["session_id"]
                kid = c.post(f"/v1/sessions/{sid}/kernels",
                             json={"ir": ir}).raise_for_status().json()["kernel_id"]
            except httpx.HTTPError as e:
                bad.append(f"set-up: {e}")
                start.abort()
                with lock:
                    errors.extend(bad)
                return
            try:
                start.wait()
            except threading.BrokenBarrierError:
                pass
            for k in range(launches):
                t0 = time.perf_counter()
                r = c.post(f"/v1/sessions/{sid}/kernels/{kid}/launch",
                           json={"variant": "primal", "args": [k + i]})
                mine.append(time.perf_counter() - t0)
                if r.status_code != 200 or r.json()["result"] != 2 * (k + i):
                    bad.append(f"{r.status_code} {r.text[:200]}")
            c.delete(f"/v1/sessions/{sid}")
        with lock:
            lat.extend(mine)
            errors.extend(bad)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        list(ex.map(client, range(clients)))
    wall = time.perf_counter() - t0
    lat.sort()
    pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]) if lat else (lambda q: 0.0)
    return {"clients": clients, "launches": launches, "done": len(lat),
            "errors": len(errors),
            "first_errors": errors[:3], "p50_s": pick(0.50), "p99_s": pick(0.99),
            "launches_per_s": len(lat) / wall if wall else 0.0, "wall_s": wall}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.backend != "difftape":
        raise common.Unsupported("the service is difftape's")
    import ray

    ti = common.load_backend("difftape")
    t0 = time.perf_counter()
    cluster = start_cluster(cpus_per_node=max(2, args.clients))
    ray_start_s = time.perf_counter() - t0
    local_gw = ray_gw = remote_gw = None
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    try:
        local_gw = Server()
        # One user per load client, as in a lab: 20 clients of one user meet that user's
        # session quota (16 by default): 4 clients got 429 at set-up, made no launch.
        ray_gw = Server(users=args.clients, env={"DIFFTAPE_CLUSTER": cluster.address,
                             "DIFFTAPE_SESSION_CPUS": "0.1",
                             "DIFFTAPE_WORKER_THREADS": "1" if args.tiny else "0"})
        remote_gw = Server(env={"DIFFTAPE_CLUSTER": cluster.address,
                                "DIFFTAPE_SESSION_CPUS": str(REMOTE_SESSION_CPUS),
                                "DIFFTAPE_WORKER_THREADS": "1"})
        for _ in range(max(1, args.rounds)):
            for mode in runs:
                if mode == "ray":
                    ti.init(arch=ti.remote, server=ray_gw.url, token=ray_gw.token)
                else:
                    ti.init(arch=ti.cpu)
                runs[mode].append(diffmpm.measure(ti, args))
                ti.reset()
        n = 1024 if args.tiny else TRANSFER_FLOATS
        transfer = {}
        for mode, gw in (("local_worker", local_gw), ("ray", ray_gw),
                         ("ray_across_nodes", remote_gw)):
            ti.init(arch=ti.remote, server=gw.url, token=gw.token)
            transfer[mode] = _transfer(ti, args.transfer_repeat, n)
            ti.reset()
        load = _load(ray_gw, args.clients, args.launches)
    finally:
        for gw in (local_gw, ray_gw, remote_gw):
            if gw is not None:
                gw.stop()
        ray.shutdown()
        cluster.shutdown()
    ratios = [r["iteration_s"] / lo["iteration_s"]
              for r, lo in zip(runs["ray"], runs["local"], strict=True)]
    ratio = statistics.median(ratios)
    t_ratio = transfer["ray"].median / transfer["local_worker"].median
    t_across = transfer["ray_across_nodes"].median / transfer["local_worker"].median
    mb = n * 4 / 2**20
    load_avg = os.getloadavg()
    rows = [
        {"label": f"{NAME}: MPM iteration, local", "value":
         statistics.median(r["iteration_s"] for r in runs["local"]) * 1e3, "unit": "ms"},
        {"label": f"{NAME}: MPM iteration, Ray-backed gateway", "value":
         statistics.median(r["iteration_s"] for r in runs["ray"]) * 1e3, "unit": "ms"},
        {"label": f"{NAME}: ratio Ray/local (bar 1.4)", "value": ratio, "unit": "x"},
        {"label": f"{NAME}: {mb:g} MiB up+down, local-worker gateway", "value":
         transfer["local_worker"].median * 1e3, "unit": "ms"},
        {"label": f"{NAME}: {mb:g} MiB up+down, Ray-backed gateway, actor on its node",
         "value": transfer["ray"].median * 1e3, "unit": "ms"},
        {"label": f"{NAME}: transfer ratio Ray/local-worker (bar 2)", "value": t_ratio,
         "unit": "x"},
        {"label": f"{NAME}: {mb:g} MiB up+down, Ray-backed gateway, actor on another node",
         "value": transfer["ray_across_nodes"].median * 1e3, "unit": "ms"},
        {"label": f"{NAME}: transfer ratio across nodes/local-worker", "value": t_across,
         "unit": "x"},
        {"label": f"{NAME}: {args.clients} clients x {args.launches} launches, errors",
         "value": load["errors"], "unit": ""},
        {"label": f"{NAME}: launches made", "value": load["done"], "unit": ""},
        {"label": f"{NAME}: launch p50", "value": load["p50_s"] * 1e3, "unit": "ms"},
        {"label": f"{NAME}: launch p99", "value": load["p99_s"] * 1e3, "unit": "ms"},
        {"label": f"{NAME}: launches/s", "value": load["launches_per_s"], "unit": "/s"},
    ]
    notes = (f"Ray cluster start {ray_start_s:.1f} s; per-round MPM ratios "
             f"{', '.join(f'{x:.2f}' for x in ratios)}; load average "
             f"{load_avg[0]:.1f}/{load_avg[1]:.1f}/{load_avg[2]:.1f} on {os.cpu_count()} cores; "
             f"loss local {runs['local'][0]['loss']:.6f} ray {runs['ray'][0]['loss']:.6f}"
             + (f"; first errors: {load['first_errors']}" if load["errors"] else ""))
    return common.result(NAME, args.backend, seconds=statistics.median(
        r["iteration_s"] for r in runs["ray"]), rows=rows, notes=notes, ratio=ratio,
        ratios=ratios, transfer_ratio=t_ratio, transfer_across_nodes_ratio=t_across,
        transfer_mib=mb, transfer_local_worker_s=transfer["local_worker"].median,
        transfer_ray_s=transfer["ray"].median,
        transfer_ray_across_nodes_s=transfer["ray_across_nodes"].median, load=load,
        ray_start_s=ray_start_s, loadavg=list(load_avg))


if __name__ == "__main__":
    p = common.parser(__doc__.splitlines()[0], repeat=5)
    p.add_argument("--transfer-repeat", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="rounds of local/Ray MPM")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--launches", type=int, default=200)
    p.add_argument("--tiny", action="store_true", help="token sizes (the harness test)")
    ns = p.parse_args()
    ns.backend = "difftape" if "--backend" not in sys.argv else ns.backend
    if ns.tiny:
        ns.rounds, ns.repeat, ns.warmup, ns.transfer_repeat = 1, 1, 0, 2
        ns.clients, ns.launches = 2, 5
    sys.exit(common.main(NAME, run, ns))
