"""A captured graph replayed on the server vs the same step run eagerly through the client,
over a link with a round-trip delay (issue 20, item 4).

The step is bench/graph.py's DiffTaichi-style MPM optimisation iteration (zero the grid, a
``ti.ad.Tape`` over the rollout, back-propagation, a gradient step as a kernel), followed by
a read of the loss, as an optimisation loop reads it. Eagerly through the client the ~380
launches of an iteration travel as one batch of launch ops (JSON), each run by the engine
from Python; captured (``ti.graph.capture()``, unchanged code) the graph goes to the server
once and each iteration is one small ``graph_replay`` request replayed natively there (the
loss rides back with it, read ahead). Both go through ``tests/service/delay_relay.py``
(``--rtt-ms`` added to each round trip: half each way) to a real server
(``python -m difftape.server``); the local replay is the reference of the issue's bar
(through a server, the replayed iteration <= 1.05x the local one). Rows: ms per iteration
and requests per iteration; the losses of the three runs must agree bit for bit (the local
run is compiled with ``check_out_of_bound=True``, as the server compiles, and all run on one
thread: the grid transfer adds floats atomically).

``python bench/service_graph.py [--rtt-ms 20] [--iterations 10]``
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common
import diffmpm
from service_mpm import Server, _free_port

NAME = "service_graph"
RELAY = Path(__file__).resolve().parents[1] / "tests" / "service" / "delay_relay.py"


def _iteration(ti):
    m = diffmpm.build(ti)
    m.start()
    return m, m.device_iteration


def _measure(ti, mode: str, iterations: int, remote: bool) -> dict[str, Any]:
    """Seconds and requests per iteration (loss read each time), and the losses."""
    m, step = _iteration(ti)
    run = step
    if mode == "replayed":
        with ti.graph.capture() as g:
            step()
        run = g.replay
    run()  # compiles (and, replayed remotely, sends the graph)
    losses = [float(m.loss.to_numpy())]
    stats = ti.remote_stats if remote else (lambda: {"round_trips": 0})
    trips0 = stats()["round_trips"]
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        run()
        losses.append(float(m.loss.to_numpy()))
        times.append(time.perf_counter() - t0)
    return {"s": statistics.median(times),
            "requests": (stats()["round_trips"] - trips0) / iterations, "losses": losses}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.backend != "difftape":
        raise common.Unsupported("the service is difftape's")
    ti = common.load_backend("difftape")
    server = Server(env={"DIFFTAPE_WORKER_THREADS": "1"})
    port = _free_port()
    relay = subprocess.Popen([sys.executable, str(RELAY), "--listen", f"127.0.0.1:{port}",
                              "--to", f"127.0.0.1:{server.port}",
                              "--delay", str(args.rtt_ms / 2000)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert relay.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}"
        out = {}
        ti.init(arch=ti.cpu, check_out_of_bound=True, cpu_max_num_threads=1)
        out["local replayed"] = _measure(ti, "replayed", args.iterations, False)
        ti.reset()
        for mode in ("eager", "replayed"):
            ti.init(arch=ti.remote, server=url, token=server.token)
            out[f"remote {mode}"] = _measure(ti, mode, args.iterations, True)
            ti.reset()
    finally:
        relay.kill()
        relay.wait()
        server.stop()
    same = len({tuple(r["losses"]) for r in out.values()}) == 1
    if not same:
        raise RuntimeError(f"the runs disagree: {[r['losses'][:3] for r in out.values()]}")
    rows = []
    for label, r in out.items():
        rows.append({"label": f"{NAME}: MPM iteration, {label}", "value": r["s"] * 1e3,
                     "unit": "ms"})
    for label in ("remote eager", "remote replayed"):
        rows.append({"label": f"{NAME}: requests per iteration, {label}",
                     "value": out[label]["requests"], "unit": ""})
    ratio = out["remote replayed"]["s"] / out["local replayed"]["s"]
    rows.append({"label": f"{NAME}: remote replayed / local replayed (bar 1.05)",
                 "value": ratio, "unit": "x"})
    notes = (f"{args.rtt_ms:g} ms added round trip (delay relay); remote eager / remote "
             f"replayed {out['remote eager']['s'] / out['remote replayed']['s']:.2f}x; "
             f"losses equal bit for bit over {args.iterations + 1} iterations")
    return common.result(NAME, args.backend, rows=rows, notes=notes, rtt_ms=args.rtt_ms,
                         runs={k: {"s": v["s"], "requests": v["requests"]}
                               for k, v in out.items()})


if __name__ == "__main__":
    p = common.parser(__doc__.splitlines()[0], repeat=1)
    p.add_argument("--rtt-ms", type=float, default=20.0, help="added round trip, ms")
    p.add_argument("--iterations", type=int, default=10)
    ns = p.parse_args()
    ns.backend = "difftape" if "--backend" not in sys.argv else ns.backend
    sys.exit(common.main(NAME, run, ns))
