"""``difftape demo --remote``: the Quick start's demo through a real loopback server."""

import subprocess
import sys


def test_demo_remote_matches_local_run():
    out = subprocess.run([sys.executable, "-m", "difftape.cli", "demo", "--remote",
                          "--steps", "5"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "on the server at http://127.0.0.1:" in out.stdout
    assert "positions identical bit for bit" in out.stdout
