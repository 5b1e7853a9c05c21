"""`mesh=auto` and `model.remat=auto`: the planner decides, when a run starts.

Design choices:
- The decision is `shardlm plan`'s ranking, nothing of its own: the train step is compiled for every strategy the
  devices allow (`mesh=auto`; otherwise the configured mesh alone), under every policy of `AUTO_REMATS`
  (`model.remat=auto`; otherwise the configured one), and the run takes the fastest estimated step that fits the
  devices' memory. The hardware it ranks on is the target's (`train --compile-only --target h100`), or on a CPU
  host this host's measured figures (`shardlm.perf.host`), or an accelerator's datasheet (`hardware_for`).
- Policies are tried from the one that keeps the most (none: nothing recomputed) to the one that keeps the least
  (full), so that among equal estimates the one that recomputes less wins; a policy that keeps more is faster
  whenever it fits, since recomputing is work.
- Resolved once: the run's config.yaml records the chosen degrees and policy (`mesh.auto` false), so a resume
  never re-plans (`shardlm.train.rundir.run_config` puts the saved choice in place of `mesh=auto` and
  `model.remat=auto` when it resumes), and the choice is reproducible: compiling and ranking are deterministic,
  and the CPU figures are measured once per host and kept.
- Several processes: process 0 plans, the others take its choice (`shardlm.distributed.broadcast`).
- This module sits above the trainer (it plans); the CLI calls it before `train`, which refuses an unresolved
  config with a one-line error (`shardlm.mesh.unresolved`).
"""

from __future__ import annotations

import dataclasses

from shardlm.config import Config, MeshConfig
from shardlm.errors import ShardlmError
from shardlm.mesh import resolve_degrees
from shardlm.models.config import AUTO_REMAT
from shardlm.perf.strategies import Strategy
from shardlm.perf.targets import Target
from shardlm.units import fmt_bytes

AUTO_REMATS = ("none", "save_qkv_proj", "save_attention", "full")
SHOWN = 3  # plan rows printed with the choice


def wants_plan(cfg: Config) -> bool:
    return cfg.mesh.auto or cfg.model.remat == AUTO_REMAT


@dataclasses.dataclass
class Decision:
    cfg: Config  # resolved: explicit degrees on every axis, a named remat policy
    text: str  # what was chosen and why, with the plan's top rows


def decide(cfg: Config, *, target: Target | None = None, n_devices: int | None = None, hosts: int | None = None,
           log=None) -> Decision:
    """Plan `cfg` on the local devices (or `n_devices` of `target` over `hosts`) and resolve `mesh=auto` and
    `model.remat=auto` to the fastest estimated step that fits. A one-line error if nothing fits."""
    from shardlm import distributed

    decided = distributed.broadcast("auto-plan", lambda: _plan_choice(cfg, target, n_devices, hosts, log))
    model = dataclasses.replace(cfg.model, remat=decided["remat"])
    mesh = MeshConfig(**decided["mesh"], sequence_parallel=cfg.mesh.sequence_parallel)
    return Decision(dataclasses.replace(cfg, model=model, mesh=mesh), decided["text"])


def _plan_choice(cfg: Config, target: Target | None, n_devices: int | None, hosts: int | None, log) -> dict:
    import jax

    from shardlm.perf.planner import format_rows, plan

    n = (n_devices or 1) if target else jax.device_count()
    strategies = None if cfg.mesh.auto else [_configured(cfg, n)]
    remats = list(AUTO_REMATS) if cfg.model.remat == AUTO_REMAT else None
    p = plan(cfg, n if target else None, _hardware(cfg, target, n, hosts), strategies=strategies, log=log,
             target=target, hosts=hosts, remats=remats)
    best = p.best
    asked = " and ".join(k for k, on in (("mesh=auto", cfg.mesh.auto), ("model.remat=auto", bool(remats))) if on)
    if best is None:  # not `planner.recommendation`'s advice: its --memory and remat hints are plan's options
        low = min(p.strategies, key=lambda r: r.peak)
        raise ShardlmError(f"{asked}: nothing fits in {fmt_bytes(p.hardware.memory_bytes)} per device; the smallest "
                           f"peak is {low.label} at {fmt_bytes(low.peak)}: lower train.batch_size or model.seq_len, "
                           "or use more devices")
    remat = best.remat or cfg.model.remat
    took = best.strategy.name + (f", model.remat={remat}" if remats else "")
    why = (f"the fastest estimated step that fits: {_seconds(best.est.step_s)} per step, peak "
           f"{fmt_bytes(best.peak)} of {fmt_bytes(p.hardware.memory_bytes)} per device, on {p.hardware.name}")
    runner_up = next((r for r in p.strategies[1:] if r.fits), None)
    if runner_up is not None and best.est.step_s > 0:
        why += f"; next {runner_up.label} at {runner_up.est.step_s / best.est.step_s:.2f}x"
    excluded = len(p.pruned) + sum(not r.fits for r in p.strategies)
    if excluded:
        why += f"; {excluded} more too large or unable to win"
    lines = [f"{asked}: planned {len(p.strategies)} compiled step(s) in {p.wall_s:.1f} s",
             *format_rows(p, SHOWN), f"{asked} took {took}: {why}"]
    return {"mesh": best.strategy.mesh, "remat": remat, "text": "\n".join(lines)}


def _configured(cfg: Config, n: int) -> Strategy:
    """The configured mesh as a strategy over `n` devices (`model.remat=auto` with a mesh given)."""
    m = cfg.mesh
    return Strategy(**resolve_degrees(m.data, m.fsdp, m.tensor, n, context=m.context, stage=m.stage,
                                      expert=m.expert))


def _hardware(cfg: Config, target: Target | None, n: int, hosts: int | None):
    import jax

    from shardlm.flops import peak_dtype
    from shardlm.perf.host import local_hardware

    # measured on this process's own devices (process 0 plans alone; a process is a host), costed as hosts of them
    return (target.hardware(peak_dtype(cfg.model), n, hosts) if target
            else local_hardware(jax.local_devices(), peak_dtype(cfg.model)))


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"
