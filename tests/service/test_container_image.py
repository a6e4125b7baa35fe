"""The server image builds with Podman here and the containerised server passes remote == local.

Minutes long, needs root, Podman, runc and (without a base image) debootstrap and a Debian
mirror, so it is deselected by default (marker ``container``; pyproject's addopts): run it with
``pytest -m container tests/service/test_container_image.py``. It runs deploy/image/check.py,
the same check a person runs by hand.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.container


@pytest.mark.skipif(shutil.which("podman") is None,
                    reason="podman is not installed (apt-get install podman runc debootstrap)")
@pytest.mark.skipif(os.geteuid() != 0, reason="the check runs rootful Podman: run as root")
def test_image_builds_with_podman_and_serves_remote_equal_local():
    out = subprocess.run([sys.executable, str(ROOT / "deploy" / "image" / "check.py")],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "positions identical bit for bit" in out.stdout
    assert "container check passed" in out.stdout
