"""Resolve a plan against a model's parameter shapes and a mesh: one PartitionSpec per parameter, checked.

Everything here works on shapes alone, before anything is placed or compiled, and every problem is an error that
names what to fix: a rule naming an axis that is neither a mesh axis nor a logical name, a rule that matches no
parameter (a typo) or only parameters earlier rules already took, parameters no rule matches (unless the plan says
`unmatched: replicate`), a spec longer than the parameter's rank, an axis used twice, and a dimension a mesh
degree does not divide (JAX would silently replicate it, jax#26946). Large parameters left whole on every device
are not errors, but are listed with their bytes.

The megatron preset is checked for doing Megatron (`megatron_problems`): that its tensor-parallel rules matched
the model's layers, that the mesh has the `tensor` axis they split over, that no fused q/k/v kernel was left out
silently, and that no weight it split is stored the other way round ([out, in]). These are warnings (notes), or
errors with the plan's `strict: true`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.sharding import PartitionSpec as P

from shardlm.errors import ShardlmError
from shardlm.foreign.plan import COLUMN, ROW, Largest, Plan, Rule, matches
from shardlm.sharding.rules import LOGICAL_AXIS_RULES, as_axes, axis_degree, logical_to_spec, rules_for_mesh
from shardlm.units import fmt_bytes

LOGICAL_NAMES = tuple(dict.fromkeys(name for name, _ in LOGICAL_AXIS_RULES))
UNMATCHED_NOTE = "no rule (replicated)"
NOT_A_PARAMETER = "not a parameter (replicated)"


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: str
    shape: tuple[int, ...]
    dtype: str
    is_param: bool = True


@dataclasses.dataclass(frozen=True)
class Placement:
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: P
    placed_by: str  # the rule, or why no rule placed it
    is_param: bool = True
    rule: Rule | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass
class Layout:
    mesh: object
    plan: Plan
    placements: list[Placement]
    input_spec: P
    output_spec: P

    @property
    def specs(self) -> dict[str, P]:
        return {p.path: p.spec for p in self.placements}

    def replicated_large(self) -> list[Placement]:
        """Parameters at least `plan.report_replicated_bytes` big that every device holds whole."""
        if self.mesh.size == 1:
            return []
        return [p for p in self.placements if p.is_param and _degree(self.mesh, p.spec) == 1
                and p.nbytes >= self.plan.report_replicated_bytes]

    def notes(self) -> list[str]:
        notes = megatron_problems(self.placements, self.mesh)
        big = self.replicated_large()
        if not big:
            return notes
        listed = ", ".join(f"{p.path} {p.shape} {fmt_bytes(p.nbytes)}" for p in big[:5])
        more = f" and {len(big) - 5} more" if len(big) > 5 else ""
        return notes + [f"{len(big)} parameter(s) of {fmt_bytes(self.plan.report_replicated_bytes)} or more are "
                        f"whole on every one of the {self.mesh.size} devices, {fmt_bytes(sum(p.nbytes for p in big))} "
                        f"in all: {listed}{more}"]


def megatron_problems(placements: list[Placement], mesh) -> list[str]:
    """What keeps the megatron preset from doing Megatron on this model and mesh (see the module docstring)."""
    from collections import Counter

    ours = [p for p in placements if p.rule is not None and p.rule.origin == "preset megatron"]
    if not ours:
        return []
    column = [p for p in ours if p.rule.label.endswith(COLUMN)]
    row = [p for p in ours if p.rule.label.endswith(ROW)]
    fused = [p for p in ours if p.rule.label.startswith("fused")]
    problems = []
    if not column and not row:
        problems.append("the megatron preset's tensor-parallel rules match no weight of this model (they know "
                        "query/q_proj/wq, linear1/fc1/c_fc/up_proj/gate_proj, out/o_proj, linear2/fc2/down_proj and "
                        "Dense_0/Dense_1 in an MLP): every weight fell to its FSDP rule; write rules naming the "
                        "model's layers")
    elif "tensor" not in mesh.axis_names:
        problems.append(f"the mesh has no 'tensor' axis (its axes: {', '.join(mesh.axis_names)}), and the megatron "
                        f"preset splits attention and MLP weights over 'tensor' only (and FSDP over 'fsdp'), so "
                        f"{len(column) + len(row)} weight(s) such as {(column + row)[0].path} are not tensor-parallel; "
                        "name the mesh axes data/fsdp/tensor, or write a plan with these axes")
    if fused:
        problems.append(f"{len(fused)} fused q/k/v parameter(s) such as {fused[0].path} {fused[0].shape}: a "
                        "contiguous split over 'tensor' would give each device a mix of q, k and v rather than its "
                        "heads', so the megatron preset shards them with FSDP only (not tensor-parallel); keep q, k "
                        "and v in separate weights to make attention column-parallel")
    widths = Counter([p.shape[0] for p in column if len(p.shape) >= 2] + [p.shape[-1] for p in row])
    if widths:
        d = widths.most_common(1)[0][0]  # the model width: column weights start with it, row weights end with it
        flipped = [p for p in column if len(p.shape) == 2 and p.shape[0] != d and p.shape[1] == d] + \
                  [p for p in row if len(p.shape) == 2 and p.shape[-1] != d and p.shape[0] == d]
        if flipped:
            p = flipped[0]
            problems.append(f"{len(flipped)} weight(s) look stored [out, in], e.g. {p.path} {p.shape} in a model of "
                            f"width {d}: the megatron preset split them on the other dimension than Megatron's; "
                            "write rules for them (the spec per dimension), or store them [in, out]")
    return problems


def canonical(spec: P) -> P:
    """Trailing unsplit dimensions dropped: P('model', None) -> P('model'). JAX returns jit outputs in this form
    and compares specs literally, so an array placed as P('model', None) would come back from a user's own jitted
    step as P('model') and force a recompile."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _degree(mesh, spec: P) -> int:
    return math.prod(axis_degree(mesh, entry) for entry in spec)


def resolve(plan: Plan, leaves: list[Leaf], mesh) -> Layout:
    _check_rule_names(plan, mesh)
    params = [leaf for leaf in leaves if leaf.is_param]
    winners: dict[str, int | None] = {}  # parameter path -> index of the rule that places it
    matched: dict[int, list[str]] = {i: [] for i in range(len(plan.rules))}
    won: dict[int, int] = {i: 0 for i in range(len(plan.rules))}
    for leaf in params:
        winner = None
        for i, rule in enumerate(plan.rules):
            if rule.spec_for_rank(len(leaf.shape)) is not None and matches(rule, leaf.path):
                matched[i].append(leaf.path)
                if winner is None:
                    winner = i
                    won[i] += 1
        winners[leaf.path] = winner
    example = params[0].path if params else "(the model has no parameters)"
    for i, rule in enumerate(plan.rules):
        if rule.optional:
            continue
        if not matched[i]:
            raise ShardlmError(f"{plan.name}: rule {i + 1} {rule.describe()} " + _why_unmatched(rule, leaves, example))
        if not won[i]:
            first = matched[i][0]
            by = winners[first]
            raise ShardlmError(
                f"{plan.name}: rule {i + 1} {rule.describe()} never applies: every parameter it matches (e.g. {first}) "
                f"is placed by the earlier rule {by + 1} {plan.rules[by].describe()}; move it up or delete it"
            )
    orphans = [leaf for leaf in params if winners[leaf.path] is None]
    if orphans and plan.unmatched == "error":
        listed = ", ".join(f"{leaf.path} {leaf.shape}" for leaf in orphans[:6])
        more = f" and {len(orphans) - 6} more" if len(orphans) > 6 else ""
        raise ShardlmError(
            f"{plan.name}: {len(orphans)} parameter(s) match no rule: {listed}{more}; add rules for them, or set "
            "`unmatched: replicate` to keep them whole on every device"
        )
    placements = []
    for leaf in leaves:
        rule = None if winners.get(leaf.path) is None else plan.rules[winners[leaf.path]]
        if not leaf.is_param:
            placements.append(Placement(leaf.path, leaf.shape, leaf.dtype, P(), NOT_A_PARAMETER, False))
        elif rule is None:
            placements.append(Placement(leaf.path, leaf.shape, leaf.dtype, P(), UNMATCHED_NOTE))
        else:
            spec = canonical(_spec_for(rule, leaf, mesh, plan.name))
            placements.append(Placement(leaf.path, leaf.shape, leaf.dtype, spec, f"rule {rule.describe()}",
                                        rule=rule))
    for i, rule in enumerate(plan.activations):  # names checked now; shapes as the model is traced
        resolve_entries(rule.spec, None, mesh, f"{plan.name}: activation rule {i + 1} '{rule.pattern}'")
    for name, entry in plan.logical.items():
        if entry is not None:
            resolve_entries((entry,), None, mesh, f"{plan.name}: logical name '{name}'")
    if plan.strict and (problems := megatron_problems(placements, mesh)):
        raise ShardlmError(f"{plan.name} (strict): {problems[0]}")
    io = lambda entries, what: canonical(resolve_entries(entries, None, mesh, f"{plan.name}: {what}"))  # noqa: E731
    return Layout(mesh, plan, placements, io(plan.inputs, "inputs"), io(plan.outputs, "outputs"))


def _why_unmatched(rule: Rule, leaves: list[Leaf], example: str) -> str:
    same_pattern = [leaf for leaf in leaves if matches(rule, leaf.path)]
    params = [leaf for leaf in same_pattern if leaf.is_param]
    if params:
        ranks = ", ".join(map(str, sorted(rule.spec.specs)))
        return (f"matches {params[0].path} of rank {len(params[0].shape)}, but its spec covers only rank(s) {ranks}; "
                "add that rank to the mapping")
    if same_pattern:
        return (f"matches only variables that are not parameters (e.g. {same_pattern[0].path}); plans place "
                "parameters, and other variables stay whole on every device: delete the rule")
    return (f"matches no parameter; fix the pattern (paths look like '{example}'; `shardlm.explain` lists them all) "
            "or delete the rule")


def _check_rule_names(plan: Plan, mesh) -> None:
    """Every name in every rule is a mesh axis or a logical name (checked even for rules that match nothing)."""
    axes = set(mesh.axis_names)
    for i, rule in enumerate(plan.rules):
        specs = rule.spec.specs.values() if hasattr(rule.spec, "specs") else [rule.spec]
        for spec in specs:
            if isinstance(spec, Largest):
                missing = [a for a in spec.axes if a not in axes]
                if missing and not rule.optional:
                    raise ShardlmError(
                        f"{plan.name}: rule {i + 1} {rule.describe()} splits over '{missing[0]}', which is not an "
                        f"axis of the mesh ({', '.join(mesh.axis_names)}); name one of those"
                    )
                continue
            for entry in spec:
                for name in entry or ():
                    if name not in axes and name not in LOGICAL_NAMES:
                        raise ShardlmError(
                            f"{plan.name}: rule {i + 1} {rule.describe()} names '{name}', which is neither a mesh "
                            f"axis ({', '.join(mesh.axis_names)}) nor a logical axis name ({', '.join(LOGICAL_NAMES)})"
                        )
                    table_axes = {a for n, ax in LOGICAL_AXIS_RULES if n == name for a in as_axes(ax)}
                    if name not in axes and table_axes and not (table_axes & axes) and not rule.optional:
                        raise ShardlmError(
                            f"{plan.name}: rule {i + 1} {rule.describe()} names logical axis '{name}', which the rule "
                            f"table maps to {', '.join(sorted(table_axes))}, and this mesh ({', '.join(mesh.axis_names)}) "
                            "has none of them; name one of the mesh's axes instead"
                        )


def _spec_for(rule: Rule, leaf: Leaf, mesh, plan_name: str) -> P:
    spec = rule.spec_for_rank(len(leaf.shape))
    where = f"{plan_name}: rule {rule.describe()} on parameter {leaf.path} of shape {leaf.shape}"
    if isinstance(spec, Largest):
        return _largest(spec, leaf.shape, mesh)
    if len(spec) > len(leaf.shape):
        raise ShardlmError(f"{where}: the spec has {len(spec)} entries for {len(leaf.shape)} dimensions; "
                           "give one entry per dimension")
    out = resolve_entries(spec, leaf.shape, mesh, where)
    _check_divisible(out, leaf, mesh, rule)
    return out


def _largest(spec: Largest, shape: tuple[int, ...], mesh) -> P:
    axes = tuple(a for a in spec.axes if a in mesh.axis_names)
    degree = axis_degree(mesh, axes)
    if degree == 1:
        return P()
    for dim in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
        if shape[dim] % degree == 0:
            entries = [None] * len(shape)
            entries[dim] = axes[0] if len(axes) == 1 else axes
            return P(*entries)
    return P()  # no dimension divides: whole on every device (listed by Layout.replicated_large if large)


def resolve_entries(entries, shape, mesh, where: str) -> P:
    """Per-dimension entries of mesh axes and logical names -> a mesh PartitionSpec."""
    axes = set(mesh.axis_names)
    explicit: list[tuple[str, ...] | None] = []
    logical: list[str | None] = []
    for entry in entries:
        if entry is None:
            explicit.append(None)
            logical.append(None)
        elif all(a in axes for a in entry):
            explicit.append(entry)
            logical.append(None)
        elif len(entry) == 1 and entry[0] in LOGICAL_NAMES:
            explicit.append(None)
            logical.append(entry[0])
        else:
            bad = next((a for a in entry if a not in axes), entry[0])
            raise ShardlmError(
                f"{where}: '{bad}' is neither a mesh axis ({', '.join(mesh.axis_names)}) nor a logical axis name "
                f"({', '.join(LOGICAL_NAMES)}); a list entry must name mesh axes only"
            )
    taken = [a for e in explicit if e for a in e]
    if len(taken) != len(set(taken)):
        dup = next(a for a in taken if taken.count(a) > 1)
        raise ShardlmError(f"{where}: mesh axis '{dup}' splits two dimensions; a mesh axis can split only one")
    resolved = list(explicit)
    if any(logical):
        try:
            from_table = logical_to_spec(tuple(logical), rules_for_mesh(mesh), shape=shape, mesh=mesh,
                                         taken=frozenset(taken), strict=True)
        except ShardlmError as e:
            raise ShardlmError(f"{where}: {e}") from None
        for i, name in enumerate(logical):
            if name is not None:
                resolved[i] = from_table[i]
    return P(*[None if e is None else e if isinstance(e, str) else e[0] if len(e) == 1 else tuple(e)
               for e in resolved])


def _check_divisible(spec: P, leaf: Leaf, mesh, rule: Rule) -> None:
    for dim, (size, entry) in enumerate(zip(leaf.shape, spec)):
        names, degree = as_axes(entry), axis_degree(mesh, entry)
        if size % degree:
            axis = " x ".join(f"'{a}' ({mesh.shape[a]})" for a in names)
            raise ShardlmError(
                f"parameter {leaf.path} of shape {leaf.shape}: dimension {dim} (size {size}) is split {degree} ways "
                f"over mesh axis {axis} by rule {rule.describe()}, and {degree} does not divide {size}; change that "
                "axis's degree, the rule, or the layer's size"
            )
