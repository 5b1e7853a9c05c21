"""Context parallelism: the sequence split over the `context` mesh axis. Parity with one device for GPT and for
Llama with grouped-query attention (dropout on), the collectives the design promises read from the compiled step,
temporaries falling with the context degree, the one-line errors, and a run that trains on a context mesh,
samples, and generates the same tokens on one device."""

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MICRO, run_steps
from shardlm.config import load_config
from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh
from shardlm.kernels.registry import ATTENTION_KERNELS, attention_impl, ring_chunk
from shardlm.perf import hlo
from shardlm.perf.strategies import Strategy, all_strategies, parse_strategy, wants_context_splits
from shardlm.train.state import TrainState, abstract_train_state, check_shardable, split_notes
from shardlm.train.step import batch_struct, train_step_for
from test_cli import assert_one_line_error, shardlm

LLAMA_GQA = MICRO + ["model.family=llama", "model.use_bias=false", "model.n_kv_heads=2", "model.d_mlp=96"]
FAMILIES = {"gpt": MICRO + ["model.dropout=0.1"], "llama-gqa": LLAMA_GQA + ["model.dropout=0.1"]}
SPLITS = {
    "context 4": {"context": 4},
    "context 8": {"context": 8},
}


# Each split against one device in one family (both families on the ring): a run each, each run a compile and 20
# steps. Llama with GQA on fsdp 2 x context 2 x tensor 2 (dropout on) is test_context_composes_with_remat_grad_
# accumulation_and_stages's first run, with remat and gradient accumulation on top. Context 2 alone is not run
# here: the ring is the same code at every degree, and degree 2 runs against one device in that test (fsdp 2 x
# context 2 x tensor 2, stage 2 x context 2) and in test_parity's DP 2 x TP 2 x CP 2 (GPT, dropout on).
FAMILY_SPLITS = {"gpt": ("context 8",), "llama-gqa": ("context 4",)}


@pytest.fixture(scope="module")
def trajectories():
    """family -> 20 steps of it on one device and on its splits: {split: (losses, state, gradient norms)}."""
    cache = {}

    def runs_of(family):
        if family not in cache:
            cache[family] = {}
            for name in ("1 device", *FAMILY_SPLITS[family]):
                norms = []
                degrees = SPLITS.get(name, (1, 1, 1))
                cache[family][name] = (*run_steps(FAMILIES[family], degrees, steps=20, grad_norms=norms)[:2], norms)
        return cache[family]

    return runs_of


@pytest.mark.parametrize("family, split", [(f, s) for f, splits in FAMILY_SPLITS.items() for s in splits])
def test_context_split_matches_one_device(trajectories, family, split):
    runs = trajectories(family)
    want, got = np.array(runs["1 device"][0]), np.array(runs[split][0])
    assert want[-1] < want[0] - 0.5, f"{family} did not learn: {want[0]} -> {want[-1]}"
    assert abs(got[0] - want[0]) / want[0] < 1e-5, (family, split, got[0], want[0])
    want_norm, got_norm = runs["1 device"][2][0], runs[split][2][0]
    assert abs(got_norm - want_norm) / want_norm < 1e-5, (family, split, got_norm, want_norm)
    assert abs(got[-1] - want[-1]) / want[-1] < 1e-3, (family, split, got[-1], want[-1])
    # Read back from the arrays: the context devices hold FSDP shards of the weights (embed over fsdp x context).
    wq = runs[split][1].state["model"]["blocks"]["attn"]["wq"][...]  # stacked over the layers
    assert wq.sharding.spec[1] == ("fsdp", "context")
    degrees = SPLITS[split]
    assert wq.addressable_shards[0].data.shape == (wq.shape[0], 64 // (degrees.get("fsdp", 1) * degrees["context"]),
                                                   4 // degrees.get("tensor", 1), 16)


def test_context_composes_with_remat_grad_accumulation_and_stages():
    """Llama with GQA, remat full and 2 microbatches: fsdp 2 x context 2 x tensor 2 (dropout on; the weights FSDP
    shards over fsdp x context, and split over tensor), and context 2 x pipeline stages 2 (dropout off: a pipeline draws its masks per microbatch), each against one device; the
    blockwise kernel alone on one device, in blocks of 8 of the 32 positions, against XLA's attention; and splash
    attention under FSDP and tensor parallelism."""
    overrides = LLAMA_GQA + ["model.remat=full", "train.grad_accum=2"]
    # (the stage 2 x context 2 run is also test_pipeline's parity of a pipeline with context inside its stages)
    # (a pipeline's microbatches carry no documents' ids: its run and its reference attend across documents)
    for dropout, degrees in (("0.1", {"fsdp": 2, "context": 2, "tensor": 2}), ("0", {"stage": 2, "context": 2})):
        with_dropout = overrides + [f"model.dropout={dropout}"] + (
            ["data.document_mask=false"] if "stage" in degrees else [])
        want = np.array(run_steps(with_dropout, (1, 1, 1), steps=10)[0])
        got, ts, _ = run_steps(with_dropout, degrees, steps=10)
        got = np.array(got)
        assert np.all(np.abs(got - want) / want < 1e-5), (degrees, got, want)
        if "fsdp" in degrees:  # read back from the arrays, as test_context_split_matches_one_device does
            wq = ts.state["model"]["blocks"]["attn"]["wq"][...]  # stacked over the layers
            assert wq.sharding.spec[1] == ("fsdp", "context")
            assert wq.addressable_shards[0].data.shape == (wq.shape[0], 64 // (2 * 2), 4 // 2, 16)
    blockwise = np.array(run_steps(with_dropout + ["model.attention=flash", "model.attention_block=8"], (1, 1, 1),
                                   steps=10)[0])
    assert np.all(np.abs(blockwise - want) / want < 1e-5), (blockwise, want)
    # Pallas splash attention (the TPU kernel; interpreted here), in blocks of 128 of 256 positions, on fsdp 2 x
    # tensor 2 against XLA's attention on one device
    long = LLAMA_GQA + ["model.seq_len=256", "train.batch_size=4", "model.attention_block=128"]
    want = np.array(run_steps(long + ["model.attention=xla"], (1, 1, 1), steps=4)[0])
    splash = np.array(run_steps(long + ["model.attention=splash"], {"fsdp": 2, "tensor": 2}, steps=4)[0])
    assert np.all(np.abs(splash - want) / want < 1e-5), (splash, want)


def _compiled_step(overrides, degrees):
    cfg = load_config(None, overrides)
    n = int(np.prod(list(degrees.values())))
    mesh = make_mesh(**degrees, devices=jax.devices()[:n])
    _, graphdef, abstract, shardings = abstract_train_state(cfg, mesh, 500)
    step = train_step_for(cfg, TrainState(graphdef, abstract, shardings), mesh)
    return step.lower(abstract, batch_struct(cfg, mesh)).compile(), mesh


def _axis_groups(mesh, axis):
    """Device positions (mesh order) of each group along `axis`, as hlo reports collective groups."""
    positions = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    k = mesh.axis_names.index(axis)
    return sorted(sorted(g) for g in np.moveaxis(positions, k, -1).reshape(-1, mesh.shape[axis]).tolist())


def _largest_array_bytes(hlo_text: str) -> int:
    """The bytes of the largest array shape a compiled program names."""
    sizes = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "pred": 1}
    return max(sizes[t] * math.prod(int(d) for d in dims.split(","))
               for t, dims in re.findall(r"\b(f32|s32|u32|bf16|pred)\[([0-9]+(?:,[0-9]+)*)\]", hlo_text))


def _sequence_pairs(hlo_text: str, sizes: set[int]) -> list[str]:
    """Every array shape in a compiled program with two dimensions whose sizes are both in `sizes`."""
    shapes = re.findall(r"[a-z]+[0-9]*\[([0-9,]+)\]", hlo_text)
    return sorted({s for s in shapes if sum(int(d) in sizes for d in s.split(",")) >= 2})


def test_the_ring_passes_keys_and_values_around_context_and_never_holds_t_by_t():
    """Llama with 2 kv heads on fsdp 2 x context 2 x tensor 2, 192 positions in blocks of 48 (a zigzag chunk).
    Per layer, K and V (8 rows x 96 local positions x 1 local kv head x 16) travel over the context axis by
    collective-permute and are never all-gathered; queries are never gathered; and no buffer of the compiled step
    pairs two sequence-sized dimensions (96 or 192), where the all-gather variant holds [96, 192] scores per
    head. With dropout, each device draws the bits of its own positions' mask, never the whole sequence's."""
    overrides = LLAMA_GQA + ["model.seq_len=192", "model.d_mlp=160", "model.attention_block=48", "model.loss_chunks=2",
                             "model.dropout=0.1"]
    compiled, mesh = _compiled_step(overrides, {"fsdp": 2, "context": 2, "tensor": 2})
    text = compiled.as_text()
    bits = set(re.findall(r"u32\[8,(\d+),\d+\]", text))  # the masks' random bits: [rows, positions, features]
    assert bits == {"96"}, bits  # before the fix also 192: the whole sequence's bits on each device
    ops = hlo.collectives(text, 8)
    kv_bytes, q_bytes = 8 * 96 * 1 * 16 * 4, 8 * 96 * 2 * 16 * 4
    permuted = [op.bytes for op in ops if op.kind == "collective-permute"]
    # K and V forward, again when the backward pass recomputes the ring, and their gradients the other way
    assert permuted.count(kv_bytes) >= 2 * 2, permuted
    context_groups = _axis_groups(mesh, "context")
    gathered = [op for op in ops if op.kind == "all-gather" and op.bytes >= kv_bytes]
    assert not [op for op in gathered if sorted(sorted(g) for g in op.groups or []) == context_groups], gathered
    assert q_bytes not in [op.bytes for op in gathered]
    assert _sequence_pairs(text, {96, 192}) == []
    # nor, stacked over blocks, a buffer as large as one ring step's [T/2, T/2] float32 scores (8 rows x 2 heads;
    # JAX once hoisted every block's mask and scores out of the scanned layers as such a residual)
    assert _largest_array_bytes(text) < 8 * 2 * 96 * 96 * 4
    gathered_variant, _ = _compiled_step(overrides + ["model.context_attention=all_gather"],
                                         {"fsdp": 2, "context": 2, "tensor": 2})
    assert any("96,192" in shape for shape in _sequence_pairs(gathered_variant.as_text(), {96, 192}))
    # What the run header and `explain` say the ring costs is what the compiled step sends.
    (note,) = split_notes(load_config(None, overrides), mesh)
    assert "each device holds 96 of every 192 tokens" in note and f"{kv_bytes * 2 // 1024}.00 KiB per layer" in note


def test_temporaries_fall_with_the_context_degree():
    """One long-ish sequence (batch 1, 512 tokens): each device's temporaries, dominated by the attention scores,
    fall roughly as 1/context."""
    overrides = MICRO + ["model.seq_len=512", "train.batch_size=1"]
    temps = {}
    for cp in (1, 2, 4):
        compiled, _ = _compiled_step(overrides, {"context": cp})
        temps[cp] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[2] < 0.6 * temps[1], temps
    assert temps[4] < 0.35 * temps[1], temps


def test_context_errors_and_plan_names(monkeypatch):
    cfg = load_config(None, MICRO + ["model.seq_len=36"])
    with pytest.raises(ShardlmError, match=r"model.seq_len=36 is split over mesh.context=8, which does not divide"):
        check_shardable(cfg, make_mesh(context=8))
    # the ring's zigzag layout cuts the sequence into 2 x context chunks: 36 splits over 4 devices, not into 8
    # chunks (which once reached the trace: a reshape's TypeError, in `plan` and `train` alike); gathered, it runs
    with pytest.raises(ShardlmError, match=r"model.seq_len=36 does not cut into the 8 equal chunks ring attention"):
        check_shardable(cfg, make_mesh(context=4))
    check_shardable(load_config(None, MICRO + ["model.seq_len=36", "model.context_attention=all_gather"]),
                    make_mesh(context=4))
    # cuDNN's kernel takes a split sequence one chunk at a time in the ring, not all-gathered
    gathered = MICRO + ["model.attention=cudnn", "model.context_attention=all_gather"]
    with pytest.raises(ShardlmError, match="cuDNN's fused kernel refuses sequence sharding"):
        check_shardable(load_config(None, gathered), make_mesh(context=2))
    with pytest.raises(ShardlmError, match="cuDNN's fused kernel refuses sequence sharding"):
        attention_impl("cudnn", jnp.bfloat16, 64, seq_split=2, context="all_gather")  # the model's own check
    assert attention_impl("cudnn", jnp.bfloat16, 64, seq_split=2) == "ring"
    with pytest.raises(ShardlmError, match=r"chunks of a multiple of 128 positions, got 1024 / \(2 x context 8\)"):
        ring_chunk("splash", jnp.bfloat16, 64, 1024, 8)
    # a JAX whose kernel internals moved: said, not a trace-time AttributeError; auto takes the blockwise kernel
    for name in ("cudnn", "splash"):
        monkeypatch.setitem(ATTENTION_KERNELS, name,
                            dataclasses.replace(ATTENTION_KERNELS[name], chunk_available=lambda: False))
    with pytest.raises(ShardlmError, match="model.attention=splash in the ring needs JAX internals"):
        ring_chunk("splash", jnp.bfloat16, 64, 4096, 2)
    assert ring_chunk("auto", jnp.bfloat16, 64, 4096, 2) == "flash"
    assert attention_impl("auto", jnp.bfloat16, 64, seq_split=2) == "ring"
    assert attention_impl("auto", jnp.bfloat16, 64, seq_split=2, context="all_gather") == "xla"
    assert attention_impl("auto", jnp.float32, 64, length=1024, block=512) == "flash"  # on the CPU
    assert attention_impl("auto", jnp.float32, 64, length=512, block=512) == "xla"
    assert parse_strategy("fsdp2+cp2+tp2", 8) == Strategy(1, 2, 2, 2)
    assert parse_strategy("context", 8) == Strategy(1, 1, 1, 8)
    assert parse_strategy("1x2x2x2", 8) == parse_strategy("fsdp2+cp2+tp2", 8)
    assert parse_strategy("2x2x2", 8) == Strategy(2, 2, 2)
    assert Strategy(1, 2, 2, 2).name == "fsdp2+cp2+tp2"
    assert len(all_strategies(8)) == 10 and len(all_strategies(8, context=True)) == 20
    assert not wants_context_splits(load_config(None, MICRO), 8)
    assert wants_context_splits(load_config(None, MICRO + ["model.seq_len=4096"]), 8)
    assert wants_context_splits(load_config(None, MICRO + ["train.batch_size=4"]), 8)


def test_plan_enumerates_and_costs_context_splits_for_a_batch_smaller_than_the_devices():
    """One sequence of 256 tokens on 4 devices: no data or FSDP split can take it; plan enumerates the context
    splits itself and costs them, K and V's all-gathers included."""
    proc = shardlm("plan", "--devices", "4", "--json", *MICRO, "train.batch_size=1", "model.seq_len=256")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    plans = {p["name"]: p for p in rows if p["rank"] is not None}
    assert set(plans) == {"cp4", "cp2+tp2", "tp4"}, set(plans)
    # the splits it cannot take are in the JSON too, unranked, with why (as the text lists them)
    refused = {p["name"]: p["not_possible"] for p in rows if p["rank"] is None}
    assert refused["dp4"] == "train.batch_size=1 is split over data x fsdp = 4 devices, which does not divide it; " \
        "use a multiple of 4", refused
    assert plans["cp4"]["mesh"] == {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "context": 4, "tensor": 1}
    assert plans["cp4"]["overrides"] == ["mesh.stage=1", "mesh.data=1", "mesh.fsdp=1", "mesh.expert=1", "mesh.context=4",
                                         "mesh.tensor=1"]
    kv_bytes = 2 * 2 * 256 * 4 * 16 * 4  # K and V of 2 layers: [1 row, 256 positions, 4 heads, 16] float32
    gathered = {c["kind"]: c["bytes"] for c in plans["cp4"]["collectives"]}["all-gather"]
    full_weights = 4 * plans["cp4"]["bytes_per_device"]["params"]  # each device holds a quarter of them
    assert kv_bytes + 0.9 * full_weights <= gathered <= kv_bytes + 1.5 * full_weights, (gathered, kv_bytes)
    # The context devices are FSDP shards of the weights; tensor parallelism leaves the norms and biases whole.
    # (Their temporaries are alike here: XLA's attention works on [heads, T / C, T] and [heads / C, T, T] scores.)
    state = {n: plans[n]["bytes_per_device"]["params"] + plans[n]["bytes_per_device"]["optimizer"] for n in plans}
    assert state["cp4"] < state["tp4"], state
    assert_one_line_error(shardlm("train", "--cpu-devices", "8", *MICRO, "model.seq_len=36", "mesh.context=8"),
                          "model.seq_len=36 is split over mesh.context=8")


def test_a_context_run_trains_samples_and_generates_the_same_on_one_device(tmp_path):
    """Its checkpoint, read onto one device, generates the tokens it generates on the run's mesh; a reader on fewer
    devices than the run's mesh names none: it gets FSDP over what it has, and a note. (A checkpoint resumed onto a
    context mesh, loss for loss: test_checkpoint's test_fsdp8_checkpoint_continues_on_another_mesh [fsdp2xcp4].)"""
    from shardlm.generate import Generator
    from shardlm.load import load_model
    from shardlm.sampling import Sampling
    from shardlm.train.loop import train

    run = ["model.n_layers=2", "model.d_model=64", "model.d_mlp=128", "model.seq_len=64", "train.batch_size=8",
           "train.warmup_steps=1", "train.eval_interval=2", "train.eval_batches=1", "train.sample_tokens=8",
           "data.tokenizer=bytes", "checkpoint.every=2", "mesh.fsdp=2", "mesh.context=4"]
    run_dir = tmp_path / "run"
    summary = train(load_config(None, run + ["train.steps=2"]), run_dir, progress=False)
    assert summary["mesh"] == {"stage": 1, "data": 1, "fsdp": 2, "expert": 1, "context": 4, "tensor": 1}
    assert (run_dir / "samples.txt").read_text().strip()  # sampled on the context mesh
    prompt = [[ord(c) for c in "ROMEO:"]]
    tokens = {}
    for name, devices in (("run's mesh", None), ("one device", jax.devices()[:1])):
        m = load_model(run_dir, devices=devices)
        assert dict(m.mesh.shape)["context"] == (4 if devices is None else 1)
        assert m.note == ("" if devices is None else f"{run_dir} trained on 8 devices; loading onto the 1 here as "
                          "mesh.data=1 mesh.fsdp=-1 mesh.tensor=1 (pass mesh.*= to choose)")
        gen = Generator(m.graphdef, m.state, m.mesh, eot_id=m.tokenizer.eot_id)
        tokens[name] = gen.generate(prompt, 12, Sampling(temperature=0))[0].ids
    assert tokens["run's mesh"] == tokens["one device"] and len(tokens["one device"]) == 12
