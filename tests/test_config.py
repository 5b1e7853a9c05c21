import re

import pytest

from shardlm.config import load_config
from shardlm.errors import ShardlmError


def test_defaults_are_the_tiny_preset():
    cfg = load_config()
    assert cfg.model.preset == "tiny"
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads) == (4, 128, 4)
    assert cfg.mesh.data is None and cfg.mesh.fsdp == 1 and cfg.mesh.tensor == 1


def test_overrides_are_typed_and_preset_applies_first():
    cfg = load_config(None, ["model.n_layers=2", "model=gpt2-small", "train.lr=1e-3", "mesh.fsdp=-1",
                             "model.tie_embeddings=false", "name=abc"])
    assert cfg.model.preset == "gpt2-small"
    assert cfg.model.n_layers == 2  # the field override wins although it came before the preset
    assert cfg.model.d_model == 768
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.mesh.fsdp == -1
    assert cfg.model.tie_embeddings is False
    assert cfg.name == "abc"


def test_yaml_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: small\ntrain:\n  steps: 7\n  batch_size: 8\nmesh:\n  tensor: 2\n")
    cfg = load_config(f, ["train.steps=9"])
    assert cfg.model.preset == "small" and cfg.model.d_model == 384
    assert cfg.train.steps == 9 and cfg.train.batch_size == 8 and cfg.mesh.tensor == 2
    # a key the file (or a run directory's config.yaml, resumed) cannot take: the error names where it came from
    f.write_text("foo: 1\n")
    with pytest.raises(ShardlmError, match=rf"^{re.escape(str(f))}: unknown config key 'foo'"):
        load_config(f)
    with pytest.raises(ShardlmError, match=r"^runs/x/config.yaml: train.steps: expected int, got 'many'"):
        load_config(None, ["train.steps=3"], base={"train": {"steps": "many"}}, base_origin="runs/x/config.yaml")
    with pytest.raises(ShardlmError, match=r"^train.steps: expected int, got 'abc'"):  # an override: as given
        load_config(None, ["train.steps=abc"], base={"train": {"steps": 3}})


def test_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, ["model=small", "train.steps=5", "mesh.data=2"])
    f = tmp_path / "round.yaml"
    f.write_text(cfg.to_yaml())
    assert load_config(f) == cfg


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.stepz=3", "unknown config key 'train.stepz' (did you mean 'steps'?)"),
        ("trian.steps=3", "unknown config key 'trian.steps'"),
        ("train.steps=abc", "train.steps: expected int, got 'abc'"),
        ("train.steps=1.5", "train.steps: expected int"),
        ("train.lr=-1", "train.lr must be a positive finite number, got -1.0"),
        ("model=gpt5", "unknown model preset 'gpt5'"),
        ("mesh.data=0", "mesh.data must be a positive degree or -1"),
        ("model.d_model=130", "model.d_model=130 is not divisible by model.n_heads=4"),
        ("train=3", "is a section"),
        ("steps", "is not key=value"),
    ],
)
def test_bad_input_names_the_key(override, fragment):
    with pytest.raises(ShardlmError) as e:
        load_config(None, [override])
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ShardlmError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_text_values_stay_verbatim():
    cfg = load_config(None, ["name=0123", "data.path=1.10", "train.lr=1e-2", "mesh.data=null"])
    assert cfg.name == "0123" and cfg.data.path == "1.10"
    assert cfg.train.lr == 0.01 and cfg.mesh.data is None


@pytest.mark.parametrize("override", ["train.lr=nan", "train.lr=.inf", "seed=-1", "train.beta2=2",
                                      "model.layer_norm_eps=-1", "train.grad_clip=nan"])
def test_out_of_range_numbers(override):
    with pytest.raises(ShardlmError, match=f"^{override.split('=')[0]} must be"):
        load_config(None, [override])


def test_mesh_auto_and_remat_auto_are_the_planners_to_resolve():
    from shardlm.config import MeshConfig, check_resolved

    cfg = load_config(None, ["mesh=auto", "model.remat=auto"])
    assert cfg.mesh == MeshConfig(auto=True) and cfg.model.remat == "auto"
    with pytest.raises(ShardlmError, match=r"^mesh=auto is chosen by the planner when `shardlm train` starts"):
        check_resolved(cfg)
    # loading a run (generate, export) says the same, not "mesh=auto: only mesh.* settings can change"
    from shardlm.load import _check_mesh_only

    with pytest.raises(ShardlmError, match=r"^mesh=auto is chosen by the planner when `shardlm train` starts"):
        _check_mesh_only(["mesh=auto"], "can change when loading a trained model")
    for overrides, fragment in [
        (["mesh=auto", "mesh.tensor=2"], "mesh=auto chooses every degree, and mesh.tensor=2 sets one"),
        (["mesh.tensor=2", "mesh=auto"], "mesh=auto chooses every degree, and mesh.tensor=2 sets one"),
        (["mesh=fsdp"], "mesh=fsdp: set the mesh's degrees as mesh.<axis>=N, or mesh=auto"),
        (["model.remat=auto", "model.remat_offload=mlp_hidden"], "model.remat=auto chooses among policies"),
    ]:
        with pytest.raises(ShardlmError, match=re.escape(fragment)):
            load_config(None, overrides)


def test_an_expert_degree_must_split_the_models_experts_and_says_so_first():
    """mesh.expert on a dense model is refused (it was once taken silently, as FSDP under another name), and a degree
    that does not divide the experts is said in their terms, before the batch of 32 it does not divide either. A
    degree of -1 is known with the devices: the mesh's checks say the same, before the batch's and the
    parameters'."""
    import jax

    from shardlm.mesh import make_mesh
    from shardlm.train.state import check_batch, check_shardable

    for overrides, message in [
        (["mesh.expert=2"], "mesh.expert=2 splits a mixture of experts' experts, and model tiny is dense "
                            "(model.moe_experts=0): drop mesh.expert, or set model.moe_experts"),
        (["model=moe-tiny", "mesh.expert=3"], "mesh.expert=3 does not divide model.moe_experts=8; choose a divisor: "
                                              "1, 2, 4, 8"),
    ]:
        with pytest.raises(ShardlmError, match=f"^{re.escape(message)}$"):
            load_config(None, overrides)
    assert load_config(None, ["model=moe-tiny", "mesh.expert=4"]).mesh.expert == 4
    cfg = load_config(None, ["model=moe-tiny", "mesh.expert=-1"])
    mesh = make_mesh(1, expert=3, devices=jax.devices()[:3])
    for check in (check_batch, check_shardable):
        with pytest.raises(ShardlmError, match=r"^mesh.expert=3 does not divide model.moe_experts=8; choose a divisor"):
            check(cfg, mesh)
