"""`shardlm plan / bench / profile`: memory, collectives and FLOPs read from compiled steps, the cost model, and the
commands. The compiled-program facts are checked against what the strategies must do (FSDP holds 1/8 of the state,
DP all-reduces exactly the gradients, Megatron TP's MLP needs one all-reduce)."""

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlm.config import load_config
from shardlm.perf import hlo
from shardlm.perf.costmodel import Hardware, estimate, issued, split_traffic, traffic_factor
from shardlm.perf.planner import _lower, plan
from shardlm.perf.strategies import Strategy, all_strategies, parse_strategies, parse_strategy
from shardlm.units import parse_rate

from conftest import MICRO
from test_cli import assert_one_line_error, shardlm

VOCAB = 512


# Data parallelism as replicas that each hold the whole state: what these tests read of DP is its gradient
# all-reduce (the state sharded over the replicas, the default, is `test_sharding`'s and `test_parity`'s).
REPLICATED = "train.shard_optimizer_over_data=false"


@pytest.fixture(scope="module")
def plan8():
    # The blocks as one module per layer: what these tests read is how XLA treats each layer's collectives.
    cfg = load_config(None, MICRO + [f"model.vocab_size={VOCAB}", "model.scan_layers=false", REPLICATED])
    return plan(cfg, 8)


def by_name(p, name):
    return next(r for r in p.strategies if r.strategy.name == name)


def kind_bytes(r, kind):
    return sum(c["bytes"] for c in hlo.summarize(r.collectives) if c["kind"] == kind)


def test_plan_enumerates_every_split_the_model_allows(plan8):
    names = {r.strategy.name for r in plan8.strategies}
    # 4 heads: tensor 8 cannot split them; every other (data, fsdp, tensor) with product 8 can.
    expected = {s.name for s in all_strategies(8) if s.tensor <= 4}
    assert names == expected and len(names) == 9
    assert [s.name for s, _ in plan8.rejected] == ["tp8"]
    assert "split 8 ways over mesh.tensor" in plan8.rejected[0][1]
    assert [r.rank for r in plan8.strategies] == list(range(1, 10))
    fitting = [r.est.step_s for r in plan8.strategies if r.fits]
    assert fitting == sorted(fitting)


def test_fsdp8_holds_an_eighth_of_dp8s_parameters_and_optimizer_state(plan8):
    dp, fsdp = by_name(plan8, "dp8"), by_name(plan8, "fsdp8")
    ratio = (fsdp.params + fsdp.optimizer) / (dp.params + dp.optimizer)
    assert abs(ratio - 1 / 8) / (1 / 8) < 0.02, ratio
    assert dp.params == plan8.param_count * 4  # float32, replicated
    # the compiled peak holds at least the state, and the analysis saw temporaries (activations, gradients)
    for r in (dp, fsdp):
        assert r.peak >= r.params + r.optimizer and r.temporaries > 0
    # every row adds up as the table's footer says, its MFU is a possible one, and its compile replicated nothing
    for r in plan8.strategies:
        assert r.peak == r.params + r.optimizer + r.temporaries >= r.temporaries and r.compiler_temps > 0
        assert 0 < r.mfu(r.est.step_s, plan8.hardware) <= 1 and not r.impossible_mfus(plan8.hardware)
        assert r.rematerialisations == [] and r.to_dict(plan8.hardware)["rematerialisations"] == []


def test_dp_all_reduces_exactly_the_gradients(plan8):
    dp = by_name(plan8, "dp8")
    grad_bytes = plan8.param_count * 4
    assert {c["kind"] for c in hlo.summarize(dp.collectives)} == {"all-reduce"}
    assert abs(kind_bytes(dp, "all-reduce") - grad_bytes) / grad_bytes < 0.05


def test_tied_embedding_gradients_are_one_all_reduce_as_on_accelerators():
    """XLA:CPU all-reduces the tied embedding's two gradients (lookup, output head) separately and adds them;
    XLA:GPU/TPU reassociate that into one all-reduce of the sum, and so does the count."""
    cfg = load_config(None, MICRO + [f"model.vocab_size={VOCAB}", REPLICATED])
    lowered, *_ = _lower(cfg, Strategy(8, 1, 1), VOCAB, jax.devices())
    text = lowered.compile().as_text()
    raw = sum(op.bytes for op in hlo.collectives(text, 8, as_accelerators_run=False))
    counted = sum(op.bytes for op in hlo.collectives(text, 8))
    assert raw - counted == VOCAB * cfg.model.d_model * 4  # one copy of the embedding table's gradient


def test_fsdp_reduce_scatters_gradients_and_gathers_weights(plan8):
    """The gradients are constrained to the parameters' shardings, so FSDP sends each gradient once as a
    reduce-scatter (not a full all-reduce), and gathers every weight for the forward and backward."""
    fsdp = by_name(plan8, "fsdp8")
    grad_bytes = plan8.param_count * 4
    assert abs(kind_bytes(fsdp, "reduce-scatter") - grad_bytes) / grad_bytes < 0.05
    assert kind_bytes(fsdp, "all-reduce") < 0.01 * grad_bytes  # scalars only (the gradient norm's partial sums)
    assert kind_bytes(fsdp, "all-gather") >= grad_bytes
    assert all(op.group_size == 8 for op in fsdp.collectives)


def test_latency_counts_combinable_collectives_once(plan8):
    """Independent collectives (FSDP's weight gathers, its gradient reduce-scatters) are one issue each once XLA:GPU
    combines them; tensor parallelism's activation all-reduces depend on one another and are issued one by one."""
    n_layers = load_config(None, MICRO).model.n_layers
    fsdp, tp = by_name(plan8, "fsdp8"), by_name(plan8, "dp2+tp4")
    assert len(fsdp.collectives) > 10 * n_layers
    # Every weight gather, and every gradient reduce-scatter, is one issue; besides them the step issues only the
    # loss's and the norm's scalar all-reduces and the embedding lookup's two all-to-alls (the rows from the
    # table's split to the batch's, their gradients back into the shards).
    assert issued([op for op in fsdp.collectives if op.kind in ("all-gather", "reduce-scatter")]) == 2
    assert issued(fsdp.collectives) <= 6
    assert issued(tp.collectives) >= 4 * n_layers  # two per layer forward, two backward, in sequence
    assert by_name(plan8, "dp8").to_dict()["issued_collectives"] == 1


def test_flops_and_estimate_are_consistent(plan8):
    hw = plan8.hardware
    for r in plan8.strategies:
        # the compiled step does at least the model's FLOPs, and not wildly more (recompute, repeated norms)
        assert 0.9 * r.model_flops < r.flops < 1.6 * r.model_flops, (r.strategy.name, r.flops, r.model_flops)
        # every kernel at or below the peak; the kernels' time is what its kinds add up to
        assert r.est.compute_s >= r.flops_per_device / hw.peak_flops
        assert r.est.compute_s == pytest.approx(sum(r.est.by_kind.values()))
        assert r.est.comm_s > 0  # XLA:CPU's collectives are synchronous: none hidden
        assert r.est.comm_total_s == pytest.approx(r.est.comm_s)
    assert by_name(plan8, "dp8").to_dict()["est_step_s"] > 0


def test_rank_follows_memory_and_hardware(plan8):
    from shardlm.perf.planner import recommendation

    smallest = min(r.peak for r in plan8.strategies)
    tight = plan8.rerank(Hardware(memory_bytes=smallest))
    assert tight.best is not None and tight.best.peak == smallest
    assert [r.fits for r in tight.strategies] == sorted((r.fits for r in tight.strategies), reverse=True)
    assert plan8.best is not None and plan8.best.fits  # the plan itself is left as it was
    assert recommendation(tight).startswith(f"recommended: {tight.best.strategy.name}")
    none_fit = plan8.rerank(Hardware(memory_bytes=1))
    assert none_fit.best is None and not any(r.fits for r in none_fit.strategies)
    assert [r.peak for r in none_fit.strategies] == sorted(r.peak for r in none_fit.strategies)
    assert recommendation(none_fit).startswith("no strategy fits")
    assert all(r.fits for r in plan8.strategies)  # MICRO fits in 80 GB: reranking did not touch plan8


def test_plan_for_one_device():
    cfg = load_config(None, MICRO + [f"model.vocab_size={VOCAB}"])
    p1 = plan(cfg, 1)
    (single,) = p1.strategies
    assert single.strategy.name == "single" and single.collectives == [] and single.est.comm_s == 0
    assert single.params == 4 * p1.param_count and single.optimizer >= 2 * single.params  # AdamW: mu and nu
    assert single.peak >= single.params + single.optimizer + single.gradients  # gradients live in temporaries


def test_tp_mlp_forward_is_one_all_reduce():
    """Seed 000's Megatron MLP: column-parallel in, row-parallel out, x replicated over tensor: the forward needs
    exactly one all-reduce (or an all-gather + reduce-scatter pair) over the tensor group, of the block's output."""
    from shardlm.mesh import make_mesh
    from shardlm.models.gpt import MLP
    from shardlm.sharding import constrain, state_shardings, use_mesh_rules

    cfg = load_config(None, MICRO).model
    mesh = make_mesh(2, 1, 4)
    with nnx.use_eager_sharding(False):  # the rule table places parameters, as in `train.state`
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MLP(cfg, nnx.Rngs(0))))
        shardings = state_shardings(abstract, mesh)
        state = jax.jit(lambda: nnx.state(MLP(cfg, nnx.Rngs(0))), out_shardings=shardings)()
    x_sharding = NamedSharding(mesh, P(("data", "fsdp"), None, None))
    x = jax.device_put(jnp.ones((8, cfg.seq_len, cfg.d_model)), x_sharding)

    def forward(state, x):
        with use_mesh_rules(mesh):
            return constrain(nnx.merge(graphdef, state)(x), "batch", "seq", "act_embed")

    compiled = jax.jit(forward, out_shardings=x_sharding).lower(state, x).compile()
    output_bytes = 4 * cfg.seq_len * cfg.d_model * 4  # this device's 4 rows of the block's output, float32
    for emulate in (False, True):
        ops = hlo.collectives(compiled.as_text(), mesh.size, as_accelerators_run=emulate)
        kinds = sorted(op.kind for op in ops)
        assert kinds in (["all-reduce"], ["all-gather", "reduce-scatter"]), kinds
        assert all(op.groups == [[0, 1, 2, 3], [4, 5, 6, 7]] for op in ops)  # the tensor groups
        # an all-reduce of the output, or a reduce-scatter of it and an all-gather of the scattered result
        assert all(op.bytes == output_bytes for op in ops), [(op.kind, op.bytes) for op in ops]


def test_collectives_inside_a_loop_count_once_per_iteration():
    from shardlm.mesh import make_mesh

    mesh = make_mesh(8, 1, 1)
    spec = NamedSharding(mesh, P("data"))

    def f(x):
        def body(carry, _):
            return carry + jax.lax.with_sharding_constraint(carry.sum(0, keepdims=True), NamedSharding(mesh, P())), None

        return jax.lax.scan(body, x, None, length=5)[0]

    compiled = jax.jit(f, in_shardings=spec, out_shardings=spec).lower(jnp.ones((8, 16))).compile()
    (c,) = hlo.summarize(hlo.collectives(compiled.as_text(), 8))
    assert c["kind"] == "all-reduce" and c["count"] == 5 and c["bytes"] == 5 * 16 * 4


def test_a_plan_costs_xla_cpus_default_program_whatever_xla_flags_asks():
    """What a plan compiles on the CPU to cost keeps an embedding's scatter-add a scatter (XLA:CPU's fusion
    emitters, its default), even where XLA_FLAGS picks the older LLVM IR emitters, which turn it into a loop of a
    trip per token (this session's flags do, on the jaxlib that has them: conftest.py)."""
    from shardlm.perf.compiled import compile_step, compile_with

    def embedding_grad(table, ids):
        return jax.grad(lambda t: jnp.sum(t[ids] ** 2))(table)

    lowered = jax.jit(embedding_grad).lower(jnp.ones((64, 8)), jnp.arange(256) % 64)
    costed = compile_step(lowered, 1, keep_hlo=True).hlo_text
    assert "scatter(" in costed and " while(" not in costed
    if "--xla_cpu_use_fusion_emitters=false" in os.environ["XLA_FLAGS"]:
        assert " while(" in lowered.compile().as_text()  # what the session's own compiles make of it
    # The options are preferences: one this XLA does not know is left out (what it chose is then the only
    # behaviour), options it refuses otherwise give way to the environment's flags, and a program that fails to
    # compile either way raises its own failure.
    assert compile_with(lowered, {"xla_cpu_no_such_option": True, "xla_cpu_use_fusion_emitters": True}).as_text() \
        == costed
    assert compile_with(lowered, {"xla_cpu_use_fusion_emitters": "sometimes"}).as_text() == \
        lowered.compile().as_text()
    unregistered = jax.ffi.ffi_call("shardlm_no_such_kernel", jax.ShapeDtypeStruct((3,), jnp.float32))
    with pytest.raises(Exception, match="No FFI handler registered for shardlm_no_such_kernel"):
        compile_with(jax.jit(unregistered).lower(), {"xla_cpu_use_fusion_emitters": True})


@pytest.mark.parametrize("attrs, groups", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups={}, to_apply=%add", [list(range(8))]),
    ("replica_groups=[4,2]<=[8], dimensions={0}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true",
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("source_target_pairs={{0,1},{1,0}}, channel_id=1", [[0, 1], [1, 0]]),
])
def test_replica_group_spellings(attrs, groups):
    assert hlo.parse_groups(attrs, 8) == groups


SYNTHETIC = """HloModule m

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[16,8], q: f32[16,8]) -> f32[16,8] {
  %p = f32[16,8]{1,0} parameter(0)
  %q = f32[16,8]{1,0} parameter(1)
  %a = f32[16,8]{1,0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %e = f32[16,8]{1,0} exponential(%SOURCE)
  %b = f32[16,8]{1,0} all-reduce(%e), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %r = f32[2,8]{1,0} reduce-scatter(%q), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%sum
  ROOT %c = f32[16,8]{1,0} add(%a, %b)
}
"""


@pytest.mark.parametrize("source, all_reduced", [("q", 512), ("a", 1024)])
def test_all_reduces_are_reassociated_only_when_the_add_is_their_only_use(source, all_reduced):
    """add(all-reduce(p), all-reduce(exp(q))) is one all-reduce of a sum; with b = all-reduce(exp(a)) the first
    all-reduce has another use, and both are sent."""
    ops = hlo.collectives(SYNTHETIC.replace("SOURCE", source), 8)
    assert kind_bytes_of(ops, "all-reduce") == all_reduced
    assert kind_bytes_of(ops, "reduce-scatter") == 16 * 8 * 4  # a real reduce-scatter counts its whole operand
    assert [op.level for op in ops if op.kind == "all-reduce"] == ([0] if source == "q" else [0, 1])


def kind_bytes_of(ops, kind):
    return sum(op.bytes for op in ops if op.kind == kind)


def test_unknown_groups_cost_the_whole_mesh():
    op = hlo.CollectiveOp("all-reduce", "x", 1_000_000, None)
    est = estimate(0.0, [op], 8, Hardware(intra_node_bw=1e9, latency_s=0, devices_per_node=8))
    assert est.traffic_bytes == pytest.approx(2 * 7 / 8 * 1e6) and est.comm_s == pytest.approx(1.75e-3)


def test_bytes_of_hlo_shapes():
    assert hlo.array_bytes("f32[4,32]{1,0}") == 512
    assert hlo.array_bytes("(f32[], bf16[8]{0}, /*index=2*/s32[2,3]{1,0})") == 4 + 16 + 24
    assert hlo.array_bytes("pred[10]") == 10


def test_cost_model_by_hand():
    hw = Hardware(peak_flops=1e12, intra_node_bw=100e9, inter_node_bw=10e9, devices_per_node=4, latency_s=1e-5)
    within = hlo.CollectiveOp("all-reduce", "a", 1_000_000, [[0, 1, 2, 3], [4, 5, 6, 7]])
    across = hlo.CollectiveOp("all-gather", "b", 1_000_000, [[0, 4], [1, 5], [2, 6], [3, 7]], times=2)
    est = estimate(2e9, [within, across], 8, hw)
    assert est.compute_s == pytest.approx(2e-3)
    sent_within = 2 * 3 / 4 * 1e6
    sent_across = 2 * (1 / 2 * 1e6)
    assert est.comm_s == pytest.approx(sent_within / 100e9 + 1e-5 + sent_across / 10e9 + 2e-5)
    assert est.traffic_bytes == pytest.approx(sent_within + sent_across)
    assert est.inter_node_bytes == pytest.approx(sent_across)
    assert traffic_factor("reduce-scatter", 8) == pytest.approx(7 / 8) and traffic_factor("all-reduce", 1) == 0


def test_strategy_names_round_trip():
    for n in (1, 8, 12):
        for s in all_strategies(n):
            assert parse_strategy(s.name, n) == s
            assert math.prod(s.mesh.values()) == n
    assert parse_strategy("fsdp+tp2", 8) == Strategy(1, 4, 2)
    assert parse_strategy("2x2x2", 8) == Strategy(2, 2, 2)
    assert parse_strategy("data4+tensor2", 8) == Strategy(4, 1, 2)
    assert parse_strategies("dp8, fsdp8,dp8", 8) == [Strategy(8, 1, 1), Strategy(1, 8, 1)]


@pytest.mark.parametrize("text, fragment", [("dp3", "uses 3 devices but 8"), ("qq8", "not understood"),
                                            ("dp+fsdp", "at most one degree may be -1"), ("tp0", "degree of 0")])
def test_bad_strategy_names(text, fragment):
    from shardlm.errors import ShardlmError

    with pytest.raises(ShardlmError, match=fragment):
        parse_strategy(text, 8)


def test_across_hosts_dp_sends_exactly_its_gradient_all_reduce_and_tp_inside_hosts_sends_nothing(plan8):
    """The same compiled programs, ranked for 2 hosts of 4 devices (`--hosts 2`): dp2+tp4 keeps each tensor group
    inside a host, and the one collective that crosses is the data-parallel all-reduce of the gradients."""
    two_hosts = plan8.rerank(Hardware(devices_per_node=4))
    dp_tp = by_name(two_hosts, "dp2+tp4")
    crossing = dp_tp.cross_host(two_hosts.hardware)
    assert [c["kind"] for c in crossing] == ["all-reduce"] and crossing[0]["count"] == 1
    # the gradients, each device's tensor shard of them (plus the 4-byte loss): the all-reduce between the two
    # devices that hold the same shard on either host sends its whole buffer across
    assert crossing[0]["bytes"] == dp_tp.gradients + 4 and crossing[0]["sent_per_device"] == crossing[0]["bytes"]
    assert dp_tp.est.inter_node_bytes == crossing[0]["bytes"]
    tensor_ops = [op for op in dp_tp.collectives if op.groups and op.group_size == 4]
    assert len(tensor_ops) >= 4 * 2  # the Megatron all-reduces, two per layer each way
    assert all(split_traffic(op, 4, 8)[1] == 0 for op in tensor_ops)
    # the same strategy on hosts of 2 devices: now every tensor group spans two hosts, and its traffic crosses
    small_hosts = plan8.rerank(Hardware(devices_per_node=2))
    assert by_name(small_hosts, "dp2+tp4").est.inter_node_bytes > 2 * crossing[0]["bytes"]
    # on one host nothing crosses
    assert all(r.est.inter_node_bytes == 0 and not r.cross_host(plan8.hardware) for r in plan8.strategies)


def test_two_level_traffic_across_hosts():
    """A group of m devices on each of h hosts: what one device sends within its host and to the others."""
    ar = hlo.CollectiveOp("all-reduce", "a", 1_000_000, [list(range(16))])
    within, across = split_traffic(ar, 8, 16)  # 8 per host, 2 hosts
    assert within == pytest.approx(2 * 7 / 8 * 1e6) and across == pytest.approx(2 * (1 / 2) * 1e6 / 8)
    assert within + across == pytest.approx(traffic_factor("all-reduce", 16) * 1e6)  # a ring's total
    a2a = hlo.CollectiveOp("all-to-all", "b", 800, [list(range(8))])
    assert split_traffic(a2a, 4, 8) == (pytest.approx(300), pytest.approx(400))
    permute = hlo.CollectiveOp("collective-permute", "c", 100, [[0, 1], [3, 4]])
    assert split_traffic(permute, 4, 8) == (0.0, 100.0)
    assert parse_rate("400Gb/s") == 50e9 and parse_rate("3.2 Tbps") == 400e9 and parse_rate("50GB/s") == 50e9
    with pytest.raises(ValueError, match="not a rate"):
        parse_rate("400")


def test_plan_cli_simulates_more_devices_than_the_host_and_emits_json():
    """16 devices from a process of its own (this one has 8), on 2 hosts; the JSON the issue asks for. Four chosen
    strategies (what plan enumerates is `test_plan_enumerates_every_split_the_model_allows`'s)."""
    proc = shardlm("plan", "--devices", "16", "--hosts", "2", "--inter-host-bandwidth", "400Gb/s", "--json",
                   "--memory", "2GB", "--strategies", "dp16,fsdp16,dp4+tp4,pp2+fsdp8", *MICRO,
                   f"model.vocab_size={VOCAB}")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {math.prod(r["mesh"].values()) for r in rows} == {16} and len(rows) == 4
    for r in rows:
        assert set(r) >= {"mesh", "bytes_per_device", "collectives", "flops", "fits", "est_step_s"}
        assert set(r["bytes_per_device"]) >= {"params", "optimizer", "total"}
        assert r["fits"] is True and r["est_step_s"] > 0 and r["flops"] > 0
        # the step: its kernels (by kind) and the collectives XLA:CPU runs unhidden
        assert r["est_step_s"] == pytest.approx(sum(r["est_kernels_s"].values()) + r["est_comm_s"])
        assert r["est_kernels_s"]["gemm"] > 0 and r["est_comm_total_s"] == pytest.approx(r["est_comm_s"])
        assert all(set(c) == {"kind", "count", "bytes"} for c in r["collectives"])
    fsdp16 = next(r for r in rows if r["mesh"] == {"stage": 1, "data": 1, "fsdp": 16, "expert": 1, "context": 1, "tensor": 1})
    dp16 = next(r for r in rows if r["mesh"] == {"stage": 1, "data": 16, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1})
    # data parallelism's replicas each store a sixteenth of the state, as FSDP does (`train.shard_optimizer_over_data`)
    assert dp16["bytes_per_device"]["params"] == fsdp16["bytes_per_device"]["params"]
    gathered = {r["name"]: {c["kind"]: c["bytes"] for c in r["collectives"]}["all-gather"] for r in (dp16, fsdp16)}
    assert gathered["dp16"] < 0.7 * gathered["fsdp16"]  # weights gathered once per step, not per use
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    assert f"planned {len(rows)} strategies" in proc.stderr
    assert_progress_counts_to(proc.stderr, 4)
    for r in rows:  # each row adds up (peak = params + optimizer + temps), and no MFU is above 100%
        b = r["bytes_per_device"]
        assert b["peak"] == b["params"] + b["optimizer"] + b["temporaries"] >= b["temporaries"] > 0
        assert 0 < r["est_mfu"] <= 1 and r["compiler_mfu"] is None and r["rematerialisations"] == []
    # a pipeline's two stages are the two hosts: its hand-offs cross between them, and it says so
    pp = next(r for r in rows if r["mesh"]["stage"] == 2)
    assert "collective-permute" in [c["kind"] for c in pp["cross_host_collectives"]]
    # 2 hosts of 8 at 400 Gb/s (6.25 GB/s per device): every strategy sends something across, and says what
    for r in rows:
        assert r["inter_node_bytes_per_device"] == sum(c["sent_per_device"] for c in r["cross_host_collectives"]) > 0
    tp4 = next(r for r in rows if r["mesh"] == {"stage": 1, "data": 4, "fsdp": 1, "expert": 1, "context": 1, "tensor": 4})
    # TP's activation all-reduces stay inside the hosts: across them go the data-parallel state's gathers and
    # reduce-scatters, the embedding rows' all-to-alls and scalars
    cross = {c["kind"]: c["bytes"] for c in tp4["cross_host_collectives"]}
    assert set(cross) == {"all-reduce", "all-gather", "reduce-scatter", "all-to-all"} and cross["all-reduce"] < 1024


def assert_progress_counts_to(stderr: str, total: int) -> list[str]:
    """A plan's progress lines ("[3/57] fsdp8: compiled in 2.1 s; 54 to go, about 6 min 20 s left"): one per
    candidate, counted 1, 2, ... against a total that never changes, each but the last saying how many are left
    and how long they will take at the pace so far. Returns them."""
    import re

    lines = [line for line in stderr.splitlines() if re.match(r"\[\d+/\d+\] ", line)]
    counts = [tuple(map(int, re.match(r"\[(\d+)/(\d+)\]", line).groups())) for line in lines]
    assert counts == [(i, total) for i in range(1, total + 1)], lines
    for i, line in enumerate(lines[:-1], 1):
        assert re.search(rf"; {total - i} to go, about (\d+ s|\d+ min \d\d s) left$", line), line
    assert " to go" not in lines[-1], lines[-1]
    return lines


def test_progress_counts_pruned_candidates_against_a_total_fixed_from_the_start(monkeypatch):
    """Candidates pruned while others compile (here: every one after the first, whatever their bounds) are counted
    as they are decided, against all of them: the total never shrinks (it read [1/3], then [2/2])."""
    from shardlm.perf import planner

    asked = []

    def prune_after_the_first(*_):
        asked.append(None)
        return "pruned by the test" if len(asked) > 1 else None

    monkeypatch.setattr(planner, "_pruning", prune_after_the_first)
    cfg = load_config(None, MICRO + [f"model.vocab_size={VOCAB}"])
    lines = []
    p = plan(cfg, 2, log=lines.append)
    candidates = len(p.strategies) + len(p.pruned)
    assert len(p.strategies) == 1 and candidates == 3, lines
    progress = assert_progress_counts_to("\n".join(lines), candidates)
    assert sum("pruned, not compiled: pruned by the test" in line for line in progress) == 2, progress


def test_a_budget_stops_starting_compiles_and_says_what_it_did_not_reach():
    """`--budget`: once it has run out (here at once) and one candidate has been started, the rest are not
    compiled, each listed as pruned with the budget as the reason, counted in the progress lines as any other."""
    cfg = load_config(None, MICRO + [f"model.vocab_size={VOCAB}"])
    lines = []
    p = plan(cfg, 2, log=lines.append, budget_s=1e-9)
    assert len(p.strategies) == 1 and len(p.pruned) == 2, lines
    assert all(why == "not compiled: the --budget of 0 s ran out" for _, why in p.pruned), p.pruned
    assert_progress_counts_to("\n".join(lines), 3)
    assert sum("--budget" in r.get("pruned", "") for r in p.to_list()) == 2  # in the JSON too


def test_the_lowering_runs_at_most_one_candidate_ahead_of_the_compiles(monkeypatch):
    """A budget must stop within a compile's time: the main thread lowers the next candidate while the workers
    compile, never more than one ahead (it once lowered every candidate into the queue, and a 2-minute budget on
    a Mixtral plan ran 6 minutes). Each compile is held back here, so that an unbounded lowering would race
    ahead."""
    from shardlm.perf import planner

    in_flight, most = [0], [0]
    lower, compile_step = planner._lower, planner.compile_step

    def counted_lower(*args, **kwargs):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        return lower(*args, **kwargs)

    def slow_compile(*args, **kwargs):
        time.sleep(0.5)
        in_flight[0] -= 1
        return compile_step(*args, **kwargs)

    monkeypatch.setattr(planner, "_lower", counted_lower)
    monkeypatch.setattr(planner, "compile_step", slow_compile)
    monkeypatch.setattr(planner, "LONG_PLAN_S", 0)  # every plan is long: the hint for --budget is given, once
    cfg = load_config(None, MICRO + [f"model.vocab_size={VOCAB}"])
    lines = []
    p = plan(cfg, 4, workers=1, strategies=parse_strategies("dp4,fsdp4,dp2+fsdp2,dp2+tp2", 4), log=lines.append)
    assert len(p.strategies) == 4 and most[0] == 2, most  # one compiling, one lowered and queued
    assert sum(line.startswith("this plan may take ") and "--budget" in line for line in lines) == 1, lines


def test_a_plan_run_again_reads_its_compiled_steps_from_the_step_cache(tmp_path, monkeypatch):
    """`shardlm plan --cache`: a strategy compiled once is read back, not compiled, by a plan of the same program
    (here with compiling forbidden), and ranks the same; an entry that does not load is compiled again and
    rewritten; another program (another batch) is a new entry; a directory that cannot be written is said, and
    the plan goes on."""
    from shardlm.perf import compiled
    from shardlm.perf.step_cache import caching_steps

    cfg = load_config(None, MICRO + [f"model.vocab_size={VOCAB}"])
    dp4 = parse_strategies("dp4", 4)

    def facts(p):
        return [(r.label, r.peak, r.flops_per_device, r.est.step_s, len(r.collectives)) for r in p.strategies]

    with caching_steps(tmp_path) as cache:
        first = plan(cfg, 4, strategies=dp4)
        entries = list(tmp_path.glob("*.pkl"))
        assert len(entries) == 1 and not first.strategies[0].cached
        compile_cpu = compiled._compile
        monkeypatch.setattr(compiled, "_compile", lambda *a, **k: pytest.fail("compiled a step the cache holds"))
        again = plan(cfg, 4, strategies=dp4)
        assert again.strategies[0].cached and cache.hits == 1 and facts(again) == facts(first)
        monkeypatch.setattr(compiled, "_compile", compile_cpu)
        entries[0].write_bytes(entries[0].read_bytes()[:100])  # a truncated entry
        assert not plan(cfg, 4, strategies=dp4).strategies[0].cached
        assert plan(cfg, 4, strategies=dp4).strategies[0].cached  # rewritten whole
        other = load_config(None, MICRO + [f"model.vocab_size={VOCAB}", "train.batch_size=8"])
        assert not plan(other, 4, strategies=dp4).strategies[0].cached
    assert len(list(tmp_path.glob("*.pkl"))) == 2 and not list(tmp_path.glob(".*.tmp"))
    (tmp_path / "a-file").write_text("")
    with caching_steps(tmp_path / "a-file" / "steps") as unwritable:  # costs the cache, not the plan
        assert len(plan(cfg, 4, strategies=dp4).strategies) == 1 and "Not a directory" in unwritable.unwritable
    # A key is the program's text, which must not change between processes: the blocks' statistics were summed in
    # a set's order, which each process's string hashing shuffles (a mixture's plans never hit the cache).
    from shardlm.models.stack import add_stats

    keys = ["moe_overflow", "aux_loss", "moe_dropped", "expert_tokens"]
    assert list(add_stats(dict.fromkeys(keys, 1.0), dict.fromkeys(keys[::-1], 1.0))) == sorted(keys)


def test_plan_and_bench_cli_errors(tmp_path, capsys):
    from shardlm.cli import main

    for command in (["plan"], ["train", "--compile-only"]):  # a target's abstract devices: 0 was taken as 1
        assert main([*command, "--target", "h100", "--devices", "0", *MICRO]) == 2
        assert capsys.readouterr().err.strip() == "shardlm: error: --devices must be at least 1, got 0"
    assert main(["plan", "--devices", "8", "--budget", "soon", *MICRO]) == 2
    assert capsys.readouterr().err.strip() == ("shardlm: error: --budget 'soon' is not a duration; write e.g. 5m, 90s "
                                               "or 1h")
    assert_one_line_error(shardlm("plan", "--devices", "8", "--memory", "lots", *MICRO), "--memory 'lots'")
    assert_one_line_error(shardlm("plan", "--devices", "8", "--peak-tflops", "0", *MICRO), "--peak-tflops")
    assert_one_line_error(shardlm("plan", "--devices", "0", *MICRO), "--devices must be at least 1")
    assert_one_line_error(shardlm("plan", "--devices", "8", "--hosts", "3", *MICRO), "does not divide the 8 devices")
    assert_one_line_error(shardlm("plan", "--devices", "8", "--hosts", "2", "--inter-host-bandwidth", "fast", *MICRO),
                          "is not a rate")
    assert_one_line_error(shardlm("bench", "--cpu-devices", "8", "--strategies", "dp8", "--plot",
                                  str(tmp_path / "missing" / "b.png"), *MICRO), "does not exist")
    assert_one_line_error(shardlm("bench", "--cpu-devices", "8", "--strategies", "dp3", *MICRO),
                          "uses 3 devices but 8")


def test_bench_cli_table_json_and_chart(tmp_path):
    chart = tmp_path / "bench.png"
    proc = shardlm("bench", "--cpu-devices", "8", "--strategies", "dp8,fsdp4+tp2", "--steps", "2", "--json",
                   "--plot", str(chart), *MICRO, f"model.vocab_size={VOCAB}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["devices"] == 8 and [s["name"] for s in out["strategies"]] == ["dp8", "fsdp4+tp2"]
    assert out["estimated_on"].startswith("this host's CPU (8 devices, measured")
    # MFU is held against the measured peak the estimate is costed with: the host's figure, kept (read here from
    # the session's cache, which the command's process wrote)
    from shardlm.host_figures import kept

    peak = kept(jax.devices())[0]["peak_flops"]
    assert out["peak_source"].startswith("measured CPU matmul peak (8 devices busy at once, kept in ")
    for s in out["strategies"]:
        assert s["steps"] == 2 and s["step_s"] > 0 and 0 < s["mfu"] and s["tokens_per_s"] > 0
        assert s["mfu"] == pytest.approx(s["tflops_per_device"] * 1e12 / peak)
        assert s["tokens_per_s"] == pytest.approx(16 * 32 / s["step_s"])
        # the plan's estimate of the same compiled step, beside the measurement
        assert s["est_step_s"] > 0 and s["measured_over_est"] == pytest.approx(s["step_s"] / s["est_step_s"])
    # the same run on two meshes: the same loss after the same steps
    a, b = (s["final_loss"] for s in out["strategies"])
    assert abs(a - b) < 1e-4 * abs(a)
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_rejects_a_strategy_the_model_cannot_take():
    proc = shardlm("bench", "--cpu-devices", "8", "--strategies", "dp8,tp8", *MICRO)
    assert_one_line_error(proc, "strategy tp8:")


def test_profile_cli_traces_with_named_scopes(tmp_path):
    out = tmp_path / "prof"
    proc = shardlm("profile", "--cpu-devices", "2", "--steps", "2", "--out", str(out), *MICRO, "mesh.fsdp=2",
                   f"model.vocab_size={VOCAB}")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.split()}
    for scope in ("embed", "layers", "head", "loss", "optimizer"):  # the scanned blocks are one scope
        assert scope in rows, proc.stdout
        assert float(rows[scope][-2]) > 0  # total ms
    assert float(rows["layers"][2]) > 0  # backward ms of the blocks: the transpose ops carry the scope too
    assert list(out.glob("plugins/profile/*/*.xplane.pb"))  # for TensorBoard / XProf
    (perfetto,) = out.glob("plugins/profile/*/perfetto_trace.json.gz")  # the file the summary was read from
    assert str(perfetto) in proc.stdout
    assert f"tensorboard --logdir {out}" in proc.stdout and "ui.perfetto.dev" in proc.stdout


def test_profile_attributes_merged_ops_to_the_model_scope():
    from shardlm.perf.profile import _scope

    assert _scope("jit(step)/jvp(layer3)/dot_general") == ("layer3", False)
    assert _scope("jit(step)/transpose(jvp(layer3))/dot_general") == ("layer3", True)
    assert _scope("jit(step)/(optimizer/reduce_sum:transpose(jvp(layer2))/reduce_sum)") == ("layer2", True)
    assert _scope("jit(step)/optimizer/mul") == ("optimizer", False)
    assert _scope("jit(step)/copy") is None


@pytest.mark.parametrize("per_host", [8, 4, 2], ids=["one host", "2 hosts of 4", "4 hosts of 2"])
def test_the_pruning_bound_never_exceeds_a_compiled_estimate(plan8, per_host):
    """`shardlm plan` skips a strategy whose analytic lower bound (scaled by the margin) exceeds the best estimate
    so far: safe only if the bound stays below every compiled strategy's own estimate, on one host and across
    hosts (where the slow links dominate); and, scaled by the known error a plan learns from the strategies it has
    compiled (`Calibration`), held out one at a time, still below it with the margin."""
    from shardlm.perf.bounds import MARGIN, Calibration, lower_bound
    from shardlm.perf.planner import _padded_vocab, _param_count
    from shardlm.train.source import model_flops_per_step

    p = plan8.rerank(Hardware(devices_per_node=per_host, inter_node_bw=6.25e9))
    count = _param_count(p.cfg, VOCAB)
    bounds = {r.strategy: lower_bound(p.cfg, r.strategy, p.hardware,
                                      model_flops_per_step(p.cfg, VOCAB, r.strategy.tensor), count,
                                      padded_vocab=_padded_vocab(p.cfg, VOCAB, r.strategy.tensor), platform="cpu")
              for r in p.strategies}
    for r in p.strategies:
        bound = bounds[r.strategy]
        assert bound.step_s <= r.est.step_s, (r.strategy.name, bound, r.est.step_s)
        assert bound.comm_s > 0  # every split of 8 devices sends something it cannot avoid
        # as a plan prunes: the bound's compute scaled by what every other strategy's compiled kernels showed
        calibration = Calibration()
        for other in p.strategies:
            if other is not r:
                calibration.learn(bounds[other.strategy], other.est.compute_s)
        assert calibration.factor > 1.5  # the matmuls at their shapes' rates are not the whole step's kernels
        assert MARGIN * calibration.applied(bound).step_s <= r.est.step_s, (r.strategy.name, calibration.factor)
