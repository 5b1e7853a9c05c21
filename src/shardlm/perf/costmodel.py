"""The step-time model `shardlm plan` ranks strategies with. Deliberately simple, so every number can be checked:

    est_step_s = compute_s + comm_s
    compute_s  = FLOPs one device executes per step (XLA's cost analysis of the compiled step) / peak FLOP/s
    comm_s     = sum over the step's collectives of  traffic / bandwidth + latency

- traffic is what one device sends with the bandwidth-optimal (ring) algorithm over a group of n devices, for a
  collective of B bytes (`shardlm.perf.hlo` says which buffer B is): all-reduce 2(n-1)/n B (a reduce-scatter then
  an all-gather); all-gather, reduce-scatter and all-to-all (n-1)/n B; collective-permute B.
- bandwidth is the per-device link bandwidth in one direction: `intra_node_bw` when every group of the collective
  sits within one node, `inter_node_bw` when a group spans nodes. Devices are numbered in mesh order (the tensor
  axis innermost), `devices_per_node` consecutive devices to a node, as `jax.make_mesh` lays out a GPU cluster.
- latency is paid once per collective *as XLA:GPU issues them*: the compiled program read here is XLA:CPU's,
  which leaves independent collectives separate (FSDP's per-weight all-gathers, per-gradient reduce-scatters),
  while XLA:GPU's combiners merge those of the same kind and device groups into ops of up to 30 MiB. So the
  collectives at the same level of the dependency chain (`CollectiveOp.level`), kind and groups are charged one
  latency per started 30 MiB; a chain of dependent ones (tensor parallelism's per-layer all-reduces) pays each.
- No overlap of compute and communication is assumed, so the estimate leans pessimistic for strategies whose
  collectives XLA can hide behind compute (FSDP's weight all-gathers), and optimistic in assuming peak FLOP/s.
  It ranks strategies; it does not promise a step time. `shardlm bench` measures the real one.

The defaults describe an NVIDIA H100 SXM node: 494.5 TFLOP/s dense float32 (as TF32 on tensor cores, JAX's
default matmul precision), 80 GB, NVLink 4 at 450 GB/s per direction, 8 GPUs per node, 400 Gb/s InfiniBand
(50 GB/s) per GPU between nodes, 10 us per collective.
"""

from __future__ import annotations

import dataclasses

from shardlm.perf.hlo import CollectiveOp


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str = "H100 SXM"
    peak_flops: float = 494.5e12  # per device
    memory_bytes: float = 80e9  # per device
    intra_node_bw: float = 450e9  # bytes/s per device, one direction
    inter_node_bw: float = 50e9
    devices_per_node: int = 8
    latency_s: float = 10e-6  # per collective

    def describe(self) -> str:
        return (f"{self.name}: compute at {self.peak_flops / 1e12:g} TFLOP/s per device; collectives at "
                f"{self.intra_node_bw / 1e9:g} GB/s within a node of {self.devices_per_node}, "
                f"{self.inter_node_bw / 1e9:g} GB/s across nodes, +{self.latency_s * 1e6:g} us each; no overlap")


def h100_peak(dtype: str) -> float:
    """The default hardware's dense peak FLOP/s for a compute dtype (494.5e12 float32 as TF32, 989e12 bfloat16)."""
    from shardlm.perf.flops import table_peak

    return table_peak("NVIDIA H100 80GB HBM3", dtype)


def traffic_factor(kind: str, n: int) -> float:
    """Bytes one device sends per byte of the collective's buffer, ring algorithm over n devices."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n
    if kind == "collective-permute":
        return 1.0
    return (n - 1) / n


def crosses_nodes(op: CollectiveOp, devices_per_node: int, n_devices: int) -> bool:
    """True if any group (or permute pair) of the collective spans two nodes. Unknown groups: the whole mesh."""
    groups = op.groups or [list(range(n_devices))]
    return any(len({d // devices_per_node for d in g}) > 1 for g in groups)


@dataclasses.dataclass
class Estimate:
    compute_s: float
    comm_s: float
    traffic_bytes: float  # sent by one device per step
    inter_node_bytes: float  # the part of it that crosses nodes

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s


COMBINE_BYTES = 30 * 2**20  # XLA:GPU's default combine threshold for all-reduce, all-gather and reduce-scatter


def issued(ops: list[CollectiveOp]) -> int:
    """How many collectives XLA:GPU would issue per step after combining independent ones (see the docstring)."""
    batches: dict[tuple, int] = {}
    for op in ops:
        if op.group_size == 1 and op.kind != "collective-permute":
            continue  # a group of one device sends nothing
        if op.kind == "collective-permute" or op.kind == "all-to-all":
            batches[(op.name,)] = op.times
            continue
        key = (op.kind, str(op.groups), op.level, op.times)
        batches[key] = batches.get(key, 0) + op.bytes
    return sum(v if len(k) == 1 else max(1, -(-v // COMBINE_BYTES)) * k[3] for k, v in batches.items())


def estimate(flops_per_device: float, ops: list[CollectiveOp], n_devices: int, hw: Hardware) -> Estimate:
    comm = traffic = inter = 0.0
    for op in ops:
        n = 2 if op.kind == "collective-permute" else op.group_size or n_devices  # unknown groups: the whole mesh
        sent = traffic_factor(op.kind, n) * op.bytes * op.times
        if sent == 0:
            continue
        across = crosses_nodes(op, hw.devices_per_node, n_devices)
        comm += sent / (hw.inter_node_bw if across else hw.intra_node_bw)
        traffic += sent
        inter += sent if across else 0.0
    comm += hw.latency_s * issued(ops)
    return Estimate(flops_per_device / hw.peak_flops, comm, traffic, inter)
