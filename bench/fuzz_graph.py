"""Graph mode for the random programs (issue 20: a replay computes bit for bit what eager
execution computes, whatever the program).

    .venv/bin/python bench/fuzz_graph.py --kind gradient --seeds 0:200 [--mode cpu|grid|remote]

The programs of bench/fuzz_gen.py and bench/fuzz_features.py (``program`` and
``gradient_program``: launches, fills, copies, element writes, ``ti.ad.Tape``,
``kernel.grad()``, ``ti.ad.FwdMode``) are run as written, statement by statement, three times
in a fresh program each (``ti.init``):

1. **plan**: the statements of ``run`` after the fields and kernels are declared are grouped
   (consecutive statements, split at random) and each group is captured with
   ``ti.graph.capture()`` and replayed. The scalars, ``ti.ndarray``s and NumPy arrays a group
   passes straight to kernels (and to ``from_numpy``) become named graph inputs
   (``g.input``). A capture that is refused must be refused with a documented
   ``ti.GraphCaptureError`` naming the program line that did it (a host read, a kernel's return
   value, Python arithmetic on a graph input, a write into a sparse field): the group is
   split there, the refused statement runs eagerly (Python arithmetic on an input: the input
   is frozen instead). Each refusal is counted by kind. Groups that can run again (no Python
   state assigned, no random draws) get up to two more rounds with other inputs: other
   scalar values, another ``ti.ndarray`` of the same shape and dtype, another NumPy array,
   and new values in up to two fields (``from_numpy``) before the round.
2. **eager**: the same statements and rounds run eagerly (a round: the statements again with
   the other inputs bound to the names).
3. **graph**: each group is captured once (no refusal may appear that the plan did not see)
   and replayed, a round by ``g.replay(**changed inputs)`` (inputs are sticky).

After every plan item the bytes of every field of the program (primal, ``.grad``, ``.dual``),
every ``ti.ndarray`` and the program's result are recorded; eager and graph must agree bit for
bit (NaNs included), and so must errors (the same type at the same place).

``--mode grid`` runs under the simulated GPU grid (``DIFFTAPE_SIMULATE_GPU``, CUDA graphs),
``--mode remote`` under ``arch=ti.remote`` (``--server URL --token T``, or an in-process
engine without them). Each batch of seeds runs in a subprocess; a summary of counts per kind
goes to ``OUT/summary.json`` and every disagreement or undocumented refusal to
``OUT/findings/<kind>-<seed>.txt``.
"""
from __future__ import annotations

import argparse
import ast
import json
import numbers
import os
import random
import re
import subprocess
import sys
import traceback
from collections import Counter
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fuzz_features  # noqa: E402
import fuzz_gen  # noqa: E402

GENERATORS = {"program": fuzz_gen.program, "gradient": fuzz_gen.gradient_program,
              "features": fuzz_features.program,
              "features_gradient": fuzz_features.gradient_program}

# Statements that declare (run eagerly, never captured): fields, SNodes, ndarrays, ti.init.
_DECLARES = re.compile(r"\bti\.(init|field|ndarray|root|Struct\.field|Vector\.field|"
                       r"Matrix\.field|Vector\.ndarray|Matrix\.ndarray)\b|"
                       r"\.(place|dense|dynamic|pointer|bitmasked)\(")

# Documented refusals (kernels/graph/core.py, README "Graphs"): kind -> message pattern with
# the named line (``loc``: file:line) where the message names one.
REFUSALS = {
    "host_read": re.compile(r"inside ti\.graph\.capture\(\) \(at (?P<loc>[^)]*)\): a graph "
                            r"replays without Python"),
    "kernel_return": re.compile(r"returns a value, which Python would read on the host while "
                                r"the graph is captured \(at (?P<loc>[^)]*)\)"),
    "input_arith": re.compile(r"graph input '(?P<name>\w+)' has a value only when the graph is "
                              r"replayed, so Python cannot compute with it or read it while "
                              r"capturing \(at (?P<loc>[^)]*)\)"),
    "sparse": re.compile(r"fields under sparse SNodes.*\(at (?P<loc>[^)]*)\)", re.S),
    "sparse_source": re.compile(r"the source is under a sparse SNode \(at (?P<loc>[^)]*)\)"),
    "element_into_input": re.compile(r"element writes into graph inputs are not supported \(at "
                                     r"(?P<loc>[^)]*)\)"),
    "numpy_on_grid": re.compile(r"a NumPy array argument on a grid program .* \(at "
                                r"(?P<loc>[^)]*)\)", re.S),
}
# Documented refusals of g.input itself (no line: the harness declared the input).
INPUT_REFUSALS = {
    "numpy_input_on_grid": re.compile(r"graph input '\w+': a NumPy array on a grid program"),
    "sparse_input": re.compile(r"graph input '\w+': fields under sparse SNodes cannot be"),
}


class Finding(Exception):
    """A disagreement or an undocumented refusal: what the fuzzer looks for."""


# ------------------------------------------------------------------------------ the program

class Program:
    """A generated program's ``run`` body as statements, grouped for capture."""

    def __init__(self, src: str, path: str) -> None:
        self.src = src
        self.path = path
        tree = ast.parse(src, path)
        self.prelude = [s for s in tree.body if not (isinstance(s, ast.FunctionDef) and
                                                     s.name == "run")]
        run = next(s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "run")
        body: list[ast.stmt] = []
        for s in run.body:  # a try's body runs as is (its handler only catches Taichi's
            if isinstance(s, ast.Try):  # failures), so that its statements can be captured
                body += s.body + s.orelse + s.finalbody
            elif isinstance(s, ast.If) and ast.unparse(s.test) == "hook is None":
                body += s.body  # (the interpreter's hook: tests/core/test_random_fuzz_...)
            else:
                body.append(s)
        self.stmts = body
        self.helpers = [(s.lineno, s.end_lineno) for s in body if isinstance(s, ast.FunctionDef)
                        and not any(_decorator(d) in ("kernel", "func", "real_func")
                                    for d in s.decorator_list)]
        self.codes = [compile(ast.Module(body=[s], type_ignores=[]), path, "exec")
                      if not isinstance(s, ast.Return) else
                      compile(ast.Expression(s.value), path, "eval") for s in body]
        self.kind = [self._classify(s) for s in body]

    def _classify(self, s: ast.stmt) -> str:
        if isinstance(s, ast.Return):
            return "return"
        if isinstance(s, ast.FunctionDef | ast.ClassDef | ast.Import | ast.ImportFrom):
            return "declare"
        if _DECLARES.search(ast.get_source_segment(self.src, s) or ""):
            return "declare"
        return "step"

    def initial_plan(self, r: random.Random) -> list[dict]:
        """Declarations eagerly, runs of other statements as groups (split at random)."""
        items: list[dict] = []
        group: list[int] = []
        assigned: set[str] = set()  # names the group assigns: a statement passing one to a
        for i, k in enumerate(self.kind):  # call starts a new group (the name an input)
            if k == "step":
                names = {n.id for c in ast.walk(self.stmts[i]) if isinstance(c, ast.Call)
                         for a in c.args for n in ast.walk(a) if isinstance(n, ast.Name)}
                if group and (r.random() < 0.3 or names & assigned):
                    items.append({"op": "group", "stmts": group})
                    group, assigned = [], set()
                group.append(i)
                assigned |= {n.id for n in ast.walk(self.stmts[i]) if isinstance(n, ast.Name)
                             and not isinstance(n.ctx, ast.Load)}
                continue
            if group:
                items.append({"op": "group", "stmts": group})
                group, assigned = [], set()
            items.append({"op": k, "stmts": [i]})
        if group:
            items.append({"op": "group", "stmts": group})
        return items

    def candidates(self, stmts: list[int], ns: dict) -> list[str]:
        """Names a group could take as graph inputs: scalars, ndarrays and NumPy arrays that
        are only passed straight to kernels (arrays: or to from_numpy) in the group and never
        assigned there. (A scalar used otherwise is refused at capture: tried, see plan.)"""
        import difftape as ti
        from difftape.frontend.kernel import Kernel
        from difftape.frontend.ndarray import Ndarray

        stored, direct, other = set(), Counter(), Counter()
        for i in stmts:
            for node in ast.walk(self.stmts[i]):
                if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                    stored.add(node.id)
                if isinstance(node, ast.Call):
                    to_kernel = isinstance(node.func, ast.Name) and isinstance(
                        ns.get(node.func.id), Kernel)
                    copy = isinstance(node.func, ast.Attribute) and node.func.attr == "from_numpy"
                    for a in node.args:
                        if isinstance(a, ast.Name) and (to_kernel or copy):
                            direct[a.id, "kernel" if to_kernel else "copy"] += 1
                        elif to_kernel:  # a scalar in an expression: refused, then frozen
                            for b in ast.walk(a):
                                if isinstance(b, ast.Name) and isinstance(b.ctx, ast.Load):
                                    direct[b.id, "expression"] += 0
            for node in ast.walk(self.stmts[i]):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                    other[node.id] += 1
        out = []
        for name, how in sorted(direct):
            if name in stored or name in out:
                continue
            v = ns.get(name)
            uses = sum(c for (n, _), c in direct.items() if n == name)
            if isinstance(v, bool) or v is None:
                continue
            if isinstance(v, numbers.Real) and how in ("kernel", "expression"):
                out.append(name)  # Python arithmetic on it elsewhere: refused, then frozen
            elif isinstance(v, Ndarray | np.ndarray) and uses == other[name] and (
                    not isinstance(v, np.ndarray) or (v.ndim > 0 and v.flags.c_contiguous)):
                out.append(name)
        del ti
        return out

    def repeatable(self, stmts: list[int], ns: dict) -> bool:
        """Can the group run again with the same Python effect (rounds)? Nothing assigned
        but device elements (``x[i] = v``) and loop variables, no method calls on Python
        containers or NumPy arrays, no random draws, no prints."""
        from difftape.frontend.field import Field
        from difftape.frontend.ndarray import Ndarray

        def root(e: ast.expr):
            while isinstance(e, ast.Attribute | ast.Subscript):
                e = e.value
            return ns.get(e.id) if isinstance(e, ast.Name) else None

        for i in stmts:
            for node in ast.walk(self.stmts[i]):
                if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if not (isinstance(t, ast.Subscript) and
                                isinstance(root(t), Field | Ndarray)):
                            return False
                if isinstance(node, ast.NamedExpr):
                    return False
                if isinstance(node, ast.Name) and node.id in ("rng", "print"):
                    return False
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        isinstance(root(node.func), list | dict | set | np.ndarray):
                    return False
        return True


def _decorator(d: ast.expr) -> str:
    d = d.func if isinstance(d, ast.Call) else d
    return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")


# ------------------------------------------------------------------------------ execution

class Run:
    """One execution of a program: ``mode`` "plan" (capture, refine the plan), "eager" or
    "graph" (follow the plan)."""

    def __init__(self, prog: Program, mode: str, init: dict, seed: int) -> None:
        import difftape as ti

        self.ti = ti
        self.prog = prog
        self.mode = mode
        self.init = init
        self.r = random.Random(seed * 7919 + 17)
        self.trace: list[tuple[str, object]] = []  # (label, snapshot)
        self.refusals: Counter = Counter()
        self.findings: list[str] = []
        self.ns: dict = {}
        self.captured = 0
        self.spares: dict = {}
        self.replays = 0
        self.launches = 0

    # --- statements
    def exec_stmt(self, i: int):
        code = self.prog.codes[i]
        if isinstance(self.prog.stmts[i], ast.Return):
            return eval(code, self.ns)  # noqa: S307 - the program's own code
        exec(code, self.ns)  # noqa: S102 - the program's own code
        return None

    def start(self) -> None:
        ti = self.ti
        self.ns = {"__name__": "fuzzprog", "__file__": self.prog.path, "ti": ti, "hook": None}
        for s in self.prog.prelude:
            exec(compile(ast.Module(body=[s], type_ignores=[]), self.prog.path, "exec"),  # noqa: S102
                 self.ns)
        init = ti.init
        extra = self.init

        def patched(*a, **k):
            k.update(extra)
            if k.get("arch") is ti.remote:  # the server compiles with its own float settings
                k.pop("fast_math", None)
            if isinstance(k.get("transport"), type):  # a fresh in-process engine per run
                k["transport"] = k["transport"]()
            return init(*a, **k)
        self._init = init
        ti.init = patched

    def finish(self) -> None:
        self.ti.init = self._init
        try:
            self.ti.reset()
        except Exception:  # noqa: BLE001 - a failed session end: reported by the run
            pass

    # --- snapshots
    def snapshot(self):
        from difftape.frontend.ndarray import Ndarray
        from difftape.runtime import program

        out = []
        try:
            fields = list(program.get().fields.values())
        except Exception as e:  # noqa: BLE001
            return [("program", type(e).__name__)]
        for k, f in enumerate(fields):  # (by creation order: ids differ between runs)
            out += [((k, r), _bytes(f.companion(r))) for r in _ROLES
                    if f.companion(r) is not None]
        for name in sorted(k for k, v in self.ns.items() if isinstance(v, Ndarray)):
            out.append((name, _bytes(self.ns[name])))
        return out

    # --- rounds
    def round_spec(self, inputs: list[str], k: int) -> dict:
        """Other inputs for one more round (values decided now, in the plan)."""
        import difftape as ti
        from difftape.frontend.field import Field
        from difftape.frontend.ndarray import Ndarray

        r = self.r
        change = {}
        for name in inputs:
            v = self.ns[name]
            if r.random() < 0.35:
                continue
            if isinstance(v, numbers.Integral):
                change[name] = ("value", r.choice([0, 1, 3, -7, 5, 2**31 - 1, -2, 11]))
            elif isinstance(v, numbers.Real):
                change[name] = ("value", r.choice([0.5, -1.5, 2.0, 0.25, -0.75, 1.0]))
            elif isinstance(v, Ndarray | np.ndarray):
                change[name] = ("permuted", r.randrange(1 << 30))
            elif isinstance(v, Field):
                change[name] = ("spare", k, r.randrange(1 << 30))
        fields = sorted(k for k, v in self.ns.items() if isinstance(v, Field) and
                        not v.sparse_terms and v.shape and k not in ("ti",))
        refill = [(k, r.randrange(1 << 30)) for k in r.sample(fields, min(len(fields),
                                                                          r.randint(0, 2)))]
        del ti
        return {"change": change, "refill": refill, "all": r.random() < 0.25}

    def apply_round(self, spec: dict, current: dict) -> dict:
        """Refill fields and make the round's inputs; returns the inputs that changed."""
        changed = {}
        for name, (how, *arg) in spec["change"].items():
            old = current[name]
            if how == "value":
                changed[name] = arg[0]
            elif how == "spare":  # the k-th spare, holding the bound field's values permuted
                spare = self.spares[name][arg[0]]
                _put(spare, _permuted_contents(_contents(old), arg[1]))
                changed[name] = spare
            else:
                changed[name] = self.permuted(old, arg[0])
        for fname, seed in spec["refill"]:
            f = self.ns[fname]
            a = f.to_numpy()
            f.from_numpy(a[np.random.default_rng(seed).permutation(a.shape[0])])
        return changed

    def permuted(self, old, seed: int):
        from difftape.frontend.ndarray import Ndarray

        if isinstance(old, np.ndarray):
            a = old
        else:
            a = old.to_numpy()
        p = np.ascontiguousarray(a[np.random.default_rng(seed).permutation(a.shape[0])])
        if isinstance(old, np.ndarray):
            return p
        ti = self.ti
        assert isinstance(old, Ndarray)
        esh = old.element_shape
        dtype = old.dtype if not esh else (ti.types.vector(esh[0], old.dtype) if len(esh) == 1
                                           else ti.types.matrix(esh[0], esh[1], old.dtype))
        new = ti.ndarray(dtype, old.shape, needs_grad=old.grad is not None)
        new.from_numpy(p)
        return new

    # --- groups
    def capture(self, stmts: list[int], inputs: list[str]):
        """Capture the group; returns (graph, None) or (None, (stmt index, error))."""
        from difftape.errors import GraphCaptureError

        ti = self.ti
        saved = {n: self.ns[n] for n in inputs}
        _RAISED.clear()
        at = None
        before = self.snapshot()  # capturing runs nothing: no device data may change
        try:
            with ti.graph.capture() as g:
                for n in inputs:
                    self.ns[n] = g.input(n, saved[n])
                for i in stmts:
                    at = i
                    self.exec_stmt(i)
                    if _RAISED:  # refused, and the program caught it (a try in its code)
                        raise _RAISED[0]
                at = None
        except GraphCaptureError as e:
            return None, (at, e)
        finally:
            self.ns.update(saved)
            after = dict(self.snapshot())  # (kernels compiled now may add fields)
            changed = [(k, v, after.get(k)) for k, v in before if after.get(k) != v]
            if changed:
                k, v, w = changed[0]
                raise Finding(f"capturing statements {stmts} changed device data ({k}): "
                              f"{_arr(v)} vs {_arr(w)}")
        return g, None

    def check_refusal(self, i: int | None, e: Exception) -> tuple[str, str | None]:
        """The refusal's documented kind (and the input it names), or a Finding."""
        msg = str(e)
        kind, m = next(((k, p.search(msg)) for k, p in REFUSALS.items() if p.search(msg)),
                       (None, None))
        if m is None:
            raise Finding(f"undocumented capture refusal at statement {i}: {type(e).__name__}: "
                          f"{msg}")
        loc = m.group("loc")
        path, _, line = loc.rpartition(":")
        s = self.prog.stmts[i] if i is not None else None
        ok = path == self.prog.path and line.isdigit() and s is not None and (
            s.lineno <= int(line) <= s.end_lineno or
            any(a <= int(line) <= b for a, b in self.prog.helpers))
        if not ok:
            raise Finding(f"refusal '{kind}' names {loc}, not the program line that did it "
                          f"(statement lines {s and (s.lineno, s.end_lineno)}): {msg}")
        self.refusals[kind] += 1
        return kind, m.groupdict().get("name")

    def run_group(self, item: dict) -> list[dict]:
        """Plan mode: capture (refusals split the group), replay, decide rounds. Returns the
        items the group became."""
        from difftape.errors import GraphError

        stmts, inputs = item["stmts"], self.prog.candidates(item["stmts"], self.ns)
        nrounds = self.r.choice([0, 1, 1, 2]) if self.prog.repeatable(stmts, self.ns) else 0
        fields = self.field_candidates(stmts)
        spares = {}
        if fields and nrounds and self.r.random() < 0.6:
            name = self.r.choice(fields)
            inputs.append(name)
            spares = {name: nrounds}
        self.make_spares(spares)
        while True:
            try:
                g, refused = self.capture(stmts, inputs)
            except GraphError as e:  # g.input refused an input: documented kinds only
                kind = next((k for k, p in INPUT_REFUSALS.items() if p.search(str(e))), None)
                name = re.search(r"graph input '(\w+)'", str(e))
                if kind is None or name is None or name.group(1) not in inputs:
                    raise Finding(f"undocumented refusal of g.input: {e}") from e
                self.refusals[kind] += 1
                inputs = [n for n in inputs if n != name.group(1)]
                continue
            if refused is None:
                break
            i, e = refused
            kind, name = self.check_refusal(i, e)
            if kind == "input_arith" and name in inputs:
                inputs = [n for n in inputs if n != name]  # frozen instead
                continue
            j = stmts.index(i)
            out = []
            if j:
                out.append({"op": "group", "stmts": stmts[:j], "retry": True})
            out.append({"op": "eager", "stmts": [i]})
            if stmts[j + 1:]:
                out.append({"op": "group", "stmts": stmts[j + 1:], "retry": True})
            return out
        self.captured += 1
        self.launches += g.launches
        self.replay(g, {})
        rounds = []
        current = {n: self.ns[n] for n in inputs}
        for k in range(nrounds):
            spec = self.round_spec(inputs, k)
            changed = self.apply_round(spec, current)
            current.update(changed)
            self.replay(g, current if spec["all"] else changed)
            rounds.append(spec)
        return [{"op": "group", "stmts": stmts, "inputs": inputs, "rounds": rounds,
                 "spares": {n: c for n, c in spares.items() if n in inputs}}]

    def field_candidates(self, stmts: list[int]) -> list[str]:
        """Dense fields (by name) a group may take as a field input, bound to a spare field
        of their kind in later rounds: not assigned in the group."""
        from difftape.frontend.field import Field

        stored = {n.id for i in stmts for n in ast.walk(self.prog.stmts[i])
                  if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
        return sorted(k for k, v in self.ns.items() if isinstance(v, Field) and k not in stored
                      and v.role == "primal" and v.shape and not v.sparse_terms)

    def make_spares(self, spares: dict) -> None:
        """Spare fields like each field input (made before the capture, so that what the
        step does to every field, a Tape clearing all gradients, covers them in both runs)."""
        self.spares = {name: [_like(self.ti, self.ns[name]) for _ in range(count)]
                       for name, count in spares.items()}

    def replay(self, g, inputs: dict) -> None:
        self.replays += 1
        g.replay(**inputs)

    def follow_group(self, item: dict) -> None:
        """Eager or graph mode: the planned group and its rounds."""
        stmts, inputs = item["stmts"], item["inputs"]
        self.make_spares(item.get("spares", {}))
        if self.mode == "graph":
            g, refused = self.capture(stmts, inputs)
            if refused is not None:
                i, e = refused
                raise Finding(f"capture refused at statement {i} in the graph run but not in the "
                              f"plan: {e}")
            self.captured += 1
            self.launches += g.launches
            self.replay(g, {})
            if inputs:
                self.refused_replay(g, inputs[hash(tuple(stmts)) % len(inputs)])
        else:
            for i in stmts:
                self.exec_stmt(i)
        self.trace.append((f"group {stmts}", self.snapshot()))
        current = {n: self.ns[n] for n in inputs}
        for k, spec in enumerate(item["rounds"]):
            changed = self.apply_round(spec, current)
            current.update(changed)
            if self.mode == "graph":
                self.replay(g, current if spec["all"] else changed)
            else:
                # A field input bound to a spare: the field holds the spare's values while
                # the statements (and kernels compiled over the field) run, then the spare
                # takes the results and the field its own values back.
                saved = {n: self.ns[n] for n in inputs}
                swapped = {n: v for n, v in current.items() if n in self.spares and
                           v is not saved[n]}
                held = {n: _contents(saved[n]) for n in swapped}
                for n, spare in swapped.items():
                    _put(saved[n], _contents(spare))
                self.ns.update({n: v for n, v in current.items() if n not in swapped})
                try:
                    for i in stmts:
                        self.exec_stmt(i)
                finally:
                    self.ns.update(saved)
                for n, spare in swapped.items():
                    _put(spare, _contents(saved[n]))
                    _put(saved[n], held[n])
            self.trace.append((f"group {stmts} round {k + 1}", self.snapshot()))

    def refused_replay(self, g, name: str) -> None:
        """A replay with input ``name`` of another shape, dtype or kind must be refused
        (``GraphError``, or ``ArgumentError`` for a scalar of the wrong type) naming the input,
        and change nothing: no device data, not the input's binding."""
        from difftape.errors import ArgumentError, GraphError
        from difftape.frontend.field import Field
        from difftape.frontend.ndarray import Ndarray

        ti, v = self.ti, self.ns[name]
        if isinstance(v, bool):
            return
        if isinstance(v, numbers.Integral):
            bad = 1.5
        elif isinstance(v, numbers.Real):
            bad = "0.5"
        elif isinstance(v, np.ndarray):
            bad = np.zeros(v.shape[:-1] + (v.shape[-1] + 1,), v.dtype) if len(self.refusals) % 2 \
                else np.zeros(v.shape, np.float32 if v.dtype != np.float32 else np.int32)
        elif isinstance(v, Ndarray):
            bad = ti.ndarray(v.dtype, tuple(n + 1 for n in v.shape))
        elif isinstance(v, Field):
            bad = np.zeros(v.shape)
        else:
            return
        before = self.snapshot()
        try:
            g.replay(**{name: bad})
        except (GraphError, ArgumentError) as e:
            if f"'{name}'" not in str(e):
                raise Finding(f"a replay with a bad '{name}' was refused without naming it: "
                              f"{e}") from e
            self.refusals["bad_replay_input"] += 1
        else:
            raise Finding(f"a replay with '{name}' of another shape, dtype or kind "
                          f"({type(bad).__name__}) ran")
        if self.snapshot() != before:
            raise Finding(f"a refused replay (bad '{name}') changed device data")

    def execute(self, plan: list[dict] | None) -> tuple[list[dict], object]:
        """Run the program; returns the (refined) plan and the result."""
        self.start()
        result = None
        out: list[dict] = []
        queue = list(plan if plan is not None else self.prog.initial_plan(self.r))
        try:
            while queue:
                item = queue.pop(0)
                label = f"{item['op']} {item['stmts']}"
                try:
                    if item["op"] == "group" and self.mode == "plan":
                        became = self.run_group(item)
                        if len(became) > 1 or became[0]["op"] != "group":
                            queue[:0] = became
                            continue
                        out += became
                    elif item["op"] == "group":
                        self.follow_group(item)
                        continue
                    else:
                        value = self.exec_stmt(item["stmts"][0])
                        out.append(item)
                        if item["op"] == "return":
                            result = value
                except Finding:
                    raise
                except Exception as e:  # noqa: BLE001 - compared between the runs
                    self.trace.append((label, ("error", type(e).__name__, _first_line(e))))
                    out.append({"inputs": [], "rounds": [], **item})
                    out += queue  # (the plan stops here: what follows never ran)
                    break
                self.trace.append((label, self.snapshot()))
        finally:
            self.finish()
        return out, result


_ROLES = ("primal", "grad", "dual", "grad_dual")


def _like(ti, f):
    """A new field of ``f``'s kind: dtype, shape, element shape, offset, .grad and .dual."""
    esh = f.element_shape
    kw = {"shape": f.shape, "needs_grad": f.companion("grad") is not None,
          "needs_dual": f.companion("dual") is not None}
    off = getattr(f, "offset", None)
    if off and any(off):
        kw["offset"] = off
    if not esh:
        return ti.field(f.dtype, **kw)
    if len(esh) == 1:
        return ti.Vector.field(esh[0], f.dtype, **kw)
    return ti.Matrix.field(esh[0], esh[1], f.dtype, **kw)


def _contents(f) -> dict:
    return {r: f.companion(r).to_numpy() for r in _ROLES if f.companion(r) is not None}


def _put(f, contents: dict) -> None:
    for r, a in contents.items():
        f.companion(r).from_numpy(a)


def _permuted_contents(contents: dict, seed: int) -> dict:
    out = {}
    for r, a in contents.items():
        out[r] = np.ascontiguousarray(a[np.random.default_rng(seed).permutation(a.shape[0])])
    return out


_RAISED: list = []


def _watch_refusals() -> None:
    """Record every GraphCaptureError made, also those a program's ``try`` swallows."""
    from difftape.errors import GraphCaptureError

    if getattr(GraphCaptureError, "_watched", False):
        return
    init = GraphCaptureError.__init__

    def watched(self, *a, **k):
        _RAISED.append(self)
        init(self, *a, **k)
    GraphCaptureError.__init__ = watched
    GraphCaptureError._watched = True


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _bytes(a) -> tuple:
    try:
        arr = np.ascontiguousarray(a.to_numpy())
    except Exception as e:  # noqa: BLE001
        return ("error", type(e).__name__)
    return (arr.dtype.str, arr.shape, arr.tobytes())


def _result_bytes(res) -> object:
    if isinstance(res, dict):
        return {k: _result_bytes(v) for k, v in res.items()}
    if isinstance(res, np.ndarray | numbers.Number):
        a = np.ascontiguousarray(res)
        return (a.dtype.str, a.shape, a.tobytes())
    return repr(res)


def check_program(kind: str, seed: int, workdir: Path, init: dict | None = None) -> dict:
    """Plan, eager and graph runs of one program; returns counts, raises Finding."""
    _watch_refusals()
    src = GENERATORS[kind](seed)
    path = workdir / f"{kind}_{seed}.py"
    path.write_text(src)
    prog = Program(src, str(path))
    init = dict(init or {})
    planner = Run(prog, "plan", init, seed)
    plan, _ = planner.execute(None)
    eager = Run(prog, "eager", init, seed)
    _, want = eager.execute(plan)
    graph = Run(prog, "graph", init, seed)
    _, got = graph.execute(plan)
    for (la, sa), (lb, sb) in zip(eager.trace, graph.trace, strict=False):
        if la != lb or sa != sb:
            raise Finding(f"after {la} / {lb}: eager and replay differ: "
                          f"{_describe(sa, sb)}")
    if len(eager.trace) != len(graph.trace):
        raise Finding(f"eager ran {len(eager.trace)} steps, the graph run {len(graph.trace)}")
    if _result_bytes(want) != _result_bytes(got):
        raise Finding(f"results differ: {_describe_result(want, got)}")
    errors = [t for t in eager.trace if isinstance(t[1], tuple) and t[1][:1] == ("error",)]
    return {"refusals": dict(planner.refusals + graph.refusals), "captured": graph.captured,
            "replays": graph.replays, "launches": graph.launches,
            "rounds": sum(len(p.get("rounds", ())) for p in plan),
            "changed": dict(Counter(how[0] for p in plan for spec in p.get("rounds", ())
                                    for how in spec["change"].values())),
            "error": errors[0][1][1:] if errors else None}


def _describe(a, b) -> str:
    if not (isinstance(a, list) and isinstance(b, list)):
        return f"{a!r:.300} vs {b!r:.300}"
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"item {k}: {_arr(x)} vs {_arr(y)}"
    return f"{len(a)} vs {len(b)} items"


def _arr(x) -> str:
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple):
        return f"{x[0]} {_arr(x[1])}"
    if isinstance(x, tuple) and len(x) == 3 and isinstance(x[2], bytes):
        return repr(np.frombuffer(x[2], dtype=np.dtype(x[0])).reshape(x[1]))[:400]
    return repr(x)[:300]


def _describe_result(a, b) -> str:
    ra, rb = _result_bytes(a), _result_bytes(b)
    if isinstance(ra, dict) and isinstance(rb, dict):
        for k in ra:
            if ra[k] != rb.get(k):
                return f"{k}: {_arr(ra[k])} vs {_arr(rb.get(k))}"
    return f"{ra!r:.300} vs {rb!r:.300}"


# ------------------------------------------------------------------------------ driver

def worker(kind: str, seeds: list[int], out: Path, init: dict) -> None:
    """Check ``seeds`` of ``kind`` in this process; one JSON line per seed to ``out``."""
    work = out / "programs"
    work.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as fh:
        for seed in seeds:
            try:
                rec = {"kind": kind, "seed": seed, **check_program(kind, seed, work, init)}
            except Finding as e:
                rec = {"kind": kind, "seed": seed, "finding": str(e)[:4000]}
            except Exception as e:  # noqa: BLE001 - the harness's own failure: reported
                rec = {"kind": kind, "seed": seed,
                       "harness_error": f"{type(e).__name__}: {e}"[:2000],
                       "tb": traceback.format_exc()[-3000:]}
            fh.write(json.dumps(rec) + "\n")
            fh.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", default="program", choices=sorted(GENERATORS))
    ap.add_argument("--seeds", default="0:20")
    ap.add_argument("--mode", default="cpu", choices=["cpu", "grid", "remote"])
    ap.add_argument("--server")
    ap.add_argument("--token")
    ap.add_argument("--out", default="/tmp/fuzz_graph")
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    a, b = (int(x) for x in args.seeds.split(":"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    init: dict = {}
    if args.mode == "remote":
        init = {"arch": "remote"}
    if args.worker:
        if args.mode == "remote":
            import difftape as ti
            init = {"arch": ti.remote}
            if args.server:
                init.update(server=args.server, token=args.token)
            else:
                from difftape.client import LocalTransport
                init["transport"] = LocalTransport
        worker(args.kind, list(range(a, b)), out, init)
        return
    env = dict(os.environ)
    if args.mode == "grid":
        env.update(DIFFTAPE_SIMULATE_GPU="3,7", DIFFTAPE_CHECK_PTX="0")
    for lo in range(a, b, args.batch):
        hi = min(b, lo + args.batch)
        cmd = [sys.executable, __file__, "--worker", "--kind", args.kind, "--seeds",
               f"{lo}:{hi}", "--mode", args.mode, "--out", str(out)]
        if args.server:
            cmd += ["--server", args.server, "--token", args.token]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            done = {json.loads(x)["seed"] for x in (out / "results.jsonl").read_text()
                    .splitlines()} if (out / "results.jsonl").exists() else set()
            with open(out / "results.jsonl", "a") as fh:
                for s in range(lo, hi):
                    if s not in done:
                        fh.write(json.dumps({"kind": args.kind, "seed": s, "crash":
                                             r.stderr[-2000:]}) + "\n")
                        break
    summarize(out)


def summarize(out: Path) -> dict:
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    summary: dict = {}
    for rec in recs:
        s = summary.setdefault(rec["kind"], Counter())
        s["programs"] += 1
        for key in ("finding", "harness_error", "crash"):
            if key in rec:
                s[key] += 1
                (out / "findings").mkdir(exist_ok=True)
                (out / "findings" / f"{rec['kind']}-{rec['seed']}.txt").write_text(
                    rec[key] + "\n" + rec.get("tb", ""))
        if "captured" in rec:
            s["agreed"] += 1
            for key in ("captured", "replays", "launches", "rounds"):
                s[key] += rec[key]
            for k, v in rec.get("changed", {}).items():
                s[f"changed:{k}"] += v
            for k, v in rec["refusals"].items():
                s[f"refused:{k}"] += v
            if rec["error"]:
                s["ended_by_error"] += 1
    summary = {k: dict(v) for k, v in summary.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
