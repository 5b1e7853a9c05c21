"""Models shardlm did not write, sharded by plans on 8 simulated devices: seed 002's miniGPT in NNX with every
`with_partitioning` removed, and a seed-003-style Linen transformer (both from examples/). Each is placed by the
dp, fsdp and megatron presets and by a hand-written plan; the arrays' shardings are read back and compared with
the plan, the optimizer state's with the parameters', and the losses with a plain, unsharded JAX run."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardlm
from conftest import structured_tokens
from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh
from shardlm.sharding.rules import path_str

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from linen_transformer import DecoderOnlyTransformer  # noqa: E402
from nnx_minigpt import MiniGPT  # noqa: E402

VOCAB, SEQ, BATCH, LR, STEPS = 64, 16, 16, 1e-2, 3
NNX_SIZES = dict(maxlen=SEQ, vocab_size=VOCAB, embed_dim=32, num_heads=4, feed_forward_dim=64,
                 num_transformer_blocks=2)
LINEN_SIZES = dict(vocab_size=VOCAB, seq_len=SEQ, embed_dim=32, num_layers=2, num_heads=4)
STRATEGIES = {  # plan, mesh degrees (None: the plan's own mesh)
    "dp": ("dp", (8, 1, 1)),
    "fsdp": ("fsdp", (1, 8, 1)),
    "megatron": ("megatron", (2, 1, 4)),
    "megatron+fsdp": ("megatron", (1, 2, 4)),
    "hand": ("hand", None),
}
HAND_PLANS = {"nnx": ROOT / "plans" / "minigpt_hybrid.yaml", "linen": ROOT / "plans" / "linen_transformer.yaml"}


def batches():
    tokens = structured_tokens(STEPS * BATCH * (SEQ + 1), VOCAB, seed=3)
    return list(tokens.reshape(STEPS, BATCH, SEQ + 1))


def build_nnx():
    return MiniGPT(**NNX_SIZES, rngs=nnx.Rngs(0))


LINEN = DecoderOnlyTransformer(**LINEN_SIZES)


def init_linen():
    return LINEN.init(jax.random.key(0), jnp.ones((2, SEQ), jnp.int32))


def ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:]).mean()


def reference_losses(kind):
    """The unsharded baseline, written the plain way (seed 002's NNX loop; a textbook Linen/optax loop)."""
    if kind == "nnx":
        model = build_nnx()
        opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, batch):
            loss, grads = nnx.value_and_grad(lambda m: ce(m(batch[:, :-1]), batch))(model)
            opt.update(model, grads)
            return loss

        return [float(step(model, opt, b)) for b in batches()]
    tx = optax.adamw(LR)
    params = init_linen()["params"]
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, batch):
        loss, grads = jax.value_and_grad(lambda p: ce(LINEN.apply({"params": p}, batch[:, :-1]), batch))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    losses = []
    for b in batches():
        params, opt, loss = step(params, opt, b)
        losses.append(float(loss))
    return losses


_REFERENCE = {}


def reference(kind):
    if kind not in _REFERENCE:
        _REFERENCE[kind] = reference_losses(kind)
    return _REFERENCE[kind]


def shard_model(kind, strategy):
    plan, degrees = STRATEGIES[strategy]
    plan = HAND_PLANS[kind] if plan == "hand" else plan
    mesh = make_mesh(*degrees) if degrees else None
    if kind == "nnx":
        return shardlm.shard(build_nnx, plan, mesh)
    return shardlm.shard(LINEN, plan, mesh, variables=init_linen)


def leaves_by_path(tree):
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("kind", ["nnx", "linen"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_placement_optimizer_state_and_loss_parity(kind, strategy):
    sharded = shard_model(kind, strategy)
    mesh = sharded.mesh
    assert mesh.size == 8
    params = leaves_by_path({"params": sharded.params} if kind == "linen" else sharded.params)
    specs = sharded.specs
    assert set(params) == {p for p, pl in zip(specs, sharded.layout.placements) if pl.is_param}
    # 1. Every array's actual sharding, read back, is the plan's.
    for path, arr in params.items():
        assert arr.sharding.mesh == mesh and arr.sharding.spec == specs[path], (path, arr.sharding.spec)
    by_suffix = lambda suffix: next(v for k, v in params.items() if k.endswith(suffix))  # noqa: E731
    total = sum(a.nbytes for a in params.values())
    held = {d: sum(s.data.nbytes for a in params.values() for s in a.addressable_shards if s.device == d)
            for d in mesh.devices.flat}
    if strategy == "dp":
        assert all(a.sharding.is_fully_replicated for a in params.values())
        assert set(held.values()) == {total}
    if strategy == "fsdp":  # every dimension here has a size 8 divides: exactly an eighth on each device
        assert set(held.values()) == {total // 8}
    if strategy.startswith("megatron"):
        attn, mlp_in, mlp_out = ("mha/query/kernel", "linear1/kernel", "linear2/kernel") if kind == "nnx" else (
            "attn/query/kernel", "MLP_0/Dense_0/kernel", "MLP_0/Dense_1/kernel")
        fsdp = "fsdp"
        assert by_suffix(attn).sharding.spec == P(fsdp, "tensor")  # heads split: column-parallel
        assert by_suffix(mlp_in).sharding.spec == P(fsdp, "tensor")
        assert by_suffix(mlp_out).sharding.spec == P("tensor", fsdp)  # row-parallel
        assert by_suffix(attn).addressable_shards[0].data.shape[1] == 1  # 4 heads over tensor=4
    if strategy == "hand" and kind == "nnx":
        assert by_suffix("mha/out/kernel").sharding.spec == P("tensor", None, "fsdp")
        assert by_suffix("linear1/kernel").sharding.spec == P("fsdp", "tensor")  # written as [embed, mlp]
        assert by_suffix("token_emb/embedding").sharding.spec == P("tensor")
    if strategy == "hand" and kind == "linen":
        assert by_suffix("params/Dense_0/kernel").sharding.spec == P(None, "tensor")
        assert by_suffix("Embed_0/embedding").sharding.is_fully_replicated  # unmatched: replicate

    # 2. The optimizer state is sharded like the parameters from step 0.
    trainer = sharded.trainer(optax.adamw(LR))
    moments = 0
    for path, arr in jax.tree_util.tree_flatten_with_path(trainer.opt_state)[0]:
        keys = path_str(path).split("/")
        moment = next((k for k in ("mu", "nu") if k in keys), None)
        if moment is None:
            assert arr.ndim == 0 and arr.sharding.is_fully_replicated  # the step counter
            continue
        param_path = "/".join(keys[keys.index(moment) + 1:])
        param_path = f"params/{param_path}" if kind == "linen" else param_path
        assert arr.sharding == params[param_path].sharding, (path_str(path), arr.sharding.spec)
        moments += 1
    assert moments == 2 * len(params)

    # 3. Losses equal the unsharded model's: step 1 (forward) and the steps after (gradients, AdamW).
    losses = [float(trainer.step(b)["loss"]) for b in batches()]
    np.testing.assert_allclose(losses, reference(kind), rtol=1e-5)
    assert losses[-1] < losses[0]
    assert trainer.compiles == 1  # no recompile after step 1: shardings are stable across steps

    # 4. The jitted forward pass honours the plan's output spec.
    logits = sharded.apply(jnp.asarray(batches()[0][:, :-1]))
    assert logits.shape == (BATCH, SEQ, VOCAB) and logits.sharding.spec == sharded.layout.output_spec


def test_nnx_module_is_sharded_in_place_and_stays_usable_after_donated_steps():
    model = build_nnx()
    before = np.asarray(model.output_layer.kernel[...])
    sharded = shardlm.shard(model, "fsdp")
    assert sharded.model is model
    kernel = model.output_layer.kernel[...]
    assert kernel.sharding.spec == P(None, "fsdp") and np.array_equal(np.asarray(kernel), before)
    trainer = sharded.trainer(optax.sgd(0.1))
    trainer.step(batches()[0])
    after = model.output_layer.kernel[...]  # the module holds the updated, live arrays (not donated ones)
    assert after.sharding.spec == P(None, "fsdp") and not np.array_equal(np.asarray(after), before)
    assert model(jnp.asarray(batches()[0][:, :-1])).shape == (BATCH, SEQ, VOCAB)


def test_linen_caller_variables_survive_donation_even_on_one_device():
    variables = init_linen()
    first = variables["params"]["Dense_0"]["kernel"]
    copy = np.asarray(first)
    sharded = shardlm.shard(LINEN, "dp", make_mesh(devices=jax.devices()[:1]), variables=variables)
    sharded.trainer(optax.sgd(0.1)).step(batches()[0])
    assert np.array_equal(np.asarray(first), copy)  # not deleted, not changed
    assert not np.array_equal(np.asarray(sharded.variables["params"]["Dense_0"]["kernel"]), copy)


def test_a_bad_plan_fails_before_anything_is_placed():
    model = build_nnx()
    kernel = model.output_layer.kernel[...]
    with pytest.raises(ShardlmError, match=r"of shape \(4, 8\): dimension 0 \(size 4\) is split 8 ways over mesh axis 'tensor'"):
        shardlm.shard(model, "megatron")  # tensor=8 does not divide 4 heads
    assert model.output_layer.kernel[...] is kernel  # untouched
    with pytest.raises(ShardlmError, match="needs its variables"):
        shardlm.shard(LINEN, "dp")
    with pytest.raises(ShardlmError, match="cannot shard a int"):
        shardlm.shard(3, "dp")


def test_explain_table_and_json_are_read_back_from_the_arrays():
    trainer = shard_model("linen", "fsdp").trainer(optax.adamw(LR))
    ex = shardlm.explain(trainer)
    data = ex.to_dict()
    assert data["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    rows = {r["path"]: r for r in data["parameters"]}
    row = rows["params/Dense_0/kernel"]
    assert row["shape"] == [32, 64] and row["dtype"] == "float32" and row["spec"] == str(P(None, "fsdp"))
    assert row["bytes_per_device"] == 32 * 64 * 4 // 8 and row["placed_by"] == "rule largest dim over fsdp (preset fsdp)"
    total = sum(r["total_bytes"] for r in data["parameters"])
    assert [d["params"] for d in data["per_device"]] == [total // 8] * 8
    assert [d["optimizer"] for d in data["per_device"]] == [2 * total // 8 + 4] * 8  # mu, nu, and the int32 count
    assert data["max_bytes_per_device"]["total"] == 3 * total // 8 + 4
    text = str(ex)
    assert "params/Dense_0/kernel" in text and "float32" in text and "per device: parameters" in text
