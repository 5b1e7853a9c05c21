"""For a host with a GPU: shardlm against Hugging Face GPT-2 with `torch.compile`, same shape, same tokens.

One run trains both for a few steps on identical random token batches (AdamW, bf16 compute on a GPU) and reports,
per framework, the median step time, tokens/s, MFU (model FLOPs from `shardlm.flops`, the same count for both, over
the device's dense peak) and the peak device memory. Unmeasured on shardlm's own machines, which have no GPU; CI
runs it at a tiny size on the CPU (tests/test_benchmarks.py) so that it cannot rot.

    python benchmarks/gpu.py                                  # gpt2-small, seq 1024, batch 8, 20 steps
    python benchmarks/gpu.py --preset tiny --batch 2 --steps 3 --no-compile     # the CPU smoke run
"""

import argparse
import statistics
import sys
import time

import numpy as np


def token_batches(vocab: int, batch: int, seq: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """[batch, seq + 1] int32 token batches, the same for both frameworks."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32) for _ in range(steps)]


def run_shardlm(preset: str, batches, vocab: int) -> dict:
    """shardlm's train step (as `shardlm train` builds it) on the local devices, one after another."""
    from shardlm.accelerator import cpu_unless_accelerator, start_cpu_quietly

    if cpu_unless_accelerator():
        start_cpu_quietly()
    import jax

    from shardlm.config import load_config
    from shardlm.flops import device_peak
    from shardlm.train.source import model_flops_per_step
    from shardlm.mesh import mesh_from_config
    from shardlm.sharding import batch_sharding
    from shardlm.train.state import create_train_state
    from shardlm.train.step import COST_ONLY_SEPARATOR, train_step_for

    batch, width = batches[0].shape
    cfg = load_config(None, [f"model={preset}", f"model.vocab_size={vocab}", f"model.seq_len={width - 1}",
                             f"train.batch_size={batch}", "model.dropout=0", f"train.steps={len(batches)}"])
    mesh = mesh_from_config(cfg.mesh, jax.devices()[:1])
    state = create_train_state(cfg, mesh, vocab)
    step = train_step_for(cfg, state, mesh, separator=COST_ONLY_SEPARATOR)
    params, times, losses = state.state, [], []
    for tokens in batches:
        t0 = time.perf_counter()
        params, metrics = step(params, jax.device_put(tokens, batch_sharding(mesh)))
        losses.append(float(metrics["loss"]))  # waits for the step
        times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    peak, _ = device_peak(jax.devices()[:1], cfg.model.dtype)
    return {"impl": f"shardlm (JAX {jax.__version__}, {cfg.model.dtype})", "times": times[1:], "losses": losses,
            "flops": model_flops_per_step(cfg, vocab, 1), "peak_flops": peak,
            "peak_bytes": stats.get("peak_bytes_in_use")}


def run_torch(preset: str, batches, vocab: int, compile_: bool = True) -> dict:
    """transformers' GPT2LMHeadModel of the same shape, AdamW, bf16 autocast on a GPU, `torch.compile`d."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardlm.config import load_config
    from shardlm.flops import table_peak
    from shardlm.train.source import model_flops_per_step

    batch, width = batches[0].shape
    cfg = load_config(None, [f"model={preset}", f"model.vocab_size={vocab}", f"model.seq_len={width - 1}",
                             f"train.batch_size={batch}"])
    m = cfg.model
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=m.seq_len, n_embd=m.d_model, n_layer=m.n_layers,
                                       n_head=m.n_heads, n_inner=m.d_mlp, resid_pdrop=0, embd_pdrop=0,
                                       attn_pdrop=0)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    forward = torch.compile(model) if compile_ else model
    times, losses = [], []
    for tokens in batches:
        t = torch.from_numpy(tokens.astype(np.int64)).to(device)
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = forward(input_ids=t[:, :-1], labels=t[:, :-1]).loss  # HF shifts labels inside
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().item())  # waits for the step
        times.append(time.perf_counter() - t0)
    peak = table_peak(torch.cuda.get_device_name(), "bfloat16") if cuda else None
    return {"impl": f"transformers + torch {torch.__version__}" + (" + torch.compile" if compile_ else ""),
            "times": times[1:], "losses": losses, "flops": model_flops_per_step(cfg, vocab, 1), "peak_flops": peak,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def report(result: dict, tokens_per_step: int) -> str:
    step = statistics.median(result["times"])
    mfu = result["flops"] / step / result["peak_flops"] if result["peak_flops"] else None
    peak = f"{result['peak_bytes'] / 2**30:.2f} GiB" if result["peak_bytes"] else "-"
    return (f"{result['impl']:<55} {step * 1e3:9.1f} ms {tokens_per_step / step:12,.0f} tok/s "
            f"{'-' if mfu is None else f'{mfu:.1%}':>7} {peak:>10}  loss {result['losses'][0]:.3f} -> "
            f"{result['losses'][-1]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20, help="timed steps, after one untimed (compiling) step")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--no-compile", action="store_true", help="run the PyTorch model eagerly")
    args = ap.parse_args()
    batches = token_batches(args.vocab, args.batch, args.seq, args.steps + 1)
    results = [run_shardlm(args.preset, batches, args.vocab),
               run_torch(args.preset, batches, args.vocab, not args.no_compile)]
    print(f"{args.preset}, batch {args.batch} x {args.seq} tokens, {args.steps} timed steps (median):",
          file=sys.stderr)
    for r in results:
        print(report(r, args.batch * args.seq))


if __name__ == "__main__":
    main()
