"""A model from the user's own file, trained like shardlm's: `shardlm train model=py:FILE:FUNCTION plan=PLAN`.

The models are tests/user_models.py's (plain Flax NNX and Linen, no sharding code), placed FSDP 4 x TP 2 by
tests/user_models_tp.yaml on 8 simulated devices. What is checked: the losses against a plain single-device loop,
an interrupted and resumed run against the uninterrupted one, a resume on another mesh, two processes against
one, activation constraints in the compiled step, the library Trainer's save/restore, plan/bench/explain/generate
on such a model, and the one-line errors for what a user gets wrong.
"""

import json
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardlm
from shardlm.cli import main
from shardlm.config import load_config
from shardlm.perf import hlo
from shardlm.train.loop import train
from test_checkpoint import copy_run, rows, send_at, steps
from user_models import build_batchnorm, build_linen, build_nnx

HERE = Path(__file__).resolve().parent
MODELS = HERE / "user_models.py"
PLAN = HERE / "user_models_tp.yaml"
VOCAB = 260  # the byte tokenizer's 257, rounded up so that tensor 2 and fsdp 4 divide the output head
RUN = ["model.seq_len=32", f"model.vocab_size={VOCAB}", "data.tokenizer=bytes", "train.batch_size=16",
       "train.steps=8", "train.warmup_steps=2", "train.log_interval=1", "train.eval_interval=4",
       "train.eval_batches=2", "train.sample_tokens=8", "checkpoint.every=3"]


def model(function: str) -> str:
    return f"model=py:{MODELS}:{function}"


def cfg_for(function: str = "build_nnx", *extra):
    return load_config(None, [model(function), f"plan={PLAN}", *RUN, *extra])


def run_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if "loss" in r}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """`shardlm train model=py:... plan=...` from the command line, once per model kind: 8 steps on FSDP 4 x TP 2."""
    runs = {}

    def get(function: str) -> Path:
        if function not in runs:
            run_dir = tmp_path_factory.mktemp(function) / "run"
            assert main(["train", "--cpu-devices", "8", "--run-dir", str(run_dir), "--no-progress", model(function),
                         f"plan={PLAN}", *RUN]) == 0
            runs[function] = run_dir
        return runs[function]

    return get


def plain_loop_losses(function: str, n: int) -> list[float]:
    """The same model, optimizer and batches on one device, in a plain JAX loop with no shardlm placement."""
    from shardlm.data.loader import BatchLoader
    from shardlm.losses import cross_entropy
    from shardlm.train.data import load_data
    from shardlm.train.optimizers import make_optimizer

    cfg = cfg_for(function)
    one = jax.sharding.NamedSharding(shardlm.make_mesh(devices=jax.devices()[:1]), jax.sharding.PartitionSpec())
    loader = BatchLoader(load_data(cfg).tokens("train"), 32, 16, one, seed=cfg.seed, shuffle=True)
    tx = make_optimizer(cfg)
    tokens = jnp.zeros((1, 32), jnp.int32)
    if function == "build_nnx":
        net = build_nnx(VOCAB, 32, 0.0, nnx.Rngs(cfg.seed))
        params = nnx.state(net, nnx.Param)
        graphdef, rest = nnx.split(net, nnx.Param, ...)[::2]
        forward = lambda p, x: nnx.merge(graphdef, p, rest)(x)  # noqa: E731
    else:
        net = build_linen(VOCAB, 32)
        params = net.init({"params": jax.random.key(cfg.seed), "dropout": jax.random.key(cfg.seed + 1)}, tokens)
        forward = lambda p, x: net.apply(p, x)  # noqa: E731
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(forward(p, batch[:, :-1]), batch[:, 1:]))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(n):
        params, opt_state, loss = step(params, opt_state, loader.get(i))
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("function", ["build_nnx", "build_linen"])
def test_a_users_model_trains_from_the_cli_like_a_plain_single_device_loop(cli_runs, function):
    run_dir = cli_runs(function)
    got = run_losses(run_dir)
    want = plain_loop_losses(function, 8)
    assert abs(got[1] - want[0]) <= 1e-5 * want[0], (got[1], want[0])
    for step in range(2, 9):  # and the updates too: AdamW, the schedule and clipping on sharded gradients
        assert abs(got[step] - want[step - 1]) <= 1e-4 * want[step - 1], (step, got[step], want[step - 1])
    assert got[8] < got[1] - 0.5  # it learns
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["mesh"] == {"stage": 1, "data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}  # the plan's mesh, no mesh.* given
    assert saved["final_eval_loss"] < saved["first_eval_loss"] and saved["mfu_convention"].startswith("3x")
    assert (run_dir / "samples.txt").read_text().strip()  # it can generate: whole-context decoding
    assert (run_dir / "loss.png").is_file() and any((run_dir / "tensorboard").iterdir())
    assert steps(run_dir) == [3, 6, 8]
    config = (run_dir / "config.yaml").read_text()
    assert "n_layers" not in config and f"plan: {PLAN}" in config  # only what a file's model uses


def test_sigterm_then_resume_is_the_uninterrupted_run_and_another_mesh_continues_it(cli_runs, tmp_path):
    reference = cli_runs("build_nnx")
    run_dir = tmp_path / "run"
    cfg = cfg_for()
    summary = train(cfg, run_dir, progress=False, on_step=send_at(4, signal.SIGTERM))
    assert summary["stopped_by"] == "SIGTERM" and summary["steps"] == 4 and steps(run_dir) == [3, 4]
    summary = train(cfg, run_dir, progress=False)
    assert summary["finished"] and summary["resumed_from"] == 4
    assert rows(run_dir) == rows(reference)  # every logged number of every step, bit for bit

    moved = copy_run(reference, tmp_path / "moved", keep_steps=(6,))
    # resumed from the command line on data 8 under the fsdp preset instead of fsdp 4 x tensor 2 by the plan file
    # (mesh.* overrides describe the whole new mesh; the run's own config is the base, so no model= is needed)
    assert main(["train", "--cpu-devices", "8", "--run-dir", str(moved), "--no-progress", "mesh.data=8",
                 "plan=fsdp"]) == 0
    summary = json.loads((moved / "summary.json").read_text())
    assert summary["resumed_from"] == 6 and summary["mesh"]["data"] == 8
    assert "plan: fsdp" in (moved / "config.yaml").read_text()
    want, got = run_losses(reference), run_losses(moved)
    for step in (7, 8):
        assert abs(got[step] - want[step]) <= 1e-5 * want[step], (step, got[step], want[step])


def test_dropout_keys_are_a_function_of_seed_and_step_on_any_mesh():
    """A file's model with dropout: the same step on two meshes draws the same masks; another step, others."""
    from shardlm.train.state import create_train_state
    from shardlm.train.step import batch_struct, train_step_for

    cfg = cfg_for("build_nnx", "model.dropout=0.3")
    batch = np.random.default_rng(0).integers(0, 257, (16, 33)).astype(np.int32)
    losses = {}
    for name, mesh in (("fsdp4_tp2", shardlm.make_mesh(fsdp=4, tensor=2)), ("dp8", shardlm.make_mesh(data=8))):
        ts = create_train_state(cfg, mesh, 257)
        step = train_step_for(cfg, ts, mesh)
        placed = jax.device_put(batch, batch_struct(cfg, mesh).sharding)
        state, first = step(ts.state, placed)
        _, second = step(state, placed)
        losses[name] = (float(first["loss"]), float(second["loss"]))
    assert losses["fsdp4_tp2"] == pytest.approx(losses["dp8"], rel=1e-6)
    no_dropout = cfg_for("build_nnx")
    mesh = shardlm.make_mesh(data=8)
    ts = create_train_state(no_dropout, mesh, 257)
    placed = jax.device_put(batch, batch_struct(no_dropout, mesh).sharding)
    _, plain = train_step_for(no_dropout, ts, mesh)(ts.state, placed)
    assert float(plain["loss"]) != pytest.approx(losses["dp8"][0], rel=1e-4)  # the masks did something


def test_grad_accumulation_is_the_full_batch_step_for_a_users_model():
    from shardlm.train.state import create_train_state
    from shardlm.train.step import batch_struct, train_step_for

    batch = np.random.default_rng(1).integers(0, 257, (16, 33)).astype(np.int32)
    mesh = shardlm.make_mesh(fsdp=4, tensor=2)
    out = {}
    for k in (1, 2):
        cfg = cfg_for("build_nnx", f"train.grad_accum={k}")
        ts = create_train_state(cfg, mesh, 257)
        step, placed = train_step_for(cfg, ts, mesh), jax.device_put(batch, batch_struct(cfg, mesh).sharding)
        state, first = step(ts.state, placed)
        _, second = step(state, placed)  # after an update made from the accumulated gradients
        out[k] = [(float(m["loss"]), float(m["grad_norm"])) for m in (first, second)]
    np.testing.assert_allclose(out[2], out[1], rtol=1e-5)


def test_batch_statistics_move_on_with_gradient_accumulation_and_a_train_flag_reaches_the_model(tmp_path):
    """An NNX BatchNorm's statistics after a step, with and without gradient accumulation, against the module
    stepped eagerly on the same microbatches; and a Linen model whose training mode is an argument, trained through
    `model.call` (the flag is True in the step, so its dropout is on and the losses of two meshes still agree)."""
    from shardlm.train.state import create_train_state
    from shardlm.train.step import batch_struct, train_step_for

    batch = np.random.default_rng(2).integers(0, 257, (16, 33)).astype(np.int32)
    mesh = shardlm.make_mesh(fsdp=4, tensor=2)
    for k in (1, 2):
        cfg = cfg_for("build_batchnorm", f"train.grad_accum={k}", "plan=fsdp")
        ts = create_train_state(cfg, mesh, 257)
        state, _ = train_step_for(cfg, ts, mesh)(ts.state, jax.device_put(batch, batch_struct(cfg, mesh).sharding))
        eager = build_batchnorm(VOCAB, nnx.Rngs(0))
        eager.train()
        for i in range(k):  # microbatch i is rows i, i + k, ...
            eager(jnp.asarray(batch[i::k, :-1]))
        np.testing.assert_allclose(np.asarray(state["model"]["bn"]["mean"][...]), np.asarray(eager.bn.mean[...]),
                                   rtol=1e-5, atol=1e-6)
    losses = {}
    for name, mesh in (("fsdp4_tp2", shardlm.make_mesh(fsdp=4, tensor=2)), ("dp8", shardlm.make_mesh(data=8))):
        cfg = cfg_for("build_linen_train_flag", "model.call=call_with_train", "plan=fsdp")
        ts = create_train_state(cfg, mesh, 257)
        _, metrics = train_step_for(cfg, ts, mesh)(ts.state, jax.device_put(batch, batch_struct(cfg, mesh).sharding))
        losses[name] = float(metrics["loss"])
    assert losses["fsdp4_tp2"] == pytest.approx(losses["dp8"], rel=1e-6)


def test_two_processes_train_a_users_model_like_one(cli_runs, tmp_path):
    from test_multihost import LAUNCH_TIMEOUT, launcher_log, shardlm_command

    reference = cli_runs("build_nnx")
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    cmd = shardlm_command("launch", "--processes", "2", "--cpu-devices", "4", "--log-dir", str(logs), "--", "train",
                          "--run-dir", str(run_dir), "--no-progress", model("build_nnx"), f"plan={PLAN}", *RUN)
    import subprocess

    with open(logs / "launcher.log", "w") as out:
        assert subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=LAUNCH_TIMEOUT).returncode == 0, \
            launcher_log(logs)[-3000:]
    assert "2 processes" in launcher_log(logs)
    want, got = run_losses(reference), run_losses(run_dir)
    for step in range(1, 9):  # gloo sums across processes in another order than one process does
        assert abs(got[step] - want[step]) <= 1e-5 * want[step], (step, got[step], want[step])


# --- activation constraints ----------------------------------------------------------------------------------

def compiled_collectives(cfg) -> list:
    from shardlm.mesh import mesh_from_config
    from shardlm.train.state import TrainState, abstract_train_state
    from shardlm.train.step import batch_struct, train_step_for

    mesh = mesh_from_config(cfg.mesh)
    _, graphdef, abstract, shardings = abstract_train_state(cfg, mesh, 257)
    step = train_step_for(cfg, TrainState(graphdef, abstract, shardings), mesh)
    text = step.lower(abstract, batch_struct(cfg, mesh)).compile().as_text()
    return hlo.collectives(text, 8)


def forward(ops, kind, group_size, at_least=0):
    """The forward pass's collectives of `kind` over groups of `group_size` moving at least `at_least` bytes."""
    return [op for op in ops if op.kind == kind and op.group_size == group_size and op.bytes >= at_least
            and "transpose" not in op.op_name]


# Megatron's sequence parallelism (Korthikanti et al. 2022): the residual stream and the norms split over tensor
# along the sequence, so each row-parallel layer's all-reduce becomes a reduce-scatter and each column-parallel
# layer starts with an all-gather of the sequence. XLA cannot choose this by itself: it is a choice of how to lay
# out activations, which the weights' shardings do not determine.
SEQUENCE_PARALLEL = """
activations:
  - ["blocks/*/{norm1,norm2}", [batch, tensor, null]]
  - ["blocks/*/attn/{query,key,value}", [batch, null, tensor, null]]
  - ["blocks/*/fc1", [batch, null, tensor]]
  - ["blocks/*/{attn,fc2}", [batch, tensor, null]]
  - ["blocks/*", [batch, tensor, null]]
"""


def test_activation_constraints_turn_megatrons_all_reduces_into_sequence_parallel_collectives(tmp_path):
    activation = 16 // 4 * 32 * 32 * 4  # a device's rows (batch 16 over fsdp 4) x seq 32 x d_model 32, float32
    plain = compiled_collectives(cfg_for())
    plan = tmp_path / "sp.yaml"
    plan.write_text(PLAN.read_text() + SEQUENCE_PARALLEL)
    sp = compiled_collectives(cfg_for("build_nnx", f"plan={plan}"))
    matmuls = lambda ops: [op for op in ops if op.op_name.endswith("dot_general")]  # noqa: E731 (not the lookup)
    # Without constraints XLA does Megatron: an all-reduce over tensor after each row-parallel layer, 2 per block.
    assert len(matmuls(forward(plain, "all-reduce", 2, activation))) == 4
    assert not forward(plain, "reduce-scatter", 2)
    # With them: no activation all-reduce over tensor in the forward pass; a reduce-scatter of the same activation
    # after each row-parallel layer, and an all-gather of the sequence before each column-parallel one.
    assert not forward(sp, "all-reduce", 2, activation)
    scatters = forward(sp, "reduce-scatter", 2)
    assert len(scatters) == 4 and all(op.bytes == activation for op in scatters)
    assert len(matmuls(forward(sp, "all-gather", 2, activation))) == 4


def test_a_plan_maps_the_models_own_logical_names(tmp_path):
    """The Linen model names its MLP hidden layer ("batch", "length", "mlp") with nn.with_logical_constraint, a
    no-op until a plan maps the names: `mlp: null` makes the hidden layer whole on every device (all-gathered over
    tensor after fc1), `mlp: tensor` keeps it split as Megatron does."""
    hidden = 16 // 4 * 32 * 128 * 4
    results = {}
    for name, mlp in (("split", "tensor"), ("whole", "null")):
        plan = tmp_path / f"{name}.yaml"
        plan.write_text(PLAN.read_text() + f"logical: {{batch: [data, fsdp], length: null, mlp: {mlp}}}\n")
        results[name] = compiled_collectives(cfg_for("build_linen", f"plan={plan}"))
    assert not forward(results["split"], "all-gather", 2, hidden)
    gathered = forward(results["whole"], "all-gather", 2, hidden)
    assert sorted(op.op_name.split("/")[-3] for op in gathered) == ["block_0", "block_1"]  # after each fc1


def test_activation_rules_reach_modules_inside_nnx_lifted_transforms():
    """nnx.remat splits a module and merges a new one inside; the rule still applies to its output."""

    class Remat(nnx.Module):
        def __init__(self):
            self.fc1, self.fc2 = nnx.Linear(16, 64, rngs=nnx.Rngs(0)), nnx.Linear(64, 16, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.fc2(nnx.remat(lambda m, x: m(x))(self.fc1, x))

    x = jnp.ones((8, 16))
    counts = {}
    for name, extra in (("free", {}), ("pinned", {"activations": [["fc1", [None, "data"]]]})):
        sharded = shardlm.shard(Remat, {"rules": [["**", "replicate"]], **extra}, shardlm.make_mesh(data=8))
        graphdef, params, rest = sharded._split()
        text = jax.jit(lambda p, r, x: sharded.forward(graphdef, p, r, x)).lower(params, rest, x).compile().as_text()
        counts[name] = len(hlo.collectives(text, 8))
    assert counts["free"] == 0 and counts["pinned"] > 0  # the hidden layer split over data: resharded around fc2


def test_a_new_plan_on_resume_brings_its_mesh(tmp_path):
    from shardlm.train.rundir import run_config

    (tmp_path / "config.yaml").write_text(cfg_for().to_yaml())  # a run saved on fsdp 4 x tensor 2
    cfg, _ = run_config(None, ["plan=fsdp"], str(tmp_path))
    assert (cfg.mesh.fsdp, cfg.mesh.tensor, cfg.plan) == (-1, 1, "fsdp")
    cfg, _ = run_config(None, ["plan=fsdp", "mesh.data=8"], str(tmp_path))
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (8, 1, 1)
    cfg, _ = run_config(None, ["train.steps=20"], str(tmp_path))  # nothing about the placement: the run's
    assert (cfg.mesh.fsdp, cfg.mesh.tensor, cfg.plan) == (4, 2, str(PLAN))


# --- the library: Trainer.save / restore ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_trainer_save_and_restore_continue_exactly_on_any_mesh_and_plan(tmp_path, kind):
    batches = [np.random.default_rng(i).integers(0, 64, (16, 33)).astype(np.int32) for i in range(5)]

    def trainer(plan, mesh):
        if kind == "nnx":  # dropout on: the RNG counters travel with the checkpoint
            sharded = shardlm.shard(lambda: build_nnx(64, 32, 0.2, nnx.Rngs(0)), plan, mesh)
        else:
            net = build_linen(64, 32)
            sharded = shardlm.shard(net, plan, mesh, variables=lambda: net.init(jax.random.key(0),
                                                                                 jnp.zeros((1, 32), jnp.int32)))
        return sharded.trainer(optax.adamw(1e-2), keep=2)

    first = trainer(str(PLAN), None)
    for b in batches[:3]:
        first.step(b)
    assert first.save(tmp_path) == 3
    first.wait()
    assert (tmp_path / "checkpoints" / "3").is_dir()
    uninterrupted = [float(first.step(b)["loss"]) for b in batches[3:]]
    same = trainer(str(PLAN), None)
    assert same.restore(tmp_path) == 3 and same.steps_done == 3
    assert [float(same.step(b)["loss"]) for b in batches[3:]] == uninterrupted  # bit for bit
    moved = trainer("fsdp", shardlm.make_mesh(data=2, fsdp=4))
    moved.restore(tmp_path)
    for got, want in zip([float(moved.step(b)["loss"]) for b in batches[3:]], uninterrupted, strict=True):
        assert abs(got - want) <= 1e-5 * want


def test_trainer_restore_errors_are_one_line(tmp_path, cli_runs):
    sharded = shardlm.shard(lambda: build_nnx(64, 32, 0.0, nnx.Rngs(0)), "fsdp", shardlm.make_mesh(fsdp=8))
    trainer = sharded.trainer(optax.adamw(1e-2))
    with pytest.raises(shardlm.ShardlmError, match="holds no complete checkpoint"):
        trainer.restore(tmp_path)
    with pytest.raises(shardlm.ShardlmError, match="a training run's checkpoint, not a Trainer's"):
        trainer.restore(cli_runs("build_nnx"))
    trainer.save(tmp_path / "saved", wait=True)
    with pytest.raises(shardlm.ShardlmError, match="exists already: this trainer saved"):
        trainer.save(tmp_path / "saved")


# --- plan, bench, explain and generate on such a model -------------------------------------------------------

def test_explain_plan_bench_and_generate_take_a_users_model(cli_runs, tmp_path, capsys):
    common = [model("build_nnx"), f"plan={PLAN}", *RUN]
    assert main(["explain", "--cpu-devices", "8", *common]) == 0
    out = capsys.readouterr().out
    assert "blocks/0/fc1/kernel" in out and "P('fsdp', 'tensor')" in out and "rule 'head/kernel'" in out
    assert main(["plan", "--strategies", "fsdp8,fsdp4+tp2", "--json", *common]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert {p["name"] for p in planned} == {"fsdp8", "fsdp4+tp2"} and all(p["model_flops"] > 0 for p in planned)
    assert main(["bench", "--cpu-devices", "8", "--strategies", "fsdp8,dp8", "--steps", "2", "--json", *common]) == 0
    benched = json.loads(capsys.readouterr().out)["strategies"]
    assert benched[0]["final_loss"] == pytest.approx(benched[1]["final_loss"], rel=1e-5)
    assert main(["generate", str(cli_runs("build_nnx")), "--cpu-devices", "8", "--prompt", "To be",
                 "--max-tokens", "6", "--temperature", "0", "--json"]) == 0
    sample = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sample["new_tokens"] == 6 or sample["stop"] == "eot"


# --- what a user gets wrong -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, fragment", [
    ([f"model=py:{HERE}/no_such_file.py:build"], "there is no file"),
    ([model("build_missing")], "defines no 'build_missing' (its functions: build_batchnorm, build_linen"),
    ([model("build_nothing")], "build_nothing() returned a dict; it must return an nnx.Module"),
    ([model("build_needs_width")], "build_needs_width() requires width"),
    ([model("build_nnx"), "plan=megatron", "model.n_layers=4"], "model.n_layers does not apply"),
    ([model("build_nnx"), "plan=missing.yaml"], "plan file missing.yaml does not exist"),
    ([model("build_linen_train_flag")], "needs model.call=NAME"),
    ([model("build_tuple")], "it returned a tuple, not logits [2, 32, 260]"),
    (["plan=fsdp"], "plan=fsdp is for a model from a py: file"),
])
def test_a_users_mistakes_are_one_line_errors(tmp_path, capsys, args, fragment):
    assert main(["train", "--cpu-devices", "8", "--run-dir", str(tmp_path / "run"), *args, *RUN]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardlm: error: ") and fragment in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_plan_that_does_not_match_the_model_is_a_one_line_error(tmp_path, capsys):
    for name, text, fragment in (
        ("typo", 'rules: [["blocks/*/fc3/kernel", [fsdp, null]]]\n', "rule 1 'blocks/*/fc3/kernel' matches no "),
        ("act", PLAN.read_text() + 'activations: [["blocks/*/mlp", [batch, null, null]]]\n',
         "activation rule 1 'blocks/*/mlp' matches no module"),
        ("divide", 'mesh: {tensor: 8}\nrules: [["**/kernel", {2: [null, tensor]}]]\nunmatched: replicate\n',
         "is split 8 ways"),
    ):
        plan = tmp_path / f"{name}.yaml"
        plan.write_text(text)
        assert main(["train", "--cpu-devices", "8", "--run-dir", str(tmp_path / name), model("build_nnx"),
                     f"plan={plan}", *RUN]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err
        assert not (tmp_path / name).exists()
