"""The mixture-of-experts layer (`shardlm.models.moe`): its dropless ragged path against a plain per-expert loop
(outputs and every gradient), an expert no token picks, the load-balancing loss on hand-made routings, and
expert parallelism on 8 simulated devices against the one-device result (with the all-to-alls in the compiled
program and the experts' bytes split over the expert devices), including the routing that fills the
exchange's fixed-size buffer exactly (every token to the experts of one device: nothing may be dropped).

Design choices:
- Everything is float32 and compared at 1e-5 relative to the compared quantity's own scale (the largest
  magnitude of the reference array): the paths differ only in summation order.
- The one-device layer, its loss and gradients are module-scoped fixtures shared by the parity tests, and each
  mesh compiles one loss-and-gradients program and one forward program; a fresh `jax.jit` per mesh, because the
  active rules are read while tracing and are not part of jit's cache key.
- The loss for the mesh comparison includes the auxiliary loss, so its psum'd statistics are differentiated
  through the shard_map too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from shardlm.mesh import make_mesh
from shardlm.models.moe import MoeMLP, load_balancing_loss
from shardlm.models.precision import Precision
from shardlm.sharding import logical_to_spec, state_shardings, use_mesh_rules

D_MODEL, D_FF, TOP_K = 32, 64, 2
BATCH, SEQ = 16, 8
PARAMS = ("router", "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down")


def make_layer(num_experts: int, shared: bool, seed: int = 0, kernel: str = "auto",
               capacity_factor: float = 0.0, exchange: str = "auto", dropless: str = "rounds") -> MoeMLP:
    with nnx.use_eager_sharding(False):  # placed by the rule table (`state_shardings`), as the trainer does
        return MoeMLP(D_MODEL, D_FF, num_experts, TOP_K, shared_expert=shared, n_layers=2,
                      precision=Precision(jnp.float32, jnp.float32), rngs=nnx.Rngs(seed), kernel=kernel, capacity_factor=capacity_factor,
                      exchange=exchange, dropless=dropless)


def make_x(seed: int = 1) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (BATCH, SEQ, D_MODEL), jnp.float32)


def weights_of(module) -> dict[str, jax.Array]:
    """The layer's parameters (or their gradients, merged into a layer) by name; absent ones left out."""
    return {name: getattr(module, name)[...] for name in PARAMS if getattr(module, name) is not None}


def reference_moe(x, router, w_gate, w_up, w_down, top_k, shared=None):
    """Plain top-k routing and a loop over the experts: each takes the tokens routed to it, applies its SwiGLU
    and scatter-adds the weighted result. `shared`: (gate, up, down) of a dense expert every token gets."""
    b, s, d = x.shape
    xf = x.reshape(b * s, d)
    n = xf.shape[0]
    probs = jax.nn.softmax(xf @ router, axis=-1)
    top_w, top_e = jax.lax.top_k(probs, top_k)
    if top_k > 1:  # Mixtral's renormalised weights; one expert keeps its probability (Switch Transformer's)
        top_w = top_w / top_w.sum(-1, keepdims=True)
    out = jnp.zeros_like(xf)
    for e in range(w_gate.shape[0]):
        hit = top_e == e
        routed = hit.any(-1)
        idx = jnp.nonzero(routed, size=n, fill_value=0)[0]  # its tokens first, then padding (masked below)
        gate = jnp.where(jnp.arange(n) < routed.sum(), (top_w * hit).sum(-1)[idx], 0.0)
        xe = xf[idx]
        ye = (jax.nn.silu(xe @ w_gate[e]) * (xe @ w_up[e])) @ w_down[e]
        out = out.at[idx].add(ye * gate[:, None])
    if shared is not None:
        g, u, dn = shared
        out = out + (jax.nn.silu(xf @ g) * (xf @ u)) @ dn
    return out.reshape(b, s, d)


def reference_loss_and_grads(weights: dict, x):
    """sum(y^2) of the reference and its gradients with respect to every weight and x."""

    def loss(weights, x):
        shared = tuple(weights[n] for n in PARAMS[4:]) if "shared_gate" in weights else None
        y = reference_moe(x, weights["router"], weights["w_gate"], weights["w_up"], weights["w_down"], TOP_K,
                          shared)
        return jnp.sum(y**2), y

    (value, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(weights, x)
    return value, y, grads[0], grads[1]


def layer_loss_fn(graphdef, aux_weight: float):
    """A fresh jitted (state, x) -> (loss, y, stats, grads of state, grad of x), loss = sum(y^2) + aux_weight *
    aux_loss. Fresh per call, since the active mesh rules are read while tracing."""

    def loss(state, x):
        y, stats = nnx.merge(graphdef, state)(x)
        return jnp.sum(y**2) + aux_weight * stats.aux_loss, (y, stats)

    def run(state, x):
        (value, (y, stats)), (g_state, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return value, y, stats, g_state, g_x

    return jax.jit(run)


def layer_forward_fn(graphdef):
    return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))


def assert_close(actual, expected, rel=1e-5, what=""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = max(float(np.abs(expected).max()), 1e-30)
    err = float(np.abs(actual - expected).max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} at scale {scale:.3g}"


def assert_grads_close(layer_grads: dict, ref_grads: dict, rel=1e-5):
    assert set(layer_grads) == set(ref_grads)
    for name in ref_grads:
        assert_close(layer_grads[name], ref_grads[name], rel, f"d loss / d {name}")


# --- one device against the per-expert loop ---------------------------------------------------------------------


# (The grouped kernels, GPUs' Triton kernel and TPUs' Megablox, interpreted here, against the same reference:
# test_expert_without_tokens; against one device under expert parallelism: test_grouped_kernels_under_...)
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
def test_layer_matches_reference(num_experts, shared):
    layer, x = make_layer(num_experts, shared), make_x()
    graphdef, state = nnx.split(layer)
    value, y, stats, g_state, g_x = layer_loss_fn(graphdef, 0.0)(state, x)
    ref_value, ref_y, ref_g, ref_gx = reference_loss_and_grads(weights_of(layer), x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, ref_y, what="y")
    assert_close(value, ref_value, what="loss")
    assert_close(g_x, ref_gx, what="d loss / d x")
    assert_grads_close(weights_of(nnx.merge(graphdef, g_state)), ref_g)
    assert float(stats.expert_tokens.sum()) == BATCH * SEQ * TOP_K


@pytest.mark.parametrize("kernel", ["auto", "triton", "megablox"])
def test_expert_without_tokens(kernel):
    """Expert 3's router column is -10 on a feature that is always 1 and 0 elsewhere: it is never in the top 2.
    Its group is empty in every grouped kernel: a zero output and an exactly zero gradient."""
    layer, unused = make_layer(4, shared=False, kernel=kernel), 3
    x = make_x().at[..., 0].set(1.0)
    layer.router[...] = layer.router[...].at[:, unused].set(0.0).at[0, unused].set(-10.0)
    graphdef, state = nnx.split(layer)
    _, y, stats, g_state, g_x = layer_loss_fn(graphdef, 0.0)(state, x)
    _, ref_y, ref_g, ref_gx = reference_loss_and_grads(weights_of(layer), x)
    assert float(stats.expert_tokens[unused]) == 0.0
    assert float(stats.expert_tokens.min(initial=1.0, where=np.arange(4) != unused)) > 0  # the others do get some
    assert_close(y, ref_y, what="y")
    assert_close(g_x, ref_gx, what="d loss / d x")
    grads = weights_of(nnx.merge(graphdef, g_state))
    assert_grads_close(grads, ref_g)
    for name in ("w_gate", "w_up", "w_down"):
        assert np.all(np.asarray(grads[name][unused]) == 0.0), name


def test_xla_grouped_matmul_under_two_vmaps_matches_a_per_group_loop():
    """A pipeline batches the experts' matmul under two vmaps (stages, replicas), where JAX 0.10 cannot lower
    `ragged_dot` itself: shardlm's runs it one element at a time, with the same outputs and gradients, an empty
    group included."""
    from shardlm.kernels.grouped import grouped_matmul

    keys = jax.random.split(jax.random.key(0), 3)
    rows = jax.random.normal(keys[0], (2, 1, 10, 4))
    weights = jax.random.normal(keys[1], (2, 1, 3, 4, 5))
    cotangent = jax.random.normal(keys[2], (2, 1, 10, 5))
    sizes = jnp.array([4, 0, 6], jnp.int32)

    def loop(r, w):  # each group's rows times its weights
        starts = np.concatenate([[0], np.cumsum(sizes)])
        return jnp.concatenate([r[starts[g]:starts[g + 1]] @ w[g] for g in range(3)])

    def loss(matmul):
        return lambda r, w: jnp.sum(jax.vmap(jax.vmap(matmul))(r, w) * cotangent)

    got = jax.jit(jax.value_and_grad(loss(lambda r, w: grouped_matmul(r, w, sizes)), (0, 1)))(rows, weights)
    want = jax.value_and_grad(loss(loop), (0, 1))(rows, weights)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got[1][1][:, :, 1]) == 0.0)  # the empty group's weights get no gradient


def test_the_triton_grouped_matmul_writes_zeros_past_the_groups():
    """An exchange buffer's rows past the groups are padding: the Triton kernel (interpreted, which fills an output
    it does not write with NaN) stores zeros there and gives them zero gradients, with no zero buffer passed in;
    the grouped rows match the per-group loop, an empty group included."""
    from shardlm.kernels.grouped import grouped_matmul

    keys = jax.random.split(jax.random.key(1), 3)
    rows, weights = jax.random.normal(keys[0], (40, 16)), jax.random.normal(keys[1], (3, 16, 32))
    cotangent = jax.random.normal(keys[2], (40, 32))
    sizes = jnp.array([10, 0, 17], jnp.int32)  # 13 rows past the groups

    def loop(r, w):
        return jnp.concatenate([r[:10] @ w[0], r[10:27] @ w[2], jnp.zeros((13, 32))])

    def loss(matmul):
        return lambda r, w: jnp.sum(matmul(r, w) * cotangent)

    triton = lambda r, w: grouped_matmul(r, w, sizes, "triton", interpret=True)  # noqa: E731
    out = np.asarray(jax.jit(triton)(rows, weights))
    assert np.all(out[27:] == 0.0)
    np.testing.assert_allclose(out, np.asarray(loop(rows, weights)), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.value_and_grad(loss(triton), (0, 1)))(rows, weights)
    want = jax.value_and_grad(loss(loop), (0, 1))(rows, weights)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got[1][0][27:]) == 0.0) and np.all(np.asarray(got[1][1][1]) == 0.0)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_router_learns_from_the_language_model_loss_alone(top_k):
    """With the load-balancing loss off, the router's gradient comes from the output alone: non-zero for one expert
    per token too (a renormalised single weight would be 1.0 whatever the router said), and the reference's."""
    with nnx.use_eager_sharding(False):
        layer = MoeMLP(D_MODEL, D_FF, 4, top_k, shared_expert=False, n_layers=2,
                       precision=Precision(jnp.float32, jnp.float32), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    x = make_x()
    _, y, _, g_state, _ = layer_loss_fn(graphdef, 0.0)(state, x)
    router_grad = np.asarray(nnx.merge(graphdef, g_state).router[...])
    assert np.abs(router_grad).max() > 0  # exactly 0 when one weight was renormalised to 1.0

    def reference_loss(router):
        w = weights_of(layer)
        return jnp.sum(reference_moe(x, router, w["w_gate"], w["w_up"], w["w_down"], top_k) ** 2)

    assert_close(router_grad, jax.grad(reference_loss)(layer.router[...]), what="d loss / d router")


# --- the load-balancing loss ------------------------------------------------------------------------------------


def test_aux_loss_by_hand():
    # Two tokens, two experts, k=1, both sent to expert 0: f = (1, 0), P = ((0.75 + 0.5) / 2, (0.25 + 0.5) / 2)
    # = (0.625, 0.375), aux = 2 * (1 * 0.625 + 0 * 0.375) = 1.25.
    probs = jnp.array([[0.75, 0.25], [0.5, 0.5]])
    assert float(load_balancing_loss(probs, jnp.array([[0], [0]]), 2)) == pytest.approx(1.25, abs=1e-7)
    # Three tokens, four experts, k=2: assignments 0,1 | 0,2 | 0,1 -> counts (3, 2, 1, 0), f = counts / 6;
    # P = column means of probs = (0.4, 0.3, 0.2, 0.1); aux = 4 * (3*0.4 + 2*0.3 + 1*0.2 + 0*0.1) / 6 = 4 * 2 / 6.
    probs = jnp.array([[0.5, 0.3, 0.1, 0.1], [0.4, 0.2, 0.3, 0.1], [0.3, 0.4, 0.2, 0.1]])
    experts = jnp.array([[0, 1], [0, 2], [1, 0]])
    assert float(load_balancing_loss(probs, experts, 4)) == pytest.approx(4 * 2 / 6, abs=1e-6)


def test_aux_loss_balanced_is_one():
    """Equal counts give sum_e P_e = 1 whatever the probabilities, for k = 1 and k = 2."""
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (4, 4)), axis=-1)
    assert float(load_balancing_loss(probs, jnp.array([[0], [1], [2], [3]]), 4)) == pytest.approx(1.0, abs=1e-6)
    assert float(load_balancing_loss(probs, jnp.array([[0, 1], [2, 3], [1, 0], [3, 2]]), 4)) == pytest.approx(
        1.0, abs=1e-6)
    uniform = jnp.full((8, 4), 0.25)
    assert float(load_balancing_loss(uniform, jnp.arange(16).reshape(8, 2) % 4, 4)) == pytest.approx(1.0, abs=1e-7)


# --- expert parallelism on 8 devices ----------------------------------------------------------------------------

MESHES = {  # name: make_mesh degrees
    "EP 2 x DP 4": dict(data=4, expert=2),
    "EP 4 x DP 2": dict(data=2, expert=4),
    "EP 8": dict(data=1, expert=8),
    "EP 2 x FSDP 2 x TP 2": dict(data=1, fsdp=2, expert=2, tensor=2),
    "DP 4 x TP 2 (no EP)": dict(data=4, tensor=2),
}


@pytest.fixture(scope="module")
def one_device():
    """The E=8 layer with a shared expert, its input, and its loss (sum(y^2) + aux) and gradients on one device."""
    layer, x = make_layer(8, shared=True), make_x()
    graphdef, state = nnx.split(layer)
    value, y, stats, g_state, g_x = layer_loss_fn(graphdef, 1.0)(state, x)
    return dict(graphdef=graphdef, state=state, x=x, value=value, y=y, stats=stats,
                grads=weights_of(nnx.merge(graphdef, g_state)), g_x=g_x)


@pytest.fixture(scope="module", params=list(MESHES))
def on_mesh(request, one_device):
    """The same layer placed on a mesh: its loss, gradients, stats and the compiled forward program's text."""
    degrees = MESHES[request.param]
    mesh = make_mesh(**degrees, devices=jax.devices()[:8])
    graphdef, state, x = one_device["graphdef"], one_device["state"], one_device["x"]
    state = jax.device_put(state, state_shardings(state, mesh))
    x_spec = logical_to_spec(("batch", "seq", "act_embed"), shape=x.shape, mesh=mesh)
    x = jax.device_put(x, NamedSharding(mesh, x_spec))
    with use_mesh_rules(mesh):
        value, y, stats, g_state, g_x = layer_loss_fn(graphdef, 1.0)(state, x)
        forward_hlo = layer_forward_fn(graphdef).lower(state, x).compile().as_text()
    return dict(degrees=degrees, mesh=mesh, state=state, value=value, y=y, stats=stats,
                grads=weights_of(nnx.merge(graphdef, g_state)), g_x=g_x, forward_hlo=forward_hlo)


def test_expert_parallel_matches_one_device(on_mesh, one_device):
    assert_close(on_mesh["y"], one_device["y"], what="y")
    assert_close(on_mesh["value"], one_device["value"], what="loss")
    assert_close(on_mesh["g_x"], one_device["g_x"], what="d loss / d x")
    assert_grads_close(on_mesh["grads"], one_device["grads"])


def test_stats_are_global(on_mesh, one_device):
    np.testing.assert_array_equal(np.asarray(on_mesh["stats"].expert_tokens),
                                  np.asarray(one_device["stats"].expert_tokens))
    assert float(on_mesh["stats"].aux_loss) == pytest.approx(float(one_device["stats"].aux_loss), rel=1e-6)
    assert float(one_device["stats"].expert_tokens.sum()) == BATCH * SEQ * TOP_K


def test_what_overflows_the_first_round_is_counted(on_mesh, one_device):
    """Dropless in rounds: each device's first round to each expert device carries its balanced share, ceil(T x k /
    EP) rows; the rest go in later rounds and are counted. By hand from the one-device routing, each device's
    tokens being a contiguous block of the batch: random routing overflows the first round on every expert split
    here, and the layer above still matches one device."""
    degrees = on_mesh["degrees"]
    ep = degrees.get("expert", 1)
    blocks = degrees.get("data", 1) * degrees.get("fsdp", 1) * ep
    state = one_device["state"]
    xf = np.asarray(one_device["x"]).reshape(blocks, -1, D_MODEL)
    experts = np.asarray(jax.lax.top_k(xf @ np.asarray(state["router"][...]), TOP_K)[1])  # [blocks, T, k]
    first = -(-xf.shape[1] * TOP_K // ep)
    per_pair = np.stack([np.bincount(e.reshape(-1) // (8 // ep), minlength=ep) for e in experts])
    expected = np.clip(per_pair - first, 0, None).sum() if ep > 1 else 0
    assert float(on_mesh["stats"].overflow) == expected
    assert (expected > 0) == (ep > 1)


def test_tokens_travel_by_all_to_all(on_mesh):
    count = on_mesh["forward_hlo"].count("all-to-all(")
    if on_mesh["degrees"].get("expert", 1) > 1:
        assert count >= 2, "the forward pass sends assignments to their experts and the results back"
    else:
        assert count == 0


def test_expert_weights_split_over_expert_devices(on_mesh):
    degrees, state = on_mesh["degrees"], on_mesh["state"]
    ep = degrees.get("expert", 1)
    split = ep * degrees.get("fsdp", 1) * degrees.get("tensor", 1)  # experts, embed and mlp dimensions
    for name in ("w_gate", "w_up", "w_down"):
        arr = state[name][...]
        shard = arr.addressable_shards[0].data
        assert shard.shape[0] == 8 // ep, name
        assert shard.nbytes * split == arr.nbytes, name
        if split == ep:
            assert shard.nbytes * ep == arr.nbytes  # pure EP: each device holds 1/EP of the experts' bytes


@pytest.mark.parametrize("dropless", ["rounds", "buffer"])
def test_expert_parallel_is_dropless_under_skew(one_device, dropless):
    """The worst case for a dropless exchange: every token picks experts 0 and 1, both held by expert device 0 of
    4, so every device sends it all its 32 assignments (T_local * min(k, E / EP)) and the others nothing. In
    rounds, the first carries the balanced share (ceil(16 x 2 / 4) = 8 per pair) and 24 later rounds of 1 the
    rest, counted as overflow (8 devices x 24); the buffer holds all 32 at once. Against the float64 per-expert
    loop, without the load-balancing loss: under routing this saturated its gradient is a float32 cancellation
    whose rounding depends on how the sums are split (the host's CPU too)."""
    layer = make_layer(8, shared=False, dropless=dropless)
    x = one_device["x"].at[..., 0].set(1.0)
    layer.router[...] = layer.router[...].at[0, :2].set(10.0)
    graphdef, state = nnx.split(layer)
    _, ref_y, ref_g, ref_gx = reference_loss_and_grads(weights_of(layer), x)
    mesh = make_mesh(data=2, expert=4, devices=jax.devices()[:8])
    placed = jax.device_put(state, state_shardings(state, mesh))
    with use_mesh_rules(mesh):
        _, y_ep, stats_ep, g_state_ep, g_x_ep = layer_loss_fn(graphdef, 0.0)(placed, x)
    np.testing.assert_array_equal(np.asarray(stats_ep.expert_tokens), [BATCH * SEQ] * 2 + [0] * 6)
    assert float(stats_ep.dropped) == 0.0
    assert float(stats_ep.overflow) == (8 * (32 - 8) if dropless == "rounds" else 0)
    assert_close(y_ep, ref_y, what="y")
    assert_close(g_x_ep, ref_gx, what="d loss / d x")
    assert_grads_close(weights_of(nnx.merge(graphdef, g_state_ep)), ref_g)


@pytest.mark.parametrize("kernel", ["triton", "megablox"])
def test_grouped_kernels_under_expert_parallelism_match_one_device(one_device, kernel):
    """EP 2 x FSDP 2 x TP 2 with a grouped kernel (interpreted) on the received exchange buffer, whose rows past
    the groups are padding: the same loss and gradients as one device with XLA's ragged_dot."""
    graphdef, state = nnx.split(make_layer(8, shared=True, kernel=kernel))  # the same seed: the same weights
    mesh = make_mesh(data=1, fsdp=2, expert=2, tensor=2, devices=jax.devices()[:8])
    state = jax.device_put(state, state_shardings(state, mesh))
    x = one_device["x"]
    x = jax.device_put(x, NamedSharding(mesh, logical_to_spec(("batch", "seq", "act_embed"), shape=x.shape,
                                                              mesh=mesh)))
    with use_mesh_rules(mesh):
        value, y, stats, g_state, g_x = layer_loss_fn(graphdef, 1.0)(state, x)
    assert_close(y, one_device["y"], what="y")
    assert_close(value, one_device["value"], what="loss")
    assert_close(g_x, one_device["g_x"], what="d loss / d x")
    assert_grads_close(weights_of(nnx.merge(graphdef, g_state)), one_device["grads"])



def _on_mesh(layer, x, degrees):
    """(loss, y, stats, grads by name, grad of x) of `layer` on an 8-device mesh of `degrees`."""
    graphdef, state = nnx.split(layer)
    mesh = make_mesh(**degrees, devices=jax.devices()[:8])
    state = jax.device_put(state, state_shardings(state, mesh))
    x = jax.device_put(x, NamedSharding(mesh, logical_to_spec(("batch", "seq", "act_embed"), shape=x.shape,
                                                              mesh=mesh)))
    with use_mesh_rules(mesh):
        value, y, stats, g_state, g_x = layer_loss_fn(graphdef, 1.0)(state, x)
    return value, y, stats, weights_of(nnx.merge(graphdef, g_state)), g_x


def test_a_capacity_that_drops_nothing_gives_the_dropless_layer(one_device):
    """EP 2 x FSDP 2 x TP 2 with capacity factor 1.5: each device sends each expert device at most 24 of its 32
    assignments (the dropless buffer holds 32), which this routing never exceeds: the same loss and gradients."""
    value, y, stats, grads, g_x = _on_mesh(make_layer(8, shared=True, capacity_factor=1.5), one_device["x"],
                                           dict(data=1, fsdp=2, expert=2, tensor=2))
    assert float(stats.dropped) == 0.0
    assert_close(y, one_device["y"], what="y")
    assert_close(value, one_device["value"], what="loss")
    assert_close(g_x, one_device["g_x"], what="d loss / d x")
    assert_grads_close(grads, one_device["grads"])


def test_the_ragged_exchange_gives_the_fixed_exchanges_layer(one_device):
    """`model.moe_exchange=ragged` (GPUs' and TPUs' `ragged_all_to_all`; here its emulation, XLA:CPU lacking the
    collective) on EP 4 x DP 2, both ways, with a capacity (3: a bounded buffer of 24 of the dropless 32 rows per
    pair that this routing never fills, so the kept counts are sent): the same loss and gradients as one device."""
    value, y, stats, grads, g_x = _on_mesh(make_layer(8, shared=True, capacity_factor=3.0, exchange="ragged"),
                                           one_device["x"], dict(data=2, expert=4))
    assert float(stats.dropped) == 0.0
    assert_close(y, one_device["y"], what="y")
    assert_close(value, one_device["value"], what="loss")
    assert_close(g_x, one_device["g_x"], what="d loss / d x")
    assert_grads_close(grads, one_device["grads"])


def test_the_emulated_ragged_all_to_all_sends_each_peer_its_rows_where_the_sender_says():
    """4 devices, each with 12 rows: device s sends device p rows [3p, 3p + n) with n = (s + p) % 4 (at most 3),
    to be written from offset 3 s of p's buffer. By hand: the received block from s holds s's rows, then zeros."""
    from jax.sharding import PartitionSpec as P

    from shardlm.kernels.exchange import emulated_ragged_all_to_all

    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    rows = jnp.arange(4 * 12, dtype=jnp.float32).reshape(48, 1) + 1  # device s holds 12 s + 1 .. 12 s + 12

    def per_device(operand):
        s = jax.lax.axis_index("x")
        peers = jnp.arange(4, dtype=jnp.int32)
        send = (s + peers) % 4
        return emulated_ragged_all_to_all(operand, jnp.zeros_like(operand), peers * 3, send,
                                          jnp.full((4,), 3 * s, jnp.int32), (peers + s) % 4, axis_name="x")

    got = np.asarray(jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
        jax.device_put(rows, NamedSharding(mesh, P("x"))))).reshape(4, 4, 3)  # [receiver, sender, row]
    for p in range(4):
        for s in range(4):
            n = (s + p) % 4
            want = [12 * s + 3 * p + r + 1 if r < n else 0 for r in range(3)]
            assert list(got[p, s]) == want, (p, s)


def test_capacity_drops_what_overflows_and_counts_it(one_device):
    """Every token picks experts 0 and 1, both on expert device 0 of EP 4 x DP 2 (8 devices of 16 tokens). At
    capacity factor 1.0 a device may send it ceil(16 x 2 / 4) = 8 of its 32 assignments: expert 0's rows come
    first in the block, in token order, so its first 8 tokens (the first of its two sequences) keep expert 0 and
    lose expert 1, and the other 8 lose both. Dropped: 8 devices x 24 = 192 of 256, logged as 75%."""
    from shardlm.train.step import model_metrics

    layer = make_layer(8, shared=False, capacity_factor=1.0)
    x = one_device["x"].at[..., 0].set(1.0)
    layer.router[...] = layer.router[...].at[0, :2].set(10.0)
    _, y, stats, _, _ = _on_mesh(layer, x, dict(data=2, expert=4))
    assert float(stats.dropped) == 8 * (16 * 2 - 8)
    metrics = model_metrics({"aux_loss": stats.aux_loss, "expert_tokens": stats.expert_tokens,
                             "moe_dropped": stats.dropped})
    assert float(metrics["moe_dropped"]) == pytest.approx(192 / 256)
    # by hand: expert 0's output times its routing weight on even sequences, nothing on odd ones
    xf = x.reshape(-1, D_MODEL)
    probs = jax.nn.softmax(xf @ layer.router[...], axis=-1)
    top_w, top_e = jax.lax.top_k(probs, TOP_K)
    weight0 = ((top_w / top_w.sum(-1, keepdims=True)) * (top_e == 0)).sum(-1)
    expert0 = (jax.nn.silu(xf @ layer.w_gate[0]) * (xf @ layer.w_up[0])) @ layer.w_down[0]
    keeps = (jnp.arange(BATCH) % 2 == 0).repeat(SEQ)
    assert_close(y.reshape(-1, D_MODEL), jnp.where(keeps[:, None], weight0[:, None] * expert0, 0.0), what="y")
