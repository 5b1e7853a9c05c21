"""Placement read back from the arrays themselves, compared with the rule table."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import MICRO
from shardlm.config import load_config
from shardlm.errors import ShardlmError
from shardlm.explanation import explain_state, format_explanation
from shardlm.mesh import make_mesh
from shardlm.sharding import batch_sharding, generation_rules, logical_to_spec, zero_rules
from shardlm.trees import path_str
from shardlm.train.state import create_train_state

# What each parameter must look like, in logical names: the model's contract with the rule table.
EXPECTED_LOGICAL = {
    "wte": ("vocab", "embed"),
    "wpe": ("pos", "embed"),
    "ln_f/scale": ("embed",),
    "ln_f/bias": ("embed",),
    "attn/wq": ("embed", "heads", "head_dim"),
    "attn/wk": ("embed", "kv_heads", "head_dim"),
    "attn/wv": ("embed", "kv_heads", "head_dim"),
    "attn/wo": ("heads", "head_dim", "embed"),
    "attn/q_bias": ("heads", "head_dim"),
    "attn/k_bias": ("kv_heads", "head_dim"),
    "attn/v_bias": ("kv_heads", "head_dim"),
    "attn/out_bias": ("embed",),
    "mlp/w_in": ("embed", "mlp"),
    "mlp/w_out": ("mlp", "embed"),
    "mlp/in_bias": ("mlp",),
    "mlp/out_bias": ("embed",),
    "ln1/scale": ("embed",),
    "ln1/bias": ("embed",),
    "ln2/scale": ("embed",),
    "ln2/bias": ("embed",),
}


def expected_spec(path: str, shape=None, mesh=None) -> P:
    """A training state's spec: the rule table's, and with data-parallel replicas the table that also splits the
    state over them (`train.shard_optimizer_over_data`, on by default)."""
    key = next(k for k in EXPECTED_LOGICAL if path == k or path.endswith("/" + k))
    names = EXPECTED_LOGICAL[key]
    if path.startswith("blocks/") and not path.split("/")[1].isdigit():  # scanned: stacked on a `layers` axis
        names = ("layers", *names)
    rules = zero_rules() if mesh is not None and mesh.shape["data"] > 1 else None
    return logical_to_spec(names, rules, shape=shape, mesh=mesh)


def _same_spec(a: P, b: P) -> bool:
    """Equal up to trailing unsharded dimensions (P('x') == P('x', None))."""
    def norm(p):
        t = list(p)
        while t and t[-1] is None:
            t.pop()
        return tuple(t)
    return norm(a) == norm(b)


@pytest.mark.parametrize("degrees", [(8, 1, 1), (1, 8, 1), (4, 1, 2), (1, 4, 2), (2, 2, 2), {"fsdp": 2, "context": 4}])
def test_every_leaf_is_placed_by_the_rule_table(degrees):
    cfg = load_config(None, MICRO)
    mesh = make_mesh(**degrees) if isinstance(degrees, dict) else make_mesh(*degrees)
    state = create_train_state(cfg, mesh, 500).state
    checked = 0
    for path, arr in jax.tree_util.tree_flatten_with_path(state["model"])[0]:
        name = path_str(path)
        assert arr.sharding.mesh == mesh
        assert _same_spec(arr.sharding.spec, expected_spec(name, arr.shape, mesh)), (name, arr.sharding.spec)
        checked += 1
    assert checked == 4 + 16  # wte, wpe, ln_f x2, and the blocks' 16 leaves, stacked over the 2 layers
    # AdamW: every moment leaf has exactly its parameter's sharding; the step counters are replicated.
    moments = 0
    for path, arr in jax.tree_util.tree_flatten_with_path(state["optimizer"])[0]:
        keys = path_str(path).split("/")
        if "mu" in keys or "nu" in keys:
            param_path = "/".join(keys[keys.index("mu" if "mu" in keys else "nu") + 1:])
            assert _same_spec(arr.sharding.spec, expected_spec(param_path, arr.shape, mesh)), (keys, arr.sharding.spec)
            moments += 1
        else:
            # counters, and the spike guard's window of losses and gradient norms
            assert (arr.ndim == 0 or keys[-1] in ("losses", "norms")) and arr.sharding.is_fully_replicated
    assert moments == 2 * checked


def test_rule_table_gives_megatron_and_zero3_placements():
    """Anchors the table itself, written out by hand for stage x FSDP x expert x context x TP (without a mesh the
    first rule for each name; the context and expert devices hold FSDP shards of the weights too)."""
    fc = ("fsdp", "context", "expert")
    assert logical_to_spec(("embed", "heads", "head_dim")) == P(fc, "tensor", None)  # q/k/v: column-parallel
    assert logical_to_spec(("heads", "head_dim", "embed")) == P("tensor", None, fc)  # out: row-parallel
    assert logical_to_spec(("embed", "mlp")) == P(fc, "tensor")
    assert logical_to_spec(("mlp", "embed")) == P("tensor", fc)
    assert logical_to_spec(("mlp",)) == P(("tensor", "fsdp"))  # biases are ZeRO-3 sharded too
    assert logical_to_spec(("heads", "head_dim")) == P("tensor", "fsdp")
    assert logical_to_spec(("vocab", "embed")) == P("tensor", fc)
    assert logical_to_spec(("layers", "embed", "mlp")) == P("stage", fc, "tensor")  # pipeline stages split depth
    # experts over expert first, so the expert weights' embed dimension takes the next rule
    assert logical_to_spec(("experts", "embed", "mlp")) == P("expert", ("fsdp", "context"), "tensor")
    assert logical_to_spec(("batch", "seq", "act_embed")) == P(("data", "fsdp", "expert"), "context", None)
    # On a mesh, an axis of degree 1 gives way to the next rule: the specs of a mesh without stages or experts.
    mesh = make_mesh(1, 2, 1, context=4)
    assert logical_to_spec(("batch", "kv_seq", "act_kv_heads", "head_dim"), mesh=mesh) == P(("data", "fsdp"), None,
                                                                                            "tensor", None)
    assert logical_to_spec(("layers", "embed"), mesh=mesh) == P(None, ("fsdp", "context"))
    assert logical_to_spec(("layers", "embed"), mesh=make_mesh(1, 4, 1, stage=2)) == P("stage", "fsdp")
    # A learned position table is split over context along its positions, as the tokens it is added to are (split
    # over context along embed, XLA could reshard it only by replicating it and its gradient on every device);
    # generation, whose context devices are replicas, reads it whole by position.
    assert logical_to_spec(("pos", "embed"), mesh=mesh) == P("context", "fsdp")
    assert logical_to_spec(("pos", "embed"), generation_rules(), mesh=mesh) == P(None, ("fsdp", "context"))
    # and generation keeps every sequence whole, the residual stream's too
    assert logical_to_spec(("batch", "res_seq", "act_embed"), mesh=mesh) == P(("data", "fsdp"), "context", None)
    assert logical_to_spec(("batch", "res_seq", "act_embed"), generation_rules(), mesh=mesh) == P(
        ("data", "fsdp"), None, None)
    assert batch_sharding(mesh).spec == P(("data", "fsdp"), None)  # rows of seq_len + 1
    assert batch_sharding(make_mesh(1, 2, 1, expert=4)).spec == P(("data", "fsdp", "expert"), None)
    # fsdp x context that does not divide an embed dimension gives way to fsdp alone.
    assert logical_to_spec(("embed",), shape=(12,), mesh=mesh) == P("fsdp")
    # A fallback rule that does not divide gives way; the last rule for a name is binding.
    mesh = make_mesh(1, 8, 1)
    assert logical_to_spec(("heads", "head_dim"), shape=(4, 4), mesh=mesh) == P("tensor", None)
    assert logical_to_spec(("mlp",), shape=(12,), mesh=mesh) == P("tensor")
    assert logical_to_spec(("heads", "head_dim"), shape=(4, 16), mesh=mesh) == P("tensor", "fsdp")
    with pytest.raises(ShardlmError, match="logical axis 'rows' has no rule"):
        logical_to_spec(("rows", "embed"))


def test_fsdp8_holds_an_eighth_of_the_state_per_device():
    cfg = load_config(None, MICRO)
    single = explain_state(create_train_state(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), 500).state,
                           make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    mesh = make_mesh(1, 8, 1)
    ex = explain_state(create_train_state(cfg, mesh, 500).state, mesh)
    full = single.max_param_bytes + single.max_opt_bytes
    for dev in ex.param_bytes_per_device:
        per_dev = ex.param_bytes_per_device[dev] + ex.opt_bytes_per_device[dev]
        assert per_dev <= full / 8 * 1.01, (dev, per_dev, full)
    # Pure DP splits the weights and AdamW's moments over the replicas too (ZeRO-1/2), unless told not to: then
    # each device holds the whole state.
    dp_mesh = make_mesh(8, 1, 1)
    dp = explain_state(create_train_state(cfg, dp_mesh, 500).state, dp_mesh)
    assert dp.max_param_bytes + dp.max_opt_bytes <= full / 8 * 1.01
    replicated = load_config(None, MICRO + ["train.shard_optimizer_over_data=false"])
    dp = explain_state(create_train_state(replicated, dp_mesh, 500).state, dp_mesh)
    assert dp.max_param_bytes + dp.max_opt_bytes == full


def test_tensor_parallel_splits_heads_mlp_and_vocab():
    cfg = load_config(None, MICRO)
    mesh = make_mesh(2, 1, 4)
    model_state = create_train_state(cfg, mesh, 500).state["model"]
    # (embed split over the 2 data-parallel replicas too: the training state is sharded over them)
    wq = model_state["blocks"]["attn"]["wq"][...]  # stacked over the 2 layers
    assert wq.addressable_shards[0].data.shape == (2, 32, 1, 16)  # one head of four per tensor device
    w_in = model_state["blocks"]["mlp"]["w_in"][...]
    assert w_in.addressable_shards[0].data.shape == (2, 32, 32)
    wte = model_state["wte"][...]
    assert wte.shape == (512, 64)  # 500 padded to a multiple of 64
    assert wte.addressable_shards[0].data.shape == (128, 32)


def test_indivisible_degree_fails_before_compile_naming_the_parameter():
    cfg = load_config(None, MICRO)  # 4 heads
    with pytest.raises(ShardlmError) as e:
        create_train_state(cfg, make_mesh(1, 1, 8), 500)
    msg = str(e.value)
    assert msg.startswith("parameter model/blocks/attn/")
    assert "heads' dimension (size 4) is split 8 ways over mesh.tensor" in msg
    assert "choose mesh.tensor dividing 4" in msg
    assert "\n" not in msg


def test_explain_lists_every_parameter_with_bytes():
    cfg = load_config(None, MICRO)
    mesh = make_mesh(1, 4, 2)
    ex = explain_state(create_train_state(cfg, mesh, 500).state, mesh)
    text = format_explanation(ex)
    assert len(ex.params) == 20  # the blocks' parameters stacked over the layers
    row = next(r for r in ex.params if r.path == "blocks/mlp/w_in")
    assert row.shape == (2, 64, 128) and row.spec == str(P(None, "fsdp", "tensor"))
    assert row.bytes_per_device == 2 * 64 * 128 * 4 // 8
    assert "blocks/mlp/w_in" in text and "per device:" in text
    assert ex.param_count == sum(int(np.prod(r.shape)) for r in ex.params)


def test_sharded_init_never_materialises_a_whole_parameter():
    """XLA's own memory plan for the init: each device outputs 1/8 and its scratch is smaller than one full
    copy of the largest parameter (the 4096 x 256 embedding), so no device ever holds a whole one."""
    from shardlm.train.state import compile_init

    cfg = load_config(None, ["model.n_layers=2", "model.d_model=256", "model.d_mlp=1024", "model.n_heads=8"])
    _, init, shardings = compile_init(cfg, make_mesh(1, 8, 1), 4096)
    stats = init.memory_analysis()
    state_bytes = 0
    for s in jax.tree.leaves(init.out_info):
        state_bytes += int(np.prod(s.shape)) * s.dtype.itemsize
    largest = 4096 * 256 * 4
    assert stats.output_size_in_bytes <= state_bytes / 8 * 1.01
    assert stats.temp_size_in_bytes < largest


@pytest.mark.parametrize("degrees, gathers, sharded_state", [
    ((8, 1, 1), False, False),  # DP: weights stay replicated and are never gathered; gradients are all-reduced
    ((8, 1, 1), True, True),  # DP, the state split over the replicas: weights gathered once, gradients scattered
    ((1, 8, 1), True, True),  # FSDP: weights are all-gathered for use; gradients are reduced (scattered) to shards
    ((1, 1, 4), False, True),  # TP: weights are never gathered; activations are all-reduced after row-parallel
])
def test_strategies_compile_to_their_collectives(degrees, gathers, sharded_state):
    """The compiled step's collectives are the ones each strategy is defined by (read from XLA's HLO)."""
    import re

    from shardlm.sharding import batch_sharding
    from shardlm.train.step import train_step_for

    cfg = load_config(None, MICRO + [f"train.shard_optimizer_over_data={str(sharded_state).lower()}"])
    mesh = make_mesh(*degrees, devices=jax.devices()[: int(np.prod(degrees))])
    ts = create_train_state(cfg, mesh, 500)
    bsh = batch_sharding(mesh)
    step = train_step_for(cfg, ts, mesh)
    hlo = step.lower(ts.state, jax.device_put(np.zeros((16, 33), np.int32), bsh)).compile().as_text()
    assert bool(re.search(r" all-gather(-start)?\(", hlo)) == gathers
    assert re.search(r" (all-reduce|reduce-scatter)(-start)?\(", hlo)


def test_sequence_parallelism_splits_the_residual_stream_and_keeps_the_loss():
    """`mesh.sequence_parallel`: in the blocks' forward pass each all-reduce of the tensor group becomes a
    reduce-scatter into the residual stream's sequence split and an all-gather before the next column-parallel
    layer (read from the compiled HLO), the residual stream is split along the sequence over tensor, and the step
    computes the same loss."""
    from shardlm.perf.hlo import collectives
    from shardlm.sharding import sequence_parallel_rules, use_mesh_rules
    from shardlm.sharding.rules import active_spec, as_axes
    from shardlm.train.step import train_step_for

    mesh = make_mesh(1, 2, 2, devices=jax.devices()[:4])
    batch = jax.device_put(np.arange(16 * 33, dtype=np.int32).reshape(16, 33) % 97, batch_sharding(mesh))
    losses, forward_kinds = {}, {}
    for sp in (False, True):
        cfg = load_config(None, MICRO + [f"mesh.sequence_parallel={str(sp).lower()}"])
        ts = create_train_state(cfg, mesh, 500)
        compiled = train_step_for(cfg, ts, mesh).lower(ts.state, batch).compile()
        _, metrics = compiled(ts.state, batch)
        losses[sp] = float(metrics["loss"])
        in_layers = [op for op in collectives(compiled.as_text(), 4)
                     if "jvp(" in op.op_name and "transpose" not in op.op_name and "layers" in op.op_name
                     and op.group_size == 2 and op.bytes >= 16 * 32 * 64 * 4 // 4]
        forward_kinds[sp] = sorted({op.kind for op in in_layers})
    assert forward_kinds[False] == ["all-reduce"]
    assert forward_kinds[True] == ["all-gather", "reduce-scatter"]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    live = lambda spec: tuple(tuple(a for a in as_axes(e) if mesh.shape[a] > 1) for e in spec)  # noqa: E731
    with use_mesh_rules(mesh, sequence_parallel_rules()):
        assert live(active_spec("batch", "res_seq", "act_embed", shape=(16, 32, 64))) == (("fsdp",), ("tensor",), ())
        # inside attention the sequence stays whole on the tensor group, and a decode step's one position too
        assert live(active_spec("batch", "seq", "act_heads", "head_dim", shape=(16, 32, 4, 16))) == (
            ("fsdp",), (), ("tensor",), ())
        assert live(active_spec("batch", "res_seq", "act_embed", shape=(16, 1, 64))) == (("fsdp",), (), ())
