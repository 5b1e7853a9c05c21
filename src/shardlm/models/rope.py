"""Rotary position embeddings: the frequencies (plain, Llama 3's `llama3` scaling, YaRN), the tables a forward pass
computes once, and the rotation. Math only.

Design choices:
- One record, `Rope`, built from the model config (`Rope.of`), holds everything a rotation needs: the base, the
  rotated width, and the scaling. Models, generation and the Hugging Face mapping read the same record, so a
  scaled model trains, generates and exports with the same frequencies.
- The frequencies are computed in float64 numpy once per trace (they are constants of the config) and the angles
  in float32 on the device, as transformers computes its inverse frequencies in float32 and its angles in float32.
- `llama3` (Llama 3.1-3.3): frequencies whose wavelength exceeds `original_context / low_freq_factor` are divided
  by `factor`, those shorter than `original_context / high_freq_factor` kept, and the band between interpolated
  smoothly (Meta's `apply_scaling`, transformers' `_compute_llama3_parameters`).
- `yarn` (Qwen's and DeepSeek's long-context scaling, Peng et al. 2023): each frequency blends its interpolated
  (divided by `factor`) and original value by a linear ramp over the dimensions between the corrections for
  `beta_fast` and `beta_slow` rotations within `original_context`; the tables are multiplied by the attention
  factor (0.1 ln(factor) + 1 unless given, or DeepSeek's ratio of `mscale` and `mscale_all_dim`), which scales
  q.k by its square.
- "rotate half" layout: the pairs (i, i + dim / 2), GPT-NeoX's and Hugging Face Llama's. With `dim` smaller than
  the head (DeepSeek's decoupled rotary part is its own tensor, so every head here is rotated whole) only the
  first `dim` features would rotate; no family uses that yet.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

SCALINGS = ("none", "llama3", "yarn")  # model.rope_scaling


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class Rope:
    theta: float
    dim: int  # the rotated features per head
    scaling: str = "none"
    factor: float = 1.0
    original_context: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # yarn: with mscale_all_dim, DeepSeek's attention factor (0: not given)
    mscale_all_dim: float = 0.0

    @classmethod
    def of(cls, m, dim: int) -> "Rope":
        """The rotary embedding of model config `m` over `dim` features per head: each field is the config's
        `rope_<field>`."""
        fields = (f.name for f in dataclasses.fields(cls) if f.name != "dim")
        return cls(dim=dim, **{name: getattr(m, f"rope_{name}") for name in fields})

    def frequencies(self) -> np.ndarray:
        """The inverse wavelengths [dim / 2], float32 as transformers computes them."""
        base = 1.0 / self.theta ** (np.arange(0, self.dim, 2, dtype=np.float32) / self.dim)
        if self.scaling == "llama3":
            return self._llama3(base.astype(np.float32))
        if self.scaling == "yarn":
            return self._yarn(base.astype(np.float32))
        return base.astype(np.float32)

    def attention_factor(self) -> float:
        """What the sin and cos tables are multiplied by (YaRN's temperature; 1 otherwise)."""
        if self.scaling != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def _llama3(self, freq: np.ndarray) -> np.ndarray:
        wavelen = 2 * math.pi / freq
        low, high = self.original_context / self.low_freq_factor, self.original_context / self.high_freq_factor
        scaled = np.where(wavelen > low, freq / self.factor, freq)
        smooth = (self.original_context / wavelen - self.low_freq_factor) / (self.high_freq_factor
                                                                             - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high) & (wavelen <= low)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def _yarn(self, freq: np.ndarray) -> np.ndarray:
        def correction(rotations: float) -> float:  # the dimension that turns `rotations` times in the context
            return self.dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low = max(math.floor(correction(self.beta_fast)), 0)
        high = min(math.ceil(correction(self.beta_slow)), self.dim - 1)
        high = high + 0.001 if high == low else high  # transformers' guard against a zero-width ramp
        ramp = np.clip((np.arange(self.dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp  # 1: the original frequency, 0: the interpolated one
        return (freq / self.factor * (1 - extrapolation) + freq * extrapolation).astype(np.float32)

    def tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(sin, cos) [rows, T, dim / 2] for integer positions [rows, T], in float32."""
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(self.frequencies())
        scale = self.attention_factor()
        return jnp.sin(angles) * scale, jnp.cos(angles) * scale


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotary position embedding of x [batch, T, heads, head_dim], rotating the pairs (i, i + head_dim / 2) (the
    "rotate half" layout of GPT-NeoX and Hugging Face Llama), in float32."""
    sin, cos = (t[:, :, None, :] for t in rope)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
