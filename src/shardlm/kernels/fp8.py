"""FP8 matmuls with per-tensor current scaling: `fp8_einsum(spec, x, w)` computes `jnp.einsum(spec, x, w)` with both
operands in float8 and float32 accumulation, and its gradient with the output's gradient in float8 too.

    fp8_einsum("btd,df->btf", x [.., D] bf16, w [D, F] bf16) -> [.., F] in x's dtype

Design choices:
- The recipe is Transformer Engine's and torchtitan's: e4m3 (3 mantissa bits, up to 448) for the forward
  operands, e5m2 (2 bits, up to 57,344: range over precision) for the gradient flowing back, each tensor scaled
  so that its largest magnitude lands on its format's largest value, the product of the two scales applied to the
  float32 result. The backward pass multiplies e5m2 by e4m3 (d x = d y . w^T, d w = x^T . d y): H100 tensor cores
  take mixed float8 operands, and XLA:GPU compiles each to one FP8 GEMM.
- Current scaling: the scale is this step's amax, computed where the tensor is (`jnp.max(jnp.abs(x))`; on a mesh
  XLA reduces it over the devices that split the tensor, so every device uses the same scale). Delayed scaling
  (a scale from past steps' amax history) saves that reduction but makes the scales training state and lets an
  outlier overflow for a step; torchao dropped it for lack of a speed-up over current scaling, and it is not
  offered here. With no history there is nothing to checkpoint, shard or restore.
- The forward pass keeps the float8 operands and their scales for the backward pass, so a matmul that keeps its
  input keeps it in half a bfloat16 copy's bytes.
- Products that share an input (the query, key and value projections; a gated MLP's gate and up) quantize it
  once (`fp8_einsums`): separate calls kept one float8 copy of it per product (XLA did not merge them) and took
  its amax as often, which put a step's peak memory above bfloat16's.
- Scales are float32, from an amax floored at 2^-64, so an all-zero tensor quantizes to zeros, not NaN.
- A non-finite element (an overflowed activation or gradient) spoils what it touches and nothing more, as in a
  bfloat16 matmul: the amax is taken over the finite elements, so the rest of the tensor keeps its scale and the
  outputs that do not read that element are exactly what they would be without it; the element itself becomes
  NaN (e4m3 has no infinity) and so do the outputs it enters. Taken over every element, the amax was inf, the
  scale inf, and every output NaN. Either way the loss is not finite, and the step is treated as any such step.
- XLA:CPU emulates the float8 types, so the CPU runs this same code; only the speed is the GPU's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # forward operands
E5M2 = jnp.float8_e5m2  # gradients
_TINY = 2.0 ** -64  # the smallest amax a scale is taken from (a zero tensor keeps a finite scale)


def scale_of(x: jax.Array, fp8_dtype) -> jax.Array:
    """The float32 scale that maps `x`'s largest magnitude to `fp8_dtype`'s largest value: x / scale fits."""
    magnitudes = jnp.abs(x)
    amax = jnp.max(jnp.where(jnp.isfinite(magnitudes), magnitudes, 0)).astype(jnp.float32)  # see the docstring
    return jnp.maximum(amax, _TINY) / jnp.float32(jnp.finfo(fp8_dtype).max)


def quantize(x: jax.Array, fp8_dtype) -> tuple[jax.Array, jax.Array]:
    """(x / scale in `fp8_dtype`, scale): per-tensor current scaling."""
    scale = scale_of(x, fp8_dtype)
    return (x.astype(jnp.float32) / scale).astype(fp8_dtype), scale


def _operand_specs(spec: str) -> tuple[str, str, str]:
    operands, out = spec.replace(" ", "").split("->")
    x_spec, w_spec = operands.split(",")
    return x_spec, w_spec, out


def _scaled_einsum(spec: str, a, b, scale, dtype):
    """The float8 product (accumulated in float32 inside the GEMM) written in `dtype`, then scaled back. Written
    in float32 instead, XLA:GPU's latency model charged an FP8 weight-gradient GEMM (a contraction over the
    tokens) at 12 TFLOP/s, and the same bfloat16 GEMM too; written in bfloat16 it charges it at twice the
    bfloat16 GEMM's rate. The extra rounding is bfloat16's, far below float8's."""
    return (jnp.einsum(spec, a, b, preferred_element_type=dtype).astype(jnp.float32) * scale).astype(dtype)


def fp8_einsum(spec: str, x: jax.Array, w: jax.Array, grad_dtype=None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` ("btd,df->btf": x's indices, the weight's, the output's) with e4m3 operands, in
    x's dtype; its gradient with an e5m2 output gradient. `grad_dtype`: the dtype the weight's gradient is
    produced in (and so summed across devices, `shardlm.models.precision.matmul`), default w's."""
    return fp8_einsums(spec, x, (w,), grad_dtype)[0]


def fp8_einsums(spec: str, x: jax.Array, ws, grad_dtype=None) -> tuple:
    """`fp8_einsum(spec, x, w)` for each weight of `ws`, with x quantized once: the query, key and value projections
    (or a gated MLP's gate and up) read the same input, and three separate calls would keep three float8 copies of
    it and take its amax three times. x's gradient is the sum of each product's, accumulated in float32."""
    x_spec, w_spec, out = _operand_specs(spec)
    x_dtype = x.dtype
    w_dtypes = [w.dtype for w in ws]
    grad_dtypes = [grad_dtype or d for d in w_dtypes]

    def forward(x, ws):
        xq, sx = quantize(x, E4M3)
        wqs = [quantize(w, E4M3) for w in ws]
        ys = tuple(_scaled_einsum(spec, xq, wq, sx * sw, x_dtype) for wq, sw in wqs)
        return ys, (xq, sx, wqs)

    @jax.custom_vjp
    def products(x, ws):
        return forward(x, ws)[0]

    def backward(saved, gs):
        xq, sx, wqs = saved
        dx, dws = None, []
        for (wq, sw), g, grad_dt, w_dt in zip(wqs, gs, grad_dtypes, w_dtypes):
            gq, sg = quantize(g, E5M2)
            part = _scaled_einsum(f"{out},{w_spec}->{x_spec}", gq, wq, sg * sw, x_dtype).astype(jnp.float32)
            dx = part if dx is None else dx + part
            dws.append(_scaled_einsum(f"{x_spec},{out}->{w_spec}", xq, gq, sx * sg, grad_dt).astype(w_dt))
        return dx.astype(x_dtype), tuple(dws)

    products.defvjp(forward, backward)
    return products(x, tuple(ws))
