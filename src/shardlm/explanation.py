"""`explain`: where every parameter lives, read back from the real (sharded) arrays, not from a plan or a rule.

    print(shardlm.explain(sharded))            # a table: path, shape, dtype, spec, bytes per device, placed by
    shardlm.explain(trainer).to_json()         # the same as JSON, with per-device totals incl. optimizer state
    shardlm.explain(train_state, mesh)         # shardlm's own {"model", "optimizer"} state

Design choices:
- It reads arrays and a mesh, nothing else, so it sits below everything that makes arrays: shardlm's train state
  is explained here (`explain_state`), and an object that knows how to describe itself (a model placed by a plan,
  its trainer: `shardlm.foreign`) provides an `explanation()` method built from `explain_trees`. `explain(obj)`
  calls that method, so this module imports none of the packages above it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict

import jax
from jax.sharding import PartitionSpec as P

from shardlm.mesh import describe_mesh
from shardlm.sharding.rules import path_str
from shardlm.units import fmt_bytes


@dataclasses.dataclass
class Row:
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    bytes_per_device: int  # the largest shard held by any device
    total_bytes: int
    placed_by: str = ""
    spec_entries: list = dataclasses.field(default_factory=list)  # per dimension: null, an axis, or a list of axes


@dataclasses.dataclass
class Explanation:
    mesh: str
    params: list[Row]
    param_bytes_per_device: dict[int, int]  # device id -> bytes of parameters
    opt_bytes_per_device: dict[int, int]  # device id -> bytes of optimizer state ({} when there is none yet)
    mesh_shape: dict[str, int] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    axes_across_hosts: dict[str, int] = dataclasses.field(default_factory=dict)  # axis -> hosts one group spans

    @property
    def max_param_bytes(self) -> int:
        return max(self.param_bytes_per_device.values(), default=0)

    @property
    def max_opt_bytes(self) -> int:
        return max(self.opt_bytes_per_device.values(), default=0)

    @property
    def param_count(self) -> int:
        return sum(r.total_bytes // jax.numpy.dtype(r.dtype).itemsize for r in self.params)

    def to_dict(self) -> dict:
        devices = sorted(self.param_bytes_per_device)
        per_device = [{"device": d, "params": self.param_bytes_per_device[d],
                       "optimizer": self.opt_bytes_per_device.get(d, 0),
                       "total": self.param_bytes_per_device[d] + self.opt_bytes_per_device.get(d, 0)}
                      for d in devices]
        return {
            "mesh": self.mesh_shape,
            "parameters": [{k: v for k, v in dataclasses.asdict(r).items() if k != "spec_entries"}
                           | {"shape": list(r.shape), "spec": r.spec_entries} for r in self.params],
            "param_count": self.param_count,
            "param_bytes": sum(r.total_bytes for r in self.params),
            "per_device": per_device,
            "max_bytes_per_device": {"params": self.max_param_bytes, "optimizer": self.max_opt_bytes,
                                     "total": max((d["total"] for d in per_device), default=0)},
            "notes": self.notes,
            "axes_across_hosts": self.axes_across_hosts,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        return format_explanation(self)


def _shard_bytes(arr) -> dict[int, int]:
    """{device id: bytes of `arr` it holds}: an array's addressable shards, or for an abstract one (a
    ShapeDtypeStruct with a sharding, as a compile for a target has) the shards its sharding would make."""
    if hasattr(arr, "addressable_shards"):
        return {s.device.id: s.data.nbytes for s in arr.addressable_shards}
    itemsize = jax.numpy.dtype(arr.dtype).itemsize
    return {d.id: math.prod(len(range(*i.indices(n))) for i, n in zip(index, arr.shape, strict=True)) * itemsize
            for d, index in arr.sharding.devices_indices_map(tuple(arr.shape)).items()}


def _rows_and_usage(tree, placed_by: dict[str, str] | None = None) -> tuple[list[Row], dict[int, int]]:
    rows, usage = [], defaultdict(int)
    for path, arr in jax.tree_util.tree_flatten_with_path(tree)[0]:
        per_device = _shard_bytes(arr)
        shard_bytes = list(per_device.values())
        for device, nbytes in per_device.items():
            usage[device] += nbytes
        name = path_str(path)
        spec = tuple(arr.sharding.spec) + (None,) * (arr.ndim - len(arr.sharding.spec))  # one entry per dimension
        entries = [e if e is None or isinstance(e, str) else list(e) for e in spec]
        rows.append(Row(name, tuple(arr.shape), str(arr.dtype), str(P(*spec)), max(shard_bytes),
                        math.prod(arr.shape) * jax.numpy.dtype(arr.dtype).itemsize,
                        (placed_by or {}).get(name, ""), entries))
    return rows, dict(usage)


def explain_state(state, mesh) -> Explanation:
    """`state` is the nnx.State {"model", "optimizer"} built by `create_train_state`."""
    return explain_trees(state["model"], state["optimizer"], mesh)  # the models' only variables are parameters


def explain_trees(params, opt_state, mesh, placed_by: dict[str, str] | None = None,
                  notes: list[str] | None = None) -> Explanation:
    """Any parameter tree (and optimizer state, or None) on `mesh`; `placed_by` names what placed each path."""
    rows, p_usage = _rows_and_usage(params, placed_by)
    o_usage = _rows_and_usage(opt_state)[1] if opt_state is not None else {}
    return Explanation(describe_mesh(mesh), rows, p_usage, o_usage, dict(mesh.shape), list(notes or []))


def explain(obj, mesh=None) -> Explanation:
    """`explain(sharded)`, `explain(trainer)` (adds optimizer state), or `explain(train_state, mesh)`.
    `str()` of the result is the table; `.to_json()` the same data as JSON."""
    if callable(getattr(obj, "explanation", None)):
        return obj.explanation()
    if mesh is None:
        raise TypeError("explain(state, mesh) needs the mesh for a train state")
    return explain_state(obj, mesh)


def format_explanation(ex: Explanation) -> str:
    if not ex.params:
        return f"mesh {ex.mesh}: the model has no parameters"
    w = max(len(r.path) for r in ex.params)
    sw = max(28, max(len(r.spec) for r in ex.params))
    by = any(r.placed_by for r in ex.params)
    lines = [f"mesh {ex.mesh}: {len(ex.params)} parameters, {ex.param_count:,} values", ""]
    lines.append(f"{'parameter':<{w}}  {'shape':<18} {'dtype':<9} {'partition spec':<{sw}} {'bytes/device':>13}"
                 + ("  placed by" if by else ""))
    for r in ex.params:
        lines.append(f"{r.path:<{w}}  {str(r.shape):<18} {r.dtype:<9} {r.spec:<{sw}} "
                     f"{fmt_bytes(r.bytes_per_device):>13}" + (f"  {r.placed_by}" if by else ""))
    total_p = sum(r.total_bytes for r in ex.params)
    totals = f"per device: parameters {fmt_bytes(ex.max_param_bytes)} (of {fmt_bytes(total_p)} in all)"
    if ex.opt_bytes_per_device:
        most = max(b + ex.opt_bytes_per_device.get(d, 0) for d, b in ex.param_bytes_per_device.items())
        totals += f", optimizer state {fmt_bytes(ex.max_opt_bytes)}, total {fmt_bytes(most)}"
    lines += ["", totals]
    lines += [f"note: {n}" for n in ex.notes]
    return "\n".join(lines)
