"""Context parallelism's memory and traffic: temporaries per device as context devices are added, in one run.

For one long-sequence configuration (default: llama-1b's shape, vocabulary 32,000, two sequences of 16,384 tokens,
float32, remat full), the real train step is compiled (never run) by `shardlm.perf.planner.plan` for FSDP 2 on
2 devices and FSDP 2 x context C on 2C devices, and for FSDP 2 x tensor (the same devices, no context axis) as a
comparison. It prints each one's temporaries and peak per device from XLA's memory analysis, the ratio of the
temporaries to FSDP 2's (the target: roughly 1/C), the bytes all-gathered per step (the context splits add the
keys and values of every layer), and the cost model's step estimate on H100s.

    python benchmarks/context_memory.py                                  # llama-1b at 16,384 tokens, C = 1, 2, 4
    python benchmarks/context_memory.py --seq-len 8192 --contexts 1,2,4,8 model=llama-350m

Compiles run on XLA:CPU (simulated devices), whose attention materialises the [T/C, T] scores as a GPU's XLA
attention would; see docs/strategies.md, "Long sequences", for what cuDNN changes.
"""

import argparse
import os
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=2, help="global batch in sequences (FSDP splits it 2 ways)")
    ap.add_argument("--contexts", default="1,2,4", help="context degrees to add to FSDP 2")
    ap.add_argument("overrides", nargs="*", default=["model=llama-1b", "model.vocab_size=32000"])
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    n_max = 2 * max(contexts)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={n_max}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    from shardlm.config import load_config
    from shardlm.errors import ShardlmError
    from shardlm.perf.planner import plan, planning_flags
    from shardlm.perf.strategies import Strategy
    from shardlm.units import fmt_bytes

    planning_flags()
    cfg = load_config(None, [*args.overrides, f"model.seq_len={args.seq_len}", f"train.batch_size={args.batch}",
                             "model.remat=full"])
    runs = [Strategy(1, 2, 1, c) for c in contexts] + [Strategy(1, 2, max(contexts), 1)]
    rows = []
    for s in runs:
        try:
            p = plan(cfg, s.devices, strategies=[s])
        except ShardlmError as e:
            print(f"{s.name}: not possible: {e}", file=sys.stderr)
            continue
        r = p.strategies[0]
        gathered = sum(op.bytes * op.times for op in r.collectives if op.kind == "all-gather")
        rows.append((s, r.temporaries, r.peak, gathered, r.est.step_s))
        print(f"compiled {s.name} on {s.devices} devices in {r.compile_s:.1f} s", file=sys.stderr, flush=True)
    base = rows[0][1]
    print(f"{cfg.model.preset}, {args.batch} x {args.seq_len} tokens, remat full, float32 (XLA:CPU memory analysis)")
    print(f"{'strategy':<12} {'devices':>7} {'temps/dev':>11} {'vs fsdp2':>8} {'peak/dev':>11} "
          f"{'all-gathered':>12} {'est step':>9}")
    for s, temps, peak, gathered, step_s in rows:
        print(f"{s.name:<12} {s.devices:>7} {fmt_bytes(temps):>11} {temps / base:>7.2f}x {fmt_bytes(peak):>11} "
              f"{fmt_bytes(gathered):>12} {step_s * 1e3:>7.1f} ms")


if __name__ == "__main__":
    main()
