"""The devices at hand as the cost model's `Hardware`: what `mesh=auto` ranks a run's strategies on, and what
`shardlm bench` holds each measured step against (`local_hardware`).

On GPUs and TPUs, the datasheet's peak for the compute dtype and the device's memory (`hardware_for`). On the CPU,
this host's figures as measured once and kept (`shardlm.host_figures`: the matmul peak, memory and collective
bandwidth, the latency per collective), the same peak training's MFU is held against; and the memory per device
is the host's RAM split evenly among its devices (they share it).
"""

from __future__ import annotations

import os

from shardlm.perf.costmodel import Hardware


def host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_hardware(devices) -> Hardware:
    """This host's `devices` (CPU) as `Hardware`, from the figures kept for them or measured now (and kept)."""
    from shardlm.host_figures import kept

    n = len(devices)
    m, path = kept(devices)
    return Hardware(name=f"this host's CPU ({n} device{'s' * (n > 1)}, measured: {path})",
                    peak_flops=m["peak_flops"], memory_bytes=host_memory_bytes() / n,
                    intra_node_bw=m["bandwidth"] or 1e12, inter_node_bw=m["bandwidth"] or 1e12,
                    devices_per_node=n, latency_s=m["latency_s"], memory_bw=m["memory_bw"], efficiency="")


def local_hardware(devices, dtype: str) -> Hardware:
    """`devices` (the run's: CPU, GPU or TPU) as `Hardware` for the cost model."""
    from shardlm.flops import table_peak
    from shardlm.perf.costmodel import hardware_for

    if devices[0].platform == "cpu":
        return host_hardware(devices)
    peak = table_peak(devices[0].device_kind, dtype)
    stats = devices[0].memory_stats() or {}
    return hardware_for(len(devices), dtype, memory_bytes=stats.get("bytes_limit") or 80e9,
                        peak_tflops=peak / 1e12 if peak else None)
