"""The client and the server over a real network (issue 18, item 3): separate network
namespaces joined by a veth pair, 10 ms added each way (20 ms round trip), made by the test
itself (see netns.py). Each examples/ program runs there unchanged, from environment
variables, and its remote/local time ratio and round trips are reported.

Skipped, with the exact reason, where the machine cannot make namespaces (no root, no
iproute2); the netem variant is skipped where the kernel has no netem qdisc, and the relay
variant then still runs over the same veth pair.
"""

import re

import pytest

from . import netns

RTT_S = 0.020
#: The examples with small problem sizes (the full ones: bench/service_net.py).
EXAMPLES = {
    "newton": ("examples/newton.py", {"n_free": 1}),  # ~400 round trips
    "checkpointing": ("examples/checkpointing.py", ["--n", "256", "--steps", "64", "--k", "8"]),
}


@pytest.fixture(scope="module", params=["netem", "relay"])
def delayed(request, tmp_path_factory):
    """(pair, server): a server in one namespace, RTT_S of delay to the other."""
    reason = netns.unavailable(request.param)
    if reason is not None:
        pytest.skip(reason)
    with netns.net_pair(request.param, RTT_S) as pair:
        server = netns.start_server(pair, tmp_path_factory.mktemp(f"net-{request.param}"))
        try:
            yield pair, server
        finally:
            server.stop()


def test_the_round_trip_has_the_added_delay(delayed):
    pair, server = delayed
    rtt = netns.measure_rtt(pair, server.url)
    assert RTT_S * 0.95 <= rtt < RTT_S + 0.25, rtt


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text)]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_examples_run_unchanged_over_the_delayed_network(delayed, name, capsys):
    pair, server = delayed
    path, args = EXAMPLES[name]
    local = netns.run_example(pair, None, path, args)
    remote = netns.run_example(pair, server, path, args)
    # The same results: iteration counts exactly, floats to rounding (the server compiles
    # with bounds checks, which can change the last bits of a reduction).
    got, want = _numbers(remote["output"]), _numbers(local["output"])
    assert len(got) == len(want) and got, (remote["output"], local["output"])
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-6, abs=1e-12), (remote["output"], local["output"])
    trips = remote["round_trips"]
    # Each round trip costs at least the added delay: the time says they really happened.
    assert trips >= 2 and remote["elapsed"] >= trips * RTT_S * 0.9 - RTT_S, remote
    with capsys.disabled():
        print(f"\n[{pair.mechanism}, {RTT_S * 1000:g} ms RTT] {name}: remote "
              f"{remote['elapsed']:.3f} s, local {local['elapsed']:.3f} s, ratio "
              f"{remote['elapsed'] / local['elapsed']:.1f}, {trips} round trips")
