"""Third-party models through `shardlm.shard`, as a new user meets them: a Hugging Face-style Flax model (keyword
inputs, an attention mask, an output object, a fused q/k/v kernel, the transformers wrapper object), the megatron
preset on models and meshes it does not fit, and malformed YAML."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, struct
from jax.sharding import PartitionSpec as P

import shardlm
from shardlm.config import load_config
from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh, make_named_mesh
from shardlm.foreign.plan import Plan
from test_cli import assert_one_line_error, shardlm as run_cli

VOCAB, D, HEADS, SEQ, BATCH = 64, 32, 4, 16, 8


@struct.dataclass
class CausalLMOutput:  # what Hugging Face's Flax models return
    logits: jax.Array


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        b, t, d = x.shape
        q, k, v = jnp.split(nn.Dense(3 * d, name="c_attn")(x), 3, axis=-1)  # fused, as GPT-2's
        heads = lambda y: y.reshape(b, t, HEADS, d // HEADS)  # noqa: E731
        scores = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / np.sqrt(d // HEADS)
        allowed = jnp.tril(jnp.ones((t, t), bool))[None, None] & (mask[:, None, None, :] > 0)
        probs = jax.nn.softmax(jnp.where(allowed, scores, -1e9), axis=-1)
        return nn.Dense(d, name="c_proj")(jnp.einsum("bhqk,bkhd->bqhd", probs, heads(v)).reshape(b, t, d))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D, name="c_proj")(jax.nn.gelu(nn.Dense(4 * D, name="c_fc")(x)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        x = x + Attention(name="attn")(nn.LayerNorm(name="ln_1")(x), mask)
        return x + MLP(name="mlp")(nn.LayerNorm(name="ln_2")(x))


class HFStyleLM(nn.Module):
    """The interface of transformers' Flax GPT-2 module: keyword inputs, an optional attention mask, keyword-only
    `deterministic`, an output object, GPT-2's layer names."""

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, *, deterministic: bool = True):
        mask = jnp.ones_like(input_ids) if attention_mask is None else attention_mask
        wte = self.param("wte", nn.initializers.normal(0.02), (VOCAB, D))
        x = wte[input_ids]
        for i in range(2):
            x = Block(name=f"h_{i}")(x, mask)
        return CausalLMOutput(logits=nn.LayerNorm(name="ln_f")(x) @ wte.T)


def adapter(model, tokens, **kw):
    return model(input_ids=tokens, deterministic=True, **kw).logits


MODEL = HFStyleLM()


def variables():
    return MODEL.init(jax.random.key(0), jnp.ones((2, SEQ), jnp.int32))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ + 1)), jnp.int32)


def test_array_keyword_arguments_are_traced_and_a_call_adapter_runs_an_hf_style_model():
    v = variables()
    sharded = shardlm.shard(MODEL, "fsdp", make_mesh(2, 4, 1), variables=v, call=adapter)
    mask = np.ones((BATCH, SEQ), np.int32)
    mask[:, SEQ // 2:] = 0  # padding at the end of every row
    for m in (mask, 1 - mask * 0):  # two masks of the same shape: one compile
        got = sharded.apply(TOKENS[:, :-1], attention_mask=jnp.asarray(m))
        want = MODEL.apply(v, input_ids=TOKENS[:, :-1], attention_mask=jnp.asarray(m)).logits
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert len(sharded._applies) == 1
    assert got.sharding.spec[0] == ("data", "fsdp")  # the plan's output spec, batch split
    with pytest.raises(ShardlmError, match="neither an array .traced. nor hashable"):
        sharded.apply(TOKENS[:, :-1], extra=[1, 2])
    with pytest.raises(ShardlmError, match="first positional argument"):
        sharded.apply(input_ids=TOKENS[:, :-1])

    # the trainer's default next-token loss goes through the adapter too, and matches a plain optax loop
    tx = optax.adamw(1e-2)
    trainer = shardlm.shard(MODEL, "fsdp", make_mesh(2, 4, 1), variables=v, call=adapter).trainer(tx)
    losses = [float(trainer.step(TOKENS)["loss"]) for _ in range(3)]
    params, opt = v["params"], tx.init(v["params"])

    def loss(p):
        logits = MODEL.apply({"params": p}, input_ids=TOKENS[:, :-1]).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()

    want = []
    for _ in range(3):
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        want.append(float(value))
    np.testing.assert_allclose(losses, want, rtol=2e-5)


def test_a_transformers_wrapper_object_is_named_in_one_line():
    class FlaxGPT2LMHeadModel:  # what transformers 4.x hands out: the Linen module and its params, wrapped
        module, params = MODEL, variables()["params"]

    with pytest.raises(ShardlmError) as e:
        shardlm.shard(FlaxGPT2LMHeadModel(), "fsdp")
    assert "shardlm.shard(hf.module, plan, variables={'params': hf.params}, call=" in str(e.value)
    assert "\n" not in str(e.value)


def test_megatron_on_gpt2_layers_splits_the_mlp_and_says_why_the_fused_attention_is_fsdp_only():
    sharded = shardlm.shard(MODEL, "megatron", make_mesh(1, 2, 4), variables=variables(), call=adapter)
    specs = sharded.specs
    assert specs["params/h_0/mlp/c_fc/kernel"] == P("fsdp", "tensor")  # column-parallel
    assert specs["params/h_0/mlp/c_proj/kernel"] == P("tensor", "fsdp")  # row-parallel
    assert "tensor" not in str(specs["params/h_0/attn/c_attn/kernel"])  # fused: not split over tensor
    assert "tensor" not in str(specs["params/h_0/attn/c_proj/kernel"])  # nor the projection after it
    notes = sharded.layout.notes()
    assert any("4 fused q/k/v parameter(s) such as params/h_0/attn/c_attn/" in n for n in notes), notes
    with pytest.raises(ShardlmError, match=r"megatron \(strict\): .*fused q/k/v"):
        shardlm.shard(MODEL, "megatron", make_mesh(1, 2, 4), variables=variables(), strict=True)


class MiniBlock(nnx.Module):
    """NNX layers under the usual names; `flip` stores the MLP's weights [out, in], as torch's Linear does."""

    def __init__(self, flip: bool = False, o_proj_3d: bool = False):
        p = lambda *shape: nnx.Param(jnp.zeros(shape))  # noqa: E731
        self.query, self.key, self.value = (nnx.Dict(kernel=p(D, D)) for _ in range(3))
        self.q_proj = nnx.Dict(kernel=p(D, HEADS, D // HEADS))
        self.o_proj = nnx.Dict(kernel=p(HEADS, D // HEADS, D) if o_proj_3d else p(D, D))
        self.linear1 = nnx.Dict(kernel=p(4 * D, D) if flip else p(D, 4 * D))
        self.linear2 = nnx.Dict(kernel=p(D, 4 * D) if flip else p(4 * D, D))


def test_megatron_places_a_3d_output_projection_row_parallel():
    sharded = shardlm.shard(MiniBlock(o_proj_3d=True), "megatron", make_mesh(1, 2, 4))
    assert sharded.specs["o_proj/kernel"] == P("tensor", None, "fsdp")
    assert sharded.specs["linear1/kernel"] == P("fsdp", "tensor") and sharded.layout.notes() == []


def test_megatron_says_when_it_cannot_do_megatron():
    # a mesh whose axes are not called tensor/fsdp: nothing is tensor-parallel
    on_xy = shardlm.shard(MiniBlock(), "megatron", make_named_mesh({"x": 4, "y": 2}))
    assert all("x" not in str(s) and "y" not in str(s) for s in on_xy.specs.values())
    assert any("the mesh has no 'tensor' axis (its axes: x, y)" in n for n in on_xy.layout.notes())
    with pytest.raises(ShardlmError, match="no 'tensor' axis"):
        shardlm.shard(MiniBlock(), Plan.load("megatron"), make_named_mesh({"x": 4, "y": 2}), strict=True)
    # weights stored [out, in]: the split lands on the other dimension than Megatron's
    flipped = shardlm.shard(MiniBlock(flip=True), "megatron", make_mesh(1, 2, 4))
    assert any("2 weight(s) look stored [out, in], e.g. linear1/kernel (128, 32) in a model of width 32" in n
               for n in flipped.layout.notes()), flipped.layout.notes()
    # no layer the preset knows
    class Unknown(nnx.Module):
        def __init__(self):
            self.foo = nnx.Dict(kernel=nnx.Param(jnp.zeros((D, D))))

    assert any("match no weight of this model" in n
               for n in shardlm.shard(Unknown(), "megatron", make_mesh(1, 2, 4)).layout.notes())


BAD_YAML = "rules:\n  - [a, b]\n  - [c, d\nmesh: {x: 1}\n"
WHERE = "line 4, column 5: expected ',' or ']', but got ':' (while parsing a flow sequence that starts at line 3, column 5)"


def test_malformed_yaml_keeps_pyyaml_position_and_reason_in_one_line(tmp_path):
    (tmp_path / "plan.yaml").write_text(BAD_YAML)
    with pytest.raises(ShardlmError) as e:
        Plan.load(tmp_path / "plan.yaml")
    assert str(e.value) == f"plan file {tmp_path / 'plan.yaml'} is not valid YAML: {WHERE}"
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained traceback
    with pytest.raises(ShardlmError, match="line 4, column 5"):
        load_config(tmp_path / "plan.yaml")
    assert_one_line_error(run_cli("train", "--config", str(tmp_path / "plan.yaml")), WHERE)
