"""A mixture of experts in shardlm's Llama (`model.moe_experts`, `mesh.expert`): expert-parallel training equal to
one device's, the all-to-alls in the compiled step, the experts' bytes per device, FLOPs that count the active
experts, a run on the default corpus, and generation on an expert mesh. The layer itself against a per-expert
loop is tests/test_moe_layer.py."""

import jax
import numpy as np
import pytest
from conftest import structured_tokens

VOCAB = 500
MOE = ["model=moe-tiny", "model.n_layers=2", "model.d_model=64", "model.d_mlp=64", "model.seq_len=32",
       "model.moe_experts=8", "model.moe_top_k=2", "train.batch_size=16", "train.steps=20", "train.warmup_steps=5",
       "train.lr=1e-2", "data.document_mask=false"]  # (synthetic streams: no documents)
_reference: dict = {}


def _train(overrides, degrees, steps):
    """(losses, metrics of the first step) of `steps` steps with the real train step on a synthetic stream."""
    from shardlm.config import load_config
    from shardlm.data.loader import BatchLoader
    from shardlm.mesh import make_mesh
    from shardlm.sharding import batch_sharding
    from shardlm.train.state import create_train_state
    from shardlm.train.step import train_step_for

    cfg = load_config(None, overrides)
    n = int(np.prod(list(degrees.values())))
    mesh = make_mesh(**{"data": 1, **degrees}, devices=jax.devices()[:n])
    ts = create_train_state(cfg, mesh, VOCAB)
    loader = BatchLoader(structured_tokens(40_000, VOCAB), cfg.model.seq_len, cfg.train.batch_size,
                         batch_sharding(mesh), seed=cfg.seed, shuffle=True)
    step = train_step_for(cfg, ts, mesh)
    losses, first = [], None
    for i in range(steps):
        ts.state, metrics = step(ts.state, loader.get(i))
        losses.append(float(metrics["loss"]))
        first = first or {k: float(v) for k, v in metrics.items()}
    return losses, first


# The expert axis beside the others (DeepSeek's sigmoid routing under expert 2 x fsdp 2 x tensor 2:
# test_family_parity). Expert 4 and 8 run the same dispatch: tests/test_moe_layer.py holds the layer to one device
# under both, and test_the_compiled_step_dispatches_by_all_to_all_and_splits_the_experts reads ep4's compiled step.
@pytest.mark.parametrize("degrees", [{"expert": 2, "fsdp": 2, "tensor": 2}], ids=["ep2 x fsdp2 x tp2"])
def test_expert_parallel_training_matches_one_device(degrees):
    if "one" not in _reference:
        _reference["one"] = _train(MOE, {}, 20)
    ref_losses, ref_first = _reference["one"]
    losses, first = _train(MOE, degrees, 20)
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-5)
    assert first["grad_norm"] == pytest.approx(ref_first["grad_norm"], rel=1e-5)
    assert first["aux_loss"] == pytest.approx(ref_first["aux_loss"], rel=1e-5)  # the load-balancing loss too
    assert losses[-1] == pytest.approx(ref_losses[-1], rel=1e-3)
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("dispatch", [[], ["model.moe_capacity_factor=2.0", "model.pipeline_schedule=1f1b"]],
                         ids=["dropless", "capacity, no drops, 1F1B"])
def test_experts_with_pipeline_stages_train_like_the_same_pipeline_without_an_expert_split(dispatch):
    """stage 2 x fsdp 2 x expert 2 against stage 2 x fsdp 2 (expert 1, GPipe): the same microbatches and
    data-parallel replicas, so the same per-microbatch load-balancing loss (a pipeline's aux loss is the
    microbatches' mean, as gradient accumulation's is), with the experts split over `expert` inside each stage.
    The second case runs the 1F1B schedule, whose loop takes the load-balancing loss's gradient itself: the same
    gradient norm says it did."""
    if "pipeline" not in _reference:
        _reference["pipeline"] = _train(MOE, {"stage": 2, "fsdp": 2}, 20)
    ref_losses, ref_first = _reference["pipeline"]
    losses, first = _train(MOE + dispatch, {"stage": 2, "fsdp": 2, "expert": 2}, 20)
    for key in ("loss", "grad_norm", "aux_loss"):
        assert first[key] == pytest.approx(ref_first[key], rel=1e-5), key
    assert first["moe_dropped"] == 0.0
    assert losses[-1] == pytest.approx(ref_losses[-1], rel=1e-3)
    assert losses[-1] < losses[0] - 0.5


def test_the_compiled_step_dispatches_by_all_to_all_and_splits_the_experts():
    """ep4 x fsdp2: each MoE layer's forward sends tokens to their experts and back (all-to-alls over the expert
    groups, once per layer of the scan) and its backward does the same for the gradients; each device holds 1/4
    of the experts (and half of those over fsdp)."""
    from shardlm.config import load_config
    from shardlm.mesh import make_mesh
    from shardlm.perf import hlo
    from shardlm.train.state import TrainState, abstract_train_state
    from shardlm.train.step import batch_struct, train_step_for

    cfg = load_config(None, MOE)
    mesh = make_mesh(1, 2, 1, expert=4)
    _, graphdef, abstract, shardings = abstract_train_state(cfg, mesh, VOCAB)
    compiled = train_step_for(cfg, TrainState(graphdef, abstract, shardings), mesh).lower(
        abstract, batch_struct(cfg, mesh)).compile()
    ops = hlo.collectives(compiled.as_text(), 8)
    expert_of = lambda p: np.unravel_index(p, mesh.devices.shape)[3]  # noqa: E731  (stage, data, fsdp, expert, ..)
    a2a = [o for o in ops if o.kind == "all-to-all" and o.group_size == 4]
    assert all(len({expert_of(p) for p in g}) == 4 for o in a2a for g in o.groups)  # over the expert axis
    per_layer = [o for o in a2a if o.times == cfg.model.n_layers]  # inside the scan over the layers
    assert len(per_layer) >= 2 * 2  # forward: there and back; backward: there and back
    w = abstract["model"]["blocks"]["mlp"]["w_gate"]
    layers, experts, d, f = w.shape
    assert w.sharding.shard_shape(w.shape) == (layers, experts // 4, d // 2, f)


def test_flops_count_the_active_experts():
    """An MoE model and a dense one with the same active parameters per token (top-2 of experts of width f, and a
    dense SwiGLU of width 2f) count the same FLOPs per token, but for the router's few."""
    from shardlm.config import load_config
    from shardlm.flops import flops_per_token

    moe = load_config(None, MOE).model
    dense = load_config(None, MOE + ["model.moe_experts=0", "model.d_mlp=128"]).model
    f_moe, f_dense = flops_per_token(moe, 512), flops_per_token(dense, 512)
    router = 6 * moe.n_layers * moe.d_model * moe.moe_experts
    assert f_moe == f_dense + router
    total_experts = load_config(None, MOE + ["model.moe_top_k=8"]).model  # every expert active: 4x the MLP FLOPs
    assert flops_per_token(total_experts, 512) > 1.5 * f_moe


def test_the_pruning_bound_stays_below_the_compiled_estimates_of_expert_splits():
    """`shardlm plan` skips a strategy whose lower bound exceeds the best estimate: for experts split over `expert`
    and stored over fsdp x context, on one host and across hosts, the bound never exceeds a compiled estimate."""
    from shardlm.config import load_config
    from shardlm.perf.bounds import lower_bound
    from shardlm.perf.costmodel import Hardware
    from shardlm.perf.planner import _padded_vocab, _param_count, plan
    from shardlm.perf.strategies import parse_strategies
    from shardlm.train.source import model_flops_per_step

    # wide experts, whose traffic dominates the step's
    cfg = load_config(None, MOE + [f"model.vocab_size={VOCAB}", "model.moe_d_ff=1024"])
    compiled = plan(cfg, 8, strategies=parse_strategies("ep2+fsdp2+cp2,dp2+ep2+cp2,ep4+fsdp2,ep2+fsdp2+tp2", 8))
    count = _param_count(cfg, VOCAB)
    for per_host in (8, 4, 2):
        p = compiled.rerank(Hardware(devices_per_node=per_host, inter_node_bw=6.25e9))
        for r in p.strategies:
            bound = lower_bound(cfg, r.strategy, p.hardware,
                                model_flops_per_step(cfg, VOCAB, r.strategy.tensor), count,
                                padded_vocab=_padded_vocab(cfg, VOCAB, r.strategy.tensor), platform="cpu")
            # a bound without the margin: experts stored over context too were once charged context times
            # their data-parallel traffic, 1.1x the estimate at 4 devices a host (the margin hid it)
            assert bound.step_s <= r.est.step_s, (per_host, r.strategy.name, bound, r.est.step_s)


def test_moe_tiny_trains_on_the_default_corpus_and_generates_on_an_expert_mesh(tmp_path):
    import json

    from shardlm.config import load_config
    from shardlm.load import load_model
    from shardlm.sampling import Sampling
    from shardlm.train.loop import train

    run_dir = tmp_path / "run"
    cfg = load_config(None, ["model=moe-tiny", "model.n_layers=2", "model.seq_len=64", "train.steps=24",
                             "train.batch_size=16", "train.eval_interval=24", "train.eval_batches=2",
                             "train.log_interval=10", "train.sample_tokens=0", "mesh.expert=4", "mesh.fsdp=2"])
    train(cfg, run_dir, progress=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < evals[0] - 1.0  # it learns
    logged = [r for r in rows if "aux_loss" in r]
    assert logged and all(0.9 < r["aux_loss"] < 4 and r["expert_load_min"] <= 1 <= r["expert_load_max"]
                          and r["moe_dropped"] == 0.0 for r in logged)  # dropless: nothing dropped, and said so
    # Greedy tokens from the checkpoint: the same on one device and on an expert x fsdp mesh.
    tokens = {}
    for name, overrides, devices in (("one", ["mesh.expert=1", "mesh.fsdp=1"], 1), ("ep4 x fsdp2", [], 8)):
        loaded = load_model(run_dir, overrides=overrides, devices=jax.devices()[:devices])
        prompt = loaded.tokenizer.encode("ROMEO:")
        gen = loaded.generator(max_batch=8)
        tokens[name] = gen.generate([prompt, prompt[:3]], 12, Sampling(temperature=0.0))
    assert [c.ids for c in tokens["one"]] == [c.ids for c in tokens["ep4 x fsdp2"]]
    assert all(len(c.ids) > 0 for c in tokens["one"])


def test_dense_and_sparse_layers_mixed_checkpoint_per_layer_and_resume(tmp_path):
    """`model.moe_every=2`: its layers differ (every other one a mixture), so they cannot stack into the stored
    layout. The checkpoint keeps them per layer, as held (saving once crashed stacking them, after the run directory
    was written), and the run resumes from it. Routed by sigmoid with a bias rate (Qwen3-MoE-style aux-free
    balancing in a Llama block), the sparse layer's bias moves from its own loads: after 2 steps each expert's is
    a sum of two steps of +-rate or 0, and not all zero (benchmarks/balance.py --model qwen3-moe-tiny: toward
    balance over 200 steps)."""
    from shardlm.checkpoint import RunCheckpoints
    from shardlm.config import load_config
    from shardlm.train.loop import train

    run_dir = tmp_path / "run"
    rate = 1e-2
    overrides = MOE[:5] + ["model.moe_every=2", "model.scan_layers=false", "model.n_layers=2", "train.batch_size=4",
                           "train.sample_tokens=0", "train.eval_batches=1", "checkpoint.every=1",
                           "data.tokenizer=bytes", "model.moe_router=sigmoid", f"model.moe_bias_rate={rate}"]
    one = jax.devices()[:1]
    first = train(load_config(None, overrides + ["train.steps=2"]), run_dir, progress=False, devices=one)
    reader = RunCheckpoints(run_dir, read_only=True)
    one_device = jax.sharding.SingleDeviceSharding(one[0])
    stored = reader.restore_trees(2, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype,
                                                                                 sharding=one_device),
                                                  reader.stored_tree(2)))[0]["blocks"]
    reader.close()
    assert sorted(map(str, stored)) == ["0", "1"] and "router" in stored["1"]["mlp"] and "router" not in \
        stored["0"]["mlp"]
    bias = np.asarray(stored["1"]["mlp"]["router_bias"]) / rate
    assert np.abs(bias).max() > 0 and np.allclose(bias, np.round(bias), atol=1e-4) and np.abs(bias).max() <= 2
    resumed = train(load_config(None, overrides + ["train.steps=3"]), run_dir, progress=False, devices=one)
    assert first["finished"] and resumed["resumed_from"] == 2 and np.isfinite(resumed["final_loss"])
