"""What each kind of kernel and collective reaches on a device: the efficiency tables of `perf/efficiency/`, one
file per target, each figure with the published measurement it comes from.

- GEMMs: throughput by (M, N, K) and dtype, interpolated in log2 space over the table's grid (trilinear); batch
  dimensions fold into M. Beyond the grid a dimension keeps the edge's throughput (a larger GEMM is as efficient as
  the largest measured), below it the edge's time (a smaller one is not faster: the GPU is not full).
- Fused attention: throughput by sequence length (log2-interpolated) and head dim (the nearest measured).
- HBM: one bandwidth; a memory-bound kernel moves its bytes at it.
- Collectives within a host: the table's throughput for that kind and group size, interpolated over log2 bytes;
  across hosts, the network's bandwidth (`shardlm.perf.costmodel.split_traffic`) plus a latency.
- A target without a table (TPUs, A100s, a CPU host) gets the figures a datasheet or a measurement on this host
  gives, at efficiency 1 (`Hardware.rates`; the hardware's description says which).
- Every kernel costs at least `launch_s` (XLA:GPU's performance model charges 1 us per kernel launch,
  `kKernelLaunchOverhead` in gpu_performance_model_base.h).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import tomllib
from pathlib import Path

TABLES = Path(__file__).with_name("efficiency")


@dataclasses.dataclass(frozen=True)
class Rates:
    peak_flops: float  # dense, the compute dtype's (what an unmeasured GEMM or attention reaches)
    hbm_bytes_per_s: float
    launch_s: float = 0.0
    host_bytes_per_s: float = 64e9  # between the device and host memory, one direction (PCIe Gen5 x16)
    gemm: dict | None = None  # {(m, n, k): {"bf16": FLOP/s, "f32": FLOP/s}} over a grid of sizes (the same per dim)
    attention: dict | None = None  # {"seq": [...], "forward": {head_dim: [...]}, "backward": {...}}
    collectives: dict | None = None  # {(kind, group size): [(bytes, bytes/s)] sorted}

    @functools.cached_property
    def _gemm_grid(self) -> list[int]:
        """The sizes the GEMM table measured each of M, N and K at, ascending."""
        return sorted({m for m, _, _ in self.gemm})

    # --- GEMMs -------------------------------------------------------------------------------------------------
    def gemm_flops_per_s(self, dtype: str, batch: int, m: int, n: int, k: int) -> float:
        """Throughput of one GEMM of `batch` x (m x k) @ (k x n) in `dtype`."""
        if not self.gemm or min(m, n, k) <= 0:
            return self.peak_flops
        column = "f32" if dtype in ("f32", "f64") else "bf16"
        scale = 2.0 if dtype.startswith("f8") else 1.0  # FP8 tensor cores: twice bf16's rate
        lo, hi = self._gemm_grid[0], self._gemm_grid[-1]
        dims = [max(batch, 1) * m, n, k]
        shrink = math.prod(min(1.0, d / lo) for d in dims)  # below the grid: the edge's time, not less
        logs = [math.log2(min(max(d, lo), hi)) for d in dims]
        return scale * shrink * self._trilinear(column, logs)

    def _trilinear(self, column: str, logs: list[float]) -> float:
        sizes = self._gemm_grid
        grid = [math.log2(x) for x in sizes]
        corners = []
        for x in logs:
            i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
            corners.append((i, (x - grid[i]) / (grid[i + 1] - grid[i])))
        total = 0.0
        for a in (0, 1):
            for b in (0, 1):
                for c in (0, 1):
                    w = ((corners[0][1] if a else 1 - corners[0][1]) * (corners[1][1] if b else 1 - corners[1][1])
                         * (corners[2][1] if c else 1 - corners[2][1]))
                    if w == 0:
                        continue
                    key = tuple(sizes[corners[d][0] + e] for d, e in enumerate((a, b, c)))
                    total += w * math.log2(self.gemm[key][column])
        return 2 ** total  # interpolated in log space: throughput spans two orders of magnitude

    # --- attention ---------------------------------------------------------------------------------------------
    def attention_flops_per_s(self, seq: int, head_dim: int, backward: bool) -> float:
        if not self.attention or seq <= 0:
            return self.peak_flops
        table = self.attention["backward" if backward else "forward"]
        dims = sorted(int(d) for d in table)
        nearest = min(dims, key=lambda d: (abs(math.log2(max(head_dim, 1)) - math.log2(d)), -d))
        return _log_interpolate(self.attention["seq"], table[str(nearest)], seq)

    # --- collectives -------------------------------------------------------------------------------------------
    def collective_bytes_per_s(self, kind: str, group: int, nbytes: float) -> float | None:
        """Throughput of one collective of `nbytes` over `group` devices of one host, if measured."""
        if not self.collectives or group < 2:
            return None
        sizes = sorted({g for (k, g) in self.collectives if k == kind})
        if not sizes:
            return None
        g = min(sizes, key=lambda s: (abs(s - group), -s))
        points = self.collectives[(kind, g)]
        return _log_interpolate([p[0] for p in points], [p[1] for p in points], nbytes)


def _log_interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """ys at x, linear in log2(x) between the points, the edge value beyond them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x) - 1
    t = (math.log2(x) - math.log2(xs[i])) / (math.log2(xs[i + 1]) - math.log2(xs[i]))
    return ys[i] + t * (ys[i + 1] - ys[i])


@functools.lru_cache(maxsize=None)
def table(name: str) -> dict:
    """The efficiency file `perf/efficiency/<name>.toml`, parsed."""
    with open(TABLES / f"{name}.toml", "rb") as f:
        return tomllib.load(f)


@functools.lru_cache(maxsize=None)  # a plan costs every strategy with the same hardware's rates
def from_table(name: str, peak_flops: float, hbm_bytes_per_s: float | None = None,
               host_bytes_per_s: float = 64e9) -> Rates:
    """Rates of target `name` (an efficiency file) whose compute dtype peaks at `peak_flops`; `hbm_bytes_per_s`
    replaces the file's HBM bandwidth (an H200 is an H100 with faster memory)."""
    t = table(name)
    gemm = None
    if points := t.get("gemm", {}).get("gemm_points"):
        gemm = {(int(m), int(n), int(k)): {"bf16": bf16, "f32": f32} for m, n, k, bf16, f32 in points}
    collectives = None
    if points := t.get("collectives", {}).get("collective_points"):
        collectives = {}
        for kind, group, groups, nbytes, rate in points:
            if groups * group == 8:  # a whole host's worth of groups at once, as a mesh axis runs them
                collectives.setdefault((kind, int(group)), []).append((float(nbytes), float(rate)))
        collectives = {k: sorted(v) for k, v in collectives.items()}
    attention = t.get("attention") if "seq" in t.get("attention", {}) else None
    return Rates(peak_flops, hbm_bytes_per_s or float(t["hbm"]["bytes_per_s"]), float(t.get("launch_s", 0.0)),
                 host_bytes_per_s, gemm, attention, collectives)
