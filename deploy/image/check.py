"""Build the CPU server image with Podman and check it for real: remote == local through it.

    python deploy/image/check.py [--python-image IMAGE] [--ca-bundle FILE] [--keep]

What it does, each step failing loudly:
1. a base image: ``--python-image`` if given, else ``localhost/debian-python:bookworm`` if
   Podman has it, else one made here with ``debootstrap`` (Debian 12 minbase with python3 and
   python3-venv; needs root and a reachable Debian mirror, no image registry);
2. ``podman build --format docker`` of the repository's Dockerfile (the ``cpu`` target), with
   the CA bundle as the ``pip_ca`` build secret when one is given or found (PIP_CERT,
   SSL_CERT_FILE): labs behind TLS-inspecting proxies need it;
3. runs the image with Podman's defaults (64 MiB /dev/shm), publishes it on a loopback port,
   creates a token inside it, runs ``difftape demo --remote --server URL`` (the run on the
   server must equal a local run bit for bit) and a field four times larger than /dev/shm
   written, reduced and read back through the client;
4. stops it with a grace period and checks that it exited 0 and logged no traceback.

Podman from Debian's packages needs ``runtime = "runc"`` and ``default_ulimits = []`` on hosts
whose cgroups are hybrid and whose rlimits cannot be raised (containers.conf beside this
script); CONTAINERS_CONF, when set, wins.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BASE_TAG = "localhost/debian-python:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"


def sh(*argv: str, check: bool = True, capture: bool = False, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(argv), flush=True)
    return subprocess.run(argv, check=check, text=True,
                          capture_output=capture, **kw)


def podman(*argv: str, **kw) -> subprocess.CompletedProcess:
    return sh("podman", *argv, **kw)


def base_image(given: str | None) -> str:
    if given:
        return given
    if podman("image", "exists", BASE_TAG, check=False).returncode == 0:
        return BASE_TAG
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        raise SystemExit("no base image: pass --python-image, or run as root with debootstrap "
                         "installed (apt-get install debootstrap) to make one")
    with tempfile.TemporaryDirectory(prefix="difftape-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        sh("debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
           "bookworm", str(rootfs), DEBIAN_MIRROR)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        podman("import", "--change", 'CMD ["/bin/bash"]', "-", BASE_TAG, stdin=tar.stdout)
        tar.wait()
    return BASE_TAG


def ca_bundle(given: str | None) -> str | None:
    for path in (given, os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE")):
        if path and Path(path).is_file():
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, name: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    podman("logs", name, check=False)
    raise SystemExit(f"the container {name} did not become ready in {limit_s:.0f} s")


BIG_FIELD = """
import numpy as np, difftape as ti
ti.init(arch=ti.remote)
n = 64 * 1024 * 1024 // 4 * 4          # 256 MiB of f32: four times the container's /dev/shm
x = ti.field(ti.f32, n)
@ti.kernel
def fill():
    for i in x:
        x[i] = ti.cast(i % 7, ti.f32)
@ti.kernel
def total() -> ti.f64:
    s = ti.f64(0.0)   # the sum of 16M terms needs f64 (a plain 0.0 is f32)
    for i in x:
        s += ti.cast(x[i], ti.f64)
    return s
fill()
got = total()
want = float((np.arange(n) % 7).sum())
back = x.to_numpy()
assert got == want, (got, want)
assert back.shape == (n,) and float(back[n - 1]) == float((n - 1) % 7)
print(f"big field: {n * 4 >> 20} MiB written, reduced and read back through the client")
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python-image", help="base image with python3 >= 3.11 and python3-venv")
    ap.add_argument("--ca-bundle", help="CA bundle for pip inside the build (default: PIP_CERT, "
                                        "SSL_CERT_FILE)")
    ap.add_argument("--tag", default="localhost/difftape:cpu")
    ap.add_argument("--keep", action="store_true", help="leave the container running")
    args = ap.parse_args(argv)
    if shutil.which("podman") is None:
        raise SystemExit("podman is not installed (apt-get install podman runc)")
    os.environ.setdefault("CONTAINERS_CONF", str(HERE / "containers.conf"))

    base = base_image(args.python_image)
    build = ["build", "--format", "docker", "--target", "cpu", "-t", args.tag,
             "--build-arg", f"PYTHON_IMAGE={base}"]
    ca = ca_bundle(args.ca_bundle)
    if ca:
        build += ["--secret", f"id=pip_ca,src={ca}"]
    t0 = time.monotonic()
    podman(*build, str(ROOT))
    print(f"image built in {time.monotonic() - t0:.0f} s", flush=True)

    name = f"difftape-check-{os.getpid()}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    podman("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000",
           "-e", "DIFFTAPE_ALLOWED_HOSTS=127.0.0.1,localhost", args.tag)
    try:
        wait_ready(url, name)
        shm = podman("exec", name, "df", "-m", "/dev/shm", capture=True).stdout
        print(shm.strip())
        out = podman("exec", name, "difftape", "token", "create", "check", "--data-dir", "/data",
                     capture=True).stdout
        token = next(w for w in out.split() if w.startswith("dt_"))
        env = {**os.environ, "DIFFTAPE_SERVER": url, "DIFFTAPE_TOKEN": token}
        for k in ("DIFFTAPE_ARCH", "TI_ARCH"):
            env.pop(k, None)
        demo = sh(sys.executable, "-m", "difftape", "demo", "--remote", "--steps", "20",
                  "--server", url, "--token", token, capture=True, env=env, check=False)
        print(demo.stdout + demo.stderr)
        if demo.returncode != 0 or "identical bit for bit" not in demo.stdout:
            raise SystemExit("remote != local through the container")
        with tempfile.TemporaryDirectory() as tmp:
            program = Path(tmp) / "big_field.py"  # kernels compile from their source file
            program.write_text(BIG_FIELD)
            big = sh(sys.executable, str(program), capture=True, env=env, check=False)
        print(big.stdout + big.stderr)
        if big.returncode != 0:
            raise SystemExit("a field larger than /dev/shm failed through the container")
        if args.keep:
            print(f"left running: {name} on {url} (token {token})")
            return 0
        podman("stop", "-t", "60", name)
        code = podman("inspect", "--format", "{{.State.ExitCode}}", name,
                      capture=True).stdout.strip()
        logs = podman("logs", name, capture=True)
        if code != "0" or "Traceback" in logs.stdout + logs.stderr:
            print(logs.stdout[-4000:] + logs.stderr[-4000:])
            raise SystemExit(f"the server did not stop cleanly (exit code {code})")
        print("container check passed: built with Podman, remote == local, clean stop")
        return 0
    finally:
        if not args.keep:
            podman("rm", "-f", name, check=False, capture=True)


if __name__ == "__main__":
    sys.exit(main())
