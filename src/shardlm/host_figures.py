"""This host's CPU figures, measured once per host and device count and kept: what MFU on a CPU is held against
(`shardlm.flops.device_peak`, in training's logs and `bench`) and what the cost model costs a CPU plan with
(`shardlm.perf.host`), so that the two rest on one measurement.

Design choices:
- Measured, not assumed: a CPU has no datasheet. The matmul peak is a float32 matmul on every device at once
  (simulated devices share the cores), the memory bandwidth an elementwise pass over `MEMORY_PROBE_BYTES` per
  device, on every device at once; the collective bandwidth is an all-gather of `PROBE_BYTES` per device over all
  of them (the bytes one device sends with the ring algorithm, over its time less the latency); the latency per
  collective a one-float all-reduce's time.
- Kept in the cache (`HARDWARE_FILE`, under `shardlm.data.prepare.cache_root`), keyed by device count and cores:
  a plan ranks strategies whose estimates may be close, and the same figures every time make `mesh=auto`'s choice
  reproducible on a host; a training run's MFU is comparable with the last one's and with `bench`'s. Measured
  again, the best of a few tries varies by 2x on a busy 2-core host (0.012 against 0.026 TFLOP/s per device).
  Delete the file to measure again.
- One process only: several processes would each read the cache and might not agree on whether to measure,
  which every process must join (`measured_peak` is for the caller to use there).
- Below the trainer and the planner, which both read it; it knows nothing of either.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PROBE_BYTES = 4 * 2**20  # per device, all-gathered
# per device, read and written once: the size of what a small model's fused elementwise kernels stream on a CPU
# (a layer's activations), which runs about twice the rate of a pass over 64 MiB (DRAM alone) on the 2-core hosts
MEMORY_PROBE_BYTES = 4 * 2**20
HARDWARE_FILE = "host-hardware.json"


def best_time(fn, x, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls `fn(x)`, after one untimed call (which compiles)."""
    fn(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_peak(devices, n: int = 1024, repeats: int = 5) -> float:
    """Per-device fp32 matmul FLOP/s with every device busy at once (simulated CPU devices share cores)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    k = len(devices)
    a = jax.device_put(jnp.ones((k, n, n), jnp.float32), sharding)
    mm = jax.jit(lambda x: jnp.einsum("kij,kjl->kil", x, x), out_shardings=sharding)
    return 2 * n**3 / best_time(mm, a, repeats)


def measure(devices) -> dict:
    """{peak_flops, memory_bw, bandwidth, latency_s} of `devices` (CPU devices of this process), measured now."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

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
    sent = (n - 1) * PROBE_BYTES  # a ring all-gather: each device passes on the n - 1 other devices' shards
    return {"peak_flops": peak, "memory_bw": memory_bw, "bandwidth": sent / max(gather - latency, 1e-9),
            "latency_s": latency}


def kept(devices) -> tuple[dict, Path]:
    """(this host's figures for `devices`, the file they are kept in): from the cache, or measured now and kept."""
    from shardlm.data.prepare import cache_root

    key = f"{len(devices)} devices, {os.cpu_count()} cores"
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
    return known[key], path
