"""FLOP counting, accelerator peaks and MFU, with the convention stated so the numbers can be checked.

Convention (PaLM appendix B, as in nanoGPT's `estimate_mfu`):
    FLOPs per token = 6 * N_matmul + 6 * n_layers * seq_len * heads * (qk head + v head)
- N_matmul counts the weights that take part in matrix multiplies: the attention weights (q, k, v, o; k and v
  narrower under grouped-query attention; latent attention's own, its family's `attention_params`) and MLP weights (two matrices, three for SwiGLU) of every block (of a
  mixture of experts, the active ones: the top-k experts a token is routed to, the shared expert and the router),
  and the output head (d_model x padded vocabulary, counted once even when tied to the embedding). The embedding lookups,
  biases and norms do no matmul and are left out. The factor 6 is 2 (multiply-add) x 3 (forward,
  and backward for activations and for weights).
  Multi-token prediction modules count as the blocks and head they run.
- 6 * L * T * H * (qk + v) is attention's QK^T and AV, forward and backward, *not* halved for causal masking:
  12 * L * T * d when the heads' size is d / H, as it is but for Qwen3's (`model.head_dim`) and latent attention's.
MFU = achieved model FLOP/s per device / peak FLOP/s per device. The peak comes from a table of known
accelerators (dense, no sparsity) for the compute dtype; on CPU there is no datasheet number, so the peak is
*measured*: a large fp32 matmul run on every device at once, kept for the host (`shardlm.host_figures`: the same
figure a CPU plan is costed with), and labelled "measured CPU matmul peak".
"""

import math
import re

import jax
import jax.numpy as jnp

from shardlm import host_figures
from shardlm.accelerator import resolve_dtype
from shardlm.families import family_of
from shardlm.kernels.grouped import megablox_flops
from shardlm.kernels.registry import ATTENTION_KERNELS
from shardlm.models.config import FP8, ModelConfig, head_size, sparse_layer_count, value_size


def jaxpr_matmul_flops(jaxpr, scope: str = "") -> float:
    """The FLOPs of every matrix multiply in a jaxpr (2 per multiply-add of each `dot_general`, and of each
    `ragged_dot_general` row by its group's matrix: the rows of an expert-parallel exchange buffer, padding
    included, count, so a mixture's count can exceed its active FLOPs), a scan's body counted once per iteration, a
    conditional's costliest branch, fused attention kernels (splash, cuDNN) by their shapes, other Pallas kernels by
    the cost they declare (grouped matmuls: their routed rows), a while loop's body once (its trip count is not
    known), a `shard_map`'s per-device body once per device, nested calls (jit, remat, custom derivatives' primal)
    followed. For a forward pass this is what the 6N + 12LTd convention counts for shardlm's models, 3 x (2N +
    4LTd): the weights' matmuls and attention's."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        inner = f"{scope}/{eqn.source_info.name_stack}"  # a nested jaxpr's names start afresh: carry the scopes
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        elif name == "ragged_dot_general":  # a mixture's experts: each row by its group's matrix, [M, K] -> [M, N]
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * eqn.invars[0].aval.shape[-1]
        elif name == "pallas_call" and _is_attention_call(eqn):
            total += _attention_call_flops(eqn)
        elif name == "pallas_call" and (grouped := _grouped_call_flops(eqn, inner)) is not None:
            total += grouped
        elif (passes := _attention_primitive_passes(name)) is not None:
            total += passes * _attention_call_flops(eqn)
        elif name == "scan":
            total += eqn.params["length"] * jaxpr_matmul_flops(eqn.params["jaxpr"], inner)
        elif name == "cond":
            total += max(jaxpr_matmul_flops(branch, inner) for branch in eqn.params["branches"])
        elif name == "shard_map":  # a per-device program, run on each device of its manual axes
            mesh = eqn.params["mesh"]
            axes = eqn.params.get("newly_manual_axes") or eqn.params.get("manual_axes") or tuple(mesh.shape)
            total += math.prod(mesh.shape[a] for a in axes) * jaxpr_matmul_flops(eqn.params["jaxpr"], inner)
        else:
            total += sum(jaxpr_matmul_flops(v, inner) for v in eqn.params.values() if _is_jaxpr(v))
    return total


def _grouped_call_flops(eqn, scope: str) -> float | None:
    """A grouped matmul's Pallas call: Megablox's for the rows its caller expects (`kernels.grouped.megablox_flops`,
    from the call's name scope), shardlm's Triton kernel's by the cost it declares (the same rows)."""
    declared = eqn.params.get("cost_estimate")
    flops = megablox_flops(scope, declared.flops if declared else None,
                           tuple(eqn.outvars[0].aval.shape))
    return flops if flops is not None else (float(declared.flops) if declared else None)


def _is_attention_call(eqn) -> bool:
    """A Pallas call of a registered attention kernel (splash's), by its name (`AttentionKernel.pallas_names`)."""
    name = str(eqn.params.get("name") or eqn.params.get("name_and_src_info"))
    return any(n in name for k in ATTENTION_KERNELS.values() for n in k.pallas_names)


def _attention_primitive_passes(name: str) -> int | None:
    """A registered kernel's own JAX primitive (cuDNN's fused attention), and the passes of attention's matmuls it
    runs: the forward QK^T and AV, the backward twice that (`AttentionKernel.primitives`); None for another."""
    return next((k.primitives[name] for k in ATTENTION_KERNELS.values() if name in k.primitives), None)


def _attention_call_flops(eqn) -> float:
    """A fused attention kernel call (splash's forward, dq or dkv; cuDNN's forward; opaque to the count above),
    counted as attention's matmuls are: 4 B H Tq Tk D, not halved for a causal mask. Its first two floating
    operands of rank 3 or more are the queries and the keys, with their positions second to last (splash's [...,
    heads, T, D]) or third to last (cuDNN's [B, T, heads, D]): the queries' whole shape times the keys' length."""
    arrays = [v.aval.shape for v in eqn.invars
              if hasattr(v.aval, "shape") and len(v.aval.shape) >= 3 and jnp.issubdtype(v.aval.dtype, jnp.floating)]
    if len(arrays) < 2:
        return 0.0
    q, k = arrays[:2]
    keys = k[-3] if _attention_primitive_passes(eqn.primitive.name) is not None else k[-2]
    return 4.0 * math.prod(q) * keys


def _is_jaxpr(value) -> bool:
    return hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns")


def matmul_params(cfg: ModelConfig, padded_vocab: int) -> int:
    """The weights one token multiplies by (a mixture of experts' active ones: its top-k experts, the shared
    expert and the router, not every expert)."""
    d, f, L = cfg.d_model, cfg.d_mlp, cfg.n_layers
    family = family_of(cfg)
    mlp_matrices = family.mlp_matrices  # SwiGLU: gate, up, down; GPT: in, out
    sparse = sparse_layer_count(cfg)
    experts_per_token = cfg.moe_top_k + (1 if cfg.moe_shared_expert else 0)
    moe_mlp = experts_per_token * mlp_matrices * d * (cfg.moe_d_ff or f) + d * cfg.moe_experts  # + the router
    main = (L * family.attention_params(cfg) + (L - sparse) * mlp_matrices * d * f + sparse * moe_mlp
            + d * padded_vocab)
    # multi-token prediction: per module, the projection of [embedding; hidden], a block (sparse when the model's
    # are) and the shared head
    mtp = cfg.mtp_depth * (2 * d * d + family.attention_params(cfg) + (moe_mlp if cfg.moe_experts else
                                                                       mlp_matrices * d * f) + d * padded_vocab)
    return main + mtp


def flops_per_token(cfg: ModelConfig, padded_vocab: int) -> int:
    qk_and_v = head_size(cfg) + value_size(cfg)  # q.k over the query/key head, p.v over the value head
    return 6 * matmul_params(cfg, padded_vocab) + 6 * cfg.n_layers * cfg.seq_len * cfg.n_heads * qk_and_v


# Dense peak FLOP/s per device, matched in order against `device.device_kind` (first match wins). float32 matmuls
# run as TF32 on NVIDIA tensor cores and as bf16 passes on TPU under JAX's default precision, so those are the
# float32 peaks. fp8: the dense FP8 tensor-core peak (NVIDIA's datasheets halve the sparse figure: H100 SXM
# 3,958 -> 1,979). H100 SXM reports e.g. "NVIDIA H100 80GB HBM3"; TPU v5p reports "TPU v5", v5e "TPU v5 lite".
_PEAKS: list[tuple[str, dict[str, float]]] = [
    (r"^NVIDIA H100 PCIe", {"bfloat16": 756e12, "float32": 378e12, FP8: 1513e12}),
    (r"^NVIDIA (H100|H200|GH200)\b", {"bfloat16": 989e12, "float32": 494.5e12, FP8: 1979e12}),
    (r"^NVIDIA A100\b", {"bfloat16": 312e12, "float32": 156e12}),
    (r"^NVIDIA L4$", {"bfloat16": 121e12, "float32": 60e12, FP8: 242.5e12}),
    (r"^TPU v6", {"bfloat16": 918e12, "float32": 918e12}),
    (r"^TPU v5( lite|e)$", {"bfloat16": 197e12, "float32": 197e12}),
    (r"^TPU v5p?$", {"bfloat16": 459e12, "float32": 459e12}),
    (r"^TPU v4$", {"bfloat16": 275e12, "float32": 275e12}),
]


def peak_dtype(m: ModelConfig) -> str:
    """The dtype whose dense peak MFU and the cost model hold a step against: FP8's where the blocks' matmuls are
    FP8 (`model.matmul_dtype=fp8`: most of a step's FLOPs), else the compute dtype."""
    return FP8 if m.matmul_dtype == FP8 else m.dtype


def mfu(model_flops_per_device: float, step_s: float | None, peak_flops: float) -> float | None:
    """Model FLOPs per device per second over the peak, for a step of `step_s` (None: no step time known)."""
    return model_flops_per_device / step_s / peak_flops if step_s else None


def possible_mfu(value: float | None) -> float | None:
    """An implied MFU as a figure to show: None above 100%, where a step faster than the peak allows for the
    model's FLOPs is an estimator's error, not a figure (`plan` and `--compile-only` say so instead)."""
    return None if value is None or value > 1 else value


def table_peak(device_kind: str, dtype: str = "float32") -> float | None:
    dtype = resolve_dtype(dtype)
    for pattern, peaks in _PEAKS:
        if re.search(pattern, device_kind):
            return peaks.get(dtype)
    return None


def device_peak(devices, dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s per device, a label saying where the number comes from). On a CPU, the matmul peak measured
    with every device busy at once, kept for the host (`shardlm.host_figures`: the figure a CPU plan is costed
    with), or, across several processes, measured now."""
    kind = devices[0].device_kind
    peak = table_peak(kind, dtype)
    if peak is not None:
        return peak, f"{kind} datasheet dense {dtype} peak"
    cpu = devices[0].platform == "cpu"
    n = len(devices)
    where = f"{n} device{'s' * (n > 1)} busy at once" if cpu else f"{kind}, not in the peak table"
    if cpu and jax.process_count() == 1:
        figures, path = host_figures.kept(devices)
        return figures["peak_flops"], f"measured CPU matmul peak ({where}, kept in {path})"
    return host_figures.measure_matmul_peak(devices), f"measured {'CPU ' * cpu}matmul peak ({where})"
