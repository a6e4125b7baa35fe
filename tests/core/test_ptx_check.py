"""The PTX check (difftape/codegen/ptx_check.py): a kernel that cannot be compiled for the CUDA
target fails the check by name and reason; one that can is compiled and assembled."""

import itertools
import shutil

import pytest

import difftape as ti
from difftape.codegen import cuda, llvm_lowering, ptx_check
from difftape.errors import CompileError

pytestmark = pytest.mark.difftape_only


@pytest.fixture
def check(tmp_path, monkeypatch):
    """A check of its own (instead of the session's, if any), with a placeholder ptxas."""
    ti.init(arch=ti.cpu, offline_cache=False)
    c = ptx_check.PTXCheck(arch=cuda.DEFAULT_ARCH, ptxas=shutil.which("true"),
                           directory=str(tmp_path), jobs=1)
    monkeypatch.setattr(llvm_lowering, "observers", [c])
    yield c
    c.finish()
    ti.reset()


def _kernels():
    x = ti.field(ti.f32, shape=16)

    @ti.kernel
    def fill_ones():
        for i in x:
            x[i] = 1.0

    @ti.kernel
    def double_up():
        for i in x:
            x[i] *= 2.0

    return fill_ones, double_up


def test_ptxas_rejection_names_the_kernel(check):
    check.ptxas = shutil.which("false")
    fill_ones, double_up = _kernels()
    fill_ones()
    double_up()
    failures = check.finish()
    assert check.kernels == 2 and check.modules == 2
    # Both were in one batch; the batch failed, so each was tried alone.
    assert sorted((f.kernel, f.stage) for f in failures) == [("double_up", "ptxas"),
                                                              ("fill_ones", "ptxas")]


def test_cuda_lowering_refusal_is_a_listed_failure(check, monkeypatch):
    def refuse(self, low, *args, **kwargs):
        raise CompileError("no such thing on the GPU", kernel=low.ir.name)

    monkeypatch.setattr(cuda.CUDATarget, "private_copy", refuse)
    monkeypatch.setattr(cuda.CUDATarget, "loop_hint", refuse)
    fill_ones, _ = _kernels()
    fill_ones()  # the CPU kernel still runs
    failures = check.finish()
    assert [(f.kernel, f.stage) for f in failures] == [("fill_ones", "lowering")]
    assert "no such thing on the GPU" in failures[0].reason


@pytest.mark.skipif(ptx_check.available() is not None,
                    reason=f"PTX check unavailable: {ptx_check.available()}")
def test_kernels_assemble_and_repeats_are_checked_once(check, tmp_path):
    check.ptxas = shutil.which("ptxas")
    fill_ones, double_up = _kernels()
    fill_ones()
    double_up()
    double_up()
    assert check.finish() == []
    assert check.modules == 2
    assert len(list(tmp_path.glob("*.ptx"))) == 1  # one batch


def test_a_kernel_loaded_from_the_disk_cache_is_checked(tmp_path, monkeypatch):
    """A second run finds its CPU code in the offline cache; its PTX is checked all the same
    (ptxas here refuses everything, so a checked kernel is a listed failure)."""
    from difftape.frontend import field as field_module
    from difftape.runtime import cache

    cache_dir = tmp_path / "cache"
    for run in ("cold", "warm"):
        cache.clear_memory()  # a new process: only the disk cache is warm, field ids
        monkeypatch.setattr(field_module, "_field_ids", itertools.count(1000))  # start over
        ti.init(arch=ti.cpu, offline_cache=True, offline_cache_file_path=str(cache_dir))
        c = ptx_check.PTXCheck(arch=cuda.DEFAULT_ARCH, ptxas=shutil.which("false"),
                               directory=str(tmp_path), jobs=1)
        monkeypatch.setattr(llvm_lowering, "observers", [c])
        fill_ones, _ = _kernels()
        fill_ones()
        failures = c.finish()
        ti.reset()
        assert [(f.kernel, f.stage) for f in failures] == [("fill_ones", "ptxas")], run
        assert (c.kernels, c.cached) == ((1, 0) if run == "cold" else (1, 1)), run
    assert any(cache_dir.rglob("*.o"))  # the warm run did load from disk


def test_verdicts_skip_only_what_this_toolchain_accepted(tmp_path, monkeypatch):
    """With a verdicts directory, a module accepted once is not assembled again by the same
    toolchain; a refused one leaves no verdict (checked again next time), and another
    toolchain (here: another ptxas version string) checks everything anew."""
    verdicts = tmp_path / "verdicts"
    verdicts.mkdir()

    def run(ptxas: str, toolchain: str = "t1") -> ptx_check.PTXCheck:
        ti.init(arch=ti.cpu, offline_cache=False)
        c = ptx_check.PTXCheck(arch=cuda.DEFAULT_ARCH, ptxas=shutil.which(ptxas),
                               directory=str(tmp_path), jobs=1, verdicts=str(verdicts),
                               toolchain=toolchain)
        monkeypatch.setattr(llvm_lowering, "observers", [c])
        fill_ones, double_up = _kernels()
        fill_ones()
        double_up()
        c.finish()
        ti.reset()
        return c

    refused = run("false")
    assert len(refused.failures) == 2 and refused.known == 0
    assert not any(verdicts.iterdir())  # failures are never remembered
    first = run("true")
    assert first.failures == [] and first.known == 0 and len(list(verdicts.iterdir())) == 2
    again = run("false")  # would refuse: but both modules were accepted by this toolchain
    assert again.failures == [] and (again.modules, again.known) == (2, 2)
    other = run("false", toolchain="t2")  # another ptxas: checked again, and refused
    assert len(other.failures) == 2 and other.known == 0
