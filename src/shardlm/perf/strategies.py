"""Strategies: assignments of N devices to the mesh axes (stage, data, fsdp, expert, context, tensor), their
names, and which ones a config allows.

A strategy is six degrees whose product is the device count. Its name lists the axes used, with their degrees:
`dp8`, `fsdp8`, `cp8`, `tp8`, `pp4`, `ep8`, `fsdp4+tp2`, `pp2+fsdp2+tp2`; one device is `single`. `parse_strategy`
reads those names (a degree may be left out on one axis to mean "the rest": `fsdp+tp2`), long axis names
(`data4+tensor2`, `context2`, `stage2`, `expert2`) and the `DxFxT` and `DxFxCxT` forms (`2x2x2`, `1x2x2x2`), so
the names `shardlm plan` prints are what `shardlm bench --strategies` takes.

Context splits (cp) pay off only for long sequences, pipeline stages (pp) across hosts, expert splits (ep) only
for a mixture of experts: `all_strategies` enumerates each when asked (`shardlm plan` asks for context splits for
sequences of `LONG_SEQUENCE` tokens or more or batches with fewer sequences than devices, for stage splits when
the devices span several hosts, and for expert splits when the model has experts), which keeps the plan of a
short-sequence dense model on one host as fast as before.
"""

from __future__ import annotations

import dataclasses
import re

from shardlm.errors import ShardlmError
from shardlm.mesh import MESH_AXES, resolve_degrees

_SHORT = {"stage": "pp", "data": "dp", "fsdp": "fsdp", "expert": "ep", "context": "cp", "tensor": "tp"}
_ALIASES = {"dp": "data", "data": "data", "fsdp": "fsdp", "cp": "context", "context": "context", "tp": "tensor",
            "tensor": "tensor", "pp": "stage", "stage": "stage", "ep": "expert", "expert": "expert"}
LONG_SEQUENCE = 4096  # from here on, `shardlm plan` also enumerates context splits


@dataclasses.dataclass(frozen=True, order=True)
class Strategy:
    """Degrees per axis. The axes added after data, fsdp and tensor come last (and default to 1) so that the
    three-axis `Strategy(d, f, t)` of every strategy without them keeps its meaning; `mesh` lists the axes in mesh
    order."""

    data: int
    fsdp: int
    tensor: int
    context: int = 1
    stage: int = 1
    expert: int = 1

    @property
    def devices(self) -> int:
        return self.stage * self.data * self.fsdp * self.expert * self.context * self.tensor

    @property
    def mesh(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def make_mesh(self, devices):
        """The mesh of this strategy over the first `devices.size` of `devices`."""
        from shardlm.mesh import make_named_mesh

        return make_named_mesh(self.mesh, list(devices)[:self.devices])

    @property
    def name(self) -> str:
        parts = [f"{_SHORT[a]}{d}" for a, d in self.mesh.items() if d > 1]
        return "+".join(parts) or "single"

    def overrides(self) -> list[str]:
        """The `key=value` overrides that train with this strategy."""
        return [f"mesh.{a}={d}" for a, d in self.mesh.items()]

    def __str__(self) -> str:
        return self.name


def all_strategies(n_devices: int, context: bool = False, stage: bool = False, expert: bool = False
                   ) -> list[Strategy]:
    """Every (data, fsdp, tensor) with data * fsdp * tensor = n_devices; with `context`, `stage` or `expert`, every
    split that also uses those axes (the product of all the degrees is n_devices)."""
    divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
    out = []
    for p in divisors if stage else [1]:
        for e in divisors if expert else [1]:
            for c in divisors if context else [1]:
                if n_devices % (p * e * c):
                    continue
                rest = n_devices // (p * e * c)
                for d in (d for d in divisors if rest % d == 0):
                    for f in (f for f in divisors if (rest // d) % f == 0):
                        out.append(Strategy(d, f, rest // d // f, c, p, e))
    return out


def wants_context_splits(cfg, n_devices: int) -> bool:
    """Whether a plan should enumerate context splits for `cfg`: long sequences, or fewer sequences in a batch
    than devices to hold them."""
    return n_devices > 1 and (cfg.model.seq_len >= LONG_SEQUENCE or cfg.train.batch_size < n_devices)


def wants_stage_splits(cfg, n_devices: int, hosts: int | None) -> bool:
    """Whether a plan should enumerate pipeline stages: the devices span several hosts (`--hosts`), where stages
    send only activations over the slow links between them."""
    return n_devices > 1 and bool(hosts) and hosts > 1 and cfg.model.n_layers > 1


def wants_expert_splits(cfg) -> bool:
    """Whether a plan should enumerate expert splits: the model is a mixture of experts."""
    return cfg.model.moe_experts > 1


def parse_strategy(text: str, n_devices: int) -> Strategy:
    """'fsdp4+tp2', 'dp', 'data2+tensor4', 'fsdp2+cp2+tp2', '2x2x2', '1x2x2x2' (DxFxCxT) or 'single' -> a
    Strategy over `n_devices`."""
    t = text.strip().lower()
    if t in ("single", "1") and n_devices == 1:
        return Strategy(1, 1, 1)
    m = re.fullmatch(r"(\d+)x(\d+)(?:x(\d+))?x(\d+)", t)
    if m:
        degrees = {"data": int(m.group(1)), "fsdp": int(m.group(2)), "context": int(m.group(3) or 1),
                   "tensor": int(m.group(4))}
    else:
        degrees = {}
        for part in t.split("+"):
            p = re.fullmatch(r"(dp|data|fsdp|cp|context|tp|tensor|pp|stage|ep|expert)(\d*)", part.strip())
            if not p or _ALIASES[p.group(1)] in degrees:
                raise ShardlmError(
                    f"strategy '{text}' is not understood; write axes with degrees joined by '+', e.g. dp8, fsdp8, "
                    "fsdp4+tp2, fsdp2+cp2+tp2, pp2+fsdp4, ep4+fsdp2 (a missing degree means the rest), or "
                    "DATAxFSDPxTENSOR such as 2x2x2 "
                    "(DATAxFSDPxCONTEXTxTENSOR with a context axis)")
            degrees[_ALIASES[p.group(1)]] = int(p.group(2)) if p.group(2) else -1
    for axis in MESH_AXES:
        degrees.setdefault(axis, 1)
    if 0 in degrees.values():
        raise ShardlmError(f"strategy '{text}' has a degree of 0; degrees are positive")
    try:
        r = resolve_degrees(degrees["data"], degrees["fsdp"], degrees["tensor"], n_devices, degrees["context"],
                            degrees["stage"], degrees["expert"])
    except ShardlmError as e:
        raise ShardlmError(f"strategy '{text}': {e}") from None
    return Strategy(r["data"], r["fsdp"], r["tensor"], r["context"], r["stage"], r["expert"])


def parse_strategies(text: str, n_devices: int) -> list[Strategy]:
    """A comma-separated list of strategy names, duplicates dropped (in order)."""
    out = []
    for part in text.split(","):
        if part.strip():
            s = parse_strategy(part, n_devices)
            if s not in out:
                out.append(s)
    if not out:
        raise ShardlmError("--strategies is empty; give names such as dp8,fsdp8,tp8,fsdp4+tp2")
    return out


def rejection(cfg, strategy: Strategy, devices=None, vocab_size: int | None = None) -> str | None:
    """Why `cfg` cannot train with `strategy` on `devices` (default: the local ones) (a mesh degree that does not
    divide a dimension, or the batch; a plan that cannot place a model from a py: file on that mesh, for its
    vocabulary `vocab_size`), or None. Shapes only: nothing is compiled."""
    import jax

    from shardlm.train.state import check_batch, check_shardable

    mesh = strategy.make_mesh(jax.devices() if devices is None else devices)
    try:
        check_shardable(cfg, mesh, vocab_size)
        check_batch(cfg, mesh)
    except ShardlmError as e:
        return str(e)
    return None
