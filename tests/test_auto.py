"""mesh=auto and model.remat=auto: the planner chooses when a run starts, the run records the choice, a resume
keeps it (a mesh=auto run is the README's, in `test_quickstart`)."""

from conftest import MICRO


def test_remat_auto_takes_the_fastest_policy_that_fits(monkeypatch):
    import dataclasses

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

    # on a device nothing fits: the advice does not suggest model.remat=full, which the plan compiled already
    advice = planner.recommendation(p.rerank(dataclasses.replace(hardware, memory_bytes=1)))
    assert advice.startswith("no strategy fits in 1 B per device") and "model.remat=full" not in advice, advice
    monkeypatch.setattr(planner, "plan", planned)
    decision = auto.decide(cfg)
    want = min(smaller, key=lambda r: r.est.step_s)
    assert decision.cfg.model.remat == want.remat != fastest.remat
    assert decision.cfg.mesh.fsdp == 8 and not decision.cfg.mesh.auto
    assert f"model.remat=auto took fsdp8, model.remat={want.remat}: the fastest estimated step that fits" in \
        decision.text
