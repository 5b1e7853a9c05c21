"""`explain`: where every parameter lives, read back from the real (sharded) arrays, not from the plan."""

import dataclasses
from collections import defaultdict

import jax

from shardlm.mesh import describe_mesh
from shardlm.sharding.rules import path_str


@dataclasses.dataclass
class Row:
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    bytes_per_device: int  # the largest shard held by any device
    total_bytes: int


@dataclasses.dataclass
class Explanation:
    mesh: str
    params: list[Row]
    param_bytes_per_device: dict[int, int]  # device id -> bytes of parameters
    opt_bytes_per_device: dict[int, int]  # device id -> bytes of optimizer state

    @property
    def max_param_bytes(self) -> int:
        return max(self.param_bytes_per_device.values())

    @property
    def max_opt_bytes(self) -> int:
        return max(self.opt_bytes_per_device.values())

    @property
    def param_count(self) -> int:
        return sum(r.total_bytes // jax.numpy.dtype(r.dtype).itemsize for r in self.params)


def _rows_and_usage(tree) -> tuple[list[Row], dict[int, int]]:
    rows, usage = [], defaultdict(int)
    for path, arr in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shard_bytes = [s.data.nbytes for s in arr.addressable_shards]
        for shard in arr.addressable_shards:
            usage[shard.device.id] += shard.data.nbytes
        rows.append(Row(path_str(path), tuple(arr.shape), str(arr.dtype), str(arr.sharding.spec),
                        max(shard_bytes), arr.nbytes))
    return rows, dict(usage)


def explain_state(state, mesh) -> Explanation:
    """`state` is the nnx.State {"model", "optimizer"} built by `create_train_state`."""
    rows, p_usage = _rows_and_usage(state["model"])  # the GPT's only variables are its parameters
    _, o_usage = _rows_and_usage(state["optimizer"])
    return Explanation(describe_mesh(mesh), rows, p_usage, o_usage)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_explanation(ex: Explanation) -> str:
    w = max(len(r.path) for r in ex.params)
    lines = [f"mesh {ex.mesh}: {len(ex.params)} parameters, {ex.param_count:,} values", ""]
    lines.append(f"{'parameter':<{w}}  {'shape':<18} {'partition spec':<28} {'bytes/device':>13}")
    for r in ex.params:
        lines.append(f"{r.path:<{w}}  {str(r.shape):<18} {r.spec:<28} {fmt_bytes(r.bytes_per_device):>13}")
    total_p = sum(r.total_bytes for r in ex.params)
    lines += [
        "",
        f"per device: parameters {fmt_bytes(ex.max_param_bytes)} (of {fmt_bytes(total_p)} in all), "
        f"optimizer state {fmt_bytes(ex.max_opt_bytes)}, "
        f"total {fmt_bytes(ex.max_param_bytes + ex.max_opt_bytes)}",
    ]
    return "\n".join(lines)


def explain(state, mesh) -> str:
    return format_explanation(explain_state(state, mesh))
