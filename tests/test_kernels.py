"""The attention kernels below the models (`shardlm.kernels`), against XLA's attention on the same inputs: ring
attention over 2, 4 and 8 simulated devices in the zigzag layout with each per-chunk kernel the ring can run here
(the blockwise kernel in plain JAX, and Pallas's splash kernel interpreted, the TPU's), forward and gradient, and
the zigzag permutation's round trip; splash's blocks at lengths that are not a power of two, the blockwise kernel at
a prime length, what the blockwise kernel's backward pass recomputes in a train step, and cuDNN's kernel asked for
where it cannot run."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from conftest import MICRO
from shardlm.accelerator import compiling_for
from shardlm.config import load_config
from shardlm.errors import ShardlmError
from shardlm.kernels.attention import xla_attention
from shardlm.kernels.flash import blocking, blockwise_attention
from shardlm.kernels.ring import from_zigzag, ring_attention, to_zigzag, zigzag_order
from shardlm.kernels.splash import LANES, _kernel, splash_attention, splash_block
from shardlm.kernels.registry import attention_impl, chunk_kernel, ring_chunk
from shardlm.perf import targets

H100, V5E, V5P = targets.get("h100"), targets.get("tpu-v5e"), targets.get("tpu-v5p")


def _inputs(length: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 64):
    """Queries, grouped-query keys and values, and a cotangent, float32 [2, length, heads, head_dim]."""
    ks = jax.random.split(jax.random.key(0), 4)
    q, w = (jax.random.normal(key, (2, length, heads, head_dim)) for key in (ks[0], ks[3]))
    k, v = (jax.random.normal(key, (2, length, kv_heads, head_dim)) for key in ks[1:3])
    return q, k, v, w


@pytest.mark.parametrize("kernel, devices, length", [("flash", 2, 64), ("flash", 4, 128), ("flash", 8, 256),
                                                     ("flash", 2, 44), ("splash", 2, 512)])
def test_ring_attention_matches_xla_attention_forward_and_backward(kernel, devices, length):
    """Blocks of 16 for the blockwise kernel (several per chunk), 128 for splash (its lane width: 2 per chunk). 44
    positions on 2 devices are chunks of 11, a prime: the blockwise kernel pads them to its blocks."""
    q, k, v, w = _inputs(length)
    mask = jnp.tril(jnp.ones((length, length), bool))[None, None]
    mesh = Mesh(np.array(jax.devices()[:devices]), ("context",))
    chunk = chunk_kernel(kernel, block=128 if kernel == "splash" else 16, interpret=True)
    per_device = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis=("context",), devices=devices,
                                                              kernel=chunk),
                               mesh=mesh, in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"),
                               check_vma=False)

    def ring(q, k, v):
        zig = lambda x: to_zigzag(x, devices)  # noqa: E731
        return (from_zigzag(per_device(zig(q), zig(k), zig(v)), devices) * w).sum()

    want, want_grads = jax.value_and_grad(lambda q, k, v: (xla_attention(q, k, v, mask) * w).sum(),
                                          argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.jit(jax.value_and_grad(ring, argnums=(0, 1, 2)))(q, k, v)
    assert abs(float(got - want)) <= 1e-5 * abs(float(want))
    for name, a, b in zip("qkv", want_grads, got_grads):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(a).max()), name


def test_a_longer_ring_traces_to_the_same_program():
    """The ring's middle steps are a loop: its forward and backward trace to as many operations for 8 devices as
    for 4 (unrolled, a 64-device context split took 15 s to trace and 43 s to compile for gpt2-small)."""
    def traced_ops(devices):
        q, k, v, _ = _inputs(32 * devices)
        mesh = Mesh(np.array(jax.devices()[:devices]), ("context",))
        per_device = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis=("context",), devices=devices,
                                                                  kernel=chunk_kernel("flash", block=16)),
                                   mesh=mesh, in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"),
                                   check_vma=False)
        jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: per_device(q, k, v).sum(), argnums=(0, 1, 2)))(q, k, v)
        return str(jaxpr).count("ppermute"), len(str(jaxpr).splitlines())

    assert traced_ops(8) == traced_ops(4)


def test_the_zigzag_layout_is_a_permutation_and_round_trips():
    x = jnp.arange(2 * 48 * 3).reshape(2, 48, 3)
    for devices in (1, 2, 4, 8):
        order = zigzag_order(48, devices)
        assert sorted(order.tolist()) == list(range(48))
        np.testing.assert_array_equal(to_zigzag(x, devices), x[:, order])
        np.testing.assert_array_equal(from_zigzag(to_zigzag(x, devices), devices), x)
    # device i holds chunks i and 2N - 1 - i of 2N: with 4 devices of 12 rows, device 1 holds 6..11 and 36..41
    assert zigzag_order(48, 4)[12:24].tolist() == list(range(6, 12)) + list(range(36, 42))


def _attention_and_grads(attend, q, k, v, w):
    """(sum(attend(q, k, v) * w), its gradients by q, k and v), jitted."""
    return jax.jit(jax.value_and_grad(lambda q, k, v: (attend(q, k, v) * w).sum(), argnums=(0, 1, 2)))(q, k, v)


def _assert_matches_xla_attention(attend, q, k, v, w):
    length = q.shape[1]
    mask = jnp.tril(jnp.ones((length, length), bool))[None, None]
    want, want_grads = _attention_and_grads(lambda q, k, v: xla_attention(q, k, v, mask), q, k, v, w)
    got, got_grads = _attention_and_grads(attend, q, k, v, w)
    assert abs(float(got - want)) <= 1e-5 * abs(float(want))
    for name, a, b in zip("qkv", want_grads, got_grads):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(a).max()), name


@pytest.mark.parametrize("length", [640, 1280, 1920])
def test_splash_blocks_are_multiples_of_128_dividing_the_length(length):
    """The largest divisor of T up to the block was 320 for 640 and 1280, and 480 for 1920, which the TPU kernel
    refuses (`bkv_compute=320 must be a multiple of 128`): splash's blocks, in every one of its kernels, are the
    largest multiple of 128 dividing T up to max(128, model.attention_block), and the model's gates ask the same."""
    for block in (512, 100, 1024):
        most = max(LANES, block)
        sizes = _kernel(length, length, 2, True, block, True).kwargs["block_sizes"]
        chosen = {getattr(sizes, f) for f in ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
                                              "block_kv_dkv_compute", "block_q_dq", "block_kv_dq")}
        assert chosen == {splash_block(length, block)}, (block, sizes)
        (size,) = chosen
        assert size % LANES == 0 and length % size == 0 and size <= most, (block, size)
        assert not [m for m in range(size + LANES, most + 1, LANES) if length % m == 0], (block, size)  # the largest
    assert splash_block(length + 64) == 0  # no multiple of 128 divides it
    with compiling_for(V5P.accelerator):
        assert attention_impl("auto", jnp.bfloat16, 64, length=length) == "splash"
        assert attention_impl("splash", jnp.bfloat16, 64, length=length, block=100) == "splash"
        assert ring_chunk("auto", jnp.bfloat16, 64, 4 * length, 2) == "splash"  # chunks of T
        with pytest.raises(ShardlmError, match="multiple of 128"):
            attention_impl("splash", jnp.bfloat16, 64, length=length + 64)


def test_splash_at_640_positions_matches_xla_attention():
    """Pallas's splash kernel (interpreted) at a length that is a multiple of 128 but not of 512: blocks of 128,
    forward and gradient; grouped-query heads."""
    q, k, v, w = _inputs(640, heads=2, kv_heads=1)
    _assert_matches_xla_attention(lambda q, k, v: splash_attention(q, k, v, block=512, interpret=True),
                                  q[:1], k[:1], v[:1], w[:1])


def _scan_lengths(jaxpr) -> set[int]:
    """The trip counts of every loop (`scan`, `lax.map`) in a jaxpr and the jaxprs inside it."""
    lengths = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            lengths.add(eqn.params["length"])
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    lengths |= _scan_lengths(inner)
    return lengths


def test_the_blockwise_kernel_pads_a_prime_length_to_whole_blocks():
    """131 positions (a prime) in blocks of at most 32: ceil(131 / 32) = 5 blocks of queries and of keys, the rows
    past 131 padding (before: a divisor of 131, blocks of 1 row, 131 x 131 of them; 17-19x the time at 1,031 against
    1,024). Forward and gradient match XLA's attention; the padded rows leave no trace."""
    length, most = 131, 32
    size, count = blocking(length, most)
    assert count == math.ceil(length / most) and size <= most and size * count >= length > size * (count - 1)
    q, k, v, w = _inputs(length)
    pos = jnp.arange(length, dtype=jnp.int32)
    attend = lambda q, k, v: blockwise_attention(q, k, v, pos, pos, block_q=most, block_k=most)  # noqa: E731
    _assert_matches_xla_attention(attend, q, k, v, w)
    # every loop of the forward and backward passes runs over the 5 blocks
    step = jax.make_jaxpr(jax.grad(lambda q, k, v: (attend(q, k, v) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
    assert _scan_lengths(step.jaxpr) == {count}


def _step_matmul_flops(*overrides) -> float:
    """The matmul FLOPs of a train step's jaxpr on one device (`flops.jaxpr_matmul_flops`, what the planner and
    `--compile-only` count)."""
    from shardlm.flops import jaxpr_matmul_flops
    from shardlm.mesh import make_mesh
    from shardlm.train.state import TrainState, abstract_train_state
    from shardlm.train.step import batch_struct, train_step_for

    cfg = load_config(None, MICRO + ["model.attention_block=8", *overrides])
    mesh = make_mesh(devices=jax.devices()[:1])
    _, graphdef, abstract, shardings = abstract_train_state(cfg, mesh, 500)
    step = train_step_for(cfg, TrainState(graphdef, abstract, shardings), mesh)
    return jaxpr_matmul_flops(step.trace(abstract, batch_struct(cfg, mesh)).jaxpr)


def test_the_blockwise_kernels_forward_pass_runs_once_under_remat_none():
    """The kernel's residuals (output and log-sum-exp) are named for the remat policies: under `none` and
    `save_attention` a train step does the matmuls XLA's attention does, no second forward pass (before: one more
    attention forward under each); under `full`, which recomputes the block, one more QK^T per layer, the kernel's
    backward pass recomputing the scores that XLA's recomputed forward pass keeps."""
    rows, m = 2, load_config(None, MICRO).model
    scores = 2 * rows * m.n_layers * m.seq_len ** 2 * m.d_model  # every layer's QK^T, 2 FLOPs a multiply-add
    for remat in ("none", "save_attention", "full"):
        xla, flash = (_step_matmul_flops(f"model.attention={kernel}", f"model.remat={remat}",
                                         f"train.batch_size={rows}") for kernel in ("xla", "flash"))
        assert flash - xla == (scores if remat == "full" else 0), (remat, flash, xla)


def test_cudnn_where_it_cannot_run_is_one_line_said_for_the_target(tmp_path):
    """model.attention=cudnn on this CPU host: a one-line error naming the problem and the fix (before: cuDNN's
    traceback, `RuntimeError: cuDNN is not detected`), for a sequence and for the ring's chunks, and from `train`
    before it writes the run directory (it traces the step before claiming it). Compiling for an H100 from the same
    host takes it in bfloat16; in float32 it is the same kind of error (before: a KeyError from inside JAX). A model
    configured so still generates here (XLA's attention for the prefill)."""
    from shardlm.train.loop import train
    from shardlm.train.source import model_source

    def refusal(*args, ring=False):
        with pytest.raises(ShardlmError) as e:
            ring_chunk("cudnn", *args, 1024, 2) if ring else attention_impl("cudnn", *args, length=1024)
        assert "\n" not in str(e.value) and str(e.value).endswith("model.attention=auto or xla")
        return str(e.value)

    for ring in (False, True):
        assert "needs an NVIDIA GPU of compute capability 8.0 or newer, and this run is on cpu" in refusal(
            jnp.bfloat16, 64, ring=ring)
        with compiling_for(V5E.accelerator):
            assert "this run is on TPU v5 lite" in refusal(jnp.bfloat16, 64, ring=ring)
        with compiling_for(H100.accelerator):
            assert "takes 16-bit inputs only, and model.dtype is float32" in refusal(jnp.float32, 64, ring=ring)
            assert (ring_chunk("cudnn", jnp.bfloat16, 64, 1024, 2) if ring else
                    attention_impl("cudnn", jnp.bfloat16, 64, length=1024)) == "cudnn"
            assert "head sizes that are multiples of 8 up to 256 on NVIDIA H100" in refusal(jnp.bfloat16, 260, ring=ring)
    with compiling_for(H100.accelerator):
        # an odd length (a sequence, or a ring's chunk): JAX's cuDNN attention raised NotImplementedError while
        # tracing, `auto` included; `auto` now takes another kernel, and asked for by name it is one line
        with pytest.raises(ShardlmError, match="takes an even number of positions .* this pass has 97"):
            attention_impl("cudnn", jnp.bfloat16, 64, length=97)
        with pytest.raises(ShardlmError, match="this pass has 25"):
            ring_chunk("cudnn", jnp.bfloat16, 64, 100, 2)
        assert attention_impl("auto", jnp.bfloat16, 64, length=97) == "xla"
        assert ring_chunk("auto", jnp.bfloat16, 64, 100, 2) == "flash"
        assert attention_impl("auto", jnp.bfloat16, 64, length=98) == "cudnn"
    cfg = load_config(None, MICRO + ["model.attention=cudnn", "train.steps=1"])
    with pytest.raises(ShardlmError, match="model.attention=cudnn needs an NVIDIA GPU") as e:
        train(cfg, tmp_path / "run", progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()  # said before anything is written
    with nnx.use_eager_sharding(False):
        model = model_source(cfg).factory(500, 1)()
    tokens = jnp.ones((1, 8), jnp.int32)
    logits, _ = model.prefill(tokens, model.init_cache(1))
    assert bool(jnp.isfinite(logits[..., :500]).all())  # (the padded vocabulary's columns are -inf)
