"""Plans on shapes alone: parsing, path patterns, presets, and every validation error (nothing compiles here)."""

import json

import pytest
from jax.sharding import PartitionSpec as P

from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh, make_named_mesh
from shardlm.foreign.layout import Leaf, resolve
from shardlm.foreign.plan import Plan, Rule, matches, preset

# A miniGPT-shaped parameter list (NNX paths), 4 heads, embed 32, ff 64, vocab 64.
LEAVES = [
    Leaf("embedding_layer/token_emb/embedding", (64, 32), "float32"),
    Leaf("embedding_layer/pos_emb/embedding", (16, 32), "float32"),
    Leaf("blocks/0/mha/query/kernel", (32, 4, 8), "float32"),
    Leaf("blocks/0/mha/query/bias", (4, 8), "float32"),
    Leaf("blocks/0/mha/value/kernel", (32, 4, 8), "float32"),
    Leaf("blocks/0/mha/out/kernel", (4, 8, 32), "float32"),
    Leaf("blocks/0/mha/out/bias", (32,), "float32"),
    Leaf("blocks/0/linear1/kernel", (32, 64), "float32"),
    Leaf("blocks/0/linear1/bias", (64,), "float32"),
    Leaf("blocks/0/linear2/kernel", (64, 32), "float32"),
    Leaf("blocks/0/layer_norm1/scale", (32,), "float32"),
    Leaf("output_layer/kernel", (32, 64), "float32"),
    Leaf("rngs/dropout/count", (), "uint32", is_param=False),
]


def specs(plan, mesh, leaves=LEAVES):
    return resolve(Plan.load(plan), leaves, mesh).specs


@pytest.mark.parametrize("pattern, path, hit", [
    ("kernel", "a/b/kernel", True),
    ("kernel", "kernel", True),
    ("ernel", "a/kernel", False),  # whole segments only
    ("/params/Dense_0/kernel", "params/Dense_0/kernel", True),
    ("/params/Dense_0/kernel", "params/MLP_0/Dense_0/kernel", False),  # anchored
    ("Dense_0/kernel", "params/MLP_0/Dense_0/kernel", True),  # unanchored: any depth
    ("mha/{query,key}/kernel", "blocks/0/mha/key/kernel", True),
    ("mha/{query,key}/kernel", "blocks/0/mha/value/kernel", False),
    ("blocks/*/mha/*/kernel", "x/blocks/3/mha/value/kernel", True),
    ("blocks/*/kernel", "blocks/0/mha/kernel", False),  # * stays within one segment
    ("blocks/**/kernel", "blocks/0/mha/kernel", True),
    ("a/**/k", "a/k", True),
    ("MLP_*/Dense_[01]/bias", "MLP_2/Dense_1/bias", True),
    ("**", "anything/at/all", True),
])
def test_pattern_matching(pattern, path, hit):
    assert matches(Rule(pattern, ()), path) is hit


def test_plan_file_mesh_axes_logical_names_and_first_match_wins(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("""
mesh: {data: 2, fsdp: 2, tensor: 2}
rules:
  - ["mha/{query,value}/kernel", [fsdp, tensor, null]]
  - ["linear1/kernel", [embed, mlp]]       # logical -> [fsdp, tensor]
  - ["linear1/bias", [mlp]]                # logical -> [(tensor, fsdp)]
  - ["linear2/kernel", [[tensor, fsdp], null]]
  - ["kernel", largest]                    # every other kernel: FSDP on the largest dimension
  - ["**", replicate]
inputs: [[data, fsdp], null]
outputs: [batch, null, tensor]
""")
    plan = Plan.load(path)
    mesh = plan.make_mesh()
    layout = resolve(plan, LEAVES, mesh)
    s = layout.specs
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert s["blocks/0/mha/query/kernel"] == P("fsdp", "tensor")
    assert s["blocks/0/linear1/kernel"] == P("fsdp", "tensor")
    assert s["blocks/0/linear1/bias"] == P(("tensor", "fsdp"))
    assert s["blocks/0/linear2/kernel"] == P(("tensor", "fsdp"))
    assert s["blocks/0/mha/out/kernel"] == P(None, None, "fsdp")  # largest dim (32) under 'kernel'
    assert s["output_layer/kernel"] == P(None, "fsdp")  # 64 > 32
    assert s["blocks/0/layer_norm1/scale"] == P()
    assert s["rngs/dropout/count"] == P()  # not a parameter: never matched, always whole
    assert layout.input_spec == P(("data", "fsdp"))
    assert layout.output_spec == P(("data", "fsdp"), None, "tensor")


def test_json_plan_and_dict_plan_are_the_same_plan(tmp_path):
    data = {"mesh": {"fsdp": -1}, "rules": [["kernel", "largest"], ["**", None]]}
    (tmp_path / "p.json").write_text(json.dumps(data))
    mesh = make_mesh(fsdp=8)
    assert specs(tmp_path / "p.json", mesh) == specs(data, mesh)


def test_presets():
    mesh = make_mesh(fsdp=2, tensor=4)
    dp = specs("dp", mesh)
    assert set(dp.values()) == {P()}
    fsdp = specs("fsdp", make_mesh(fsdp=8))
    assert fsdp["embedding_layer/token_emb/embedding"] == P("fsdp")  # 64 is the largest dimension
    assert fsdp["blocks/0/mha/query/kernel"] == P("fsdp")
    assert fsdp["blocks/0/mha/query/bias"] == P(None, "fsdp")  # 4 heads: 8 does not divide; head_dim 8 does
    meg = specs("megatron", mesh)  # column- then row-parallel, FSDP on the embed dimension of the same weights
    assert meg["blocks/0/mha/query/kernel"] == P("fsdp", "tensor")
    assert meg["blocks/0/mha/query/bias"] == P("tensor", "fsdp")  # the table gives FSDP the head_dim of a bias
    assert meg["blocks/0/mha/out/kernel"] == P("tensor", None, "fsdp")
    assert meg["blocks/0/linear1/kernel"] == P("fsdp", "tensor")
    assert meg["blocks/0/linear1/bias"] == P(("tensor", "fsdp"))
    assert meg["blocks/0/linear2/kernel"] == P("tensor", "fsdp")
    assert meg["output_layer/kernel"] == P(None, "fsdp")  # not attention or MLP: the fsdp fallback
    assert preset("megatron").mesh == {"tensor": -1} and preset("fsdp").mesh == {"fsdp": -1}


def test_preset_plus_own_rules():
    plan = Plan.load({"preset": "megatron", "rules": [["output_layer/kernel", [None, "tensor"]]]})
    s = specs(plan, make_mesh(data=2, tensor=4))
    assert s["output_layer/kernel"] == P(None, "tensor") and s["blocks/0/linear2/kernel"] == P("tensor", "fsdp")


def test_rank_mapping_matches_only_listed_ranks():
    plan = {"rules": [["kernel", {2: [None, "tensor"]}], ["**", "replicate"]]}
    s = specs(plan, make_mesh(data=2, tensor=4))
    assert s["blocks/0/linear1/kernel"] == P(None, "tensor")
    assert s["blocks/0/mha/query/kernel"] == P()  # rank 3: the rule does not apply


def _error(plan, mesh=None, leaves=LEAVES) -> str:
    with pytest.raises(ShardlmError) as e:
        resolve(Plan.load(plan), leaves, mesh or make_mesh(data=2, tensor=4))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_rule_matching_nothing_is_an_error_naming_it():
    msg = _error({"rules": [["mha/qurey/kernel", [None, "tensor"]], ["**", "replicate"]]})
    assert "rule 1 'mha/qurey/kernel' matches no parameter" in msg
    assert "embedding_layer/token_emb/embedding" in msg  # shows what paths look like


def test_a_rule_that_never_applies_is_an_error():
    msg = _error({"rules": [["kernel", "replicate"], ["linear1/kernel", [None, "tensor"]], ["**", "replicate"]]})
    assert "rule 2 'linear1/kernel' never applies" in msg and "earlier rule 1 'kernel'" in msg


def test_unmatched_parameters_are_an_error_listing_them_unless_replicate():
    msg = _error({"rules": [["kernel", "replicate"]]})
    assert "6 parameter(s) match no rule" in msg
    assert "blocks/0/mha/query/bias (4, 8)" in msg and "unmatched: replicate" in msg
    s = specs({"rules": [["kernel", "replicate"]], "unmatched": "replicate"}, make_mesh(data=2, tensor=4))
    assert s["blocks/0/mha/query/bias"] == P()


def test_indivisible_dimension_names_parameter_shape_axis_and_degree():
    msg = _error({"rules": [["mha/query/kernel", [None, "tensor", None]]], "unmatched": "replicate"},
                 make_mesh(tensor=8))
    assert msg.startswith("parameter blocks/0/mha/query/kernel of shape (32, 4, 8): dimension 1 (size 4) is split "
                          "8 ways over mesh axis 'tensor' (8)")
    assert "8 does not divide 4" in msg


def test_unknown_axis_name_and_malformed_specs():
    assert "names 'modle', which is neither a mesh axis (stage, data, fsdp, expert, context, tensor) nor a logical axis name" in _error(
        {"rules": [["kernel", [None, "modle"]]]})
    assert "the spec has 3 entries for 2 dimensions" in _error(
        {"rules": [["linear1/kernel", [None, "tensor", None]]], "unmatched": "replicate"})
    assert "mesh axis 'tensor' splits two dimensions" in _error(
        {"rules": [["linear1/kernel", ["tensor", "tensor"]]], "unmatched": "replicate"})
    assert "splits over 'fsdpp'" in _error({"rules": [["**", "largest:fsdpp"]]})
    with pytest.raises(ShardlmError, match="spec 'tensor' is not a list"):
        Plan.load({"rules": [["kernel", "tensor"]]})
    with pytest.raises(ShardlmError, match="unknown key"):
        Plan.load({"rulez": []})
    with pytest.raises(ShardlmError, match="unclosed"):
        Plan.load({"rules": [["mha/{query,key/kernel", "replicate"]]})
    with pytest.raises(ShardlmError, match="neither a preset .* nor a .yaml"):
        Plan.load("megatronn")


def test_bad_plan_files(tmp_path):
    with pytest.raises(ShardlmError, match="does not exist"):
        Plan.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: [[unclosed")
    with pytest.raises(ShardlmError, match="is not valid YAML"):
        Plan.load(bad)
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ShardlmError, match="must hold a mapping"):
        Plan.load(tmp_path / "list.yaml")


def test_large_replicated_parameters_are_reported_with_bytes():
    leaves = LEAVES + [Leaf("head/kernel", (1024, 1000), "float32")]  # 4,096,000 bytes, 1000 % 8 != 0
    layout = resolve(Plan.load({"rules": [["head/kernel", "largest"], ["**", "largest"]]}), leaves,
                     make_mesh(fsdp=8))
    assert layout.specs["head/kernel"] == P("fsdp")  # the largest dimension 8 divides
    layout = resolve(Plan.load("dp"), leaves, make_mesh(data=8))
    big = layout.replicated_large()
    assert [p.path for p in big] == ["head/kernel"] and big[0].nbytes == 4_096_000
    (note,) = layout.notes()
    assert "whole on every one of the 8 devices" in note and "head/kernel (1024, 1000) 3.91 MiB" in note


def test_custom_axis_names():
    mesh = make_named_mesh({"data": 4, "model": 2})
    s = specs({"rules": [["linear1/kernel", [None, "model"]], ["**", "replicate"]]}, mesh)
    assert s["blocks/0/linear1/kernel"] == P(None, "model")
    # Presets name shardlm's axes; on a mesh without them those axes shard nothing.
    assert all(e is None for spec in specs("megatron", mesh).values() for e in spec)


def test_negated_character_class_and_bad_classes():
    assert matches(Rule("Dense_[!0]/kernel", ()), "MLP_0/Dense_1/kernel")
    assert not matches(Rule("Dense_[!0]/kernel", ()), "MLP_0/Dense_0/kernel")
    for bad, fragment in [("[a/b]x", "containing '/'"), ("Dense_[z-a]", "is malformed"), ("a[", "unclosed")]:
        with pytest.raises(ShardlmError, match=fragment):
            Plan.load({"rules": [[bad, "replicate"]]})


def test_rank_mapping_that_misses_and_rules_for_non_parameters_say_why():
    msg = _error({"rules": [["linear1/kernel", {3: [None, "tensor", None]}]], "unmatched": "replicate"})
    assert "matches blocks/0/linear1/kernel of rank 2, but its spec covers only rank(s) 3" in msg
    msg = _error({"rules": [["rngs/**", "replicate"]], "unmatched": "replicate"})
    assert "matches only variables that are not parameters (e.g. rngs/dropout/count)" in msg


def test_logical_names_never_silently_dropped():
    # The batch's axes (data, fsdp) cannot go to dimension 0 when dimension 1 already takes data.
    assert "logical axis 'batch' cannot be placed: its mesh axes (data, expert, fsdp) already split another dimension" in (
        _error({"rules": [["**", "replicate"]], "inputs": ["batch", "data"]}))
    # 'heads' maps to tensor, which a ("data", "model") mesh does not have.
    msg = _error({"rules": [["mha/query/kernel", [None, "heads", None]]], "unmatched": "replicate"},
                 make_named_mesh({"data": 4, "model": 2}))
    assert "names logical axis 'heads', which the rule table maps to tensor, and this mesh (data, model) has none" in msg


def test_loose_specs_are_refused():
    for plan, fragment in [
        ({"rules": [["**", "largest:fsdp+fsdp"]]}, "distinct mesh axes"),
        ({"rules": [["**", "largest:+"]]}, "distinct mesh axes"),
        ({"rules": [{"match": "kernel"}]}, "must be \\[pattern, spec\\]"),
        ({"rules": [], "report_replicated_bytes": "1MiB"}, "must be a number of bytes"),
    ]:
        with pytest.raises(ShardlmError, match=fragment):
            Plan.load(plan)


def test_numpy_integer_degrees():
    import numpy as np

    assert dict(make_named_mesh({"data": np.int64(4), "tensor": 2}).shape) == {"data": 4, "tensor": 2}
