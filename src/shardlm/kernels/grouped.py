"""Grouped matmuls: rows sorted into groups (a mixture's tokens by expert), each group multiplied by its own
weights, in work proportional to the rows. `jax.lax.ragged_dot` says this, but XLA:GPU and XLA:CPU lower it to a
dense matmul over every group's weights (each row times every expert: G times the work), so the GPU path here is
a Pallas kernel of shardlm's own, compiled by Triton, and TPUs get JAX's Megablox.

    grouped_matmul(rows [M, K], weights [G, K, N], group_sizes [G], kernel) -> [M, N]

Group g is the next group_sizes[g] rows; rows past the last group come out zero (and get zero gradients).

Design choices:
- Three kernels behind one function (`KERNELS`): `xla` is `jax.lax.ragged_dot` (exact everywhere; dense work off
  TPUs); `triton` is the Pallas kernel below (NVIDIA GPUs; the CPU tests run the same kernel in Pallas's interpret
  mode); `megablox` is JAX's Pallas TPU grouped matmul (`jax.experimental.pallas.ops.tpu.megablox`), with its
  own gradient kernels, where K and N are multiples of 128 (elsewhere XLA:TPU's own ragged_dot).
- The Triton kernel's grid is (row tiles, column blocks). A row tile is up to `block_m` rows of one group: each
  group is cut into tiles of its own, so a tile never straddles two groups and multiplies by one expert's weights
  (MegaBlocks' and Megablox's layout, without padding the rows). The tiles' table (group, first row, rows) is
  built in XLA before the call, for the most tiles the sizes allow, cdiv(M, block_m) + G; unused tiles do
  nothing. A tile reads its rows as one block that stays inside the array (moved back from the end where a group
  ends within block_m of it) and masks out rows not its own, so no load is out of bounds, in Triton or in
  interpret mode. Rows past the groups are one more group whose tiles store zeros, so every row is written once.
  (An aliased zero buffer did the same at a cost: XLA hoisted it out of the scan over layers and copied it into
  every call, 2 bytes read and written per output element, and kept it live across the loop.)
- The gradient is two more kernels (`jax.custom_vjp`): d rows = d out x weights^T (the same kernel, the weights
  read transposed), and d weights[g] = rows_g^T x d out_g, one program per (group, K block, N block) looping over
  its group's rows (a dynamic trip count). An empty group's gradient is zero.
- Under a pipeline the kernel is batched by two `vmap`s (stages, data-parallel replicas), each split over its mesh
  axes. JAX 0.10 cannot lower `ragged_dot` batched twice, so `xla` batches it one element at a time
  (`custom_vmap`, a loop that runs once per device), with its gradient written out (`custom_vjp`).
- Accumulation in float32; the output in the rows' dtype. Block sizes are powers of two dividing K and N (no
  column masks); shapes they do not fit (a dimension under 16) take `xla`.
- The compiled program cannot say how many rows were routed, so each kernel records the work its caller expects
  in its metadata, as the GEMM it amounts to: [groups, rows per group, N, K] for the rows the caller expects in
  groups (by default all of them: exact for a local dispatch), which `shardlm.perf.kernels` reads to cost it.
"""

from __future__ import annotations

import functools
import json
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

KERNELS = ("xla", "triton", "megablox")
GEMM_KEY = "shardlm_gemm"  # the metadata field `shardlm.perf.kernels` reads a Triton kernel's work from
ROUTED_SCOPE = "grouped_matmul_routed_{routed}_of_{rows}"  # a Megablox call's name scope: its expected rows


def routed_rows(name: str) -> tuple[int, float] | None:
    """From an op's name (its scopes), the rows a Megablox call expects in groups and their share of its buffer's
    rows, which its kernels' declared costs count all of (`ROUTED_SCOPE`); None outside such a call."""
    m = re.search(r"grouped_matmul_routed_(\d+)_of_(\d+)", name)
    return (int(m.group(1)), int(m.group(1)) / int(m.group(2))) if m else None


def megablox_flops(name: str, declared: float | None, out_shape: tuple[int, ...]) -> float | None:
    """The FLOPs of a Megablox kernel named `name` for its expected rows: its declared cost (every row's) scaled
    to them, or for the weight gradient `tgmm` (which declares none; out [G, K, N]) 2 x rows x K x N."""
    routed = routed_rows(name)
    if routed is None:
        return None
    rows, share = routed
    if declared:
        return declared * share
    if "tgmm" in name and len(out_shape) == 3:
        return 2.0 * rows * out_shape[1] * out_shape[2]
    return None


def grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array, kernel: str = "xla", *,
                   interpret: bool = False, expected_rows: int | None = None) -> jax.Array:
    """rows [M, K] grouped by `group_sizes` [G] times weights [G, K, N] -> [M, N] in rows' dtype (see the module
    docstring). `interpret` runs the Triton kernel in Pallas's interpret mode (off a GPU); `expected_rows` is how
    many of the M rows the caller expects to be in groups, for the cost model (default M)."""
    if kernel == "triton" and triton_fits(*rows.shape, weights.shape[2]):
        blocks = _blocks(rows.shape[0], rows.shape[1], weights.shape[2])
        rows_routed = rows.shape[0] if expected_rows is None else expected_rows
        return _triton_gmm(rows, weights, group_sizes.astype(jnp.int32), blocks, interpret, rows_routed)
    if kernel == "megablox" and megablox_fits(rows.shape[1], weights.shape[2], interpret):
        return _megablox(rows, weights, group_sizes, interpret, expected_rows)
    return _ragged_dot(rows, weights, group_sizes)


def _one_at_a_time(f):
    """`f` batched one element at a time (`jax.lax.map` over the batch): JAX 0.10 cannot lower `ragged_dot` batched
    under two `vmap`s (its expansion passes NumPy integers as `in_axes`), which a pipeline's vmaps over stages and
    data-parallel replicas do. Each of those is split over its mesh axes, so a device's loop runs once."""
    mapped = custom_vmap(f)

    @mapped.def_vmap
    def batched(axis_size, in_batched, *args):
        args = tuple(a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched))
        return jax.lax.map(lambda one: mapped(*one), args), True  # an outer vmap comes back here

    return mapped


@_one_at_a_time
def _ragged_forward(rows, weights, group_sizes):
    return jax.lax.ragged_dot(rows, weights, group_sizes)


@_one_at_a_time
def _ragged_weight_gradient(rows, d_out, group_sizes):
    """d weights [G, K, N] of `ragged_dot(rows, weights, group_sizes)` for the output's gradient d_out [M, N]."""
    zeros = jnp.zeros((group_sizes.shape[0], rows.shape[1], d_out.shape[1]), rows.dtype)
    return jax.vjp(lambda w: jax.lax.ragged_dot(rows, w, group_sizes), zeros)[1](d_out)[0]


@jax.custom_vjp
def _ragged_dot(rows, weights, group_sizes):
    """`jax.lax.ragged_dot` with its gradient written out, each part `_one_at_a_time` (a `custom_vmap` has no
    reverse-mode derivative of its own under remat)."""
    return _ragged_forward(rows, weights, group_sizes)


def _ragged_dot_forward(rows, weights, group_sizes):
    return _ragged_forward(rows, weights, group_sizes), (rows, weights, group_sizes)


def _ragged_dot_backward(saved, d_out):
    rows, weights, group_sizes = saved
    d_rows = _ragged_forward(d_out.astype(rows.dtype), jnp.swapaxes(weights, 1, 2), group_sizes)
    d_weights = _ragged_weight_gradient(rows, d_out.astype(rows.dtype), group_sizes).astype(weights.dtype)
    return d_rows, d_weights, None


_ragged_dot.defvjp(_ragged_dot_forward, _ragged_dot_backward)


def triton_fits(m: int, k: int, n: int) -> bool:
    """Whether the Triton kernel takes `m` rows, a contraction of `k` and an output of `n` columns (at least 16
    rows, K and N multiples of 16: Triton's smallest dot)."""
    return m >= 16 and k % 16 == 0 and n % 16 == 0


def megablox_fits(k: int, n: int, interpret: bool = False) -> bool:
    """Whether Megablox takes a contraction of `k` and `n` columns on a TPU: both multiples of 128 (its tiles, in
    the gradient's transposed order too, must be; XLA:TPU's own ragged_dot takes the rest). Interpreted, any."""
    return interpret or (k % 128 == 0 and n % 128 == 0)


class Blocks(NamedTuple):
    m: int
    k: int
    n: int


def _largest_power_of_two_dividing(x: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and x % (b * 2) == 0:
        b *= 2
    return b


def _blocks(m: int, k: int, n: int) -> Blocks:
    """Tiles of 128 rows (the largest power of two up to m, for fewer), K in blocks of 64 and N of 128 where they
    divide, else smaller powers of two."""
    return Blocks(min(128, 1 << (m.bit_length() - 1)), _largest_power_of_two_dividing(k, 64),
                  _largest_power_of_two_dividing(n, 128))


# --- the tiles' table --------------------------------------------------------------------------------------------


class Tiles(NamedTuple):
    group: jax.Array  # [T] int32: the group of each tile
    start: jax.Array  # [T] int32: its first row
    rows: jax.Array  # [T] int32: how many rows it has (0: an unused tile)


def tiles(group_sizes: jax.Array, m: int, block_m: int) -> Tiles:
    """Each group's rows cut into tiles of up to `block_m` rows, then the rows past the groups (group G: tiles that
    store zeros), for cdiv(m, block_m) + G tiles (the most any G + 1 sizes summing to m can need); unused tiles
    have 0 rows."""
    g = group_sizes.shape[0]
    grouped = group_sizes.astype(jnp.int32)
    sizes = jnp.concatenate([grouped, jnp.maximum(m - jnp.sum(grouped), 0)[None]])
    starts = jnp.cumsum(sizes) - sizes
    per_group = (sizes + block_m - 1) // block_m
    first = jnp.cumsum(per_group) - per_group
    t = jnp.arange(-(-m // block_m) + g, dtype=jnp.int32)
    group = jnp.clip(jnp.searchsorted(jnp.cumsum(per_group), t, side="right"), 0, g).astype(jnp.int32)
    within = t - first[group]
    used = within < per_group[group]
    rows = jnp.where(used, jnp.clip(sizes[group] - within * block_m, 0, block_m), 0)
    return Tiles(group, (starts[group] + within * block_m).astype(jnp.int32), rows.astype(jnp.int32))


def _in_bounds(start, length: int, total: int):
    """A block of `length` starting at `start`, moved back to end within `total`: (its start, the row offsets
    0..length-1 of it, as positions)."""
    begin = jnp.minimum(start, total - length)
    return begin, begin + jnp.arange(length)


# --- the kernels ---------------------------------------------------------------------------------------------------


def _gmm_kernel(group_ref, start_ref, rows_ref, lhs_ref, rhs_ref, out_ref, *, blocks: Blocks, m: int, k: int,
                groups: int, transpose_rhs: bool):
    """out[tile rows, column block j] = lhs[tile rows] @ rhs[tile's group] (or its transpose); zeros for a tile of
    the rows past the groups (group `groups`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    tile, j = pl.program_id(0), pl.program_id(1)
    group, start, count = group_ref[tile], start_ref[tile], rows_ref[tile]
    begin, positions = _in_bounds(start, blocks.m, m)
    mine = (positions >= start) & (positions < start + count)
    rows, cols = pl.ds(begin, blocks.m), pl.ds(j * blocks.n, blocks.n)

    @pl.when((count > 0) & (group < groups))
    def _():
        def step(kk, acc):
            ks = pl.ds(kk * blocks.k, blocks.k)
            x = plgpu.load(lhs_ref.at[rows, ks], mask=mine[:, None], other=0)
            if transpose_rhs:
                w = plgpu.load(rhs_ref.at[group, cols, ks]).T
            else:
                w = plgpu.load(rhs_ref.at[group, ks, cols])
            return acc + jax.lax.dot(x, w, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, k // blocks.k, step, jnp.zeros((blocks.m, blocks.n), jnp.float32))
        plgpu.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=mine[:, None])

    @pl.when((count > 0) & (group == groups))
    def _():
        plgpu.store(out_ref.at[rows, cols], jnp.zeros((blocks.m, blocks.n), out_ref.dtype), mask=mine[:, None])


def _work(groups: int, rows: int, n: int, k: int) -> dict[str, str]:
    """The metadata a kernel carries for the cost model: [groups, rows per group, N, K]."""
    return {GEMM_KEY: json.dumps([groups, rows / groups, n, k])}


def _cost(rows: int, n: int, k: int, itemsize: int):
    """What the kernel does for `rows` routed rows, as JAX's FLOP counts read it (`shardlm.flops`); the Triton
    lowering drops it, hence `_work` for the compiled program."""
    from jax.experimental import pallas as pl

    return pl.CostEstimate(flops=int(2 * rows * n * k), transcendentals=0,
                           bytes_accessed=int(rows * (n + k) * itemsize))


def _gmm(lhs, rhs, group_sizes, blocks: Blocks, interpret: bool, rows_routed: int, transpose_rhs: bool = False):
    """lhs [M, K] x rhs [G, K, N] (or [G, N, K] read transposed) -> [M, N]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    table = tiles(group_sizes, m, blocks.m)
    kernel = functools.partial(_gmm_kernel, blocks=blocks, m=m, k=k, groups=rhs.shape[0],
                               transpose_rhs=transpose_rhs)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        grid=(table.group.shape[0], n // blocks.n), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        cost_estimate=_cost(rows_routed, n, k, lhs.dtype.itemsize),
        metadata=_work(rhs.shape[0], rows_routed, n, k), name="grouped_matmul",
    )(*table, lhs, rhs)


def _tgmm_kernel(start_ref, size_ref, lhs_ref, dout_ref, out_ref, *, blocks: Blocks, m: int):
    """out[group, K block, N block] = lhs[group's rows, K block]^T @ dout[group's rows, N block]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    group, kb, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, size = start_ref[group], size_ref[group]
    ks, cols = pl.ds(kb * blocks.k, blocks.k), pl.ds(j * blocks.n, blocks.n)

    def step(r, acc):
        first = start + r * blocks.m
        begin, positions = _in_bounds(first, blocks.m, m)
        mine = (positions >= first) & (positions < start + size)
        rows = pl.ds(begin, blocks.m)
        x = plgpu.load(lhs_ref.at[rows, ks], mask=mine[:, None], other=0)
        dy = plgpu.load(dout_ref.at[rows, cols], mask=mine[:, None], other=0)
        return acc + jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, (size + blocks.m - 1) // blocks.m, step,
                            jnp.zeros((blocks.k, blocks.n), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _tgmm(lhs, dout, group_sizes, blocks: Blocks, interpret: bool, rows_routed: int):
    """lhs [M, K], dout [M, N] -> [G, K, N]: each group's lhs^T @ dout."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    (m, k), n, g = lhs.shape, dout.shape[1], group_sizes.shape[0]
    if lhs.dtype.itemsize > 2:  # float32 rows and d out tiles, 3 stages deep, overflow an H100's shared memory
        blocks = Blocks(min(blocks.m, 32), blocks.k, blocks.n)
    starts = (jnp.cumsum(group_sizes) - group_sizes).astype(jnp.int32)
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, blocks=blocks, m=m),
        out_shape=jax.ShapeDtypeStruct((g, k, n), lhs.dtype),
        grid=(g, k // blocks.k, n // blocks.n),
        in_specs=[whole((g,)), whole((g,)), whole((m, k)), whole((m, n))],
        out_specs=pl.BlockSpec((None, blocks.k, blocks.n), lambda gi, kb, j: (gi, kb, j)),
        interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        cost_estimate=_cost(rows_routed, n, k, lhs.dtype.itemsize),
        metadata=_work(g, rows_routed, n, k), name="grouped_matmul_weight_gradient",
    )(starts, group_sizes, lhs, dout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _triton_gmm(rows, weights, group_sizes, blocks: Blocks, interpret: bool, rows_routed: int):
    return _gmm(rows, weights, group_sizes, blocks, interpret, rows_routed)


def _triton_gmm_forward(rows, weights, group_sizes, blocks, interpret, rows_routed):
    return _triton_gmm(rows, weights, group_sizes, blocks, interpret, rows_routed), (rows, weights, group_sizes)


def _triton_gmm_backward(blocks, interpret, rows_routed, saved, d_out):
    rows, weights, group_sizes = saved
    k, n = rows.shape[1], weights.shape[2]
    transposed = Blocks(blocks.m, _largest_power_of_two_dividing(n, 64), _largest_power_of_two_dividing(k, 128))
    d_rows = _gmm(d_out.astype(rows.dtype), weights, group_sizes, transposed, interpret, rows_routed,
                  transpose_rhs=True)
    d_weights = _tgmm(rows, d_out.astype(rows.dtype), group_sizes, blocks, interpret, rows_routed)
    return d_rows, d_weights.astype(weights.dtype), np.zeros(group_sizes.shape, jax.dtypes.float0)


_triton_gmm.defvjp(_triton_gmm_forward, _triton_gmm_backward)


# --- Megablox on TPUs ----------------------------------------------------------------------------------------------


def _megablox(rows, weights, group_sizes, interpret: bool, expected_rows: int | None):
    """JAX's Pallas TPU grouped matmul, with its gradient kernels (`megablox.gmm`), in tiles of 512 rows (padded to a
    multiple) and up to 1024 of K and N (`_tpu_tile`). Megablox leaves rows past the groups unwritten, forward and
    backward, so they are masked to zero on the way in and out (the masks' gradients zero them in d rows too). Its
    kernels declare the cost of every row of the buffer, so a name scope says how many the caller expects in groups
    (`ROUTED_SCOPE`, read by `shardlm.perf.kernels`)."""
    from jax.experimental.pallas.ops.tpu import megablox

    m, k = rows.shape
    n = weights.shape[2]
    # MaxText's tiles (512 x 1024 x 1024): each row tile is read once per N tile, so small tiles multiply the
    # traffic (128-wide ones made a 2048 x 7168 expert matmul byte-bound at 29 GiB per call)
    tile = (512, _tpu_tile(k), _tpu_tile(n))
    padded = -(-m // tile[0]) * tile[0]
    grouped_rows = (jnp.arange(m) < jnp.sum(group_sizes))[:, None]
    lhs = jnp.pad(jnp.where(grouped_rows, rows, 0), ((0, padded - m), (0, 0)))
    with jax.named_scope(ROUTED_SCOPE.format(routed=m if expected_rows is None else expected_rows, rows=padded)):
        out = megablox.gmm(lhs, weights, group_sizes.astype(jnp.int32), preferred_element_type=rows.dtype,
                           tiling=tile, interpret=interpret)
    return jnp.where(grouped_rows, out[:m], 0)


def _tpu_tile(dim: int, cap: int = 1024) -> int:
    """A Megablox tile of `dim`: a multiple of 128 (the TPU's lane width) dividing it, up to `cap` (the whole
    dimension off a TPU, where 128 need not divide it)."""
    if dim % 128:
        return dim
    return 128 * _largest_power_of_two_dividing(dim // 128, cap // 128)


def reference(rows, weights, group_sizes):
    """The per-group loop the kernels are tested against: group g's rows times weights[g], zero past the groups."""
    out = jnp.zeros((rows.shape[0], weights.shape[2]), jnp.float32)
    start = 0
    for g, size in enumerate(np.asarray(group_sizes).tolist()):
        out = out.at[start:start + size].set(rows[start:start + size].astype(jnp.float32)
                                             @ weights[g].astype(jnp.float32))
        start += size
    return out.astype(rows.dtype)

