"""`shardlm plan`: what every strategy costs before anything runs.

For each assignment of N devices to (data, fsdp, tensor) that the config allows (and to context too, for long
sequences or a batch smaller than the devices: `strategies.wants_context_splits`; to pipeline stages when the
devices span hosts; to experts for a mixture of experts), the real train step (the one
`shardlm train` runs: model, AdamW, loss, gradient clipping) is lowered and compiled against N devices, and read:

- bytes per device: parameters and optimizer state from the shardings of the state (exactly what each device
  holds); gradients, sharded like the parameters once reduced; the peak from XLA's memory analysis of the
  compiled step (XLA:TPU's own peak, else arguments + outputs - donated aliases + temporaries), and as its
  temporaries the rest of the peak beside the state, so that peak = params + optimizer + temporaries in every row
  (`CompiledStep.at_peak`: XLA:TPU's temporary allocation can exceed its peak);
- the collectives per step, from the compiled HLO (`shardlm.perf.hlo`);
- FLOPs per device per step, from XLA's cost analysis;
- an estimated step time from `shardlm.perf.costmodel`;
- with several hosts (`--hosts`), which collectives cross between them and what each device sends across,
  costed at the hosts' network bandwidth: the hybrid that keeps its chatty axes inside hosts ranks first.

Strategies are compiled in the order of an analytic lower bound on their step time (`shardlm.perf.bounds`);
once one that fits has an estimate, those whose bound exceeds it are not compiled (listed as pruned, with the
reason); the bound's compute is scaled by what the strategies compiled so far showed of it (`bounds.Calibration`).
Progress is a line per candidate as its fate is known (compiled, failed or pruned), counted against all
of them: the count's total never changes. What XLA logs while compiling is kept off the terminal; the tensors
its partitioner had to replicate to reshard them are reported per strategy (`shardlm.perf.xla_log`).

Nothing is executed and no array is allocated: the state is abstract (shapes and shardings). On a CPU host the N
devices are simulated (`--xla_force_host_platform_device_count`), so 64 or 256 work on a laptop; the compiled
program is XLA:CPU's, whose partitioning is the accelerators' but whose buffer scheduling is its own, so the
temporaries are indicative (within tens of percent of a GPU's), not exact.

With a target (`--target h100`, `shardlm.perf.targets`) the step is compiled by that accelerator's own compiler
for abstract devices of it: memory, collectives and fits are then XLA:GPU's or XLA:TPU's, and the compiler's own
estimate of the step's time (`compiler_s`) and the MFU it implies stand beside the cost model's (XLA:TPU's is
withheld for a step with loops, whose bodies it counts once: `compiled.tpu_seconds`). A program the compiler
refuses for its memory (XLA:TPU does) is reported as not fitting, with the compiler's reason. No MFU above 100% is
shown: a step faster than the peak allows for the model's FLOPs is an estimator's error (`StrategyPlan.mfu`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import sys
import time

from shardlm.config import Config, describe
from shardlm.errors import ShardlmError
from shardlm.flops import peak_dtype
from shardlm.models.config import FP8
from shardlm.perf import hlo
from shardlm.perf.bounds import Calibration, lower_bound
from shardlm.perf.compiled import CompiledStep, CompileFailed, compile_step
from shardlm.perf.costmodel import Estimate, Hardware, h100_peak, issued, split_traffic
from shardlm.perf.kernels import Program
from shardlm.perf.strategies import (
    Strategy,
    all_strategies,
    rejection,
    wants_context_splits,
    wants_expert_splits,
    wants_stage_splits,
)
from shardlm.perf.targets import Target
from shardlm.perf.timeline import step_estimate
from shardlm.perf.xla_log import Rematerialisation
from shardlm.units import fmt_bytes, fmt_duration


LONG_PLAN_S = 600  # a plan whose pace says it will take longer than this is told of --budget, once
BUDGET_RAN_OUT = "not compiled: the --budget of"  # a candidate's reason when the plan's time was up before it


@dataclasses.dataclass
class StrategyPlan:
    strategy: Strategy
    params: int  # bytes per device
    optimizer: int
    gradients: int  # once reduced, sharded like the parameters; these buffers are part of `temporaries`
    temporaries: int  # the rest of the peak: peak - params - optimizer (`CompiledStep.at_peak`)
    peak: int  # everything the step holds at its peak: the compiler's, or arguments + outputs - aliases + temporaries
    collectives: list[hlo.CollectiveOp]
    flops_per_device: float
    model_flops: float  # per step, all devices (the model source's convention: 6N + 12LTd for shardlm's models)
    est: Estimate | None  # set by `rank`, for a given hardware
    fits: bool
    compile_s: float
    rank: int = 0
    compiler_s: float | None = None  # the target compiler's own estimate of the step's time
    compiler_withheld: str | None = None  # why the compiler's estimate is not given although it made one
    compiler_temps: int = 0  # the compiler's temporary allocation (XLA's temp size; XLA:TPU's exceeds the peak)
    refusal: str | None = None  # the target compiler refused the program (it does not fit): its reason
    hidden: dict | None = None  # XLA:GPU's schedule: fraction of each collective kind's time hidden by compute
    host_temps: int = 0  # temporaries in host memory (activations offloaded by `model.remat_offload`)
    remat: str = ""  # the remat policy it was compiled with, when the plan compares several (`--remat`)
    program: Program | None = None  # its kernels in schedule order: what `rank_strategies` costs on any hardware
    matmul_dtype: str = ""  # the blocks' matmul dtype it was compiled with, when the plan compares several
    # tensors XLA replicated on every device to reshard them, as its partitioner logged them (`perf.xla_log`)
    rematerialisations: list[Rematerialisation] = dataclasses.field(default_factory=list)
    cached: bool = False  # read from the step cache: compiled by an earlier plan (`perf.step_cache`)

    @property
    def label(self) -> str:
        """The strategy's name, and its remat policy and matmul dtype when the plan compares several."""
        return self.strategy.name + variant_suffix(self.remat, self.matmul_dtype)

    def overrides(self) -> list[str]:
        """The `key=value` overrides that train with it."""
        return (self.strategy.overrides() + ([f"model.remat={self.remat}"] if self.remat else [])
                + ([f"model.matmul_dtype={self.matmul_dtype}"] if self.matmul_dtype else []))

    def mfu(self, step_s: float | None, hardware: Hardware) -> float | None:
        """Model FLOPs per device per second over the peak (the FP8 peak for FP8 matmuls), for a step of `step_s`;
        None without a step time, or where it would exceed 100%: a step faster than the peak allows for the
        model's FLOPs is an estimator's error, not a figure (`impossible_mfus` says which)."""
        from shardlm.flops import possible_mfu  # JAX-importing: planning_flags runs before JAX starts

        return possible_mfu(self._mfu(step_s, hardware))

    def _mfu(self, step_s: float | None, hardware: Hardware) -> float | None:
        from shardlm.flops import mfu  # JAX-importing: planning_flags runs before JAX starts

        return mfu(self.model_flops / self.strategy.devices, step_s,
                   hardware.for_matmuls(self.matmul_dtype).peak_flops)

    def impossible_mfus(self, hardware: Hardware) -> dict[str, float]:
        """{estimator: the MFU its step time implies} for the estimates of this step that imply more than 100%."""
        implied = {"est": self._mfu(self.est.step_s, hardware), "compiler": self._mfu(self.compiler_s, hardware)}
        return {k: v for k, v in implied.items() if v is not None and v > 1}

    @property
    def flops(self) -> float:
        """FLOPs per step summed over devices: above `model_flops` where a strategy repeats work on every device
        (tensor parallelism repeats the norms and the embedding; XLA may recompute)."""
        return self.flops_per_device * self.strategy.devices

    def cross_host(self, hardware: Hardware) -> list[dict]:
        """The collectives that cross hosts, per kind: {kind, count, bytes (their buffers), sent_per_device (what
        one device sends to other hosts)}, per step."""
        acc: dict[str, list[float]] = {}
        for op in self.collectives:
            across = split_traffic(op, hardware.devices_per_node, self.strategy.devices)[1]
            if across > 0:
                a = acc.setdefault(op.kind, [0, 0, 0.0])
                a[0] += op.times
                a[1] += op.bytes * op.times
                a[2] += across * op.times
        return [{"kind": k, "count": acc[k][0], "bytes": acc[k][1], "sent_per_device": round(acc[k][2])}
                for k in hlo.KINDS if k in acc]

    def to_dict(self, hardware: Hardware | None = None) -> dict:
        return {
            "rank": self.rank,
            "name": self.strategy.name,
            "remat": self.remat or None,
            "matmul_dtype": self.matmul_dtype or None,
            "mesh": self.strategy.mesh,
            "bytes_per_device": {"params": self.params, "optimizer": self.optimizer, "gradients": self.gradients,
                                 "temporaries": self.temporaries, "peak": self.peak, "total": self.peak,
                                 "host_temporaries": self.host_temps, "compiler_temporaries": self.compiler_temps},
            "collectives": hlo.summarize(self.collectives),
            "issued_collectives": issued(self.collectives),
            "comm_bytes_per_device": round(self.est.traffic_bytes),
            "inter_node_bytes_per_device": round(self.est.inter_node_bytes),
            "cross_host_collectives": self.cross_host(hardware) if hardware is not None else None,
            "flops": self.flops,
            "flops_per_device": self.flops_per_device,
            "model_flops": self.model_flops,
            "fits": self.fits,
            "refusal": self.refusal,
            "compiler_step_s": self.compiler_s,
            "compiler_step_withheld": self.compiler_withheld,
            "compiler_mfu": self.mfu(self.compiler_s, hardware) if hardware else None,
            "collectives_hidden": self.hidden,
            "est_mfu": self.mfu(self.est.step_s, hardware) if hardware else None,
            "est_step_s": self.est.step_s,
            "est_compute_s": self.est.compute_s,
            "est_comm_s": self.est.comm_s,  # the collectives' time left exposed by the schedule
            "est_comm_total_s": self.est.comm_total_s,  # hidden or not
            "est_kernels_s": self.est.by_kind,  # the kernels' time by kind: gemm, attention, memory
            "rematerialisations": [r.to_dict() for r in self.rematerialisations],
            "overrides": self.overrides(),
        }


@dataclasses.dataclass
class Plan:
    cfg: Config
    n_devices: int
    hardware: Hardware
    strategies: list[StrategyPlan]  # ranked
    rejected: list[tuple[Strategy, str]]
    param_count: int  # of the model with the least vocabulary padding
    wall_s: float
    platform: str = "cpu"  # what it was compiled for
    target: Target | None = None
    pruned: list[tuple["Candidate", str]] = dataclasses.field(default_factory=list)  # not compiled: cannot win
    failed: list[tuple["Candidate", str]] = dataclasses.field(default_factory=list)  # the compiler failed: why

    @property
    def unreached(self) -> int:
        """How many of the pruned were not compiled because the plan's budget ran out, not because they cannot
        win."""
        return sum(why.startswith(BUDGET_RAN_OUT) for _, why in self.pruned)

    @property
    def best(self) -> StrategyPlan | None:
        return self.strategies[0] if self.strategies and self.strategies[0].fits else None

    @property
    def hosts(self) -> int:
        return -(-self.n_devices // self.hardware.devices_per_node)

    def to_list(self) -> list[dict]:
        """One object per strategy, ranked; then, unranked, one per candidate the compiler failed on (`failed`: its
        words), was pruned without compiling (`pruned`: why) and strategy the model cannot take (`not_possible`:
        why), as the text lists them."""
        def unranked(c: Candidate, key: str, why: str) -> dict:
            return {"rank": None, "name": c.strategy.name, "remat": c.remat or None,
                    "matmul_dtype": c.matmul_dtype or None, "mesh": c.strategy.mesh, "fits": False, key: why}

        return ([s.to_dict(self.hardware) for s in self.strategies]
                + [unranked(c, "failed", why) for c, why in self.failed]
                + [unranked(c, "pruned", why) for c, why in self.pruned]
                + [unranked(Candidate(s, "", ""), "not_possible", why) for s, why in self.rejected])

    def rerank(self, hardware: Hardware) -> "Plan":
        """The same compiled facts estimated and ranked for other hardware (no compiling)."""
        ranked = rank_strategies([dataclasses.replace(r) for r in self.strategies], hardware)
        return dataclasses.replace(self, hardware=hardware, strategies=ranked)


def shard_bytes(tree) -> int:
    """Bytes one device holds of an abstract (sharded) tree: the largest shard of each leaf, summed."""
    import math

    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


def _abstract_state(cfg: Config, strategy: Strategy, vocab: int, devices, target: Target | None = None):
    """(mesh, `abstract_train_state`'s (build, graphdef, abstract state, shardings)) of one strategy: built once,
    read by the fit check and the lowering."""
    import contextlib

    from shardlm.perf.targets import tracing_for
    from shardlm.train.state import abstract_train_state

    mesh = strategy.make_mesh(devices)
    with tracing_for(target) if target else contextlib.nullcontext():
        return mesh, abstract_train_state(cfg, mesh, vocab)


def _cannot_fit(abstract, hardware: Hardware) -> str | None:
    """Why a strategy whose abstract train state is `abstract` cannot fit the hardware's memory before anything
    compiles (its parameters and optimizer state alone exceed it), or None."""
    state = shard_bytes(abstract["model"]) + shard_bytes(abstract["optimizer"])
    if state <= hardware.memory_bytes:
        return None
    return (f"does not fit: its parameters and optimizer state alone take {fmt_bytes(state)} per device, over "
            f"the {fmt_bytes(hardware.memory_bytes)}")


def _param_count(cfg: Config, vocab: int) -> int:
    """The model's parameters (with its vocabulary padded for one tensor device): shapes only."""
    import jax
    from flax import nnx

    from shardlm.train.source import model_source

    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(model_source(cfg).factory(vocab, 1))
    return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def _lower(cfg: Config, strategy: Strategy, vocab: int, devices, target: Target | None = None, prepared=None,
           name: str = "step"):
    """(lowered train step, its matmul FLOPs, param bytes/device, optimizer bytes/device) for one strategy;
    `prepared`: its `_abstract_state`, when already built; `name`: the step's (`train.step.make_train_step`)."""
    import contextlib

    from shardlm.flops import jaxpr_matmul_flops
    from shardlm.perf.targets import tracing_for
    from shardlm.train.state import TrainState
    from shardlm.train.step import COST_ONLY_SEPARATOR, batch_struct, train_step_for

    mesh, (_, graphdef, abstract, shardings) = prepared or _abstract_state(cfg, strategy, vocab, devices, target)
    with tracing_for(target) if target else contextlib.nullcontext():
        step = train_step_for(cfg, TrainState(graphdef, abstract, shardings), mesh, name,
                              separator=COST_ONLY_SEPARATOR)
        traced = step.trace(abstract, batch_struct(cfg, mesh))
        lowered = traced.lower()
    return lowered, jaxpr_matmul_flops(traced.jaxpr), shard_bytes(abstract["model"]), \
        shard_bytes(abstract["optimizer"])


def _devices(n_devices: int | None, target: Target | None, hosts: int | None) -> list:
    import jax

    if target is not None:
        from shardlm.perf.targets import topology

        return list(topology(target, n_devices or 1, hosts).devices)
    devices = jax.devices()
    n = n_devices or len(devices)
    if n > len(devices):
        raise ShardlmError(f"planning for {n} devices needs JAX to see {n}, but it sees {len(devices)}; run "
                           f"`shardlm plan --devices {n}` (it simulates them on the CPU) or set XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={n} before JAX starts")
    return devices[:n]


def plan(cfg: Config, n_devices: int | None = None, hardware: Hardware | None = None, *, vocab_size: int | None = None,
         strategies: list[Strategy] | None = None, workers: int | None = None, log=None,
         target: Target | None = None, hosts: int | None = None, remats: list[str] | None = None,
         matmul_dtypes: list[str] | None = None, budget_s: float | None = None) -> Plan:
    """Compile the train step of `cfg` for every strategy over `n_devices` (default: all devices JAX sees, or one
    device of `target`), or only for `strategies`, and rank them. Without a target JAX must already see that many
    devices (the CLI's `--devices` simulates them on a CPU host); with one, they are its abstract devices over
    `hosts` hosts. `hardware` defaults to the target's, or an H100 SXM at its dense peak for `model.dtype`.
    `remats`: compile each strategy under each of these remat policies (`model.remat`), not the config's alone;
    `matmul_dtypes` likewise for the blocks' matmuls (`model.matmul_dtype`: auto, fp8), each costed and held against
    the peak of its own (`Hardware.for_matmuls`). `budget_s`: once that much time has passed and something has
    been compiled, no further candidate is started; each is listed as pruned, the budget named as the reason (the
    compiles already started finish)."""
    planning = _Planning(cfg, n_devices, hardware, vocab_size, strategies, workers, log, target, hosts, remats,
                         matmul_dtypes, budget_s)
    planning.compile_all()
    return planning.result()


class _Planning:
    """One `plan` call's named steps: the candidates and their bounds (`__init__`), then `compile_all` (lower one at a
    time, compile in threads, read each as it finishes, prune against the best so far), then `result`."""

    def __init__(self, cfg, n_devices, hardware, vocab_size, strategies, workers, log, target, hosts, remats,
                 matmul_dtypes, budget_s):
        from shardlm.train.data import tokenizer_vocab

        self.cfg, self.target, self.hosts, self.budget_s, self.given = cfg, target, hosts, budget_s, strategies
        if hardware is None:
            dtype = plan_peak_dtype(cfg, matmul_dtypes)
            hardware = (target.hardware(dtype, n_devices or 1, hosts) if target
                        else Hardware(peak_flops=h100_peak(dtype)))
        self.hardware = hardware
        self.t0 = time.perf_counter()
        # each strategy under each policy and matmul dtype, checked before anything is prepared: the policies in
        # the order given (the cheapest in FLOPs first, as a rule)
        accelerator = target.accelerator if target else None
        self.compiled_as = {(r, m): _with_variant(cfg, r, m, accelerator)
                            for r in remats or [""] for m in matmul_dtypes or [""]}
        self.devices = _devices(n_devices, target, hosts)
        self.log = log or (lambda m: None)
        self.vocab = vocab_size or tokenizer_vocab(cfg, log=self.log)
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.platform = target.platform if target else self.devices[0].platform
        self.param_count = _param_count(cfg, self.vocab)
        strategies_ok = self._strategies()
        self.bounds = self._bounds(strategies_ok, matmul_dtypes)
        if strategies is None:  # the likeliest winners first, so that the rest can be pruned against them
            strategies_ok.sort(key=lambda s: self.bounds[s].step_s)
        self.candidates = [Candidate(s, r, m) for s in strategies_ok for r, m in self.compiled_as]
        self.results: list[StrategyPlan] = []
        self.pruned: list[tuple[Candidate, str]] = []
        self.failed: list[tuple[Candidate, str]] = []
        self.best = None  # (estimated step time, candidate) of the fastest fitting strategy compiled so far
        # the least the compiled steps' kernels took over the bound's compute, so far: the bound's known error
        # (`bounds.Calibration`)
        self.calibration = Calibration()
        self.hinted = False  # the hint for a long plan is given once

    def _strategies(self) -> list[Strategy]:
        """The strategies to compile: the given ones or every assignment of the devices, less those the config
        refuses (kept in `rejected`, with why)."""
        cfg, n = self.cfg, len(self.devices)
        self.rejected = []
        candidates = []
        for s in self.given or all_strategies(n, wants_context_splits(cfg, n),
                                              stage=wants_stage_splits(cfg, n, self.hosts),
                                              expert=wants_expert_splits(cfg)):
            why = rejection(cfg, s, self.devices, self.vocab)
            (self.rejected.append((s, why)) if why else candidates.append(s))
        if not candidates:
            raise ShardlmError(f"no assignment of {n} devices to the mesh axes suits this config: "
                               + "; ".join(f"{s.name}: {why}" for s, why in self.rejected[:3]))
        return candidates

    def _bounds(self, strategies: list[Strategy], matmul_dtypes) -> dict:
        """Each strategy's lower bound, one for every variant: at the highest peak any of them is held against."""
        from shardlm.train.source import model_flops_per_step

        cfg, hw = self.cfg, self.hardware
        bound_hw = hw.for_matmuls(FP8) if FP8 in (matmul_dtypes or [cfg.model.matmul_dtype]) else hw
        return {s: lower_bound(cfg, s, bound_hw, model_flops_per_step(cfg, self.vocab, s.tensor), self.param_count,
                               padded_vocab=_padded_vocab(cfg, self.vocab, s.tensor), platform=self.platform)
                for s in strategies}

    def _compile_one(self, lowered, matmul_flops, devices_used):
        from shardlm.train.step import step_compiler_options

        target = self.target
        return compile_step(lowered, devices_used, platform=self.platform, matmul_flops=matmul_flops,
                            options=step_compiler_options(self.cfg, self.platform),
                            devices=f"{target.label if target else self.platform} over {self.hosts or 1} host(s)")

    def _progress(self, c: Candidate, what: str) -> None:
        """A line per candidate as its fate is known: compiled, failed or pruned, counted against all of them, so
        that the count's total never changes; with how many are left and, at the pace so far, how long they take."""
        done = len(self.results) + len(self.failed) + len(self.pruned)
        left = len(self.candidates) - done
        pace = (time.perf_counter() - self.t0) / done
        self.log(f"[{done}/{len(self.candidates)}] {c.name}: {what}"
                 + (f"; {left} to go, about {fmt_duration(pace * left)} left" if left else ""))
        if self.budget_s is None and not self.hinted and done >= self.workers and pace * left > LONG_PLAN_S:
            self.hinted = True
            self.log(f"this plan may take {fmt_duration(pace * left)} more: `--budget {LONG_PLAN_S // 60}m` ranks "
                     "what compiles in that time, the likeliest winners first, and lists the rest as not reached")

    def _read(self, c, p_bytes, o_bytes, future) -> None:
        """A finished compile, read into a ranked `StrategyPlan` (or a failure, said beside the others)."""
        from shardlm.train.source import model_flops_per_step

        try:
            step: CompiledStep = future.result()
        except CompileFailed as e:  # said in the plan beside the others, not raised: the rest may compile
            self.failed.append((c, str(e)))
            self._progress(c, str(e))
            return
        s = c.strategy
        peak, temporaries = step.at_peak(p_bytes + o_bytes)
        r = StrategyPlan(s, p_bytes, o_bytes, p_bytes, temporaries, peak, step.collectives,
                         step.flops_per_device, model_flops_per_step(self.cfg, self.vocab, s.tensor), None, False,
                         step.compile_s, compiler_s=step.compiler_s, compiler_withheld=step.compiler_withheld,
                         compiler_temps=step.temp_bytes, refusal=step.refusal,
                         hidden=step.schedule.hidden_by_kind() if step.schedule else None,
                         host_temps=step.host_temp_bytes, remat=c.remat, program=step.program,
                         matmul_dtype=c.matmul_dtype, rematerialisations=step.rematerialisations,
                         cached=step.cached)
        rank_strategies([r], self.hardware)
        self.calibration.learn(self.bounds[s], r.est.compute_s)
        if r.fits and (self.best is None or r.est.step_s < self.best[0]):
            self.best = (r.est.step_s, c)
        self.results.append(r)
        self._progress(c, (f"read from the step cache (compiled in {step.compile_s:.1f} s by an earlier plan)"
                           if step.cached else f"compiled in {step.compile_s:.1f} s")
                       + (" (refused by the compiler: it does not fit)" if step.refusal else ""))

    def _time_up(self) -> bool:
        return self.budget_s is not None and time.perf_counter() - self.t0 > self.budget_s

    def _not_reached(self, c: Candidate) -> None:
        self.pruned.append((c, why := f"{BUDGET_RAN_OUT} {fmt_duration(self.budget_s)} ran out"))
        self._progress(c, why)

    def _settle(self, pending: list, wait: bool) -> None:
        """Read the compiles that have finished; with `wait`, first wait for one while every worker is busy and one
        more is queued."""
        if wait and len(pending) > self.workers:
            concurrent.futures.wait([p[3] for p in pending], return_when=concurrent.futures.FIRST_COMPLETED)
        for item in [p for p in pending if p[3].done()]:
            pending.remove(item)
            self._read(*item)

    def compile_all(self) -> None:
        """Lowering traces Python (one at a time); XLA compiles in threads, overlapping the next lowering. Results
        are read as they finish, so that the best estimate so far can prune what is left. The lowering runs at most
        one candidate ahead of the compiles: a budget then stops within a compile's time, and no more than
        `workers` + 1 lowered programs are held at once."""
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            pending = []
            for c in self.candidates:
                self._settle(pending, wait=True)
                if self._time_up() and (self.results or pending):  # something has been compiled, or is being
                    self._not_reached(c)
                    continue
                submitted = self._lower_unless_pruned(c)
                if submitted:
                    lowered, matmul_flops, p_bytes, o_bytes = submitted
                    pending.append((c, p_bytes, o_bytes, pool.submit(self._compile_one, lowered, matmul_flops,
                                                                     c.strategy.devices)))
                    del lowered, submitted
            for item in list(pending):  # a compile not yet started when the budget ran out is not started
                if self._time_up() and self.results and item[3].cancel():
                    pending.remove(item)
                    self._not_reached(item[0])
            while pending:  # drop each executable once read: 64 devices' worth of programs add up
                self._read(*pending.pop(0))

    def _lower_unless_pruned(self, c: Candidate):
        """(lowered, matmul FLOPs, parameter bytes, optimizer bytes) of candidate `c`, or None when its bound
        (calibrated by what has compiled) cannot beat the best so far."""
        s, cfg_c = c.strategy, self.compiled_as[c.remat, c.matmul_dtype]
        prepared = _abstract_state(cfg_c, s, self.vocab, self.devices, self.target)
        why = None if self.given is not None else _pruning(prepared, self.calibration.applied(self.bounds[s]),
                                                           self.best, self.hardware)
        if why:
            self.pruned.append((c, why))
            self._progress(c, f"pruned, not compiled: {why}")
            return None
        return _lower(cfg_c, s, self.vocab, self.devices, self.target, prepared, c.program_name)

    def result(self) -> Plan:
        if self.failed and not self.results:
            raise ShardlmError("no strategy compiled: " + "; ".join(f"{c.name}: {why}" for c, why in self.failed))
        return Plan(self.cfg, len(self.devices), self.hardware, rank_strategies(self.results, self.hardware),
                    self.rejected, self.param_count, time.perf_counter() - self.t0, self.platform, self.target,
                    self.pruned, self.failed)


def _padded_vocab(cfg: Config, vocab: int, tensor: int) -> int:
    """The vocabulary as shardlm's models pad it for `tensor` devices (0 for a py: file's model, whose matmuls
    the bound does not know)."""
    from shardlm.foreign.modules import is_py
    from shardlm.train.source import model_source

    return 0 if is_py(cfg.model.preset) else model_source(cfg).vocab_sizes(vocab, tensor)[1]


def _pruning(prepared, bound, best, hardware: Hardware) -> str | None:
    """Why a candidate (its `_abstract_state`, its lower bound) need not be compiled, or None: it cannot fit, or
    it cannot beat `best` (estimated step time, candidate) of those compiled so far."""
    if why := _cannot_fit(prepared[1][2], hardware):
        return why
    if best is not None and not bound.beats(best[0]):
        return (f"cannot beat {best[1].name} ({_format_seconds(best[0])}): its lower bound is "
                f"{_format_seconds(bound.step_s)} ({_format_seconds(bound.compute_s)} compute "
                f"{'+' if not bound.overlap else 'or'} {_format_seconds(bound.comm_s)} of unavoidable traffic)")
    return None


def plan_peak_dtype(cfg: Config, matmul_dtypes: list[str] | None = None) -> str:
    """The dtype whose dense peak a plan's hardware is built at: the run's own (`flops.peak_dtype`), or, when the
    plan compares matmul dtypes, the compute dtype's, each FP8 row then held against the FP8 peak
    (`Hardware.for_matmuls`)."""
    return peak_dtype(dataclasses.replace(cfg.model, matmul_dtype="auto") if matmul_dtypes else cfg.model)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A strategy to compile, under a remat policy and a matmul dtype ("" = the config's)."""

    strategy: Strategy
    remat: str = ""
    matmul_dtype: str = ""

    @property
    def name(self) -> str:
        return self.strategy.name + variant_suffix(self.remat, self.matmul_dtype)

    @property
    def program_name(self) -> str:
        """Its train step's name, an identifier unique in the plan: compiles run at once, and what XLA logs about
        an instruction names the step it is in (`perf.xla_log`)."""
        return "step_" + re.sub(r"\W+", "_", self.name)


def variant_suffix(remat: str, matmul_dtype: str) -> str:
    """What follows a strategy's name when the plan compares remat policies or matmul dtypes."""
    return (f" remat={remat}" if remat else "") + (f" matmul_dtype={matmul_dtype}" if matmul_dtype else "")


def _with_variant(cfg: Config, remat: str, matmul_dtype: str, accelerator=None) -> Config:
    """`cfg` with `model.remat` and `model.matmul_dtype` set ("" = as it is), checked (FP8 against `accelerator`,
    the target compiled for, or the local devices')."""
    if not remat and not matmul_dtype:
        return cfg
    from shardlm.accelerator import current
    from shardlm.config import check_fp8
    from shardlm.families import check_model_config

    model = dataclasses.replace(cfg.model, **({"remat": remat} if remat else {}),
                                **({"matmul_dtype": matmul_dtype} if matmul_dtype else {}))
    check_model_config(model)
    if model.matmul_dtype == FP8:
        check_fp8(accelerator or current())
    return dataclasses.replace(cfg, model=model)


def rank_strategies(results: list[StrategyPlan], hardware: Hardware) -> list[StrategyPlan]:
    """Estimate every strategy's step on `hardware` and order them: those that fit its memory by estimated step
    time, then the rest by peak memory. Cheap: re-rank a plan for other hardware without compiling again."""
    for r in results:
        r.est = step_estimate(r.program, r.flops_per_device, r.collectives, r.strategy.devices,
                              hardware.for_matmuls(r.matmul_dtype))
        r.fits = r.peak <= hardware.memory_bytes and r.refusal is None
    ordered = sorted(results, key=lambda r: (not r.fits, r.est.step_s if r.fits else r.peak))
    for i, r in enumerate(ordered, 1):
        r.rank = i
    return ordered


_ABBREV = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
           "collective-permute": "CP"}


def _short_collectives(ops: list[hlo.CollectiveOp]) -> str:
    return " ".join(f"{_ABBREV[c['kind']]} {c['count']}x {fmt_bytes(c['bytes'])}" for c in hlo.summarize(ops)) or "none"


def _label_width(p: Plan) -> int:
    """The strategy column's width: every row's label, whichever rows are shown."""
    return max([16] + [len(r.label) for r in p.strategies])


def _offloads(p: Plan) -> bool:
    """Whether any strategy keeps activations in host memory (the table then has a `host` column)."""
    return any(r.host_temps for r in p.strategies)


def format_rows(p: Plan, limit: int | None = None) -> list[str]:
    """The plan's table: a header, a rule and a row per strategy (the first `limit` of them)."""
    hosts, target = p.hosts > 1, p.target
    rows = p.strategies[:limit]
    w, offloads = _label_width(p), _offloads(p)
    head = (f"{'rank':>4}  {'strategy':<{w}} {'params':>10} {'optimizer':>10} {'grads*':>10} {'temps':>10} "
            f"{'peak':>10}  " + (f"{'host':>10}  " if offloads else "")
            + f"{'fits':<4} {'TFLOP/dev':>9} {'comm/dev':>10} " + (f"{'x-host/dev':>10} " if hosts else "")
            + f"{'est step':>9} {'MFU':>6}  " + (f"{'compiler':>9} {'MFU':>6}  " if target else "")
            + "collectives per step")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.rank:>4}  {r.label:<{w}} {fmt_bytes(r.params):>10} {fmt_bytes(r.optimizer):>10} "
            f"{fmt_bytes(r.gradients):>10} {fmt_bytes(r.temporaries):>10} {fmt_bytes(r.peak):>10}  "
            + (f"{fmt_bytes(r.host_temps):>10}  " if offloads else "")
            + f"{'yes' if r.fits else 'NO':<4} {r.flops_per_device / 1e12:>9.3f} {fmt_bytes(r.est.traffic_bytes):>10} "
            + (f"{fmt_bytes(r.est.inter_node_bytes):>10} " if hosts else "")
            + f"{_format_seconds(r.est.step_s):>9} {_percent(r.mfu(r.est.step_s, p.hardware)):>6}  "
            + (f"{_format_seconds(r.compiler_s):>9} {_percent(r.mfu(r.compiler_s, p.hardware)):>6}  " if target else "")
            + (f"refused: {r.refusal}" if r.refusal else _short_collectives(r.collectives)))
    return lines


def format_plan(p: Plan) -> str:
    from shardlm.train.optimizers import optimizer_summary

    m, t = p.cfg.model, p.cfg.train
    hosts = p.hosts > 1
    target = p.target
    lines = [
        f"plan for {p.n_devices} {target.label + ' ' if target else ''}devices"
        + (f" on {p.hosts} hosts of {p.hardware.devices_per_node}" if hosts else "")
        + f": {p.param_count / 1e6:.1f}M parameters, {describe(p.cfg)}; global batch {t.batch_size} x {m.seq_len} "
        f"tokens, {optimizer_summary(p.cfg)}",
        f"cost model ({p.hardware.describe()}); memory {p.hardware.memory_bytes / 1e9:g} GB "
        f"({fmt_bytes(p.hardware.memory_bytes)}) per device",
        "",
    ]
    lines += format_rows(p)
    w, offloads = _label_width(p), _offloads(p)
    lines.append("")
    if hosts:
        lines.append(f"across hosts (devices in mesh order, tensor innermost, {p.hardware.devices_per_node} to a "
                     "host; x-host/dev = what one device sends to other hosts per step):")
        for r in p.strategies:
            cross = r.cross_host(p.hardware)
            what = ", ".join(f"{_ABBREV[c['kind']]} {c['count']}x {fmt_bytes(c['bytes'])} (sends "
                             f"{fmt_bytes(c['sent_per_device'])})" for c in cross)
            lines.append(f"  {r.label:<{w}} {what or 'nothing crosses hosts'}")
        lines.append("")
    lines.append("bytes are per device; peak = params + optimizer + temps, everything the step holds at once: "
                 + ("XLA:TPU's own peak (what it checks against HBM; a refused step: its state and the temporaries "
                    "it asked for)" if p.platform == "tpu" else
                    "arguments + outputs - donated buffers + XLA's temporaries")
                 + "; temps = the rest of the peak beside the state (activations, gradients, gathered weights, the "
                 "batch); grads* = the gradients once reduced, sharded like the parameters, inside temps"
                 + ("; host = activations offloaded to host memory (model.remat_offload), not in the peak"
                    if offloads else ""))
    lines.append("comm/dev = what one device sends per step (ring algorithms); est step = the compiled step's "
                 "kernels, each at the rate its kind and shape reach on the hardware, and its collectives, hidden "
                 "where the schedule overlaps them with compute (`shardlm.perf.timeline`)")
    from shardlm.train.source import flops_convention  # imports JAX: planning_flags runs before JAX starts

    lines.append(f"MFU = model FLOPs ({flops_convention(p.cfg)}) per device per second over the peak"
                 + (" (the FP8 peak for matmul_dtype=fp8)" if any(r.matmul_dtype == FP8 for r in p.strategies)
                    else ""))
    lines += impossible_mfu_lines(p)
    if target:
        lines.append(_compiler_note(p))
    if p.platform == "cpu" and p.cfg.model.dtype != "float32":
        lines.append(f"note: XLA:CPU emulates {p.cfg.model.dtype} in float32, so temps and collectives above are "
                     "float32-sized (or more, with the conversions); a GPU or TPU computes it natively and needs "
                     "less: check there with `shardlm bench`")
    lines += attention_lines(p) + pipeline_lines(p) + remat_lines(p) + matmul_lines(p) + rematerialisation_lines(p)
    for s, why in p.pruned:
        lines.append(f"pruned (not compiled): {s.name}: {why}")
    for c, why in p.failed:
        lines.append(f"failed to compile: {c.name}: {why}")
    for s, why in p.rejected:
        lines.append(f"not possible: {s.name}: {why}")
    lines.append("")
    lines.append(recommendation(p))
    return "\n".join(lines)


def cheapest_remats(p: Plan) -> dict[str, StrategyPlan | None]:
    """Per strategy (its name) of a plan that compared remat policies: its fastest compiled policy that fits, or
    None if none does."""
    out: dict[str, StrategyPlan | None] = {}
    for r in p.strategies:  # ranked: fitting ones by estimated step first
        name = r.strategy.name + variant_suffix("", r.matmul_dtype)
        out.setdefault(name, None)
        if r.fits and out[name] is None:
            out[name] = r
    return out


def attention_lines(p: Plan) -> list[str]:
    """Which attention kernel the strategies' steps compiled with, and why (`models.attention.attention_summary`, for
    the target compiled for): a line per kernel, naming its strategies."""
    import contextlib

    from shardlm.accelerator import compiling_for
    from shardlm.foreign.modules import is_py
    from shardlm.models.attention import attention_summary
    from shardlm.train.source import within_documents

    if is_py(p.cfg.model.preset):
        return []
    kernels: dict[str, list[str]] = {}
    with compiling_for(p.target.accelerator) if p.target else contextlib.nullcontext():
        for r in p.strategies:
            documents = within_documents(p.cfg, r.strategy.stage, r.strategy.context)
            kernels.setdefault(attention_summary(p.cfg.model, r.strategy.context, documents), []).append(
                r.strategy.name)
    return [f"attention ({', '.join(dict.fromkeys(names))}): {what}" for what, names in kernels.items()]


def remat_lines(p: Plan) -> list[str]:
    """The cheapest remat policy that fits each strategy, when the plan compared several (`--remat`)."""
    if not any(r.remat for r in p.strategies):
        return []
    parts = [f"{name}: {r.remat} ({_format_seconds(r.est.step_s)}, peak {fmt_bytes(r.peak)})" if r else
             f"{name}: none of them fits" for name, r in cheapest_remats(p).items()]
    return ["cheapest remat policy that fits, per strategy: " + "; ".join(parts)]


def matmul_lines(p: Plan) -> list[str]:
    """FP8 matmuls against the compute dtype's, per strategy and remat policy, when the plan compared them
    (`--matmul-dtype auto,fp8`): how much faster the estimate is, and the two peaks."""
    pairs: dict[str, dict[str, StrategyPlan]] = {}
    for r in p.strategies:
        if r.matmul_dtype:
            pairs.setdefault(r.strategy.name + variant_suffix(r.remat, ""), {})[r.matmul_dtype] = r
    parts = []
    for name, rows in pairs.items():
        if {"auto", FP8} <= rows.keys():
            base, fp8 = rows["auto"], rows[FP8]
            compiler = (f", the compiler's {base.compiler_s / fp8.compiler_s:.2f}x" if base.compiler_s and
                        fp8.compiler_s else "")
            parts.append(f"{name}: {base.est.step_s / fp8.est.step_s:.2f}x faster ({_format_seconds(fp8.est.step_s)} "
                         f"vs {_format_seconds(base.est.step_s)}{compiler}), peak {fmt_bytes(fp8.peak)} vs "
                         f"{fmt_bytes(base.peak)}")
    return ["FP8 matmuls against the compute dtype's, per strategy: " + "; ".join(parts)] if parts else []


def rematerialisation_lines(p: Plan) -> list[str]:
    """A line per strategy whose compile replicated a tensor on every device to reshard it (XLA's involuntary
    full rematerialisation, `perf.xla_log`): which tensors, their bytes and the operation they came from."""
    return [f"XLA replicated to reshard (involuntary full rematerialisation), {r.label}: "
            + "; ".join(x.describe() for x in r.rematerialisations) for r in p.strategies if r.rematerialisations]


def pipeline_lines(p: Plan) -> list[str]:
    """For each strategy with pipeline stages: the schedule's bubble (which the compiled step's FLOPs, and so the
    estimate, already include: idle stages compute on zeros) and what it hands between stages, in all and across
    hosts."""
    from shardlm.schedules.gpipe import bubble_fraction, microbatch_count

    m = p.cfg.model
    lines = []
    for r in p.strategies:
        stages = r.strategy.stage
        if stages == 1:
            continue
        micro = microbatch_count(m.pipeline_microbatches, stages)
        hand_offs = [op for op in r.collectives if op.kind == "collective-permute"]
        sent = sum(op.bytes * op.times for op in hand_offs)
        across = sum(split_traffic(op, p.hardware.devices_per_node, r.strategy.devices)[1] * op.times
                     for op in hand_offs)
        bubble = bubble_fraction(stages, micro, m.pipeline_repeats)
        lines.append(f"pipeline {r.label}: {m.pipeline_schedule}, {micro} microbatches x {m.pipeline_repeats} "
                     f"repeat(s) over {stages} stages, bubble {bubble:.0%} of the "
                     f"stage-iterations (charged: idle stages compute on zeros); hand-offs send "
                     f"{fmt_bytes(sent)} per device per step" + (f", {fmt_bytes(across)} of it across hosts"
                                                                 if p.hosts > 1 else ""))
    return lines


def _compiler_note(p: Plan) -> str:
    """What the target's compiler said, and how far to trust its estimate."""
    what = (f"compiled by {'XLA:GPU' if p.platform == 'gpu' else 'XLA:TPU'} for {p.n_devices} {p.target.label} "
            f"(abstract devices, nothing ran): bytes, fits and collectives are its own; compiler = its estimate of "
            f"the step")
    if p.platform == "gpu":
        what += (" (the latency-hiding scheduler's; none for one device, whose program it does not schedule; "
                 "cuDNN attention charged 10 us a call, so attention-heavy steps read fast)")
        hidden = [(r.label, r.hidden) for r in p.strategies if r.hidden]
        if hidden:
            what += "\ncollective time hidden behind compute in XLA:GPU's schedule: " + "; ".join(
                f"{name} " + ", ".join(f"{_ABBREV[k]} {v:.0%}" for k, v in h.items())
                for name, h in hidden)
    else:
        what += " (cost analysis optimal_seconds)"
        withheld = [r.label for r in p.strategies if r.compiler_withheld]
        if withheld:
            what += ("\ncompiler '-' for " + ("every strategy" if len(withheld) == len(p.strategies) else
                                               ", ".join(withheld))
                     + ": XLA:TPU's optimal_seconds counts a loop's body once, and these steps loop (the scanned "
                     "layers, microbatches, windowed einsums), so its figure is a fraction of the step, not an "
                     "estimate of it (JSON: compiler_step_withheld)")
    return what


def impossible_mfu_lines(p: Plan) -> list[str]:
    """A line naming the estimates whose MFU would exceed 100%, shown as '-' (`StrategyPlan.mfu`), if any."""
    over = [f"{r.label} {what} {mfu:.0%}" for r in p.strategies for what, mfu in r.impossible_mfus(p.hardware).items()]
    return [f"MFU '-' where it would exceed 100% (a step faster than the peak allows for the model's FLOPs is the "
            f"estimator's error): {', '.join(over)}"] if over else []


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _format_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def recommendation(p: Plan) -> str:
    best = p.best
    if best is None:
        low = min(p.strategies, key=lambda r: r.peak)
        return (f"no strategy fits in {fmt_bytes(p.hardware.memory_bytes)} per device; the smallest peak is "
                f"{low.label} at {fmt_bytes(low.peak)}: lower train.batch_size or model.seq_len, use more "
                "devices, " + ("" if "full" in {p.cfg.model.remat, *(r.remat for r in p.strategies)}
                               else "model.remat=full, ")
                + ("or a target with more memory" if p.target else "or pass --memory for a larger device"))
    text = (f"recommended: {best.label} (est {_format_seconds(best.est.step_s)} per step: "
            f"{_format_seconds(best.est.compute_s)} compute + {_format_seconds(best.est.comm_s)} communication; "
            f"peak {fmt_bytes(best.peak)} of {fmt_bytes(p.hardware.memory_bytes)})")
    nxt = next((r for r in p.strategies[1:] if r.fits), None)
    if nxt and best.est.step_s > 0:
        text += (f"; next {nxt.label} at {_format_seconds(nxt.est.step_s)} "
                 f"({nxt.est.step_s / best.est.step_s:.2f}x)")
    no_fit = [r.label for r in p.strategies if not r.fits]
    if no_fit:
        text += f"; too large for the memory: {', '.join(no_fit)}"
    text += f"\ntrain with it: shardlm train {' '.join(best.overrides())} ..."
    return text


def report_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# XLA:CPU's default scheduler orders work for concurrency on the host's cores: it runs independent computations
# early, and so keeps, say, every layer's rematerialised activations alive at once (remat then saves ~4% of the
# temporaries where a memory-minimising order saves ~30%). Accelerators order for memory, so a plan asks for the
# memory-minimising scheduler; its temporaries are then the ones an accelerator's schedule would need.
MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def planning_flags() -> None:
    """XLA flags for compiling without running, set before JAX starts. Planning never runs the programs it
    compiles: ask XLA:CPU for cheap machine code (LLVM at -O0); the HLO passes, partitioning and buffer
    assignment, which are all a plan reads, are unchanged. And schedule for memory (`MEMORY_SCHEDULER_FLAG`)."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 MEMORY_SCHEDULER_FLAG):
        if flag.split("=")[0] not in flags:
            flags += " " + flag
    os.environ["XLA_FLAGS"] = flags.strip()
