"""schemathesis against /openapi.json: no input the schema admits (or not) gives a 5xx.

The quick run (coverage phase plus a few fuzzed examples per operation) is part of the suite;
the long one is ``-m bench``. Both run the ``st`` CLI against a real server, with a real
session id supplied so that requests get past the 404 and reach the worker.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .conftest import start_server

ST = shutil.which("st") or str(Path(sys.executable).with_name("st"))


def run_schemathesis(tmp_path, *, phases: str, max_examples: int) -> subprocess.CompletedProcess:
    server = start_server(tmp_path / "data", users=("fuzz",), quota_field_bytes=64 * 2**20,
                          quota_sessions=50, kernel_time_limit_s=20, max_body_bytes=8 * 2**20)
    try:
        token = server.tokens["fuzz"]
        r = httpx.post(server.url + "/v1/sessions", json={},
                       headers={"Authorization": f"Bearer {token}"})
        sid = r.json()["session_id"]
        config = tmp_path / "schemathesis.toml"
        config.write_text(f'[parameters]\n"path.sid" = "{sid}"\n')
        out = subprocess.run(
            [ST, "--config-file", str(config), "run", server.url + "/openapi.json",
             "-H", f"Authorization: Bearer {token}", "--checks", "not_a_server_error",
             "--workers", "1", "--max-examples", str(max_examples), "--phases", phases,
             "--seed", "1", "--no-color"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path)
        out.server_log = server.log()
        return out
    finally:
        server.stop()


def _check(out) -> None:
    text = out.stdout + out.stderr
    summary = [ln for ln in text.splitlines() if "generated" in ln or " in " in ln[-12:]]
    print("schemathesis:", " | ".join(ln.strip() for ln in summary[-3:]))
    assert "Server error" not in text and "ST101" not in text, text[-6000:]
    assert out.returncode == 0, text[-6000:]
    assert "Internal Server Error" not in out.server_log, out.server_log[-4000:]


def test_schemathesis_quick(tmp_path):
    if not Path(ST).exists():
        pytest.skip("schemathesis is not installed (pip install -e .[test])")
    _check(run_schemathesis(tmp_path, phases="coverage,fuzzing", max_examples=5))


@pytest.mark.bench
def test_schemathesis_long(tmp_path):
    _check(run_schemathesis(tmp_path, phases="coverage,fuzzing,stateful", max_examples=100))
