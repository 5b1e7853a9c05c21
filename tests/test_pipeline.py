"""Pipeline parallelism (`mesh.stage`, `shardlm.schedules.gpipe`): parity with the unpipelined model, bubbles that
cannot poison gradients, and the compiled program's stage traffic."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MICRO, structured_tokens
from flax import nnx

VOCAB = 500
BASE = [o for o in MICRO if not o.startswith("model.n_layers")] + ["model.n_layers=4"]
_reference: dict = {}


def _train(overrides, degrees, steps):
    """(losses, gradient norms) of `steps` training steps with the real train step on a synthetic stream."""
    from shardlm.config import load_config
    from shardlm.data.loader import BatchLoader
    from shardlm.mesh import make_mesh
    from shardlm.sharding import batch_sharding
    from shardlm.train.state import create_train_state
    from shardlm.train.step import train_step_for

    cfg = load_config(None, overrides)
    n = int(np.prod(list(degrees.values())))
    mesh = make_mesh(**degrees, devices=jax.devices()[:n])
    ts = create_train_state(cfg, mesh, VOCAB)
    loader = BatchLoader(structured_tokens(40_000, VOCAB), cfg.model.seq_len, cfg.train.batch_size,
                         batch_sharding(mesh), seed=cfg.seed, shuffle=True)
    step = train_step_for(cfg, ts, mesh)
    losses, norms = [], []
    for i in range(steps):
        ts.state, metrics = step(ts.state, loader.get(i))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return losses, norms


def _reference_run(family_overrides, steps):
    key = (tuple(family_overrides), steps)
    if key not in _reference:
        _reference[key] = _train(BASE + family_overrides, {"data": 1}, steps)
    return _reference[key]


# (name, mesh degrees, overrides of the pipelined run only, overrides of both runs). Each case is a compile and 20
# steps, so no case repeats what another test or case runs. Not cases of their own:
# - pp2 alone, two layers per stage: pp2 x fsdp 2 x tensor 2 below runs its schedule and stage split, and
#   test_parity's PP 2 x DP 2 a two-stage pipeline with no axis within its stages, against the plain step;
# - pp4: M = 2S is the pp8 case's, and pp4 x data 2 trains test_a_pp4_checkpoint_resumes_on_other_stage_counts's
#   checkpoint, whose steps 4 to 6 an unpipelined model repeats from it to 1e-5;
# - pp2 x data 2 alone: the two remat cases below run on it, and test_parity's PP 2 x DP 2;
# - pp2 x context 2: test_context's test_context_composes_with_remat_grad_accumulation_and_stages runs stage 2 x
#   context 2 (Llama with GQA, remat full, 2 microbatches) against one device, every step to 1e-5.
CASES = [
    ("pp2, circular R = 2", {"stage": 2, "data": 1}, ["model.pipeline_repeats=2"], []),
    ("pp8, one layer per stage, M = 2S", {"stage": 8}, ["model.pipeline_microbatches=16"], ["model.n_layers=8"]),
    ("pp2 x fsdp 2 x tensor 2", {"stage": 2, "data": 1, "fsdp": 2, "tensor": 2}, [], []),  # each axis within a stage
    ("pp2, grad_accum 2, remat full", {"stage": 2, "data": 2}, ["train.grad_accum=2", "model.remat=full"], []),
    ("pp2, remat full per layer too", {"stage": 2, "data": 2}, ["model.remat=full", "model.pipeline_remat=layer"],
     []),
    # 1F1B (`shardlm.schedules.one_f_one_b`): the head and loss inside the loop, a copy of the head per device of the
    # batch split, and each stage's replicas over fsdp; the GPT case above runs GPipe on the same mesh
    ("llama 1f1b, pp2 x fsdp 2 x tensor 2, M = 2S", {"stage": 2, "data": 1, "fsdp": 2, "tensor": 2},
     ["model.pipeline_schedule=1f1b", "model.pipeline_microbatches=4"],
     ["model.family=llama", "model.use_bias=false", "model.n_kv_heads=2"]),
]


@pytest.mark.parametrize("name,degrees,pipelined,both", CASES, ids=[c[0] for c in CASES])
def test_pipelined_training_matches_the_unpipelined_model(name, degrees, pipelined, both):
    steps = 20
    ref_losses, ref_norms = _reference_run(both, steps)
    losses, norms = _train(BASE + both + pipelined, degrees, steps)
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-5)
    assert norms[0] == pytest.approx(ref_norms[0], rel=1e-5)  # the whole gradient, not only the loss
    assert losses[-1] == pytest.approx(ref_losses[-1], rel=1e-3)
    assert losses[-1] < losses[0] - 0.25  # it trains


# --- the schedule on its own: circular repeats, and bubbles full of NaN --------------------------------------------


def _stage_mesh(stages, data):
    from shardlm.mesh import make_mesh

    return make_mesh(stage=stages, data=data, devices=jax.devices()[:stages * data])


def _blocks_and_input(n_layers=4, seed=0):
    from shardlm.config import load_config
    from shardlm.models.gpt import GPT, padded_vocab_size

    cfg = load_config(None, BASE + [f"model.n_layers={n_layers}"])
    with nnx.use_eager_sharding(False):
        model = GPT(cfg.model, VOCAB, padded_vocab_size(VOCAB, 1), nnx.Rngs(params=seed))
    x = jax.random.normal(jax.random.key(1), (8, cfg.model.seq_len, cfg.model.d_model))
    return model, x


def _step(model):
    from shardlm.models.attention import Context, causal_mask

    ctx = Context("xla", causal_mask(model.context), None, None)
    return lambda block, x, rngs, cache, i: block(x, rngs, cache, ctx._replace(layer=i))


def _loss_and_grads(run, blocks, x):
    """Sum of squares of run(blocks, x) and its gradient with respect to the blocks' parameters and x."""
    graphdef, params = nnx.split(blocks)

    def loss(params, x):
        return jnp.sum(run(nnx.merge(graphdef, params), x) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


def _in_layer_order(grads, repeats: int):
    """Gradients of blocks held with repeats ([R, n / R, ...]) in layer order ([n, ...])."""
    return [np.asarray(g).reshape(-1, *g.shape[2:]) if repeats > 1 else np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.fixture(scope="module")
def layers_in_order():
    """The blocks, their input, and the loss and gradients of running the layers in order: one reference for
    every schedule below."""
    from shardlm.models.stack import run_blocks

    model, x = _blocks_and_input()
    step = _step(model)
    return model, x, _loss_and_grads(lambda b, x: run_blocks(b, model.n_layers, True, step, x)[0], model.blocks, x)


# (circular S = R = M = 2 with zero bubbles was a third case: the table is played out on paper below, and M = 2S
# runs the circular schedule here)
@pytest.mark.parametrize("stages,repeats,microbatches,data,idle",
                         [(4, 1, 4, 2, float("nan")), (2, 2, 4, 2, float("nan"))],
                         ids=["bubbles full of NaN", "circular M=2S, NaN bubbles"])
def test_the_schedule_equals_the_layers_in_order(layers_in_order, stages, repeats, microbatches, data, idle):
    from shardlm.schedules.gpipe import run_pipeline, stage_layers
    from shardlm.models.stack import in_repeats
    from shardlm.sharding import use_mesh_rules

    model, x, reference = layers_in_order
    step = _step(model)
    # stage 0 holds layers 0 and 2 when circular: its layer of each repeat, as [R, S K] split over the stages gives it
    assert stage_layers(model.n_layers, stages, repeats)[0] == ([0, 2] if repeats == 2 else [0])
    mesh = _stage_mesh(stages, data)

    def pipelined(b, x):
        with use_mesh_rules(mesh):
            return run_pipeline(b, model.n_layers, step, x, stages=stages, microbatches=microbatches,
                                repeats=repeats, idle_input=idle)[0]

    loss, (grads, dx) = _loss_and_grads(pipelined, in_repeats(model.blocks, repeats), x)
    ref_loss, (ref_grads, ref_dx) = reference
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    # The key bias's gradient is zero in exact arithmetic (softmax ignores a constant added to every score), so
    # entries are compared at the scale of the whole gradient.
    scale = max(np.abs(np.asarray(r)).max() for r in jax.tree.leaves(ref_grads))
    for g, r in zip(_in_layer_order(grads, repeats), jax.tree.leaves(ref_grads), strict=True):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, np.asarray(r), rtol=1e-4, atol=1e-6 * scale)
    # float32 rounding of sums of terms up to ~10 in magnitude: near-zero entries are compared at that scale
    np.testing.assert_allclose(np.asarray(dx), np.asarray(ref_dx), rtol=1e-4, atol=1e-6 * np.abs(ref_dx).max())


@pytest.mark.parametrize("stages,microbatches,repeats", [(2, 2, 1), (4, 4, 2), (2, 6, 3)])
def test_the_schedule_table_runs_every_microbatch_through_every_layer_once_in_order(stages, microbatches, repeats):
    """Played out on paper: stage 0 reads slot read_slot, every stage passes its output on, and the last stage's
    output lands in slot write_slot one iteration later. Every microbatch goes through the model's layers 0, 1,
    ..., n - 1 in order (a stage's repeat r runs layers first_layer .. first_layer + K - 1), no slot is
    overwritten before it is read, and the last repeat's outputs are in their slots at the end."""
    from shardlm.schedules.gpipe import bubble_fraction, pipeline_schedule

    k = 2
    sched = pipeline_schedule(stages, microbatches, repeats, k)
    assert sched.iterations == microbatches * repeats + stages - 1
    assert 1 - sched.active.mean() == pytest.approx(bubble_fraction(stages, microbatches, repeats))
    slots = [[] for _ in range(microbatches)]  # what each of stage 0's slots holds: the layers run so far
    held = [None] * stages  # each stage's output after the iteration: (microbatch, layers it has been through)
    for t in range(sched.iterations + 1):
        arrived = [held[-1]] + held[:-1]
        if sched.write_slot[t] >= 0:
            mb, layers = arrived[0]
            assert mb == sched.write_slot[t]
            slots[mb] = layers
        if t == sched.iterations:
            break
        for s in range(stages):
            if not sched.active[t, s]:
                held[s] = None
                continue
            mb = int(sched.microbatch[t, s])
            layers = slots[sched.read_slot[t]] if s == 0 else arrived[s][1]
            if s == 0:
                assert sched.read_slot[t] == mb
            else:
                assert arrived[s][0] == mb
            first = int(sched.first_layer[t, s])
            assert first == (int(sched.repeat[t, s]) * stages + s) * k
            assert first == len(layers), "each stage continues exactly where the previous one stopped"
            held[s] = (mb, layers + list(range(first, first + k)))
    assert all(layers == list(range(stages * repeats * k)) for layers in slots)


@pytest.mark.parametrize("stages,microbatches,repeats", [(2, 2, 1), (3, 6, 1), (4, 12, 1), (2, 4, 2), (3, 6, 3),
                                                         (4, 4, 2)])
def test_1f1b_ticks_run_each_microbatch_forward_then_backward_through_every_layer(stages, microbatches, repeats):
    """Played out on paper: each microbatch goes forward through the model's layers in order (stage 0 reads it
    from the batch for its first repeat and takes the last stage's output, one tick old, for the next), the
    last stage's output of its last repeat has its loss in the tick it leaves, and it goes backward through
    the layers in reverse, each unit (a microbatch through K layers) one tick after the one it follows, reading
    the slot its forward pass wrote and no later forward pass overwrote; at most 2 S R - 1 units are in flight on
    a stage, and the schedule takes (M R + S - 1) forward and backward ticks' time, circular GPipe's."""
    from shardlm.schedules.one_f_one_b import in_flight, one_f_one_b_ticks

    k = 2
    ticks = one_f_one_b_ticks(stages, microbatches, k, repeats)
    n, units = len(ticks.dx_slot), microbatches * repeats
    assert ticks.phases[0][1] + (ticks.phases[1][1] - ticks.phases[1][0]) + (n - ticks.phases[2][0]) == n
    time = ticks.phases[0][1] + 2 * (ticks.phases[1][1] - ticks.phases[1][0]) + (n - ticks.phases[2][0])
    assert time == 2 * (units + stages - 1)  # forward and backward ticks, each one unit of K layers
    runs = ticks.steady_runs()  # the steady ticks in runs that all run the head or none does
    assert runs[0][0] == ticks.phases[1][0] and runs[-1][1] == ticks.phases[1][1]
    assert all(b == c for (_, b, _), (c, _, _) in zip(runs, runs[1:]))
    assert all((ticks.head_microbatch[a:b] >= 0).all() == head == (ticks.head_microbatch[a:b] >= 0).any()
               for a, b, head in runs)
    through = {m: [] for m in range(microbatches)}  # layers each microbatch has gone through, forward
    slots = [dict() for _ in range(stages)]  # per stage: slot -> (microbatch, first layer) held
    forward_at, backward_at, last_out, most = {}, {}, [None] * stages, 0
    back_through = {m: [] for m in range(microbatches)}
    for t in range(n):
        forward_phase = any(a <= t < b and f for a, b, f, _ in ticks.phases)
        arrived = [last_out[-1]] + last_out[:-1]
        for s in range(stages):
            if not ticks.forward.active[t, s]:
                last_out[s] = None
                if forward_phase:  # an idle forward pass writes its slot too: what it held is gone
                    slots[s][int(ticks.forward_slot[t, s])] = "idle"
                continue
            assert forward_phase
            m, first = int(ticks.forward.microbatch[t, s]), int(ticks.forward.first_layer[t, s])
            if s == 0 and ticks.reads_batch[t]:
                assert ticks.forward.read_slot[t] == m and through[m] == []
            else:
                assert arrived[s] == m, (t, s)
            assert first == len(through[m]), "each unit continues exactly where the previous one stopped"
            through[m] += list(range(first, first + k))
            forward_at[s, m, first] = t
            slots[s][int(ticks.forward_slot[t, s])] = (m, first)
            last_out[s] = m
        if ticks.head_microbatch[t] >= 0:  # the loss of what the last stage just ran through the last layer
            m = int(ticks.head_microbatch[t])
            assert through[m] == list(range(stages * repeats * k)) and last_out[-1] == m
        for s in range(stages):
            most = max(most, sum(1 for key in slots[s].values() if key != "idle" and (s, *key) not in backward_at))
        for s in range(stages):
            if not ticks.backward_active[t, s]:
                continue
            m, first = slots[s][int(ticks.backward_slot[t, s])]  # (fails on a slot an idle pass wrote)
            assert first == (int(ticks.backward_repeat[t, s]) * stages + s) * k
            assert first + k == (stages * repeats - len(back_through[m])) * k, "backward in reverse layer order"
            back_through[m] += [first]
            backward_at[s, m, first] = t
            if first + k < stages * repeats * k:  # its output gradient came from the unit after it, a tick ago
                after = (s + 1) % stages
                assert backward_at[after, m, first + k] == t - 1
            else:
                assert ticks.head_microbatch[t] == m and s == stages - 1
        if ticks.dx_slot[t] >= 0:
            assert backward_at[0, int(ticks.dx_slot[t]), 0] == t
    assert all(layers == list(range(stages * repeats * k)) for layers in through.values())
    assert len(backward_at) == len(forward_at) == stages * units
    assert most <= in_flight(stages, repeats) and in_flight(stages, repeats) == 2 * stages * repeats - 1
    # a slot per unit in flight; with fewer units than 2 S R - 1, a spare that only idle forward passes write
    live = min(units, in_flight(stages, repeats))
    assert ticks.slots == live + (live < in_flight(stages, repeats))
    assert (ticks.forward_slot[ticks.forward.active] < live).all()
    assert (ticks.backward_slot[ticks.backward_active] < live).all()


@pytest.mark.parametrize("stages,microbatches,data,repeats", [(4, 4, 2, 1), (2, 8, 1, 1), (2, 4, 2, 2)],
                         ids=["pp4 x data 2", "pp2, M = 4S", "pp2 x data 2, interleaved R = 2"])
def test_1f1b_equals_the_layers_in_order(layers_in_order, stages, microbatches, data, repeats):
    """The 1F1B schedule's loss and gradients (the blocks', the input's and the head's) are the layers' in order,
    the head taking each microbatch's share of the loss; with circular repeats, interleaved."""
    from shardlm.schedules.one_f_one_b import run_1f1b
    from shardlm.models.stack import in_repeats
    from shardlm.sharding import use_mesh_rules

    model, x, (ref_loss, (ref_grads, ref_dx)) = layers_in_order
    graphdef, params = nnx.split(in_repeats(model.blocks, repeats))
    mesh, step = _stage_mesh(stages, data), _step(model)
    targets = jnp.zeros(x.shape[:2], jnp.int32)

    def loss(params, x, scale):
        head = lambda p, y, t: p * microbatches * jnp.sum(y ** 2)  # noqa: E731 - the mean over microbatches
        with use_mesh_rules(mesh):
            return run_1f1b(nnx.merge(graphdef, params), model.n_layers, step, x, head, scale, targets,
                            stages=stages, microbatches=microbatches, repeats=repeats)[0]

    value, (grads, dx, d_scale) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, x, jnp.float32(1))
    assert float(value) == pytest.approx(float(ref_loss), rel=1e-5)
    assert float(d_scale) == pytest.approx(float(ref_loss), rel=1e-5)
    scale = max(np.abs(np.asarray(r)).max() for r in jax.tree.leaves(ref_grads))
    for g, r in zip(_in_layer_order(grads, repeats), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, np.asarray(r), rtol=1e-4, atol=1e-6 * scale)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(ref_dx), rtol=1e-4, atol=1e-6 * np.abs(ref_dx).max())


def test_1f1b_holds_a_few_microbatches_where_gpipe_holds_them_all():
    """Compiled at 2 and 16 microbatches of the same size (two stages): GPipe's temporaries grow with every
    microbatch, whose activations it keeps until its backward pass; 1F1B's hold at most 2S - 1 = 3
    microbatches' whatever M is, so they grow only by the batch itself (its input and its gradient)."""
    from shardlm.schedules.one_f_one_b import run_1f1b
    from shardlm.schedules.gpipe import run_pipeline
    from shardlm.sharding import use_mesh_rules

    model, x = _blocks_and_input()
    graphdef, params = nnx.split(model.blocks)
    mesh, step = _stage_mesh(2, 1), _step(model)

    def temporaries(schedule, m):
        xs = jax.ShapeDtypeStruct((2 * m, *x.shape[1:]), x.dtype)
        targets = jnp.zeros(xs.shape[:2], jnp.int32)

        def loss(params, x):
            blocks = nnx.merge(graphdef, params)
            with use_mesh_rules(mesh):
                if schedule == "1f1b":
                    return run_1f1b(blocks, model.n_layers, step, x, lambda p, y, t: p * jnp.sum(y ** 2),
                                    jnp.float32(1), targets, stages=2, microbatches=m)[0]
                return jnp.sum(run_pipeline(blocks, model.n_layers, step, x, stages=2, microbatches=m)[0] ** 2)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, xs).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    gpipe, one_f_one_b = ([temporaries(schedule, m) for m in (2, 16)] for schedule in ("gpipe", "1f1b"))
    # measured: GPipe 5.2 -> 21.3 MiB, 1F1B 5.6 -> 5.8 MiB
    assert gpipe[1] - gpipe[0] > 10 * (one_f_one_b[1] - one_f_one_b[0])
    assert one_f_one_b[1] < gpipe[1] / 3


def test_stage_weights_are_read_in_the_compute_dtype_and_their_gradients_summed_in_float32():
    """The blocks read their compute copies (bfloat16, but float32 for norms and biases); each weight's gradient reaches
    the stored float32 weight through a float32 carrier, so the pipeline's loop sums it over its iterations in
    float32: against a float64 sum of 4,096 bfloat16 terms, the carrier's sum is float32-exact where a sum in
    bfloat16 (the weight's own cotangent) is off by a thousandth."""
    from flax.traverse_util import flatten_dict

    from shardlm.schedules.gpipe import _with_gradient_into, stage_weights
    from shardlm.models.precision import compute_view

    model, _ = _blocks_and_input()
    weights, carriers = stage_weights(compute_view(model, jnp.bfloat16).blocks, model.blocks, 2, 1, 1, ())
    dtypes = {k: a.dtype for k, a in flatten_dict(nnx.to_pure_dict(weights), sep="/").items()}
    in_float32 = {k for k in dtypes if k.split("/")[0].startswith("ln") or k.endswith("bias")}  # norms, biases
    assert in_float32 and {dtypes[k] for k in in_float32} == {jnp.dtype("float32")}
    assert {dtypes[k] for k in dtypes.keys() - in_float32} == {jnp.dtype("bfloat16")}  # the matrices
    assert {a.dtype for a in jax.tree.leaves(carriers)} == {jnp.dtype("float32")}

    terms = jax.random.normal(jax.random.key(0), (4096, 8), jnp.float32).astype(jnp.bfloat16) + 1
    exact = np.asarray(terms, np.float64).sum(0)

    def summed(w, c):  # the gradient of sum_t <w, terms[t]> over a loop, as a pipeline's weights take it
        return jax.lax.scan(lambda acc, g: (acc + (_with_gradient_into(w, c) * g).sum(), None), 0.0, terms)[0]

    w, c = jnp.ones(8, jnp.bfloat16), jnp.zeros(8, jnp.float32)
    through_carrier = jax.grad(summed, argnums=1)(w, c)
    own = jax.grad(lambda w: jax.lax.scan(lambda acc, g: (acc + (w * g).sum(), None), 0.0, terms)[0])(w)
    assert through_carrier.dtype == jnp.float32 and own.dtype == jnp.bfloat16
    assert np.abs(np.asarray(through_carrier) / exact - 1).max() < 1e-6
    assert np.abs(np.asarray(own, np.float64) / exact - 1).max() > 1e-3


def test_pipeline_errors_are_one_line():
    from shardlm.errors import ShardlmError
    from shardlm.schedules.gpipe import check_pipeline

    with pytest.raises(ShardlmError, match="n_layers=6 does not split into mesh.stage=4"):
        check_pipeline(6, 16, 4, 4, 1)
    with pytest.raises(ShardlmError, match="pipeline_microbatches=6 is not a multiple of mesh.stage=4"):
        check_pipeline(8, 16, 4, 6, 1)
    with pytest.raises(ShardlmError, match=r"batch of 12 sequences \(train.batch_size / train.grad_accum\) does "
                                           "not split"):
        check_pipeline(8, 12, 4, 8, 1)


# --- the compiled program -----------------------------------------------------------------------------------------


def test_stages_hand_on_activations_and_hold_their_own_layers():
    """pp2 x fsdp4 on 8 devices, a model whose weights dwarf its activations: the step's only traffic between
    stages is activations (the hand-offs are collective-permutes, once per pipeline iteration, forward and
    backward), FSDP gathers each stage's weights within the stage once per step and reduce-scatters their
    gradients once per step, and each device holds 1/(2 x 4) of the blocks' parameters."""
    from shardlm.config import load_config
    from shardlm.mesh import make_mesh
    from shardlm.perf import hlo
    from shardlm.train.state import TrainState, abstract_train_state
    from shardlm.train.step import batch_struct, train_step_for

    cfg = load_config(None, BASE + ["model.d_mlp=1024", "model.seq_len=8"])
    mesh = make_mesh(1, 4, 1, stage=2)
    _, graphdef, abstract, shardings = abstract_train_state(cfg, mesh, VOCAB)
    compiled = train_step_for(cfg, TrainState(graphdef, abstract, shardings), mesh).lower(
        abstract, batch_struct(cfg, mesh)).compile()
    ops = hlo.collectives(compiled.as_text(), 8)
    stage_of = lambda p: np.unravel_index(p, mesh.devices.shape)[0]  # noqa: E731
    spans_stages = lambda op: any(len({stage_of(p) for p in g}) > 1 for g in op.groups)  # noqa: E731
    iterations = 2 + 2 - 1  # M + S - 1 with M = S = 2
    hand_offs = [o for o in ops if o.kind == "collective-permute" and spans_stages(o) and o.times == iterations]
    assert len(hand_offs) >= 2  # forward and backward
    layer_bytes = 2 * cfg.model.d_model * cfg.model.d_mlp * 4  # one layer's MLP weights, float32
    across = [o for o in ops if spans_stages(o)]
    assert max(o.bytes for o in across) < layer_bytes / 10, [(o.kind, o.bytes, o.op_name) for o in across]
    gathers = [o for o in ops if o.kind == "all-gather" and o.bytes >= layer_bytes / 4]  # the weights' own
    assert gathers and all(o.times == 1 and not spans_stages(o) for o in gathers)
    # Gradients are reduced once, after the loop: inside it the only collectives are the hand-offs.
    assert {o.kind for o in ops if o.times > 1} == {"collective-permute"}
    scatters = [o for o in ops if o.kind == "reduce-scatter" and o.bytes >= layer_bytes / 4]
    assert scatters and all(o.times == 1 and not spans_stages(o) for o in scatters)
    w_in = abstract["model"]["blocks"]["mlp"]["w_in"]
    assert w_in.sharding.spec[0] == "stage"
    assert w_in.sharding.shard_shape(w_in.shape) == (2, 64 // 4, 1024)  # 2 of the 4 layers, an FSDP quarter each


# --- checkpoints across stage counts -------------------------------------------------------------------------------

RUN = BASE + ["model.dropout=0", "train.steps=6", "train.warmup_steps=2", "train.log_interval=1",
              "train.eval_interval=100", "train.sample_tokens=0", "data.tokenizer=bytes", "checkpoint.every=3"]


@pytest.fixture(scope="module")
def pp4_run(tmp_path_factory):
    """Six steps on pp4 x data 2, a checkpoint at step 3 (stored in layer order, as every checkpoint is)."""
    from shardlm.config import load_config
    from shardlm.train.loop import train

    run_dir = tmp_path_factory.mktemp("pp4") / "run"
    train(load_config(None, RUN + ["mesh.stage=4", "mesh.data=2"]), run_dir, progress=False)
    return run_dir


# Each resumption is a run (its train and eval steps compiled). Every checkpoint is stored in layer order, so both
# read the same arrays; pp1 with the layers scanned is not a third: its target, stacked blocks without a stage axis,
# is pp2 x fsdp2's (stacked) and pp1 block by block's (no stage), and test_checkpoint's
# test_fsdp8_checkpoint_continues_on_another_mesh[fsdp2xcp4] resumes stacked blocks onto another mesh.
# (A pp4 checkpoint resumed by a circular pipeline is not a case of its own: the checkpoint below, stored in layer
# order as this one, is resumed by one, on another mesh.)
@pytest.mark.parametrize("mesh", [["mesh.data=8", "model.scan_layers=false"]], ids=["pp1 block by block"])
def test_a_pp4_checkpoint_resumes_on_other_stage_counts(pp4_run, tmp_path, mesh):
    import json
    import shutil

    from shardlm.checkpoint import RunCheckpoints
    from shardlm.config import load_config
    from shardlm.train.loop import train

    run_dir = tmp_path / "run"
    shutil.copytree(pp4_run, run_dir)
    ck = RunCheckpoints(run_dir)
    for step in ck.steps():
        if step != 3:
            shutil.rmtree(run_dir / "checkpoints" / str(step))
    ck.close()
    summary = train(load_config(None, RUN + mesh), run_dir, progress=False)
    assert summary["resumed_from"] == 3

    def losses(d):
        return {r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").open()) if "loss" in r}

    want, got = losses(pp4_run), losses(run_dir)
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


# A run of 4 steps on pp2 x data 4 with circular repeats 2 (d_model 16), written by shardlm before the stack was held as
# [repeats, layers] (when a circular pipeline permuted the stack's rows and stored them in layer order), with its
# checkpoint at step 2 and the uninterrupted run's metrics.
CIRCULAR_RUN = Path(__file__).parent / "fixtures" / "circular_run"
CIRCULAR = ([o for o in MICRO if not o.startswith(("model.n_layers", "model.d_model", "model.d_mlp"))]
            + ["model.n_layers=4", "model.d_model=16", "model.d_mlp=32", "model.dropout=0", "train.steps=4",
               "train.warmup_steps=2", "train.log_interval=1", "train.eval_interval=100", "train.sample_tokens=0",
               "data.tokenizer=bytes", "checkpoint.every=2", "model.pipeline_repeats=2"])


def test_a_checkpoint_of_a_circular_pipeline_from_before_the_repeats_axis_resumes(tmp_path):
    """The stack is held as [repeats, layers] now, and stored in layer order, as it was when the rows were permuted:
    the old run's checkpoint resumes on another mesh (pp2 x fsdp 2 x data 2) and continues its losses."""
    import json
    import shutil

    from shardlm.config import load_config
    from shardlm.train.loop import train

    def losses(d):
        return {r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").open()) if "loss" in r}

    want = losses(CIRCULAR_RUN)
    run_dir = tmp_path / "run"
    shutil.copytree(CIRCULAR_RUN, run_dir)
    summary = train(load_config(None, CIRCULAR + ["mesh.stage=2", "mesh.fsdp=2", "mesh.data=2"]), run_dir,
                    progress=False)
    assert summary["resumed_from"] == 2
    got = losses(run_dir)
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_explain_says_which_layers_each_stage_holds():
    from shardlm.config import load_config
    from shardlm.train.explain import explain_run

    cfg = load_config(None, BASE + ["data.tokenizer=bytes", "mesh.stage=2", "mesh.data=4",
                                    "model.pipeline_repeats=2", "model.pipeline_microbatches=4"])
    ex = explain_run(cfg, log=lambda m: None)
    (note,) = [n for n in ex.notes if n.startswith("pipeline")]
    # circular: stage 0 runs layer 0, then (second repeat) layer 2
    assert "pipeline over stage=2 (stage 0: layers 0, 2; stage 1: layers 1, 3)" in note
    assert "4 microbatches x 2 repeat(s)" in note and "9 iterations" in note and "bubble (S-1)/(M R+S-1) = 11%" in note
    assert "GPipe: each stage holds all 4 microbatches' activations until the backward pass" in note
    # the stack held as [repeats, layers]: its layers split over the stages, every repeat on every stage
    row = next(r for r in ex.params if r.path == "blocks/mlp/w_in")
    assert row.spec.startswith("P(None, 'stage'") and row.shape[:2] == (2, 2)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.stage=4", "model.n_layers=6"], "model.n_layers=6 does not split into mesh.stage=4 stages"),
    (["mesh.stage=2", "model.pipeline_microbatches=3"], "pipeline_microbatches=3 is not a multiple of mesh.stage=2"),
    (["mesh.stage=2", "model.pipeline_repeats=4"], "does not split into mesh.stage=2 stages x model.pipeline_repeats=4"),
    (["mesh.stage=2", "model.scan_layers=false"], "set model.scan_layers=true"),
    (["mesh.stage=2", "mesh.data=1", "mesh.tensor=4", "train.batch_size=6", "train.grad_accum=2"],
     r"a batch of 3 sequences \(train.batch_size / train.grad_accum\) does not split into 2 microbatches "
     r"\(model.pipeline_microbatches=0, one per stage: 2\)"),
    (["mesh.stage=2", "mesh.data=4", "model.pipeline_microbatches=8"], "use a train.batch_size that is a multiple of 32"),
])
def test_configs_a_pipeline_cannot_run_are_one_line_errors(overrides, message):
    from shardlm.config import load_config
    from shardlm.errors import ShardlmError
    from shardlm.mesh import mesh_from_config
    from shardlm.train.state import check_batch, check_shardable

    cfg = load_config(None, BASE + overrides)
    mesh = mesh_from_config(cfg.mesh)
    with pytest.raises(ShardlmError, match=message) as e:
        check_shardable(cfg, mesh)
        check_batch(cfg, mesh)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["model.pipeline_schedule=zigzag"], "model.pipeline_schedule"),
    (["model.pipeline_schedule=1f1b", "model.remat=full", "model.remat_offload=block_input"],
     "cannot offload them .model.remat_offload=block_input.; drop model.remat_offload"),
])
def test_pipeline_schedules_it_cannot_run_are_one_line_errors(overrides, message):
    from shardlm.config import load_config
    from shardlm.errors import ShardlmError

    with pytest.raises(ShardlmError, match=message) as e:
        load_config(None, BASE + ["mesh.stage=2", *overrides])
    assert "\n" not in str(e.value)


def test_remat_per_layer_without_remat_is_a_one_line_error():
    from shardlm.config import load_config
    from shardlm.errors import ShardlmError

    with pytest.raises(ShardlmError, match="model.remat=none keeps every matmul output, so there is nothing to "
                                           "rematerialise: set model.remat"):
        load_config(None, BASE + ["mesh.stage=2", "model.pipeline_remat=layer"])
