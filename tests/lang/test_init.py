"""ti.init options (default_fp, default_ip, random_seed elsewhere), ti.reset, ti.sync and
ti.profiler."""

import warnings

import numpy as np
import pytest


def test_default_fp_f64_makes_float_fields_and_literals_f64(ti):
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    x = ti.field(float, shape=2)
    assert x.dtype == ti.f64
    assert x.to_numpy().dtype == np.float64

    @ti.kernel
    def run():
        x[0] = 1.0 + 1e-10  # needs f64 to survive
        x[1] = ti.sqrt(2.0)

    run()
    assert x[0] == 1.0 + 1e-10
    assert x[1] == np.sqrt(2.0)


def test_default_fp_f32_is_the_default(ti):
    ti.init(arch=ti.cpu)
    x = ti.field(float, shape=())
    assert x.dtype == ti.f32

    @ti.kernel
    def run():
        x[None] = 1.0 + 1e-10

    run()
    assert x[None] == 1.0
    assert x.to_numpy().dtype == np.float32


def test_default_ip_i64(ti):
    ti.init(arch=ti.cpu, default_ip=ti.i64)
    x = ti.field(int, shape=())
    assert x.dtype == ti.i64

    @ti.kernel
    def run(a: int) -> int:
        b = a * 4  # int locals and args are 64-bit: no wrap-around at 2**31
        x[None] = b + 1
        return b

    assert run(2**31) == 2**33
    assert x[None] == 2**33 + 1


def test_default_ip_is_i32(ti):
    ti.init(arch=ti.cpu)
    x = ti.field(int, shape=())
    assert x.dtype == ti.i32


def test_reset_then_init_gives_a_fresh_program(ti):
    x = ti.field(ti.i32, shape=3)
    x.fill(5)

    @ti.kernel
    def total() -> ti.i32:
        s = 0
        for i in range(3):
            s += x[i]
        return s

    assert total() == 15
    ti.reset()
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    y = ti.field(float, shape=3)
    assert y.dtype == ti.f64
    np.testing.assert_array_equal(y.to_numpy(), np.zeros(3))  # fresh memory, zeroed

    @ti.kernel
    def fill():
        for i in y:
            y[i] = i + 0.5

    fill()
    np.testing.assert_array_equal(y.to_numpy(), [0.5, 1.5, 2.5])


def test_init_twice_without_reset(ti):
    ti.init(arch=ti.cpu)
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    x = ti.field(float, shape=())
    assert x.dtype == ti.f64


def test_sync_waits_for_kernels(ti):
    x = ti.field(ti.i32, shape=1000)

    @ti.kernel
    def fill():
        for i in x:
            x[i] = i

    fill()
    ti.sync()
    assert int(x.to_numpy().sum()) == 999 * 1000 // 2


def test_unknown_init_options_raise_key_error(ti):
    with pytest.raises(KeyError, match="foo_bar"):
        ti.init(arch=ti.cpu, foo_bar=3)
    with pytest.raises(KeyError, match="default_up"):
        ti.init(arch=ti.cpu, default_up=ti.u64)


@pytest.mark.difftape_only
def test_unknown_init_option_keeps_the_current_program(ti):
    x = ti.field(ti.i32, shape=2)
    with pytest.raises(ti.UnknownOptionError) as info:
        ti.init(arch=ti.cpu, foo_bar=3, fast_mth=True)
    assert "foo_bar, fast_mth" in str(info.value)
    assert isinstance(info.value, ti.DifftapeError)
    x[1] = 4  # the program was not reset by the refused call
    assert x[1] == 4


def test_taichi_options_without_effect_leave_results_unchanged(ti):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ti.init(arch=ti.cpu, advanced_optimization=True, ad_stack_size=64,
                default_cpu_block_dim=32, log_level="warn", short_circuit_operators=False)
    x = ti.field(ti.f32, shape=8)

    @ti.kernel
    def run():
        for i in x:
            x[i] = ti.sqrt(i * 1.0)

    run()
    np.testing.assert_allclose(x.to_numpy(), np.sqrt(np.arange(8.0)), rtol=1e-6)


@pytest.mark.difftape_only
def test_options_without_effect_warn_once_saying_why(ti):
    from difftape.runtime import program

    program._warned.discard("ad_stack_size")
    with pytest.warns(UserWarning, match=r"ad_stack_size=.*no effect: .*grow"):
        ti.init(arch=ti.cpu, ad_stack_size=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ti.init(arch=ti.cpu, ad_stack_size=64)  # once per process


@pytest.mark.difftape_only
def test_options_difftape_cannot_honour_are_refused(ti):
    with pytest.raises(ti.OptionError, match="arch=ti.remote"):
        ti.init(arch=ti.cpu, server="http://localhost:1")


def test_enable_fallback_false_refuses_an_arch_that_cannot_run(ti):
    """Taichi's enable_fallback=False: no CUDA device is a RuntimeError, not the CPU."""
    try:
        ti.init(arch=ti.cuda, enable_fallback=False)
    except RuntimeError as e:
        assert "cuda" in str(e).lower()
    else:
        pytest.skip("a CUDA device is usable here: nothing to refuse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's warning)
        ti.init(arch=ti.cuda)  # enable_fallback=True, the default: the CPU
    x = ti.field(ti.f32, shape=3)

    @ti.kernel
    def k():
        for i in x:
            x[i] = i + 0.5

    k()
    assert x.to_numpy().tolist() == [0.5, 1.5, 2.5]


@pytest.mark.difftape_only
def test_every_option_is_accepted_or_refused_by_its_table_entry(ti):
    """The option table is the one place that names ti.init's keywords."""
    from difftape.runtime import program

    for name, opt in program.OPTIONS.items():
        if opt.convert is None and not opt.no_effect and not opt.refusal:
            continue  # arch=ti.remote's own
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sample = {"log_level": "warn"}.get(name, 0)  # a value the option takes
            ti.init(arch=ti.cpu, **{name: opt.only if opt.refusal else
                                    (opt.convert(sample) if opt.convert else 1)})
    ti.init(arch=ti.cpu)


@pytest.mark.difftape_only
def test_print_ir(ti, capsys):
    ti.init(arch=ti.cpu, print_ir=True)
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def scaled_copy_for_print():
        for i in x:
            x[i] = i * 2.0

    scaled_copy_for_print()
    out = capsys.readouterr().out
    assert "kernel scaled_copy_for_print" in out and "store" in out
    np.testing.assert_array_equal(x.to_numpy(), [0, 2, 4, 6])


def test_kernel_profiler_records_each_launch(ti, capsys):
    ti.init(arch=ti.cpu, kernel_profiler=True)
    x = ti.field(ti.f32, shape=200_000)

    @ti.kernel
    def profiled_sines():
        for i in x:
            x[i] = ti.sin(i * 1e-3)

    for _ in range(3):
        profiled_sines()
    r = ti.profiler.query_kernel_profiler_info("profiled_sines")
    assert r.counter == 3
    assert 0 < r.min <= r.avg <= r.max
    assert ti.profiler.get_kernel_profiler_total_time() >= 3 * r.min / 1000 * 0.999
    ti.profiler.print_kernel_profiler_info()
    assert "profiled_sines" in capsys.readouterr().out
    ti.profiler.print_kernel_profiler_info("trace")
    assert capsys.readouterr().out.count("profiled_sines") == 3
    ti.profiler.clear_kernel_profiler_info()
    assert ti.profiler.query_kernel_profiler_info("profiled_sines").counter == 0
    np.testing.assert_allclose(x.to_numpy()[:5], np.sin(np.arange(5) * 1e-3), rtol=1e-6)


def _current_arch(ti):
    """The arch the current program runs on (Taichi: its config; difftape: its program's)."""
    if ti.__name__ == "taichi":
        return ti.lang.impl.current_cfg().arch
    from difftape.runtime import program

    return program.get().config.arch


def test_ti_arch_overrides_the_arch_given_to_init(ti, monkeypatch):
    """Taichi programs pick their backend with TI_ARCH (Taichi's arch names), whatever their
    ti.init line says: the environment wins, with no fallback warning."""
    monkeypatch.setenv("TI_ARCH", "x64")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ti.init(arch=ti.cuda)
    assert _current_arch(ti) == ti.cpu
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def run():
        for i in x:
            x[i] = i * 0.5

    run()
    np.testing.assert_array_equal(x.to_numpy(), np.arange(4) * 0.5)


@pytest.mark.difftape_only
def test_ti_arch_gpu_names_fall_back_saying_where_the_arch_came_from(ti, monkeypatch):
    monkeypatch.setenv("TI_ARCH", "vulkan")
    with pytest.warns(UserWarning, match=r"TI_ARCH=vulkan has no backend here yet"):
        ti.init(arch=ti.cpu)
    assert _current_arch(ti) == ti.cpu


@pytest.mark.difftape_only
@pytest.mark.parametrize("var,value", [("TI_ARCH", "cpu"), ("TI_ARCH", "remote"),
                                       ("DIFFTAPE_ARCH", "x86"), ("TI_ARCH", "CUDA")])
def test_unknown_arch_names_in_the_environment_are_refused(ti, monkeypatch, var, value):
    """Taichi aborts on a TI_ARCH it does not know (``cpu`` included: its name is ``x64``);
    difftape refuses it with an error that lists the names."""
    monkeypatch.setenv(var, value)
    x = ti.field(ti.i32, shape=2)
    with pytest.raises(ti.OptionError, match=rf"{var}='{value}' is not an arch name.*x64"):
        ti.init(arch=ti.cpu)
    x[1] = 3  # the refused call left the current program alone
    assert x[1] == 3


@pytest.mark.difftape_only
def test_difftape_arch_comes_before_ti_arch_and_empty_means_unset(ti, monkeypatch):
    monkeypatch.setenv("TI_ARCH", "cuda")
    monkeypatch.setenv("DIFFTAPE_ARCH", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TI_ARCH=cuda would warn of the CPU fallback
        ti.init(arch=ti.gpu)
    assert _current_arch(ti) == ti.cpu
    monkeypatch.setenv("TI_ARCH", "")
    monkeypatch.setenv("DIFFTAPE_ARCH", "")
    with pytest.warns(UserWarning, match=r"arch=cuda cannot run on a GPU here: .+; falling "
                                         r"back to the CPU"):
        ti.init(arch=ti.cuda)


@pytest.mark.difftape_only
def test_difftape_arch_cpu_runs_a_remote_program_here(ti, monkeypatch):
    """A program written for ti.remote runs locally under DIFFTAPE_ARCH=cpu; its server and
    token options have nothing to do there, and the warning says so."""
    monkeypatch.setenv("DIFFTAPE_ARCH", "cpu")
    with pytest.warns(UserWarning, match=r"DIFFTAPE_ARCH=cpu runs this program here.*server="):
        ti.init(arch=ti.remote, server="http://127.0.0.1:1", token="t")
    assert _current_arch(ti) == ti.cpu
    x = ti.field(ti.i32, shape=())
    x[None] = 7
    assert x[None] == 7


@pytest.mark.difftape_only
def test_difftape_arch_remote_keeps_the_remote_refusals(ti, monkeypatch):
    monkeypatch.setenv("DIFFTAPE_ARCH", "remote")
    with pytest.raises(ti.OptionError, match=r"kernel_profiler=True.*DIFFTAPE_ARCH=remote"):
        ti.init(arch=ti.cpu, kernel_profiler=True)


def test_logging_levels_under_taichis_names(ti):
    """ti.set_logging_level / ti.is_logging_effective with Taichi's level constants; every
    ti.init sets the level again (log_level=, 'info' by default)."""
    assert [ti.TRACE, ti.DEBUG, ti.INFO, ti.WARN, ti.ERROR, ti.CRITICAL] == \
        ["trace", "debug", "info", "warn", "error", "critical"]
    ti.set_logging_level(ti.WARN)
    assert not ti.is_logging_effective(ti.INFO)
    assert ti.is_logging_effective(ti.WARN) and ti.is_logging_effective(ti.ERROR)
    ti.set_logging_level(ti.TRACE)
    assert ti.is_logging_effective(ti.TRACE) and ti.is_logging_effective(ti.DEBUG)
    ti.init(arch=ti.cpu, log_level=ti.ERROR)
    assert not ti.is_logging_effective(ti.WARN) and ti.is_logging_effective(ti.CRITICAL)
    ti.init(arch=ti.cpu)
    assert ti.is_logging_effective(ti.INFO) and not ti.is_logging_effective(ti.DEBUG)


def test_unknown_logging_level_is_refused(ti):
    with pytest.raises(Exception, match="Unknown logging level"):
        ti.set_logging_level("loud")
    with pytest.raises(Exception, match="Unknown logging level"):
        ti.init(arch=ti.cpu, log_level="loud")
    ti.init(arch=ti.cpu)


def test_options_from_ti_environment_variables(ti, monkeypatch):
    """Taichi reads TI_<OPTION> for the ti.init options it was not given (TI_DEBUG=1 turns
    the index checks on) and TI_DEFAULT_FP/TI_DEFAULT_IP; an argument wins."""
    monkeypatch.setenv("TI_DEBUG", "1")
    monkeypatch.setenv("TI_DEFAULT_FP", "64")
    monkeypatch.setenv("TI_LOG_LEVEL", "error")
    ti.init(arch=ti.cpu)
    x = ti.field(float, shape=4)
    assert x.dtype == ti.f64
    assert not ti.is_logging_effective(ti.WARN)

    @ti.kernel
    def poke(i: ti.i32):
        x[i] = 1.0

    with pytest.raises(AssertionError):
        poke(4)
    ti.init(arch=ti.cpu, debug=False, default_fp=ti.f32, log_level=ti.INFO)
    assert ti.field(float, shape=2).dtype == ti.f32 and ti.is_logging_effective(ti.INFO)
    monkeypatch.setenv("TI_DEBUG", "0")
    monkeypatch.delenv("TI_DEFAULT_FP")
    monkeypatch.delenv("TI_LOG_LEVEL")
    ti.init(arch=ti.cpu)
    y = ti.field(ti.f32, shape=4)

    @ti.kernel
    def poke_inside(i: ti.i32):
        y[i % 4] = 1.0

    poke_inside(6)
    assert y[2] == 1.0


@pytest.mark.difftape_only
def test_check_out_of_bound_checks_indices_without_debug():
    """Taichi's ``check_out_of_bound=True``: field and ndarray indices are checked (what the
    server compiles every kernel with), without the rest of ``debug=True`` (asserts,
    integer-overflow reports)."""
    import difftape as ti

    ti.init(arch=ti.cpu, check_out_of_bound=True)
    x = ti.field(ti.i32, shape=4)

    @ti.kernel
    def poke(i: ti.i32, a: ti.i32):
        assert a == 0, "asserts need debug=True"
        x[i] = a

    poke(3, 1)  # the assert is not compiled: it would fail
    with pytest.raises(ti.KernelAssertionError):
        poke(4, 0)
        ti.sync()  # (on a grid the launch is asynchronous: its error comes at a sync point)
    assert x.to_numpy().tolist() == [0, 0, 0, 1]
    ti.reset()


def test_init_test_mode_checks_and_returns_the_special_settings(ti, monkeypatch):
    """ti.init(_test_mode=True, ...) (Taichi's argument check): the options are checked and
    returned, from the arguments or TI_<NAME>, and not applied (the logging level stays)."""
    monkeypatch.delenv("TI_LOG_LEVEL", raising=False)
    monkeypatch.delenv("TI_GDB_TRIGGER", raising=False)
    ti.set_logging_level("info")
    cfg = ti.init(_test_mode=True)
    assert (cfg.log_level, cfg.gdb_trigger, cfg.short_circuit_operators,
            cfg.print_full_traceback, cfg.unrolling_limit) == ("info", False, True, False, 32)
    cfg = ti.init(_test_mode=True, log_level="error", gdb_trigger=True)
    assert (cfg.log_level, cfg.gdb_trigger) == ("error", True)
    assert ti.is_logging_effective("info")  # not applied
    monkeypatch.setenv("TI_LOG_LEVEL", "warn")
    monkeypatch.setenv("TI_GDB_TRIGGER", "1")
    cfg = ti.init(_test_mode=True)
    assert (cfg.log_level, cfg.gdb_trigger) == ("warn", True)
    assert ti.init(_test_mode=True, log_level="debug").log_level == "debug"  # argument wins
    with pytest.raises(KeyError, match="foo_bar"):
        ti.init(_test_mode=True, debug=True, foo_bar=233)
    monkeypatch.delenv("TI_LOG_LEVEL")
    monkeypatch.delenv("TI_GDB_TRIGGER")
    ti.init(arch=ti.cpu)  # a real program again
    x = ti.field(ti.i32, shape=3)

    @ti.kernel
    def fill():
        for i in x:
            x[i] = i * 2

    fill()
    np.testing.assert_array_equal(x.to_numpy(), [0, 2, 4])
