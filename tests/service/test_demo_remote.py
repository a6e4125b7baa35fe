"""``difftape demo --remote``: the Quick start's demo through a real loopback server."""

import os
import subprocess
import sys


def test_demo_remote_matches_local_run():
    out = subprocess.run([sys.executable, "-m", "difftape.cli", "demo", "--remote",
                          "--steps", "5"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "on the server at http://127.0.0.1:" in out.stdout
    assert "positions identical bit for bit" in out.stdout
    # The demo's own server keeps its per-request JSON access log to itself: its lines (the
    # 503s of /readyz while it starts among them) are nothing a demo user can act on.
    assert '"request_id"' not in out.stdout + out.stderr, out.stderr


def test_demo_server_flag_needs_remote_and_a_token():
    """``--server URL`` points the remote == local check at a running server (a container, a
    lab machine); it means nothing without --remote, and says where a token comes from."""
    base = [sys.executable, "-m", "difftape.cli", "demo", "--server", "http://127.0.0.1:9"]
    out = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--server is for --remote" in out.stderr
    env = {k: v for k, v in os.environ.items() if k != "DIFFTAPE_TOKEN"}
    out = subprocess.run(base + ["--remote"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode != 0 and "difftape token create" in out.stderr
