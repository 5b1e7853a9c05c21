"""The optimizers by name and the spike guard (`shardlm.train.optimizers`, `shardlm.train.spikes`).

Muon orthogonalises each matrix on the devices that own it whole; on fsdp 2 x tensor 2 it trains as on one device
(float32, step 5, the weights too). Each optimizer's state is what it keeps per parameter, read back from the
sharded arrays. An update whose loss spikes is skipped, and the run ends bit for bit as the run that never saw
that batch; a run whose updates keep spiking stops in one line, with no checkpoint of the halted state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import MICRO, run_steps, structured_tokens
from shardlm.config import load_config
from shardlm.data.loader import BatchLoader
from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh
from shardlm.perf.compile_only import shard_bytes
from shardlm.sharding import batch_sharding
from shardlm.train import step as step_module
from shardlm.train.optimizers import muon_plan
from shardlm.train.state import abstract_train_state, create_train_state
from shardlm.train.step import train_step_for
from shardlm.trees import path_str

LLAMA = MICRO + ["model.family=llama", "model.use_bias=false", "model.n_kv_heads=2"]


def _params(ts) -> dict:
    return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(
        nnx.to_pure_dict(nnx.filter_state(ts.state["model"], nnx.Param)))[0]}


def test_muon_on_fsdp_and_tensor_matches_one_device():
    cfg = LLAMA + ["train.optimizer=muon"]
    ref_losses, ref, _ = run_steps(cfg, (1, 1, 1), steps=5)
    losses, got, mesh = run_steps(cfg, {"fsdp": 2, "tensor": 2}, steps=5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert ref_losses[-1] < ref_losses[0] - 0.2  # it learns
    # every matrix Muon orthogonalised on its owners is the one device's (the embedding, on AdamW, normalises
    # its rare rows' tiny gradients, whose float sums differ by the mesh's order: those move within 2e-5)
    want, have = _params(ref), _params(got)
    matrices = {name for name, (dims, _, _) in muon_plan(got.state["model"]).items() if dims is not None}
    assert matrices and matrices <= set(want)
    for name in want:
        np.testing.assert_allclose(have[name], want[name], rtol=1e-4, atol=1e-6 if name in matrices else 2e-5,
                                   err_msg=name)
    # the momentum is stored as its weight is (fsdp x tensor), and moves to its owners inside the update alone
    muon = got.state["optimizer"]["opt_state"]["inner"][1]["inner_states"]["muon"]["inner_state"]  # Muon's half
    mu = muon["inner_states"]["muon"]["inner_state"][0]["mu"]
    weight = got.state["model"]["blocks"]["attn"]["wq"][...]
    assert mu["blocks"]["attn"]["wq"][...].sharding.is_equivalent_to(weight.sharding, 4)
    assert {s.data.shape for s in weight.addressable_shards} == {(2, 32, 2, 16)}


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    gpt = dict((k, d) for k, (d, _, _) in muon_plan(_model(MICRO)).items())
    assert {k for k, d in gpt.items() if d is not None} == {
        "blocks/attn/wq", "blocks/attn/wk", "blocks/attn/wv", "blocks/attn/wo", "blocks/mlp/w_in", "blocks/mlp/w_out"}
    assert gpt["blocks/attn/wq"].reduction_axis == (1,) and gpt["blocks/attn/wq"].output_axis == (2, 3)
    assert gpt["blocks/attn/wo"].reduction_axis == (1, 2) and gpt["blocks/attn/wo"].output_axis == (3,)
    deepseek = dict((k, d) for k, (d, _, _) in muon_plan(_model(MICRO + [
        "model=deepseek-tiny", "model.n_layers=2", "model.mtp_depth=0", "model.tie_embeddings=false"])).items())
    for adamw in ("wte", "lm_head", "blocks/mlp/router", "blocks/mlp/router_bias", "blocks/ln1/scale",
                  "blocks/attn/kv_norm/scale"):
        assert deepseek.get(adamw, "absent") is None, adamw
    experts = deepseek["blocks/mlp/w_gate"]  # [layers, experts, embed, mlp]: a matrix per layer and expert
    assert experts.reduction_axis == (2,) and experts.output_axis == (3,)


def _model(overrides):
    cfg = load_config(None, overrides)
    with nnx.use_eager_sharding(False):
        from shardlm.train.source import model_source
        return nnx.eval_shape(model_source(cfg).factory(500, 1))


# Adafactor factors a weight whose two largest dimensions are at least 128 (optax's default): none of this model's,
# so it keeps one full second moment each
@pytest.mark.parametrize("optimizer, moments", [("adamw", 2.0), ("lion", 1.0), ("adafactor", 1.0), ("muon", None)])
def test_each_optimizer_keeps_its_own_state(optimizer, moments):
    cfg = load_config(None, LLAMA + [f"train.optimizer={optimizer}"])
    mesh = make_mesh(fsdp=2, tensor=2, devices=jax.devices()[:4])
    _, _, abstract, _ = abstract_train_state(cfg, mesh, 500)
    params, state = shard_bytes(abstract["model"]), shard_bytes(abstract["optimizer"])
    guard = 2 * cfg.train.spike_window * 4 + 5 * 4  # the spike guard's window and counters, on every device
    if moments is not None:
        assert state - guard == pytest.approx(moments * params, rel=1e-3)
    else:  # muon: one momentum per matrix, AdamW's two on the embedding and norms
        plan = muon_plan(_model(LLAMA))
        matrices = sum(np.prod(shape) for d, _, shape in plan.values() if d is not None) * 4 / 4  # f32, 4 devices
        rest = sum(np.prod(shape) for d, _, shape in plan.values() if d is None) * 4 / 4
        assert state - guard == pytest.approx(matrices + 2 * rest, rel=2e-2)


def _spiky_run(cfg, degrees, batches, spikes=None):
    """The real state and step over `batches`, the loss of each step in `spikes` (1-based step -> factor: 1000 for a
    spike, NaN for a non-finite loss) scaled by its factor. -> (state, each step's metrics with the routers'
    balancing biases after it, as "router_bias", where the model has them)."""
    mesh = make_mesh(**degrees, devices=jax.devices()[:int(np.prod(list(degrees.values())))])
    ts = create_train_state(cfg, mesh, 500)

    def hook(index):  # read when the step is traced, at its first call
        factor = jnp.float32(1.0)
        for step, f in (spikes or {}).items():
            factor = jnp.where(index == step - 1, jnp.float32(f), factor)
        return factor

    step_module.LOSS_HOOK = None if spikes is None else hook
    metrics = []
    try:
        step = train_step_for(cfg, ts, mesh)
        for batch in batches:
            ts.state, m = step(ts.state, jax.device_put(batch, batch_sharding(mesh)))
            mlp = ts.state["model"]["blocks"]["mlp"]
            bias = {"router_bias": np.asarray(mlp["router_bias"][...])} if "router_bias" in mlp else {}
            metrics.append({**jax.device_get(m), **bias})
    finally:
        step_module.LOSS_HOOK = None
    return ts, metrics


def test_a_spike_is_skipped_and_the_run_ends_as_if_it_never_saw_the_batch():
    """DeepSeek with a balancing bias on data 2 x fsdp 2: a 1000x loss at step 7 and a NaN loss at step 9 are both
    skipped, the routers' biases do not move on either step (their loads count nowhere), and the run ends bit for
    bit as the run that never saw those two batches."""
    cfg = load_config(None, MICRO + ["model=deepseek-tiny", "model.n_layers=2", "model.mtp_depth=0",
                                     "model.moe_bias_rate=1e-2", "train.spike_window=8", "train.spike_sigmas=100",
                                     "train.steps=12"])
    loader = BatchLoader(structured_tokens(40_000, 500), cfg.model.seq_len, cfg.train.batch_size, None, seed=0,
                         shuffle=True, rows=range(cfg.train.batch_size))
    batches = [np.asarray(loader.local[i]) for i in range(11)]
    degrees = {"data": 2, "fsdp": 2}
    spiked, metrics = _spiky_run(cfg, degrees, batches, spikes={7: 1000.0, 9: float("nan")})
    assert [int(m["skipped"]) for m in metrics] == [0] * 6 + [1, 1, 2, 2, 2]
    assert metrics[6]["loss"] > 100 * metrics[5]["loss"] and np.isnan(metrics[8]["loss"])
    bias = [m["router_bias"] for m in metrics]
    for skipped in (7, 9):  # the bias after a skipped step is the bias before it, exactly
        assert np.abs(bias[skipped - 1] - bias[skipped - 2]).max() == 0.0, skipped
    assert all(np.abs(bias[i] - bias[i - 1]).max() > 0 for i in (1, 5, 7, 9))  # applied steps move it
    # the same program (its hook at steps it never reaches), without batches 7 and 9
    never, _ = _spiky_run(cfg, degrees, batches[:6] + batches[7:8] + batches[9:], spikes={10**6: 1000.0,
                                                                                          10**6 + 1: float("nan")})
    want, have = _params(never), _params(spiked)
    assert "blocks/mlp/router_bias" in want
    for name in want:
        np.testing.assert_array_equal(have[name], want[name], err_msg=name)


def test_a_run_whose_updates_keep_spiking_stops_in_one_line_with_its_skips_logged(tmp_path, capsys):
    import json

    from shardlm.checkpoint import local_steps
    from shardlm.train.loop import train

    cfg = load_config(None, MICRO + ["model.n_layers=1", "train.batch_size=4", "train.steps=12",
                                     "train.log_interval=1", "train.eval_interval=12", "train.eval_batches=1",
                                     "train.sample_tokens=0", "train.max_skips=3", "checkpoint.every=4",
                                     "data.tokenizer=bytes", "train.z_loss=1e-4"])
    step_module.LOSS_HOOK = lambda index: jnp.where(index >= 5, jnp.nan, 1.0)  # step 6 on: a non-finite loss
    try:
        with pytest.raises(ShardlmError, match=r"^3 updates in a row were skipped by step 8 \(train.max_skips=3\)"):
            train(cfg, tmp_path / "run", progress=False, devices=jax.devices()[:1])
    finally:
        step_module.LOSS_HOOK = None
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows if "skipped" in r] == [0, 0, 0, 0, 0, 1, 2, 3]
    out = capsys.readouterr().out
    assert "step 6: 1 update(s) skipped since the last log" in out
    # each logged term weighted as it joins the objective, or named unweighted: the z-loss is 1e-4 x log^2 Z
    first = next(r for r in rows if "z_loss" in r)
    assert first["z_loss"] == pytest.approx(1e-4 * first["log_z_squared"], rel=1e-5) and first["log_z_squared"] > 20
    assert first["objective"] == pytest.approx(first["loss"] + first["z_loss"], rel=1e-6)
    assert f"z-loss {first['z_loss']:.4f} (0.0001 x log^2 Z {first['log_z_squared']:.1f})" in out
    assert local_steps(tmp_path / "run") == [4]  # step 8's checkpoint would hold the halted guard: not written


def test_qk_norm_and_z_loss_train_a_gpt_alike_on_a_mesh():
    """The stability options: QK-norm in a GPT (its q and k norms are parameters) and the z-loss through the fused
    head (logged beside the cross entropy, joining the objective) train the same on fsdp 2 x tensor 2 as on one
    device."""
    cfg = load_config(None, MICRO + ["model.qk_norm=true", "train.z_loss=1e-2"])
    loader = BatchLoader(structured_tokens(40_000, 500), cfg.model.seq_len, cfg.train.batch_size, None, seed=0,
                         shuffle=True, rows=range(cfg.train.batch_size))
    batches = [np.asarray(loader.local[i]) for i in range(3)]
    one, one_metrics = _spiky_run(cfg, {"fsdp": 1}, batches)
    _, metrics = _spiky_run(cfg, {"fsdp": 2, "tensor": 2}, batches)
    assert "q_norm" in one.state["model"]["blocks"]["attn"]
    z = [float(m["log_z_squared"]) for m in metrics]
    assert all(v > 1.0 for v in z)  # log^2 Z of a 500-token vocabulary's logits: about ln(500)^2 at the start
    np.testing.assert_allclose(z, [float(m["log_z_squared"]) for m in one_metrics], rtol=1e-5)
    # the logged z-loss is the term as it joins the objective, train.z_loss times log^2 Z
    np.testing.assert_allclose([float(m["z_loss"]) for m in metrics], np.multiply(z, 1e-2), rtol=1e-6)
    np.testing.assert_allclose([float(m["objective"]) for m in metrics],
                               [float(m["loss"]) + float(m["z_loss"]) for m in metrics], rtol=1e-6)
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], [float(m["loss"]) for m in one_metrics],
                               rtol=1e-5)


def test_muons_adamw_half_is_the_projects_adamw_and_leaves_norms_and_biases_undecayed():
    """Muon's other half is `train.optimizer=adamw`'s AdamW: optax.adamw (plain, not Nesterov) with the decay mask
    (`decays`). With a zero gradient no norm scale, bias or router bias moves (0.0); with gradients, every weight
    outside Muon's matrices moves as optax.adamw on those weights alone moves it."""
    from shardlm.train.optimizers import decays, make_optimizer, make_schedule

    cfg = load_config(None, MICRO + ["model=deepseek-tiny", "model.n_layers=2", "model.mtp_depth=0",
                                     "model.moe_bias_rate=0.01", "train.optimizer=muon", "train.weight_decay=0.1",
                                     "train.grad_clip=0", "train.skip_spikes=false"])
    model = _model_concrete(cfg)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    plan = muon_plan(model)
    rest = {name for name, (dims, _, _) in plan.items() if dims is None}
    undecayed = {name for name in rest if name.endswith(("scale", "bias"))}
    assert "blocks/mlp/router_bias" in undecayed and "ln_f/scale" in undecayed and "wte" in rest
    tx = make_optimizer(cfg, model)

    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    moved = {path_str(p): float(jnp.abs(u).max()) for p, u in jax.tree_util.tree_flatten_with_path(updates)[0]}
    assert {name: moved[name] for name in undecayed} == dict.fromkeys(undecayed, 0.0)

    def flat(tree) -> dict:
        return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}

    reference = optax.adamw(make_schedule(cfg), b1=cfg.train.beta1, b2=cfg.train.beta2,
                            weight_decay=cfg.train.weight_decay,
                            mask=lambda tree: {k: decays((jax.tree_util.DictKey(k),), v, 1) for k, v in tree.items()})
    theirs = {k: v for k, v in flat(params).items() if k in rest}
    ref_state, state, ours = reference.init(theirs), tx.init(params), params
    for i in range(3):
        grads = jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i), p.shape, p.dtype), params)
        updates, state = tx.update(grads, state, ours)
        ref_updates, ref_state = reference.update({k: v for k, v in flat(grads).items() if k in rest},
                                                  ref_state, theirs)
        ours, theirs = optax.apply_updates(ours, updates), optax.apply_updates(theirs, ref_updates)
        got = flat(ours)
        for name in rest:
            np.testing.assert_allclose(got[name], theirs[name], rtol=1e-6, atol=1e-7, err_msg=f"{name}, step {i + 1}")


def _model_concrete(cfg):
    with nnx.use_eager_sharding(False):
        from shardlm.train.source import model_source
        return model_source(cfg).factory(500, 1)()


def _compiled_step(overrides, degrees):
    """The train step `shardlm plan` compiles for `overrides` on the local CPU devices of `degrees`: its
    collectives and the tensors XLA's partitioner replicated to reshard them (read from its native stderr)."""
    from shardlm.perf.compiled import compile_step
    from shardlm.train.state import TrainState
    from shardlm.train.step import COST_ONLY_SEPARATOR, batch_struct

    cfg = load_config(None, overrides)
    n = int(np.prod(list(degrees.values())))
    mesh = make_mesh(**degrees, devices=jax.devices()[:n])
    _, graphdef, abstract, shardings = abstract_train_state(cfg, mesh, 500)
    lowered = train_step_for(cfg, TrainState(graphdef, abstract, shardings), mesh, separator=COST_ONLY_SEPARATOR
                             ).trace(abstract, batch_struct(cfg, mesh)).lower()
    return compile_step(lowered, n), shard_bytes(abstract["optimizer"])


def test_muon_on_fsdp_and_tensor_moves_each_matrix_to_its_owners_by_all_to_all_and_replicates_none():
    """Muon's step on fsdp 2 x tensor 2, a 4-layer Llama: each gradient, momentum and weight moves to its owners
    (whole matrices, a layer per device, the layers split over fsdp x tensor) and the update and momentum back, by
    one all-to-all each (`sharding.exchange`). XLA replicates nothing to reshard (before: 25 tensors, each whole on
    every device, its "Involuntary full rematerialization" warning printed), gathers what AdamW's step gathers (the
    weights, for the forward and backward passes), and moves Muon's matrices five times, their share per device
    each time."""
    from shardlm.perf import hlo

    llama4 = LLAMA + ["model.n_layers=4"]
    muon, muon_state = _compiled_step(llama4 + ["train.optimizer=muon"], {"fsdp": 2, "tensor": 2})
    adamw, _ = _compiled_step(llama4 + ["train.optimizer=adamw"], {"fsdp": 2, "tensor": 2})
    assert muon.rematerialisations == [], [x.describe() for x in muon.rematerialisations]

    def by_kind(step) -> dict:
        return {c["kind"]: c["bytes"] for c in hlo.summarize(step.collectives)}

    got, want = by_kind(muon), by_kind(adamw)
    assert got["all-gather"] == pytest.approx(want["all-gather"], rel=0.1), (got, want)
    matrices = sum(np.prod(shape) for d, _, shape in muon_plan(_model(llama4)).values() if d is not None) * 4 / 4
    exchanged = got.get("all-to-all", 0) - want.get("all-to-all", 0)
    assert exchanged == pytest.approx(5 * matrices, rel=0.01), (exchanged, matrices)


@pytest.mark.parametrize("degrees, stored, names, shape", [
    ({"fsdp": 4, "tensor": 2}, P(None, "fsdp", "tensor"), ("layers", "embed", "mlp"), (16, 8, 6)),  # one all-to-all
    ({"fsdp": 4, "tensor": 2}, P(None, "tensor", None, "fsdp"), ("layers", "heads", "head_dim", "embed"),
     (8, 4, 3, 8)),
    ({"fsdp": 2, "context": 2, "tensor": 2}, P(None, ("fsdp", "context"), "tensor"), ("layers", "embed", "mlp"),
     (8, 8, 6)),  # two axes leave one dimension
    ({"data": 2, "fsdp": 2, "tensor": 2}, P(None, "fsdp", "tensor"), ("layers", "embed", "mlp"), (2, 4, 6)),  # copies
])
def test_the_exchange_lays_every_matrix_whole_on_its_owners_and_brings_it_back(degrees, stored, names, shape):
    """`sharding.exchange` moves an array from its stored layout to its owners' (whole matrices, the layers split
    over the mesh axes that divide them; `sharding.owner_spec`) and back: every device's block there is the global
    array's at its index (copies along the axes the layers could not take), and the way back is exact."""
    from jax.sharding import NamedSharding

    from shardlm.sharding import owner_spec
    from shardlm.sharding.exchange import exchange, exchange_back, exchange_plan

    mesh = make_mesh(**degrees, devices=jax.devices()[:8])
    moves, there = exchange_plan(stored, owner_spec(names, shape, mesh, ("layers",), stored), len(shape), mesh)
    assert all(m.kind != "all-gather" for m in moves) or shape[0] < 8
    x = jax.device_put(np.arange(np.prod(shape), dtype=np.float32).reshape(shape), NamedSharding(mesh, stored))

    def run(f, out):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=stored, out_specs=out, check_vma=False))

    owned = run(lambda b: exchange(b, moves, mesh), there)(x)
    for shard in owned.addressable_shards:
        assert shard.data.shape[1:] == shape[1:]  # whole matrices
        np.testing.assert_array_equal(shard.data, np.asarray(x)[shard.index])
    back = run(lambda b: exchange_back(2 * exchange(b, moves, mesh), moves, mesh), stored)(x)
    assert back.sharding.is_equivalent_to(x.sharding, len(shape))
    np.testing.assert_array_equal(np.asarray(back), 2 * np.asarray(x))
