"""A tensor group's all-gather hidden behind its GEMM by hand (a collective matmul), against XLA's gather then GEMM,
compiled for 4 H100s from this CPU host (docs/strategies.md, sequence parallelism; nothing runs on a GPU).

The case is the sequence-parallel column projection: x [1, 4096, 8192] split over the sequence, w [8192, 57344]
split over its columns, the output split over its columns; forward and backward (the gradient of a sum of
squares). Two programs:
- plain: a sharding constraint gathers x, then one einsum (what the blocks compile, and XLA:GPU keeps as one
  all-gather and one GEMM even when asked for a windowed einsum);
- ring: a `shard_map` over the group where each device multiplies the chunk of x it holds while passing it to its
  neighbour (`ppermute`), placing each product at its chunk's position; a custom VJP computes the input's
  gradient by the reverse ring (each partial sum passed on and added to) and the weight's in one GEMM over the
  gathered x the forward pass kept.

First the ring is checked against the plain einsum on 4 CPU devices (forward and both gradients), then both are
compiled for H100s and shardlm's per-kernel estimate (`shardlm.perf.timeline`) printed: kernels, collectives left
exposed by XLA:GPU's schedule, and the step.

    python benchmarks/collective_matmul.py     # about 10 seconds on a 2-core VM

"Compiled for", not "measured on".
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardlm.perf import targets  # noqa: E402
from shardlm.perf.compiled import compile_step  # noqa: E402
from shardlm.perf.timeline import step_estimate  # noqa: E402

AXIS = "tensor"
X_SPEC, W_SPEC, OUT_SPEC = P(None, AXIS, None), P(None, AXIS), P(None, None, AXIS)


def _ring_forward(x, w):
    """(x gathered into w, x gathered): chunk j of the sequence arrives from device j, multiplied as it arrives."""
    n, size, idx = x.shape[1], jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    to_left = [(j, (j - 1) % size) for j in range(size)]
    out = jnp.zeros((x.shape[0], size * n, w.shape[1]), x.dtype)
    gathered = jnp.zeros((x.shape[0], size * n, x.shape[2]), x.dtype)
    chunk = x
    for step in range(size):
        arriving = jax.lax.ppermute(chunk, AXIS, to_left) if step < size - 1 else None
        at = ((idx + step) % size) * n
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.einsum("bsd,df->bsf", chunk, w), at, axis=1)
        gathered = jax.lax.dynamic_update_slice_in_dim(gathered, chunk, at, axis=1)
        chunk = arriving
    return out, gathered


@jax.custom_vjp
def ring_matmul(x, w):
    return _ring_forward(x, w)[0]


def _ring_fwd(x, w):
    out, gathered = _ring_forward(x, w)
    return out, (gathered, w)


def _ring_bwd(residuals, dy):
    gathered, w = residuals
    size, idx = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    n = gathered.shape[1] // size
    to_left = [(j, (j - 1) % size) for j in range(size)]
    dx = None
    for step in range(size):  # the sum for chunk c starts on device c + 1 and reaches c after size - 1 hops
        c = (idx + step + 1) % size
        part = jnp.einsum("bsf,df->bsd", jax.lax.dynamic_slice_in_dim(dy, c * n, n, axis=1), w)
        dx = part if dx is None else jax.lax.ppermute(dx, AXIS, to_left) + part
    return dx, jnp.einsum("bsd,bsf->df", gathered, dy)


ring_matmul.defvjp(_ring_fwd, _ring_bwd)


def programs(mesh):
    def plain(x, w):
        gathered = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))
        return jax.lax.with_sharding_constraint(jnp.einsum("bsd,df->bsf", gathered, w), NamedSharding(mesh, OUT_SPEC))

    def ring(x, w):
        return jax.shard_map(ring_matmul, mesh=mesh, in_specs=(X_SPEC, W_SPEC), out_specs=OUT_SPEC,
                             check_vma=False)(x, w)

    return {"plain": plain, "ring": ring}


def value_and_grads(f, weights=None):
    def loss(x, w):
        y = f(x, w).astype(jnp.float32)
        return jnp.sum(y * weights) if weights is not None else jnp.sum(y ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def check_on_cpu() -> float:
    """The ring's forward and gradients against the plain einsum on 4 CPU devices: the largest difference."""
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), (AXIS,))
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.device_put(jax.random.normal(kx, (2, 16, 8)), NamedSharding(mesh, X_SPEC))
    w = jax.device_put(jax.random.normal(kw, (8, 12)), NamedSharding(mesh, W_SPEC))
    weights = jax.random.normal(kc, (2, 16, 12))
    want = value_and_grads(lambda x, w: jnp.einsum("bsd,df->bsf", x, w), weights)(x, w)
    got = value_and_grads(programs(mesh)["ring"], weights)(x, w)
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def main():
    print(f"ring against the plain einsum on 4 CPU devices: largest difference {check_on_cpu():.2g}")
    h100 = targets.get("h100")
    mesh = Mesh(targets.topology(h100, 4).devices, (AXIS,))
    x = jax.ShapeDtypeStruct((1, 4096, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, X_SPEC))
    w = jax.ShapeDtypeStruct((8192, 57344), jnp.bfloat16, sharding=NamedSharding(mesh, W_SPEC))
    hardware = h100.hardware("bfloat16", 4, None)
    steps = {}
    for name, f in programs(mesh).items():
        with targets.tracing_for(h100):
            lowered = value_and_grads(f).trace(x, w).lower()
        step = compile_step(lowered, 4, platform="gpu")
        est = step_estimate(step.program, step.flops_per_device, step.collectives, 4, hardware)
        steps[name] = est.compute_s + est.comm_s
        kinds = ", ".join(f"{kind} {s * 1e3:.2f}" for kind, s in sorted(est.by_kind.items()))
        print(f"{name:5s} compiled for 4 H100s: step {steps[name] * 1e3:.2f} ms = kernels {est.compute_s * 1e3:.2f} "
              f"({kinds}) + exposed collectives {est.comm_s * 1e3:.2f} of {est.comm_total_s * 1e3:.2f} ms")
    print(f"ring / plain: {steps['ring'] / steps['plain']:.3f}")


if __name__ == "__main__":
    main()
