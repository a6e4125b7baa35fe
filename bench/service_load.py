"""Load test of the difftape service: N concurrent clients x M kernel launches each.

Each client has its own session (so its own worker process), registers one kernel and
launches it M times, one request at a time, over one keep-alive connection. The figure of
merit is the latency of a launch request (HTTP + gateway + worker pipe + kernel) under
contention, and that no request fails. By default a server is started on a free loopback
port with a fresh data dir; ``--url`` and ``--token`` point at a running one instead.

    .venv/bin/python bench/service_load.py                 # 20 clients x 200 launches
    .venv/bin/python bench/service_load.py --clients 4 --launches 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np


def kernel_ir() -> tuple[list[dict], dict]:
    """Field-creation ops and the IR of ``y = 2 x`` over 1024 floats, built by the local
    frontend exactly as a client would."""
    import difftape as ti
    from difftape.ir import serialize
    from difftape.runtime import program

    ti.init(arch=ti.cpu)
    x = ti.field(ti.f32, shape=1024)
    y = ti.field(ti.f32, shape=1024)

    @ti.kernel
    def double():
        for i in x:
            y[i] = 2.0 * x[i]

    ops = [{"op": "create_field", "id": f.id, "dtype": "f32", "shape": [1024]} for f in (x, y)]
    return ops, serialize.encode(double.build_ir(program.get(), ()))


def start_server(data_dir: Path) -> tuple[subprocess.Popen, str, str]:
    token = subprocess.run([sys.executable, "-m", "difftape.cli", "token", "create", "load",
                            "--data-dir", str(data_dir)], check=True, capture_output=True,
                           text=True).stdout.strip()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DIFFTAPE_WORKER_THREADS="1", DIFFTAPE_QUOTA_SESSIONS="1000",
               DIFFTAPE_SPARE_WORKERS="2")
    proc = subprocess.Popen([sys.executable, "-m", "difftape.server", "--port", str(port),
                             "--data-dir", str(data_dir), "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz").status_code == 200:
                return proc, url, token
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not become ready")


async def one_client(url: str, token: str, ops: list[dict], ir: dict, launches: int,
                     latencies: list[float], errors: list[str]) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:
        r = await c.post("/v1/sessions", json={})
        if r.status_code != 201:
            errors.append(f"create session: {r.status_code} {r.text[:200]}")
            return
        sid = r.json()["session_id"]
        try:
            r = await c.post(f"/v1/sessions/{sid}/batch",
                             json={"ops": ops + [{"op": "register", "ir": ir}]})
            if r.status_code != 200:
                errors.append(f"setup: {r.status_code} {r.text[:200]}")
                return
            kid = r.json()["results"][-1]["kernel_id"]
            x = np.arange(1024, dtype=np.float32)
            r = await c.put(f"/v1/sessions/{sid}/fields/{ops[0]['id']}/data",
                            content=x.tobytes(),
                            headers={"Content-Type": "application/octet-stream",
                                     "X-Dtype": "float32", "X-Shape": "1024"})
            if r.status_code != 204:
                errors.append(f"upload: {r.status_code} {r.text[:200]}")
            path = f"/v1/sessions/{sid}/kernels/{kid}/launch"
            for _ in range(launches):
                t0 = time.perf_counter()
                try:
                    r = await c.post(path, json={"variant": "primal", "args": []})
                except httpx.HTTPError as e:
                    errors.append(f"launch: {type(e).__name__}: {e}")
                    continue
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors.append(f"launch: {r.status_code} {r.text[:200]}")
            r = await c.get(f"/v1/sessions/{sid}/fields/{ops[1]['id']}/data",
                            headers={"Accept": "application/octet-stream"})
            if not np.array_equal(np.frombuffer(r.content, np.float32), 2 * x):
                errors.append("wrong result")
        finally:
            await c.delete(f"/v1/sessions/{sid}")


async def run(url: str, token: str, clients: int, launches: int) -> dict:
    ops, ir = kernel_ir()
    latencies: list[float] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(one_client(url, token, ops, ir, launches, latencies, errors)
                           for _ in range(clients)))
    wall = time.perf_counter() - t0
    lat = np.array(latencies) * 1e3
    return {"clients": clients, "launches_per_client": launches, "requests": len(latencies),
            "errors": len(errors), "first_errors": errors[:5], "wall_s": round(wall, 2),
            "p50_ms": round(float(np.percentile(lat, 50)), 3) if len(lat) else None,
            "p99_ms": round(float(np.percentile(lat, 99)), 3) if len(lat) else None,
            "max_ms": round(float(lat.max()), 3) if len(lat) else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--url")
    ap.add_argument("--token")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    proc = None
    if args.url:
        url, token = args.url, args.token
    else:
        tmp = tempfile.mkdtemp(prefix="difftape-load-")
        proc, url, token = start_server(Path(tmp))
    try:
        res = asyncio.run(run(url, token, args.clients, args.launches))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['clients']} clients x {res['launches_per_client']} launches: "
              f"{res['requests']} requests in {res['wall_s']} s, {res['errors']} errors; "
              f"latency p50 {res['p50_ms']} ms, p99 {res['p99_ms']} ms, max {res['max_ms']} ms")
        for e in res["first_errors"]:
            print("  error:", e)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
