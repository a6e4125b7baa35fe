"""Offloading: split a kernel body into launchable tasks.

Each outermost parallel ``range_for`` becomes a ``range`` task run in chunks on all cores;
maximal runs of other top-level statements become ``serial`` tasks. Values that cross tasks
are handled in one place here: cheap pure values are recomputed in the task that needs them;
kernel-level variables and other values go through *temps*, slots in the launch context
(Taichi's global temporaries). A range task reads the temps it never writes once per chunk.
"""

from __future__ import annotations

from ..nodes import Block, KernelIR, Stmt, Task, walk

_REMAT_OPS = {"const", "arg", "buf_shape", "cast", "select", "neg", "abs", "add", "sub", "mul",
              "div", "floordiv", "mod", "min", "max", "lt", "le", "gt", "ge", "eq", "ne",
              "logical_and", "logical_or", "logical_not", "bit_and", "bit_or", "bit_xor",
              "shl", "shr"}


#: The most operations recomputed for one value in a task; a larger expression is spilled.
REMAT_LIMIT = 32


def _split(ir: KernelIR) -> list[Task]:
    tasks: list[Task] = []
    serial: Block = []
    for s in ir.body:
        if s.op == "range_for" and s.attr[1] == "parallel":
            if serial:
                tasks.append(Task("serial", serial))
                serial = []
            tasks.append(Task("range", s.blocks[0], loop_id=s.attr[0], begin=s.args[0],
                              end=s.args[1]))
        else:
            serial.append(s)
    if serial or not tasks:
        tasks.append(Task("serial", serial))
    return tasks


class _Offloader:
    def __init__(self, ir: KernelIR, tasks: list[Task]) -> None:
        self.ir = ir
        self.tasks = tasks
        self.owner: dict[Stmt, int] = {}
        self.temps: dict[Stmt, int] = {}  # alloca or spilled value -> temp slot
        self.cost: dict[Stmt, int] = {}  # value -> operations to recompute it (capped)
        for t_index, t in enumerate(tasks):
            for blk in (t.body,):
                for s in walk(blk):
                    self.owner[s] = t_index

    def temp_slot(self, s: Stmt) -> int:
        if s not in self.temps:
            self.temps[s] = len(self.temps)
        return self.temps[s]

    def run(self) -> None:
        # 1. Kernel-level variables used by more than one task become temps.
        for t_index, t in enumerate(self.tasks):
            for s in walk(t.body):
                if s.op in ("local_load", "local_store", "local_atomic"):
                    alloca = s.args[0]
                    if self.owner.get(alloca, t_index) != t_index:
                        self.temp_slot(alloca)
        for t in self.tasks:
            t.body = self._lower_temps(t.body)
        # 2. Foreign values: recompute or spill.
        for t_index, t in enumerate(self.tasks):
            cache: dict[Stmt, Stmt] = {}
            prologue: Block = []
            t.body = self._localize(t.body, t_index, prologue, cache)
            if t.kind == "range":
                bcache: dict[Stmt, Stmt] = {}
                t.begin = self._import(t.begin, t_index, t.bounds, bcache)
                t.end = self._import(t.end, t_index, t.bounds, bcache)
                t.prologue = prologue
                self._hoist_readonly_temps(t)
            else:
                t.body = prologue + t.body
        # 3. Spills: store after the definition in the owning task.
        for t in self.tasks:
            t.body = self._insert_spills(t.body)
        self.ir.num_temps = len(self.temps)

    def _lower_temps(self, block: Block) -> Block:
        out: Block = []
        for s in block:
            if s.blocks:
                s.blocks = tuple(self._lower_temps(b) for b in s.blocks)
            if s.op == "alloca" and s in self.temps:
                continue
            if s.op == "local_load" and s.args[0] in self.temps:
                s.op, s.attr, s.args = "temp_load", self.temps[s.args[0]], ()
            elif s.op == "local_store" and s.args[0] in self.temps:
                s.op, s.attr, s.args = "temp_store", self.temps[s.args[0]], (s.args[1],)
            elif s.op == "local_atomic" and s.args[0] in self.temps:
                s.op, s.attr, s.args = "temp_atomic", (self.temps[s.args[0]], s.attr), (s.args[1],)
            out.append(s)
        return out

    def _cheap(self, d: Stmt) -> bool:
        """Is ``d`` pure arithmetic on pure arithmetic... costing at most REMAT_LIMIT
        operations (counted as a tree, so shared operands count once per use: an
        over-estimate)? Memoized and iterative: long or doubling chains cost linear time."""
        cost = self.cost
        stack = [d]
        while stack:
            s = stack[-1]
            if s in cost:
                stack.pop()
            elif s.op not in _REMAT_OPS:
                cost[s] = REMAT_LIMIT + 1
                stack.pop()
            elif pending := [a for a in s.args if a not in cost]:
                stack.extend(pending)
            else:
                cost[s] = min(REMAT_LIMIT + 1, 1 + sum(cost[a] for a in s.args))
                stack.pop()
        return cost[d] <= REMAT_LIMIT

    def _import(self, d: Stmt, t_index: int, into: Block, cache: dict) -> Stmt:
        """A statement in ``into`` giving the value of foreign statement ``d``: recomputed
        when cheap, else read from a temp. Operands first (post-order, without recursion)."""
        stack: list[tuple[Stmt, bool]] = [(d, False)]
        while stack:
            s, operands_done = stack.pop()
            if s in cache:
                continue
            if self._cheap(s):
                if not operands_done:
                    stack.append((s, True))
                    stack.extend((a, False) for a in s.args if a not in cache)
                    continue
                new = s.replace(args=tuple(cache[a] for a in s.args))
            else:
                new = Stmt("temp_load", s.dtype, (), self.temp_slot(s), loc=s.loc)
            into.append(new)
            cache[s] = new
        return cache[d]

    def _localize(self, block: Block, t_index: int, prologue: Block, cache: dict) -> Block:
        for s in block:
            if s.blocks:
                s.blocks = tuple(self._localize(b, t_index, prologue, cache) for b in s.blocks)
            if s.args:
                s.args = tuple(self._import(a, t_index, prologue, cache)
                               if self.owner.get(a, t_index) != t_index else a
                               for a in s.args)
        return block

    def _insert_spills(self, block: Block) -> Block:
        out: Block = []
        for s in block:
            if s.blocks:
                s.blocks = tuple(self._insert_spills(b) for b in s.blocks)
            out.append(s)
            if s in self.temps and s.op != "alloca" and s.dtype is not None:
                out.append(Stmt("temp_store", None, (s,), self.temps[s], loc=s.loc))
        return out

    def _hoist_readonly_temps(self, t: Task) -> None:
        written = {s.attr if s.op == "temp_store" else s.attr[0] for s in walk(t.body)
                   if s.op in ("temp_store", "temp_atomic")}
        hoisted: dict[int, Stmt] = {s.attr: s for s in t.prologue if s.op == "temp_load"}

        def rewrite(block: Block) -> Block:
            out: Block = []
            mapping: dict[Stmt, Stmt] = {}
            for s in block:
                if s.blocks:
                    s.blocks = tuple(rewrite(b) for b in s.blocks)
                if s.args:
                    s.args = tuple(mapping.get(a, a) for a in s.args)
                if s.op == "temp_load" and s.attr not in written:
                    h = hoisted.get(s.attr)
                    if h is None:
                        h = s.replace()
                        hoisted[s.attr] = h
                        t.prologue.append(h)
                    mapping[s] = h
                    replace_everywhere[s] = h
                    continue
                out.append(s)
            return out

        replace_everywhere: dict[Stmt, Stmt] = {}
        t.body = rewrite(t.body)
        if replace_everywhere:
            for s in walk(t.body):
                if s.args:
                    s.args = tuple(replace_everywhere.get(a, a) for a in s.args)


def _weight(block: Block) -> int:
    w = 0
    for s in block:
        w += 1
        for b in s.blocks:
            w += _weight(b) * (16 if s.op in ("range_for", "while") else 1)
    return w


def offload(ir: KernelIR) -> KernelIR:
    tasks = _split(ir)
    _Offloader(ir, tasks).run()
    for t in tasks:
        t.weight = _weight(t.body)
    ir.tasks = tasks
    return ir

