"""mesh=auto and model.remat=auto: the planner chooses when a run starts, the run records the choice, a resume
keeps it."""

import contextlib
import io
import json

import pytest
import yaml

from conftest import MICRO


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """(run directory, what train printed) of a run started with mesh=auto."""
    from shardlm.cli import main

    run_dir = tmp_path_factory.mktemp("auto") / "run"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["train", "--cpu-devices", "8", "--run-dir", str(run_dir), "mesh=auto", *MICRO,
                     "train.eval_batches=1", "train.sample_tokens=0", "--no-progress"]) == 0
    return run_dir, out.getvalue()


def test_mesh_auto_trains_with_the_plans_best_and_says_why(auto_run):
    from shardlm.perf.strategies import parse_strategy

    run_dir, out = auto_run
    best = next(line.split()[1] for line in out.splitlines() if line.split()[:1] == ["1"])  # the plan's rank 1
    took = next(line for line in out.splitlines() if line.startswith("mesh=auto took "))
    assert took.startswith(f"mesh=auto took {best}: the fastest estimated step that fits: ")
    assert "this host's CPU (8 devices, measured" in took
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["mesh"]
    assert saved == {**parse_strategy(best, 8).mesh, "auto": False}  # resolved: a resume does not re-plan
    assert f"mesh stage={saved['stage']} x data={saved['data']}" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert rows[-1]["step"] == 20 and losses[-1] < losses[0] - 1  # nats: it learned


def test_a_resume_keeps_what_auto_chose(auto_run):
    from shardlm.config import MeshConfig
    from shardlm.train.rundir import run_config

    run_dir, _ = auto_run
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg, _ = run_config(None, ["mesh=auto", "model.remat=auto", "train.steps=30"], str(run_dir))
    assert cfg.mesh == MeshConfig(**saved["mesh"]) and cfg.model.remat == saved["model"]["remat"]
    assert cfg.train.steps == 30


def test_remat_auto_takes_the_fastest_policy_that_fits(monkeypatch):
    import jax

    from shardlm.config import load_config
    from shardlm.perf import auto, host, planner
    from shardlm.perf.strategies import Strategy

    cfg = load_config(None, [*MICRO, "mesh.fsdp=8", "model.remat=auto"])
    hardware = host.host_hardware(jax.devices())
    p = planner.plan(cfg, None, hardware, strategies=[Strategy(1, 8, 1)], remats=list(auto.AUTO_REMATS))
    fastest = p.strategies[0]
    smaller = [r for r in p.strategies if r.peak < fastest.peak]
    assert smaller, [(r.remat, r.peak) for r in p.strategies]  # remat keeps less: some policy peaks lower
    # a device just too small for the fastest policy: remat=auto takes the fastest of those that fit (the same
    # compiled facts, ranked for the smaller device: `Plan.rerank`)
    monkeypatch.setattr(host, "host_memory_bytes", lambda: 8 * (fastest.peak - 1))

    def planned(cfg_, n, hardware_, *, strategies, remats, **_):
        assert (strategies, remats) == ([Strategy(1, 8, 1)], list(auto.AUTO_REMATS))
        assert hardware_.memory_bytes == fastest.peak - 1
        return p.rerank(hardware_)

    monkeypatch.setattr(planner, "plan", planned)
    decision = auto.decide(cfg)
    want = min(smaller, key=lambda r: r.est.step_s)
    assert decision.cfg.model.remat == want.remat != fastest.remat
    assert decision.cfg.mesh.fsdp == 8 and not decision.cfg.mesh.auto
    assert f"model.remat=auto took fsdp8, model.remat={want.remat}: the fastest estimated step that fits" in \
        decision.text
