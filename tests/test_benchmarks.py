"""benchmarks/gpu.py is for hosts with a GPU, which shardlm's machines lack: here it runs at a tiny size on the
CPU, both sides, so that it cannot rot."""

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_benchmark_runs_shardlm_and_transformers_on_the_same_tokens():
    gpu = load("gpu")
    batches = gpu.token_batches(vocab=512, batch=2, seq=32, steps=3)
    ours = gpu.run_shardlm("tiny", batches, 512)
    theirs = gpu.run_torch("tiny", batches, 512, compile_=False)
    for r in (ours, theirs):
        assert len(r["times"]) == 2 and all(t > 0 for t in r["times"])  # the first (compiling) step untimed
        assert r["losses"][0] == pytest.approx(math.log(512), abs=0.5)  # untrained: about ln(vocab)
    assert ours["flops"] == theirs["flops"]  # one FLOP count for both, so MFUs compare
    assert ours["impl"].startswith("shardlm") and theirs["impl"].startswith("transformers")
    assert "tok/s" in gpu.report(ours, 64)


def test_compile_depth_benchmark_measures_scanned_and_looped_steps():
    """The benchmark's measurement on two small depths: with the blocks scanned the compiled program does not
    grow with depth; block by block it does."""
    compile_depth = load("compile_depth")
    rows = {(r["layers"], r["scan"]): r for r in (compile_depth.measure(n, 1, scan) for n in (2, 6)
                                                  for scan in (True, False))}
    assert all(r["compile_s"] > 0 and r["lower_s"] > 0 for r in rows.values())
    assert rows[6, True]["hlo_kb"] < 1.2 * rows[2, True]["hlo_kb"]
    assert rows[6, False]["hlo_kb"] > 2 * rows[2, False]["hlo_kb"]


def test_peers_benchmark_times_shardlm_and_names_a_missing_nanogpt(tmp_path, monkeypatch):
    """benchmarks/peers.py's shardlm worker at a tiny shape (nanoGPT's side needs its model.py, which the
    benchmark downloads and CI has no network for): steps run, the loss falls from about ln(vocab), and the head's
    schedule is named; a --nanogpt path without model.py is one line."""
    peers = load("peers")
    monkeypatch.setattr(peers, "SHAPES", {"tiny": (1, 2, 32, 512)})
    monkeypatch.setattr(peers, "BATCH", 2)
    run, about = peers.shardlm_worker("tiny")
    first = run(1)
    assert first == pytest.approx(math.log(512), abs=0.5) and run(3) < first
    assert about["head"].startswith("gradients in the forward pass")
    with pytest.raises(SystemExit, match=r"^peers.py: no nanoGPT model.py at .*; pass --nanogpt a clone"):
        peers.nanogpt_model(str(tmp_path))
