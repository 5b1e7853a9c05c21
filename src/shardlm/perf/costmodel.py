"""The step-time model `shardlm plan` ranks strategies with. Deliberately simple, so every number can be checked:

    est_step_s = compute_s + comm_s
    compute_s  = FLOPs one device executes per step (XLA's cost analysis of the compiled step) / peak FLOP/s
    comm_s     = sum over the step's collectives of  traffic / bandwidth + latency

- traffic is what one device sends with the bandwidth-optimal (ring) algorithm over a group of n devices, for a
  collective of B bytes (`shardlm.perf.hlo` says which buffer B is): all-reduce 2(n-1)/n B (a reduce-scatter then
  an all-gather); all-gather, reduce-scatter and all-to-all (n-1)/n B; collective-permute B.
- bandwidth is the per-device link bandwidth in one direction: `intra_node_bw` within a host (node), and between
  hosts `inter_node_bw`, a device's share of its host's network (every device of a host sends at once). Devices
  are numbered in mesh order (the tensor axis innermost), `devices_per_node` consecutive devices to a host, as
  `shardlm.mesh` lays them out across hosts. A group that spans hosts is costed as a two-level collective (what
  NCCL's rings over several NICs and TPU's DCN collectives amount to): for a group of m devices on each of h
  hosts, a device sends (m-1)/m of the buffer within its host and 1/m of the (h-1)/h share between hosts (twice
  both for an all-reduce); an all-to-all sends what belongs to other hosts across. A ring over the whole group
  sends the same total; the split says which part meets the slow links. `split_traffic` gives the two parts.
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
(50 GB/s) per GPU between nodes (3.2 Tb/s per node), 10 us per collective.
"""

from __future__ import annotations

import dataclasses

from shardlm.errors import ShardlmError
from shardlm.flops import table_peak
from shardlm.models.config import FP8
from shardlm.perf.hlo import CollectiveOp
from shardlm.perf.rates import Rates, from_table
from shardlm.units import format_rate, parse_rate


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str = "H100 SXM"
    peak_flops: float = 494.5e12  # per device
    memory_bytes: float = 80e9  # per device
    intra_node_bw: float = 450e9  # bytes/s per device, one direction
    inter_node_bw: float = 50e9
    devices_per_node: int = 8
    latency_s: float = 10e-6  # per collective
    memory_bw: float = 3.35232e12  # HBM bytes/s per device
    efficiency: str = "h100"  # the efficiency table of `perf/efficiency/` its kernels are costed with ("": none)
    host_link_bw: float = 64e9  # bytes/s to and from host memory, one direction (a PCIe Gen5 x16 link)
    fp8_peak_flops: float | None = None  # dense FP8 peak per device, where it has FP8 matrix units

    def for_matmuls(self, matmul_dtype: str) -> "Hardware":
        """This hardware as a step whose blocks multiply in `matmul_dtype` (`model.matmul_dtype`) is held against:
        at its FP8 peak for `model.matmul_dtype=fp8` (what `shardlm.flops.peak_dtype` picks for a run's MFU), else as it is."""
        if matmul_dtype == FP8 and self.fp8_peak_flops:
            return dataclasses.replace(self, peak_flops=self.fp8_peak_flops)
        return self

    def rates(self) -> Rates:
        """What kernels reach on this hardware: its efficiency table's measurements where it has one, else the
        peak and memory bandwidth (`shardlm.perf.rates`)."""
        if self.efficiency:
            return from_table(self.efficiency, self.peak_flops, self.memory_bw, self.host_link_bw)
        # no table: every kernel at the peak and the memory bandwidth
        return Rates(self.peak_flops, self.memory_bw, host_bytes_per_s=self.host_link_bw)

    @property
    def host_bw(self) -> float:
        """A host's network bandwidth between hosts, one direction (bytes/s)."""
        return self.inter_node_bw * self.devices_per_node

    def describe(self) -> str:
        kernels = (f"kernels at the measured rates of perf/efficiency/{self.efficiency}.toml (peak "
                   f"{self.peak_flops / 1e12:g} TFLOP/s, HBM {self.memory_bw / 1e12:g} TB/s)" if self.efficiency else
                   f"kernels at {self.peak_flops / 1e12:g} TFLOP/s and {self.memory_bw / 1e9:g} GB/s of memory")
        return (f"{self.name}: {kernels} per device; collectives at {self.intra_node_bw / 1e9:g} GB/s within a "
                f"host of {self.devices_per_node}{' (or as measured)' if self.efficiency else ''}, "
                f"{format_rate(self.host_bw)} per host between hosts ({self.inter_node_bw / 1e9:g} GB/s per "
                f"device), +{self.latency_s * 1e6:g} us each; overlapped as the compiler scheduled them")


def h100_peak(dtype: str) -> float:
    """The default hardware's dense peak FLOP/s for a compute dtype (494.5e12 float32 as TF32, 989e12 bfloat16)."""
    return table_peak("NVIDIA H100 80GB HBM3", dtype)


def hardware_for(n_devices: int, dtype: str, *, memory_bytes: float = 80e9, peak_tflops: float | None = None,
                 intra_node_gbs: float = 450, hosts: int | None = None, devices_per_node: int | None = None,
                 inter_host_bandwidth: str | None = None, inter_node_gbs: float | None = None,
                 latency_us: float = 10) -> Hardware:
    """The hardware `shardlm plan`'s options describe for `n_devices` computing in `dtype`: the defaults are an
    H100 SXM node's (named so), any option changed makes it "custom". Hosts are given as a count (`hosts`) or as
    devices per host (`devices_per_node`), the network between them per host (`inter_host_bandwidth`, a rate such
    as '400Gb/s') or per device (`inter_node_gbs`)."""
    for flag, value in (("--peak-tflops", peak_tflops), ("--intra-node-gbs", intra_node_gbs),
                        ("--inter-node-gbs", inter_node_gbs), ("--devices-per-node", devices_per_node),
                        ("--hosts", hosts)):
        if value is not None and value <= 0:
            raise ShardlmError(f"{flag} must be positive, got {value}")
    if latency_us < 0:
        raise ShardlmError(f"--latency-us must be >= 0, got {latency_us}")
    per_host = devices_per_host(n_devices, hosts, devices_per_node)
    per_device_bw = inter_host_bw_per_device(per_host, inter_host_bandwidth, inter_node_gbs)
    h100 = h100_peak(dtype) / 1e12
    peak = h100 if peak_tflops is None else peak_tflops
    default = (peak, intra_node_gbs, per_device_bw, latency_us) == (h100, 450, 50e9, 10)
    return Hardware(peak_flops=peak * 1e12, memory_bytes=memory_bytes, intra_node_bw=intra_node_gbs * 1e9,
                    inter_node_bw=per_device_bw, devices_per_node=per_host, latency_s=latency_us * 1e-6,
                    name="H100 SXM" if default else "custom",
                    # the H100 table holds what an H100 measured: a changed peak is another chip
                    efficiency="h100" if peak == h100 else "")


def devices_per_host(n: int, hosts: int | None, devices_per_node: int | None) -> int:
    """Devices on each host, from a host count (which must divide `n`) or devices per host (default 8)."""
    if hosts is not None and devices_per_node is not None:
        raise ShardlmError("--hosts and --devices-per-node both say how devices group into hosts; pass one")
    if hosts is None:
        return devices_per_node or 8
    if n % hosts:
        raise ShardlmError(f"--hosts {hosts} does not divide the {n} devices evenly; choose a host count that "
                           f"divides {n}")
    return n // hosts


def inter_host_bw_per_device(per_host: int, inter_host_bandwidth: str | None, inter_node_gbs: float | None) -> float:
    """Bytes/s one device gets between hosts: its share of the host's network."""
    if inter_host_bandwidth is not None and inter_node_gbs is not None:
        raise ShardlmError("--inter-host-bandwidth and --inter-node-gbs both give the bandwidth between hosts; "
                           "pass one")
    if inter_host_bandwidth is None:
        return (50 if inter_node_gbs is None else inter_node_gbs) * 1e9
    try:
        return parse_rate(inter_host_bandwidth) / per_host
    except ValueError as e:
        raise ShardlmError(f"--inter-host-bandwidth {e}") from None


def traffic_factor(kind: str, n: int) -> float:
    """Bytes one device sends per byte of the collective's buffer, ring algorithm over n devices."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n
    if kind == "collective-permute":
        return 1.0
    return (n - 1) / n


def split_traffic(op: CollectiveOp, devices_per_node: int, n_devices: int) -> tuple[float, float]:
    """(bytes one device sends within its host, bytes it sends to other hosts) for one execution of `op`: the
    busiest group's, two-level across hosts (see the module docstring). Unknown groups: the whole mesh."""
    if op.kind == "collective-permute":
        pairs = op.groups or [[0, n_devices - 1]]
        across = any(a // devices_per_node != b // devices_per_node for a, b in pairs)
        return (0.0, float(op.bytes)) if across else (float(op.bytes), 0.0)
    best = (0.0, 0.0)
    for group in op.groups or [list(range(n_devices))]:
        per_host: dict[int, int] = {}
        for d in group:
            per_host[d // devices_per_node] = per_host.get(d // devices_per_node, 0) + 1
        g, h, m = len(group), len(per_host), max(per_host.values())
        if op.kind == "all-to-all":
            split = (op.bytes * (m - 1) / g, op.bytes * (g - m) / g)
        else:
            split = (traffic_factor(op.kind, m) * op.bytes, traffic_factor(op.kind, h) * op.bytes / m)
        best = max(best, split, key=lambda s: (s[1], s[0]))
    return best


@dataclasses.dataclass
class Estimate:
    compute_s: float
    comm_s: float  # collectives' time not hidden behind compute
    traffic_bytes: float  # sent by one device per step
    inter_node_bytes: float  # the part of it that crosses hosts (nodes)
    comm_total_s: float = 0.0  # every collective's time, hidden or not (the per-kernel model's; else comm_s)
    by_kind: dict = dataclasses.field(default_factory=dict)  # kernels' time by kind: gemm, attention, memory

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
        within, across = split_traffic(op, hw.devices_per_node, n_devices)
        comm += (within / hw.intra_node_bw + across / hw.inter_node_bw) * op.times
        traffic += (within + across) * op.times
        inter += across * op.times
    comm += hw.latency_s * issued(ops)
    return Estimate(flops_per_device / hw.peak_flops, comm, traffic, inter, comm)
