"""Adding a model family and an attention kernel each touches one place: a `register` call. Both are added here, from
this file alone, and then configured, checked, built, run and counted as the built-in ones are."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import MICRO
from shardlm.config import load_config
from shardlm.errors import ShardlmError
from shardlm.families import FAMILIES, Family, build_model, hf_format, register
from shardlm.flops import flops_per_token
from shardlm.kernels.registry import ATTENTION_KERNELS, AttentionKernel, attention_impl, register_attention
from shardlm.models import gpt
from shardlm.models.attention import attention_summary
from shardlm.models.layers import CausalLM
from shardlm.models.params import param
from shardlm.models.precision import Precision

VOCAB = 64


def _build(cfg):
    with nnx.use_eager_sharding(False):  # the rule table places parameters, not Flax (as in training)
        return build_model(cfg.model, VOCAB, VOCAB, nnx.Rngs(params=0))


class NoPositions(CausalLM):
    """GPT-2's blocks without a position table (NoPE): causal attention alone tells positions apart."""

    def __init__(self, cfg, vocab_size: int, padded_vocab: int, rngs: nnx.Rngs):
        self.vocab_size, self.padded_vocab, self.context = vocab_size, padded_vocab, cfg.seq_len
        self.precision, self.attention = Precision.of(cfg), cfg.attention
        self.remat, self.remat_offload = cfg.remat, cfg.remat_offload
        pd = self.precision.param
        self.wte = param(rngs, nnx.initializers.normal(0.02), (padded_vocab, cfg.d_model), ("vocab", "embed"), pd,
                         cast_where_read=True)
        self.dropout = nnx.Dropout(cfg.dropout)
        self._stack_blocks(cfg, lambda r, i=None: gpt.Block(cfg, r), rngs)
        self.ln_f = gpt.LayerNorm(cfg.d_model, cfg.layer_norm_eps, cfg.use_bias, pd, rngs)
        self.lm_head = None

    def _embed(self, tokens, rngs, pos):
        return self.dropout(self._token_rows(tokens), deterministic=rngs is None, rngs=rngs), None


def _one_kv_head_per_query_head(m) -> None:
    if (m.n_kv_heads or m.n_heads) != m.n_heads:
        raise ShardlmError("model.n_kv_heads: the nope family has one kv head per query head; drop it")


@pytest.fixture
def nope():
    family = register(Family(name="nope", model=NoPositions, mlp_matrices=2, check=_one_kv_head_per_query_head,
                             presets={"nope-micro": dict(n_layers=2, n_heads=4, d_model=64, d_mlp=128, seq_len=16)}))
    yield family
    FAMILIES.pop("nope")


def test_a_family_registered_from_outside_configures_builds_counts_and_refuses(nope):
    cfg = load_config(None, ["model=nope-micro"])
    assert cfg.model.family == "nope"
    model = _build(cfg)
    assert type(model) is NoPositions and not hasattr(model, "wpe")
    # no positions: a row of one repeated token has the same logits at every position, where GPT's differ
    same = jnp.full((1, 16), 7, jnp.int32)
    logits = np.asarray(model(same))[0]
    np.testing.assert_allclose(logits, np.broadcast_to(logits[:1], logits.shape), atol=1e-5)
    gpt_cfg = load_config(None, ["model.n_layers=2", "model.n_heads=4", "model.d_model=64", "model.d_mlp=128",
                                 "model.seq_len=16"])
    gpt_logits = np.asarray(_build(gpt_cfg)(same))[0]
    assert not np.allclose(gpt_logits, gpt_logits[:1], atol=1e-3)
    # it trains: the fused loss and its gradient at initialisation, about log V
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 17)), jnp.int32)
    loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens[:, :-1], tokens[:, 1:])[0])(model)
    assert abs(float(loss) - math.log(VOCAB)) < 0.1
    assert float(jnp.abs(grads.wte[...]).sum()) > 0
    # the FLOP count reads its record (a 2-matrix MLP, as GPT's): the same shape counts the same, but for the
    # position table, which no matmul reads
    assert flops_per_token(cfg.model, VOCAB) == flops_per_token(gpt_cfg.model, VOCAB)
    # its own check, and what it lacks, each a one-line error
    with pytest.raises(ShardlmError, match="the nope family has one kv head per query head"):
        load_config(None, ["model=nope-micro", "model.n_kv_heads=2"])
    with pytest.raises(ShardlmError, match="the nope family has no Hugging Face counterpart"):
        hf_format(cfg.model)
    with pytest.raises(ShardlmError, match="model.moe_experts applies to the llama"):
        load_config(None, ["model=nope-micro", "model.moe_experts=4"])


def test_an_unregistered_family_and_its_presets_are_unknown():
    with pytest.raises(ShardlmError, match="unknown model preset 'nope-micro'; choose one of: tiny, small"):
        load_config(None, ["model=nope-micro"])
    with pytest.raises(ShardlmError, match="model.family='nope' is not one of: gpt, llama"):
        load_config(None, ["model.family=nope"])


def _einsum_attention(q, k, v, *, residual_name, **_):
    """Causal attention written out: [T, T] scores by einsum, softmax in float32."""
    t = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1).astype(v.dtype), v)


@pytest.fixture
def einsum_kernel():
    kernel = register_attention(AttentionKernel(
        name="einsum", description="einsums written out", placement="gathered", attend=_einsum_attention,
        fits=lambda dtype, head_dim, length, block: False,  # never auto's choice
        summary=lambda requested, length, block: "einsums written out, [T, T] scores per head"))
    yield kernel
    ATTENTION_KERNELS.pop("einsum")


def test_an_attention_kernel_registered_from_outside_is_configured_run_and_reported(einsum_kernel):
    cfg = load_config(None, MICRO + ["model.attention=einsum"])
    xla_cfg = load_config(None, MICRO + ["model.attention=xla"])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 32)), jnp.int32)
    ours, xla = (np.asarray(_build(c)(tokens)) for c in (cfg, xla_cfg))
    np.testing.assert_allclose(ours, xla, atol=2e-5)
    assert attention_summary(cfg.model, 1) == "einsums written out, [T, T] scores per head"
    assert attention_impl("auto", jnp.float32, 16, length=32) == "xla"  # auto passes it by
    with pytest.raises(ShardlmError, match="model.attention='blocked' is not one of: auto, cudnn, splash, flash, "
                                           "xla, einsum"):
        load_config(None, MICRO + ["model.attention=blocked"])


def test_a_pipeline_schedule_registered_from_outside_is_configured_dispatched_and_explained():
    from shardlm import schedules
    from shardlm.mesh import make_mesh
    from shardlm.schedules import SCHEDULES, Schedule, register_schedule
    from shardlm.sharding import use_mesh_rules
    from shardlm.train.source import model_source

    ran = []

    def loss(model, tokens, targets, rngs, settings):  # the layers one after another, as the model runs them
        ran.append(settings)
        return model.loss(tokens, targets, rngs)

    register_schedule(Schedule("in-order", loss=loss, forward=lambda model, tokens, rngs, s: model.with_stats(tokens),
                               holds=lambda stages, micro, repeats, n: f"in order: {n // stages} layers a stage"))
    try:
        cfg = load_config(None, MICRO + ["model.pipeline_schedule=in-order", "mesh.stage=2", "mesh.data=4"])
        mesh = make_mesh(stage=2, data=4, devices=jax.devices()[:8])
        assert "in order: 1 layers a stage" in model_source(cfg)._pipeline_note(mesh)
        model = _build(cfg)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (8, 33)), jnp.int32)
        with use_mesh_rules(mesh):
            staged, _ = jax.jit(lambda t: schedules.loss(model, t[:, :-1], t[:, 1:], None, cfg.model))(tokens)
        assert [(s.stages, s.microbatches, s.repeats) for s in ran] == [(2, 0, 1)]
        assert float(staged) == pytest.approx(float(model.loss(tokens[:, :-1], tokens[:, 1:])[0]), rel=1e-6)
    finally:
        SCHEDULES.pop("in-order")
    with pytest.raises(ShardlmError, match="model.pipeline_schedule='in-order' is not one of: gpipe, 1f1b"):
        load_config(None, MICRO + ["model.pipeline_schedule=in-order"])
