"""The step time `shardlm plan` ranks by: the compiled program's kernels and collectives laid on a timeline in the
order the compiler scheduled them, each costed by what such a kernel reaches on the hardware (`perf.rates`).

    kernel time     = max(FLOPs / the throughput of its kind and shape, bytes / HBM bandwidth, launch cost)
    collective time = its buffer / the measured throughput of that kind, group and size within a host
                      (else the ring traffic of `costmodel.split_traffic` over the links, plus a latency)

Design choices:
- One device runs its kernels one after another (one compute stream) and its asynchronous collectives one after
  another on a second stream, from their `-start` to their `-done` in the schedule: XLA:GPU's latency-hiding
  scheduler and XLA:TPU's place those, so the overlap is the compiler's own. A collective's time that falls
  under kernels scheduled between its start and done is hidden; a `-done` reached before the collective finishes
  waits. A synchronous collective (XLA:CPU's) waits for the stream and blocks.
- A loop body's time counts once per iteration (its trip count). A conditional costs its costliest branch: one
  branch runs, and which one is data (the ring's two cases on different devices are equal work; a causal
  kernel's skip-or-compute block is charged as computed, the same as counting every branch).
- `Estimate.compute_s` is the kernels' time, `comm_s` the collectives' time left exposed, so that
  `compute_s + comm_s` is the step. `comm_total_s` is every collective's time, hidden or not.
- Collectives the schedule does not place (a rewrite merged or renamed them) are charged exposed.
- Asynchronous copies to and from host memory (offloaded activations) run on a third stream, the copy engine, at
  the host link's bandwidth; a `copy-done` reached early waits. Their waiting counts as exposed, like a
  collective's.
"""

from __future__ import annotations

import dataclasses

from shardlm.perf import costmodel
from shardlm.perf.costmodel import Estimate, Hardware, split_traffic
from shardlm.perf.hlo import CollectiveOp
from shardlm.perf.kernels import Kernel, Program
from shardlm.perf.rates import Rates


def kernel_seconds(k: Kernel, rates: Rates) -> float:
    """One execution of kernel `k`: the longer of its FLOPs at the throughput of its kind and its bytes at HBM
    bandwidth, and at least a launch."""
    compute = 0.0
    if k.flops:
        if k.kind == "gemm" and len(k.dims) == 4:
            rate = rates.gemm_flops_per_s(k.dtype, *k.dims)
        elif k.kind == "attention" and len(k.dims) == 4:
            rate = rates.attention_flops_per_s(max(k.dims[0], k.dims[1]), k.dims[2], bool(k.dims[3]))
        else:
            rate = rates.peak_flops
        compute = k.flops / rate
    return max(compute, k.bytes / rates.hbm_bytes_per_s, rates.launch_s)


def collective_seconds(op: CollectiveOp, hw: Hardware, rates: Rates, n_devices: int) -> float:
    """One execution of `op`: the measured throughput for its kind, group and size when its group is within one
    host and the table has it, else its ring traffic over the links plus a latency."""
    if op.group_size == 1 and op.kind != "collective-permute":
        return 0.0
    within, across = split_traffic(op, hw.devices_per_node, n_devices)
    if not across and (rate := rates.collective_bytes_per_s(op.kind, op.group_size, op.bytes)):
        return op.bytes / rate
    return within / hw.intra_node_bw + across / hw.inter_node_bw + hw.latency_s


@dataclasses.dataclass
class _Run:
    seconds: float = 0.0  # wall time of one run of the computation
    compute: float = 0.0  # kernels' time in it
    comm: float = 0.0  # collectives' time in it, hidden or not
    by_kind: dict = dataclasses.field(default_factory=dict)


class _Timeline:
    def __init__(self, program: Program, hw: Hardware, rates: Rates, n_devices: int):
        self.program, self.rates = program, rates
        self.op_s = [collective_seconds(op, hw, rates, n_devices) for op in program.collectives]
        self.runs: dict[str, _Run] = {}
        self.placed: set[int] = set()

    def run(self, computation: str, stack=()) -> _Run:
        if computation in self.runs:
            return self.runs[computation]
        r, clock, stream_free, finish = _Run(), 0.0, 0.0, {}
        copies_free, copied = 0.0, {}  # the copy engine: asynchronous copies to and from host memory
        for e in self.program.schedules.get(computation, []):
            if e.what == "kernel":
                t = kernel_seconds(e.kernel, self.rates)
                clock += t
                r.compute += t
                r.by_kind[e.kernel.kind] = r.by_kind.get(e.kernel.kind, 0.0) + t
            elif e.what in ("call", "branches"):
                called = [c for c in e.branches or (e.computation,) if c not in stack]
                if not called:
                    continue
                inner = max((self.run(c, stack + (computation,)) for c in called), key=lambda run: run.seconds)
                clock += inner.seconds * e.times
                r.compute += inner.compute * e.times
                r.comm += inner.comm * e.times
                for kind, t in inner.by_kind.items():
                    r.by_kind[kind] = r.by_kind.get(kind, 0.0) + t * e.times
            elif e.what in ("start", "sync"):
                self.placed.add(e.op)
                begin = max(clock, stream_free)
                stream_free = begin + self.op_s[e.op]
                r.comm += self.op_s[e.op]
                if e.what == "sync":
                    clock = stream_free
                else:
                    finish[e.op] = stream_free
            elif e.what == "done":
                clock = max(clock, finish.pop(e.op, clock))
            elif e.what == "copy_start":
                copies_free = max(clock, copies_free) + e.kernel.bytes / self.rates.host_bytes_per_s
                copied[e.kernel.name] = copies_free
            elif e.what == "copy_done":
                clock = max(clock, copied.pop(e.computation, clock))
        r.seconds = max([clock] + list(finish.values()) + list(copied.values()))
        self.runs[computation] = r
        return r


def estimate(program: Program, n_devices: int, hw: Hardware, rates: Rates) -> Estimate:
    """The step's estimate on `hw` with `rates` (see the module docstring)."""
    timeline = _Timeline(program, hw, rates, n_devices)
    step = timeline.run(program.entry)
    unplaced = sum(timeline.op_s[i] * op.times for i, op in enumerate(program.collectives)
                   if i not in timeline.placed)
    traffic = inter = 0.0
    for op in program.collectives:
        within, across = split_traffic(op, hw.devices_per_node, n_devices)
        traffic += (within + across) * op.times
        inter += across * op.times
    exposed = max(0.0, step.seconds - step.compute) + unplaced
    return Estimate(step.compute, exposed, traffic, inter, comm_total_s=step.comm + unplaced,
                    by_kind=dict(step.by_kind))


def step_estimate(program: Program | None, flops_per_device: float, collectives: list[CollectiveOp],
                  n_devices: int, hw: Hardware) -> Estimate:
    """The estimate a plan ranks by: the per-kernel timeline of the compiled program, or, for a step the compiler
    refused (no program), its FLOPs at peak plus its collectives, unhidden (`costmodel.estimate`)."""
    if program is None:
        return costmodel.estimate(flops_per_device, collectives, n_devices, hw)
    return estimate(program, n_devices, hw, hw.rates())
