"""Choosing the next token from logits: greedy, or temperature with top-k and top-p (nucleus) filtering.

Randomness is a pure function of (seed, sample index, position): each row's key is `fold_in(fold_in(key(seed),
sample), position)`. A sample's text therefore does not depend on which other samples share its batch, on the
batch padding a mesh needs, or on whether the KV cache is used.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from shardlm.errors import ShardlmError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy (argmax); top_k 0 = no top-k filter; top_p 1 = no nucleus filter."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 1.0

    def __post_init__(self):
        finite = math.isfinite(self.temperature)
        if not (finite and self.temperature >= 0) or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ShardlmError(f"sampling needs temperature >= 0, top-k >= 0 and 0 < top-p <= 1; got temperature "
                               f"{self.temperature}, top-k {self.top_k}, top-p {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: jax.Array, s: Sampling) -> jax.Array:
    """[batch, vocab] logits (less their maximum) scaled by 1/temperature, with tokens outside the top-k and outside
    the top-p nucleus set to -inf (the order of Hugging Face's and vLLM's samplers). Ties at a cut-off are kept."""
    logits = logits.astype(jnp.float32)
    # Shifted so the likeliest token is at 0 before scaling: a tiny temperature then sends the others to -inf
    # (greedy in effect) instead of every logit to +-inf and the probabilities to NaN.
    logits = (logits - logits.max(axis=-1, keepdims=True)) / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # The smallest set of likeliest tokens whose probability reaches top_p: a token is in it if the tokens
        # before it hold less than top_p. The likeliest token always is.
        kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < s.top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def next_tokens(logits: jax.Array, s: Sampling, seed: jax.Array, rows: jax.Array, positions: jax.Array
                ) -> jax.Array:
    """logits [batch, vocab] for the tokens at `positions` [batch] of samples `rows` [batch] -> tokens [batch]."""
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    base = jax.random.key(seed)
    keys = jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(base, r), p))(rows, positions)
    return jax.vmap(jax.random.categorical)(keys, filter_logits(logits, s)).astype(jnp.int32)
