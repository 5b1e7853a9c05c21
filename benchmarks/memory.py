"""What one layer keeps for the backward pass, per remat policy, compiled for 8 H100s, against its analytic value.

For each family (a GPT block, a Llama block, a Llama block whose MLP is a mixture of experts) the real train step
is compiled by XLA:GPU for 8 H100s (FSDP 8, bfloat16, 2,048-token sequences, 4 per device: nothing runs) at 4
and at 8 layers. The difference in temporaries, over 4, is what one layer keeps: its saved activations and its
share of the gradients. It is printed in bytes per token x d_model beside:

- the analytic value for the policy (`analytic`): what the policy's named activations (`shardlm.models.remat`)
  add up to for the block, plus the layer's float32 gradient shard;
- the analytic minimum of the literature, every matmul input kept once in 16 bits with a fused attention kernel
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", without dropout:
  34 sbh - 2 sbh of masks for GPT; 12 + 4 kv/H + 6 F/d for a SwiGLU Llama), which `none` goes below by
  recomputing the norms and activation functions from the matmul outputs it keeps.

An offloading policy's host bytes per layer are printed beside its device bytes. `--outside` also compiles Llama
3.1 8B's width at 4 and 8 layers (FSDP 8, 2 x 8,192 tokens per device) and prints what the step keeps outside the
layers.

    python benchmarks/memory.py                      # every family and policy (about 10 minutes on 2 cores)
    python benchmarks/memory.py --families gpt --policies none,full

Everything here is "compiled for", not "measured on": no GPU ran it.
"""

import argparse
import dataclasses
import sys
import time


@dataclasses.dataclass(frozen=True)
class Shape:
    d: int = 2048
    heads: int = 16
    kv_heads: int = 4  # Llama's; GPT has one per head
    seq: int = 2048
    per_device: int = 4  # sequences
    devices: int = 8
    vocab: int = 32000
    gpt_mlp: int = 8192
    llama_mlp: int = 7168
    experts: int = 8
    top_k: int = 2
    expert_mlp: int = 3584  # top 2 of them: the dense Llama's active width

    def tokens(self) -> int:
        return self.seq * self.per_device


def overrides(family: str, s: Shape) -> list[str]:
    common = [f"model.d_model={s.d}", f"model.n_heads={s.heads}", f"model.seq_len={s.seq}",
              f"model.vocab_size={s.vocab}"]
    if family == "gpt":
        return ["model=gpt2-small", *common, f"model.d_mlp={s.gpt_mlp}"]
    llama = ["model=llama-1b", *common, f"model.n_kv_heads={s.kv_heads}", f"model.d_mlp={s.llama_mlp}"]
    if family == "llama":
        return llama
    return llama + [f"model.moe_experts={s.experts}", f"model.moe_top_k={s.top_k}", f"model.moe_d_ff={s.expert_mlp}"]


FAMILIES = ("gpt", "llama", "moe")
POLICIES = {  # label: (model.remat, model.remat_offload)
    "none": ("none", ""),
    "save_attention": ("save_attention", ""),
    "save_qkv_proj": ("save_qkv_proj", ""),
    "full": ("full", ""),
    "dots_saveable": ("dots_saveable", ""),
    "none + mlp_hidden offloaded": ("none", "mlp_hidden"),
}


def korthikanti(family: str, s: Shape) -> float | None:
    """Every matmul input kept once in 16 bits, with a fused attention kernel and without dropout."""
    if family == "gpt":
        return 32.0
    return 12 + 4 * s.kv_heads / s.heads + 6 * s.llama_mlp / s.d if family == "llama" else None


def named_bytes(family: str, s: Shape) -> dict[str, float]:
    """Bytes per token x d_model of each named activation of the family's block (bfloat16; the fused attention
    kernel's float32 log-sum-exp per head with its output)."""
    kv = s.heads if family == "gpt" else s.kv_heads
    out = {"block_input": 2, "qkv_proj": 2 * (1 + 2 * kv / s.heads), "attention_out": 2 + 4 * s.heads / s.d,
           "out_proj": 2, "mlp_out": 2}
    if family == "gpt":
        out["mlp_hidden"] = 2 * s.gpt_mlp / s.d
    elif family == "llama":
        out["mlp_hidden"] = 4 * s.llama_mlp / s.d
    else:  # the routed rows, their gate and up projections, and the experts' outputs, k per token
        out.update(mlp_hidden=4 * s.top_k * s.expert_mlp / s.d, moe_dispatch=2 * s.top_k, moe_out=2 * s.top_k)
    return out


def layer_params(family: str, s: Shape) -> int:
    kv = s.heads if family == "gpt" else s.kv_heads
    attention = 2 * s.d * s.d + 2 * s.d * kv * (s.d // s.heads)
    if family == "gpt":
        return attention + 2 * s.d * s.gpt_mlp + 9 * s.d + s.gpt_mlp  # and the biases and the two LayerNorms
    if family == "llama":
        return attention + 3 * s.d * s.llama_mlp + 2 * s.d
    return attention + s.experts * (3 * s.d * s.expert_mlp + s.d) + 2 * s.d  # the experts, the router, norms


def analytic(family: str, remat: str, offload: str, s: Shape = Shape()) -> tuple[float, float] | None:
    """(device, host) bytes per token x d_model one layer keeps under the policy, with its float32 gradient shard
    on the device; None for JAX's dots policies (they name nothing)."""
    from shardlm.models.remat import saved_names

    names = saved_names(remat)
    if names is None:
        return None
    sizes = named_bytes(family, s)
    host = [n for n in offload.split(",") if n]
    device = {"block_input", *names} - set(host)
    gradients = 4 * layer_params(family, s) / s.devices / (s.tokens() * s.d)
    return sum(sizes.get(n, 0) for n in device) + gradients, sum(sizes.get(n, 0) for n in host)


def compile_h100(args: list[str], devices: int):
    from shardlm.accelerator import compiling_for
    from shardlm.config import load_config
    from shardlm.perf import targets
    from shardlm.perf.compile_only import compile_train_step

    h100 = targets.get("h100")
    with compiling_for(h100.accelerator):
        cfg = load_config(None, args)
    return compile_train_step(cfg, target=h100, n_devices=devices).step


def measure(family: str, remat: str, offload: str, s: Shape = Shape(), depths=(4, 8)) -> dict:
    """Compile the family at two depths for H100s: per layer (device, host) bytes per token x d_model, and what
    the step keeps outside the layers."""
    temps, host, t0 = {}, {}, time.perf_counter()
    for layers in depths:
        step = compile_h100(overrides(family, s) + [
            f"model.n_layers={layers}", f"mesh.fsdp={s.devices}", f"train.batch_size={s.per_device * s.devices}",
            f"model.remat={remat}", f"model.remat_offload={offload}"], s.devices)
        temps[layers], host[layers] = step.temp_bytes, step.host_temp_bytes
    a, b = depths
    per = s.tokens() * s.d * (b - a)
    return {"device": (temps[b] - temps[a]) / per, "host": (host[b] - host[a]) / per,
            "outside_layers_gib": (temps[a] - a * (temps[b] - temps[a]) / (b - a)) / 2**30,
            "compile_s": time.perf_counter() - t0}


LLAMA_8B = Shape(d=4096, heads=32, kv_heads=8, seq=8192, per_device=2, vocab=128256, llama_mlp=14336)


def outside_8b() -> float:
    """GiB of temporaries Llama 3.1 8B's step keeps outside its layers, FSDP 8, 2 x 8,192 tokens per device."""
    return measure("llama", "none", "", LLAMA_8B)["outside_layers_gib"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--policies", default=",".join(POLICIES), help="labels: " + ", ".join(POLICIES))
    ap.add_argument("--outside", action="store_true", help="also Llama 3.1 8B's temporaries outside the layers")
    args = ap.parse_args()
    from shardlm.accelerator import cpu_unless_accelerator, start_cpu_quietly

    if cpu_unless_accelerator():
        start_cpu_quietly()
    s, rows = Shape(), []
    for family in args.families.split(","):
        for label in args.policies.split(","):
            remat, offload = POLICIES[label]
            print(f"compiling {family}, remat {label} ...", file=sys.stderr, flush=True)
            rows.append((family, label, measure(family, remat, offload, s), analytic(family, remat, offload, s)))
    print(f"one layer's temporaries, bytes per token x d_model: {s.devices} H100s (XLA:GPU), FSDP {s.devices}, "
          f"bfloat16, d_model {s.d}, {s.seq}-token sequences, {s.per_device} per device")
    print("| family | remat | measured (device) | analytic | measured / analytic | host (measured / analytic) | "
          "Korthikanti's minimum | outside the layers |")
    print("|---|---|---|---|---|---|---|---|")
    for family, label, m, a in rows:
        k = korthikanti(family, s)
        cells = [family, label, f"{m['device']:.1f}", f"{a[0]:.1f}" if a else "-",
                 f"{m['device'] / a[0]:.2f}" if a else "-",
                 f"{m['host']:.1f} / {a[1]:.1f}" if a and (a[1] or m["host"]) else "-",
                 "-" if k is None else f"{k:.1f}", f"{m['outside_layers_gib']:.2f} GiB"]
        print("| " + " | ".join(cells) + " |")
    if args.outside:
        print(f"\nLlama 3.1 8B's width, FSDP 8, 2 x 8,192 tokens per device: {outside_8b():.2f} GiB of temporaries "
              "outside the layers")


if __name__ == "__main__":
    main()
