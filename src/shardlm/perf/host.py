"""The devices at hand as the cost model's `Hardware`: what `mesh=auto` ranks a run's strategies on, and what
`shardlm bench` holds each measured step against (`local_hardware`).

On GPUs and TPUs, the datasheet's peak for the compute dtype and the device's memory (`hardware_for`). On the CPU:

- Measured, not assumed: a CPU has no datasheet the cost model could read. The peak is a float32 matmul on every
  device at once (`shardlm.flops.measure_matmul_peak`: simulated devices share the cores), the memory bandwidth
  an elementwise pass over `MEMORY_PROBE_BYTES` per device, on every device at once; the collective
  bandwidth is an all-gather of `PROBE_BYTES` per device over all of them (bytes one device sends with the ring
  algorithm, over its time less the latency); the latency per collective is a one-float all-reduce's time.
- The memory per device is the host's RAM split evenly among its devices (they share it).
- Measured once per host and device count, and kept in the cache (`HARDWARE_FILE`): a plan ranks strategies
  whose estimates may be close, and the same figures every time make `mesh=auto`'s choice reproducible on a
  host. Delete the file to measure again.
"""

from __future__ import annotations

import json
import os

from shardlm.perf.costmodel import Hardware, traffic_factor

PROBE_BYTES = 4 * 2**20  # per device, all-gathered
# per device, read and written once: the size of what a small model's fused elementwise kernels stream on a CPU
# (a layer's activations), which runs about twice the rate of a pass over 64 MiB (DRAM alone) on the 2-core hosts
MEMORY_PROBE_BYTES = 4 * 2**20
HARDWARE_FILE = "host-hardware.json"


def host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measure(devices) -> dict:
    """{peak_flops, bandwidth, latency_s} of `devices` (CPU devices of this process), measured now."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardlm.flops import best_time, measure_matmul_peak

    n = len(devices)
    peak = measure_matmul_peak(devices, repeats=10)  # measured once per host and kept: the best of more tries
    mesh = Mesh(np.asarray(devices), ("d",))
    sharded = NamedSharding(mesh, P("d"))
    streamed = jax.device_put(jnp.ones((n * MEMORY_PROBE_BYTES // 4,), jnp.float32), sharded)
    memory_bw = 2 * MEMORY_PROBE_BYTES / best_time(jax.jit(lambda x: x * 1.5 + 1.0), streamed)  # read + write
    if n == 1:  # nothing to communicate with
        return {"peak_flops": peak, "memory_bw": memory_bw, "bandwidth": None, "latency_s": 0.0}

    def collective(op):
        return jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))

    one = jax.device_put(jnp.ones((n,), jnp.float32), sharded)
    latency = best_time(collective(lambda x: jax.lax.psum(x, "d")), one)
    floats = PROBE_BYTES // 4
    probe = jax.device_put(jnp.ones((n * floats,), jnp.float32), sharded)
    gather = best_time(collective(lambda x: jax.lax.all_gather(x, "d", tiled=True)[:floats]), probe)
    sent = traffic_factor("all-gather", n) * n * PROBE_BYTES
    return {"peak_flops": peak, "memory_bw": memory_bw, "bandwidth": sent / max(gather - latency, 1e-9),
            "latency_s": latency}


def host_hardware(devices) -> Hardware:
    """This host's `devices` (CPU) as `Hardware`, from the cache or measured now (and cached)."""
    from shardlm.data.prepare import cache_root

    n = len(devices)
    key = f"{n} devices, {os.cpu_count()} cores"
    path = cache_root() / HARDWARE_FILE
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if "memory_bw" not in known.get(key, {}):  # (figures cached before memory bandwidth was measured too)
        known[key] = measure(devices)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    m = known[key]
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
