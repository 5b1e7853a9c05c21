"""Loss parity: every strategy is the same computation, so the same seed and global batch give the same losses; and
every memory lever (the remat policies, activations offloaded to the host, the loss fused with the head and
chunked over the vocabulary, the training state sharded over the data-parallel replicas) computes the plain step:
one device, float32 logits for the whole vocabulary, optax's cross entropy, autodiff's gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import MICRO, PARITY_STRATEGIES, structured_tokens

# The parity meshes: of the strategies every family trains identically on, those test_llama's Llama does not
# already cover with the same axes (tensor x data or fsdp, data or fsdp alone: DP 4 x FSDP 2 below has both), and
# the memory levers' meshes (data-parallel replicas holding shards of the state, with FSDP, tensor x context, and
# pipeline stages).
STRATEGIES = {**{k: v for k, v in PARITY_STRATEGIES.items()
                 if k not in ("DP 4 x TP 2", "FSDP 4 x TP 2", "DP 8", "FSDP 8")},
              "DP 4 x FSDP 2": {"data": 4, "fsdp": 2}, "DP 2 x TP 2 x CP 2": {"data": 2, "tensor": 2, "context": 2},
              "PP 2 x DP 2": {"stage": 2, "data": 2}}
# dropout too: its masks must not depend on the sharding; the loss in 4 chunks of the vocabulary
OVERRIDES = MICRO + ["model.dropout=0.1", "model.loss_chunks=4"]
# (model.remat, model.remat_offload) beside the default (none, nothing offloaded), on DP 2 x TP 2 x CP 2
# (save_qkv_proj and dots_saveable: what each keeps is read below, test_remat_policies_keep_what_they_name)
POLICIES = [("full", ""), ("save_attention", ""), ("none", "mlp_hidden")]
VOCAB = 500


def batches(cfg, mesh=None):
    from shardlm.data.loader import BatchLoader
    from shardlm.mesh import make_mesh
    from shardlm.sharding import batch_sharding

    mesh = mesh or make_mesh(1, 1, 1, devices=jax.devices()[:1])
    return BatchLoader(structured_tokens(40_000, VOCAB), cfg.model.seq_len, cfg.train.batch_size,
                       batch_sharding(mesh), seed=cfg.seed, shuffle=True)


def shardlm_run(overrides, degrees, steps=20):
    """The metrics of each step of shardlm's own train step on `degrees`."""
    from shardlm.config import load_config
    from shardlm.mesh import make_mesh
    from shardlm.train.state import create_train_state
    from shardlm.train.step import train_step_for

    cfg = load_config(None, overrides)
    degrees = degrees if isinstance(degrees, dict) else dict(zip(("data", "fsdp", "tensor"), degrees))
    n = int(np.prod(list(degrees.values())))
    mesh = make_mesh(**degrees, devices=jax.devices()[:n])
    ts = create_train_state(cfg, mesh, VOCAB)
    loader = batches(cfg, mesh)
    step = train_step_for(cfg, ts, mesh)
    out = []
    for i in range(steps):
        ts.state, metrics = step(ts.state, loader.get(i))
        out.append({k: float(v) for k, v in metrics.items()})
    return out


def plain_run(overrides):
    """The plain step, as shardlm computed it before its memory levers: one device, the model's float32 logits for
    every position and the whole vocabulary, optax's cross entropy, `jax.value_and_grad`, the same AdamW and the
    same dropout keys (seed, step)."""
    from shardlm.config import load_config
    from shardlm.losses import cross_entropy
    from shardlm.mesh import make_mesh
    from shardlm.train.optimizers import make_optimizer
    from shardlm.train.state import create_train_state

    cfg = load_config(None, overrides)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    ts = create_train_state(cfg, mesh, VOCAB)  # the same initial weights
    graphdef, params, rest = nnx.split(nnx.merge(ts.graphdef, ts.state)["model"], nnx.Param, ...)
    tx = make_optimizer(cfg)
    base = jax.random.key(cfg.seed)

    @jax.jit
    def step(params, opt_state, batch, i):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p, rest)(batch[:, :-1], nnx.Rngs(dropout=jax.random.fold_in(base, i)))
            return cross_entropy(logits, batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    opt_state, loader, out = tx.init(params), batches(cfg), []
    for i in range(20):
        params, opt_state, loss, norm = step(params, opt_state, loader.get(i), jnp.int32(i))
        out.append({"loss": float(loss), "grad_norm": float(norm)})
    return out


@pytest.fixture(scope="module")
def plain():
    """{with dropout: the plain step's metrics}: a pipeline draws its dropout masks per microbatch, so it is
    compared without dropout."""
    return {True: plain_run(OVERRIDES), False: plain_run(without_dropout(OVERRIDES))}


def without_dropout(overrides):
    return [o for o in overrides if not o.startswith("model.dropout=")] + ["model.dropout=0"]


def pipelined(name):
    return isinstance(STRATEGIES[name], dict) and STRATEGIES[name].get("stage", 1) > 1


@pytest.fixture(scope="module")
def trajectories():
    return {name: shardlm_run(without_dropout(OVERRIDES) if pipelined(name) else OVERRIDES, degrees)
            for name, degrees in STRATEGIES.items()}


def assert_same_step(got, want):
    """Loss and gradient norm within 1e-5 relative at step 1, the loss within 1e-3 at step 20."""
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[0][key], want[0][key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(got[19]["loss"], want[19]["loss"], rtol=1e-3)


def test_loss_decreases(plain):
    assert plain[True][-1]["loss"] < 0.8 * plain[True][0]["loss"]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_matches_the_plain_step(trajectories, plain, name):
    assert_same_step(trajectories[name], plain[not pipelined(name)])


@pytest.mark.parametrize("remat, offload", POLICIES, ids=[f"{r}{'+offload ' + o if o else ''}" for r, o in POLICIES])
def test_every_remat_policy_computes_the_plain_step(plain, remat, offload):
    """On DP 2 x TP 2 x CP 2, each policy (and one offloading the MLP's hidden activations to host memory, which
    XLA:CPU runs) gives the plain step's losses and gradients."""
    got = shardlm_run(OVERRIDES + [f"model.remat={remat}", f"model.remat_offload={offload}"],
                      STRATEGIES["DP 2 x TP 2 x CP 2"])
    assert_same_step(got, plain[True])


def saved_bytes(overrides) -> int:
    """Bytes of activations the training loss keeps for its backward pass (JAX's own list of saved residuals, the
    weights excepted), one device."""
    import contextlib
    import io
    import re

    from shardlm.config import load_config
    from shardlm.families import build_model

    cfg = load_config(None, overrides)
    with nnx.use_eager_sharding(False):
        model = build_model(cfg.model, VOCAB, 512, nnx.Rngs(params=0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.zeros((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32)

    def loss(p):
        return nnx.merge(graphdef, p, rest).loss(tokens[:, :-1], tokens[:, 1:])[0]

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        jax.ad_checkpoint.print_saved_residuals(loss, params)
    sizes = {"f32": 4, "bf16": 2, "i32": 4, "s32": 4, "u32": 4, "bool": 1}
    total = 0
    for line in text.getvalue().splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\]", line)
        if m and "from the argument" not in line:
            total += sizes.get(m.group(1), 4) * int(np.prod([int(d) for d in m.group(2).split(",") if d]))
    return total


def test_remat_policies_keep_what_they_name():
    """What the loss keeps for its backward pass, per policy (XLA's attention, float32): full keeps each block's
    input; save_qkv_proj the q, k, v projections too; save_attention the attention half's matmul outputs; none every
    matmul output the backward pass needs; dots_saveable every dot's output, which under XLA's attention includes
    the [T, T] scores."""
    from jax import ad_checkpoint  # noqa: F401 - print_saved_residuals lives there

    shape = MICRO + ["model.n_layers=4", "model.seq_len=128", "train.batch_size=8"]
    kept = {r: saved_bytes(shape + [f"model.remat={r}"])
            for r in ("full", "save_qkv_proj", "save_attention", "none", "dots_saveable")}
    assert kept["full"] < kept["save_qkv_proj"] < kept["save_attention"] < kept["none"] < kept["dots_saveable"], kept
    # none: per layer and token, the block's input (64), q, k, v (3 x 64), the attention output (64), the output
    # projection (64) and the MLP's pre-activation (128), float32: 512 values of 4 bytes
    per_layer = 8 * 128 * 512 * 4
    assert per_layer <= (kept["none"] - kept["full"]) / 4 + 8 * 128 * 64 * 4 <= 1.1 * per_layer, kept


def test_same_config_twice_is_bit_identical(trajectories):
    again = shardlm_run(OVERRIDES, STRATEGIES["DP 2 x FSDP 2 x TP 2"])
    assert again == trajectories["DP 2 x FSDP 2 x TP 2"]  # exact float equality, every step
