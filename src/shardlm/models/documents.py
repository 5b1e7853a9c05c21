"""Documents packed in one sequence: each token's document, from the separator tokens in the row.

Design choices:
- Prepared data is a stream of documents, each opened by the tokenizer's separator (`<|endoftext|>`:
  `shardlm.data.prepare`), cut into windows without regard to where documents end. A token's document is the number
  of separators up to it, itself included (`document_ids`): the separator opens its document, as a BOS token
  does, and the tokens of a document cut by the window's start form a document of their own (id 0).
- Positions may restart at each document (`data.document_positions`, an option as in Llama 3's and OLMo's
  packing): a token's position is its offset from its document's first token in the row (`document_positions`),
  read by the rotary tables or the learned position embedding in place of its place in the window.
- The ids are computed inside the jitted step from the batch's tokens, one cumulative sum per row (what the data
  pipeline would otherwise compute per window on the host and send beside the tokens, doubling what a batch
  carries to the devices for nothing the devices cannot derive). The attention kernels read them
  (`shardlm.models.attention`); the loss is unchanged: a document's last token still predicts the next document's
  separator, as nanoGPT's, Llama 3's and torchtitan's document masking leave it.
"""

import jax
import jax.numpy as jnp
from jax import lax


def document_ids(tokens: jax.Array, separator: int) -> jax.Array:
    """tokens [batch, T] -> int32 [batch, T]: each token's document within its row, counted from 0 (the part of a
    document the row starts in), a separator opening the next."""
    return jnp.cumsum(tokens == separator, axis=1, dtype=jnp.int32)


def document_positions(ids: jax.Array) -> jax.Array:
    """Documents' ids [batch, T] -> int32 [batch, T]: each token's offset from the first token of its document in
    the row (0 at every separator, and at the row's start)."""
    t = ids.shape[1]
    index = jnp.arange(t, dtype=jnp.int32)[None]
    starts = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    first = lax.cummax(jnp.where(starts, index, 0), axis=1)
    return index - first
