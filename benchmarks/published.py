"""The step time `shardlm plan` ranks by, held against published, measured training runs of the same model and
configuration: the validation table of docs/targets.md.

Each row's train step is compiled for its accelerators from this CPU host (XLA:GPU deviceless for H100s, XLA:TPU
through libtpu for TPUs; nothing runs), and costed kernel by kernel (`shardlm.perf.timeline`, with the tables of
`src/shardlm/perf/efficiency/`). Printed: the estimate, the published step, their ratio, and the median absolute
error over the rows no efficiency-table entry was drawn from (here: all of them; the tables come from XLA's
GEMM and NCCL measurements and the FlashAttention-3 paper, none from a training run).

    python benchmarks/published.py            # every row (a few minutes on a 2-core host)
    python benchmarks/published.py --only nemo

Everything here is "compiled for", not "measured on".
"""

import argparse
import statistics
import sys

from targets import LLAMA_8B, compile_for  # the Llama 3.1 8B shape, and how a case compiles

LLAMA_70B = ["model=llama-1b", "model.n_layers=80", "model.d_model=8192", "model.n_heads=64", "model.n_kv_heads=8",
             "model.d_mlp=28672", "model.tie_embeddings=false"]
# AXLearn's fuji-7B v1: Llama 2 7B's shape with a 32,768-token vocabulary and tied embeddings, and a remat policy
# saving the attention's q/k/v, context and output projections (the MLP recomputed), at commit 4dae719
FUJI_7B = ["model=llama-1b", "model.n_layers=32", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=32",
           "model.d_mlp=11008", "model.vocab_size=32768", "model.seq_len=2048", "model.rope_theta=10000",
           "model.tie_embeddings=true", "model.remat=save:qkv_proj,attention_out,out_proj"]
MAXTEXT_OFFLOAD = ["model.remat=full", "model.remat_offload=block_input,qkv_proj,out_proj"]  # MaxText's remat
# "custom" with decoder_layer_input, query/key/value_proj and out_proj offloaded to host, the rest recomputed

# (key, framework, hardware, configuration, target, devices, hosts, overrides, published step seconds, source)
# Step seconds are the published figure converted where it is a throughput: tokens per step / (tokens/s per
# device x devices).
ROWS = [
    ("torchtitan-8b", "torchtitan", "8 H100 (96 GB HBM2e, 500 W)",
     "Llama 3.1 8B, FSDP 8, local batch 2 x 8192, selective (per-op) activation checkpointing, eager", "h100", 8,
     None, LLAMA_8B + ["mesh.fsdp=8", "train.batch_size=16", "model.remat=dots_saveable"], 2 * 8192 / 5762,
     "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1: 5,762 tokens/s per GPU"),
    ("torchtitan-8b-tp", "torchtitan", "64 H100 (96 GB HBM2e, 500 W), 8 hosts",
     "Llama 3 8B, FSDP 8 x TP 8 with sequence parallelism, local batch 12 x 8192 (global 96), per-op SAC, "
     "torch.compile", "h100", 64, 8,
     LLAMA_8B + ["mesh.fsdp=8", "mesh.tensor=8", "mesh.sequence_parallel=true", "train.batch_size=96",
                 "model.remat=dots_saveable"],
     12 * 8192 / 8 / 4378,
     "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: 4,378 tokens/s per GPU (vanilla TP)"),
    ("nemo-8b", "NeMo 24.09", "8 H100 SXM",
     "Llama 3.1 8B, TP 1, PP 1, CP 2 (DP 4), microbatch 1, global batch 128 x 8192, no recompute", "h100", 8,
     None, LLAMA_8B + ["mesh.data=4", "mesh.context=2", "train.batch_size=128", "train.grad_accum=32",
                       "model.remat=none"], 12.91,
     "NVIDIA/dgxc-benchmarking v24.11.1 llama3.1/README_8b.md: 12.91 s per step"),
    # NeMo runs it without recompute, under its interleaved 1F1B schedule. shardlm compiles its 1F1B schedule
    # (`model.pipeline_schedule=1f1b`) with one repeat per stage (a bubble of 3/67 where NeMo's 5 virtual stages
    # make it 3/323: interleaved over 5, 18.89 s, each tick slicing its repeat's weights) under the policy
    # `model.remat=auto` takes for it: save_attention, 18.16 s at 51.7 GiB, where none fits at 67.8 GiB but
    # leaves more of the tensor and context groups' collectives exposed in XLA:GPU's schedule (20.71 s). Its
    # GPipe schedule fits only under full (43.7 GiB; 455 GiB without recompute).
    ("nemo-70b", "NeMo 24.09", "64 H100 SXM, 8 hosts",
     "Llama 3.1 70B, TP 4 with sequence parallelism, PP 4 (5 virtual stages), CP 2, DP 2, microbatch 1, global "
     "batch 128 x 8192, no recompute (shardlm: 1F1B with one repeat per stage, remat save_attention, the one "
     "model.remat=auto takes)", "h100", 64, 8,
     LLAMA_70B + ["model.vocab_size=128256", "model.seq_len=8192", "model.rope_theta=500000", "mesh.tensor=4",
                  "mesh.sequence_parallel=true", "mesh.stage=4", "mesh.context=2", "mesh.data=2",
                  "train.batch_size=128", "model.pipeline_microbatches=64", "model.pipeline_schedule=1f1b",
                  "model.remat=save_attention"], 14.72,
     "NVIDIA/dgxc-benchmarking v24.11.1 llama3.1/README_70b.md: 14.72 s per step"),
    ("nemotron-15b", "NeMo 24.11", "16 H100 SXM, 2 hosts",
     "Nemotron-4 15B (squared-ReLU MLP of 24576 as a SwiGLU of 16384: the same weights and FLOPs), TP 4, DP 4, "
     "sequence parallelism, microbatch 4, global batch 64 x 4096, no recompute", "h100", 16, 2,
     ["model=llama-1b", "model.n_layers=32", "model.d_model=6144", "model.n_heads=48", "model.n_kv_heads=8",
      "model.d_mlp=16384", "model.vocab_size=256000", "model.seq_len=4096", "model.tie_embeddings=false",
      "mesh.tensor=4", "mesh.sequence_parallel=true", "mesh.data=4", "train.batch_size=64", "train.grad_accum=4",
      "model.remat=none"], 2.83,
     "NVIDIA/dgxc-benchmarking v24.11.1 nemotron/README_15b.md: 2.83 s per step"),
    ("maxtext-70b-h100", "MaxText (JAX-Toolbox 2024-12-09)", "64 H100 SXM, 8 hosts",
     "Llama 2 70B, FSDP 64, batch 2 x 4096 per GPU (global 128), remat save_dot_except_mlpwi, cuDNN attention",
     "h100", 64, 8,
     LLAMA_70B + ["model.vocab_size=32000", "model.seq_len=4096", "mesh.fsdp=64", "train.batch_size=128",
                  "model.remat=save:qkv_proj,attention_out,out_proj,mlp_out"], 6.999,
     "NVIDIA/dgxc-benchmarking v24.11.1 maxtext/README_70b.md: 6.999 s per step"),
    ("llm-foundry-mpt7b", "llm-foundry", "8 H100 80GB",
     "MPT-7B (32 layers, d 4096, 32 heads, MLP 16384), FSDP 8 (full shard), microbatch 6 x 2048 (global 48), "
     "no activation checkpointing", "h100", 8, None,
     ["model=gpt2-small", "model.n_layers=32", "model.d_model=4096", "model.n_heads=32", "model.d_mlp=16384",
      "model.vocab_size=50368", "model.seq_len=2048", "model.dtype=bfloat16", "mesh.fsdp=8",
      "train.batch_size=48", "model.remat=none"], 48 * 2048 / 85144,
     "mosaicml/llm-foundry scripts/train/benchmarking/README.md (h100_80gb table): 85,144 tokens/s on 8 GPUs"),
    ("maxtext-8b-v6e", "MaxText (tpu-recipes v0.1.4)", "TPU v6e-8",
     "Llama 3.1 8B, FSDP 8, per-device batch 3 x 8192, remat custom (layer input, q/k/v and output projections "
     "offloaded to host), splash attention", "tpu-v6e", 8, None,
     LLAMA_8B + ["mesh.fsdp=8", "train.batch_size=24"] + MAXTEXT_OFFLOAD, 3.443,
     "AI-Hypercomputer/tpu-recipes training/trillium/Llama3.1-8B-MaxText/v6e-8: 7,138.9 tokens/s per chip"),
    ("maxtext-mistral-v6e", "MaxText (tpu-recipes v0.1.2)", "TPU v6e-8",
     "Mistral 7B, FSDP 8, per-device batch 6 x 8192, remat custom with offload, splash attention", "tpu-v6e", 8,
     None, ["model=llama-1b", "model.n_layers=32", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8",
            "model.d_mlp=14336", "model.vocab_size=32000", "model.seq_len=8192", "model.tie_embeddings=false",
            "mesh.fsdp=8", "train.batch_size=48"] + MAXTEXT_OFFLOAD, 6.320,
     "AI-Hypercomputer/tpu-recipes training/trillium/Mistral-7B-MaxText: 7,776.8 tokens/s per chip"),
    ("nemo-grok-moe", "NeMo (dgxc-benchmarking v24.11.1)", "8 H100 SXM",
     "Grok-1 cut to 2 layers (d 6144, 48 heads, 8 kv heads, 8 experts of 32768, top 2), TP 4 with sequence "
     "parallelism, EP 2, microbatch 1, global batch 1024 x 4096, no recompute", "h100", 8, None,
     ["model=llama-1b", "model.n_layers=2", "model.d_model=6144", "model.n_heads=48", "model.n_kv_heads=8",
      "model.d_mlp=32768", "model.moe_experts=8", "model.moe_top_k=2", "model.vocab_size=131072",
      "model.seq_len=4096", "model.tie_embeddings=false", "mesh.tensor=4", "mesh.sequence_parallel=true",
      "mesh.expert=2",
      "train.batch_size=1024", "train.grad_accum=512", "model.remat=none"], 24.03,
     "NVIDIA/dgxc-benchmarking v24.11.1 grok1/README_314b.md (8 GPUs, 2 layers): 24.03 s per step"),
    # Added 2026-11-28, chosen before any was estimated: every run found on one host or one TPU slice with its
    # hardware named (H100 SXM or a TPU), from a framework the table did not have, whose configuration shardlm
    # can express (modded-nanogpt's records were not: Muon, not AdamW).
    ("llmc-gpt2-xl", "llm.c", "8 H100 SXM (80 GB)",
     "GPT-2 XL 1.5B, DP 8 with ZeRO-1, microbatch 16 x 1024, global 1024 sequences (8 accumulation steps), no "
     "recompute, cuDNN attention", "h100", 8, None,
     ["model=gpt2-xl", "model.vocab_size=50304", "mesh.data=8", "train.batch_size=1024", "train.grad_accum=8",
      "model.remat=none"], 2.80,
     "karpathy/llm.c scripts/run_gpt2_1558M.sh (c6efd90): \"on 8X H100 80GB SXM ($28/hr) steps in 2.80s/iter\""),
    ("llmc-gpt2-124m", "llm.c", "8 H100 (80 GB HBM3)",
     "GPT-2 124M, DP 8 with ZeRO-1, batch 64 x 1024 per GPU (global 512), no recompute, cuDNN attention", "h100",
     8, None, ["model=gpt2-small", "model.vocab_size=50304", "mesh.data=8", "train.batch_size=512",
               "model.remat=none"], 0.140,
     "KellerJordan/modded-nanogpt records/track_1_short/2024-10-13_llmc/README.md (llm.c on 8x H100 HBM3): "
     "\"The mean per-step time was 140ms\""),
    ("axlearn-fuji7b-h100", "AXLearn (4dae719)", "8 H100 SXM (AWS p5.48xlarge)",
     "fuji-7B v1 (Llama 2 7B shape, vocabulary 32,768, tied embeddings), FSDP 8, global batch 64 x 2048, remat "
     "saving the attention projections", "h100", 8, None, FUJI_7B + ["mesh.fsdp=8", "train.batch_size=64"], 2.03,
     "apple/axlearn axlearn/experiments/text/gpt/c4_trainer.py docstring at 4dae719: \"gpu-p5.48xlarge 8x1 step "
     "time: 128K tokens per batch: 2.03s for v1\""),
    ("axlearn-fuji7b-v5e", "AXLearn (4dae719)", "TPU v5e-32",
     "fuji-7B v1, data 2 x FSDP 16, global batch 64 x 2048, remat saving the attention projections", "tpu-v5e",
     32, None, FUJI_7B + ["mesh.data=2", "mesh.fsdp=16", "train.batch_size=64"], 1.93,
     "apple/axlearn axlearn/experiments/text/gpt/c4_trainer.py docstring at 4dae719: \"tpu-v5litepod-32 step "
     "time: 128K tokens per batch: 1.93s for v1\""),
]


def run(row) -> dict:
    key, framework, hardware, what, name, devices, hosts, overrides, published, source = row
    report, wall_s = compile_for(name, devices, overrides, hosts)
    return {"row": row, "report": report, "wall_s": wall_s}


def _work(report) -> float:
    """The arithmetic shardlm's compiled step does per device (its kernels' FLOPs) over the model's (6N + 12LTd per
    token, spread over the devices): above 1 where the program recomputes (remat), computes what it then discards
    (a densified grouped matmul, idle pipeline stages), or repeats work across a tensor group."""
    done = sum(k.flops * k.times for k in report.step.program.kernels())
    return done / (report.model_flops / report.devices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated row keys: " + ", ".join(r[0] for r in ROWS))
    args = ap.parse_args()
    from shardlm.accelerator import cpu_unless_accelerator, start_cpu_quietly
    from shardlm.errors import ShardlmError

    if cpu_unless_accelerator():
        start_cpu_quietly()
    keys = args.only.split(",") if args.only else [r[0] for r in ROWS]
    results = []
    for row in (r for r in ROWS if r[0] in keys):
        print(f"compiling {row[1]}: {row[3]} on {row[2]} ...", file=sys.stderr, flush=True)
        try:
            results.append(run(row))
        except ShardlmError as e:  # said, and the other rows still compile
            print(f"  {row[0]}: {e}", file=sys.stderr, flush=True)
            continue
        est = results[-1]["report"].est
        print(f"  {row[0]}: estimate {est.step_s:.2f} s, published {row[-2]:.2f} s "
              f"({est.step_s / row[-2]:.2f}), compiled in {results[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    print("| framework | hardware | configuration | published step | shardlm's estimate | estimate / published |"
          " gemm / attention / memory / exposed comm | program FLOPs / model FLOPs | peak per device (fits) |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors = []
    for res in results:
        key, framework, hardware, what, *_, published, source = res["row"]
        est = res["report"].est
        ratio = est.step_s / published
        errors.append(abs(ratio - 1))
        parts = " / ".join(f"{est.by_kind.get(k, 0.0):.2f}" for k in ("gemm", "attention", "memory"))
        print(f"| {framework} | {hardware} | {what} | {published:.2f} s | {est.step_s:.2f} s | {ratio:.2f} | "
              f"{parts} / {est.comm_s:.2f} s | {_work(res['report']):.2f} | {res['report'].peak / 2**30:.1f} GiB "
              f"({'yes' if res['report'].fits else 'NO'}) |")
    within = sum(e <= 0.25 for e in errors)
    print(f"\n{within} of {len(errors)} rows within 0.75-1.25; median absolute error {statistics.median(errors):.0%} "
          "over the rows no table entry was drawn from (all of them)")
    for res in results:
        print(f"- {res['row'][1]}: {res['row'][-1]}")


if __name__ == "__main__":
    main()
