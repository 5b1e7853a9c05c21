"""The one table that maps logical axis names to mesh axes, and everything that applies it.

Model code names the axes of every parameter and of a few activations with logical names (`embed`, `heads`,
`mlp`, `vocab`, `batch`, ...). This module is the only place that knows how those names land on the mesh axes
(data, fsdp, context, tensor). Because a mesh axis of degree 1 shards nothing, this single table covers every
strategy:

- DP (data=N): only `batch` is split; parameters are replicated for use. A training state may be stored split
  over `data` as well (`zero_rules`: ZeRO-1/2, each weight gathered once per step by its compute copy,
  `compute_copy`).
- FSDP / ZeRO-3 (fsdp=N): `batch` is split over fsdp too, and every parameter's `embed` dimension is split over
  fsdp, so parameters, gradients and AdamW moments are all 1/N per device; XLA all-gathers weights per layer.
- Megatron TP (tensor=N): attention heads (query and key/value), the MLP hidden dimension and the vocabulary are
  split over tensor (column-parallel in, row-parallel out, one all-reduce per attention or MLP half of a block).
- Context parallelism (context=N): the `seq` dimension of every activation is split over context, so a device
  holds 1/N of each sequence's tokens. Attention is the one place tokens meet: its keys and values are named
  `kv_seq`, which stays whole, so XLA all-gathers K and V over context before attention (and reduce-scatters
  their gradients after it), MaxText's all-gather form; queries, scores and outputs stay split. Parameters are
  not split by position, so the context devices would each hold every weight, as data-parallel replicas do;
  like MaxText, `embed` is sharded over fsdp x context instead (ZeRO-3 over the context devices too): the same
  bytes on the wire as the gradient all-reduce replicas would need, and 1/N of the weights and AdamW moments,
  which long sequences need most. The one parameter split by position, a learned position table (`pos`), is
  split over context along it, as the tokens it is added to are. Token batches are not split along the sequence
  (a row is seq_len + 1 tokens, inputs and shifted targets); the model splits them as it embeds.
- Sequence parallelism (`mesh.sequence_parallel`, with tensor=N): the residual stream's sequence (`res_seq`) is
  split over tensor as well, between the tensor-parallel layers (`sequence_parallel_rules`).
- Hybrids: the product of the above.

Parameters and activations differ in one name: a parameter's `embed` dimension is FSDP-sharded, while the
residual stream's `act_embed` stays whole (its batch dimension is already split over data and fsdp).
"""

import contextlib
import math
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlm.errors import ShardlmError
from shardlm.kernels.gradients import with_gradient
from shardlm.trees import path_str

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Ordered (logical name, mesh axes) pairs. A name may appear more than once: the first rule whose mesh axes are
# still free in the array's spec wins (the semantics of Flax's `logical_to_mesh_axes`), and earlier rules claim
# axes first. That is how FSDP reaches the parameters that have no `embed` dimension (biases): after `embed` has
# claimed fsdp elsewhere, the later fallbacks give fsdp to `mlp` or `head_dim`, so ZeRO-3 shards *all* state.
LOGICAL_AXIS_RULES: Rules = (
    # activations
    ("batch", ("data", "fsdp", "expert")),  # expert devices are data-parallel for everything but the experts ...
    ("batch", ("data", "fsdp")),  # ... (a rule that splits no more ways than the next gives way to it)
    ("seq", "context"),
    # The residual stream's sequence between the blocks' halves (where the norms, dropout and residual adds run):
    # split over context like every sequence; `sequence_parallel_rules` splits it over tensor too.
    ("res_seq", "context"),
    ("kv_seq", None),  # keys and values as attention reads them: every position, gathered over context
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("act_experts", "expert"),  # a mixture of experts' tokens, grouped by the expert they are sent to
    # parameters
    ("repeats", None),  # a circular pipeline's repeats axis, before `layers` ([R, S K]: each stage holds every repeat)
    ("layers", "stage"),  # the stacked blocks' layers axis (`model.scan_layers`): pipeline stages split it
    ("layers", None),
    ("experts", "expert"),  # a mixture of experts' expert dimension (claims `expert` before `embed` can)
    # A position table is stored as it is read: split over context as the sequence is (so it claims `context`
    # before `embed` can). Split over context on `embed` instead, the rows each device adds would have to move
    # the context split from one dimension to the other, which XLA's partitioner can do only by replicating the
    # table and its gradient on every device (an involuntary full rematerialisation).
    ("pos", "context"),
    ("embed", ("fsdp", "context", "expert")),  # context and expert devices are FSDP shards of the weights too ...
    ("embed", ("fsdp", "context")),
    ("embed", "fsdp"),  # ... unless the product does not divide the dimension
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),  # grouped-query attention's key/value heads: the tensor degree must divide them too
    ("mlp", ("tensor", "fsdp")),  # an MLP bias: split over both
    ("mlp", "tensor"),  # an MLP weight, whose embed dimension already took fsdp
    # multi-head latent attention's latents (the compressed queries, keys and values every head reads): never
    # split over tensor (each tensor device expands the whole latent for its heads), split over fsdp where the
    # weight has no embed dimension (the up-projections [latent, heads, head_dim])
    ("latent", "fsdp"),
    ("latent", None),
    ("head_dim", "fsdp"),  # an attention bias [heads, head_dim]: FSDP has no embed dimension to use
    ("head_dim", None),
    ("pos", None),
)


def as_axes(axes: MeshAxes) -> tuple[str, ...]:
    """A spec entry (None, an axis, or several) as a tuple of mesh axes."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(names: tuple[str | None, ...], rules: Rules | None = None, *, shape=None, mesh=None,
                    taken: frozenset[str] = frozenset(), strict: bool = False) -> P:
    """('embed', 'mlp') -> P('fsdp', 'tensor'). Every name must have a rule (map it to None to replicate).

    Given the array's `shape` and the `mesh`, a rule that is not a name's last one is also skipped when its degree
    does not divide that dimension (a bias with head_dim 64 under fsdp=128 falls back to replicated) or when it
    splits no more ways than the next rule for the name, made of fewer of its axes (`_no_more_than_next`); the last
    rule for a name is binding, and `check_divisible` reports it if it does not fit. Mesh axes in `taken` are
    already used by other dimensions (a plan that mixes mesh axes and logical names); with `strict`, a name none
    of whose rules could be applied because their axes were taken is an error instead of staying unsplit.
    """
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    last_rule = {name: i for i, (name, _) in enumerate(rules)}
    known = set(last_rule)
    for name in names:
        if name is not None and name not in known:
            raise ShardlmError(
                f"logical axis '{name}' has no rule; add it to the logical axis rules (map it to None to replicate)"
            )
    out: list[MeshAxes] = [None] * len(names)
    decided = [name is None for name in names]
    used: set[str] = set(taken)
    for r, (rule_name, axes) in enumerate(rules):
        for i, name in enumerate(names):
            if decided[i] or name != rule_name:
                continue
            fits = r == last_rule[name] or (
                (shape is None or shape[i] % axis_degree(mesh, axes) == 0)
                and (mesh is None or not _no_more_than_next(rules, r, mesh)))
            if fits and used.isdisjoint(as_axes(axes)):
                out[i], decided[i] = axes, True
                used.update(as_axes(axes))
            break
    if strict:
        for name, done in zip(names, decided):
            if not done:
                axes = sorted({a for n, ax in rules if n == name for a in as_axes(ax)})
                raise ShardlmError(f"logical axis '{name}' cannot be placed: its mesh axes ({', '.join(axes)}) "
                                   "already split another dimension; name a free mesh axis instead")
    return P(*out)


def _no_more_than_next(rules: Rules, r: int, mesh) -> bool:
    """Whether rule r splits its name no more ways on `mesh` than the name's next rule, whose axes are a subset of
    its own: then the next, simpler rule is used (embed over (fsdp, context) with context 1 is embed over fsdp;
    layers over stage with one stage is layers whole)."""
    name, axes = rules[r]
    nxt = next(ax for n, ax in rules[r + 1:] if n == name)
    fewer = set(as_axes(nxt)) < set(as_axes(axes))  # (no axes at all: an axis of degree 1 gives way to None)
    return fewer and axis_degree(mesh, nxt) == axis_degree(mesh, axes)


def sequence_parallel_rules(rules: Rules | None = None) -> Rules:
    """The table with Megatron's sequence parallelism (Korthikanti et al., 2022; `mesh.sequence_parallel`): the
    residual stream (`res_seq`: the blocks' inputs and outputs, the norms, the residual adds) split along the
    sequence over the tensor group as well as over context. A device then holds 1/tensor of those activations
    and of the block inputs a checkpoint keeps; each row-parallel projection's all-reduce becomes a
    reduce-scatter into the split, and each column-parallel projection starts with an all-gather of it. Inside
    attention and the MLP the sequence is split as `seq` is (heads and the hidden layer are split over tensor).
    Where tensor x context does not divide the sequence (a decode step's one position), the next rule, context
    alone, applies."""
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    at = next(i for i, (name, _) in enumerate(rules) if name == "res_seq")
    return rules[:at] + (("res_seq", ("context", "tensor")),) + rules[at:]


def rules_for_mesh(mesh, rules: Rules | None = None) -> Rules:
    """The table restricted to `mesh`'s axes: an axis the mesh does not have shards nothing (degree 1)."""
    present = set(mesh.axis_names)
    out = []
    for name, axes in LOGICAL_AXIS_RULES if rules is None else rules:
        kept = tuple(a for a in as_axes(axes) if a in present)
        out.append((name, kept[0] if len(kept) == 1 else kept or None))
    return tuple(out)


def axis_degree(mesh, axes: MeshAxes) -> int:
    return math.prod(mesh.shape[a] for a in as_axes(axes))


# --- activation constraints -------------------------------------------------------------------------------------
# Model code calls `constrain(x, "batch", "seq", "act_embed")`; outside `use_mesh_rules` it is the identity, so a
# model runs unchanged on one device and in tests that never build a mesh.

_active = threading.local()


class _Active(NamedTuple):
    mesh: Any
    rules: Rules  # how activations, and weights as they are used, are split
    storage: Rules  # how the weights are stored (with `data` too when the state is sharded over it: `zero_rules`)


@contextlib.contextmanager
def use_mesh_rules(mesh, rules: Rules | None = None, storage: Rules | None = None):
    """Within this context, `constrain` pins activations to `mesh` through the logical rules. `storage`: the table
    the weights are stored by, when it differs (a training state sharded over `data`: `zero_rules`); the
    gradients of their compute copies are pinned to it (`compute_copy`)."""
    previous = getattr(_active, "value", None)
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    _active.value = _Active(mesh, rules, rules if storage is None else storage)
    try:
        yield
    finally:
        _active.value = previous


def active_mesh():
    """The mesh of the active rules (None outside `use_mesh_rules`): model code that runs per device
    (`jax.shard_map`, a mixture of experts' all-to-alls) asks for it."""
    active = getattr(_active, "value", None)
    return None if active is None else active.mesh


def active_rules() -> Rules | None:
    """The rules of the active `use_mesh_rules` (None outside it)."""
    active = getattr(_active, "value", None)
    return None if active is None else active.rules


def active_spec(*names: str | None, shape=None) -> P:
    """The PartitionSpec the active rules give logical `names` (P() outside `use_mesh_rules`)."""
    active = getattr(_active, "value", None)
    if active is None:
        return P()
    return logical_to_spec(names, active.rules, shape=shape, mesh=active.mesh)


def active_storage_spec(*names: str | None, shape=None) -> P:
    """The PartitionSpec a weight with logical `names` is stored with under the active rules (P() outside
    `use_mesh_rules`): the storage table's (`use_mesh_rules(storage=...)`)."""
    active = getattr(_active, "value", None)
    if active is None:
        return P()
    return logical_to_spec(names, active.storage, shape=shape, mesh=active.mesh)


def active_degree(name: str) -> int:
    """How many ways the active rules split logical axis `name` (1 outside `use_mesh_rules`): model code asks
    whether the sequence is split without naming a mesh axis."""
    active = getattr(_active, "value", None)
    if active is None:
        return 1
    return axis_degree(active.mesh, logical_to_spec((name,), active.rules, mesh=active.mesh)[0])


def active_axes(name: str) -> tuple[str, ...]:
    """The mesh axes the active rules split logical axis `name` over (() outside `use_mesh_rules`): a pipeline's
    `vmap` over stages names them as its `spmd_axis_name`."""
    active = getattr(_active, "value", None)
    return () if active is None else as_axes(logical_to_spec((name,), active.rules, mesh=active.mesh)[0])


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    active = getattr(_active, "value", None)
    if active is None:
        return x
    # Shape-aware, as parameters' shardings are: a weight cast to the compute dtype (`use`) is pinned to exactly
    # its own spec, fallback rules included.
    spec = logical_to_spec(names, active.rules, shape=x.shape, mesh=active.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(active.mesh, spec))


def constrain_with_gradient(x: jax.Array, names: tuple, gradient_names: tuple) -> jax.Array:
    """`constrain(x, *names)`, whose gradient is constrained as `gradient_names` say rather than by autodiff's
    transpose of the constraint. Under sequence parallelism a norm's output is read by several projections
    gathered over the sequence (`names`), while its gradient, their partial sums, belongs split as the residual
    stream is (`gradient_names`): pinned there, the partial sums are reduce-scattered once, and every projection
    reads one gather of the input, in the forward pass and in its recomputation. The identity outside
    `use_mesh_rules`."""
    active = getattr(_active, "value", None)
    if active is None:
        return x
    # Both shardings are read now, under the rules in force here: the backward pass is traced later, outside them.
    pinned, gradient = (NamedSharding(active.mesh, logical_to_spec(n, active.rules, shape=x.shape, mesh=active.mesh))
                        for n in (names, gradient_names))
    return _pinned_with_gradient(x, lambda a: jax.lax.with_sharding_constraint(a, pinned),
                                 lambda g: jax.lax.with_sharding_constraint(g, gradient))


def _pinned_with_gradient(x: jax.Array, pin, pin_gradient) -> jax.Array:
    """`pin(x)`, whose gradient is `pin_gradient(g)` rather than autodiff's own transpose of `pin`."""

    return with_gradient(pin, lambda _, g: (pin_gradient(g),), x, saves_inputs=False)


# Mesh axes that split a weight only to store it (FSDP's, and the context devices acting as FSDP shards): a weight
# is gathered over them for use. The others (stage, tensor) split the computation itself and stay split.
STORAGE_AXES = ("data", "fsdp", "expert", "context")
# Logical dimensions computed where they are stored: a mixture's experts run on the devices that hold them (expert
# parallelism), so their split is never gathered for use, whichever axes it is over.
COMPUTED_WHERE_STORED = ("experts",)


def _in_use(names: tuple, stored: P) -> tuple:
    """The spec entries of a weight with logical `names` and stored spec `stored` as it is used: the stored entries
    less the `STORAGE_AXES`, except on a dimension computed where it is stored."""
    stored = tuple(stored) + (None,) * (len(names) - len(stored))
    return tuple(entry if name in COMPUTED_WHERE_STORED else _keep(entry) for name, entry in zip(names, stored))


def axes_in_use(names: tuple, shape: tuple) -> set[str]:
    """The mesh axes (of more than one device) that still split a weight of logical `names` and `shape` as
    `gathered_for` lays it out for use: the tensor split, and an expert split. Empty outside `use_mesh_rules`."""
    active = getattr(_active, "value", None)
    if active is None:
        return set()
    mesh = active.mesh
    stored = logical_to_spec(names, active.storage, shape=shape, mesh=mesh)
    return {a for entry in _in_use(names, stored) for a in as_axes(entry) if mesh.shape[a] > 1}


def gathered_for(x: jax.Array, names: tuple) -> jax.Array:
    """A weight with logical `names` gathered over the `STORAGE_AXES` that shard it, its gradient reduce-scattered
    back to its stored sharding: a pipeline gathers each stage's weights once per step with it. The identity
    outside `use_mesh_rules`."""
    active = getattr(_active, "value", None)
    if active is None:
        return x
    mesh = active.mesh
    stored = NamedSharding(mesh, logical_to_spec(names, active.storage, shape=x.shape, mesh=mesh))
    used = NamedSharding(mesh, P(*_in_use(names, stored.spec)))
    return _pinned_with_gradient(x, lambda a: jax.lax.with_sharding_constraint(a, used),
                                 lambda g: jax.lax.with_sharding_constraint(g, stored))


def compute_copy(x: jax.Array, names: tuple, dtype, reduce_dtype=None) -> jax.Array:
    """Weight `x` (logical `names`) cast to `dtype` for use, and pinned to its sharding under the active rules:
    its stored sharding, less the `data` split of a state sharded over the data-parallel replicas (`zero_rules`),
    which XLA gathers here, in `dtype`, once per step. Its gradient is pinned to the stored sharding (summed over
    the replicas and, sharded over them, reduce-scattered) after a cast to `reduce_dtype` (default: x's), and
    returned in x's dtype. The identity but for the cast outside `use_mesh_rules`."""
    active = getattr(_active, "value", None)
    if active is None:
        return x.astype(dtype)
    mesh, reduce_dtype = active.mesh, reduce_dtype or x.dtype
    used = NamedSharding(mesh, logical_to_spec(names, active.rules, shape=x.shape, mesh=mesh))
    stored = NamedSharding(mesh, logical_to_spec(names, active.storage, shape=x.shape, mesh=mesh))
    # cast where each shard lies (pinned to the stored sharding), then gathered: in `dtype`, not in x's
    return _pinned_with_gradient(
        x, lambda a: jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(a.astype(dtype), stored), used),
        lambda g: jax.lax.with_sharding_constraint(g.astype(reduce_dtype), stored).astype(x.dtype))


def sharded_lookup(table: jax.Array, ids: jax.Array, names: tuple, dtype=None) -> jax.Array:
    """table[ids] for a table (logical `names`, [vocab, embed]) stored with its embed dimension split over mesh
    axes that also split the tokens of `ids` [batch, T] (FSDP's, the context devices', a state sharded over
    `data`): the ids are gathered over those axes, each device looks up its own columns of the table for all of
    them, and the rows move to the activations' split, one mesh axis at a time (all-to-alls of activations: moved
    all at once, XLA's partitioner falls back to replicating the rows). Nothing of the table moves: the
    alternative, a lookup into the gathered table, gathers it (1 GiB of bfloat16 for Llama 3's 128k x 4096) and
    reduce-scatters its gradient, a dense [vocab, embed] buffer. The gradient is scattered into the table's own
    shard, in its dtype: a frequent token's rows are summed in float32 for a float32 table. The rows are cast to
    `dtype` (default: the table's) as they are looked up, so they move, and their gradients move back, in it.
    Rows come out [batch, T, embed], split as ("batch", "seq", "act_embed")."""
    active = getattr(_active, "value", None)
    dtype = dtype or table.dtype
    if active is None:
        return table[ids].astype(dtype)
    mesh = active.mesh
    live = lambda entry: [a for a in as_axes(entry) if mesh.shape[a] > 1]  # noqa: E731
    columns = live(logical_to_spec(names, active.storage, shape=table.shape, mesh=mesh)[1])
    target = logical_to_spec(("batch", "seq", "act_embed"), active.rules, shape=(*ids.shape, table.shape[1]),
                             mesh=mesh)
    batch, seq = live(target[0]), live(target[1])
    rows_axes = [a for a in batch if a not in columns]
    seq_axes: list[str] = []

    def pinned(x, *entries):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*(tuple(e) or None for e in entries))))

    rows = pinned(table[pinned(ids, rows_axes, [])].astype(dtype), rows_axes, [], columns)
    while columns:  # the minor-most column axis to its place among the batch's or the sequence's axes
        axis = columns.pop()
        if axis in batch:
            rows_axes = [a for a in batch if a in rows_axes or a == axis]
        else:
            seq_axes = [a for a in seq if a in seq_axes or a == axis]
        rows = pinned(rows, rows_axes, seq_axes, columns)
    return pinned(rows, batch, seq, [])


def zero_rules(rules: Rules | None = None) -> Rules:
    """The table for a training state whose weights and optimizer state are split over `data` as well (ZeRO-1 over
    the data-parallel replicas: MaxText's `shard_optimizer_over_data`): a name's rules that split over `fsdp` are
    preceded by variants of them with `data` added last, in the same order. A variant is skipped where it does not
    divide the dimension, or splits no more ways than the next (the same axes, some of degree 1)."""
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    out, done = [], set()
    for name, axes in rules:
        if name not in done and name not in _ACTIVATION_NAMES:
            out += [(name, (*as_axes(a), "data")) for n, a in rules if n == name and "fsdp" in as_axes(a)]
            done.add(name)
        out.append((name, axes))
    return tuple(out)


_ACTIVATION_NAMES = ("batch", "seq", "res_seq", "kv_seq")


def replicas_of(x: jax.Array, names: tuple, replicas: int, axes: tuple[str, ...]) -> jax.Array:
    """Weight `x` (logical `names`, its first axis the stage's) as `replicas` copies on a new second axis split over
    mesh `axes` (the batch's): each device holds a whole copy of its stage's weight (gathered over the
    `STORAGE_AXES`, once), and so accumulates its own partial gradient through loops that use it. The copies'
    gradients are summed only where the broadcast is transposed, after those loops: one reduce-scatter back into
    the stored shards, where a weight used whole would have its gradient reduced in every iteration."""
    mesh, storage = _active.value.mesh, _active.value.storage
    stored = logical_to_spec(names, storage, shape=x.shape, mesh=mesh)
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, stored))
    copies = jnp.broadcast_to(x[:, None], (x.shape[0], replicas, *x.shape[1:]))
    return jax.lax.with_sharding_constraint(copies, NamedSharding(mesh, _copies_spec(names, stored, axes, at=1)))


def copies_over(x: jax.Array, names: tuple, axes: tuple[str, ...]) -> jax.Array:
    """Weight `x` (logical `names`) gathered over the `STORAGE_AXES` that shard it, as one copy per device of mesh
    `axes` on a new leading axis split over them: [copies, ...]. A loop that uses the weight once per microbatch
    (a 1F1B pipeline's head) then adds each microbatch's gradient into its device's own copy's, and the copies'
    gradients are summed where the broadcast is transposed, after the loop: one reduce-scatter into the stored
    shards instead of one per microbatch. The identity, on a leading axis of 1, outside `use_mesh_rules`."""
    active = getattr(_active, "value", None)
    if active is None:
        return x[None]
    mesh, storage = active.mesh, active.storage
    stored = logical_to_spec(names, storage, shape=x.shape, mesh=mesh)
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, stored))
    n = math.prod(mesh.shape[a] for a in axes)
    copies = jnp.broadcast_to(x[None], (n, *x.shape))
    return jax.lax.with_sharding_constraint(copies, NamedSharding(mesh, _copies_spec(names, stored, axes, at=0)))


def _copies_spec(names: tuple, stored: P, axes: tuple[str, ...], at: int) -> P:
    """The spec of copies of a weight with logical `names` stored as `stored`, one per device of mesh `axes` on a
    new axis at position `at`: the dimensions before it as stored (a pipeline's stage axis), the rest as the
    weight is used (`_in_use`: gathered over the `STORAGE_AXES`)."""
    kept = tuple(stored) + (None,) * (len(names) - len(stored))
    return P(*kept[:at], axes or None, *_in_use(names, stored)[at:])


def gradient_carrier(x: jax.Array, names: tuple, replicas: int = 1, axes: tuple[str, ...] = ()) -> jax.Array:
    """Zeros of `x`'s shape and dtype, laid out as `gathered_for(x, names)` lays x out (with `replicas`, as
    `replicas_of(x, names, replicas, axes)` does, [S, F, ...]), whose gradient is `x`'s: summed over the replicas and
    pinned to x's stored sharding. A loop that reads a weight in a 16-bit dtype takes its gradient through a
    carrier (`shardlm.schedules.gpipe`), so that the loop sums the weight's gradient over its iterations in x's
    dtype (float32) and not in the weight's. The zeros themselves are never read (XLA drops them)."""
    active = getattr(_active, "value", None)
    shape = x.shape if replicas == 1 else (x.shape[0], replicas, *x.shape[1:])
    pin = pin_gradient = lambda a: a  # noqa: E731
    if active is not None:
        mesh = active.mesh
        stored = logical_to_spec(names, active.storage, shape=x.shape, mesh=mesh)
        used = P(*_in_use(names, stored)) if replicas == 1 else _copies_spec(names, stored, axes, at=1)
        pin = lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, used))  # noqa: E731
        pin_gradient = lambda g: jax.lax.with_sharding_constraint(g, NamedSharding(mesh, stored))  # noqa: E731

    return with_gradient(lambda x: pin(jnp.zeros(shape, x.dtype)),
                         lambda _, g: (pin_gradient(g if replicas == 1 else g.sum(1)),), x, saves_inputs=False)


def _keep(entry: MeshAxes) -> MeshAxes:
    kept = tuple(a for a in as_axes(entry) if a not in STORAGE_AXES)
    return kept[0] if len(kept) == 1 else kept or None


# --- parameter and state shardings ------------------------------------------------------------------------------


def _logical_names(variable: Any) -> tuple[str | None, ...] | None:
    names = getattr(variable, "out_sharding", None)
    if names is None:
        names = variable.get_metadata().get("out_sharding") if hasattr(variable, "get_metadata") else None
    return tuple(names) if names is not None else None


def state_partition_specs(abstract_state, mesh, rules: Rules | None = None):
    """For an `nnx.State` of variables, a matching tree of mesh PartitionSpecs (variables without names: P())."""
    from flax import nnx

    def spec(variable):
        names = _logical_names(variable)
        if names is None:
            return variable.replace(P())
        return variable.replace(logical_to_spec(names, rules, shape=variable.shape, mesh=mesh))

    return jax.tree.map(spec, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(abstract_state, mesh, rules: Rules | None = None):
    """NamedShardings for every leaf of an `nnx.State`, after checking every split dimension divides evenly."""
    specs = state_partition_specs(abstract_state, mesh, rules)
    check_divisible(abstract_state, specs, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def check_divisible(abstract_state, specs, mesh) -> None:
    """JAX may silently replicate a dimension its mesh axis does not divide (jax#26946); fail loudly instead."""
    from flax import nnx

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    variables = jax.tree_util.tree_flatten_with_path(abstract_state, is_leaf=is_var)[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, var), spec in zip(variables, spec_leaves, strict=True):
        shape = tuple(var.shape)
        names = _logical_names(var) or (None,) * len(shape)
        for dim, (size, axes) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
            degree = axis_degree(mesh, axes)
            if size % degree:
                knobs = " x ".join(f"mesh.{a}" for a in as_axes(axes))
                what = f"its '{names[dim]}' dimension" if names[dim] else f"dimension {dim}"
                raise ShardlmError(
                    f"parameter {path_str(path)} of shape {shape}: {what} (size {size}) is split {degree} ways over "
                    f"{knobs}, which does not divide it; choose {knobs} dividing {size} or resize the model"
                )


def batch_sharding(mesh, rules: Rules | None = None) -> NamedSharding:
    """Sharding of a [batch, seq_len + 1] token array: batch split over (data, fsdp, expert), each row whole
    (seq_len + 1 does not split evenly; the model splits the sequence over context as it embeds it)."""
    return NamedSharding(mesh, logical_to_spec(("batch", None), rules, mesh=mesh))


def rules_without(axes: tuple[str, ...], rules: Rules) -> Rules:
    """The table with mesh `axes` taken out of every rule: inside a `vmap` whose vmapped dimension those axes split
    (a pipeline's data-parallel replicas), no other dimension may take them."""
    out = []
    for name, entry in rules:
        kept = tuple(a for a in as_axes(entry) if a not in axes)
        out.append((name, kept[0] if len(kept) == 1 else kept or None))
    return tuple(out)


def generation_rules(rules: Rules | None = None) -> Rules:
    """The table with `seq` (and the residual stream's, `res_seq`), `pos` and `layers` left whole: generation's. A
    decode step has one token per row, so the context devices serve as replicas (and a row looks up its position
    in the whole table); and it runs the layers one after another, not as a pipeline, so the stage devices do too
    (each holds every layer)."""
    return tuple((name, None if name in ("seq", "res_seq", "pos", "layers") else axes)
                 for name, axes in (LOGICAL_AXIS_RULES if rules is None else rules))


def owner_spec(names: tuple, shape: tuple, mesh, batch_names: tuple[str, ...], stored: P | None = None) -> P:
    """A layout of whole matrices, each on the devices that own it: the dimensions named in `batch_names` (a
    stack's layers, a mixture's experts) split over as many of the mesh's axes as divide them, and every other
    dimension whole. Where the batch dimensions cannot take every axis, the matrices are copied over the rest (all
    of them, for a weight with no batch dimension). What an optimizer that needs whole matrices (Muon's
    Newton-Schulz iterations) computes in, with no collective inside.

    Which axes (given how the array is `stored`): a batch dimension keeps the axes that already split it (a
    pipeline's stages, an expert axis: nothing moves); then come the axes that split its other dimensions (each
    moves to the batch dimensions by an all-to-all of the array's share; one left out must be gathered, the array
    n times over on every device), then the rest; the largest first within each (fewest matrices per device). An
    axis that did not split the stored array costs nothing to split the matrices over (each device keeps its
    slice of them), and the owners' results are gathered along it afterwards."""
    entries = tuple(stored or P()) + (None,) * len(shape)
    stored_axes = [as_axes(entry) for entry in entries[:len(shape)]]
    splitting = {a for axes in stored_axes for a in axes}
    free = sorted((a for a in mesh.axis_names if mesh.shape[a] > 1),
                  key=lambda a: (a not in splitting, -mesh.shape[a]))
    kept = [[a for a in axes if a in free] if name in batch_names else []
            for name, axes in zip(names, stored_axes)]
    free = [a for a in free if not any(a in axes for axes in kept)]
    spec = []
    for name, size, taken in zip(names, shape, kept):
        size //= math.prod(mesh.shape[a] for a in taken)
        if name in batch_names:
            for axis in list(free):
                if size % mesh.shape[axis] == 0:
                    taken.append(axis)
                    free.remove(axis)
                    size //= mesh.shape[axis]
        spec.append(tuple(taken) if len(taken) > 1 else taken[0] if taken else None)
    return P(*spec)


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
