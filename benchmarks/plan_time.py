"""Where a `shardlm plan` spends its time: wall time, strategies compiled, pruned and rejected, and the time in
each phase, summed over the strategies (the compiles run in threads beside the main thread's tracing, so the
phases add up to more than the wall time on a host with idle cores, and contend on one without).

    python benchmarks/plan_time.py                                  # gpt2-small on 64 simulated devices
    python benchmarks/plan_time.py --devices 8 model=llama-1b train.batch_size=16
    python benchmarks/plan_time.py --again                          # then re-plan, reading the step cache

Phases, each wrapped around the planner's own function:
- `abstract state`: the train state's shapes and shardings for a strategy (`planner._abstract_state`);
- `trace and lower`: tracing the train step and lowering it to StableHLO (`planner._lower`), one at a time;
- `XLA compile`: the backend's compile of the lowered step (`jax._src.compiler.backend_compile_and_load`), in
  the plan's worker threads;
- `read the program`: shardlm's reading of the compiled HLO into kernels (`perf.kernels.program`);
- `rank`: the cost model's estimate of each compiled step (`planner.rank_strategies`).

The account of the 64-device plan is in docs/plan-and-bench.md (Plan time).
"""

from __future__ import annotations

import argparse
import collections
import functools
import shutil
import sys
import tempfile
import threading
import time


def timed(phases: dict, counts: collections.Counter, lock: threading.Lock, module, name: str, label: str) -> None:
    """Wrap `module.name` so that each call adds its wall time to `phases[label]`."""
    inner = getattr(module, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            with lock:
                phases[label] += time.perf_counter() - t0
                counts[label] += 1

    setattr(module, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--quiet", action="store_true", help="no progress line per strategy")
    ap.add_argument("--again", action="store_true",
                    help="then plan again, as `shardlm plan` does with its step cache, and print that wall time")
    ap.add_argument("overrides", nargs="*", default=["model=gpt2-small"])
    args = ap.parse_args()

    from shardlm.mesh import simulate_cpu_devices
    from shardlm.perf.planner import planning_flags

    planning_flags()  # as `shardlm plan` compiles: LLVM at -O0, the memory-minimising scheduler
    simulate_cpu_devices(args.devices)
    import jax._src.compiler as compiler

    from shardlm.config import load_config
    from shardlm.perf import kernels, planner
    from shardlm.perf.step_cache import caching_steps

    phases: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    for module, name, label in ((planner, "_abstract_state", "abstract state"), (planner, "_lower", "trace and lower"),
                                (compiler, "backend_compile_and_load", "XLA compile"),
                                (kernels, "program", "read the program"), (planner, "rank_strategies", "rank")):
        timed(phases, counts, lock, module, name, label)

    cfg = load_config(None, args.overrides)
    cache = tempfile.mkdtemp(prefix="shardlm-plan-time-")  # empty: the first plan compiles everything
    t0 = time.perf_counter()
    log = None if args.quiet else (lambda m: print(f"{time.perf_counter() - t0:7.1f} s  {m}", flush=True))
    with caching_steps(cache):
        p = planner.plan(cfg, args.devices, log=log)
    wall = time.perf_counter() - t0
    best = p.strategies[0]
    print(f"\nshardlm plan --devices {args.devices} {' '.join(args.overrides)}: {wall:.0f} s wall; "
          f"{len(p.strategies)} compiled, {len(p.pruned)} pruned, {len(p.failed)} failed, {len(p.rejected)} "
          f"rejected before compiling; best {best.strategy.name} (est {best.est.step_s * 1e3:.2f} ms)")
    print("| phase | seconds (summed over strategies) | calls | per call |\n| --- | --- | --- | --- |")
    for label, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {seconds:.1f} | {counts[label]} | {seconds / max(counts[label], 1):.2f} |")
    if args.again:
        t1 = time.perf_counter()
        with caching_steps(cache) as steps:
            again = planner.plan(cfg, args.devices)
        print(f"\nthe same plan again: {time.perf_counter() - t1:.0f} s wall, {steps.hits} of its "
              f"{len(again.strategies)} compiled steps read from the step cache; "
              f"best {again.strategies[0].strategy.name}")
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
