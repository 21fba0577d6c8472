"""Loop trip counts and early returns of a Triton kernel launch, from its TTGIR, without running it.

``skeleton(ttgir)`` keeps the kernel's control flow (its blocks and early returns, ``scf.for``,
``scf.while``, ``scf.if``) and the scalar integer arithmetic that decides it (program ids, the
kernel's
integer arguments, constants); ``evaluate`` runs it for every program of a grid at once (each value
an
array over the programs) on a launch's arguments: how many iterations each loop makes over all
programs,
and how many programs go on past each early return. A decision that depends on anything else (loaded
data, a float) is unknown: for a loop, ``UnknownTrips``; for a branch, both sides are taken.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

_SCALAR = re.compile(r"^(i1|i8|i16|i32|i64|index)$")
_RESULTS = re.compile(r"^((?:%[\w$.-]+(?::\d+)?)(?:\s*,\s*%[\w$.-]+(?::\d+)?)*)\s*=\s*(.*)$")
_LOC_TAIL = re.compile(r"\s+loc\((?:[^()]|\([^()]*\))*\)\s*$")
_ARG = re.compile(r"%([\w$.-]+): ([^\s,{)]+)(?: \{[^}]*\})? loc\(\"([^\"]+)\"")


def _strip(line: str) -> str:
    return _LOC_TAIL.sub("", line.strip())


def skeleton(ttgir: str) -> list:
    """The TTGIR function's control flow and its scalar integer ops, as nested lists:
    ``["args", {ssa: name}]`` first, then blocks ``["block", label, [nodes]]`` of nodes ``["op",
    results,
    text]``, ``["for", results, iv, lb, ub, step, [[arg, init]...], [nodes]]``,
    ``["while", results, [[arg, init]...], [before], [after], [after's arguments]]``, ``["if",
    results, cond, [then], [else]]``,
    ``["yield", [operands]]``, ``["condition", cond, [operands]]``, ``["cond_br", cond, true, false,
    at]``
    (``at``: where it stands in the function, 0 to 1),
    ``["br", label]``, ``["return"]``. Tensor ops are left out."""
    lines = ttgir.splitlines()
    start = next(i for i, line in enumerate(lines) if "tt.func" in line and "@" in line)
    args = {m.group(1): m.group(3) for m in _ARG.finditer(lines[start])}
    blocks: list = [["block", "^bb0", []]]
    stack: list = [("block", blocks[0][2])]  # (kind, node list being filled, node)
    branches = []
    for number, raw in enumerate(lines[start + 1 :]):
        line = _strip(raw)
        if not line:
            continue
        kind = stack[-1][0]
        if line.startswith("}"):
            rest = line[1:].strip()
            frame = stack.pop()
            if rest.startswith("else {") and frame[0] == "then":
                stack.append(("else", frame[2][4], frame[2]))
            elif rest.startswith("do {") and frame[0] == "before":
                stack.append(("after", frame[2][4], frame[2]))
            if not stack:
                break
            continue
        if kind == "skip":
            if line.endswith("{"):
                stack.append(("skip", None, None))
            continue
        if line.startswith("^bb") and kind == "after":
            stack[-1][2][5].extend(re.findall(r"(%[\w$.-]+):", line))
            continue
        if line.startswith("^bb") and len(stack) == 1:
            label = line.split(":")[0].split("(")[0]
            blocks.append(["block", label, []])
            stack[-1] = ("block", blocks[-1][2])
            continue
        nodes = stack[-1][1]
        m = _RESULTS.match(line)
        results, body = (
            ([r.strip() for r in m.group(1).split(",")], m.group(2)) if m else ([], line)
        )
        if body.startswith("scf.for "):
            fm = re.match(
                r"scf\.for (%\S+) = (%\S+) to (%\S+) step (%\S+)(?: iter_args\((.*?)\))?", body
            )
            inits = [
                a.split(" = ") for a in re.findall(r"%[\w$.-]+ = %[\w$.#-]+", fm.group(5) or "")
            ]
            node = ["for", results, *fm.group(1, 2, 3, 4), inits, []]
            nodes.append(node)
            stack.append(("for", node[7], node))
        elif body.startswith("scf.while "):
            inits = [a.split(" = ") for a in re.findall(r"%[\w$.-]+ = %[\w$.#-]+", body)]
            node = ["while", results, inits, [], [], []]
            nodes.append(node)
            stack.append(("before", node[3], node))
        elif body.startswith("scf.if "):
            node = ["if", results, body.split()[1], [], []]
            nodes.append(node)
            stack.append(("then", node[3], node))
        elif body.startswith("scf.yield"):
            nodes.append(["yield", re.findall(r"%[\w$.#-]+", body.split(":")[0])])
        elif body.startswith("scf.condition"):
            cm = re.match(r"scf\.condition\((%\S+)\)(.*)", body)
            nodes.append(
                ["condition", cm.group(1), re.findall(r"%[\w$.#-]+", cm.group(2).split(":")[0])]
            )
        elif body.startswith("cf.cond_br"):
            cm = re.match(r"cf\.cond_br (%\S+), (\^bb\d+)(?:\(.*?\))?, (\^bb\d+)", body)
            nodes.append(["cond_br", cm.group(1), cm.group(2), cm.group(3), number])
            branches.append(nodes[-1])
        elif body.startswith("cf.br"):
            nodes.append(["br", re.match(r"cf\.br (\^bb\d+)", body).group(1)])
        elif body.startswith("tt.return"):
            nodes.append(["return"])
        else:
            if line.endswith(
                "{"
            ):  # a region that is not control flow (a reduction's combiner, ...)
                stack.append(("skip", None, None))
                continue
            if results and _scalar_op(body):
                nodes.append(["op", results, body])
    for branch in branches:
        branch[4] /= max(number, 1)
    return [["args", args], *blocks]


def _scalar_op(body: str) -> bool:
    if body.startswith("tt.get_program_id") or body.startswith("tt.get_num_programs"):
        return True
    if not body.startswith("arith."):
        return False
    types = body.rsplit(":", 1)[-1].strip().split(" to ")[-1].strip()
    return bool(_SCALAR.match(types))


EXIT_REACH = 0.25
"""How far (in a share of the program) a SASS exit may stand before the TTGIR returns it was made
from."""


class UnknownTrips(RuntimeError):
    """A loop's trip count (or a branch's condition) depends on something the skeleton does not
    hold:
    loaded data, a float."""


def _div(a, b, ceil=False, floor=False):
    q = np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))
    r = a - b * q
    if ceil:
        q = q + ((r != 0) & ((a < 0) == (b < 0)))
    if floor:
        q = q - ((r != 0) & ((a < 0) != (b < 0)))
    return q


_BINARY = {
    "addi": np.add,
    "subi": np.subtract,
    "muli": np.multiply,
    "andi": np.bitwise_and,
    "ori": np.bitwise_or,
    "xori": np.bitwise_xor,
    "maxsi": np.maximum,
    "minsi": np.minimum,
    "maxui": np.maximum,
    "minui": np.minimum,
    "shli": np.left_shift,
    "shrsi": np.right_shift,
    "shrui": np.right_shift,
    "divsi": _div,
    "divui": _div,
    "remsi": lambda a, b: a - b * _div(a, b),
    "remui": lambda a, b: a - b * _div(a, b),
    "ceildivsi": lambda a, b: _div(a, b, ceil=True),
    "ceildivui": lambda a, b: _div(a, b, ceil=True),
    "floordivsi": lambda a, b: _div(a, b, floor=True),
}
_COMPARE = {
    "eq": np.equal,
    "ne": np.not_equal,
    "slt": np.less,
    "sle": np.less_equal,
    "sgt": np.greater,
    "sge": np.greater_equal,
    "ult": np.less,
    "ule": np.less_equal,
    "ugt": np.greater,
    "uge": np.greater_equal,
}


@dataclass
class Trips:
    """What the skeleton says of one launch."""

    programs: int
    loops: list[dict] = field(default_factory=list)
    """Per ``scf.for``/``scf.while``, in textual order: ``parent`` (index or None), ``iterations``
    (summed over the programs and the iterations of the loops around it), ``histogram`` (trip count
    ->
    how many times a program starts the loop with it), ``static`` (its bounds are constants: the
    compiler may unroll it whole)."""
    survivors: list[tuple[float, float]] = field(default_factory=list)
    """After each early return, in order: (where it stands in the function, 0 to 1; the programs
    still running)."""


class _Evaluator:
    """The skeleton run for every program at once: each value an array over the programs, each
    region
    entered with a weight per program (how many times that program runs it: 0 where it does not)."""

    def __init__(self, skeleton: list, arguments: dict, grid: tuple[int, int, int]):
        self.programs = grid[0] * grid[1] * grid[2]
        ids = np.indices(grid).reshape(3, -1).astype(np.int64)
        self.env: dict[str, object] = {
            "__pid_x": ids[0],
            "__pid_y": ids[1],
            "__pid_z": ids[2],
            "__n_x": grid[0],
            "__n_y": grid[1],
            "__n_z": grid[2],
        }
        for ssa, name in skeleton[0][1].items():
            value = arguments.get(name)
            if isinstance(value, (bool, int)):
                self.env["%" + ssa] = np.int64(value)
        self.blocks = {b[1]: b[2] for b in skeleton[1:]}
        self.order = [b[1] for b in skeleton[1:]]
        self.trips = Trips(self.programs)
        self._loop_ids: dict[int, int] = {}
        self.constants: set[str] = set()

    def value(self, name: str):
        if name not in self.env:
            raise UnknownTrips(f"{name} is not a scalar the skeleton computes")
        return self.env[name]

    def array(self, name: str) -> np.ndarray:
        return np.broadcast_to(np.asarray(self.value(name)), (self.programs,))

    def op(self, results: list[str], body: str) -> None:
        opname = body.split()[0]
        try:
            if opname in ("tt.get_program_id", "tt.get_num_programs"):
                axis = body.split()[1]
                value = self.env[("__pid_" if opname == "tt.get_program_id" else "__n_") + axis]
            elif opname == "arith.constant":
                token = body.split()[1]
                value = np.int64(
                    {"true": 1, "false": 0}[token] if token in ("true", "false") else int(token)
                )
                self.constants.update(r.split(":")[0] for r in results)
            else:
                operands = re.findall(r"%[\w$.#-]+", body.split(" : ")[0])
                kind = opname.split(".")[1]
                if kind == "cmpi":
                    predicate = body.split()[1].rstrip(",")
                    value = _COMPARE[predicate](
                        self.value(operands[0]), self.value(operands[1])
                    ).astype(np.int64)
                elif kind == "select":
                    c, a, b = (self.value(o) for o in operands)
                    value = np.where(c != 0, a, b)
                elif kind in ("extsi", "extui", "trunci", "index_cast", "index_castui", "bitcast"):
                    value = self.value(operands[0])
                elif kind in _BINARY:
                    a, b = (self.value(o) for o in operands[:2])
                    if kind.startswith(("div", "rem", "ceildiv", "floordiv")):
                        b = np.where(np.asarray(b) == 0, 1, b)
                    value = _BINARY[kind](a, b)
                else:
                    return
        except (UnknownTrips, ValueError):
            return
        for r in results:
            self.env[r.split(":")[0]] = value

    def run(self) -> Trips:
        """Walk the function's blocks (a DAG of early returns), each with the programs that reach
        it."""
        reach = {label: np.zeros(self.programs) for label in self.order}
        reach[self.order[0]][:] = 1.0
        for label in self.order:
            weight = reach[label]
            nodes = self.blocks[label]
            self.nodes(nodes, weight, None)
            last = nodes[-1] if nodes else ["return"]
            if last[0] == "br":
                reach[last[1]] += weight
            elif last[0] == "cond_br":
                cond = self.array(last[1]) != 0
                yes, no = weight * cond, weight * ~cond
                reach[last[2]] += yes
                reach[last[3]] += no
                for target, other in ((last[2], no), (last[3], yes)):
                    if self._returns(target):
                        self.trips.survivors.append((last[4], float(other.sum())))
        return self.trips

    def _returns(self, label: str) -> bool:
        nodes = self.blocks[label]
        return bool(nodes) and nodes[-1][0] == "return" and all(n[0] == "op" for n in nodes[:-1])

    def nodes(self, nodes: list, weight: np.ndarray, parent: int | None) -> list | None:
        """Evaluate ``nodes`` with ``weight``; returns the terminating yield or condition, if
        any."""
        for node in nodes:
            kind = node[0]
            if kind == "op":
                self.op(node[1], node[2])
            elif kind == "for":
                self.loop_for(node, weight, parent)
            elif kind == "while":
                self.loop_while(node, weight, parent)
            elif kind == "if":
                self.branch(node, weight, parent)
            elif kind in ("yield", "condition"):
                return node
        return None

    def _record(self, node, parent) -> dict:
        key = id(node)
        if key not in self._loop_ids:
            self._loop_ids[key] = len(self.trips.loops)
            self.trips.loops.append(
                {"iterations": 0.0, "histogram": {}, "static": False, "parent": parent}
            )
        return self.trips.loops[self._loop_ids[key]]

    def _index(self, node) -> int:
        return self._loop_ids[id(node)]

    def loop_for(self, node, weight, parent) -> None:
        _, results, iv, lb, ub, step, inits, body = node
        record = self._record(node, parent)
        try:
            lo, hi, st = (self.array(x) for x in (lb, ub, step))
        except UnknownTrips as e:
            raise UnknownTrips(f"the trip count of a loop: {e}") from None
        trips = np.maximum(0, _div(hi - lo, np.where(st == 0, 1, st), ceil=True))
        record["iterations"] += float((trips * weight).sum())
        record["static"] = all(x in self.constants for x in (lb, ub, step))
        live = weight > 0
        if live.any():
            values, where = np.unique(trips[live], return_inverse=True)
            for n, w in zip(values, np.bincount(where, weights=weight[live])):
                record["histogram"][int(n)] = record["histogram"].get(int(n), 0.0) + float(w)
        carried = [arg for arg, _ in inits]
        for arg in carried:
            self.env.pop(arg, None)
        index = self._index(node)
        if not self._needs_iterations(body, {iv, *carried}):
            self.env.pop(iv, None)
            self.nodes(body, weight * trips, index)
        else:
            for arg, init in inits:
                if init in self.env:
                    self.env[arg] = self.env[init]
            for i in range(int((trips * (weight > 0)).max(initial=0))):
                live = weight * (i < trips)
                self.env[iv] = lo + i * st
                out = self.nodes(body, live, index)
                if out is not None and out[0] == "yield":
                    for (arg, _), v in zip(inits, [self.env.get(o) for o in out[1]]):
                        if v is None:
                            self.env.pop(arg, None)
                        else:
                            self.env[arg] = np.where(live > 0, v, self.env.get(arg, v))
        for r in results:
            self.env.pop(r.split(":")[0], None)

    def _needs_iterations(self, body, carried: set[str]) -> bool:
        """Whether a control decision in ``body`` depends on the loop's induction variable or
        carried values."""
        tainted = set(carried)
        controls = []

        def walk(nodes):
            for n in nodes:
                if n[0] == "op":
                    if any(o in tainted for o in re.findall(r"%[\w$.#-]+", n[2])):
                        tainted.update(r.split(":")[0] for r in n[1])
                elif n[0] == "for":
                    controls.extend(n[3:6])
                    walk(n[7])
                elif n[0] == "while":
                    controls.extend(init for _, init in n[2])
                    walk(n[3])
                    walk(n[4])
                elif n[0] == "if":
                    controls.append(n[2])
                    walk(n[3])
                    walk(n[4])

        walk(body)
        return any(c in tainted for c in controls)

    def loop_while(self, node, weight, parent) -> None:
        _, results, inits, before, after, after_args = node
        record = self._record(node, parent)
        index = self._index(node)
        args = [a for a, _ in inits]
        for arg, init in inits:
            if init in self.env:
                self.env[arg] = self.env[init]
            else:
                self.env.pop(arg, None)
        live, rounds = weight.copy(), 0
        while (live > 0).any():
            rounds += 1
            if rounds > 1_000_000:
                raise UnknownTrips("a while loop that does not end")
            cond = self.nodes(before, live, index)
            if cond is None or cond[0] != "condition":
                raise UnknownTrips("a while loop without a condition")
            try:
                live = live * (self.array(cond[1]) != 0)
            except UnknownTrips as e:
                raise UnknownTrips(f"the condition of a while loop: {e}") from None
            record["iterations"] += float(live.sum())
            record["histogram"][1] = record["histogram"].get(1, 0.0) + float(live.sum())
            for name, passed in zip(after_args, cond[2]):
                if passed in self.env:
                    self.env[name] = self.env[passed]
                else:
                    self.env.pop(name, None)
            out = self.nodes(after, live, index)
            if out is not None and out[0] == "yield":
                for arg, v in zip(args, [self.env.get(o) for o in out[1]]):
                    if v is None:
                        self.env.pop(arg, None)
                    else:
                        self.env[arg] = np.where(live > 0, v, self.env.get(arg, v))
        for r in results:
            self.env.pop(r.split(":")[0], None)

    def branch(self, node, weight, parent) -> None:
        _, results, cond, then, other = node
        try:
            c = self.array(cond) != 0
            yes, no = weight * c, weight * ~c
        except UnknownTrips:
            yes = no = weight  # both sides, for every program
        self.nodes(then, yes, parent)
        self.nodes(other, no, parent)
        for r in results:
            self.env.pop(r.split(":")[0], None)


def evaluate(skeleton: list, arguments: dict, grid: tuple[int, int, int]) -> Trips:
    """The skeleton's loops and early exits for one launch (``arguments``: the kernel's by name)."""
    return _Evaluator(skeleton, arguments, grid).run()


# ------------------------------------------------------------------------------- compiled loops

_PTX_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_PTX_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
_PTX_MEMORY = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(?:ld\.global|st\.global|ld\.shared|st\.shared|cp\.async|red\.|atom\."
    r"|ldmatrix|stmatrix|mma\.|wgmma\.mma)"
)


def nest(intervals: list[tuple[int, int]]) -> list[dict]:
    """Loops from (header, back-branch) positions: one per header, nested by containment, outer
    first: each ``{"parent": index or None, "start": ..., "end": ...}``."""
    ends: dict[int, int] = {}
    for start, end in intervals:
        ends[start] = max(ends.get(start, start), end)
    loops: list[dict] = []
    for start, end in sorted(ends.items(), key=lambda se: (se[0], -se[1])):
        parent = next(
            (
                i
                for i in range(len(loops) - 1, -1, -1)
                if loops[i]["start"] <= start and end <= loops[i]["end"]
            ),
            None,
        )
        loops.append({"parent": parent, "start": start, "end": end})
    return loops


def ptx_loops(ptx: str) -> list[dict]:
    """The PTX's natural loops (a back edge to a block that dominates it: LLVM does not lay a loop
    out
    in one piece), outer first in the order of their headers, each with ``parent``, ``memory`` (its
    own body's global and shared memory and MMA instructions) and ``size`` (its own
    instructions)."""
    blocks: list[list[str]] = [[]]
    labels: dict[str, int] = {}
    for line in ptx.splitlines():
        text = line.strip()
        if m := _PTX_LABEL.match(text):
            if blocks[-1]:
                blocks.append([])
            labels[m.group(1)] = len(blocks) - 1
            continue
        if not text or text.startswith(("//", ".", "{", "}", "$")):
            continue
        blocks[-1].append(text)
        if re.search(r"\b(bra|ret)\b", text):
            blocks.append([])
    successors = []
    for i, block in enumerate(blocks):
        last = block[-1] if block else ""
        out = []
        if m := _PTX_BRANCH.search(last):
            out.append(labels[m.group(1)])
            if last.startswith("@"):
                out.append(i + 1)
        elif not re.search(r"\bret\b", last):
            out.append(i + 1)
        successors.append([s for s in out if s < len(blocks)])
    dominators = _dominators(successors)
    predecessors = [[p for p, o in enumerate(successors) if b in o] for b in range(len(blocks))]
    bodies: dict[int, set[int]] = {}
    for tail, outs in enumerate(successors):
        for head in outs:
            if head in dominators[tail]:
                body, stack = {head, tail}, [tail] if tail != head else []
                while stack:
                    for p in predecessors[stack.pop()]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                bodies.setdefault(head, set()).update(body)
    heads = sorted(bodies)
    loops = []
    for head in heads:
        around = [h for h in heads if h != head and bodies[head] < bodies[h]]
        parent = min(around, key=lambda h: len(bodies[h])) if around else None
        loops.append({"parent": heads.index(parent) if parent is not None else None, "head": head})
    for k, loop in enumerate(loops):
        inner = set().union(
            *(bodies[heads[c]] for c in range(len(loops)) if loops[c]["parent"] == k)
        )
        own = [line for b in bodies[loop["head"]] - inner for line in blocks[b]]
        loop["size"] = len(own)
        loop["memory"] = sum(bool(_PTX_MEMORY.match(line)) for line in own)
    return loops


def _dominators(successors: list[list[int]]) -> list[set[int]]:
    """Each block's dominators (block 0 the entry), by the iterative data-flow algorithm."""
    n = len(successors)
    predecessors = [[p for p in range(n) if b in successors[p]] for b in range(n)]
    everything = set(range(n))
    dominators = [{0}] + [set(everything) for _ in range(n - 1)]
    changed = True
    while changed:
        changed = False
        for b in range(1, n):
            reached = [dominators[p] for p in predecessors[b]]
            new = ({b} | set.intersection(*reached)) if reached else {b}
            if new != dominators[b]:
                dominators[b], changed = new, True
    return dominators


def _children(loops: list[dict], parent: int | None) -> list[int]:
    return [i for i, loop in enumerate(loops) if loop["parent"] == parent]


def _divided(histogram: dict, share: float, k: int, remainder: bool = False) -> dict:
    out: dict[int, float] = {}
    for n, w in histogram.items():
        m = n % k if remainder else n // k
        out[m] = out.get(m, 0.0) + w * share
    return out


def align(upper: list[dict], lower: list[dict], factor=None) -> list[dict]:
    """The loops of a later compilation stage (``lower``: ``parent``, ``memory``, ``size``) with the
    trip counts of an earlier one's (``upper``: ``parent``, ``histogram``, ``static``), the trees
    matched in order: each lower loop with its ``histogram`` and ``static``. A compiler may have
    unrolled
    an upper loop: by ``factor(upper, lower)`` in place (its trip counts divided; default 1), by an
    integer factor with a remainder loop after it (two lower loops: their memory instructions in
    that ratio), or whole when its bounds are constants (its nested loops then appear once per
    iteration). UnknownTrips when no such reading matches."""
    factor = factor or (lambda u, lo: 1)

    def pair(a: int, b: int) -> int:
        """The unroll factor of lower loop ``a`` if ``b`` is its remainder loop, else 0."""
        if _children(lower, a) or _children(lower, b):
            return 0
        la, lb = lower[a], lower[b]
        if lb["memory"] and la["memory"] % lb["memory"] == 0:
            k = la["memory"] // lb["memory"]
        elif not (la["memory"] or lb["memory"]) and lb["size"]:
            k = round(la["size"] / lb["size"])
        else:
            return 0
        return k if k >= 2 else 0

    def go(us: list[tuple[int, float]], ls: list[int]) -> dict | None:
        if not us:
            return None if ls else {}
        (u, share), rest = us[0], us[1:]
        histogram, static = upper[u]["histogram"], upper[u]["static"]
        tries = []
        if not _children(upper, u) and len(ls) >= 2 and (k := pair(ls[0], ls[1])):
            tries.append(("remainder", k))
        if ls:
            tries.append(("in place", factor(upper[u], lower[ls[0]])))
        if static and len(histogram) == 1 and next(iter(histogram)) <= 64:
            tries.append(("whole", next(iter(histogram))))
        for how, k in tries:
            if how == "in place":
                nested = go(
                    [(c, share / k) for c in _children(upper, u)] * k, _children(lower, ls[0])
                )
                tail = go(rest, ls[1:]) if nested is not None else None
                if tail is not None:
                    mine = {"histogram": _divided(histogram, share, k), "static": static and k == 1}
                    return {ls[0]: mine, **nested, **tail}
            elif how == "remainder":
                tail = go(rest, ls[2:])
                if tail is not None:
                    return {
                        ls[0]: {"histogram": _divided(histogram, share, k), "static": False},
                        ls[1]: {"histogram": _divided(histogram, share, k, True), "static": False},
                        **tail,
                    }
            else:
                copies = [(c, share / k if k else 0.0) for c in _children(upper, u)] * k
                found = go(copies + rest, ls)
                if found is not None:
                    return found
        return None

    found = go([(u, 1.0) for u in _children(upper, None)], _children(lower, None))
    if found is None:
        raise UnknownTrips(
            f"the compiled code's {len(lower)} loops do not match the {len(upper)} before it"
        )
    return [{**lower[i], **found[i]} for i in range(len(lower))]


def iterations(histogram: dict) -> float:
    return sum(n * w for n, w in histogram.items())
