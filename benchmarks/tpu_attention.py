"""Splash attention against XLA's attention on TPUs, compiled by XLA:TPU from this host: peak memory per chip.

For gpt2-small and llama-1b at 8,192 tokens (one sequence per chip, FSDP over 4 TPU v5p chips, `model.remat=full`),
the real train step is compiled (`shardlm.perf.compile_only`; nothing runs) with `model.attention=splash` (what
`auto` picks on a TPU) and with `model.attention=xla`; it prints each one's peak bytes per chip, whether XLA:TPU
accepts it, and the Pallas kernel calls (`tpu_custom_call`) in the compiled program.

    python benchmarks/tpu_attention.py
    python benchmarks/tpu_attention.py --seq 4096 --target tpu-v5e

"Compiled for", not "measured on": no TPU ran it.
"""

import argparse
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--target", default="tpu-v5p")
    ap.add_argument("--chips", type=int, default=4)
    args = ap.parse_args()
    from shardlm.accelerator import compiling_for, cpu_unless_accelerator, start_cpu_quietly

    if cpu_unless_accelerator():
        start_cpu_quietly()
    from shardlm.config import load_config
    from shardlm.perf import targets
    from shardlm.perf.compile_only import compile_train_step
    from shardlm.units import fmt_bytes

    target = targets.get(args.target)
    print(f"| model ({args.seq} tokens, {args.chips} {target.label} chips, FSDP, remat full) | attention | peak/chip "
          "| accepted | Pallas kernel calls | splash / XLA peak |")
    print("|---|---|---|---|---|---|")
    for preset in ("gpt2-small", "llama-1b"):
        peaks = {}
        for attention in ("splash", "xla"):
            print(f"compiling {preset}, attention={attention} ...", file=sys.stderr, flush=True)
            with compiling_for(target.accelerator):
                cfg = load_config(None, [f"model={preset}", f"model.seq_len={args.seq}", f"model.attention={attention}",
                                         f"train.batch_size={args.chips}", f"mesh.fsdp={args.chips}",
                                         "model.remat=full"])
            r = compile_train_step(cfg, target=target, n_devices=args.chips)
            s = r.step
            peaks[attention] = s.peak
            calls = s.hlo_text.count('custom_call_target="tpu_custom_call"') if s.hlo_text else 0
            ratio = f"{peaks['splash'] / s.peak:.2f}" if attention == "xla" else ""
            print(f"| {preset} | {attention} | {fmt_bytes(s.peak)} | {'no: ' + s.refusal[:60] if s.refusal else 'yes'} "
                  f"| {calls} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
