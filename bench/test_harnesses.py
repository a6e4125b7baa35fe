"""Tests of the Taichi-compatibility harnesses themselves (not of difftape).

Outside the default test paths: run with ``.venv/bin/python -m pytest -q bench/test_harnesses.py``
(a few seconds); the end-to-end run against real Taichi is marked ``bench``
(``-m bench``, ~30 s).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import difftaichi  # noqa: E402
import program_runs  # noqa: E402
import taichi_examples  # noqa: E402
import taichi_suite  # noqa: E402

TAICHI_PYTHON = Path("/work/tivenv/bin/python")


def _alias_python(tmp_path: Path, code: str) -> str:
    """Run ``code`` with the ``taichi`` alias first on the path; its stdout."""
    (tmp_path / "taichi").mkdir()
    (tmp_path / "taichi" / "__init__.py").write_text(
        (BENCH / "taichi_compat" / "alias.py").read_text())
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path,
                       env={"PYTHONPATH": str(tmp_path)}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_alias_is_difftape_and_marks_internals(tmp_path):
    out = _alias_python(tmp_path, """
        import difftape, taichi as ti, taichi.math as tm
        print(ti.f32 is difftape.f32, tm is difftape.math, ti.kernel is difftape.kernel)
        print(ti.TaichiCompilationError is difftape.CompileError)
        try:
            from taichi.lang import impl
            impl.get_runtime().materialize()
        except Exception as e:
            print(type(e).__name__)
        try:
            ti.definitely_not_an_api
        except AttributeError as e:
            print("difftape has no ti.definitely_not_an_api" in str(e))
    """)
    assert out.split() == ["True", "True", "True", "True", "TaichiInternalsUsed", "True"]


def test_alias_says_there_is_no_ggui(tmp_path):
    """difftape has no GGUI: Taichi's tests that need one (ti.ui.Scene's deprecation warning)
    skip, as on a Taichi without it; ti.ui.Scene() itself refuses."""
    out = _alias_python(tmp_path, """
        import taichi as ti
        from taichi._lib import core
        print(core.GGUI_AVAILABLE)
        try:
            ti.ui.Scene()
        except RuntimeError as e:
            print("no GGUI" in str(e))
    """)
    assert out.split() == ["False", "True"]


def test_alias_reports_the_compilation_time(tmp_path):
    # DiffTaichi's smoke_taichi_gpu.py prints get_runtime().prog.get_total_compilation_time()
    # (kernels need a source file: the script is written to one, which -c imports)
    (tmp_path / "compile_time.py").write_text(textwrap.dedent("""
        import taichi as ti
        from taichi.lang import impl
        ti.init(arch=ti.cpu)
        x = ti.field(ti.f32, 4)
        total = impl.get_runtime().prog.get_total_compilation_time
        before = total()

        @ti.kernel
        def k():
            for i in x:
                x[i] = i

        k()
        print(before, total() > before, total() < 60)
    """))
    out = _alias_python(tmp_path, "import compile_time")
    assert out.split() == ["0.0", "True", "True"]


def test_alias_shadows_no_difftape_name(tmp_path):
    out = _alias_python(tmp_path, """
        import difftape, taichi as ti
        print([n for n in dir(difftape) if not n.startswith("__")
               and getattr(ti, n) is not getattr(difftape, n)])
    """)
    assert out.strip() == "[]"


def test_classify_separates_wrong_values_from_refusals():
    wrong = {"outcome": "failed", "exc_type": "builtins.AssertionError", "exc_origin": "test",
             "exc_stmt": "assert x[0] == 2", "message": "assert 1 == 2"}
    assert taichi_suite.classify(wrong) == "wrong_value"
    msg = dict(wrong, exc_stmt="assert e.value.args[0] == 'boom'")
    assert taichi_suite.classify(msg) == "message_differs"
    internal_assert = dict(wrong, exc_origin="backend")
    assert taichi_suite.classify(internal_assert) == "error"
    refused = {"outcome": "failed", "exc_type": "difftape.errors.CompileError",
               "message": "no"}
    assert taichi_suite.classify(refused) == "error"
    accepted = {"outcome": "failed", "exc_type": "_pytest.outcomes.Failed",
                "message": "Failed: DID NOT RAISE <class 'CompileError'>"}
    assert taichi_suite.classify(accepted) == "not_refused"
    assert taichi_suite.classify({"outcome": "failed", "exc_type": "x.TaichiInternalsUsed"}) \
        == "internal"


def test_normalise_groups_one_cause():
    a = taichi_suite._normalise("unsupported op at 0x7f00aa: size 1024\nmore")
    b = taichi_suite._normalise("unsupported op at 0x7f11bb: size 2048")
    assert a == b and "more" not in a


def test_difftaichi_compare_reports_first_difference():
    spec = difftaichi.Example()
    ta = difftaichi.result_lines("[Taichi] version 1.7.4\nIter= 0 Loss= 1.5\ntime 3 ms\n"
                                 "Iter= 1 Loss= 1.25\n", spec)
    same = difftaichi.result_lines("Iter= 0 Loss= 1.5000001\nIter= 1 Loss= 1.25\n", spec)
    off = difftaichi.result_lines("Iter= 0 Loss= 1.5\nIter= 1 Loss= 1.3\n", spec)
    assert [n for _, n in ta] == [[0.0, 1.5], [1.0, 1.25]]
    assert difftaichi.compare(ta, same, 1e-6)[0]
    agree, first, _ = difftaichi.compare(ta, off, 1e-3)
    assert not agree and "1.25" in first and "1.3" in first


def test_difftaichi_drops_the_kernel_profilers_table():
    # ti.profiler.print_kernel_profiler_info() (diffmpm_benchmark.py): timings, in each
    # backend's own words (Taichi's header names its arch: "@ X64")
    table = ("=====\nKernel Profiler(count, default) @ X64 \n=====\n"
             "[      %     total   count |      min       avg       max   ] Kernel name\n"
             "[100.00%   0.007 s      3x |    0.052     2.470     7.114 ms] k_c80_0\n"
             "[100.00%] Total execution time:   0.007 s   number of results: 1\n")
    lines = difftaichi.result_lines(table + "loss= 0.5\n", difftaichi.Example())
    assert lines == [("loss= 0.5", [0.5])]


def test_difftaichi_within_chaos_judges_up_to_taichis_own_horizon():
    spec = difftaichi.Example()

    def lines(*losses):
        return difftaichi.result_lines("".join(f"Iter= {i} Loss= {x!r}\n"
                                               for i, x in enumerate(losses)), spec)

    ta = lines(0.5, 0.25, 3e18)
    nudged = lines(0.5, 0.2501, 2e22)  # Taichi itself moves by 4e-4 at iteration 1
    c = difftaichi.within_chaos(ta, lines(0.5, 0.2503, 1e24), nudged, 1e-7)
    assert c.agree and c.horizon == 4 and c.unjudged == 2  # values 5, 6 beyond the horizon
    assert c.spread == pytest.approx(0.0001 / 0.2503)  # relative to the larger value
    # beyond ten times Taichi's own move at the horizon, or before it: differs
    c = difftaichi.within_chaos(ta, lines(0.5, 0.252, 3e18), nudged, 1e-7)
    assert not c.agree and "0.252" in c.outside and "at Taichi's horizon" in c.outside
    c = difftaichi.within_chaos(ta, lines(0.5000001, 0.25, 3e18), nudged, 1e-7)
    assert not c.agree and "line 1, before" in c.outside
    # a nudge that moves nothing proves nothing
    assert not difftaichi.within_chaos(ta, lines(0.5, 0.2503, 3e18), ta, 1e-7).agree
    assert not difftaichi.within_chaos(ta, lines(0.5, 0.25), nudged, 1e-7).agree


def test_difftaichi_nudge_moves_random_draws_one_ulp(tmp_path):
    script = tmp_path / "ex.py"
    script.write_text("import random\nimport numpy as np\n"
                      "print(repr(np.random.randn()), repr(random.random()), "
                      "repr(float(np.random.rand(3)[2])))\n")
    (tmp_path / "taichi.py").write_text("def init(**kwargs):\n    pass\n")  # a stand-in
    program_runs.write_runner(tmp_path, "taichi", script, [], {})
    outs = []
    for nudge in ({}, {"DIFFTAICHI_NUDGE": "1"}):
        env = {k: v for k, v in os.environ.items() if k != "DIFFTAICHI_NUDGE"} | nudge
        p = subprocess.run([sys.executable, "_run_example.py"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True)
        outs.append([float(v) for v in p.stdout.split()])
    plain, nudged = outs
    assert plain[0] != nudged[0]
    assert nudged == [float(np.nextafter(v, np.inf)) for v in plain]


@pytest.mark.parametrize("chaotic, strict, want", [
    (True, True, "[('arch', 'cpu'), ('default_fp', 'f64'), ('fast_math', False)]"),
    (True, False, "[('arch', 'cpu'), ('default_fp', 'f64')]"),
    (False, True, "[('arch', 'cpu'), ('default_fp', 'f64')]")])
def test_difftaichi_chaotic_scenes_init_without_fast_math(tmp_path, chaotic, strict, want):
    examples = tmp_path / "checkout" / "examples"
    examples.mkdir(parents=True)
    (examples / "ex.py").write_text("import taichi as ti\nreal = ti.f32\n"
                                    "ti.init(arch=ti.gpu, default_fp='f64')\n")
    (examples / "taichi.py").write_text(  # a stand-in that shows what ti.init gets
        "cpu, gpu, f32, f64 = 'cpu', 'gpu', 'f32', 'f64'\n"
        "def init(**kwargs):\n    print(sorted(kwargs.items()))\n")
    work, _ = difftaichi.prepare(tmp_path / "checkout", tmp_path / "work", "taichi", "ex.py",
                                 difftaichi.Example(chaotic=chaotic), 1, strict)
    p = subprocess.run([sys.executable, "_run_example.py"], cwd=work, capture_output=True,
                       text=True, check=True)
    assert p.stdout.strip() == want


def _frames(*arrays):
    return [[("gui.circles", {"0": a, "radius": 1.5})] for a in arrays]


def test_examples_prints_of_parallel_loops_compared_in_any_order():
    t = program_runs.Run(0, 1.0, "block [2, 3]\nblock [1, 1]\n", "")
    d = program_runs.Run(0, 1.0, "block [1, 1]\nblock [2, 3]\n", "")
    ordered = taichi_examples.judge(t, d, [], [], taichi_examples.Spec(), "exact")
    assert ordered["verdict"] == "differs"
    spec = taichi_examples.Spec(unordered_prints=True)
    assert taichi_examples.judge(t, d, [], [], spec, "exact")["verdict"] == "agrees"
    d = program_runs.Run(0, 1.0, "block [1, 1]\nblock [2, 4]\n", "")
    assert taichi_examples.judge(t, d, [], [], spec, "exact")["verdict"] == "differs"


def test_examples_compare_reports_the_first_differing_element():
    a = np.linspace(0, 1, 12, dtype=np.float32).reshape(6, 2)
    assert not taichi_examples.compare_frames(_frames(a), _frames(a * (1 + 1e-5)), "exact",
                                              None).where
    off = a.copy()
    off[4, 1] += 0.05
    d = taichi_examples.compare_frames(_frames(a, a), _frames(a, off), "exact", None)
    assert d.where.startswith("frame 1, call 0 gui.circles, argument 0, index [4, 1]")
    assert "1 of 12 elements differ" in d.where
    # a chaotic scene judged on its first frame: later values are not held, shapes are
    assert not taichi_examples.compare_frames(_frames(a, a), _frames(a, off), "exact", 1).where
    assert "(6, 2) (Taichi) vs ndarray (3, 2)" in taichi_examples.compare_frames(
        _frames(a, a), _frames(a, a[:3]), "exact", 1).where
    img = np.full((4, 4, 3), 200, np.uint8)
    assert not taichi_examples.compare_frames(_frames(img), _frames(img + 1), "exact", None).where
    assert taichi_examples.compare_frames(_frames(img), _frames(img + 2), "exact", None).where
    more = [[("gui.circles", {"0": a}), ("gui.lines", {"0": a})]]
    assert "gui.lines" in taichi_examples.compare_frames(_frames(a), more, "exact", None).where


def test_examples_compare_rows_appended_in_any_order_and_written_files():
    a = np.arange(12.0).reshape(6, 2)
    b = np.arange(6.0)
    perm = [3, 0, 5, 1, 4, 2]
    ta = [[("gui.triangles", {"0": a, "1": b, "color": 7})]]
    da = [[("gui.triangles", {"0": a[perm], "1": b[perm], "color": 7})]]
    assert taichi_examples.compare_frames(ta, da, "exact", None).where
    assert not taichi_examples.compare_frames(ta, da, "exact", None, unordered=True).where
    broken = [[("gui.triangles", {"0": a[perm], "1": b, "color": 7})]]  # rows torn apart
    assert taichi_examples.compare_frames(ta, broken, "exact", None, unordered=True).where
    d = taichi_examples.Diff()
    taichi_examples.compare_files({"m.ply": b"ply 1.5 2\n"}, {"m.ply": b"ply 1.5000001 2\n"},
                                  "exact", d)
    assert not d.where and d.values == 2  # 1.5 and 2 (1.5000001 within RTOL)
    taichi_examples.compare_files({"m.ply": b"ply 1.5 2\n"}, {"m.ply": b"ply 1.6 2\n"},
                                  "exact", d)
    assert d.where.startswith("file m.ply: line 1: Taichi 1.5 / difftape 1.6")
    d = taichi_examples.Diff()
    taichi_examples.compare_files({"a.bin": b"\x00\x01"}, {"b.bin": b""}, "exact", d)
    assert "files written" in d.where


def test_examples_compare_random_states_by_distribution():
    rng = np.random.default_rng(1)
    a, b = rng.random((4000, 2)), rng.random((4000, 2))
    assert not taichi_examples.compare_frames(_frames(a), _frames(b), "distribution", None).where
    d = taichi_examples.compare_frames(_frames(a), _frames(b + [0, 0.05]), "distribution", None)
    assert "component 1: mean" in d.where
    assert taichi_examples.mode(taichi_examples.Spec(), "x[i] = ti.random() * 2") \
        == "distribution"
    assert taichi_examples.mode(taichi_examples.Spec(judged=2), "x[i] = 2") == "first 2 frames"


def test_examples_recording_gui_keeps_what_each_frame_draws(tmp_path):
    script = tmp_path / "ex.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import taichi as ti
        ti.init(arch=ti.gpu)
        pos = np.zeros((3, 2))
        gui = ti.GUI("x", res=(64, 32))
        while gui.running:
            pos += 1
            gui.circles(pos, radius=2, color=0xFF0000)
            gui.text(f"frame {gui.frame}", (0, 1))
            gui.show()
            if gui.frame == 3:
                break
        print("loop ended", ti.GUI.ESCAPE != ti.GUI.SPACE)
        window = ti.ui.Window("w", (8, 8))
        scene, camera = window.get_scene(), ti.ui.Camera()
        camera.position(0, 1, 2)
        for i in range(100):  # never looks at window.running: ended by the frame limit
            scene.set_camera(camera)
            scene.particles(pos * i, radius=0.1)
            window.get_canvas().set_image(np.full((2, 2), i, np.float32))
            window.show()
    """))
    (tmp_path / "taichi.py").write_text(  # a stand-in backend: what ti.init gets
        "cpu, gpu = 'cpu', 'gpu'\ndef init(**kwargs):\n    print(sorted(kwargs.items()))\n")
    program_runs.write_runner(tmp_path, "taichi", script, [], {"fast_math": False},
                              gui="record", frames=5, record=str(tmp_path / "_frames.pkl"))
    p = subprocess.run([sys.executable, "_run_example.py"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == ["[('arch', 'cpu'), ('fast_math', False)]",
                                        "loop ended True"]
    frames = taichi_examples.load_frames(tmp_path)
    assert len(frames) == 5
    assert [c for c, _ in frames[0]] == ["gui.GUI", "gui.circles", "gui.text"]
    assert frames[0][1][1]["0"].tolist() == [[1, 1]] * 3  # taken at the call, not at the end
    assert frames[2][0][1]["0"].tolist() == [[3, 3]] * 3
    assert frames[2][1][1]["0"] == "frame 2" and frames[2][1][1]["1"].tolist() == [0, 1]
    assert [c for c, _ in frames[4]] == ["scene.set_camera", "scene.particles",
                                         "canvas.set_image"]
    assert frames[4][0][1]["position"].tolist() == [0, 1, 2]
    assert frames[4][1][1]["0"].tolist() == [[3, 3]] * 3  # i = 1
    assert frames[4][2][1]["0"].tolist() == [[1, 1], [1, 1]]


@pytest.mark.bench
@pytest.mark.skipif(not TAICHI_PYTHON.exists(), reason="needs Taichi 1.7.4 in /work/tivenv")
def test_suite_end_to_end_detects_each_kind(tmp_path):
    """A fake checkout whose tests misbehave only on difftape: each kind lands in its list."""
    tests = tmp_path / "checkout" / "tests"
    (tests / "python").mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (tests / "python" / "__init__.py").write_text("")
    (tests / "test_utils.py").write_text(
        "import pytest\n"
        "def test(arch=None, **options):\n"
        "    def deco(f):\n"
        "        f.__ti_test__ = True\n"
        "        import taichi as ti\n"
        "        return pytest.mark.parametrize('req_arch,req_options', [(ti.cpu, options)],"
        " ids=['arch=x64'])(f)\n"
        "    return deco\n")
    (tests / "python" / "test_fake.py").write_text(textwrap.dedent("""
        import os, signal, time
        import taichi as ti
        from tests import test_utils
        ON_DIFFTAPE = hasattr(ti, "DifftapeError")

        @test_utils.test()
        def test_ok():
            assert 1 == 1

        @test_utils.test()
        def test_value():
            assert (0.5 if ON_DIFFTAPE else 1.0) == 1.0

        @test_utils.test()
        def test_hang():
            if ON_DIFFTAPE:
                time.sleep(60)

        @test_utils.test()
        def test_crash():
            if ON_DIFFTAPE:
                os.kill(os.getpid(), signal.SIGSEGV)

        @test_utils.test()
        def test_after():
            assert 2 == 2
    """))
    out = tmp_path / "report"
    subprocess.run([sys.executable, str(BENCH / "taichi_suite.py"), "--checkout",
                    str(tmp_path / "checkout"), "--output", str(out), "--test-timeout", "4",
                    "--taichi-python", str(TAICHI_PYTHON)], check=True, capture_output=True)
    a = json.loads(out.with_suffix(".json").read_text())["analysis"]
    assert [w["test"] for w in a["wrong_values"]] == ["test_fake.py::test_value[arch=x64]"]
    assert [h["test"] for h in a["hangs"]] == ["test_fake.py::test_hang[arch=x64]"]
    assert [c["test"] for c in a["crashes"]] == ["test_fake.py::test_crash[arch=x64]"]
    assert a["totals"]["all"]["taichi_passed"] == 5 and a["totals"]["all"]["passed"] == 2


def test_compare_remote_lists_what_passes_only_locally():
    run = taichi_suite.FileRun
    local = run("test_a.py", tests={"test_a.py::ok": {"outcome": "passed"},
                                    "test_a.py::value": {"outcome": "passed"},
                                    "test_a.py::gone": {"outcome": "passed"},
                                    "test_a.py::both_fail": {"outcome": "failed"}})
    remote = run("test_a.py", tests={
        "test_a.py::ok": {"outcome": "passed"},
        "test_a.py::value": {"outcome": "failed", "exc_type": "builtins.AssertionError",
                             "message": "assert 0.5 == 1.0"},
        "test_a.py::both_fail": {"outcome": "passed"}})
    cmp = taichi_suite.compare_remote({"test_a.py": local}, {"test_a.py": remote})
    assert cmp["totals"]["local_passed"] == 3 and cmp["totals"]["passed"] == 1
    assert cmp["totals"]["remote_only_passed"] == 1
    assert {(r["test"], r["kind"]) for r in cmp["differences"]} == {
        ("test_a.py::value", "wrong_value"), ("test_a.py::gone", "error")}
    assert "assert N == N" in taichi_suite.markdown_remote(cmp)


@pytest.mark.bench
def test_suite_remote_backend_runs_each_test_on_a_server(tmp_path):
    """``--backends difftape,difftape-remote``: the second run's kernels run on the harness's
    server (its ``ti.init`` gives a remote program), and what differs is listed."""
    tests = tmp_path / "checkout" / "tests"
    (tests / "python").mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (tests / "python" / "__init__.py").write_text("")
    (tests / "test_utils.py").write_text("")  # the difftape backends bring their own
    (tests / "python" / "test_fake.py").write_text(textwrap.dedent("""
        import taichi as ti
        from tests import test_utils

        @test_utils.test()
        def test_kernel():
            x = ti.field(ti.f32, shape=4)

            @ti.kernel
            def fill():
                for i in x:
                    x[i] = i * 0.5

            fill()
            assert x.to_numpy().tolist() == [0, 0.5, 1, 1.5]

        @test_utils.test()
        def test_remote_differs():
            assert ti.lang.impl.current_cfg().arch != ti.remote
    """))
    out = tmp_path / "report"
    subprocess.run([sys.executable, str(BENCH / "taichi_suite.py"), "--checkout",
                    str(tmp_path / "checkout"), "--output", str(out), "--backends",
                    "difftape,difftape-remote"], check=True, capture_output=True)
    cmp = json.loads(out.with_suffix(".json").read_text())["remote"]
    assert cmp["totals"]["local_passed"] == 2 and cmp["totals"]["passed"] == 1
    assert [(r["test"], r["kind"]) for r in cmp["differences"]] == [
        ("test_fake.py::test_remote_differs[arch=x64]", "wrong_value")]
    assert "difftape locally vs arch=ti.remote" in out.with_suffix(".md").read_text()


def test_graph_benchmark_overhead_graph_runs_every_launch():
    # bench/graph.py's overhead graph: every captured launch runs at each replay (it checks
    # the sum itself and raises otherwise)
    import graph

    import difftape as ti

    ti.init(arch=ti.cpu)
    try:
        per_launch, eager = graph.launch_overhead(ti, 50, 2)
    finally:
        ti.reset()
    assert 0 < per_launch < eager
def _busy(python: str, backend: str) -> dict:
    p = subprocess.run([python, str(BENCH / "busy.py"), "--backend", backend, "--json",
                        "--repeat", "1", "--rounds", "2", "--warmup", "1"],
                       capture_output=True, text=True, timeout=600)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "error" not in out, out.get("traceback")
    return out


def test_busy_times_quiet_and_busy_rounds_and_stops_its_spinner():
    before = subprocess.run(["pgrep", "-f", "^" + sys.executable + " -c import os"],
                            capture_output=True, text=True).stdout.split()
    out = _busy(sys.executable, "difftape")
    assert [r["label"] for r in out["rows"]] == [
        "busy: MPM iteration, quiet", "busy: MPM iteration, second core busy",
        "busy: slowdown (busy / quiet)"]
    assert len(out["quiet_s"]) == len(out["busy_s"]) == 2
    assert out["rows"][2]["value"] == pytest.approx(out["rows"][1]["value"]
                                                    / out["rows"][0]["value"])
    assert out["pool"]["launches"] > 0 and "load avg" in out["notes"]
    after = subprocess.run(["pgrep", "-f", "^" + sys.executable + " -c import os"],
                           capture_output=True, text=True).stdout.split()
    assert after == before  # the spinners were stopped


@pytest.mark.bench
@pytest.mark.skipif(not TAICHI_PYTHON.exists(), reason="needs Taichi 1.7.4 in /work/tivenv")
def test_busy_runs_the_same_iterations_on_taichi():
    ours, theirs = _busy(sys.executable, "difftape"), _busy(str(TAICHI_PYTHON), "taichi")
    loss = [float(o["notes"].split("loss=")[1].split(";")[0]) for o in (ours, theirs)]
    assert loss[0] == pytest.approx(loss[1], rel=1e-4)
    assert [r["label"] for r in ours["rows"]] == [r["label"] for r in theirs["rows"]]


def test_service_ray_runs_at_a_tiny_size():
    """bench/service_ray.py end to end (a Ray cluster, three gateways) at token sizes: every
    figure is there and no launch failed."""
    pytest.importorskip("ray", reason="the Ray extra is not installed")
    r = subprocess.run([sys.executable, str(BENCH / "service_ray.py"), "--tiny", "--json"],
                       cwd=BENCH, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "error" not in out, out.get("traceback")
    assert out["load"]["errors"] == 0 and out["load"]["clients"] == 2
    assert out["load"]["done"] == 2 * out["load"]["launches"]
    assert out["ratio"] > 0 and out["transfer_ratio"] > 0
    assert out["transfer_across_nodes_ratio"] > 0
    assert len(out["rows"]) == 13


@pytest.mark.bench
@pytest.mark.skipif(not TAICHI_PYTHON.exists(), reason="needs Taichi 1.7.4 in /work/tivenv")
def test_compile_times_logs_each_kernel_on_both_backends(tmp_path):
    """bench/compile_times.py on one example: both backends log a first-launch compilation of
    each of its kernels (the timings themselves are not judged: they depend on the load)."""
    import compile_times

    out = tmp_path / "ct"
    assert compile_times.main(["--output", str(out), "--only", "taichi_bitmasked.py",
                               "--difftaichi", ""]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    r = report["examples"]["features/sparse/taichi_bitmasked.py"]
    for backend in ("difftape", "taichi"):
        # (Taichi's own kernels, as to_numpy's tensor_to_ext_arr, are logged too)
        assert {"activate", "paint_active_pixels"} <= set(r[backend]), (backend, r)
        assert all(s > 0 for s in r[backend].values())
    assert "| features/sparse/taichi_bitmasked.py | 2 |" in out.with_suffix(".md").read_text()
