"""The compiled-code cache of the CUDA target (runtime/cuda.py's Assembler) without a GPU.

The stand-in driver (tests/cuda_standin.py) plays the device, the code is the real CUDA
target's PTX for the device's compute capability (sm_90) and the real ``ptxas`` (found here
as in CI) assembles it. Checked: the driver is handed a cubin for sm_90, not PTX for its JIT;
a second process finds the PTX and the cubin on disk and runs neither LLVM nor ptxas nor the
JIT; where ptxas cannot make a cubin the driver may load (none, older than the device, newer
than the driver, or the driver refuses its cubin) the PTX goes through the JIT, said in the
log and counted.
"""

import importlib.util
import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cuda_standin import FakeDriver, use

import difftape as ti
from difftape.codegen.cuda import find_libdevice, find_ptxas
from difftape.runtime import cuda as cuda_runtime
from difftape.runtime import program

pytestmark = [pytest.mark.difftape_only,
              pytest.mark.skipif(find_ptxas() is None or find_libdevice() is None,
                                 reason="needs ptxas and libdevice (the CUDA toolkit or the "
                                        "nvidia-cuda-nvcc wheel)")]

TESTS = str(Path(__file__).resolve().parents[1])

_PROGRAM = """
import difftape as ti

def run(cache_dir):
    ti.init(arch=ti.cuda, offline_cache_file_path=cache_dir)
    x = ti.field(ti.f32, shape=64)

    @ti.kernel
    def wave(t: ti.f32):
        for i in x:
            x[i] = ti.sin(i * 0.1 + t)

    wave(0.5)
"""


def _cubin_arch(image: bytes) -> int:
    """The SM version a cubin's ELF header names (``e_flags``)."""
    flags = int.from_bytes(image[48:52], "little")
    return (flags >> 8) & 0xFF if image[7] == 0x41 else flags & 0xFF  # (OS ABI 0x41: bits 8-15)


def _logging_ptxas(tmp_path: Path) -> tuple[str, Path]:
    """A ptxas that writes each call's arguments to a log, then runs the real one."""
    log = tmp_path / "ptxas.log"
    script = tmp_path / "ptxas"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {find_ptxas()} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), log


def _program_file(tmp_path: Path) -> Path:
    """The program as a module file (kernels are compiled from their source)."""
    path = tmp_path / "cuda_program.py"
    path.write_text(_PROGRAM)
    return path


def _child(tmp_path: Path, ptxas: str, forbid_llvm: bool) -> dict:
    """Run the program in a new process on the stand-in device; what it loaded."""
    cache_dir = tmp_path / "cache"
    _program_file(tmp_path)
    code = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [{TESTS!r}, {str(tmp_path)!r}]
        from cuda_standin import FakeDriver
        from difftape.codegen import cuda as cuda_codegen
        from difftape.runtime import cuda as cuda_runtime, program
        drv = FakeDriver()
        cuda_runtime.load_driver = lambda: drv
        if {forbid_llvm!r}:
            def no_llvm(self, text):
                raise AssertionError("LLVM ran in the warm process")
            cuda_codegen.CUDATarget.compile = no_llvm
        import cuda_program
        cuda_program.run({str(cache_dir)!r})
        print(json.dumps({{"images": drv.images,
                          "loads": program.get().launcher.loads.as_dict()}}))
        """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TI_ARCH", "DIFFTAPE_ARCH", "DIFFTAPE_SIMULATE_GPU", "DIFFTAPE_CACHE_DIR",
                        cuda_runtime.DEVICE_VAR)}
    env["DIFFTAPE_PTXAS"] = ptxas
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_warm_process_loads_the_cubin_without_llvm_ptxas_or_the_jit(tmp_path):
    ptxas, log = _logging_ptxas(tmp_path)
    cold = _child(tmp_path, ptxas, forbid_llvm=False)
    assert cold == {"images": ["cubin"],
                    "loads": {"cubin_cached": 0, "cubin_assembled": 1, "ptx_jit": 0}}
    assembled = [line for line in log.read_text().splitlines() if "-o" in line.split()]
    assert len(assembled) == 1 and "--gpu-name=sm_90" in assembled[0]
    cubins = list((tmp_path / "cache").rglob("*.cubin"))
    assert len(cubins) == 1
    image = cubins[0].read_bytes()
    assert cuda_runtime.is_cubin(image) and _cubin_arch(image) == 90
    assert len(list((tmp_path / "cache").rglob("*.o"))) == 1  # the PTX, keyed like CPU code

    log.unlink()
    warm = _child(tmp_path, ptxas, forbid_llvm=True)
    assert warm == {"images": ["cubin"],
                    "loads": {"cubin_cached": 1, "cubin_assembled": 0, "ptx_jit": 0}}
    assert not log.exists() or not [line for line in log.read_text().splitlines()
                                    if "-o" in line.split()]  # ptxas assembled nothing


def _run_here(tmp_path):
    spec = importlib.util.spec_from_file_location("cuda_program", _program_file(tmp_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.run(str(tmp_path / "cache"))
    return program.get().launcher


@pytest.fixture
def device(monkeypatch):
    drv = use(monkeypatch, FakeDriver(), code="cuda")
    yield drv
    ti.reset()


def _jit_logged(caplog, why: str) -> None:
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("PTX loaded through the CUDA driver's JIT" in m and why in m for m in lines), lines


def test_without_ptxas_the_ptx_goes_through_the_jit_and_says_so(device, monkeypatch, tmp_path,
                                                                 caplog):
    monkeypatch.setenv("DIFFTAPE_PTXAS", "")
    with caplog.at_level(logging.INFO, logger="difftape"):
        launcher = _run_here(tmp_path)
    _jit_logged(caplog, "no ptxas found")
    assert device.images == ["ptx"] and launcher.loads.as_dict() == \
        {"cubin_cached": 0, "cubin_assembled": 0, "ptx_jit": 1}
    assert not list((tmp_path / "cache").rglob("*.cubin"))


def test_a_ptxas_older_than_the_device_is_not_used(device, monkeypatch, tmp_path, caplog):
    old = tmp_path / "old-ptxas"
    old.write_text("#!/bin/sh\ncase \"$1\" in\n"
                   "--version) echo 'Cuda compilation tools, release 11.7, V11.7.64';;\n"
                   "--help) echo \"Allowed values for this option:  'sm_75','sm_80','sm_86'\";;\n"
                   "*) echo 'should not assemble' >&2; exit 1;;\nesac\n")
    old.chmod(0o755)
    monkeypatch.setenv("DIFFTAPE_PTXAS", str(old))
    with caplog.at_level(logging.INFO, logger="difftape"):
        launcher = _run_here(tmp_path)
    _jit_logged(caplog, "is older than this device needs: it cannot assemble for sm_90")
    assert device.images == ["ptx"] and launcher.loads.ptx_jit == 1


def test_a_ptxas_newer_than_the_driver_is_not_used(monkeypatch, tmp_path, caplog):
    drv = use(monkeypatch, FakeDriver(driver_version=11080), code="cuda")  # a CUDA 11.8 driver
    try:
        with caplog.at_level(logging.INFO, logger="difftape"):
            launcher = _run_here(tmp_path)
        _jit_logged(caplog, "is newer than the driver (CUDA 11.8), which cannot load its cubins")
        assert drv.images == ["ptx"] and launcher.loads.ptx_jit == 1
    finally:
        ti.reset()


def test_a_cubin_the_driver_refuses_is_replaced_by_the_jit(device, tmp_path, caplog):
    device.refuse_cubins = True
    with caplog.at_level(logging.INFO, logger="difftape"):
        launcher = _run_here(tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("refused the cubin of wave" in m and "through the CUDA driver's JIT" in m
               for m in warnings), warnings
    assert launcher.loads.as_dict() == {"cubin_cached": 0, "cubin_assembled": 1, "ptx_jit": 1}
    assert device.images == ["ptx"]  # the refused cubin is not recorded as loaded


def test_the_log_names_ptxas_and_the_cache(device, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="difftape"):
        _run_here(tmp_path)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("kernels assembled by ptxas" in m and "for sm_90" in m and
               str(tmp_path / "cache") in m for m in infos), infos
    assert device.images == ["cubin"]
