"""Sharding plans: how to place the parameters of a model shardlm did not write, as data.

A plan is a YAML or JSON file, a Python dict, or the name of a preset (`dp`, `fsdp`, `megatron`):

    mesh: {data: 2, fsdp: 2, tensor: 2}        # degrees by axis name; one may be -1 ("the rest")
    rules:                                     # ordered: the first rule that matches a parameter places it
      - ["mha/{query,key,value}/kernel", [fsdp, tensor, null]]
      - ["linear1/kernel", [embed, mlp]]       # logical names, resolved through shardlm's strategy table
      - ["**/bias", replicate]
    inputs: [batch, null]                      # the model input's spec (tokens [batch, seq])
    outputs: [batch, null, null]               # the model output's spec (logits)
    unmatched: error                           # parameters no rule matches: error (default) or replicate
    preset: fsdp                               # optional: a preset's rules are tried after this plan's own
    strict: false                              # true: what the megatron preset warns about is an error
    activations:                               # optional: module outputs to constrain, by module path
      - ["blocks/*/mlp", [batch, null, null]]
    logical: {embed: null, mlp: tensor}        # optional: the model's own logical names -> mesh axes

Patterns match '/'-joined parameter paths, the key path of the tree the user holds (`nnx.state(model)`:
`blocks/0/mha/query/kernel`; Linen variables: `params/Dense_0/kernel`). `*` matches within one path segment,
`**` any number of segments, `{a,b}` either alternative. Like a .gitignore line, a pattern matches the end of the
path at any depth unless it starts with '/', which anchors it at the root.

A spec is a list with one entry per dimension (shorter lists leave trailing dimensions whole). An entry is null,
a mesh axis, a logical axis name (`embed`, `heads`, `mlp`, `vocab`, ...; see `sharding.rules`), or a list of mesh
axes. Whole-parameter specs: `replicate`; `largest` (split the largest dimension the fsdp degree divides, seed
004's FSDP; `largest:AXIS` names another axis); and a mapping from rank to spec, which matches only parameters of
those ranks (so one rule can cover a 2-D Dense kernel and a 3-D attention kernel).

`activations` and `logical` constrain activations rather than place parameters (`shardlm.foreign.activations`).

Presets are plans too: their rules are ordinary rules, marked optional so that a rule for a layer name the model
does not use is not an error.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from shardlm.errors import ShardlmError
from shardlm.files import read_mapping

UNMATCHED = ("error", "replicate")
PLAN_KEYS = {"mesh", "rules", "inputs", "outputs", "unmatched", "preset", "report_replicated_bytes", "strict",
             "activations", "logical"}
DEFAULT_REPORT_BYTES = 1 << 20  # a parameter this large left whole on every device is worth a line

Entry = tuple[str, ...] | None  # None: not split; else mesh axes, or one logical name


@dataclasses.dataclass(frozen=True)
class Largest:
    """Split the largest dimension that the product of `axes` divides (seed 004's FSDP); else replicate."""

    axes: tuple[str, ...] = ("fsdp",)


@dataclasses.dataclass(frozen=True)
class ByRank:
    """Different specs for parameters of different ranks; a rank not listed means the rule does not match."""

    specs: dict[int, tuple[Entry, ...] | Largest]


Spec = tuple[Entry, ...] | Largest | ByRank


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str
    spec: Spec
    optional: bool = False  # preset rules: matching nothing is fine
    origin: str = "plan"  # "plan", or "preset NAME"
    label: str = ""  # a short name for a preset rule, shown instead of its long pattern

    @property
    def regex(self) -> re.Pattern:
        return compile_pattern(self.pattern)

    def spec_for_rank(self, rank: int) -> tuple[Entry, ...] | Largest | None:
        if isinstance(self.spec, ByRank):
            return self.spec.specs.get(rank)
        return self.spec

    def describe(self) -> str:
        if self.label:
            return f"{self.label} ({self.origin})"
        return f"'{self.pattern}'" + (f" ({self.origin})" if self.origin != "plan" else "")


@dataclasses.dataclass
class Plan:
    rules: list[Rule] = dataclasses.field(default_factory=list)
    mesh: dict[str, int] | None = None
    inputs: tuple[Entry, ...] = (("batch",),)
    outputs: tuple[Entry, ...] = (("batch",),)
    unmatched: str = "error"
    report_replicated_bytes: int = DEFAULT_REPORT_BYTES
    name: str = "plan"
    strict: bool = False  # the megatron preset's warnings (`layout.megatron_problems`) are errors
    activations: list[Rule] = dataclasses.field(default_factory=list)  # module path -> output spec
    logical: dict[str, tuple[str, ...] | None] = dataclasses.field(default_factory=dict)  # model's names -> axes

    @classmethod
    def load(cls, source: Plan | str | Path | dict) -> Plan:
        """A Plan from a Plan, a preset name, a .yaml/.yml/.json path, or a dict in the file format."""
        if isinstance(source, Plan):
            return source
        if isinstance(source, dict):
            return cls.from_dict(source)
        text = str(source)
        if text in PRESETS:
            return preset(text)
        path = Path(text)
        if path.suffix.lower() not in (".yaml", ".yml", ".json"):
            raise ShardlmError(
                f"plan '{text}' is neither a preset ({', '.join(PRESETS)}) nor a .yaml/.yml/.json file; "
                "name a preset or a plan file"
            )
        data = read_mapping(path, "plan file", missing="check the path",
                            not_mapping="a plan holds a 'rules' list; see docs/your-own-model.md")
        return cls.from_dict(data, name=path.name)

    @classmethod
    def from_dict(cls, data: dict, name: str = "plan") -> Plan:
        unknown = set(data) - PLAN_KEYS
        if unknown:
            raise ShardlmError(f"{name}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
                               f"a plan has {', '.join(sorted(PLAN_KEYS))}")
        base = preset(data["preset"]) if data.get("preset") is not None else None
        rules = [_parse_rule(r, i, name) for i, r in enumerate(data.get("rules") or [])]
        if base is not None:
            rules += base.rules
        mesh = _parse_mesh(data["mesh"], name) if data.get("mesh") is not None else (base.mesh if base else None)
        unmatched = data.get("unmatched", base.unmatched if base else "error")
        if unmatched not in UNMATCHED:
            raise ShardlmError(f"{name}: unmatched must be 'error' or 'replicate', not {unmatched!r}")
        plan = cls(rules=rules, mesh=mesh, unmatched=unmatched, name=name)
        for key in ("inputs", "outputs"):
            if data.get(key) is not None:
                spec = parse_spec(data[key], f"{name}: {key}")
                if not isinstance(spec, tuple):
                    raise ShardlmError(f"{name}: {key} must be a list of per-dimension entries, e.g. [batch, null]")
                setattr(plan, key, spec)
        if data.get("strict") is not None:
            if not isinstance(data["strict"], bool):
                raise ShardlmError(f"{name}: strict must be true or false, not {data['strict']!r}")
            plan.strict = data["strict"]
        plan.activations = [_parse_activation(r, i, name) for i, r in enumerate(data.get("activations") or [])]
        plan.logical = _parse_logical(data.get("logical") or {}, name)
        if data.get("report_replicated_bytes") is not None:
            value = data["report_replicated_bytes"]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ShardlmError(f"{name}: report_replicated_bytes must be a number of bytes, not {value!r}")
            plan.report_replicated_bytes = value
        return plan

    def with_mesh(self, **degrees: int) -> Plan:
        """The same plan on other mesh degrees: `Plan.load("megatron").with_mesh(data=2, tensor=4)`."""
        return dataclasses.replace(self, mesh=_parse_mesh(degrees, self.name))

    def make_mesh(self, devices=None):
        from shardlm.mesh import make_named_mesh

        return make_named_mesh(self.mesh or {"data": -1}, devices)


# --- parsing ----------------------------------------------------------------------------------------------------


def _parse_mesh(mesh: Any, where: str) -> dict[str, int]:
    if not isinstance(mesh, dict) or not mesh:
        raise ShardlmError(f"{where}: mesh must map axis names to degrees, e.g. {{data: 4, tensor: 2}}")
    return {str(k): v for k, v in mesh.items()}


def _parse_rule(raw: Any, index: int, where: str) -> Rule:
    if isinstance(raw, dict) and set(raw) <= {"match", "spec", "optional"} and {"match", "spec"} <= set(raw):
        pattern, spec, optional = raw["match"], raw["spec"], bool(raw.get("optional", False))
    elif isinstance(raw, (list, tuple)) and len(raw) == 2:
        (pattern, spec), optional = raw, False
    else:
        raise ShardlmError(f"{where}: rule {index + 1} must be [pattern, spec] (or {{match:, spec:}}), got {raw!r}")
    if not isinstance(pattern, str) or not pattern.strip("/"):
        raise ShardlmError(f"{where}: rule {index + 1} has pattern {pattern!r}; a pattern is a non-empty path glob")
    try:
        compile_pattern(pattern)  # a malformed glob is reported now, naming the rule
    except ShardlmError as e:
        raise ShardlmError(f"{where}: rule {index + 1}: {e}") from None
    return Rule(pattern, parse_spec(spec, f"{where}: rule {index + 1} '{pattern}'"), optional)


def _parse_activation(raw: Any, index: int, where: str) -> Rule:
    rule = _parse_rule(raw, index, f"{where}: activations")
    if not isinstance(rule.spec, tuple):
        raise ShardlmError(f"{where}: activation rule {index + 1} '{rule.pattern}' needs a spec per dimension, e.g. "
                           "[batch, null, tensor] (replicate is [], largest and rank mappings place parameters only)")
    return rule


def _parse_logical(raw: Any, where: str) -> dict[str, tuple[str, ...] | None]:
    if not isinstance(raw, dict):
        raise ShardlmError(f"{where}: logical must map the model's logical axis names to mesh axes, e.g. "
                           "{embed: null, mlp: tensor}")
    out = {}
    for name, entry in raw.items():
        spec = parse_spec([entry], f"{where}: logical name '{name}'")
        out[str(name)] = spec[0]
    return out


def parse_spec(raw: Any, where: str) -> Spec:
    """YAML/JSON/Python spec -> Spec. Accepts jax PartitionSpecs, lists, tuples and the keywords above."""
    if raw is None or raw == "replicate":
        return ()
    if isinstance(raw, str):
        if raw == "largest":
            return Largest()
        if raw.startswith("largest:"):
            axes = raw[len("largest:"):].split("+")
            if not all(axes) or len(set(axes)) != len(axes):
                raise ShardlmError(f"{where}: {raw!r} must name distinct mesh axes, e.g. largest:fsdp or "
                                   "largest:data+fsdp")
            return Largest(tuple(axes))
        raise ShardlmError(
            f"{where}: spec {raw!r} is not a list; write one entry per dimension, e.g. [null, {raw}], or use "
            "replicate / largest / largest:AXIS"
        )
    if isinstance(raw, dict):
        specs = {}
        for rank, sub in raw.items():
            try:
                r = int(rank)
            except (TypeError, ValueError):
                raise ShardlmError(f"{where}: a mapping spec is keyed by rank (1, 2, 3...), not {rank!r}") from None
            parsed = parse_spec(sub, where)
            if isinstance(parsed, ByRank):
                raise ShardlmError(f"{where}: rank mappings do not nest")
            specs[r] = parsed
        return ByRank(specs)
    try:
        entries = list(raw)  # lists, tuples and jax.sharding.PartitionSpec
    except TypeError:
        raise ShardlmError(f"{where}: spec {raw!r} is not a list of per-dimension entries") from None
    out: list[Entry] = []
    for e in entries:
        if e is None:
            out.append(None)
        elif isinstance(e, str):
            out.append((e,))
        elif isinstance(e, (list, tuple)) and e and all(isinstance(a, str) for a in e):
            out.append(tuple(e))
        else:
            raise ShardlmError(f"{where}: spec entry {e!r} must be null, an axis name or a list of mesh axes")
    return tuple(out)


# --- path patterns ----------------------------------------------------------------------------------------------

_PATTERN_CACHE: dict[str, re.Pattern] = {}


def compile_pattern(pattern: str) -> re.Pattern:
    """Glob -> regex over '/'-joined paths (see the module docstring). Unanchored patterns match a path suffix."""
    if pattern in _PATTERN_CACHE:
        return _PATTERN_CACHE[pattern]
    anchored = pattern.startswith("/")
    body = _glob_to_regex(pattern.strip("/"), pattern)
    try:
        regex = re.compile(("" if anchored else "(?:.*/)?") + body)
    except re.error as e:
        raise ShardlmError(f"pattern '{pattern}' is malformed ({e})") from None
    _PATTERN_CACHE[pattern] = regex
    return regex


def _glob_to_regex(glob: str, original: str) -> str:
    out, i, depth = [], 0, 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "{":
            out.append("(?:")
            depth += 1
        elif c == "}" and depth:
            out.append(")")
            depth -= 1
        elif c == "," and depth:
            out.append("|")
        elif c == "[":
            # A character class within one segment; [!...] negates it, as in shell globs and .gitignore.
            end = glob.find("]", i + 2 if glob.startswith("[!", i) else i + 1)
            if end < 0:
                raise ShardlmError(f"pattern '{original}' has an unclosed '['")
            body = glob[i + 1:end]
            negate = body.startswith("!")
            body = body[1:] if negate else body
            if not body or "/" in body:
                raise ShardlmError(f"pattern '{original}' has an empty character class or one containing '/'")
            body = body.replace("\\", "\\\\").replace("^", "\\^").replace("[", "\\[")
            out.append(f"[^/{body}]" if negate else f"[{body}]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    if depth:
        raise ShardlmError(f"pattern '{original}' has an unclosed '{{'")
    return "".join(out)


def matches(rule: Rule, path: str) -> bool:
    return rule.regex.fullmatch(path) is not None


# --- presets ----------------------------------------------------------------------------------------------------
# The usual Flax names. Attention: Linen `SelfAttention` / `MultiHeadDotProductAttention` and NNX
# `MultiHeadAttention` have DenseGeneral query/key/value kernels [embed, heads, head_dim] and an out kernel
# [heads, head_dim, embed]; Hugging Face-style ports use q_proj/k_proj/v_proj/o_proj. MLPs: NNX miniGPT's
# linear1/linear2, GPT-2's c_fc/c_proj, Llama's gate/up/down_proj, T5's wi/wo, and Linen's auto-named
# Dense_0/Dense_1 inside an MLP (or transformer block) module.

_QKV = "{query,key,value,q_proj,k_proj,v_proj,wq,wk,wv}"
# q, k and v side by side in one kernel: a contiguous split over tensor would hand a device a mix of them, not its
# heads' q, k and v, so the preset leaves these to FSDP and says so (`layout.megatron_problems`).
FUSED_QKV = "{c_attn,qkv,query_key_value,qkv_proj,Wqkv}"
_MLP_PARENT = "{mlp,MLP,MLP_*,Mlp*,MlpBlock*,ffn,FFN*,feed_forward,FeedForward*,Block_*,blocks_*,TransformerBlock_*}"
_MLP_IN = "{linear1,fc1,c_fc,wi,wi_0,wi_1,up_proj,gate_proj,w1,w3,fc_in,dense_h_to_4h}"
_MLP_OUT = "{linear2,fc2,down_proj,wo,w2,fc_out,dense_4h_to_h}"  # GPT-2's c_proj only under an MLP (below)
COLUMN, ROW = "column", "row"  # how a megatron rule's label ends: its tensor-parallel kind


def _megatron_rules() -> list[tuple[str, str, Spec]]:
    e = lambda *names: tuple((n,) if n else None for n in names)  # noqa: E731
    column = ByRank({2: e("embed", "mlp")})
    row = ByRank({2: e("mlp", "embed")})
    attn_out = ByRank({3: e("heads", "head_dim", "embed"), 2: e("heads", "embed")})
    return [
        # Column-parallel: each device computes some heads / some hidden units...
        ("q/k/v column", f"{_QKV}/kernel", ByRank({3: e("embed", "heads", "head_dim"), 2: e("embed", "heads")})),
        ("q/k/v bias", f"{_QKV}/bias", ByRank({2: e("heads", "head_dim"), 1: e("heads")})),
        ("fused q/k/v: fsdp only", f"{FUSED_QKV}/{{kernel,bias}}", Largest()),
        ("mlp-in column", f"{_MLP_IN}/kernel", column),
        ("mlp-in bias", f"{_MLP_IN}/bias", ByRank({1: e("mlp")})),
        ("mlp-in column", f"{_MLP_PARENT}/Dense_0/kernel", column),
        ("mlp-in bias", f"{_MLP_PARENT}/Dense_0/bias", ByRank({1: e("mlp")})),
        # ...then row-parallel: partial sums, one all-reduce per attention or MLP half of a block.
        ("attn-out row", "{out,attn_out,o_proj,out_proj,wo_attn}/kernel", attn_out),
        ("mlp-out row", f"{_MLP_OUT}/kernel", row),
        ("mlp-out row", f"{_MLP_PARENT}/{{Dense_1,c_proj}}/kernel", row),
        # Everything else (embeddings, norms, the head, output biases): FSDP if the mesh has it, else whole.
        ("rest: largest dim over fsdp", "**", Largest()),
    ]


_PRESETS: dict[str, dict] = {
    "dp": {"mesh": {"data": -1}, "rules": [("everything whole", "**", ())]},
    "fsdp": {"mesh": {"fsdp": -1}, "rules": [("largest dim over fsdp", "**", Largest())]},
    "megatron": {"mesh": {"tensor": -1}, "rules": None},
}
PRESETS = tuple(_PRESETS)


def preset(name: str) -> Plan:
    """`dp`: every parameter whole on every device. `fsdp`: each split along its largest dimension the fsdp degree
    divides. `megatron`: attention and MLP column- then row-parallel over `tensor` (logical names, so an fsdp axis
    shards them too); the rest as fsdp. The batch is split over data and fsdp in all three."""
    if name not in _PRESETS:
        raise ShardlmError(f"unknown preset '{name}'; presets are {', '.join(PRESETS)}")
    spec = _PRESETS[name]
    raw_rules = spec["rules"] if spec["rules"] is not None else _megatron_rules()
    rules = [Rule(p, s, optional=True, origin=f"preset {name}", label=label) for label, p, s in raw_rules]
    return Plan(rules=rules, mesh=dict(spec["mesh"]), unmatched="replicate", name=name)
