"""Human-readable IR, for ``DIFFTAPE_PRINT_IR=1`` and for error reports."""

from __future__ import annotations

from .nodes import Block, KernelIR, Stmt


def _fmt(s: Stmt, names: dict[Stmt, str]) -> str:
    args = ", ".join(names.get(a, f"?{a.uid}") for a in s.args)
    attr = "" if s.attr is None else f" [{s.attr}]"
    t = f": {s.dtype}" if s.dtype is not None else ""
    return f"{s.op}({args}){attr}{t}"


def _block(block: Block, names: dict[Stmt, str], indent: int, lines: list[str]) -> None:
    pad = "  " * indent
    for s in block:
        names[s] = f"%{len(names)}"
        lhs = f"{names[s]} = " if s.dtype is not None or s.op == "alloca" else ""
        lines.append(f"{pad}{lhs}{_fmt(s, names)}")
        for k, b in enumerate(s.blocks):
            if k:
                lines.append(f"{pad}else:")
            _block(b, names, indent + 1, lines)


def format_kernel(ir: KernelIR) -> str:
    lines = [f"kernel {ir.name}(" + ", ".join(f"{p.name}: {p.dtype}" for p in ir.params) + ")"]
    for slot, b in enumerate(ir.buffers):
        lines.append(f"  buffer {slot}: {b.name} {b.dtype}{list(b.shape)} key={b.key}")
    names: dict[Stmt, str] = {}
    if ir.tasks is None:
        _block(ir.body, names, 1, lines)
    else:
        for k, t in enumerate(ir.tasks):
            lines.append(f"  task {k} {t.kind}" + (f" loop {t.loop_id}" if t.loop_id is not None
                                                   else "")
                         + (f" schedule {t.schedule}" if t.schedule != "any" else ""))
            for part in ("bounds", "prologue", "body", "epilogue"):
                blk = getattr(t, part)
                if blk:
                    lines.append(f"   {part}:")
                    _block(blk, names, 3, lines)
            if t.kind == "range":
                lines.append(f"   range [{names.get(t.begin)}, {names.get(t.end)})")
    return "\n".join(lines)
