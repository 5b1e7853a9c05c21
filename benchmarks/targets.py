"""What the accelerators' own compilers say of shardlm's train step, and how that compares with published runs.

Each case's real train step (model, AdamW, loss, clipping) is compiled, from this CPU host, by XLA:GPU for H100s
or XLA:TPU for a TPU slice (`shardlm.perf.compile_only`; nothing runs). For each it prints the compile time, the
peak bytes per device and whether they fit, the compiler's own estimate of the step (XLA:GPU's latency-hiding
schedule, XLA:TPU's optimal_seconds) with the MFU it implies, shardlm's cost model with its MFU, and, where a
published measured run has the same configuration, its step time and the ratio estimate / published.

    python benchmarks/targets.py                 # every case (about 15 minutes on a 2-core host)
    python benchmarks/targets.py --only gpt2,llama-1b

MFU is model FLOPs (6N + 12LTd per token, not halved for the causal mask) per device-second over the dense bf16
peak. Everything here is "compiled for", not "measured on": no GPU or TPU ran it.
"""

import argparse
import sys
import time

LLAMA_8B = ["model=llama-1b", "model.n_layers=32", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8",
            "model.d_mlp=14336", "model.vocab_size=128256", "model.seq_len=8192", "model.rope_theta=500000",
            "model.tie_embeddings=false"]

# (key, what, target, devices, overrides, published step seconds or None, source)
CASES = [
    ("gpt2", "gpt2-small, seq 1024, bf16, batch 8, 1 H100", "h100", 1,
     ["model=gpt2-small", "model.vocab_size=50257", "train.batch_size=8"], None, ""),
    ("llama-1b", "llama-1b, seq 2048, batch 4, remat dots_saveable, 1 H100", "h100", 1,
     ["model=llama-1b", "model.vocab_size=128256", "train.batch_size=4", "model.remat=dots_saveable"], None, ""),
    ("8b-h100", "Llama 3.1 8B shape, 8 H100 FSDP 8, 2 x 8192 per GPU, remat dots_saveable (torchtitan: selective "
     "AC)", "h100", 8, LLAMA_8B + ["mesh.fsdp=8", "train.batch_size=16", "model.remat=dots_saveable"],
     2 * 8192 / 5762,
     "torchtitan docs/performance.md, Llama 3.1 8B, 8x H100 (96 GB HBM2e, 500 W), FSDP, local batch 2, seq 8192, "
     "selective AC: 5,762 tokens/s per GPU"),
    ("8b-v5p", "the same on 8 TPU v5p chips, FSDP 8, remat full", "tpu-v5p", 8,
     LLAMA_8B + ["mesh.fsdp=8", "train.batch_size=16", "model.remat=full"], None, ""),
    ("nemo", "Llama 3.1 8B, 8 H100, DP 4 x CP 2, microbatch 1, grad accumulation 32 (global 128 x 8192), remat "
     "full", "h100", 8, LLAMA_8B + ["mesh.data=4", "mesh.context=2", "train.batch_size=128", "train.grad_accum=32",
                                    "model.remat=full"], 12.91,
     "NVIDIA DGX Cloud benchmarking, llama3.1 README_8b (NeMo 24.09, 8x H100, TP1 PP1 CP2, MBS 1, GBS 128, seq "
     "8192): 12.91 s per step, 59.4% MFU"),
    ("maxtext", "Llama 3.1 8B, TPU v6e-8, FSDP 8, 3 x 8192 per chip, remat full", "tpu-v6e", 8,
     LLAMA_8B + ["mesh.fsdp=8", "train.batch_size=24", "model.remat=full"], 3.443,
     "AI-Hypercomputer/tpu-recipes, Llama3.1-8B-MaxText on v6e-8 (per-device batch 3, FSDP, seq 8192): 3.443 s "
     "per step, 7,138.9 tokens/s per chip"),
]


def compile_for(name: str, devices: int, overrides: list[str], hosts: int | None = None):
    """(report, seconds): the train step of the config `overrides` give (with target `name`'s defaults) compiled
    for `devices` of that target over `hosts` (`shardlm.perf.compile_only`). Also benchmarks/published.py's."""
    from shardlm.accelerator import compiling_for
    from shardlm.config import load_config
    from shardlm.perf import targets
    from shardlm.perf.compile_only import compile_train_step

    target = targets.get(name)
    with compiling_for(target.accelerator):
        cfg = load_config(None, overrides)
    t0 = time.perf_counter()
    report = compile_train_step(cfg, target=target, n_devices=devices, hosts=hosts)
    return report, time.perf_counter() - t0


def run(case) -> dict:
    key, what, name, devices, overrides, published, source = case
    r, wall_s = compile_for(name, devices, overrides)
    return {"key": key, "what": what, "wall_s": wall_s, "report": r, "published": published, "source": source}


def _s(x):
    return "-" if x is None else (f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s")


def _p(x):
    """An MFU; above 100% an estimate is faster than the step's FLOPs at the dense peak allow, which no real step
    is (a compiler's estimate that misses work), so it says so."""
    return "-" if x is None else f"{x:.1%}" + (" (impossible)" if x > 1 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated case keys: " + ", ".join(c[0] for c in CASES))
    args = ap.parse_args()
    from shardlm.accelerator import cpu_unless_accelerator, start_cpu_quietly

    if cpu_unless_accelerator():
        start_cpu_quietly()
    from shardlm.units import fmt_bytes

    keys = args.only.split(",") if args.only else [c[0] for c in CASES]
    rows = []
    for case in (c for c in CASES if c[0] in keys):
        print(f"compiling {case[1]} ...", file=sys.stderr, flush=True)
        rows.append(run(case))
    print("| case | compile | peak/device | fits | compiler's estimate | MFU | shardlm's cost model | MFU | "
          "published | estimate / published |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        r, s = row["report"], row["report"].step
        fits = "yes" if r.fits else ("NO (refused by XLA:TPU)" if s.refusal else "NO")
        ratio = (f"{r.est.step_s / row['published']:.2f} (compiler "
                 + (f"{s.compiler_s / row['published']:.2f})" if s.compiler_s else "-)")) if row["published"] else "-"
        print(f"| {row['what']} | {s.compile_s:.0f} s | {fmt_bytes(s.peak)} | {fits} | {_s(s.compiler_s)} | "
              f"{_p(r.mfu(s.compiler_s))} | {_s(r.est.step_s)} | {_p(r.mfu(r.est.step_s))} | "
              f"{_s(row['published'])} | {ratio} |")
    print()
    for row in rows:
        s = row["report"].step
        extra = []
        if s.schedule:
            extra.append("hidden in XLA:GPU's schedule: " + ", ".join(
                f"{k} {v:.0%}" for k, v in s.schedule.hidden_by_kind().items()))
        if s.refusal:
            extra.append(f"refused: {s.refusal}")
        if row["source"]:
            extra.append(f"published: {row['source']}")
        if extra:
            print(f"- {row['what']}: " + "; ".join(extra))


if __name__ == "__main__":
    main()
