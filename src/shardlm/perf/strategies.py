"""Strategies: assignments of N devices to the mesh axes (data, fsdp, context, tensor), their names, and which
ones a config allows.

A strategy is four degrees whose product is the device count. Its name lists the axes used, with their degrees:
`dp8`, `fsdp8`, `cp8`, `tp8`, `fsdp4+tp2`, `fsdp2+cp2+tp2`; one device is `single`. `parse_strategy` reads those
names (a degree may be left out on one axis to mean "the rest": `fsdp+tp2`), long axis names (`data4+tensor2`,
`context2`) and the `DxFxT` and `DxFxCxT` forms (`2x2x2`, `1x2x2x2`), so the names `shardlm plan` prints are what
`shardlm bench --strategies` takes.

Context splits (cp) pay off only for long sequences, so `all_strategies` enumerates them when asked
(`shardlm plan` asks for sequences of `LONG_SEQUENCE` tokens or more, or when the batch has fewer sequences than
there are devices); otherwise they are left out, which keeps the plan of a short-sequence model as fast as before.
"""

from __future__ import annotations

import dataclasses
import re

from shardlm.errors import ShardlmError
from shardlm.mesh import MESH_AXES, resolve_degrees

_SHORT = {"data": "dp", "fsdp": "fsdp", "context": "cp", "tensor": "tp"}
_ALIASES = {"dp": "data", "data": "data", "fsdp": "fsdp", "cp": "context", "context": "context", "tp": "tensor",
            "tensor": "tensor"}
LONG_SEQUENCE = 4096  # from here on, `shardlm plan` also enumerates context splits


@dataclasses.dataclass(frozen=True, order=True)
class Strategy:
    """Degrees per axis. `context` comes last (and defaults to 1) so that the three-axis `Strategy(d, f, t)` of
    every strategy without a sequence split keeps its meaning; `mesh` lists the axes in mesh order."""

    data: int
    fsdp: int
    tensor: int
    context: int = 1

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.context * self.tensor

    @property
    def mesh(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "context": self.context, "tensor": self.tensor}

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


def all_strategies(n_devices: int, context: bool = False) -> list[Strategy]:
    """Every (data, fsdp, tensor) with data * fsdp * tensor = n_devices; with `context`, every split that also uses
    the context axis (data * fsdp * context * tensor = n_devices)."""
    divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
    out = []
    for c in divisors if context else [1]:
        rest = n_devices // c
        for d in (d for d in divisors if rest % d == 0):
            for f in (f for f in divisors if (rest // d) % f == 0):
                out.append(Strategy(d, f, rest // d // f, c))
    return out


def wants_context_splits(cfg, n_devices: int) -> bool:
    """Whether a plan should enumerate context splits for `cfg`: long sequences, or fewer sequences in a batch
    than devices to hold them."""
    return n_devices > 1 and (cfg.model.seq_len >= LONG_SEQUENCE or cfg.train.batch_size < n_devices)


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
            p = re.fullmatch(r"(dp|data|fsdp|cp|context|tp|tensor)(\d*)", part.strip())
            if not p or _ALIASES[p.group(1)] in degrees:
                raise ShardlmError(
                    f"strategy '{text}' is not understood; write axes with degrees joined by '+', e.g. dp8, fsdp8, "
                    "fsdp4+tp2, fsdp2+cp2+tp2 (a missing degree means the rest), or DATAxFSDPxTENSOR such as 2x2x2 "
                    "(DATAxFSDPxCONTEXTxTENSOR with a context axis)")
            degrees[_ALIASES[p.group(1)]] = int(p.group(2)) if p.group(2) else -1
    for axis in MESH_AXES:
        degrees.setdefault(axis, 1)
    if 0 in degrees.values():
        raise ShardlmError(f"strategy '{text}' has a degree of 0; degrees are positive")
    try:
        r = resolve_degrees(degrees["data"], degrees["fsdp"], degrees["tensor"], n_devices, degrees["context"])
    except ShardlmError as e:
        raise ShardlmError(f"strategy '{text}': {e}") from None
    return Strategy(r["data"], r["fsdp"], r["tensor"], r["context"])


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
