"""The Qwen family: Qwen2 / 2.5 (q/k/v biases), Qwen3 (per-head q/k RMSNorm, a head size of its own) and
Qwen3-MoE (many narrow experts), computed by the Llama block (`shardlm.models.llama`, whose settings these are)
and mapped to Hugging Face's Qwen architectures (`shardlm.hf.qwen`). Presets are Qwen3's published shapes, and
tiny ones of the same kinds for tests."""

from shardlm.families.llama import check
from shardlm.families.spec import Family, register
from shardlm.hf.qwen import QWEN as QWEN_HF

_QWEN3 = dict(use_bias=False, qk_norm=True, head_dim=128, rope_theta=1e6, layer_norm_eps=1e-6, vocab_size=151936)

PRESETS = {
    # Qwen3's kinds at llama-tiny's scale: a head size apart from d_model / heads (64, not 32), q/k norms; and
    # Qwen3-MoE's, 8 experts of 64 routed top-2, renormalised.
    "qwen3-tiny": dict(_QWEN3, n_layers=4, n_heads=4, n_kv_heads=2, d_model=128, d_mlp=384, head_dim=64,
                       seq_len=128, vocab_size=0, tie_embeddings=True),
    "qwen3-moe-tiny": dict(_QWEN3, n_layers=4, n_heads=4, n_kv_heads=2, d_model=128, d_mlp=384, head_dim=64,
                           seq_len=128, vocab_size=0, tie_embeddings=True, moe_experts=8, moe_top_k=2,
                           moe_d_ff=64),
    # Qwen3-0.6B (0.60B with its 151,936-token vocabulary, tied; 28 layers, 16 query and 8 kv heads of 128 over a
    # width of 1024) and Qwen3-30B-A3B (30.5B, 3.3B active: 48 layers, 128 experts of 768 routed top-8 and
    # renormalised, 32 query and 4 kv heads), at sequences of 4096 (their pretraining's first stage).
    "qwen3-0.6b": dict(_QWEN3, n_layers=28, n_heads=16, n_kv_heads=8, d_model=1024, d_mlp=3072, seq_len=4096,
                       tie_embeddings=True),
    "qwen3-30b-a3b": dict(_QWEN3, n_layers=48, n_heads=32, n_kv_heads=4, d_model=2048, d_mlp=6144, seq_len=4096,
                          tie_embeddings=False, moe_experts=128, moe_top_k=8, moe_d_ff=768,
                          moe_aux_loss_weight=0.008),
}

QWEN = register(Family(name="qwen", model="shardlm.models.llama:Llama", mlp_matrices=3, presets=PRESETS,
                       check=check, experts=True, hf=QWEN_HF))
