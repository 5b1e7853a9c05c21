"""Checkpoints: exact resumption, moving a run to another mesh, preemption, kills during a save, corruption, and
parameter-only readers. Runs are real `train` calls (in-process, or `shardlm` subprocesses where a signal or a kill
must hit a whole process) on the built-in corpus with a byte tokenizer."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from shardlm.config import load_config
from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh
from shardlm.sharding.rules import as_axes
from shardlm.checkpoint import RunCheckpoints
from shardlm.train import stored
from shardlm.train.loop import train
from shardlm.train.state import abstract_train_state
from conftest import MIXTURE
from test_cli import assert_one_line_error, shardlm

# Dropout on, so that exactness also covers the RNG stream; a checkpoint every 3 steps of 10. The blocks' matmuls
# in FP8 (`model.matmul_dtype=fp8`), on a two-source mixture (`conftest.MIXTURE`): their checkpoints resume bit
# for bit and move across meshes like any other.
RUN = ["model.n_layers=2", "model.d_model=64", "model.d_mlp=128", "model.seq_len=32", "model.dropout=0.1",
       "train.batch_size=16", "train.steps=10", "train.warmup_steps=2", "train.log_interval=1",
       "train.eval_interval=4", "train.eval_batches=2", "train.sample_tokens=0", "data.tokenizer=bytes",
       "checkpoint.every=3", "model.matmul_dtype=fp8", MIXTURE]
FSDP8 = ["mesh.fsdp=-1"]
VOCAB = 257  # the byte tokenizer's
EXACT = ("step", "loss", "lr", "grad_norm", "eval_loss", "eval_bpb")


def cfg_for(*extra):
    return load_config(None, RUN + list(extra))


def rows(run_dir):
    return [{k: r[k] for k in EXACT if k in r} for r in map(json.loads, (run_dir / "metrics.jsonl").open())]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


def steps(run_dir):
    ck = RunCheckpoints(run_dir, read_only=True)
    try:
        return ck.steps()
    finally:
        ck.close()


def send_at(step, *signals):
    """An on_step hook that sends this process `signals` after `step` is dispatched."""
    def hook(s):
        if s == step:
            for sig in signals:
                os.kill(os.getpid(), sig)
    return hook


def restore_arrays(run_dir, step, mesh, optimizer=True):
    """The checkpoint's arrays read onto `mesh` (with the shardings shardlm would train them with there)."""
    _, _, abstract, shardings = abstract_train_state(cfg_for(), mesh, VOCAB)
    ck = RunCheckpoints(run_dir, read_only=True)
    try:
        return stored.restore_state(ck, step, abstract), shardings
    finally:
        ck.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted FSDP 8 run: 10 steps, checkpoints kept at 6, 9 and 10."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    summary = train(cfg_for(*FSDP8), run_dir, progress=False)
    assert summary["finished"] and summary["resumed_from"] == 0
    return run_dir


def copy_run(reference, tmp_path, keep_steps):
    """A copy of the reference run as it was when its newest checkpoint was max(keep_steps)."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    for step in steps(run_dir):
        if step not in keep_steps:
            shutil.rmtree(run_dir / "checkpoints" / str(step))
    return run_dir


def test_interrupted_and_resumed_equals_uninterrupted_bit_for_bit(reference, tmp_path):
    run_dir = tmp_path / "run"
    cfg = cfg_for(*FSDP8)
    # 1. Preempted: SIGTERM during step 4 (an eval step) finishes it, evaluates it and saves it.
    summary = train(cfg, run_dir, progress=False, on_step=send_at(4, signal.SIGTERM))
    assert summary == {**summary, "steps": 4, "finished": False, "stopped_by": "SIGTERM"}
    assert steps(run_dir) == [3, 4] and not (run_dir / "summary.json").exists()

    # 2. Resumed, then crashed in step 8: the checkpoint at 6 was saved, step 7 was logged and is lost.
    def crash(step):
        if step == 8:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        train(cfg, run_dir, progress=False, on_step=crash)
    assert steps(run_dir) == [3, 4, 6] and max(losses(run_dir)) == 7

    # 3. Resumed from 6 to the end.
    summary = train(cfg, run_dir, progress=False)
    assert summary["finished"] and summary["resumed_from"] == 6 and summary["trained_now"] == 4
    assert rows(run_dir) == rows(reference)  # every logged number, each step once, bit for bit
    assert steps(run_dir) == steps(reference) == [6, 9, 10]
    mesh = make_mesh(1, 8, 1)
    resumed, _ = restore_arrays(run_dir, 10, mesh)
    uninterrupted, _ = restore_arrays(reference, 10, mesh)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(resumed), jax.tree.leaves(uninterrupted)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    for run in (run_dir, reference):  # the data position: 10 batches consumed, one JSON file for any process count
        assert json.loads((run / "checkpoints/10/data/metadata").read_text()) == {"next_batch": 10}
        ck = RunCheckpoints(run, read_only=True)
        assert ck.read_position(10) == 10
        ck.close()


def test_a_checkpoint_with_grains_per_process_position_files_still_resumes(reference, tmp_path):
    """Checkpoints written before the position became process-independent hold Grain's own state files."""
    run_dir = copy_run(reference, tmp_path, keep_steps=(6,))
    data = run_dir / "checkpoints/6/data"
    shutil.rmtree(data)
    data.mkdir()
    (data / "process_0-of-1.json").write_text(json.dumps({"next_index": 6}))
    summary = train(cfg_for(*FSDP8), run_dir, progress=False)
    assert summary["resumed_from"] == 6 and rows(run_dir) == rows(reference)


def test_restore_reads_each_array_into_the_new_sharding(reference):
    saved, _ = restore_arrays(reference, 10, make_mesh(1, 8, 1))
    mesh = make_mesh(2, 1, 4)
    moved, shardings = restore_arrays(reference, 10, mesh)
    tensor_split = 0
    for (path, a), b, s in zip(jax.tree_util.tree_leaves_with_path(moved), jax.tree.leaves(saved),
                               jax.tree.leaves(shardings)):
        assert a.sharding == s, jax.tree_util.keystr(path)  # read back from the restored array
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
        if any(e == "tensor" or (isinstance(e, tuple) and "tensor" in e) for e in s.spec):
            tensor_split += 1  # each device holds its shard (a quarter over tensor, halved again over data when the
            degree = math.prod(mesh.shape[a] for e in s.spec for a in as_axes(e))  # state is sharded over it)
            assert degree >= 4 and a.addressable_shards[0].data.size * degree == a.size, jax.tree_util.keystr(path)
    assert tensor_split >= 8  # attention and MLP weights of both layers, and their AdamW moments


@pytest.mark.parametrize("mesh, devices, scan", [({"data": 2, "tensor": 4}, 8, False), ({"fsdp": 2, "context": 4}, 8, True),
                                                 ({"data": 1}, 1, True)],
                         ids=["dp2xtp4 block by block", "fsdp2xcp4", "one-device"])
def test_fsdp8_checkpoint_continues_on_another_mesh(reference, tmp_path, mesh, devices, scan):
    """The reference ran with its blocks scanned; a checkpoint continues on any mesh, scanned or block by block."""
    run_dir = copy_run(reference, tmp_path, keep_steps=[6])
    summary = train(cfg_for(*(f"mesh.{a}={d}" for a, d in mesh.items()), f"model.scan_layers={str(scan).lower()}"),
                    run_dir, progress=False, devices=jax.devices()[:devices])
    assert summary["resumed_from"] == 6 and summary["mesh"] == {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1,
                                                                **mesh}
    want, got = losses(reference), losses(run_dir)
    assert sorted(got) == list(range(1, 11))
    for step in range(7, 11):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_a_checkpoint_moves_in_and_out_of_a_state_sharded_over_data(reference, tmp_path):
    """The FSDP 8 checkpoint at step 6 continues on data 8 with the weights and AdamW's moments split over the
    replicas (`train.shard_optimizer_over_data`, the default), is stopped at step 8 and saved so; that checkpoint
    continues with the setting off, every replica holding the whole state. Every loss matches the uninterrupted
    run. (Which arrays each setting splits is `test_sharding`'s.)"""
    run_dir = copy_run(reference, tmp_path, keep_steps=[6])
    summary = train(cfg_for("mesh.data=8"), run_dir, progress=False, on_step=send_at(8, signal.SIGTERM))
    assert summary["resumed_from"] == 6 and max(steps(run_dir)) == 8
    summary = train(cfg_for("mesh.data=8", "train.shard_optimizer_over_data=false"), run_dir, progress=False)
    assert summary["resumed_from"] == 8 and summary["finished"]
    want, got = losses(reference), losses(run_dir)
    for step in range(7, 11):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_a_checkpoint_stored_layer_by_layer_restores_into_scanned_blocks(reference, tmp_path):
    """Checkpoints written before blocks were stored stacked hold a tree per layer; they resume the same, bit for
    bit: the layout is read from the checkpoint's metadata and converted as the arrays are read."""
    from shardlm.models.stack import per_layer_tree

    run_dir = copy_run(reference, tmp_path, keep_steps=[6])
    state, _ = restore_arrays(run_dir, 6, make_mesh(1, 8, 1))  # scanned: the blocks stacked
    pure = per_layer_tree(nnx.to_pure_dict(state), 2)
    ck = RunCheckpoints(run_dir)
    meta, position = ck.read_meta(6), ck.read_position(6)
    ck.close()
    shutil.rmtree(run_dir / "checkpoints" / "6")
    ck = RunCheckpoints(run_dir)
    ck.save_trees(6, pure["model"], pure["optimizer"], position, meta)
    ck.close()
    ck = RunCheckpoints(run_dir, read_only=True)
    assert sorted(ck.stored_tree(6)["blocks"]) == ["0", "1"]  # stored per layer
    ck.close()
    assert train(cfg_for(*FSDP8), run_dir, progress=False)["resumed_from"] == 6
    assert rows(run_dir) == rows(reference)


def test_raising_train_steps_extends_a_finished_run(reference, tmp_path):
    run_dir = copy_run(reference, tmp_path, keep_steps=[6, 9, 10])
    assert train(cfg_for(*FSDP8), run_dir, progress=False)["trained_now"] == 0  # finished: nothing to do
    summary = train(cfg_for(*FSDP8, "train.steps=12"), run_dir, progress=False)
    assert summary["finished"] and summary["resumed_from"] == 10 and summary["trained_now"] == 2
    assert sorted(losses(run_dir)) == list(range(1, 13)) and 12 in steps(run_dir)


def test_a_resume_that_would_change_the_run_is_refused(reference, tmp_path):
    run_dir = copy_run(reference, tmp_path, keep_steps=[6])
    before = (run_dir / "metrics.jsonl").read_bytes()
    for extra, message in [(["model.d_model=128"], "model.d_model=128 differs from the run's 64 (checkpoint step 6)"),
                           (["train.batch_size=32"], "train.batch_size=32 differs from the run's 16"),
                           (["seed=1"], "seed=1 differs from the run's 0"),
                           (["data.val_fraction=0.1"], "the training data"),
                           # another optimizer: with the route docs/recipe.md gives, which keeps the weights
                           (["train.optimizer=lion"], "train.optimizer=lion differs from the run's adamw (checkpoint "
                            "step 6); the checkpoint holds the state of the run's optimizer, which another cannot "
                            f"read: drop the override to resume, or continue the run's weights in a new run: shardlm "
                            f"export {run_dir} --out DIR, then shardlm train init.from=hf:DIR train.optimizer=lion "
                            "... (docs/recipe.md)")]:
        with pytest.raises(ShardlmError, match=re.escape(message)):
            train(cfg_for(*FSDP8, *extra), run_dir, progress=False)
    assert (run_dir / "metrics.jsonl").read_bytes() == before and steps(run_dir) == [6]


def test_second_ctrl_c_aborts_without_saving(tmp_path):
    run_dir = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background shell job
    with pytest.raises(KeyboardInterrupt):
        train(cfg_for(*FSDP8), run_dir, progress=False, on_step=send_at(4, signal.SIGINT, signal.SIGINT))
    assert 4 not in steps(run_dir) and not list((run_dir / "checkpoints").glob("4*"))  # nothing saved for step 4
    # The periodic save of step 3 was left writing in the background, and completes.
    wait_for(lambda: steps(run_dir) == [3], timeout=60)
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_corrupt_checkpoint_is_a_one_line_error_naming_the_fallback(reference, tmp_path):
    run_dir = copy_run(reference, tmp_path, keep_steps=[6, 9])
    for f in (run_dir / "checkpoints/9/params").rglob("*"):
        if f.is_file() and "/d/" in str(f):  # the array data files
            f.write_bytes(b"\0garbage" * 64)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(ShardlmError) as err:
        train(cfg_for(*FSDP8), run_dir, progress=False)
    message = str(err.value)
    assert "\n" not in message and message.startswith("checkpoint step 9 in ")
    assert "the newest readable one is step 6: move " in message and str(run_dir / "checkpoints" / "9") in message
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # nothing touched

    # The command line prints exactly one line (none of the aborted reads' echoes); the fallback is now bad too.
    (run_dir / "checkpoints/6/meta/metadata").write_text("{not json")
    proc = shardlm("train", "--cpu-devices", "8", "--run-dir", str(run_dir), "--no-progress")
    assert_one_line_error(proc, "checkpoint step 9 in ")
    assert "no older checkpoint reads either: pass --overwrite or another --run-dir" in proc.stderr


def test_readers_load_parameters_only(reference, tmp_path, capsys):
    from shardlm.cli import main
    from shardlm.load import load_model

    run_dir = copy_run(reference, tmp_path, keep_steps=[10])
    shutil.rmtree(run_dir / "checkpoints/10/optimizer")  # a reader that touched the optimizer state would fail
    loaded = load_model(run_dir, overrides=["mesh.tensor=2"])
    assert loaded.step == 10 and dict(loaded.mesh.shape) == {"stage": 1, "data": 4, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2}
    saved, _ = restore_arrays(reference, 10, make_mesh(1, 8, 1))
    assert set(nnx.to_pure_dict(loaded.state)) == set(nnx.to_pure_dict(saved["model"]))
    for a, b in zip(jax.tree.leaves(loaded.state), jax.tree.leaves(saved["model"])):
        assert np.array_equal(np.asarray(a), np.asarray(b))

    assert main(["generate", str(run_dir), "--prompt", "ROMEO:", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    assert main(["generate", str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere'} does not exist; pass the --run-dir" in capsys.readouterr().err
    assert main(["generate", str(tmp_path)]) == 2
    assert "is a directory without a shardlm run (no config.yaml)" in capsys.readouterr().err
    shutil.rmtree(run_dir / "checkpoints")
    assert main(["generate", str(run_dir)]) == 2
    assert "has no complete checkpoint yet" in capsys.readouterr().err


def wait_for(predicate, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def logged_steps(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line] \
        if path.exists() else []


def test_sigterm_saves_the_step_reached_and_resume_continues_from_it(tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", "--cpu-devices", "8", "--run-dir", str(run_dir), "--no-progress", *RUN, "train.steps=100000",
            "checkpoint.every=1000"]
    proc = subprocess.Popen([sys.executable, "-m", "shardlm", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(logged_steps(run_dir)) >= 3 or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    reached, log = logged_steps(run_dir)[-1], out + err
    assert f"stopped by SIGTERM at step {reached}" in log and f"resume with: shardlm train --run-dir {run_dir}" in log
    assert steps(run_dir) == [reached]  # the checkpoint holds exactly the step reached

    # `shardlm train --run-dir DIR` alone resumes: the run's config.yaml is the base.
    proc = shardlm("train", "--cpu-devices", "8", "--run-dir", str(run_dir), "--no-progress",
                   f"train.steps={reached + 2}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert f"resuming {run_dir} from its checkpoint at step {reached} (of {reached + 2})" in log
    assert "train.steps 100000 -> " in log
    assert logged_steps(run_dir) == list(range(1, reached + 3))


SLOW_COMMIT = """
import asyncio, pathlib, sys
from orbax.checkpoint._src.path import atomicity

finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def stalled_finalize(self):
    # The save of step 4 has written its files but is not yet committed: stall here until killed.
    if self._final_path.name == "4":
        pathlib.Path(sys.argv[1]).write_text("writing")
        await asyncio.sleep(3600)
    return await finalize(self)

atomicity.AtomicRenameTemporaryPath.finalize = stalled_finalize
from shardlm.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_sigkill_during_an_async_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    run_dir, marker = tmp_path / "run", tmp_path / "saving"
    args = ["train", "--cpu-devices", "8", "--run-dir", str(run_dir), "--no-progress", *RUN, *FSDP8,
            "checkpoint.every=2"]
    proc = subprocess.Popen([sys.executable, "-c", SLOW_COMMIT, str(marker), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: marker.exists() or proc.poll() is not None)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.kill()  # SIGKILL in the middle of the background save
    proc.communicate()
    killed = losses(run_dir)
    assert (run_dir / "checkpoints/4.orbax-checkpoint-tmp").is_dir() and steps(run_dir) == [2]

    log = []
    monkeypatch.setattr("shardlm.train.loop._log", log.append)
    summary = train(cfg_for(*FSDP8, "checkpoint.every=2"), run_dir, progress=False)
    text = "\n".join(log)
    assert "ignoring the incomplete checkpoint" in text and "4.orbax-checkpoint-tmp" not in os.listdir(
        run_dir / "checkpoints")
    assert f"resuming {run_dir} from its checkpoint at step 2" in text and summary["resumed_from"] == 2
    resumed = losses(run_dir)
    for step in range(3, max(killed) + 1):  # the killed process and the resumed one agree bit for bit
        assert resumed[step] == killed[step], step


def test_checkpoints_dir_that_is_not_shardlms_is_never_written_or_deleted(reference, tmp_path):
    for overwrite in (False, True):
        run_dir = tmp_path / f"mine{overwrite}"
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints" / "model.pt").write_bytes(b"someone else's")
        with pytest.raises(ShardlmError, match="holds files shardlm did not write"):
            train(cfg_for(*FSDP8), run_dir, progress=False, overwrite=overwrite)
        assert (run_dir / "checkpoints" / "model.pt").read_bytes() == b"someone else's"
    run_dir = copy_run(reference, tmp_path, keep_steps=[6])  # the run's own: --overwrite replaces it
    summary = train(cfg_for(*FSDP8, "train.steps=3"), run_dir, progress=False, overwrite=True)
    assert summary["resumed_from"] == 0 and steps(run_dir) == [3] and sorted(losses(run_dir)) == [1, 2, 3]


def test_a_muon_run_saved_before_its_adamw_half_was_fixed_is_refused_in_one_line():
    """Its optimizer state is optax.contrib.muon's own AdamW branch (another layout, and it decayed norms and
    biases): the refusal names the way on, an export and a new run from it; other runs pass."""
    from shardlm.train.rundir import check_optimizer_layout

    with pytest.raises(ShardlmError, match=r"^runs/old's checkpoint step 40 holds Muon's state from before .* "
                                           r"shardlm export runs/old --out DIR, then shardlm train init.from=hf:DIR"):
        check_optimizer_layout({"train": {"optimizer": "muon", "lr": 3e-3}}, 40, Path("runs/old"))
    check_optimizer_layout({"train": {"optimizer": "muon", "muon_nesterov": True}}, 40, Path("runs/new"))
    check_optimizer_layout({"train": {"optimizer": "adamw"}}, 40, Path("runs/adamw"))
