"""Reading a compiled XLA program: its collectives (kind, count, bytes, device groups), FLOPs and memory.

The source is the optimised, SPMD-partitioned HLO text of `jax.jit(f).lower(...).compile().as_text()`: the
program one device runs, so every number here is per device.

- Bytes of a collective are the size of the buffer it reduces or assembles: an all-reduce's operand, an
  all-gather's (gathered) result, a reduce-scatter's (unscattered) operand, an all-to-all's operand, a
  collective-permute's operand. What crosses a link depends on the algorithm and the group size; that is the cost
  model's business (`shardlm.perf.costmodel`), so the group of every collective is kept.
- A collective inside a `while` loop (a `lax.scan`) is counted once per iteration when XLA knows the trip count.
- XLA:CPU has no ReduceScatterCreator pass: the partitioner's "all-reduce, then keep my 1/n slice" stays an
  all-reduce there, while XLA:GPU and XLA:TPU rewrite it to a reduce-scatter. An all-reduce whose every use keeps
  only a 1/n slice of it (n = its group size) is therefore reported as the reduce-scatter the accelerator runs
  (`as_reduce_scatter=True`, the default), so that a plan compiled on a CPU host counts FSDP's gradient traffic as
  a GPU would.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")


@dataclasses.dataclass
class CollectiveOp:
    """One collective instruction of the compiled program."""

    kind: str
    name: str
    bytes: int  # see the module docstring for which buffer
    groups: list[list[int]] | None  # device positions (in the mesh's device order) of each group; None: unknown
    times: int = 1  # executions per step (trip count of enclosing loops)
    op_name: str = ""  # the JAX source scope, e.g. jit(step)/transpose(jvp(layer3))/dot_general

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 0


def array_bytes(shape_text: str) -> int:
    """Bytes of every array in an HLO shape, tuples included: '(f32[4,32]{1,0}, bf16[8])' -> 4*4*32 + 2*8."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return int(total)


def _array_sizes(shape_text: str) -> list[int]:
    return [math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in _ARRAY.findall(shape_text)
            if dtype in _DTYPE_BYTES]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    a = np.arange(math.prod(dims)).reshape(dims)
    return a.transpose(perm) if perm else a


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def parse_groups(attrs: str, n_devices: int) -> list[list[int]] | None:
    """The device groups of a collective from its attributes, in any of XLA's three spellings:
    `replica_groups={{0,1},{2,3}}`, the iota form `replica_groups=[2,2]<=[4]` (or `<=[2,2]T(1,0)`), and the mesh
    form `replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}` (optionally `, device_ids=([2,4]T(1,0))`).
    Collective-permutes give `source_target_pairs`, returned as the pairs."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if m:
        return [_ints(p) for p in re.findall(r"\{([\d,]+)\}", m.group(1))]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*"
                  r"\{([^}]*)\}", attrs)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        if not axes or ":" in m.group(1):
            return None  # sub-axis notation: not needed by any program shardlm compiles
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        devices = (_iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None).reshape(sizes)
                   if m.group(2) else np.arange(math.prod(sizes)).reshape(sizes))
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        rest = [i for i in range(len(names)) if i not in chosen]
        return devices.transpose(rest + chosen).reshape(-1, math.prod(sizes[i] for i in chosen)).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = _ints(m.group(1))
        return _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None).reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m:
        groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return groups if groups and groups[0] else [list(range(n_devices))]  # {} means one group of all
    return None


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    args: str  # the text between the opcode's parentheses
    attrs: str
    computation: str
    root: bool


def _parse(hlo_text: str) -> list[_Instruction]:
    """Every instruction of every computation, with the computation it belongs to."""
    instructions, computation = [], ""
    for line in hlo_text.splitlines():
        c = _COMPUTATION.match(line)
        if c and "=" not in line.split("{")[0]:
            computation = c.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        depth, end = 1, len(rest)
        for i, ch in enumerate(rest):  # the operand list ends at the parenthesis matching the opcode's
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                end = i
                break
        operands = re.findall(r"%([\w.\-]+)", rest[:end])
        instructions.append(_Instruction(name, shape, opcode, operands, rest[:end], rest[end + 1:], computation,
                                         line.lstrip().startswith("ROOT")))
    return instructions


def _trip_counts(instructions: list[_Instruction]) -> dict[str, int]:
    """Executions per step of each computation reached through `while` loops with a known trip count."""
    parent: dict[str, tuple[str, int]] = {}
    for ins in instructions:
        if ins.opcode == "while":
            body = re.search(r"body=%([\w.\-]+)", ins.attrs)
            n = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
            if body:
                parent[body.group(1)] = (ins.computation, int(n.group(1)) if n else 1)

    def times(comp: str, seen=()) -> int:
        if comp not in parent or comp in seen:
            return 1
        outer, n = parent[comp]
        return n * times(outer, seen + (comp,))

    return {comp: times(comp) for comp in {i.computation for i in instructions}}


def collectives(hlo_text: str, n_devices: int, *, as_reduce_scatter: bool = True) -> list[CollectiveOp]:
    """Every collective of a compiled program (sync or async `-start` form), with its bytes and device groups."""
    instructions = _parse(hlo_text)
    users: dict[str, list[_Instruction]] = defaultdict(list)
    for ins in instructions:
        for op in ins.operands:
            users[op].append(ins)
    times = _trip_counts(instructions)
    out = []
    for ins in instructions:
        kind = ins.opcode.removesuffix("-start")
        if kind not in KINDS:
            continue
        sizes = _array_sizes(ins.shape)
        nbytes = array_bytes(ins.shape)
        if ins.opcode.endswith("-start") and kind in ("all-gather", "collective-permute") and len(sizes) >= 2:
            # (operand, result[, contexts]): the result is the second half for all-gather, the first for permute
            arrays = _ARRAY.findall(ins.shape)
            half = arrays[len(arrays) // 2:] if kind == "all-gather" else arrays[:1]
            nbytes = array_bytes(" ".join(f"{d}[{s}]" for d, s in half))
        groups = parse_groups(ins.attrs, n_devices)
        op_name = re.search(r'op_name="([^"]*)"', ins.attrs)
        op = CollectiveOp(kind, ins.name, nbytes, groups, times.get(ins.computation, 1),
                          op_name.group(1) if op_name else "")
        out.append(op)
    if as_reduce_scatter:
        out = _AcceleratorRewrites(instructions, users, out).run()
    return out


class _AcceleratorRewrites:
    """Two rewrites XLA:GPU and XLA:TPU make after partitioning and XLA:CPU does not, applied to the all-reduces:

    1. AllReduceReassociate: add(all-reduce(x), all-reduce(y)) is one all-reduce of x + y. (The tied embedding's
       two gradients, from the lookup and from the output head, are the case in point.)
    2. ReduceScatterCreator: an all-reduce whose every use keeps only this device's 1/n slice (n = group size) is
       a reduce-scatter.

    XLA:CPU fuses the slice (and the add) into its consumers, so both are recognised inside fusions too. A combined
    (tuple) all-reduce is judged element by element; scalars riding along (partial sums of the gradient norm)
    stay all-reduces.
    """

    def __init__(self, instructions: list[_Instruction], users, ops: list[CollectiveOp]):
        self.by_name = {i.name: i for i in instructions}
        self.users = users
        self.body: dict[str, list[_Instruction]] = defaultdict(list)
        self.inner_users: dict[tuple[str, str], list[_Instruction]] = defaultdict(list)
        for ins in instructions:
            self.body[ins.computation].append(ins)
            for o in ins.operands:
                self.inner_users[ins.computation, o].append(ins)
        self.ops = ops
        self.all_reduces = {op.name: op for op in ops if op.kind == "all-reduce" and op.groups}
        self.origin = {}  # all-reduced value (the all-reduce itself or one of its get-tuple-elements) -> all-reduce
        for name in self.all_reduces:
            for value in self.elements(self.by_name[name]):
                self.origin[value.name] = name
        self.pairs: list[tuple[str, str]] = []  # all-reduced values summed together

    def elements(self, ar: _Instruction) -> list[_Instruction]:
        if not ar.shape.startswith("("):
            return [ar]
        return [u for u in self.users.get(ar.name, []) if u.opcode == "get-tuple-element"]

    def _partner(self, a: str, b: str) -> bool:
        """Both all-reduced, over the same groups, the same size: their sum can be one all-reduce."""
        oa, ob = self.origin.get(a), self.origin.get(b)
        return (oa is not None and ob is not None and a != b
                and self.all_reduces[oa].groups == self.all_reduces[ob].groups
                and array_bytes(self.by_name[a].shape) == array_bytes(self.by_name[b].shape))

    def _param(self, fusion: _Instruction, slot: int) -> str | None:
        called = re.search(r"calls=%([\w.\-]+)", fusion.attrs)
        if not called:
            return None
        return next((i.name for i in self.body[called.group(1)]
                     if i.opcode == "parameter" and i.args.strip() == str(slot)), None)

    def _slices(self, reads: list[_Instruction], size: int, n: int) -> bool:
        return bool(reads) and all(r.opcode == "dynamic-slice" and sum(_array_sizes(r.shape)) * n == size
                                   for r in reads)

    def keeps_slice(self, use: _Instruction, value: _Instruction, n: int) -> bool:
        """`use` keeps only a 1/n slice of `value` (after adding a partner all-reduced value, maybe)."""
        size = sum(_array_sizes(value.shape))
        if use.opcode == "dynamic-slice":
            return sum(_array_sizes(use.shape)) * n == size
        if use.opcode in ("add", "fusion") and self._summed(use, value):
            after = self.users.get(use.name, [])
            return bool(after) and all(self.keeps_slice(u, use, n) for u in after)
        if use.opcode != "fusion":
            return False
        comp = re.search(r"calls=%([\w.\-]+)", use.attrs).group(1)
        slots = [k for k, o in enumerate(use.operands) if o == value.name]
        for slot in slots:
            param = self._param(use, slot)
            reads = self.inner_users.get((comp, param), [])
            plain = [r for r in reads if r.opcode != "add"]
            for r in reads:
                if r.opcode != "add":
                    continue
                # add(param, other param) inside the fusion: fine if the other is a partner and the sum is sliced
                others = [use.operands[int(self.by_name_in(comp, o).args.strip())] for o in r.operands
                          if o != param and self.by_name_in(comp, o) is not None
                          and self.by_name_in(comp, o).opcode == "parameter"]
                if len(others) != 1 or not self._partner(value.name, others[0]):
                    return False
                if not self._slices(self.inner_users.get((comp, r.name), []), size, n):
                    return False
                self.pairs.append((value.name, others[0]))
            if plain and not self._slices(plain, size, n):
                return False
        return bool(slots)

    def by_name_in(self, comp: str, name: str) -> _Instruction | None:
        return next((i for i in self.body[comp] if i.name == name), None)

    def _summed(self, ins: _Instruction, value: _Instruction) -> bool:
        """`ins` is add(value, partner) (or a fusion that is nothing but that add)."""
        if ins.opcode == "fusion":
            called = re.search(r"calls=%([\w.\-]+)", ins.attrs)
            body = [i for i in self.body[called.group(1)] if i.opcode != "parameter"] if called else []
            if len(body) != 1 or body[0].opcode != "add":
                return False
        elif ins.opcode != "add":
            return False
        others = [o for o in ins.operands if o != value.name]
        if len(ins.operands) != 2 or len(others) != 1 or not self._partner(value.name, others[0]):
            return False
        self.pairs.append((value.name, others[0]))
        return True

    def run(self) -> list[CollectiveOp]:
        scattered: dict[str, int] = defaultdict(int)
        for name, op in self.all_reduces.items():
            n = len(op.groups[0])
            for value in self.elements(self.by_name[name]):
                nbytes = array_bytes(value.shape)
                uses = self.users.get(value.name, [])
                if n > 1 and nbytes > 8 and uses and all(self.keeps_slice(u, value, n) for u in uses):
                    scattered[name] += nbytes
                else:  # an add of partners that is not sliced afterwards is still reassociated
                    for u in uses:
                        if u.opcode in ("add", "fusion"):
                            self._summed(u, value)
        dropped: dict[str, int] = defaultdict(int)  # bytes of the second value of each summed pair, not sent
        gone = set()
        for a, b in self.pairs:
            if a in gone or b in gone:
                continue
            second = max(a, b)  # either one; deterministic
            gone.add(second)
            dropped[self.origin[second]] += array_bytes(self.by_name[second].shape)
            if second in self._scattered_values(scattered):
                scattered[self.origin[second]] -= array_bytes(self.by_name[second].shape)
        result = []
        for op in self.ops:
            if op.name not in self.all_reduces:
                result.append(op)
                continue
            total = op.bytes - dropped.get(op.name, 0)
            rs = min(scattered.get(op.name, 0), total)
            if rs > 0:
                result.append(dataclasses.replace(op, kind="reduce-scatter", bytes=rs))
            if total - rs > 0:
                result.append(dataclasses.replace(op, bytes=total - rs))
        return result

    def _scattered_values(self, scattered) -> set[str]:
        return {v.name for name in scattered for v in self.elements(self.by_name[name])}


def summarize(ops: list[CollectiveOp]) -> list[dict]:
    """[{kind, count, bytes}] per kind (counts and bytes per step), in `KINDS` order."""
    acc: dict[str, list[int]] = {}
    for op in ops:
        a = acc.setdefault(op.kind, [0, 0])
        a[0] += op.times
        a[1] += op.bytes * op.times
    return [{"kind": k, "count": acc[k][0], "bytes": acc[k][1]} for k in KINDS if k in acc]


def compiled_flops(compiled) -> float:
    """FLOPs one device executes per call, from XLA's cost analysis of the compiled program."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def op_scopes(hlo_text: str) -> dict[str, str]:
    """{instruction name: the JAX scope it came from (metadata op_name)}: joins profiler events to named scopes."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=.*?op_name="([^"]*)"', line)
        if m:
            out[m.group(1)] = m.group(2)
    return out
