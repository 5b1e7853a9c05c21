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
from shardlm.trees import path_str

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


# Every strategy on at least one kind, and each kind under replication, an FSDP split, Megatron's tensor split and
# a hand-written plan: the plan's placement does not depend on the kind (fsdp on NNX: the nested optimizers' test
# below; dp on Linen: test_linen_caller_variables_survive_donation), Megatron on dp 2 x tp 4 is Megatron + FSDP's
# tensor split with replicas instead.
PARITY_CASES = [("dp", "nnx"), ("megatron", "nnx"), ("megatron+fsdp", "nnx"), ("hand", "nnx"),
                ("fsdp", "linen"), ("megatron+fsdp", "linen"), ("hand", "linen")]


@pytest.mark.parametrize("strategy, kind", PARITY_CASES, ids=[f"{s}-{k}" for s, k in PARITY_CASES])
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


@pytest.mark.parametrize("devices, plan", [(1, "dp"), (8, "dp"), (8, "fsdp")])
def test_linen_caller_variables_survive_donation(devices, plan):
    """Replicating a one-device array onto a mesh can keep its buffer as a shard; the donated step must not free
    the caller's arrays through it."""
    variables = init_linen()
    leaves = jax.tree.leaves(variables)
    copies = [np.asarray(x) for x in leaves]
    mesh = make_mesh(devices=jax.devices()[:devices]) if devices == 1 else None
    sharded = shardlm.shard(LINEN, plan, mesh, variables=variables)
    sharded.trainer(optax.sgd(0.1)).step(batches()[0])
    assert all(np.array_equal(np.asarray(x), c) for x, c in zip(leaves, copies))  # not deleted, not changed
    head = np.asarray(variables["params"]["Dense_0"]["kernel"])
    assert not np.array_equal(np.asarray(sharded.variables["params"]["Dense_0"]["kernel"]), head)  # it trained


class StatefulNNX(nnx.Module):
    """Non-parameter state that training must move on: dropout RNG counters and BatchNorm statistics."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(self.bn(self.l1(x))))


def test_nnx_dropout_and_batch_stats_move_on_like_the_eager_model():
    x = np.random.default_rng(0).normal(size=(16, 16)).astype(np.float32)
    loss_fn = lambda model, b: jnp.mean(model(b) ** 2)  # noqa: E731
    ref = StatefulNNX(nnx.Rngs(0, dropout=1))
    opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, opt, b):
        loss, grads = nnx.value_and_grad(loss_fn)(model, b)
        opt.update(model, grads)
        return loss

    expected = [float(ref_step(ref, opt, x)) for _ in range(3)]
    model = StatefulNNX(nnx.Rngs(0, dropout=1))
    trainer = shardlm.shard(model, "fsdp").trainer(optax.sgd(0.1), loss_fn)
    losses = [float(trainer.step(x)["loss"]) for _ in range(3)]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)  # same dropout masks, same statistics
    assert int(model.drop.rngs.count[...]) == int(ref.drop.rngs.count[...]) == 3
    np.testing.assert_allclose(np.asarray(model.bn.mean[...]), np.asarray(ref.bn.mean[...]), rtol=1e-5, atol=1e-7)
    assert trainer.compiles == 1
    model.eval()  # the module's mode is read at each call: apply is now deterministic and uses running stats
    sharded = trainer.sharded
    np.testing.assert_allclose(np.asarray(sharded.apply(x)), np.asarray(model(x)), rtol=1e-5, atol=1e-6)


def test_linen_dropout_key_per_step_and_batch_stats_kept():
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(32)(x))
            return nn.Dense(8)(nn.Dropout(0.5, deterministic=not train)(x))

    x = np.random.default_rng(0).normal(size=(16, 16)).astype(np.float32)
    net = Net()
    sharded = shardlm.shard(net, "fsdp", variables=net.init(jax.random.key(0), x))
    trainer = sharded.trainer(optax.sgd(0.0), lambda model, b: jnp.mean(model(b, train=True) ** 2), seed=3)
    losses = [float(trainer.step(x)["loss"]) for _ in range(2)]
    assert losses[0] != losses[1]  # lr 0: only a new dropout mask changes the loss
    mean = np.asarray(sharded.variables["batch_stats"]["BatchNorm_0"]["mean"])
    assert np.abs(mean).sum() > 0 and trainer.compiles == 1


@pytest.mark.parametrize("name, tx", [
    ("multi_transform", lambda: optax.multi_transform(
        {"adam": optax.adam(1e-3), "sgd": optax.sgd(1e-3)},
        lambda p: jax.tree.map(lambda x: "adam" if x.ndim > 1 else "sgd", p))),
    ("adafactor", lambda: optax.adafactor(1e-3)),
    ("clip + masked adamw", lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))),
])
def test_optimizer_state_follows_parameters_for_nested_optimizers(name, tx):
    sharded = shard_model("nnx", "fsdp")
    params = leaves_by_path(sharded.params)
    trainer = sharded.trainer(tx())
    mirrored = 0
    for path, arr in jax.tree_util.tree_flatten_with_path(trainer.opt_state)[0]:
        parts = path_str(path).split("/")
        match = next(("/".join(parts[i:]) for i in range(len(parts)) if "/".join(parts[i:]) in params), None)
        if match and params[match].shape == arr.shape:
            assert arr.sharding == params[match].sharding, path_str(path)
            mirrored += 1
        else:
            assert arr.sharding.is_fully_replicated, path_str(path)  # counters, Adafactor's factored rows/columns
    assert mirrored > 0
    for b in batches():
        trainer.step(b)
    assert trainer.compiles == 1


def test_inputs_and_outputs_of_any_structure():
    sharded = shard_model("linen", "dp")
    with pytest.raises(ShardlmError, match=r"inputs of shape \(12, 16\): dimension 0 \(size 12\) is split 8 ways "
                                           r"over data x fsdp"):
        sharded.apply(jnp.zeros((12, SEQ), jnp.int32))
    trainer = sharded.trainer(optax.sgd(0.1), lambda model, b: ce(model(b["tokens"][:, :-1]), b["tokens"]) * b["w"])
    trainer.step({"tokens": batches()[0], "w": np.float32(1.0)})  # a scalar leaf stays whole
    assert trainer.compiles == 1


def test_explicit_axis_mesh_is_refused():
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    with pytest.raises(ShardlmError, match="mesh axes data, tensor are not AxisType.Auto"):
        shardlm.shard(build_nnx, "megatron", mesh)


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
    assert data["mesh"] == {"stage": 1, "data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}
    rows = {r["path"]: r for r in data["parameters"]}
    row = rows["params/Dense_0/kernel"]
    assert row["shape"] == [32, 64] and row["dtype"] == "float32" and row["spec"] == [None, "fsdp"]
    assert row["bytes_per_device"] == 32 * 64 * 4 // 8 and row["placed_by"] == "rule largest dim over fsdp (preset fsdp)"
    total = sum(r["total_bytes"] for r in data["parameters"])
    assert [d["params"] for d in data["per_device"]] == [total // 8] * 8
    assert [d["optimizer"] for d in data["per_device"]] == [2 * total // 8 + 4] * 8  # mu, nu, and the int32 count
    assert data["max_bytes_per_device"]["total"] == 3 * total // 8 + 4
    text = str(ex)
    assert "params/Dense_0/kernel" in text and "float32" in text and "per device: parameters" in text
