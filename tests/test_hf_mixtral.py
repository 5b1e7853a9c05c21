"""Mixtral (`MixtralForCausalLM`) checkpoints in and out, checked against transformers (PyTorch, CPU) as the
independent reference: a random-weight Mixtral built from a config (no network) and saved with `save_pretrained`
imports onto one device and onto an expert mesh with transformers' logits and greedy tokens, from the per-expert
tensors `save_pretrained` and the published checkpoints hold and from the fused ones transformers 5 holds in
memory; a shardlm mixture of experts trained on an expert mesh exports to a directory transformers loads, with
shardlm's logits and greedy tokens; what either side cannot express is a one-line error."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file
from transformers import MixtralConfig, MixtralForCausalLM

from shardlm.config import load_config
from shardlm.errors import ShardlmError
from shardlm.exporter import export
from shardlm.hf.weights import Checkpoint
from shardlm.load import load_model
from shardlm.sampling import Sampling
from shardlm.train.loop import train
from test_hf import our_logits, torch_greedy, torch_logits

VOCAB, LAYERS, EXPERTS, D, FF = 300, 2, 4, 64, 96
RTOL = 1e-4  # float32, two implementations: summation orders differ
EP_MESH = ["mesh.expert=4", "mesh.fsdp=2"]
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (8, 24)).astype(np.int32)  # 8 rows: data x fsdp x expert


def rel_err(ours, ref) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def greedy_matches(m, hf, prompts: list[list[int]], n: int) -> None:
    """shardlm's greedy tokens (`LoadedModel.generator`, stopping at its end-of-text token) are transformers'."""
    for prompt, ours in zip(prompts, m.generator(max_batch=8).generate(prompts, n, Sampling(temperature=0.0))):
        theirs = torch_greedy(hf, prompt, n)
        assert ours.ids == theirs[:len(ours.ids)], (ours.ids, theirs)
        assert len(ours.ids) == n or (ours.stop == "eot" and theirs[len(ours.ids)] == m.tokenizer.eot_id)


@pytest.fixture(scope="module")
def mixtral_dirs(tmp_path_factory):
    """A random-weight Mixtral (4 query and 2 kv heads, 4 experts of 96, top 2, untied) as save_pretrained writes
    it (per expert: block_sparse_moe.experts.{e}.w1/w2/w3), and the same weights fused as transformers 5 holds
    them (mlp.experts.gate_up_proj, down_proj). The routers are scaled up from their N(0, 0.02) start so that each
    token's experts are chosen decisively (at 0.02 the routing is near uniform, and which of two near-equal
    experts wins is decided by rounding)."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("mixtral")
    config = MixtralConfig(hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                           num_local_experts=EXPERTS, num_experts_per_tok=2, rope_theta=5000.0,
                           router_aux_loss_coef=0.02, bos_token_id=0, eos_token_id=0)
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(20.0)
    model.save_pretrained(root / "per-expert")
    weights = load_file(str(root / "per-expert" / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in weights  # what this transformers writes
    fused = {k: v for k, v in weights.items() if ".block_sparse_moe." not in k}
    for i in range(LAYERS):
        p = f"model.layers.{i}.block_sparse_moe."
        fused[f"model.layers.{i}.mlp.gate.weight"] = weights[f"{p}gate.weight"]
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack([np.concatenate(
            [weights[f"{p}experts.{e}.w1.weight"], weights[f"{p}experts.{e}.w3.weight"]]) for e in range(EXPERTS)])
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack([weights[f"{p}experts.{e}.w2.weight"]
                                                                     for e in range(EXPERTS)])
    shutil.copytree(root / "per-expert", root / "fused")
    save_file(fused, str(root / "fused" / "model.safetensors"), metadata={"format": "pt"})
    return {"per-expert": root / "per-expert", "fused": root / "fused", "model": model}


# each layout once on each path (the layer on one device, and under the expert exchange); Qwen3-MoE's and
# DeepSeek-V3's per-expert tensors are read under expert splits in test_hf_families
@pytest.mark.parametrize("layout, mesh", [("per-expert", "ep4 x fsdp2"), ("fused", "one device")])
def test_an_imported_mixtral_computes_transformers_logits_and_tokens(mixtral_dirs, layout, mesh, monkeypatch):
    reads = []
    real_read = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, name, index: reads.append((name, index)) or
                        real_read(self, name, index))
    devices = jax.devices()[:1] if mesh == "one device" else jax.devices()
    m = load_model(f"hf:{mixtral_dirs[layout]}", overrides=[] if mesh == "one device" else EP_MESH, devices=devices)
    model = m.cfg.model
    assert (model.family, model.moe_experts, model.moe_top_k, model.moe_every, model.d_mlp, model.rope_theta) == \
        ("llama", EXPERTS, 2, 1, FF, 5000.0)
    assert model.moe_aux_loss_weight == pytest.approx(0.04)  # transformers' coefficient x k: the same objective
    hf = mixtral_dirs["model"]
    err = rel_err(our_logits(m, TOKENS, VOCAB), torch_logits(hf, TOKENS))
    print(f"import {layout} on {mesh}: max relative logit difference {err:.2e}")
    assert err < RTOL, err
    assert m.generator(max_batch=8).generate([TOKENS[0, :10].tolist()], 8, Sampling(temperature=0.0))[0].ids == \
        torch_greedy(hf, TOKENS[0, :10].tolist(), 8)
    if mesh == "one device":  # the load-balancing term weighs in the objective what it weighs in transformers'
        with torch.no_grad():
            theirs = hf(torch.tensor(TOKENS, dtype=torch.long), output_router_logits=True).aux_loss.item()
        ours = float(nnx.merge(m.graphdef, m.state).with_stats(TOKENS)[1]["aux_loss"])
        assert model.moe_aux_loss_weight * ours == pytest.approx(0.02 * theirs, rel=1e-2)  # pooled vs mean of layers
        return
    w_gate = m.state["blocks"]["mlp"]["w_gate"][...]  # [layers, experts, d_model, d_ff]
    assert w_gate.sharding.spec == P(None, "expert", "fsdp", "tensor")
    assert {s.data.shape for s in w_gate.addressable_shards} == {(LAYERS, 1, D // 2, FF)}  # 1 expert, half of d
    # Each device read its own expert's half of d_model, never a whole expert tensor (nor a whole fused one).
    expert_reads = [(n, i) for n, i in reads if ".experts." in n]
    assert expert_reads
    for name, index in expert_reads:
        if layout == "per-expert":  # w1/w3 [f, d] and w2 [d, f]: the d_model half only
            width = index[1 if name.endswith(("w1.weight", "w3.weight")) else 0]
            assert width.stop - width.start == D // 2, (name, index)
        else:  # [E, 2f | d, d | f]: one expert
            assert index[0].stop - index[0].start == 1, (name, index)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A short shardlm mixture-of-experts run (byte tokenizer, 4 experts of 96 over d_mlp 128, tied embeddings) on
    expert 4 x fsdp 2, long enough that its greedy continuations are not one repeated byte."""
    run = tmp_path_factory.mktemp("moe") / "run"
    cfg = load_config(None, ["model=moe-tiny", "model.n_layers=2", "model.d_model=64", "model.d_mlp=128",
                             "model.moe_experts=4", "model.moe_d_ff=96", "model.seq_len=32", "data.tokenizer=bytes",
                             "train.steps=150", "train.batch_size=16", "train.warmup_steps=4", "train.lr=2e-2",
                             "train.eval_interval=150", "train.eval_batches=1", "train.sample_tokens=0",
                             *EP_MESH])
    train(cfg, run, progress=False)
    return run


def test_an_exported_moe_run_loads_in_transformers_with_the_same_logits_and_tokens(moe_run, tmp_path):
    out = tmp_path / "export"
    export(moe_run, out, log=lambda m: None)
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["num_local_experts"],
            config["num_experts_per_tok"], config["intermediate_size"], config["tie_word_embeddings"]) == \
        (["MixtralForCausalLM"], "mixtral", 4, 2, 96, True)
    names = load_file(str(out / "model.safetensors"))
    assert names["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (64, 96)
    assert names["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, 64) and "lm_head.weight" not in names
    m = load_model(moe_run)
    hf = MixtralForCausalLM.from_pretrained(out).eval()
    tokens = TOKENS % 257
    err = rel_err(our_logits(m, tokens, 257), torch_logits(hf, tokens))
    print(f"export: max relative logit difference {err:.2e}")
    assert err < RTOL, err
    greedy_matches(m, hf, [m.tokenizer.encode(p) for p in ("The king", "ROMEO: But soft")], 12)  # 32-token context
    back = load_model(f"hf:{out}", devices=jax.devices()[:1])  # and shardlm reads its own export back
    for key in ("moe_experts", "moe_top_k", "moe_every", "moe_aux_loss_weight", "tie_embeddings", "n_kv_heads"):
        assert getattr(back.cfg.model, key) == getattr(m.cfg.model, key), key
    assert back.cfg.model.d_mlp == 96
    assert rel_err(our_logits(back, tokens, 257), torch_logits(hf, tokens)) < RTOL


def assert_one_line(e, message: str) -> None:
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_sliding_window_shorter_than_the_context_is_a_one_line_error(mixtral_dirs, tmp_path):
    from shardlm.mesh import make_mesh
    from shardlm.train.init_from import check_checkpoint

    windowed = shutil.copytree(mixtral_dirs["per-expert"], tmp_path / "windowed")
    tree = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**tree, "sliding_window": 16}))
    # the default context stops at the window, where Mixtral's attention is shardlm's full attention ...
    assert load_config(None, [f"model=hf:{windowed}"]).model.seq_len == 16
    check_checkpoint(load_config(None, [f"init.from=hf:{windowed}"]), make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    # ... and a longer one is refused by name before any weight is read
    with pytest.raises(ShardlmError) as e:
        check_checkpoint(load_config(None, [f"init.from=hf:{windowed}", "model.seq_len=32"]),
                         make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    assert_one_line(e, "sliding_window=16 is not supported with model.seq_len=32")
    (windowed / "config.json").write_text(json.dumps({**tree, "hidden_act": "gelu"}))
    with pytest.raises(ShardlmError) as e:
        load_model(f"hf:{windowed}", devices=jax.devices()[:1])
    assert_one_line(e, 'hidden_act="gelu" is not supported')
    # one expert per token: Mixtral weighs it 1.0, shardlm by its router probability (Switch's)
    (windowed / "config.json").write_text(json.dumps({**tree, "num_experts_per_tok": 1}))
    with pytest.raises(ShardlmError) as e:
        load_config(None, [f"model=hf:{windowed}"])
    assert_one_line(e, "num_experts_per_tok=1 is not supported")


@pytest.mark.parametrize("model, message", [
    ({"moe_every": 2, "scan_layers": False}, "(model.moe_every=2), which MixtralForCausalLM cannot hold"),
    ({"moe_shared_expert": True}, "shared expert (model.moe_shared_expert=true), which MixtralForCausalLM cannot"),
    ({"moe_top_k": 1}, "(model.moe_top_k=1, Switch's), which MixtralForCausalLM would weigh 1.0"),
    # DeepSeek's routing in a Llama block (aux-free balancing): written as Mixtral or Qwen3-MoE, the sigmoid and
    # its bias would be dropped
    ({"moe_router": "sigmoid", "moe_bias_rate": 0.01}, "(model.moe_router=sigmoid), which MixtralForCausalLM"),
    ({"family": "qwen", "qk_norm": True, "moe_router": "sigmoid", "moe_groups": 2},
     "(model.moe_router=sigmoid, model.moe_groups=2), which Qwen3MoeForCausalLM cannot hold"),
], ids=["moe_every 2", "shared expert", "top 1", "sigmoid as Mixtral", "sigmoid as Qwen3-MoE"])
def test_exporting_what_mixtral_cannot_hold_is_a_one_line_error(tmp_path, model, message):
    run = tmp_path / "run"
    run.mkdir()
    section = {"family": "llama", "use_bias": False, "n_layers": 2, "moe_experts": 4, **model}
    (run / "config.yaml").write_text(json.dumps({"model": section}) + "\n")  # YAML reads JSON
    with pytest.raises(ShardlmError) as e:
        export(run, tmp_path / "never", log=lambda m: None)
    assert_one_line(e, message)
    assert not (tmp_path / "never").exists()
