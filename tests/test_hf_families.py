"""The checkpoints people start from, against transformers (PyTorch, CPU) as the independent implementation:
tiny random-weight models made with `from_config` and saved with `save_pretrained` (no network), one per
architecture shardlm's newer mappings read: Llama 3.1 (`llama3` rotary scaling), Qwen3 (head_dim apart from
hidden / heads, q/k norms; YaRN scaling), Qwen2.5 (q/k/v biases) and Qwen3-MoE (8 experts, top 2, raw top-k
weights). Each greedily continues a prompt exactly as transformers does when shardlm loads it sharded over 4
devices, and, trained 20 steps on a mesh from it and exported, loads back in transformers and continues exactly
as shardlm's run does."""

import numpy as np
import pytest
import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

import jax
from shardlm.config import load_config
from shardlm.exporter import export
from shardlm.load import load_model
from shardlm.sampling import Sampling
from shardlm.train.loop import train
from test_hf import GREEDY, assert_close, our_greedy, our_logits, torch_greedy, torch_logits

VOCAB = 300
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
# Scaled for a pretraining context of 16 positions, so that the scaling changes frequencies the 24-token prompts
# and 32-token windows turn through (at Llama 3.1's 8192 it would change none here).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
ARCHITECTURES = {
    "llama3": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_theta=5000.0, rope_scaling=LLAMA3,
                                                   tie_word_embeddings=True)),
    "qwen3-yarn": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32, rope_theta=5000.0, rope_scaling=YARN)),
    "qwen2.5": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, rope_theta=5000.0)),
    "qwen3-moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, head_dim=32, num_experts=8,
                                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                                            norm_topk_prob=False, rope_theta=5000.0)),
    # latent attention (latents of 32 and 48, heads of 32 + 16, values of 32; interleaved rotary rows, YaRN with
    # DeepSeek's mscale), 1 dense layer then 8 routed experts in 4 groups (2 kept, top 2) beside 1 shared, one MTP
    # module (which transformers neither runs nor saves)
    "deepseek-v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        **{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, num_nextn_predict_layers=1, rope_theta=5000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                      "mscale_all_dim": 1.0})),
}
# Each over 4 of the 8 simulated devices: the heads split over tensor, the experts over expert.
MESHES = {"llama3": ["mesh.fsdp=2", "mesh.tensor=2"], "qwen3-yarn": ["mesh.fsdp=2", "mesh.tensor=2"],
          "qwen2.5": ["mesh.fsdp=2", "mesh.tensor=2"], "qwen3-moe": ["mesh.expert=2", "mesh.fsdp=2"],
          "deepseek-v3": ["mesh.expert=2", "mesh.tensor=2"]}
TOKENS = np.random.default_rng(1).integers(0, VOCAB, (8, 24)).astype(np.int32)
TRAIN = ["data.tokenizer=bytes", "model.seq_len=32", "train.steps=20", "train.batch_size=8", "train.warmup_steps=2",
         "train.lr=1e-2", "train.log_interval=10", "train.eval_interval=20", "train.eval_batches=1",
         "train.sample_tokens=0", "checkpoint.every=20"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """save_pretrained directories of the random-weight models. The MoE routers are scaled up from their N(0, 0.02)
    start so that each token's experts are chosen decisively (near-uniform routing leaves a tie to rounding); less
    for sigmoid scores, which saturate. DeepSeek's balancing biases, zero from transformers, are drawn at random."""
    torch.manual_seed(0)
    root, out = tmp_path_factory.mktemp("families"), {}
    for name, build in ARCHITECTURES.items():
        model = build().eval()
        with torch.no_grad():
            for key, w in model.state_dict().items():
                if key.endswith("mlp.gate.weight"):
                    w.mul_(5.0 if name.startswith("deepseek") else 50.0)
                if key.endswith("e_score_correction_bias"):
                    w.normal_(0.0, 0.1)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_an_imported_checkpoint_continues_as_transformers_does_on_4_devices(hf_dirs, name):
    m = load_model(f"hf:{hf_dirs[name]}", overrides=["mesh.data=1", *MESHES[name]], devices=jax.devices()[:4])
    assert m.mesh.devices.size == 4
    model = m.cfg.model
    assert model.family == {"llama3": "llama", "deepseek-v3": "deepseek"}.get(name, "qwen")
    assert (model.rope_scaling, model.head_dim, model.qk_norm, model.qkv_bias) == {
        "llama3": ("llama3", 0, False, False), "qwen3-yarn": ("yarn", 32, True, False),
        "qwen2.5": ("none", 0, False, True), "qwen3-moe": ("none", 32, True, False),
        "deepseek-v3": ("yarn", 0, False, False)}[name]
    reference = AutoModelForCausalLM.from_pretrained(hf_dirs[name]).eval()
    assert_close(our_logits(m, TOKENS, VOCAB), torch_logits(reference, TOKENS))
    for prompt in (TOKENS[0, :10].tolist(), TOKENS[1, :20].tolist()):
        assert our_greedy(m, prompt, GREEDY) == torch_greedy(reference, prompt, GREEDY)
    # the cache's bytes per token, read off its arrays, against the formula: latent attention caches its latent
    # and rotary key per layer, grouped-query attention 2 x kv heads x head size
    gen = m.generator(max_batch=4)
    gen.generate([TOKENS[0, :4].tolist()], 2, Sampling(temperature=0.0))
    per_layer = (model.mla_kv_rank + model.mla_rope_dim if model.mla_kv_rank
                 else 2 * model.n_kv_heads * (model.head_dim or model.d_model // model.n_heads))
    assert gen.cache_bytes_per_token == model.n_layers * per_layer * 4  # float32


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_a_run_trained_from_it_exports_and_continues_in_transformers_as_in_shardlm(hf_dirs, tmp_path, name):
    run, out = tmp_path / "run", tmp_path / "export"
    result = train(load_config(None, [f"init.from=hf:{hf_dirs[name]}", *TRAIN, *MESHES[name]]), run, progress=False)
    assert result["steps"] == 20
    export(run, out, dtype="float32", log=lambda m: None)
    m = load_model(run)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == type(ARCHITECTURES[name]()).__name__
    tokens = TOKENS % 257
    assert_close(our_logits(m, tokens, VOCAB), torch_logits(hf, tokens))
    for prompt in (tokens[2, :8].tolist(), tokens[3, :16].tolist()):
        assert our_greedy(m, prompt, GREEDY) == torch_greedy(hf, prompt, GREEDY)
    if name == "deepseek-v3":  # what transformers does not compute goes out and back in: MTP, the moved biases
        imported = load_model(f"hf:{hf_dirs[name]}")
        back = load_model(f"hf:{out}")
        for path in (("mtp", 0, "eh_proj"), ("mtp", 0, "block", "attn", "wkv_a"), ("blocks", "mlp", "router_bias")):
            ours = np.asarray(get(m.state, path)[...])
            assert np.array_equal(np.asarray(get(back.state, path)[...]), ours), path
        moved = np.asarray(get(m.state, path)[...]) - np.asarray(get(imported.state, path)[...])
        assert np.abs(moved).max() > 0 and np.abs(moved).max() <= 20 * 1e-3 + 1e-6  # 20 steps of at most 1e-3


def get(state, path):
    for key in path:
        state = state[key]
    return state
