"""The examples/ programs through the service over a real network with added delay.

The server runs in one network namespace and each program in another, joined by a veth pair
(tests/service/netns.py); the round trip gets ``--rtt-ms`` of delay added (tc netem where the
kernel has it, else a delaying TCP relay: the output names which). Each program runs
unchanged: locally (``DIFFTAPE_ARCH=cpu``) and remotely (``DIFFTAPE_ARCH=remote`` with
``DIFFTAPE_SERVER``/``DIFFTAPE_TOKEN``), each timed around its ``main()`` in a process that
has imported difftape already, after one untimed run that fills both compile caches. Round
trips are the requests the server answered for the run's user (its access log): session
creation and deletion included.

Needs root (network namespaces). ``python bench/service_net.py [--rtt-ms 0 20] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.service import netns  # noqa: E402

#: name -> (file, how main() is called: a list is argv, a dict keyword arguments)
EXAMPLES = {
    "newton": ("examples/newton.py", {}),
    "checkpointing": ("examples/checkpointing.py", []),
}
QUICK = {
    "newton": ("examples/newton.py", {"n_free": 4}),
    "checkpointing": ("examples/checkpointing.py", ["--n", "256", "--steps", "64", "--k", "8"]),
}

def measure(rtts_ms: list[float], examples: dict, mechanism: str, timeout: float) -> dict:
    rows: dict[str, dict] = {name: {} for name in examples}
    for rtt_ms in rtts_ms:
        with netns.net_pair(mechanism, rtt_ms / 1000) as pair:
            data = Path(tempfile.mkdtemp(prefix="bench-net-"))
            server = netns.start_server(pair, data / "server", spare_workers=0)
            try:
                measured = netns.measure_rtt(pair, server.url)
                for name, (path, args) in examples.items():
                    row = rows[name]
                    if "local_s" not in row:
                        netns.run_example(pair, None, path, args, timeout)  # fills the cache
                        local = netns.run_example(pair, None, path, args, timeout)
                        row["local_s"] = local["elapsed"]
                    netns.run_example(pair, server, path, args, timeout)  # fills the server's
                    r = netns.run_example(pair, server, path, args, timeout)
                    row[rtt_ms] = {"remote_s": r["elapsed"], "round_trips": r["round_trips"],
                                   "ratio": r["elapsed"] / row["local_s"],
                                   "measured_rtt_ms": measured * 1000}
            finally:
                server.stop()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 20.0],
                   help="round-trip delays to add, in ms (default 0 20)")
    p.add_argument("--mechanism", choices=["auto", "netem", "relay"], default="auto",
                   help="how delay is added (auto: netem if the kernel has it)")
    p.add_argument("--quick", action="store_true", help="small problem sizes")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per program run")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = p.parse_args()
    mechanism = a.mechanism
    if mechanism == "auto":
        mechanism = "netem" if netns.unavailable("netem") is None else "relay"
    reason = netns.unavailable(mechanism)
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    note = "" if mechanism == "netem" else f" ({netns.unavailable('netem')})"
    rows = measure(a.rtt_ms, QUICK if a.quick else EXAMPLES, mechanism, a.timeout)
    if a.json:
        print(json.dumps({"mechanism": mechanism, "rows": rows}))
        return 0
    print(f"delay added by {mechanism}{note}; client and server in separate network "
          f"namespaces joined by a veth pair\n")
    head = "| example | local s |" + "".join(
        f" remote s @{r:g} ms | ratio | round trips |" for r in a.rtt_ms)
    print(head)
    print("|" + "---|" * (2 + 3 * len(a.rtt_ms)))
    for name, row in rows.items():
        cells = [f"{row[r]['remote_s']:.3f} | {row[r]['ratio']:.2f} | {row[r]['round_trips']}"
                 for r in a.rtt_ms]
        print(f"| {name} | {row['local_s']:.3f} | " + " | ".join(cells) + " |")
    print("\nmeasured round trip (GET /livez, median of 5): " + ", ".join(
        f"{r:g} ms added: {next(iter(rows.values()))[r]['measured_rtt_ms']:.1f} ms"
        for r in a.rtt_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
