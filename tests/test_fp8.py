"""FP8 matmuls (`shardlm.kernels.fp8`, `model.matmul_dtype=fp8`): the product and its gradients against a float64
reference within the bound e4m3 and e5m2 rounding implies, scaling that keeps large values in range, and a model
step in FP8 that trains like one device on a mesh. XLA:CPU emulates the float8 types: this is the GPU's code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlm.kernels.fp8 import E4M3, E5M2, fp8_einsum, fp8_einsums, quantize

# Rounding to a float8 format with m mantissa bits moves a normal value by at most 2^-(m+1) of itself, and a value
# in the subnormal range by at most half the smallest subnormal (e4m3: 2^-9, e5m2: 2^-16), in scaled units.
U = {E4M3: 2.0**-4, E5M2: 2.0**-3}
HALF_SUBNORMAL = {E4M3: 2.0**-10, E5M2: 2.0**-17}


def _rounding(x: np.ndarray, fmt) -> np.ndarray:
    """Per element, the most that quantizing `x` (per-tensor current scaling to `fmt`) can move it."""
    scale = float(np.abs(x).max()) / float(jnp.finfo(fmt).max)
    return U[fmt] * np.abs(x) + HALF_SUBNORMAL[fmt] * scale


def _product_bound(a, da, b, db):
    """|a^ b^ - a b| over a contraction, element by element, for |a^ - a| <= da and |b^ - b| <= db (a @ b)."""
    return da @ np.abs(b) + np.abs(a) @ db + da @ db


def _fp8_and_reference(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8_einsum("td,df->tf", x, w), x, w)
    dx, dw = vjp(g)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    return (y, dx, dw), (x64 @ w64, g64 @ w64.T, x64.T @ g64), (x64, w64, g64)


@pytest.mark.parametrize("magnitude", [1.0, 1e4], ids=["unit", "1e4"])
def test_fp8_product_and_gradients_are_within_float8_rounding_of_float64(magnitude):
    """y = x w with e4m3 operands, d x = d y w^T and d w = x^T d y with d y in e5m2: each element within the bound
    the two roundings imply (plus 1e-5 of float32 accumulation), and FP8 really ran (errors far above float32's).
    At 1e4, x does not fit e4m3 (largest 448) unscaled: cast as it is, it is NaN."""
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (64, 128)) * magnitude
    w = jax.random.normal(ks[1], (128, 96)) * 0.05
    g = jax.random.normal(ks[2], (64, 96))
    got, want, (x64, w64, g64) = _fp8_and_reference(x, w, g)
    ex, ew, eg = _rounding(x64, E4M3), _rounding(w64, E4M3), _rounding(g64, E5M2)
    bounds = (_product_bound(x64, ex, w64, ew), _product_bound(g64, eg, w64.T, ew.T),
              _product_bound(x64.T, ex.T, g64, eg))
    for name, a, b, bound, plain in zip(("y", "d x", "d w"), got, want, bounds,
                                        (np.abs(x64) @ np.abs(w64), np.abs(g64) @ np.abs(w64.T),
                                         np.abs(x64.T) @ np.abs(g64))):
        err = np.abs(np.asarray(a, np.float64) - b)
        assert np.all(np.isfinite(np.asarray(a))), name
        assert np.all(err <= bound + 1e-5 * plain), f"{name}: {np.max(err - bound - 1e-5 * plain):.3g} over"
        assert np.max(err / plain) > 1e-4, f"{name}: no float8 rounding at all"
    if magnitude > 448:
        assert np.isnan(np.asarray(x.astype(E4M3).astype(jnp.float32))).any()


def test_a_zero_tensor_quantizes_to_zeros():
    q, scale = quantize(jnp.zeros((4, 8)), E4M3)
    assert np.all(np.asarray(q.astype(jnp.float32)) == 0.0) and np.isfinite(float(scale)) and float(scale) > 0


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_one_non_finite_element_spoils_only_the_outputs_it_enters(bad):
    """An inf (or NaN) in x, or in the output's gradient, leaves every product that does not read it exactly as
    it is with that element at zero, and makes the ones that do non-finite, as a bfloat16 matmul does; with the
    amax over every element, the scale was inf and every output NaN."""
    ks = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(ks[0], (16, 32))
    w = jax.random.normal(ks[1], (32, 24)) * 0.05
    g = jax.random.normal(ks[2], (16, 24))

    def run(x, g):
        y, vjp = jax.vjp(lambda x, w: fp8_einsum("td,df->tf", x, w), x, w)
        return (np.asarray(y), *(np.asarray(d) for d in vjp(g)))

    y, dx, dw = run(x.at[3, 5].set(bad), g)
    y0, dx0, dw0 = run(x, g)  # the element at its own value: outputs that do not read it are these exactly
    clean = run(x.at[3, 5].set(0.0), g)
    assert np.all(~np.isfinite(y[3])) and np.array_equal(np.delete(y, 3, 0), np.delete(clean[0], 3, 0))
    assert np.all(~np.isfinite(dw[5])) and np.array_equal(np.delete(dw, 5, 0), np.delete(clean[2], 5, 0))
    assert np.array_equal(dx, dx0)  # d x = d y w^T reads no x
    assert np.isfinite(y0).all() and not np.array_equal(clean[0], y0)  # (the element mattered)
    yg, dxg, dwg = run(x, g.at[7, 2].set(bad))  # the same for the output's gradient
    assert np.array_equal(yg, y0) and np.all(~np.isfinite(dxg[7])) and np.all(~np.isfinite(dwg[:, 2]))
    assert np.array_equal(np.delete(dxg, 7, 0), np.delete(run(x, g.at[7, 2].set(0.0))[1], 7, 0))


def test_products_sharing_an_input_quantize_it_once_and_each_equals_its_own_call():
    """`fp8_einsums` (query, key and value; gate and up) quantizes x once: each output and each weight's gradient
    is bit for bit the separate call's, and x's gradient is the separate calls' gradients summed in float32."""
    ks = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(ks[0], (32, 64), jnp.bfloat16)
    ws = [jax.random.normal(k, (64, n), jnp.bfloat16) * 0.05 for k, n in zip(ks[1:3], (48, 16))]
    gs = [jax.random.normal(k, (32, n), jnp.bfloat16) for k, n in zip(ks[3:], (48, 16))]
    ys, vjp = jax.vjp(lambda x, ws: fp8_einsums("td,df->tf", x, ws), x, tuple(ws))
    dx, dws = vjp(tuple(gs))
    dx_sum = jnp.zeros(x.shape, jnp.float32)
    for y, dw, w, g in zip(ys, dws, ws, gs):
        y1, vjp1 = jax.vjp(lambda x, w: fp8_einsum("td,df->tf", x, w), x, w)
        dx1, dw1 = vjp1(g)
        assert np.array_equal(np.asarray(y), np.asarray(y1)) and np.array_equal(np.asarray(dw), np.asarray(dw1))
        dx_sum = dx_sum + dx1.astype(jnp.float32)
    assert dx.dtype == jnp.bfloat16 and np.array_equal(np.asarray(dx), np.asarray(dx_sum.astype(jnp.bfloat16)))
    text = jax.jit(lambda x, ws: fp8_einsums("td,df->tf", x, ws)).lower(x, tuple(ws)).as_text()
    n_quantized = sum(1 for line in text.splitlines() if "convert" in line and "tensor<32x64xf8E4M3FN>" in line)
    assert n_quantized == 1, n_quantized  # x, once (separate calls: once per weight)


# FSDP with the heads and the MLP split over tensor (the batch split as data-parallel replicas split it, and the
# weights' amax over their shards), a sequence split over context (ring attention between the matmuls), and
# pipeline stages (each microbatch quantizes its own activations, as one device's gradient accumulation would).
FP8_MESHES = {"FSDP 4 x TP 2": {"fsdp": 4, "tensor": 2}, "CP 2 x FSDP 4": {"context": 2, "fsdp": 4},
              "PP 2 x FSDP 4": {"stage": 2, "fsdp": 4}}


@pytest.fixture(scope="module")
def fp8_one_device():
    from test_parity import shardlm_run

    from conftest import MICRO

    return shardlm_run(MICRO + ["model=llama-tiny", "model.matmul_dtype=fp8"], {"data": 1}, steps=2)


@pytest.mark.parametrize("name", list(FP8_MESHES))
def test_fp8_steps_match_one_device_on_every_mesh(fp8_one_device, name):
    """Per-tensor scales are taken over the whole tensor wherever it is split (XLA reduces the amax over the
    devices), so a mesh quantizes as one device does: the loss and gradient norm at step 1 and the loss at step 2
    within 1e-3 of one device's, in FP8."""
    from test_parity import shardlm_run

    from conftest import MICRO

    got = shardlm_run(MICRO + ["model=llama-tiny", "model.matmul_dtype=fp8"], FP8_MESHES[name], steps=2)
    for key in ("loss", "grad_norm"):
        assert got[0][key] == pytest.approx(fp8_one_device[0][key], rel=1e-3), key
    assert got[1]["loss"] == pytest.approx(fp8_one_device[1]["loss"], rel=1e-3)
    assert got[1]["loss"] < got[0]["loss"]
