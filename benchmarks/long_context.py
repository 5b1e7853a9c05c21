"""Long sequences: memory per device and XLA:GPU's estimate of the step against sequence length and context degree.

Llama 3.1 8B's shape (`targets.LLAMA_8B`), `model.remat=full`, on 8 H100s: for each sequence length (8k to 128k
tokens) and context degree C (the other 8 / C ways FSDP, one sequence per FSDP group, so each GPU holds T / C of
a sequence's tokens), the real train step is compiled
by XLA:GPU from this CPU host (`shardlm.perf.compile_only`; nothing runs) and its peak bytes per device, whether
it fits 80 GiB, the attention it compiled with, XLA:GPU's estimate of the step and the tokens per second per GPU
that estimate implies are printed. With C = 1 the sequence is whole on every device (cuDNN's kernel); with C > 1
it is the ring, with cuDNN's fused kernel on each chunk of keys.

    python benchmarks/long_context.py                              # 8k, 32k, 128k x C = 1, 2, 8
    python benchmarks/long_context.py --seq 8192,131072 --contexts 8

"Compiled for", not "measured on": no GPU ran it.
"""

import argparse
import sys

from targets import LLAMA_8B


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="8192,32768,131072", help="sequence lengths")
    ap.add_argument("--contexts", default="1,2,8", help="context degrees (dividing 8)")
    args = ap.parse_args()
    from shardlm.accelerator import compiling_for, cpu_unless_accelerator, start_cpu_quietly

    if cpu_unless_accelerator():
        start_cpu_quietly()
    from shardlm.config import load_config
    from shardlm.perf import targets
    from shardlm.perf.compile_only import compile_train_step
    from shardlm.units import fmt_bytes

    h100 = targets.get("h100")
    print("| tokens | mesh | attention | peak/device | fits 80 GiB | compile | XLA:GPU's estimate | tokens/s per GPU |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in (int(s) for s in args.seq.split(",")):
        for cp in (int(c) for c in args.contexts.split(",")):
            overrides = LLAMA_8B + [f"model.seq_len={seq}", f"train.batch_size={8 // cp}", "model.remat=full",
                                    f"mesh.context={cp}", f"mesh.fsdp={8 // cp}"]
            print(f"compiling {seq} tokens, fsdp {8 // cp} x context {cp} ...", file=sys.stderr, flush=True)
            with compiling_for(h100.accelerator):
                cfg = load_config(None, overrides)
            r = compile_train_step(cfg, target=h100, n_devices=8)
            s = r.step
            rate = f"{seq / cp / s.compiler_s:,.0f}" if s.compiler_s else "-"  # each GPU: T / C tokens a step
            estimate = f"{s.compiler_s:.2f} s" if s.compiler_s else "-"
            print(f"| {seq:,} | fsdp {8 // cp} x context {cp} | {r.attention} | {fmt_bytes(s.peak)} | "
                  f"{'yes' if r.fits else 'NO'} | {s.compile_s:.0f} s | {estimate} | {rate} |", flush=True)


if __name__ == "__main__":
    main()
