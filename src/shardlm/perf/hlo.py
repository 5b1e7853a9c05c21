"""Reading a compiled XLA program: its collectives (kind, count, bytes, device groups), FLOPs and memory.

The source is the optimised, SPMD-partitioned HLO text of `jax.jit(f).lower(...).compile().as_text()`: the
program one device runs, so every number here is per device.

- Bytes of a collective are the size of the buffer it reduces or assembles: an all-reduce's operand, an
  all-gather's (gathered) result, a reduce-scatter's (unscattered) operand, an all-to-all's operand, a
  collective-permute's operand. What crosses a link depends on the algorithm and the group size; that is the cost
  model's business (`shardlm.perf.costmodel`), so the group of every collective is kept.
- A collective inside a `while` loop (a `lax.scan`) is counted once per iteration when XLA knows the trip count.
- XLA:TPU writes an asynchronous collective as up to three fusions, each holding a clone of it
  (`AsyncFusions`): it is counted once, at its start.
- XLA:CPU lacks two passes XLA:GPU and XLA:TPU run after partitioning: ReduceScatterCreator (the partitioner's
  "all-reduce, then keep my 1/n slice" becomes a reduce-scatter) and AllReduceReassociate (a sum of all-reduces
  becomes the all-reduce of a sum). With `as_accelerators_run=True` (the default) both are applied to the counts
  (`_AcceleratorRewrites`), so that a plan compiled on a CPU host counts FSDP's gradient traffic as a GPU would.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

from shardlm.kernels.exchange import routed_share

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
    # Collectives on the longest chain of data dependencies before this one: collectives at the same level of the
    # same kind and groups depend on no one another, so XLA:GPU's combiners may issue them as one.
    level: int = 0

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
        # A header is not an assignment; its parameter tuples may hold /*index=5*/ comments.
        if c and "=" not in re.sub(r"/\*.*?\*/", "", line.split("{")[0]):
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


def _kind(opcode: str) -> str:
    """A collective's kind from its opcode: the async `-start` form's too, and a ragged all-to-all as an
    all-to-all (its bytes are the rows its caller expects to send: `shardlm.kernels.exchange`)."""
    kind = opcode.removesuffix("-start")
    return "all-to-all" if kind == "ragged-all-to-all" else kind


def _op_name(ins: _Instruction) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


def called(ins: _Instruction) -> str | None:
    """The computation an instruction calls (a fusion's body, an async op's wrapped computation), if it names one."""
    m = re.search(r"calls=%([\w.\-]+)", ins.attrs)
    return m.group(1) if m else None


def custom_call_target(ins: _Instruction) -> str:
    """A custom call's target (`__cudnn$fmha...`, `AsyncCollectiveStart`, ...); empty for any other instruction."""
    m = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    return m.group(1) if m else ""


def branches(ins: _Instruction) -> list[str]:
    """The branch computations of a `conditional` (either spelling: `branch_computations={...}` or
    `true_computation=`/`false_computation=`)."""
    listed = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
    if listed:
        return re.findall(r"%([\w.\-]+)", listed.group(1))
    return re.findall(r"(?:true|false)_computation=%([\w.\-]+)", ins.attrs)


def _trip_counts(instructions: list[_Instruction]) -> dict[str, int]:
    """Executions per call of the program of each computation: a `while` body runs its known trip count times
    per execution of the computation holding the loop; fused and called computations run once per execution of
    their caller, and each branch of a conditional at most once (counting them all counts every branch).
    (Reducers, `to_apply` of reduce and all-reduce, are not executions of their own.)"""
    parent: dict[str, tuple[str, int]] = {}
    for ins in instructions:
        if ins.opcode == "while":
            body = re.search(r"body=%([\w.\-]+)", ins.attrs)
            if body:
                trips = _loop_trips(ins, instructions)
                parent[body.group(1)] = (ins.computation, 1 if trips is None else trips)
        elif ins.opcode in ("fusion", "call"):
            callee = re.search(r"(?:calls|to_apply)=%([\w.\-]+)", ins.attrs)
            if callee:
                parent.setdefault(callee.group(1), (ins.computation, 1))
        elif ins.opcode == "conditional":  # each branch at most once per execution of the caller
            for branch in branches(ins):
                parent.setdefault(branch, (ins.computation, 1))

    def times(comp: str, seen=()) -> int:
        if comp not in parent or comp in seen:
            return 1
        outer, n = parent[comp]
        return n * times(outer, seen + (comp,))

    return {comp: times(comp) for comp in {i.computation for i in instructions}}


def _loop_trips(loop: _Instruction, instructions: list[_Instruction]) -> int | None:
    """A `while` loop's trip count: XLA's annotation, else counted from its condition (`_counted_trips`); None if
    neither says."""
    n = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    return int(n.group(1)) if n else _counted_trips(loop, instructions)


def loop_trips(hlo_text: str) -> list[int | None]:
    """The trip count of each `while` loop of a program that may run its body more than once per execution of the
    computation holding it (None: a count neither XLA nor its condition says), in program order."""
    instructions = _parse(hlo_text)
    trips = [_loop_trips(ins, instructions) for ins in instructions if ins.opcode == "while"]
    return [n for n in trips if n is None or n > 1]


def _counted_trips(loop: _Instruction, instructions: list[_Instruction]) -> int | None:
    """The trip count of a `while` XLA left unannotated (XLA:GPU's gradient-accumulation loop, XLA:TPU's windowed
    einsums): its condition compares the induction variable with a constant (`i < N`, in the condition or a
    fusion it calls), counting from the constant the loop's initial tuple holds (0 if it is not one) in steps of
    the constant the body adds to it (1 if it adds none: XLA:TPU unrolls a windowed einsum's loop by two and
    steps by 2)."""
    cond = re.search(r"condition=%([\w.\-]+)", loop.attrs)
    if not cond:
        return None
    by_comp: dict[str, list[_Instruction]] = defaultdict(list)
    for i in instructions:
        by_comp[i.computation].append(i)
    by_name = {i.name: i for i in instructions}

    def constant(name: str) -> int | None:
        c = by_name.get(name)
        m = re.match(r"\s*(-?\d+)\s*$", c.args) if c is not None and c.opcode == "constant" else None
        return int(m.group(1)) if m else None

    def tuple_index(name: str) -> int | None:
        g = by_name.get(name)
        m = re.search(r"index=(\d+)", g.attrs) if g is not None and g.opcode == "get-tuple-element" else None
        return int(m.group(1)) if m else None

    comps, limit, counter = [cond.group(1)], None, None
    while comps and limit is None:
        for i in by_comp.get(comps.pop(), []):
            if i.opcode == "compare" and "direction=LT" in i.attrs and len(i.operands) == 2:
                limit, counter = constant(i.operands[1]), tuple_index(i.operands[0])
            elif i.opcode == "fusion" and (body := called(i)):
                comps.append(body)
    if limit is None:
        return None
    known = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"', loop.attrs)
    if counter is None and known:
        counter = int(known.group(1))
    start, step = 0, 1
    init = by_name.get(loop.operands[0]) if loop.operands else None
    if counter is not None and init is not None and init.opcode == "tuple" and counter < len(init.operands):
        start = constant(init.operands[counter]) or 0
    body = re.search(r"body=%([\w.\-]+)", loop.attrs)
    root = next((i for i in by_comp.get(body.group(1), []) if i.root), None) if body else None
    if counter is not None and root is not None and root.opcode == "tuple" and counter < len(root.operands):
        update = by_name.get(root.operands[counter])
        if update is not None and update.opcode == "add" and len(update.operands) == 2:
            for counted, added in (update.operands, update.operands[::-1]):  # i + c or c + i
                if tuple_index(counted) == counter and (c := constant(added)):
                    step = c
                    break
    return max(-(-(limit - start) // max(step, 1)), 1)


@dataclasses.dataclass
class AsyncFusions:
    """XLA:TPU's asynchronous collectives, written as fusions: a *start* fusion whose computation passes the
    collective to a custom call `AsyncCollectiveStart`, *continuation* fusions that drive it forward while they
    compute (a convolution fused with a clone of the collective), and a *done* fusion whose `AsyncCollectiveDone`
    waits for it. Every clone keeps the start's `channel_id`: one collective, written up to three times."""

    started: dict[str, list[str]]  # fused computation of a start fusion -> the collectives it starts
    done: dict[str, list[str]]  # fused computation of a done fusion -> the started collectives it waits for
    clones: set[str]  # collectives in done and continuation fusions (the start's, again)


_CHANNEL = re.compile(r"channel_id=(\d+)")


def async_fusions(instructions: list[_Instruction]) -> AsyncFusions:
    """The asynchronous collective fusions of a parsed program (`AsyncFusions`; empty for XLA:GPU and XLA:CPU,
    which write `-start`/`-done` pairs)."""
    calls: dict[str, str] = {}  # collective -> the custom call that takes it
    for ins in instructions:
        if ins.opcode == "custom-call" and (target := custom_call_target(ins)).startswith("AsyncCollective"):
            for o in ins.operands:
                calls[o] = target
    runs_in = {}  # fused computation -> the computation its fusion runs in (a start pairs with its own loop's done)
    for ins in instructions:
        if ins.opcode == "fusion" and (body := called(ins)):
            runs_in[body] = ins.computation

    def key(ins: _Instruction) -> tuple[str, str]:
        return _CHANNEL.search(ins.attrs).group(1), runs_in.get(ins.computation, "")

    starts: dict[tuple[str, str], str] = {}  # (channel, where it runs) -> its started collective
    started, done, clones = {}, {}, set()
    collectives = [i for i in instructions if _kind(i.opcode) in KINDS and _CHANNEL.search(i.attrs)]
    for ins in collectives:
        if calls.get(ins.name) == "AsyncCollectiveStart":
            started.setdefault(ins.computation, []).append(ins.name)
            starts[key(ins)] = ins.name
    for ins in collectives:
        if calls.get(ins.name) == "AsyncCollectiveStart" or (start := starts.get(key(ins))) is None:
            continue
        clones.add(ins.name)
        if calls.get(ins.name) == "AsyncCollectiveDone":
            done.setdefault(ins.computation, []).append(start)
    return AsyncFusions(started, done, clones)


def collectives(hlo_text: str, n_devices: int, *, as_accelerators_run: bool = True) -> list[CollectiveOp]:
    """Every collective of a compiled program (sync or async `-start` form), with its bytes and device groups.
    The accelerator rewrites look at sync all-reduces, the only kind XLA:CPU emits."""
    instructions = _parse(hlo_text)
    users: dict[str, list[_Instruction]] = defaultdict(list)
    for ins in instructions:
        for op in ins.operands:
            users[op].append(ins)
    by_name = {ins.name: ins for ins in instructions}
    times = _trip_counts(instructions)
    level = _collective_levels(instructions, by_name)
    clones = async_fusions(instructions).clones
    out = []
    for ins in instructions:
        kind = _kind(ins.opcode)
        if kind not in KINDS or ins.name in clones:  # an XLA:TPU async collective counts once, at its start
            continue
        groups = parse_groups(ins.attrs, n_devices)
        out.append(CollectiveOp(kind, ins.name, _message_bytes(ins, kind, groups, n_devices), groups,
                                times.get(ins.computation, 1), _op_name(ins), level[ins.name]))
    if as_accelerators_run:
        out = _AcceleratorRewrites(instructions, by_name, users, out).run()
    return out


def _collective_levels(instructions: list[_Instruction], by_name: dict[str, _Instruction]) -> dict[str, int]:
    """Levels: collectives passed on the longest chain of data before each instruction. Instructions are listed
    operands first, so one pass does it. Scalars add no level: XLA:CPU packs the gradient norm's partial sums into
    the gradients' all-reduces, which would otherwise chain every gradient's reduction to the previous one."""

    def by_kind(name: str) -> str | None:
        ins = by_name.get(name)
        kind = _kind(ins.opcode if ins is not None else "")
        return kind if kind in KINDS else None

    def passes_collective(name: str) -> bool:
        """`name` is a collective's (non-scalar) result: the collective, an element of a combined one, or the
        `-done` of an async one."""
        ins = by_name.get(name)
        if ins is None or ins.shape.startswith("(") or array_bytes(ins.shape) <= 8:
            return False
        if ins.opcode.endswith("-done") or by_kind(name) is not None:
            return True
        return ins.opcode == "get-tuple-element" and by_kind(ins.operands[0]) is not None

    level: dict[str, int] = {}
    for ins in instructions:
        operands = ins.operands
        if by_kind(ins.name) is not None:  # a scalar riding in a combined collective does not order it
            operands = [o for o in operands if o in by_name and array_bytes(by_name[o].shape) > 8] or operands
        level[ins.name] = max((level.get(o, 0) + passes_collective(o) for o in operands), default=0)
    return level


def _message_bytes(ins: _Instruction, kind: str, groups, n_devices: int) -> int:
    """The bytes of a collective's message: its result, but for the cases below."""
    sizes = _array_sizes(ins.shape)
    nbytes = array_bytes(ins.shape)
    if ins.opcode.startswith("ragged-all-to-all"):  # its output buffer, times the share its caller expects used
        last = _ARRAY.findall(ins.shape)[-1]
        return int(array_bytes(f"{last[0]}[{last[1]}]") * (routed_share(ins.attrs) or 1.0))
    if ins.opcode.endswith("-start") and kind != "all-reduce" and len(sizes) >= 2:
        # An async start holds (operands, results[, contexts]); the message is the results for all-gather and
        # all-to-all, the unscattered operands for reduce-scatter, the operand for permute
        arrays = _ARRAY.findall(ins.shape)
        half = {"collective-permute": arrays[:1], "reduce-scatter": arrays[:len(arrays) // 2]}.get(
            kind, arrays[len(arrays) // 2:])
        return array_bytes(" ".join(f"{d}[{s}]" for d, s in half))
    if kind == "reduce-scatter":  # the result is this device's 1/n of the operand
        return nbytes * (len(groups[0]) if groups else n_devices)
    return nbytes


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

    def __init__(self, instructions: list[_Instruction], by_name: dict[str, _Instruction], users,
                 ops: list[CollectiveOp]):
        self.by_name = by_name
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

    def _param(self, fusion: _Instruction, slot: int) -> str | None:
        return next((i.name for i in self.body[called(fusion) or ""]
                     if i.opcode == "parameter" and i.args.strip() == str(slot)), None)

    def _in(self, comp: str, name: str) -> _Instruction | None:
        return next((i for i in self.body[comp] if i.name == name), None)

    def _pure_add(self, ins: _Instruction) -> bool:
        """An add, or a fusion that is nothing but one."""
        if ins.opcode == "add":
            return True
        body = [i for i in self.body[called(ins) or ""] if i.opcode != "parameter"]
        return ins.opcode == "fusion" and len(body) == 1 and body[0].opcode == "add"

    def _adds(self, use: _Instruction, value: str) -> list[_Instruction]:
        """Inside fusion `use`, the reads of `value`'s parameter (all of them, to qualify, are adds)."""
        comp = called(use) or ""
        reads = []
        for slot in (k for k, o in enumerate(use.operands) if o == value):
            reads += self.inner_users.get((comp, self._param(use, slot)), [])
        return reads

    def _sum_partner(self, use: _Instruction, value: str) -> str | None:
        """The value `use` adds `value` to, if adding is all it does with it: add(value, w) (or a fusion that is
        only that add) gives w; in a larger fusion, every read of value's parameter must be an add with the same
        other parameter, whose value is returned."""
        if self._pure_add(use):
            others = [o for o in use.operands if o != value]
            return others[0] if len(use.operands) == 2 and len(others) == 1 else None
        if use.opcode != "fusion":
            return None
        comp, partners = called(use) or "", set()
        reads = self._adds(use, value)
        if not reads or any(r.opcode != "add" or len(r.operands) != 2 for r in reads):
            return None
        for r in reads:
            q = [self._in(comp, o) for o in r.operands]
            if any(i is None or i.opcode != "parameter" for i in q):
                return None
            partners |= {use.operands[int(i.args.strip())] for i in q} - {value}
        return partners.pop() if len(partners) == 1 else None

    def _partner(self, a: str, b: str) -> bool:
        """a and b are all-reduced over the same groups, are the same size, and every use of each adds it to the
        other: then one all-reduce of their sum does (AllReduceReassociate needs the add to be their only user)."""
        oa, ob = self.origin.get(a), self.origin.get(b)
        if (oa is None or ob is None or a == b or self.all_reduces[oa].groups != self.all_reduces[ob].groups
                or array_bytes(self.by_name[a].shape) != array_bytes(self.by_name[b].shape)):
            return False
        ua, ub = self.users.get(a, []), self.users.get(b, [])
        if not ua or {u.name for u in ua} != {u.name for u in ub}:
            return False
        return all(self._sum_partner(u, a) == b and self._sum_partner(u, b) == a for u in ua)

    def _slices(self, reads: list[_Instruction], size: int, n: int) -> bool:
        return bool(reads) and all(r.opcode == "dynamic-slice" and sum(_array_sizes(r.shape)) * n == size
                                   for r in reads)

    def keeps_slice(self, use: _Instruction, value: _Instruction, n: int) -> bool:
        """`use` keeps only a 1/n slice of `value`, maybe after adding a partner all-reduced value to it."""
        size = sum(_array_sizes(value.shape))
        if use.opcode == "dynamic-slice":
            return sum(_array_sizes(use.shape)) * n == size
        partner = self._sum_partner(use, value.name)
        if partner is not None and self._partner(value.name, partner):
            self.pairs.append((value.name, partner))
            if self._pure_add(use):
                after = self.users.get(use.name, [])
                return bool(after) and all(self.keeps_slice(u, use, n) for u in after)
            comp = called(use)
            return all(self._slices(self.inner_users.get((comp, r.name), []), size, n)
                       for r in self._adds(use, value.name))
        return use.opcode == "fusion" and self._slices(self._adds(use, value.name), size, n)

    def run(self) -> list[CollectiveOp]:
        scattered: dict[str, int] = defaultdict(int)  # all-reduce -> bytes of its elements that are sliced
        scattered_values = set()
        for name, op in self.all_reduces.items():
            n = len(op.groups[0])
            for value in self.elements(self.by_name[name]):
                nbytes = array_bytes(value.shape)
                uses = self.users.get(value.name, [])
                if n > 1 and nbytes > 8 and uses and all(self.keeps_slice(u, value, n) for u in uses):
                    scattered[name] += nbytes
                    scattered_values.add(value.name)
                else:  # a sum of partners that is not sliced afterwards is still one all-reduce
                    for u in uses:
                        partner = self._sum_partner(u, value.name)
                        if partner is not None and self._partner(value.name, partner):
                            self.pairs.append((value.name, partner))
        dropped: dict[str, int] = defaultdict(int)  # bytes of the second value of each summed pair, not sent
        gone = set()
        for a, b in self.pairs:
            if a in gone or b in gone:
                continue
            second = max(a, b)  # either one; deterministic
            gone.add(second)
            nbytes = array_bytes(self.by_name[second].shape)
            dropped[self.origin[second]] += nbytes
            if second in scattered_values:
                scattered[self.origin[second]] -= nbytes
        result = []
        leftovers: dict[tuple, CollectiveOp] = {}
        for op in self.ops:
            if op.name not in self.all_reduces:
                result.append(op)
                continue
            total = op.bytes - dropped.get(op.name, 0)
            rs = min(scattered.get(op.name, 0), total)
            if rs > 0:
                result.append(dataclasses.replace(op, kind="reduce-scatter", bytes=rs))
            if total - rs <= 0:
                continue
            if rs == 0:
                result.append(dataclasses.replace(op, bytes=total))
                continue
            # What stays an all-reduce of a split combined all-reduce (the norm's partial sums riding along with
            # each gradient) is combined again, per group and loop, as XLA's AllReduceCombiner does after the split.
            key = (str(op.groups), op.times, op.level)
            if key in leftovers:
                leftovers[key].bytes += total - rs
            else:
                leftovers[key] = dataclasses.replace(op, bytes=total - rs)
                result.append(leftovers[key])
        return result


def summarize(ops: list[CollectiveOp]) -> list[dict]:
    """[{kind, count, bytes}] per kind (counts and bytes per step), in `KINDS` order."""
    acc: dict[str, list[int]] = {}
    for op in ops:
        a = acc.setdefault(op.kind, [0, 0])
        a[0] += op.times
        a[1] += op.bytes * op.times
    return [{"kind": k, "count": acc[k][0], "bytes": acc[k][1]} for k in KINDS if k in acc]


def _dot_flops(ins: _Instruction, shapes: dict[str, str]) -> float:
    """2 x output elements x contracted size: the FLOPs of one `dot`."""
    out = (_array_sizes(ins.shape) or [0])[0]
    lhs = _ARRAY.search(shapes.get(ins.operands[0], "")) if ins.operands else None
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    if lhs is None or m is None:
        return 0.0
    dims = _ints(lhs.group(2))
    return 2.0 * out * math.prod(dims[d] for d in _ints(m.group(1)))


def compiled_flops(compiled) -> float:
    """FLOPs one device executes per call: XLA's cost analysis of the compiled program, plus the matmuls of loop
    iterations after the first. XLA's cost analysis counts a `while` body once, so a gradient-accumulation scan
    of K microbatches would otherwise count 1/K of the model's FLOPs. Matmuls are found as `dot` instructions,
    which is how XLA:CPU (where plans compile) keeps them; a GPU's cuBLAS custom-calls are not counted."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    flops = float((cost or {}).get("flops", 0.0))
    instructions = _parse(compiled.as_text())
    times = _trip_counts(instructions)
    shapes = {i.name: i.shape for i in instructions}
    return flops + sum((times[i.computation] - 1) * _dot_flops(i, shapes)
                       for i in instructions if i.opcode == "dot" and times[i.computation] > 1)


def op_scopes(hlo_text: str) -> dict[str, str]:
    """{instruction name: the JAX scope it came from (metadata op_name)}: joins profiler events to named scopes."""
    return {ins.name: name for ins in _parse(hlo_text) if (name := _op_name(ins))}
