"""Experts at the cost of dense layers: a mixture-of-experts step against the dense step of the same active FLOPs.

Issue 38's case, compiled for 8 H100s and for a TPU v5p-8 from this CPU host (`shardlm.perf.compile_only`; nothing
runs): a 4-layer Llama, d_model 2048, batch 32 x 2048, either dense (SwiGLU 14336, FSDP 8) or 8 experts of 7168 with
top-2 routing (the same active FLOPs per token) under expert 8, expert 4 x fsdp 2 and fsdp 8, dropless (in rounds,
the default, and expert 8 again with one exchange buffer of the worst case, `model.moe_dropless=buffer`), and the
two expert splits again with a capacity factor of 1.25 and of 1.0 (`model.moe_capacity_factor`). Each MoE row uses the
platform's grouped kernel (`model.moe_kernel=auto`: shardlm's Pallas Triton kernel on H100s, Megablox on TPUs); the
last H100 row is XLA's `ragged_dot` (`model.moe_kernel=xla`), which multiplies every row by every local expert.
Printed: peak memory per device and the part of it that is the parameters and AdamW's moments, the FLOPs per
device of the compiled program, shardlm's per-kernel estimate and the compiler's own, and each MoE row's estimate
and peak over its platform's dense row, then the floor under an MoE row's peak: the dense peak plus what the
experts' extra parameters hold whatever the dispatch (16 bytes each: float32 weight, two float32 moments, a
bfloat16 compute copy and a bfloat16 gradient), over the dense peak.

    python benchmarks/moe.py                    # both targets (about 9 minutes on a 2-core VM)
    python benchmarks/moe.py --targets h100

"Compiled for", not "measured on".
"""

import argparse
import sys

from targets import compile_for

SHAPE = ["model=llama-1b", "model.n_layers=4", "model.d_model=2048", "model.n_heads=16", "model.n_kv_heads=8",
         "model.vocab_size=32000", "model.seq_len=2048", "train.batch_size=32"]
DENSE = ["model.d_mlp=14336"]
MOE = ["model.moe_experts=8", "model.moe_top_k=2", "model.moe_d_ff=7168"]
CASES = [  # (label, overrides)
    ("dense, fsdp 8", DENSE + ["mesh.fsdp=8"]),
    ("MoE, expert 8", MOE + ["mesh.expert=8"]),
    ("MoE, expert 8, dropless in one worst-case buffer", MOE + ["mesh.expert=8", "model.moe_dropless=buffer"]),
    ("MoE, expert 4 x fsdp 2", MOE + ["mesh.expert=4", "mesh.fsdp=2"]),
    ("MoE, fsdp 8", MOE + ["mesh.fsdp=8"]),
    ("MoE, expert 8, capacity factor 1.25", MOE + ["mesh.expert=8", "model.moe_capacity_factor=1.25"]),
    ("MoE, expert 8, capacity factor 1.0", MOE + ["mesh.expert=8", "model.moe_capacity_factor=1.0"]),
    ("MoE, expert 4 x fsdp 2, capacity factor 1.25", MOE + ["mesh.expert=4", "mesh.fsdp=2",
                                                           "model.moe_capacity_factor=1.25"]),
    ("MoE, expert 4 x fsdp 2, capacity factor 1.0", MOE + ["mesh.expert=4", "mesh.fsdp=2",
                                                          "model.moe_capacity_factor=1.0"]),
]
XLA_ROW = ("MoE, expert 8, XLA's ragged_dot", MOE + ["mesh.expert=8", "model.moe_kernel=xla"])


def _s(x):
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="h100,tpu-v5p")
    args = ap.parse_args()
    from shardlm.accelerator import cpu_unless_accelerator, start_cpu_quietly

    if cpu_unless_accelerator():
        start_cpu_quietly()
    from shardlm.units import fmt_bytes

    print("| target | step | grouped kernel | peak/device | params + moments | FLOPs/device | shardlm's estimate "
          "| compiler's estimate | estimate / dense | peak / dense |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    floors = []
    for name in args.targets.split(","):
        cases = CASES + ([XLA_ROW] if name == "h100" else [])
        dense = None
        for label, overrides in cases:
            print(f"compiling {label} for {name} ...", file=sys.stderr, flush=True)
            r, _ = compile_for(name, 8, SHAPE + overrides)
            s, est = r.step, r.est.step_s
            dense = dense or (est, s.peak, r.params)
            if label == "MoE, expert 8":  # the extra parameters per device are the same under every expert split
                floors.append((name, (dense[1] + 4 * (r.params - dense[2])) / dense[1]))
            kernel = "-" if "moe" not in " ".join(overrides) else next(
                (o.split("=")[1] for o in overrides if o.startswith("model.moe_kernel=")),
                {"h100": "triton"}.get(name, "megablox"))
            print(f"| {name} | {label} | {kernel} | {fmt_bytes(s.peak)} | {fmt_bytes(r.params + r.optimizer)} | "
                  f"{s.flops_per_device / 1e12:.2f} TFLOP | {_s(est)} | {_s(s.compiler_s)} | {est / dense[0]:.2f} | "
                  f"{s.peak / dense[1]:.2f} |", flush=True)
    for name, floor in floors:
        print(f"{name}: the experts' parameters alone put an MoE step's peak at least {floor:.2f}x the dense step's")


if __name__ == "__main__":
    main()
