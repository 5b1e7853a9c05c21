"""Long sequences: memory per device and XLA:GPU's estimate of the step against sequence length and context degree.

Llama 3.1 8B's shape (`targets.LLAMA_8B`), `model.remat=full`, on 8 H100s: for each sequence length (8k to 128k
tokens) and context degree C (the other 8 / C ways FSDP, one sequence per FSDP group, so each GPU holds T / C of a
sequence's tokens), the real train step is compiled by XLA:GPU from this CPU host (`shardlm.perf.compile_only`;
nothing runs) and its peak bytes per device, whether it fits 80 GiB, the attention it compiled with, the largest
buffer pairing two sequence-sized dimensions (T / C or T: "none" is the issue's "no [T, T]"), shardlm's per-kernel
estimate of the step (the one `plan` ranks by) with the tokens per second per GPU it implies, and XLA:GPU's own
estimate are printed. With C = 1 the sequence is whole on every device (cuDNN's kernel); with C > 1 it is the ring,
with cuDNN's fused kernel on each chunk of keys.

    python benchmarks/long_context.py                              # 8k, 32k, 128k x C = 1, 2, 8
    python benchmarks/long_context.py --seq 8192,131072 --contexts 8

"Compiled for", not "measured on": no GPU ran it.
"""

import argparse
import re
import sys

from targets import LLAMA_8B


def score_buffers(hlo_text: str, sizes: set[int], model_sizes: set[int]) -> str:
    """The array shapes of a compiled program of three or more dimensions, two of them sequence-sized (`sizes`):
    attention scores would be [batch, heads, T / C, T]. 'n/a' when a sequence size is also one of the model's
    widths (T / C = d_model = 4096 at 8k over context 2: every activation would match); tests/test_context.py
    and test_targets.py choose sizes that never collide."""
    if sizes & model_sizes:
        return "n/a (T / C is a model width)"
    shapes = {s for s in re.findall(r"[a-z]+[0-9]*\[([0-9,]+)\]", hlo_text) if s.count(",") >= 2}
    pairs = sorted(f"[{s}]" for s in shapes if sum(int(d) in sizes for d in s.split(",")) >= 2)
    return ", ".join(pairs) or "none"


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
    print("| tokens | mesh | attention | [T, T]-shaped buffers | peak/device | fits 80 GiB | compile | shardlm's "
          "estimate | tokens/s per GPU | XLA:GPU's estimate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seq in (int(s) for s in args.seq.split(",")):
        for cp in (int(c) for c in args.contexts.split(",")):
            overrides = LLAMA_8B + [f"model.seq_len={seq}", f"train.batch_size={8 // cp}", "model.remat=full",
                                    f"mesh.context={cp}", f"mesh.fsdp={8 // cp}"]
            print(f"compiling {seq} tokens, fsdp {8 // cp} x context {cp} ...", file=sys.stderr, flush=True)
            with compiling_for(h100.accelerator):
                cfg = load_config(None, overrides)
            r = compile_train_step(cfg, target=h100, n_devices=8)
            s = r.step
            m = cfg.model
            head_dim = m.d_model // m.n_heads
            widths = {m.d_model, m.d_mlp, m.vocab_size, (m.n_kv_heads or m.n_heads) * head_dim}
            scores = score_buffers(s.hlo_text, {seq // cp, seq}, widths)
            rate = f"{seq / cp / r.est.step_s:,.0f}"  # each GPU: T / C tokens a step
            compiler = f"{s.compiler_s:.2f} s" if s.compiler_s else "-"
            print(f"| {seq:,} | fsdp {8 // cp} x context {cp} | {r.attention} | {scores} | "
                  f"{fmt_bytes(s.peak)} | {'yes' if r.fits else 'NO'} | {s.compile_s:.0f} s | {r.est.step_s:.2f} s | "
                  f"{rate} | {compiler} |", flush=True)


if __name__ == "__main__":
    main()
