"""``difftape info``: what the compiler targets, in words a user can act on."""

from difftape import cli
from difftape.codegen import get_target


def test_info_names_the_vector_instruction_set_and_lanes(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    t = get_target()
    line = next(ln for ln in out.splitlines() if ln.startswith("cpu: "))
    if t.isa and t.mvec:
        # glibc's one-letter variant code ('e') says nothing to a user: the ISA and the
        # lanes of f32 and f64 do.
        assert f"{t.lanes[32]} x f32, {t.lanes[64]} x f64" in line, line
        assert any(name in line for name in ("AVX-512", "AVX2", "SSE2")), line
    else:
        assert "scalar libm" in line, line
