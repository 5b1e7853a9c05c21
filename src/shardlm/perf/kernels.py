"""The compiled program as the kernels one device launches, in the order the compiler scheduled them: the one op list
the step-time model (`shardlm.perf.timeline`) costs.

The source is the optimised HLO text of a compiled step (XLA:GPU's, XLA:TPU's or XLA:CPU's `as_text()`), which is
scheduled (`is_scheduled=true`): each computation lists its instructions in the order they run. A computation is
*executed* if the entry runs it: the entry itself, `while` bodies (times their trip count), conditional branches (one
of them runs: the timeline charges the costliest), `call`s and the computations of non-collective async ops. Every
other computation belongs to one instruction (a fusion's body, a reducer) and is read only to cost that instruction.

Design choices:
- A `Kernel` is one top-level instruction of an executed computation that does work: a fusion, a custom call, or an
  unfused op (copy, transpose, dot, ...). Bookkeeping (parameter, tuple, get-tuple-element, bitcast, constant) is
  free. Its `kind` says which table costs it: `gemm` (a dot or convolution, alone or as a fusion's core: Triton
  GEMM fusions on GPUs, convolution fusions on TPUs, cuBLAS custom calls), `attention` (cuDNN's fused attention,
  a Pallas attention kernel), or `memory` (everything else, costed by its bytes).
- FLOPs: 2 x the output's elements x the contracted size for each dot (convolution: per output element, the
  kernel's elements over its output features); fused attention 4 x batch x heads x q x kv x head_dim forward, half
  that under a causal mask (the kernel skips the masked half), 2.5x the forward backward (FlashAttention's
  accounting: five matmuls against two); a Pallas kernel's own `cost_estimate` where it declares one.
- Bytes: what the kernel reads and writes in HBM: its operands and results, except that a parameter of a fusion
  read only through slices counts the slices (a scanned layer reading its weights from the stacked array), and an
  in-place dynamic-update-slice counts the update written, not the buffer (a scan stacking residuals), and of the
  buffer only what the fusion reads through slices (an accumulation adding into a block of it).
- Collectives are `shardlm.perf.hlo.CollectiveOp`s (bytes, groups, trip counts), placed in the sequence where they
  start and where they must be done; a synchronous one (XLA:CPU's) is both at once. XLA:TPU writes an asynchronous
  collective as fusions (`hlo.AsyncFusions`): its start and done fusions are the start and the done, and the
  continuation fusions between them, which compute while the collective moves, are kernels like any other (the
  collective's buffers they pass along count among their bytes; their matmuls outweigh them). Asynchronous copies
  (`copy-start`, and XLA:TPU's `dynamic-slice-start` / `dynamic-update-slice-start` into a stacked host buffer:
  activations offloaded to host memory and brought back) are placed the same way, as kernels of kind `copy`
  whose bytes (the slice moved, not the buffer) cross the host link.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from shardlm.kernels.grouped import megablox_flops, routed_rows
from shardlm.kernels.registry import ATTENTION_KERNELS
from shardlm.perf import hlo

ASYNC_COPIES = ("copy-start", "dynamic-slice-start", "dynamic-update-slice-start")
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "after-all",
        "partition-id", "replica-id", "add-dependency", "domain", "iota"}


def _names_attention(name: str, placement: str = "") -> bool:
    """Whether an HLO kernel's name is a registered attention kernel's (`AttentionKernel.hlo_names`: splash's
    Pallas kernels, the blockwise kernel's scopes), of that `placement` if given."""
    return any(n in name for k in ATTENTION_KERNELS.values() if not placement or k.placement == placement
               for n in k.hlo_names)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel launch per execution of its computation (`times` executions per step)."""

    name: str
    kind: str  # "gemm", "attention" or "memory"
    flops: float
    bytes: float
    dtype: str = ""  # a GEMM's or attention's operand dtype ("bf16", "f32", "f8e4m3fn")
    # gemm: (batch, m, n, k); attention: (q length, kv length, head dim, backward 0/1)
    dims: tuple[int, ...] = ()
    times: int = 1


@dataclasses.dataclass(frozen=True)
class Event:
    """One step of a computation's schedule: a kernel, a collective starting / being waited for (`op` indexes
    `Program.collectives`), or a nested computation run `times` times per run of this one."""

    what: str  # "kernel", "start", "done", "sync", "call", "branches", "copy_start", "copy_done" (`computation`:
    # its start)
    kernel: Kernel | None = None
    op: int = -1
    computation: str = ""
    times: int = 1
    branches: tuple[str, ...] = ()  # "branches": a conditional's computations, one of which runs


@dataclasses.dataclass
class Program:
    """Per computation, its schedule; `entry` is where a step starts."""

    entry: str
    schedules: dict[str, list[Event]]
    collectives: list[hlo.CollectiveOp]

    def kernels(self) -> list[Kernel]:
        """Every kernel of the step, with `times` its executions per step."""
        return [e.kernel for events in self.schedules.values() for e in events if e.what == "kernel"]


def _shape_dims(shape_text: str) -> tuple[str, list[int]]:
    m = hlo._ARRAY.search(shape_text)
    return (m.group(1), hlo._ints(m.group(2))) if m else ("", [])


def _config(ins: hlo._Instruction) -> dict:
    """An instruction's `backend_config` JSON (empty if it has none or it does not parse)."""
    start = ins.attrs.find("backend_config={")
    if start < 0:
        return {}
    text, depth = ins.attrs[start + len("backend_config="):], 0
    for i, ch in enumerate(text):  # the object ends at the brace that closes it: attributes may follow
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            try:
                return json.loads(text[:i + 1])
            except ValueError:
                return {}
    return {}


class _Reader:
    """Costs instructions of one parsed module."""

    def __init__(self, instructions: list[hlo._Instruction]):
        self.by_name = {i.name: i for i in instructions}
        self.in_computation: dict[str, list[hlo._Instruction]] = {}
        for i in instructions:
            self.in_computation.setdefault(i.computation, []).append(i)
        self.users: dict[str, list[hlo._Instruction]] = {}
        for i in instructions:
            for o in i.operands:
                self.users.setdefault(o, []).append(i)

    def shape(self, name: str) -> str:
        ins = self.by_name.get(name)
        return ins.shape if ins else ""

    # --- FLOPs -------------------------------------------------------------------------------------------------
    def dot(self, ins: hlo._Instruction, numbers: dict | None = None) -> tuple[float, tuple[int, ...], str]:
        """(FLOPs, (batch, m, n, k), operand dtype) of a dot (or a cuBLAS call with `numbers`, its
        dot_dimension_numbers)."""
        dtype, lhs = _shape_dims(self.shape(ins.operands[0])) if ins.operands else ("", [])
        _, rhs = _shape_dims(self.shape(ins.operands[1])) if len(ins.operands) > 1 else ("", [])

        def dims(key: str) -> list[int]:
            if numbers is not None:
                return [int(d) for d in numbers.get(key, [])]
            m = re.search(key.replace("_dimensions", "_dims") + r"=\{([\d,]*)\}", ins.attrs)
            return hlo._ints(m.group(1)) if m else []
        lc, rc = dims("lhs_contracting_dimensions"), dims("rhs_contracting_dimensions")
        lb, rb = dims("lhs_batch_dimensions"), dims("rhs_batch_dimensions")
        if not lhs or not rhs:
            return 0.0, (), dtype
        batch = math.prod(lhs[d] for d in lb if d < len(lhs))
        k = math.prod(lhs[d] for d in lc if d < len(lhs))
        m = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
        n = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
        return 2.0 * batch * m * n * k, (batch, m, n, k), dtype

    def convolution(self, ins: hlo._Instruction) -> tuple[float, tuple[int, ...], str]:
        """A convolution (how XLA:TPU writes matmuls, often as windows over padded dimensions): 2 x batch x output
        features x input features x, per spatial dimension, the window positions that fall on the input rather
        than on padding (as XLA's cost analysis counts them), as (1, m, n, k) for the GEMM table."""
        dtype, lhs = _shape_dims(self.shape(ins.operands[0])) if ins.operands else ("", [])
        _, rhs = _shape_dims(self.shape(ins.operands[1])) if len(ins.operands) > 1 else ("", [])
        _, out = _shape_dims(ins.shape)
        labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", ins.attrs)
        if not (lhs and rhs and out and labels):
            return 0.0, (), dtype
        lhs_l, rhs_l, out_l = labels.groups()
        window = re.search(r"window=\{([^}]*)\}", ins.attrs)
        spec = dict(re.findall(r"(\w+)=(\S+)", window.group(1))) if window else {}

        spatial = sorted(c for c in lhs_l if c.isdigit())
        sizes = [int(x) for x in spec.get("size", "").split("x") if x] or [1] * len(spatial)
        pads = [tuple(int(v) for v in p.split("_")) for p in spec.get("pad", "").split("x") if p] or \
            [(0, 0)] * len(spatial)
        strides = [int(x) for x in spec.get("stride", "").split("x") if x] or [1] * len(spatial)
        lhs_dilation = [int(x) for x in spec.get("lhs_dilate", "").split("x") if x] or [1] * len(spatial)
        rhs_dilation = [int(x) for x in spec.get("rhs_dilate", "").split("x") if x] or [1] * len(spatial)
        positions, out_spatial, window_size = 1, 1, 1
        for d, c in enumerate(spatial):
            n_in, n_out = lhs[lhs_l.index(c)], out[out_l.index(c)]
            w, (lo, _), st = sizes[d], pads[d], strides[d]
            ld, rd = lhs_dilation[d], rhs_dilation[d]
            extent = (n_in - 1) * ld  # the last input position, in dilated coordinates
            valid = 0
            for k in range(w):  # output positions o whose window tap k lands on the input: 0 <= o*st - lo + k*rd <= extent
                first = max(0, -(-(lo - k * rd) // st))
                last = min(n_out - 1, (lo - k * rd + extent) // st)
                valid += max(0, last - first + 1) / ld  # with lhs dilation, one tap in ld lands on a real input
            positions *= valid
            out_spatial *= n_out
            window_size *= w
        b, f, i = out[out_l.index("b")], out[out_l.index("f")], rhs[rhs_l.index("i")]
        return 2.0 * b * f * i * positions, (1, b * out_spatial, f, i * window_size), dtype

    def core(self, computation: str, seen=()) -> tuple[float, tuple[int, ...], str]:
        """FLOPs of the dots and convolutions a fused computation holds (nested fusions too), with the largest
        one's dims and dtype."""
        flops, best = 0.0, (0.0, (), "")
        for ins in self.in_computation.get(computation, []):
            if ins.opcode == "dot":
                f = self.dot(ins)
            elif ins.opcode == "convolution":
                f = self.convolution(ins)
            elif ins.opcode == "fusion" and (called := hlo.called(ins)) and called not in seen:
                f = self.core(called, seen + (called,))
            else:
                continue
            flops += f[0]
            best = max(best, f, key=lambda x: x[0])
        return flops, best[1], best[2]

    def attention(self, ins: hlo._Instruction, config: dict) -> tuple[float, tuple[int, ...], str]:
        """A cuDNN fused attention call: its [batch, heads, q, kv] scores (never stored) and head dim."""
        fmha = config.get("cudnn_fmha_backend_config", {})
        scores = [int(d) for d in fmha.get("intermediate_tensor_shape", {}).get("dimensions", [])]
        dtype, q = _shape_dims(self.shape(ins.operands[0])) if ins.operands else ("", [])
        if len(scores) != 4 or not q:
            return 0.0, (), dtype
        b, h, tq, tk = scores
        d = q[-1]
        backward = "Backward" in hlo.custom_call_target(ins)
        flops = 4.0 * b * h * tq * tk * d * (0.5 if fmha.get("mask_type") == "CAUSAL" else 1.0)
        return flops * (2.5 if backward else 1.0), (tq, tk, d, int(backward)), dtype

    def splash(self, ins: hlo._Instruction) -> tuple[float, tuple[int, ...], str] | None:
        """A Pallas splash attention kernel (`shardlm.kernels.splash` on TPUs; its calls declare no cost): its
        [batch, heads, seq, head_dim] queries are the largest 4-D array it reads or writes. Causal (shardlm's
        models are), so half of 4 x batch x heads x seq^2 x head_dim forward; the dq kernel recomputes the scores
        and does two more matmuls (1.5x), the dkv kernel three more (2x)."""
        name = ins.name
        passes = 1.5 if "_dq" in name else 2.0 if "_dkv" in name else 1.0 if "_fwd" in name else None
        if passes is None or not _names_attention(name, placement="per_device"):
            return None
        arrays = [(d, t) for text in [ins.shape] + [self.shape(o) for o in ins.operands]
                  for t, dims in hlo._ARRAY.findall(text) if len(d := hlo._ints(dims)) == 4 and t in ("bf16", "f32")]
        if not arrays:
            return None
        (b, h, t, d), dtype = max(arrays, key=lambda a: math.prod(a[0]))  # the queries' (or outputs') dtype
        return 2.0 * b * h * t * t * d * passes, (t, t, d, int(passes > 1)), dtype

    def megablox(self, ins: hlo._Instruction, estimate: dict, nbytes: float) -> tuple[float, float, str] | None:
        """A Megablox grouped matmul (`shardlm.kernels.grouped` on TPUs), whose name scope says how many of its
        buffer's rows the caller expects in groups: (FLOPs, bytes, dtype) for those (`grouped.megablox_flops`)."""
        op_name = hlo._op_name(ins)
        dtype, out = _shape_dims(ins.shape)
        flops = megablox_flops(op_name, float(estimate.get("flops", 0.0)) if estimate else None, tuple(out))
        if flops is None:
            return None
        share = routed_rows(op_name)[1]
        return flops, float(estimate.get("bytes_accessed", nbytes)) * share, dtype

    # --- bytes -------------------------------------------------------------------------------------------------
    def fusion_bytes(self, ins: hlo._Instruction, computation: str) -> float:
        """What a fusion reads and writes in HBM (see the module docstring for slices and in-place updates)."""
        params = {p.name: p for p in self.in_computation.get(computation, []) if p.opcode == "parameter"}
        slot = {int(m.group(1)): name for name, p in params.items()
                if (m := re.match(r"(\d+)", p.args.strip()))}
        total = 0.0
        in_place = set()
        root = next((i for i in self.in_computation.get(computation, []) if i.root), None)
        written = self._written(root, in_place) if root else hlo.array_bytes(ins.shape)
        for index, operand in enumerate(ins.operands):
            param = slot.get(index)
            total += self._read(param, hlo.array_bytes(self.shape(operand)), in_place) if param else \
                hlo.array_bytes(self.shape(operand))
        return total + written

    def _through(self, name: str) -> list[hlo._Instruction]:
        """The users of `name`, looking through bitcasts and reshapes."""
        out = []
        for u in self.users.get(name, []):
            out.extend(self._through(u.name) if u.opcode in ("bitcast", "reshape") else [u])
        return out

    def _read(self, param: str, full: float, in_place: set) -> float:
        users = self._through(param)
        if not users:
            return 0.0
        slices = [u for u in users if u.opcode in ("dynamic-slice", "slice", "gather") and u.operands and
                  self._source(u.operands[0]) == param]
        # read only through slices, or the buffer a dynamic-update-slice writes into in place (of which the fusion
        # reads only the rows it slices: an accumulation's block): the slices, not the buffer
        if len(slices) == len(users) or any(u.name in in_place for u in users):
            return sum(hlo.array_bytes(u.shape) for u in slices)
        return full

    def _source(self, name: str) -> str:
        ins = self.by_name.get(name)
        while ins is not None and ins.opcode in ("bitcast", "reshape") and ins.operands:
            name = ins.operands[0]
            ins = self.by_name.get(name)
        return name

    def _written(self, root: hlo._Instruction, in_place: set) -> float:
        if root.opcode == "tuple":
            return sum(self._written(self.by_name[o], in_place) if o in self.by_name else 0.0
                       for o in root.operands)
        if root.opcode in ("bitcast", "reshape") and root.operands and root.operands[0] in self.by_name:
            return self._written(self.by_name[root.operands[0]], in_place)
        if root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
            in_place.add(root.name)
            return hlo.array_bytes(self.shape(root.operands[1]))
        return hlo.array_bytes(root.shape)

    def copied(self, ins: hlo._Instruction) -> float:
        """Bytes an asynchronous copy moves: a copy's operand, a dynamic slice's slice, an update's update (XLA:TPU
        moves one layer's offloaded activations to or from the stacked host buffer this way)."""
        if ins.opcode == "dynamic-update-slice-start" and len(ins.operands) > 1:
            return hlo.array_bytes(self.shape(ins.operands[1]))
        if ins.opcode == "dynamic-slice-start" and ins.operands:
            sizes = re.search(r"dynamic_slice_sizes=\{([\d,]*)\}", ins.attrs)
            dtype, _ = _shape_dims(self.shape(ins.operands[0]))
            if sizes and dtype in hlo._DTYPE_BYTES:
                return hlo._DTYPE_BYTES[dtype] * math.prod(hlo._ints(sizes.group(1)))
        return hlo.array_bytes(self.shape(ins.operands[0])) if ins.operands else 0.0

    def plain_bytes(self, ins: hlo._Instruction) -> float:
        if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
            return 2.0 * hlo.array_bytes(self.shape(ins.operands[1]))
        if ins.opcode in ("dynamic-slice", "slice"):
            return 2.0 * hlo.array_bytes(ins.shape)
        return hlo.array_bytes(ins.shape) + sum(hlo.array_bytes(self.shape(o)) for o in ins.operands)

    # --- one instruction ---------------------------------------------------------------------------------------
    def kernel(self, ins: hlo._Instruction, times: int) -> Kernel | None:
        if ins.opcode in FREE:
            return None
        if ins.opcode == "fusion":
            called = hlo.called(ins)
            inner = [i for i in self.in_computation.get(called, []) if i.opcode == "custom-call"] if called else []
            if len(inner) == 1:  # XLA:TPU fuses a Pallas call with its operands' layout changes: cost the call
                k = self._custom_call(inner[0], times)
                return dataclasses.replace(k, name=ins.name)
            flops, dims, dtype = self.core(called) if called else (0.0, (), "")
            nbytes = self.fusion_bytes(ins, called) if called else hlo.array_bytes(ins.shape)
            return Kernel(ins.name, "gemm" if flops else "memory", flops, nbytes, dtype, dims, times)
        if ins.opcode == "custom-call":
            return self._custom_call(ins, times)
        if ins.opcode == "dot":
            flops, dims, dtype = self.dot(ins)
            return Kernel(ins.name, "gemm", flops, self.plain_bytes(ins), dtype, dims, times)
        if ins.opcode == "convolution":
            flops, dims, dtype = self.convolution(ins)
            return Kernel(ins.name, "gemm", flops, self.plain_bytes(ins), dtype, dims, times)
        return Kernel(ins.name, "memory", 0.0, self.plain_bytes(ins), times=times)

    def _custom_call(self, ins: hlo._Instruction, times: int) -> Kernel:
        target, config = hlo.custom_call_target(ins), _config(ins)
        nbytes = self.plain_bytes(ins)
        if target.startswith(tuple(t for k in ATTENTION_KERNELS.values() for t in k.hlo_targets)):
            flops, dims, dtype = self.attention(ins, config)
            return Kernel(ins.name, "attention", flops, nbytes, dtype, dims, times)
        if "gemm" in target or "matmul" in target:  # cuBLAS: __cublas$gemm, __cublas$lt$matmul(...)
            numbers = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
            flops, dims, dtype = self.dot(ins, numbers)
            return Kernel(ins.name, "gemm", flops, nbytes, dtype, dims, times)
        if target == "__gpu$xla.gpu.triton" and (work := _declared_gemm(ins)) is not None:
            dims = work
            dtype = _shape_dims(self.shape(ins.operands[-1]))[0] if ins.operands else ""
            return Kernel(ins.name, "gemm", 2.0 * math.prod(dims), nbytes, dtype, dims, times)
        if target == "tpu_custom_call" and (splash := self.splash(ins)) is not None:
            flops, dims, dtype = splash
            return Kernel(ins.name, "attention", flops, nbytes, dtype, dims, times)
        estimate = config.get("custom_call_config", {}).get("cost_estimate") or {}
        if target == "tpu_custom_call" and (grouped := self.megablox(ins, estimate, nbytes)) is not None:
            flops, nbytes, dtype = grouped
            return Kernel(ins.name, "gemm", flops, nbytes, dtype, (), times)
        if estimate:  # a Pallas kernel that says what it does (splash attention)
            flops = float(estimate.get("flops", 0.0))
            nbytes = float(estimate.get("bytes_accessed", nbytes))
            kind = "attention" if "attention" in hlo._op_name(ins) or _names_attention(hlo._op_name(ins)) else "gemm"
            dtype = _shape_dims(self.shape(ins.operands[0]))[0] if ins.operands else ""
            return Kernel(ins.name, kind if flops else "memory", flops, nbytes, dtype, (), times)
        return Kernel(ins.name, "memory", 0.0, nbytes, times=times)


def _declared_gemm(ins: hlo._Instruction) -> tuple[int, ...] | None:
    """The GEMM a Pallas Triton kernel says it amounts to in its metadata (`shardlm.kernels.grouped`: a grouped
    matmul's [groups, rows per group, N, K]), which XLA:GPU prints with quotes escaped as \\22."""
    m = re.search(r'shardlm_gemm\\22: \\22\[([0-9., ]+)\]\\22', ins.attrs)
    return tuple(float(x) for x in m.group(1).split(",")) if m else None


def _wrapped_collective(reader: _Reader, ins: hlo._Instruction, op_index: dict[str, int]) -> int | None:
    """The collective an `async-start` wraps (its called computation's), as an index of `op_index`."""
    for inner in reader.in_computation.get(hlo.called(ins) or "", []):
        if inner.name in op_index:
            return op_index[inner.name]
    return None


def program(hlo_text: str, n_devices: int, collectives: list[hlo.CollectiveOp] | None = None) -> Program:
    """The schedule of every executed computation of a compiled program (`as_text()`), and its collectives
    (`hlo.collectives` of the same text unless given)."""
    instructions = hlo._parse(hlo_text)
    ops = collectives if collectives is not None else hlo.collectives(hlo_text, n_devices)
    entry = next((m.group(1) for line in hlo_text.splitlines() if (m := re.match(r"^ENTRY %([\w.\-]+)", line))),
                 instructions[-1].computation if instructions else "")
    scheduler = _Scheduler(instructions, ops)
    schedules: dict[str, list[Event]] = {}
    pending = [entry]
    while pending:
        comp = pending.pop()
        if comp not in schedules:
            schedules[comp] = scheduler.events(comp, pending)
    return Program(entry, schedules, ops)


class _Scheduler:
    """Each computation's instructions as schedule events: collectives started, waited for or done in place, copies to
    and from the host, the computations it runs (their names added to the caller's `pending`), kernels. Each step
    below answers for the instructions it knows (None for the others), in this order."""

    def __init__(self, instructions, ops: list[hlo.CollectiveOp]):
        self.reader = _Reader(instructions)
        self.times = hlo._trip_counts(instructions)
        self.op_index = {op.name: i for i, op in enumerate(ops)}
        self.fused_async = hlo.async_fusions(instructions)
        self.started: dict[str, int] = {}

    def events(self, comp: str, pending: list[str]) -> list[Event]:
        events: list[Event] = []
        for ins in self.reader.in_computation.get(comp, []):
            for step in (self._collective_or_copy, self._folded, self._nested, self._async_collective, self._call):
                found = step(ins, comp, pending)
                if found is not None:
                    events.extend(found)
                    break
            else:
                k = self.reader.kernel(ins, self.times.get(comp, 1))
                if k is not None:
                    events.append(Event("kernel", kernel=k))
        return events

    def _collective_or_copy(self, ins, comp: str, pending) -> list[Event] | None:
        op_index = self.op_index
        if ins.name in op_index:  # a collective, sync or the start of an async one
            return [Event("start" if ins.opcode.endswith("-start") else "sync", op=op_index[ins.name])]
        if ins.opcode in ASYNC_COPIES:  # to or from host memory (offloaded activations), asynchronously
            return [Event("copy_start", kernel=Kernel(ins.name, "copy", 0.0, self.reader.copied(ins),
                                                       times=self.times.get(comp, 1)))]
        if ins.opcode in ("copy-done", "dynamic-slice-done", "dynamic-update-slice-done") and ins.operands:
            return [Event("copy_done", computation=ins.operands[0])]
        if ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in op_index:
            return [Event("done", op=op_index[ins.operands[0]])]
        return None

    def _folded(self, ins, comp: str, pending) -> list[Event] | None:
        """A collective the rewrites folded away, or the end of an async op costed at its start: nothing."""
        if hlo._kind(ins.opcode) in hlo.KINDS or ins.opcode.endswith("-done") or ins.opcode.endswith("-update"):
            return []
        return None

    def _nested(self, ins, comp: str, pending: list[str]) -> list[Event] | None:
        """A loop's body (run its trip count per run of `comp`) or a conditional's branches."""
        if ins.opcode == "while":
            body = re.search(r"body=%([\w.\-]+)", ins.attrs)
            if not body:
                return []
            n = self.times.get(body.group(1), 1) // max(self.times.get(comp, 1), 1)
            pending.append(body.group(1))
            return [Event("call", computation=body.group(1), times=max(n, 1))]
        if ins.opcode == "conditional":
            branches = tuple(hlo.branches(ins))
            pending.extend(branches)
            return [Event("branches", branches=branches)]
        return None

    def _async_collective(self, ins, comp: str, pending) -> list[Event] | None:
        """XLA:TPU's async collective fusions (the start begins its collectives, the done waits for them), and
        XLA:GPU's async reduce-scatter / all-to-all."""
        if ins.opcode == "fusion" and (called := hlo.called(ins)) and (
                names := self.fused_async.started.get(called) or self.fused_async.done.get(called)):
            what = "start" if called in self.fused_async.started else "done"
            return [Event(what, op=self.op_index[name]) for name in names if name in self.op_index]
        wrapped = _wrapped_collective(self.reader, ins, self.op_index) if ins.opcode == "async-start" else None
        if wrapped is not None:
            self.started[ins.name] = wrapped
            return [Event("start", op=wrapped)]
        if ins.opcode == "async-done" and ins.operands and ins.operands[0] in self.started:
            return [Event("done", op=self.started[ins.operands[0]])]
        return None

    def _call(self, ins, comp: str, pending: list[str]) -> list[Event] | None:
        if ins.opcode not in ("call", "async-start"):
            return None
        called = re.search(r"(?:to_apply|calls)=%([\w.\-]+)", ins.attrs)
        if not called:
            return []
        pending.append(called.group(1))
        return [Event("call", computation=called.group(1))]
