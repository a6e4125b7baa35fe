"""The deployment files (Dockerfile, deploy/) agree with the code they deploy.

What is checked, without Docker, a cluster or systemd:
- the Dockerfile: CPU by default, a CUDA target with the `cuda` extra, stages Podman can
  resolve, no build tools in the runtime stages, a numeric non-root USER, a HEALTHCHECK on
  /livez, the entrypoint;
- the probes and healthchecks name routes that `create_app` really serves, and send a Host
  header the server allows;
- every DIFFTAPE_* variable set anywhere is a field of `difftape.server.settings.Settings`
  (read from its source, so this needs no server dependencies);
- every flag in an ExecStart line or the entrypoint is one `difftape serve --help` lists;
- the systemd unit's user, state directory and hardening; compose and Kubernetes structure.

The structural YAML checks need PyYAML (not a project dependency): without it they are
skipped and the line-based checks below still run. The route checks need the `server` extra.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yml"
K8S_BASE = DEPLOY / "k8s" / "base"
K8S_GPU = DEPLOY / "k8s" / "gpu"
UNIT = DEPLOY / "systemd" / "difftape.service"
UNIT_CUDA = DEPLOY / "systemd" / "difftape.service.d" / "cuda.conf"
SYSUSERS = DEPLOY / "systemd" / "difftape.sysusers"
RAY = DEPLOY / "ray"
RAY_SCRIPTS = [RAY / "ray-start.sh", RAY / "slurm.sbatch"]

APP_UID = 10001
YAML_FILES = [COMPOSE, COMPOSE_GPU, *sorted(K8S_BASE.glob("*.yaml")),
              *sorted(K8S_GPU.glob("*.yaml")), *sorted(RAY.glob("*.yaml"))]

try:
    import yaml
except ImportError:  # pragma: no cover - depends on the environment
    yaml = None

needs_yaml = pytest.mark.skipif(
    yaml is None, reason="PyYAML is not installed (not a difftape dependency): "
                         "`pip install pyyaml` to run the structural YAML checks")


# ------------------------------------------------------------------------------- helpers
def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment inside a continued instruction
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    return out


def dockerfile_stages() -> tuple[dict[str, str], dict[str, list[tuple[str, str]]], list]:
    """(global ARG defaults, {stage name: instructions}, final stage instructions)."""
    args: dict[str, str] = {}
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list | None = None
    order = []
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else f"#{len(order)}"
            current = [("FROM", rest)]
            stages[name] = current
            order.append(current)
        elif current is None:
            assert word == "ARG", f"only ARG may precede the first FROM, not {word}"
            k, _, v = rest.partition("=")
            args[k] = v
        else:
            current.append((word, rest))
    return args, stages, order[-1]


def expand(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m[1] or m[2], m[0]), text)


def settings_fields() -> set[str]:
    """Settings' field names, read from server/settings.py without importing it."""
    tree = ast.parse((ROOT / "server" / "settings.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Settings":
            return {s.target.id for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    and s.target.id != "model_config"}
    raise AssertionError("no class Settings in server/settings.py")


def settings_default(name: str):
    tree = ast.parse((ROOT / "server" / "settings.py").read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == name and node.value is not None):
            return ast.literal_eval(node.value)
    raise AssertionError(f"Settings.{name} has no literal default")


def unit_entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) of a systemd unit file, in order (keys may repeat)."""
    out, section = [], None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not key=value: {raw!r}"
        out.append((section, key.strip(), value.strip()))
    return out


def unit_value(path: Path, key: str, section: str = "Service") -> str | None:
    values = [v for s, k, v in unit_entries(path) if s == section and k == key]
    return values[-1] if values else None


def serve_argv(argv: list[str]) -> list[str]:
    """The arguments after `difftape serve` in a command line."""
    i = argv.index("serve")
    assert Path(argv[i - 1]).name == "difftape", argv
    return argv[i + 1:]


def option_values(args: list[str]) -> dict[str, str]:
    out, i = {}, 0
    while i < len(args):
        a = args[i]
        assert a.startswith("--"), f"unexpected positional argument {a!r} in {args}"
        if "=" in a:
            k, v = a.split("=", 1)
            out[k] = v
            i += 1
        else:
            out[a] = args[i + 1]
            i += 2
    return out


_SERVE_HELP: list[str] = []


def serve_help() -> str:
    if not _SERVE_HELP:
        r = subprocess.run([sys.executable, "-m", "difftape.cli", "serve", "--help"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            pytest.skip(f"`difftape serve --help` failed here (rc {r.returncode}): "
                        f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        _SERVE_HELP.append(r.stdout)
    return _SERVE_HELP[0]


def check_serve_flags(args: list[str], where: str) -> None:
    """Every --flag is listed by `difftape serve --help`; choice values are listed choices."""
    text = serve_help()
    known = set(re.findall(r"(--[a-z][a-z0-9-]*)", text))
    for flag, value in option_values(args).items():
        assert flag in known, f"{where}: {flag} is not a `difftape serve` flag ({sorted(known)})"
        m = re.search(re.escape(flag) + r"\s+\{([^}]*)\}", text)
        if m:
            assert value in m[1].split(","), f"{where}: {flag} {value} not in {{{m[1]}}}"


def yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_objects(folder: Path = K8S_BASE) -> dict[str, dict]:
    objs = {}
    for p in sorted(folder.glob("*.yaml")):
        if p.name == "kustomization.yaml":
            continue
        for d in yaml_docs(p):
            objs[d["kind"]] = d
    return objs


def probe_specs_text() -> list[tuple[str, str, str | None]]:
    """(probe kind, path, Host header) from deployment.yaml, read line by line."""
    out, kind, path = [], None, None
    lines = (K8S_BASE / "deployment.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*(startupProbe|livenessProbe|readinessProbe):\s*$", line)
        if m:
            kind, path = m[1], None
        m = re.match(r"\s*path:\s*(\S+)\s*$", line)
        if m and kind:
            path = m[1]
        m = re.match(r"\s*-?\s*name:\s*Host\s*$", line)
        if m and kind and path:
            host = re.match(r"\s*value:\s*(\S+)", lines[i + 1])[1]
            out.append((kind, path, host))
            kind = path = None
    return out


# ------------------------------------------------------------------------------ Dockerfile
def test_dockerfile_cpu_by_default_cuda_by_target():
    args, stages, final = dockerfile_stages()
    for name in ("build-cpu", "build-cuda", "base-cpu", "base-cuda", "cuda", "cpu"):
        assert name in stages, f"stage {name} missing"
    # The last stage is what a plain `docker build .` / `podman build .` makes.
    assert final is stages["cpu"]
    base_cuda = expand(stages["base-cuda"][0][1], args)
    base_cuda = expand(base_cuda, args)
    assert base_cuda.startswith("nvidia/cuda:12.") and "-runtime-" in base_cuda, base_cuda
    assert "-devel-" in expand(expand(stages["build-cuda"][0][1], args), args)
    installs = [r for w, r in stages["build-cuda"] if w == "RUN" and "pip-install" in r]
    assert any("cuda" in r.split("pip-install", 1)[1] for r in installs), installs
    cpu_installs = [r for w, r in stages["build-cpu"] if w == "RUN" and "pip-install" in r]
    assert cpu_installs and not any("cuda" in r.split("pip-install", 1)[1]
                                    for r in cpu_installs)


def test_dockerfile_builds_with_podman_and_behind_a_proxy():
    """Podman 4.3 (Buildah 1.28) looks a stage name computed from a build argument up as an
    image (`FROM build-${TARGET}`: "short-name did not resolve"): a FROM names either an image
    (possibly through an ARG) or, literally, an earlier stage. pip honours a CA bundle secret
    and index build arguments through the one install script."""
    args, stages, _ = dockerfile_stages()
    seen: set[str] = set()
    for name, instructions in stages.items():
        source = instructions[0][1].split()[0]
        if "$" in source:
            assert source.strip("${}") in args, f"stage {name}: FROM {source}"
        else:
            assert source in seen or ":" in source or "/" in source, f"stage {name}: {source}"
        seen.add(name)
    script = DEPLOY / "image" / "pip-install.sh"
    text = script.read_text()
    assert "/run/secrets/pip_ca" in text and "PIP_CERT" in text
    for build in ("build-cpu", "build-cuda"):
        runs = [r for w, r in stages[build] if w == "RUN" and "pip-install" in r]
        assert runs and all("--mount=type=secret,id=pip_ca" in r for r in runs), runs
        assert ("ARG", "PIP_INDEX_URL PIP_EXTRA_INDEX_URL") in stages[build]
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert "!deploy/image/pip-install.sh" in ignored


def test_dockerfile_cpu_and_cuda_images_are_the_same_steps():
    """The two final stages differ only in their base and the build stage they copy from."""
    _, stages, _ = dockerfile_stages()

    def steps(target: str) -> list[tuple[str, str]]:
        out = []
        for word, rest in stages[target][1:]:
            out.append((word, rest.replace(f"build-{target}", "build-T")
                        .replace(f"({target})", "(T)")))
        return out

    assert stages["cpu"][0][1] == "base-cpu AS cpu"
    assert stages["cuda"][0][1] == "base-cuda AS cuda"
    assert steps("cpu") == steps("cuda")


def test_dockerfile_runtime_has_no_build_tools():
    _, stages, _ = dockerfile_stages()
    tools = {"build-essential", "gcc", "g++", "make", "cmake", "python3-dev", "python3-pip"}

    def builds(text: str) -> bool:
        return bool(tools & set(text.split())) or "-devel-" in text or "pip install" in text

    for name in ("base-cpu", "base-cuda", "cpu", "cuda"):
        for word, rest in stages[name]:
            assert not builds(rest), f"{name}: {word} {rest}"
    for target in ("cpu", "cuda"):
        copies = [r for w, r in stages[target] if w == "COPY"]
        assert copies == [f"--from=build-{target} /opt/venv /opt/venv"], copies


def test_dockerfile_runs_as_numeric_non_root_user():
    args, _, final = dockerfile_stages()
    local = dict(args)
    for word, rest in final:
        if word == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            local[k] = v
    users = [expand(r, local) for w, r in final if w == "USER"]
    assert users, "the image must not run as root: no USER in the final stage"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so that Kubernetes' runAsNonRoot can verify it.
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert int(uid) == APP_UID and (not gid or int(gid) == APP_UID)
    # USER comes after everything that needs root.
    last_user = max(i for i, (w, _) in enumerate(final) if w == "USER")
    assert all(w != "RUN" for w, _ in final[last_user:])


def test_dockerfile_healthcheck_volume_port_entrypoint():
    _, _, final = dockerfile_stages()
    words = dict(final)
    hc = words.get("HEALTHCHECK")
    assert hc, "no HEALTHCHECK"
    assert "/livez" in hc and "urllib" in hc and "curl" not in hc
    cmd = json.loads(hc[hc.index("CMD") + 3:].strip())
    assert cmd[:2] == ["python", "-c"]
    compile(cmd[2], "<healthcheck>", "exec")
    assert json.loads(words["VOLUME"]) == ["/data"]
    assert words["EXPOSE"].split() == ["8000"]
    entry = json.loads(words["ENTRYPOINT"])
    assert entry[:2] == ["difftape", "serve"]
    opts = option_values(entry[2:])
    assert opts["--host"] == "0.0.0.0" and opts["--data-dir"] == "/data"


def test_dockerfile_entrypoint_flags_exist():
    _, _, final = dockerfile_stages()
    check_serve_flags(json.loads(dict(final)["ENTRYPOINT"])[2:], "Dockerfile ENTRYPOINT")


def test_dockerignore_keeps_what_the_image_copies():
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    for must in (".git", ".venv"):
        assert must in ignored
    _, stages, _ = dockerfile_stages()
    copied = {src for st in stages.values() for w, r in st
              if w == "COPY" and not r.startswith("--from") for src in r.split()[:-1]}
    assert copied >= {"pyproject.toml", "README.md", "kernels", "server", "client"}
    for src in copied:
        assert src not in ignored, f".dockerignore drops {src}, which the Dockerfile copies"
        assert (ROOT / src).exists(), src


# ------------------------------------------------------------------ settings and flag names
def _env_names_everywhere() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    pat = re.compile(r"\b(DIFFTAPE_[A-Z0-9_]+)\b")
    files = [DOCKERFILE, *YAML_FILES, UNIT, UNIT_CUDA, *RAY_SCRIPTS]
    for p in files:
        for line in p.read_text().splitlines():
            code = line.split("#", 1)[0]
            for name in pat.findall(code):
                found.setdefault(name, set()).add(p.relative_to(ROOT).as_posix())
    return found


def test_every_difftape_variable_is_a_setting():
    fields = settings_fields()
    names = _env_names_everywhere()
    assert "DIFFTAPE_ALLOWED_HOSTS" in names and "DIFFTAPE_ARCH" in names
    for name, where in sorted(names.items()):
        field = name.removeprefix("DIFFTAPE_").lower()
        assert field in fields, f"{name} (in {sorted(where)}) is not a Settings field"


def test_systemd_unit():
    assert unit_value(UNIT, "User") == "difftape"
    assert unit_value(UNIT, "Group") == "difftape"
    state = unit_value(UNIT, "StateDirectory")
    assert state == "difftape"
    for key, value in {"NoNewPrivileges": "yes", "PrivateTmp": "yes",
                       "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateDevices": "yes", "CapabilityBoundingSet": ""}.items():
        assert unit_value(UNIT, key) == value, key
    # Not MemoryDenyWriteExecute: the JIT maps generated code executable.
    assert unit_value(UNIT, "MemoryDenyWriteExecute") in (None, "no")
    args = serve_argv(shlex.split(unit_value(UNIT, "ExecStart")))
    opts = option_values(args)
    assert opts["--host"] == "127.0.0.1"
    assert opts["--data-dir"] == f"/var/lib/{state}"
    assert unit_value(UNIT, "WantedBy", "Install") == "multi-user.target"
    # The sysusers file creates the same user, home in the state directory.
    (line,) = [ln for ln in SYSUSERS.read_text().splitlines() if ln and ln[0] != "#"]
    fields = shlex.split(line)
    assert fields[:2] == ["u", "difftape"] and fields[4] == f"/var/lib/{state}"


def test_systemd_cuda_dropin():
    entries = [(k, v) for s, k, v in unit_entries(UNIT_CUDA) if s == "Service"]
    execs = [v for k, v in entries if k == "ExecStart"]
    assert execs[0] == "", "a drop-in must clear ExecStart before setting it"
    opts = option_values(serve_argv(shlex.split(execs[-1])))
    assert opts["--arch"] == "cuda"
    base = option_values(serve_argv(shlex.split(unit_value(UNIT, "ExecStart"))))
    assert {k: v for k, v in opts.items() if k != "--arch"} == \
           {k: v for k, v in base.items() if k != "--arch"}
    assert ("PrivateDevices", "no") in entries
    assert any(k == "DeviceAllow" and "nvidia" in v for k, v in entries)


def test_systemd_flags_exist():
    check_serve_flags(serve_argv(shlex.split(unit_value(UNIT, "ExecStart"))), "ExecStart")
    execs = [v for s, k, v in unit_entries(UNIT_CUDA) if k == "ExecStart" and v]
    check_serve_flags(serve_argv(shlex.split(execs[-1])), "cuda.conf ExecStart")


# ------------------------------------------------------------- probes and routes of the app
def test_probes_line_based():
    """Without PyYAML: the three probes, their paths and Host headers."""
    specs = probe_specs_text()
    assert sorted(k for k, _, _ in specs) == ["livenessProbe", "readinessProbe", "startupProbe"]
    paths = {k: p for k, p, _ in specs}
    assert paths["livenessProbe"] == paths["startupProbe"] == "/livez"
    assert paths["readinessProbe"] == "/readyz"
    for _, _, host in specs:
        assert host in settings_default("allowed_hosts"), \
            f"probe Host {host} is not allowed by default"
    text = (K8S_BASE / "deployment.yaml").read_text()
    assert re.search(r"^\s*enableServiceLinks:\s*false\s*$", text, re.M)
    assert "/livez" in COMPOSE.read_text()


@pytest.fixture(scope="module")
def app_paths(tmp_path_factory) -> set[str]:
    pytest.importorskip("fastapi", reason="the `server` extra is not installed")
    from difftape.server.app import create_app
    from difftape.server.settings import Settings

    app = create_app(Settings(data_dir=tmp_path_factory.mktemp("data"), spare_workers=0))
    # The OpenAPI paths, plus top-level routes kept out of the schema (FastAPI may wrap
    # included routers, so app.routes alone need not list them).
    flat = {getattr(r, "path", None) for r in app.routes} - {None}
    return set(app.openapi()["paths"]) | flat


def test_health_endpoints_exist(app_paths):
    for path in ("/livez", "/readyz", "/metrics"):
        assert path in app_paths, f"{path} not served by create_app(): {sorted(app_paths)}"
    for _, path, _ in probe_specs_text():
        assert path in app_paths
    hc = dict(dockerfile_stages()[2])["HEALTHCHECK"]
    assert re.search(r"/livez\b", hc)


def test_health_endpoints_answer_the_probes(tmp_path):
    """The probes' requests, made in-process: Host localhost gets through the Host check."""
    pytest.importorskip("fastapi", reason="the `server` extra is not installed")
    from fastapi.testclient import TestClient

    from difftape.server.app import create_app
    from difftape.server.settings import Settings

    app = create_app(Settings(data_dir=tmp_path, spare_workers=0))
    # Not entered as a context manager: no lifespan, so no worker processes start; liveness
    # must not depend on them anyway.
    client = TestClient(app, base_url="http://localhost:8000")
    assert client.get("/livez").status_code == 200
    # What the kubelet would send without the probes' Host header: the pod's IP.
    assert client.get("/livez", headers={"host": "10.1.2.3:8000"}).status_code == 400
    assert client.get("/readyz").status_code in (200, 503)


def _third_party_imports(folders) -> set[str]:
    names = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "difftape"}


def test_server_extra_installs_what_the_service_imports():
    """The image installs `.[server,...]` (the extras its CPU build stage names; not editable,
    no dev tools): everything server/ and client/ import must come with those extras,
    directly or through their dependencies."""
    pytest.importorskip("fastapi", reason="the `server` extra is not installed")
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    # The first level from pyproject.toml itself (installed metadata may be older), the rest
    # from the installed distributions.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (extras,) = re.findall(r'pip-install "\.\[([a-z,]+)\]"\n\nFROM \$\{CUDA_DEVEL_IMAGE\}',
                           (ROOT / "Dockerfile").read_text())
    assert "server" in extras.split(",")
    closure, todo = set(), [*project["dependencies"],
                            *(r for x in extras.split(",")
                              for r in project["optional-dependencies"][x])]
    while todo:
        req = Requirement(todo.pop())
        name = canonicalize_name(req.name)
        if name in closure or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        closure.add(name)
        try:
            todo += metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            pass
    provided = metadata.packages_distributions()
    for module in sorted(_third_party_imports(["server", "client"])):
        dists = {canonicalize_name(d) for d in provided.get(module, [])}
        assert dists & closure, (f"server/ or client/ imports {module} ({sorted(dists)}), "
                                 f"which `pip install .[{extras}]` does not bring")


# ------------------------------------------------------------------------ YAML structure
def test_yaml_files_parse_without_tabs():
    for p in YAML_FILES:
        text = p.read_text()
        assert "\t" not in text, f"{p.name}: tab character"
        if yaml is not None:
            assert yaml_docs(p), f"{p.name}: empty"


@needs_yaml
def test_compose():
    svc = yaml_docs(COMPOSE)[0]["services"]["difftape"]
    assert svc["build"]["context"] == ".." and svc["build"]["target"] == "cpu"
    assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert svc["ports"] == ["127.0.0.1:8000:8000"], "publish on the host's loopback only"
    assert svc["volumes"] == ["difftape-data:/data"]
    assert "difftape-data" in yaml_docs(COMPOSE)[0]["volumes"]
    assert svc["user"] == f"{APP_UID}:{APP_UID}"
    assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
    hc = svc["healthcheck"]["test"]
    assert hc[0] == "CMD" and "/livez" in hc[-1]
    compile(hc[-1], "<compose healthcheck>", "exec")
    assert "command" not in svc and "entrypoint" not in svc, "the image's entrypoint is used"
    for value in svc["environment"].values():
        assert isinstance(value, str), "quote environment values"

    gpu = yaml_docs(COMPOSE_GPU)[0]["services"]["difftape"]
    assert gpu["build"]["target"] == "cuda"
    assert gpu["environment"]["DIFFTAPE_ARCH"] == "cuda"
    (dev,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["count"] == 1
    # compute for CUDA, utility for NVML (the device's utilisation in /metrics and /readyz)
    assert dev["capabilities"] == ["gpu", "compute", "utility"]
    assert gpu["environment"]["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"


@needs_yaml
def test_kubernetes_base():
    objs = k8s_objects()
    assert set(objs) == {"Namespace", "ConfigMap", "PersistentVolumeClaim", "Deployment",
                         "Service"}
    ns = objs["Namespace"]["metadata"]["name"]
    for kind, obj in objs.items():
        if kind != "Namespace":
            assert obj["metadata"]["namespace"] == ns, kind
    kust = yaml_docs(K8S_BASE / "kustomization.yaml")[0]
    assert sorted(kust["resources"]) == sorted(
        p.name for p in K8S_BASE.glob("*.yaml") if p.name != "kustomization.yaml")

    dep = objs["Deployment"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False
    assert pod["automountServiceAccountToken"] is False
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True
    assert psc["runAsUser"] == psc["runAsGroup"] == psc["fsGroup"] == APP_UID
    (c,) = pod["containers"]
    csc = c["securityContext"]
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"]
    assert "command" not in c and "args" not in c, "the image's entrypoint is used"

    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    data = vols[mounts["/data"]]
    assert data["persistentVolumeClaim"]["claimName"] == objs["PersistentVolumeClaim"][
        "metadata"]["name"]
    assert "emptyDir" in vols[mounts["/tmp"]], "read-only root: /tmp must be writable"

    (port,) = c["ports"]
    assert port["containerPort"] == 8000
    for name, path in (("startupProbe", "/livez"), ("livenessProbe", "/livez"),
                       ("readinessProbe", "/readyz")):
        get = c[name]["httpGet"]
        assert get["path"] == path and get["port"] == port["name"]
        hosts = {h["value"] for h in get["httpHeaders"] if h["name"].lower() == "host"}
        allowed = objs["ConfigMap"]["data"]["DIFFTAPE_ALLOWED_HOSTS"].split(",")
        assert hosts and hosts <= set(allowed), (name, hosts, allowed)
    assert c["envFrom"][0]["configMapRef"]["name"] == objs["ConfigMap"]["metadata"]["name"]

    svc = objs["Service"]
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"][
        "labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == port["name"]
    # Clients inside the cluster use the Service's DNS names: they must pass the Host check.
    allowed = objs["ConfigMap"]["data"]["DIFFTAPE_ALLOWED_HOSTS"].split(",")
    name = svc["metadata"]["name"]
    assert f"{name}.{ns}.svc.cluster.local" in allowed and f"{name}.{ns}.svc" in allowed


@needs_yaml
def test_kubernetes_gpu_overlay():
    kust = yaml_docs(K8S_GPU / "kustomization.yaml")[0]
    assert kust["resources"] == ["../base"]
    assert {"name": "difftape", "newTag": "cuda"} in kust["images"]
    patches = {d["kind"]: d for p in kust["patches"] for d in yaml_docs(K8S_GPU / p["path"])}
    assert patches["ConfigMap"]["data"]["DIFFTAPE_ARCH"] == "cuda"
    (c,) = patches["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert c["name"] == k8s_objects()["Deployment"]["spec"]["template"]["spec"][
        "containers"][0]["name"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m)?", str(text).strip())
    assert m, text
    return float(m.group(1)) * (60 if m.group(2) == "m" else 1)


@needs_yaml
def test_shutdown_grace_and_shared_memory_fit_the_orchestrators():
    """The server's own grace period (it saves every session within it) is shorter than
    the one after which each orchestrator sends SIGKILL, and /dev/shm is raised from the
    64 MiB containers get by default."""
    svc = yaml_docs(COMPOSE)[0]["services"]["difftape"]
    grace = float(svc["environment"]["DIFFTAPE_SHUTDOWN_GRACE_S"])
    assert grace + 10 <= _seconds(svc["stop_grace_period"])
    size = re.fullmatch(r"(\d+)([kmg])b?", svc["shm_size"].lower())
    assert size and int(size.group(1)) * {"k": 1, "m": 2**10, "g": 2**20}[size.group(2)] \
        >= 256 * 2**10, svc["shm_size"]

    objs = k8s_objects()
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    grace = float(objs["ConfigMap"]["data"]["DIFFTAPE_SHUTDOWN_GRACE_S"])
    assert grace + 10 <= pod["terminationGracePeriodSeconds"]
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    dshm = {v["name"]: v for v in pod["volumes"]}[mounts["/dev/shm"]]["emptyDir"]
    assert dshm["medium"] == "Memory" and dshm["sizeLimit"] in ("512Mi", "1Gi", "2Gi")

    envs = dict(e.split("=", 1) for s, k, v in unit_entries(UNIT)
                if s == "Service" and k == "Environment" for e in shlex.split(v))
    assert float(envs["DIFFTAPE_SHUTDOWN_GRACE_S"]) + 10 <= \
        _seconds(unit_value(UNIT, "TimeoutStopSec"))


# ------------------------------------------------------------------ Ray cluster (deploy/ray)
@needs_yaml
def test_kuberay_cluster_gateways_and_database():
    """The KubeRay deployment holds together: a RayCluster whose head schedules no engine
    and whose worker group has GPUs, every Ray pod and gateway on one image (one Python and
    Ray version across the cluster and its clients), gateways that reach the head's client
    port with real `difftape serve` flags, share the database (from a Secret) and a
    ReadWriteMany saved-sessions volume, advertise their pod address, and can overlap."""
    kust = yaml_docs(RAY / "kustomization.yaml")[0]
    objs = {}
    for name in kust["resources"]:
        assert (RAY / name).exists(), name
        for d in yaml_docs(RAY / name):
            objs[(d["kind"], d["metadata"]["name"])] = d
    ray_cluster = objs[("RayCluster", "difftape-ray")]
    head = ray_cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    (gpu,) = [g for g in ray_cluster["spec"]["workerGroupSpecs"] if g["groupName"] == "gpu"]
    (worker,) = gpu["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert gpu["maxReplicas"] >= 50
    head_ports = {p["name"]: p["containerPort"]
                  for p in head["template"]["spec"]["containers"][0]["ports"]}

    gateway = objs[("Deployment", "difftape-gateway")]
    spec = gateway["spec"]
    assert spec["replicas"] >= 2 and spec["strategy"]["type"] == "RollingUpdate"
    (gw,) = spec["template"]["spec"]["containers"]
    images = {worker["image"], gw["image"],
              head["template"]["spec"]["containers"][0]["image"]}
    assert images == {"difftape:cuda"}, images
    check_serve_flags(gw["args"], "gateway.yaml args")
    cluster = option_values(gw["args"])["--cluster"]
    assert cluster == f"ray://{ray_cluster['metadata']['name']}-head-svc:{head_ports['client']}"
    env = {e["name"]: e for e in gw["env"]}
    assert env["DIFFTAPE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "difftape-db"
    assert env["DIFFTAPE_GATEWAY_URL"]["value"] == "http://$(POD_IP):8000"
    assert env["DIFFTAPE_ARCH"]["value"] == "cuda" and float(env["DIFFTAPE_SESSION_GPUS"][
        "value"]) > 0
    mounts = {m["mountPath"]: m["name"] for m in gw["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    claim = volumes[mounts[env["DIFFTAPE_SESSIONS_DIR"]["value"]]]["persistentVolumeClaim"]
    pvc = objs[("PersistentVolumeClaim", claim["claimName"])]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "emptyDir" in volumes[mounts["/data"]]  # per gateway
    db = objs[("StatefulSet", "difftape-db")]
    assert objs[("Service", "difftape-db")]["spec"]["ports"][0]["port"] == 5432
    pg_env = {e["name"]: e for e in db["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert pg_env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "difftape-db"


def test_ray_start_recipes():
    """The bare-machine and Slurm recipes are valid shell, start the head without CPUs for
    engines, and run gateways as drivers on a cluster node with real `difftape serve`
    flags."""
    for script in RAY_SCRIPTS:
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, (script.name, r.stderr)
        text = script.read_text()
        assert "ray start --head" in text and "--num-cpus=0" in text
        serve = [line for line in text.splitlines() if "difftape serve" in line]
        assert serve, script.name
        for line in serve:
            argv = shlex.split(line.split("exec ", 1)[-1])
            args = serve_argv(argv[argv.index("difftape"):])
            assert option_values(args)["--cluster"] == "auto", (script.name, args)
