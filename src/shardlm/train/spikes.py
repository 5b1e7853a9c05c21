"""Skipping an update whose loss or gradient norm spikes, inside the jitted step (OLMo-core's rule).

Design choices:
- An optax wrapper around the whole optimizer (`guard_spikes`): the step hands it the loss and the gradient norm
  (before clipping) with the gradients. It keeps the last `train.spike_window` losses and gradient norms of the
  updates it applied, and skips an update when either value is not finite, or, once half the window is filled,
  exceeds the window's mean by more than `train.spike_sigmas` standard deviations. Every device sees the same two
  global scalars, so every mesh takes the same decision.
- A skipped update leaves everything as it was: the updates returned are negative zeros (x + -0.0 is x bit for bit,
  -0.0 included, where +0.0 would turn -0.0 into +0.0), the inner optimizer's state (moments, its step count and
  so the learning rate's schedule) is the old one, and the window does not take the spike. The run after a skip is
  then, bit for bit, the run that never saw that batch (the step counter, the data position and dropout's key
  still advance: they count batches, not updates).
- What it did is counted in its state (`GuardState`): updates skipped in all, the current streak of skips and
  whether the streak reached `train.max_skips`, after which it skips every update (`halted`) until the loop, at
  its next look, stops the run with a one-line error. The state is part of the optimizer's, so a checkpoint holds
  it and a resumed run continues the same window.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class GuardState(NamedTuple):
    inner: optax.OptState
    losses: jax.Array  # [window] float32: the applied updates' losses, newest at (seen - 1) % window
    norms: jax.Array  # [window] float32: their gradient norms
    seen: jax.Array  # int32: updates applied (so entries filled: min(seen, window))
    skipped: jax.Array  # int32: updates skipped in all
    streak: jax.Array  # int32: updates skipped in a row, up to the last one
    halted: jax.Array  # bool: the streak reached max_skips


def _beyond(value, history, filled, sigmas: float):
    """Whether `value` exceeds the mean of the window's `filled` entries by more than `sigmas` of their standard
    deviations."""
    valid = jnp.arange(history.shape[0]) < filled
    count = jnp.maximum(filled, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, history, 0.0)) / count
    std = jnp.sqrt(jnp.sum(jnp.where(valid, (history - mean) ** 2, 0.0)) / count)
    return value - mean > sigmas * std


def is_spike(state: GuardState, loss, grad_norm, sigmas: float) -> jax.Array:
    """The rule: a non-finite loss or gradient norm, or either beyond `sigmas` deviations of the window once it is
    half full."""
    window = state.losses.shape[0]
    filled = jnp.minimum(state.seen, window)
    ready = filled >= max(2, window // 2)
    spike = ready & (_beyond(loss, state.losses, filled, sigmas) | _beyond(grad_norm, state.norms, filled, sigmas))
    return ~jnp.isfinite(loss) | ~jnp.isfinite(grad_norm) | spike | state.halted


def guard_spikes(inner: optax.GradientTransformation, t) -> optax.GradientTransformationExtraArgs:
    """`inner` that skips the update at a spike (`is_spike`, with train config `t`'s window, sigmas and
    max_skips). Its update takes `loss` and `grad_norm` (before clipping) as keyword arguments."""
    window, sigmas, max_skips = t.spike_window, t.spike_sigmas, t.max_skips

    def init(params):
        zeros = jnp.zeros((window,), jnp.float32)
        count = jnp.zeros((), jnp.int32)
        return GuardState(inner.init(params), zeros, zeros, count, count, count, jnp.zeros((), jnp.bool_))

    def update(updates, state: GuardState, params=None, *, loss=None, grad_norm=None, **extra):
        # Without them (optax's own callers), the updates' norm, and no loss rule (a window of zeros)
        grad_norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        loss, grad_norm = jnp.asarray(0.0 if loss is None else loss, jnp.float32), jnp.asarray(grad_norm, jnp.float32)
        skip = is_spike(state, loss, grad_norm, sigmas)
        new_updates, new_inner = inner.update(updates, state.inner, params, **extra)
        kept = lambda old, new: jnp.where(skip, old, new)  # noqa: E731
        inner_state = jax.tree.map(kept, state.inner, new_inner)
        new_updates = jax.tree.map(lambda u: jnp.where(skip, jnp.full_like(u, -0.0), u), new_updates)
        slot = state.seen % window
        streak = jnp.where(skip, state.streak + 1, 0)
        return new_updates, GuardState(
            inner_state,
            kept(state.losses, state.losses.at[slot].set(loss)),
            kept(state.norms, state.norms.at[slot].set(grad_norm)),
            state.seen + (~skip).astype(jnp.int32),
            state.skipped + skip.astype(jnp.int32),
            streak,
            state.halted | (streak >= max_skips),
        )

    return optax.GradientTransformationExtraArgs(init, update)


def guard_state(opt_state) -> GuardState | None:
    """The guard's state in an optimizer state (nnx's or optax's), or None when the optimizer has no guard."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, GuardState))
             if isinstance(s, GuardState)]
    return found[0] if found else None


def guard_metrics(opt_state) -> dict:
    """What a step logs of the guard: {"skipped": updates skipped in all, "skip_streak", "skip_halted"}; {}
    without a guard."""
    g = guard_state(opt_state)
    if g is None:
        return {}
    return {"skipped": g.skipped, "skip_streak": g.streak, "skip_halted": g.halted}


def skipped_updates(train_state) -> jax.Array | int:
    """Updates the guard has skipped in a training state ({"model", "optimizer"}, an `nnx.State`), 0 without a
    guard."""
    opt_state = train_state["optimizer"]["opt_state"]
    return opt_state["skipped"][...] if "skipped" in opt_state else 0
