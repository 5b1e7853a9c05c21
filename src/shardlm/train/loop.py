"""The training loop: config -> mesh -> data -> sharded state -> compiled step -> metrics, checkpoints, samples.

`train` is a sequence of named steps (`Training`'s methods): open the data, build or restore the state, compile,
claim the run directory, run the steps, finish.

Design choices:
- Everything is built and checked before the first compile: a mesh that does not fit the devices, a degree that
  does not divide a parameter or the batch, a resume that would change the model, or an unreadable checkpoint
  fails in seconds, before the run directory is touched. The step is compiled before the directory is claimed
  too, so that a configuration only the compiler refuses leaves nothing behind either.
- A run directory that already holds a run is resumed from its newest checkpoint (see `rundir`), with the
  optimizer state, the step and the data position, so the continued run is the uninterrupted one.
- The train step is compiled ahead of time (`lower().compile()`), so the compile time is reported on its own and
  the first logged tokens/s is a real step's.
- The host syncs with the devices only when it logs: the first step, every `train.log_interval` and every
  `train.eval_interval` steps, and the last. Checkpoints are saved every `checkpoint.every` steps and at the end,
  in the background (see `checkpoint`).
- SIGTERM or Ctrl-C ends the run after the current step with a checkpoint (see `preemption`).
- Eval loss and bits per byte are measured at step 0 (the untrained baseline), every `train.eval_interval` steps
  and at the end, on the same fixed batches of the validation split each time (each source's, for a mixture:
  `evaluation`).
- Several processes (`shardlm.distributed`) run this same code in lockstep: they check that they were given the
  same config and read the same data, follow process 0's decision about the run directory, and each take part in
  every step, evaluation, checkpoint and sample. Only process 0 writes the run's files and draws the progress
  bar; the others log each step as lines (the launcher keeps them in log files).
"""

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from shardlm import distributed
from shardlm.config import Config, agree_on_config, check_resolved, describe
from shardlm.data.loader import BatchLoader, TokenWindows
from shardlm.data.prepare import PreparedData
from shardlm.data.tokenizer import EOT
from shardlm.errors import ShardlmError
from shardlm.explanation import format_explanation
from shardlm.flops import device_peak, peak_dtype
from shardlm.foreign.modules import file_sha256, is_py
from shardlm.generate import sample_text
from shardlm.mesh import check_tensor_inside_hosts, describe_hosts, describe_mesh, mesh_from_config
from shardlm.checkpoint import CheckpointError, RunCheckpoints, checkpoint_dir, local_steps
from shardlm.train.data import load_sources, stream_identity, weight_schedule
from shardlm.train.evaluation import Evaluation, epochs_seen, eval_batch_size
from shardlm.train.init_from import check_checkpoint, import_params, with_checkpoint_defaults
from shardlm.train.metrics import MetricsLogger
from shardlm.train.preemption import StopOnSignal
from shardlm.train.rundir import (
    CONFIG_FILE,
    FINISHED_MARKER,
    RunStart,
    check_vocab_padding,
    claim,
    decide_start,
    default_run_dir,
    unreadable,
)
from shardlm.train.state import (
    TrainState,
    abstract_train_state,
    batch_unit,
    check_batch,
    check_shardable,
    create_train_state,
    split_notes,
    train_state_with,
    vocab_sizes,
)
from shardlm.train import stored
from shardlm.train.optimizers import effective_warmup, optimizer_summary
from shardlm.train.source import model_source
from shardlm.train.spikes import skipped_updates
from shardlm.train.step import eval_step_for, train_step_for
from shardlm.units import fmt_bytes


def _log(msg: str) -> None:
    tqdm.write(msg)


def checkpoint_meta(cfg: Config, mesh, data: PreparedData, vocab: tuple[int, int], stream: str,
                    schedule: list) -> dict:
    """What every checkpoint records besides the arrays (the step is added per save). `stream`: the training
    sources' identity (`train.data.stream_identity`); `schedule`: their weights and the steps they changed at."""
    import orbax.checkpoint

    import shardlm

    return {**model_file(cfg),
        "config": cfg.to_dict(),
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "vocab": {"real": vocab[0], "padded": vocab[1]},
        "data": {"path": str(data.path), "train_sha256": stream, "schedule": schedule},
        # Dropout keys are a pure function of the seed and the optimizer's step (see `step`): the step restored
        # with the optimizer state and this seed give the identical stream.
        "rng": {"seed": cfg.seed, "dropout_key": "fold_in(key(seed), optimizer step)",
                "prng_impl": str(jax.config.jax_default_prng_impl)},
        "versions": {"shardlm": shardlm.__version__, "jax": jax.__version__, "orbax": orbax.checkpoint.__version__},
    }


def per_source(row: dict) -> str:
    """A mixture's eval loss per source, for a log line: ' (plays 4.12, notes 5.03)'; '' for one source."""
    losses = [f"{k.split('/', 1)[1]} {v:.4f}" for k, v in row.items() if k.startswith("eval_loss/")]
    return f" ({', '.join(losses)})" if losses else ""


def model_file(cfg: Config) -> dict:
    """A model from a py: file: the file's path and SHA-256, recorded with every checkpoint."""
    if not is_py(cfg.model.preset):
        return {}
    return {"model_file": {"spec": cfg.model.preset, "sha256": file_sha256(cfg.model.preset)}}


def recipe_lines(cfg: Config, documents: bool) -> list[str]:
    """The opening lines' account of the training recipe (docs/recipe.md): the optimizer, then each setting that
    changes what a step does besides the model's shape (the spike guard, document masks, QK-norm, z-loss), on or
    off, so that a run's log says which recipe it ran. `documents`: whether the step attends within documents
    (`source.within_documents`, which also weighs the mesh and the kernel against `data.document_mask=auto`)."""
    t, d, m = cfg.train, cfg.data, cfg.model
    optimizer = f"optimizer: {t.optimizer} (train.optimizer): {optimizer_summary(cfg)}"
    if t.optimizer == "muon":
        optimizer += (f"; Muon's momentum {'Nesterov' if t.muon_nesterov else 'heavy-ball'} "
                      f"(train.muon_nesterov={str(t.muon_nesterov).lower()})")
    guard = (f"spike guard on (skips an update beyond {t.spike_sigmas:g} sigmas of the last {t.spike_window}, stops "
             f"after {t.max_skips} skips in a row)" if t.skip_spikes else "spike guard off (train.skip_spikes=false)")
    mask = str(d.document_mask).lower()
    masks = (f"document masks on (data.document_mask={mask}"
             + (", positions restarting at each document)" if d.document_positions else ")") if documents else
             f"document masks off (data.document_mask={mask}): attention across documents")
    settings = [guard, masks]
    if not is_py(m.preset):  # a model from a py: file has its own attention, which model.qk_norm does not reach
        settings.append(f"QK-norm {'on' if m.qk_norm else 'off'}")
    settings.append(f"z-loss {t.z_loss:g} x log^2 Z" if t.z_loss else "z-loss off")
    return [optimizer, "recipe: " + " | ".join(settings)]


def spikes_halted(cfg: Config, step: int, run_dir: Path, newest: int | None) -> ShardlmError:
    """The one line that stops a run the spike guard has halted at `step`: where to go on from, which is the newest
    checkpoint (`newest`) if the run wrote one, else a run started again, since there is nothing to resume."""
    k = cfg.train.max_skips
    what = (f"{k} updates in a row were skipped by step {step} (train.max_skips={k}): the loss or gradient norm kept "
            "spiking or was not finite; ")
    fixes = "a lower train.lr, more train.warmup_steps, or a larger train.spike_sigmas or train.max_skips"
    if newest is None:
        return ShardlmError(what + "no checkpoint was written before them, so there is none to resume from: start "
                            f"the run again (shardlm train --run-dir {run_dir} restarts a run without checkpoints "
                            f"from step 0) with {fixes}")
    return ShardlmError(what + f"checkpoint step {newest} ({checkpoint_dir(run_dir) / str(newest)}) holds the "
                        f"weights from before them: resume from it (shardlm train --run-dir {run_dir}) with {fixes}")


def check_same_run(meta: dict, mesh, data: PreparedData, vocab: tuple[int, int], run_dir: Path, stream: str) -> None:
    """The checks of a resume that need the data: the same training stream (`stream`), vocabulary and RNG."""
    if meta["data"]["train_sha256"] != stream:
        mixture = stream.startswith("mixture:") or meta["data"]["train_sha256"].startswith("mixture:")
        raise ShardlmError(f"the training data ({'data.sources' if mixture else data.path}) differs from the data the "
                           f"run in {run_dir} trained on ({meta['data']['path']}); resume on the same data"
                           + (" (the same sources in the same order; their weights may change)" if mixture else "")
                           + ", or pass another --run-dir")
    if meta["vocab"]["real"] != vocab[0]:
        raise ShardlmError(f"the tokenizer's vocabulary ({vocab[0]}) differs from the run's ({meta['vocab']['real']});"
                           " resume with the run's tokenizer, or pass another --run-dir")
    check_vocab_padding(meta, vocab[1], mesh.shape["tensor"], "resume")
    saved = meta.get("model_file")
    if saved and saved["sha256"] != file_sha256(saved["spec"]):
        _log(f"note: {saved['spec']} has changed since checkpoint step {meta['step']} was saved; the checkpoint "
             "restores into the new file's model if its variables are the same")
    if meta["rng"]["prng_impl"] != str(jax.config.jax_default_prng_impl):
        raise ShardlmError(f"the run used the {meta['rng']['prng_impl']} PRNG, this process uses "
                           f"{jax.config.jax_default_prng_impl}; set jax_default_prng_impl to the run's")


def restore_state(run_dir: Path, step: int, cfg: Config, mesh, vocab_size: int) -> tuple[TrainState, int]:
    """The checkpoint at `step`, read straight into this mesh's shardings, and the data position saved with it.
    If it cannot be read, the error names the newest older checkpoint that can."""
    _, graphdef, abstract, shardings = abstract_train_state(cfg, mesh, vocab_size)
    source = model_source(cfg)
    reader = RunCheckpoints(run_dir, read_only=True)

    def read(s: int):
        return stored.restore_state(reader, s, abstract, stacks_blocks=source.stacks_blocks,
                                    repeats=source.stack_repeats)

    try:
        state = read(step)
        position = reader.read_position(step)
    except CheckpointError as e:
        older = [s for s in local_steps(run_dir) if s < step]
        raise unreadable(run_dir, e, older, reader, check=lambda s: (reader.read_meta(s), read(s))) from None
    finally:
        reader.close()
    return TrainState(graphdef, state, shardings), position


def _finished(run_dir: Path, start: RunStart) -> dict:
    summary_file = run_dir / FINISHED_MARKER
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return {**summary, "steps": start.resume_step, "finished": True, "trained_now": 0}


def train(cfg: Config, run_dir: str | Path | None = None, *, overwrite: bool = False, progress: bool = True,
          explain: bool = False, devices=None, on_step: Callable[[int], None] | None = None) -> dict:
    """Run the configured job, or resume it if `run_dir` holds it; returns the summary (also written to
    `<run_dir>/summary.json` when the run reaches `train.steps`). `on_step(step)` is called after each step is
    dispatched (monitoring; the tests use it to send signals at a chosen step)."""
    t_start = time.perf_counter()
    check_resolved(cfg)  # mesh=auto and model.remat=auto are the planner's to choose, before this
    cfg = with_checkpoint_defaults(cfg)  # a model imported from Hugging Face: its vocabulary and tokenizer
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    mesh = mesh_from_config(cfg.mesh, devices)
    check_batch(cfg, mesh)
    check_shardable(cfg, mesh)  # before the data, which may take minutes to prepare
    start = decide_start(run_dir, cfg, overwrite, _log)  # first: it also finds a run directory that is not shared
    agree_on_config(cfg, run_dir=str(run_dir), overwrite=overwrite)
    if start.resume_step is None:
        check_checkpoint(cfg, mesh)  # a Hugging Face checkpoint to start from, also before the data
    if start.finished:
        return _finished(run_dir, start)
    hosts = describe_hosts(mesh)
    _log(f"shardlm: run {run_dir} | mesh {describe_mesh(mesh)} on {mesh.devices.size} {jax.devices()[0].platform} "
         f"device(s)" + (f" | {jax.process_count()} processes on {hosts}" if hosts else
                         f" | {jax.process_count()} processes" if jax.process_count() > 1 else ""))
    check_tensor_inside_hosts(mesh, _log)

    run = Training(cfg, mesh, run_dir, start, progress=progress and distributed.is_primary(), on_step=on_step)
    run.open_data(progress)  # everything that can reject the input runs before the run directory is written
    run.initial_state()
    run.describe(explain)
    run.compile()  # a configuration the compiler refuses stops here, before anything is written
    run.claim_run_dir()
    run.open_metrics()
    # Signals are handled from the first step until the run returns: after the loop, a first one lets it finish
    # (without samples) and a second aborts.
    with StopOnSignal(coordinated=distributed.is_multiprocess()) as stop:
        stopped = run.loop(stop)
        return run.finish(stopped, stop, t_start)


class Training:
    """One run of `train`, step by step. Attributes appear as the steps that make them run."""

    def __init__(self, cfg: Config, mesh, run_dir: Path, start: RunStart, *, progress: bool,
                 on_step: Callable[[int], None] | None):
        self.cfg, self.mesh, self.run_dir, self.start = cfg, mesh, run_dir, start
        self.progress, self.on_step = progress, on_step
        self.primary = distributed.is_primary()
        self.resumed = start.resume_step or 0
        self.newest = start.resume_step  # the newest checkpoint of this run (None: none yet), which `save` updates
        self.source = model_source(cfg)
        self.state = None

    # --- before the run directory is touched ------------------------------------------------------------------
    def open_data(self, progress: bool) -> None:
        cfg = self.cfg
        prepared = load_sources(cfg, progress and self.primary, log=_log)
        data = prepared[0][1]
        tokenizer = data.tokenizer
        self.announce_data(prepared)
        # `auto` resolved (gpt2, bytes or bpe = the run's tokenizer.json), so the run names its tokenizer; an
        # explicit choice (bpe:PATH) stays as given, so that replaying config.yaml prepares the same data.
        if cfg.data.tokenizer == "auto":
            self.cfg = cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data,
                                                                                tokenizer=data.meta["tokenizer"]))
        self.vocab = vocab_sizes(cfg, tokenizer.vocab_size, self.mesh.shape["tensor"])
        if self.source.placeholder_vocab is None:  # a file's model: its plan checked for the real vocabulary
            check_shardable(cfg, self.mesh, self.vocab[0])
        self.stream = stream_identity(prepared)
        if self.start.meta is not None:
            check_same_run(self.start.meta, self.mesh, data, self.vocab, self.run_dir, self.stream)
        self.data, self.tokenizer, self.sources = data, tokenizer, [src for src, _ in prepared]
        # what summary.json names as the data: the prepared directory, or a mixture's, by source
        self.data_paths = str(data.path) if len(prepared) == 1 else {src.name: str(d.path) for src, d in prepared}
        self.open_loaders(prepared)

    def announce_data(self, prepared) -> None:
        """Every process has the same sources (or all stop with one line), and the log says what they hold."""
        named = (lambda src: "") if len(prepared) == 1 else (lambda src: f"{src.name}.")  # noqa: E731
        distributed.agree("data", {f"{named(src)}{split}_sha256": d.meta["splits"][split]["sha256"]
                                   for src, d in prepared for split in ("train", "val")},
                          "the training data", "give every process the same data.path, prepared from the same "
                                               "inputs (a shared filesystem, or identical copies)")
        total = sum(src.weight for src, _ in prepared)
        for src, d in prepared:
            splits = d.meta["splits"]
            _log(f"data: {d.path} | {d.meta['tokenizer']} tokenizer, vocabulary {d.tokenizer.vocab_size} | "
                 f"{splits['train']['num_tokens']:,} train / {splits['val']['num_tokens']:,} validation tokens, "
                 f"{d.meta['num_documents']:,} documents"
                 + (f" | source {src.name}, weight {src.weight / total:.3g}" if len(prepared) > 1 else ""))

    def open_loaders(self, prepared) -> None:
        """The training stream (by the weight schedule: a resume with new weights adds to it) and the evaluation's
        fixed batches of each source."""
        cfg = self.cfg
        bsh = self.source.batch_sharding(self.mesh)
        seq, bsz = cfg.model.seq_len, cfg.train.batch_size
        self.schedule = weight_schedule(self.sources, self.start.meta, self.resumed)
        if len(self.schedule) > 1 and self.schedule[-1][0] == self.resumed:
            before, after = self.schedule[-2][1], self.schedule[-1][1]
            _log(f"data: the mixture's weights change at step {self.resumed}: " + ", ".join(
                f"{name} {before.get(name, 0):g} -> {w:g}" for name, w in after.items()))
        self.train_data = BatchLoader([d.tokens("train") for _, d in prepared], seq, bsz, bsh, seed=cfg.seed,
                                      shuffle=True, names=[src.name for src, _ in prepared],
                                      schedule=self.window_schedule())
        self.evaluation = Evaluation([(src, self.validation_loader(src, d, len(prepared) > 1))
                                      for src, d in prepared], cfg.train.eval_batches)
        self.batches = self.train_data.iterator()

    def validation_loader(self, src, data: PreparedData, mixture: bool) -> BatchLoader:
        """A source's fixed validation batches: of train.batch_size windows, or fewer for a small split (said)."""
        cfg = self.cfg
        seq, bsz = cfg.model.seq_len, cfg.train.batch_size
        name = f"{src.name} source's validation split" if mixture else "validation split"
        tokens = data.tokens("val")
        windows = len(TokenWindows(tokens, seq))
        size = eval_batch_size(bsz, batch_unit(cfg, self.mesh), windows, name)
        if size < bsz:
            _log(f"note: the {name} holds {windows} windows of {seq + 1} tokens, fewer than train.batch_size={bsz}; "
                 f"evaluating on batches of {size}")
        return BatchLoader(tokens, seq, size, self.source.batch_sharding(self.mesh), seed=cfg.seed, shuffle=False,
                           name=name)

    def initial_state(self) -> None:
        cfg, mesh = self.cfg, self.mesh
        if self.start.resume_step is None and cfg.init.from_:  # a new run from a Hugging Face checkpoint
            _, params = import_params(cfg.init.from_, cfg, mesh, self.tokenizer.vocab_size, log=_log)
            self.ts = train_state_with(cfg, mesh, self.tokenizer.vocab_size, params)
            return
        if self.start.resume_step is None:
            self.ts = create_train_state(cfg, mesh, self.tokenizer.vocab_size)
            return
        t0 = time.perf_counter()
        self.ts, position = restore_state(self.run_dir, self.resumed, cfg, mesh, self.tokenizer.vocab_size)
        self.batches.seek(position)
        saved = self.start.meta
        _log(f"restored step {self.resumed} onto mesh {describe_mesh(mesh)} in {time.perf_counter() - t0:.1f}s "
             f"(saved on {' x '.join(f'{k}={v}' for k, v in saved['mesh'].items())}"
             f"{', by ' + str(saved['processes']) + ' processes' if saved.get('processes', 1) > 1 else ''}); "
             f"data continues at batch {position}")

    def describe(self, explain: bool) -> None:
        cfg = self.cfg
        ex = self.source.explain(self.ts.state, self.mesh)
        if explain:
            _log(format_explanation(ex))
        _log(f"model: {describe(cfg)} | {ex.param_count:,} parameters | per device: params "
             f"{fmt_bytes(ex.max_param_bytes)}, optimizer {fmt_bytes(ex.max_opt_bytes)}")
        for line in recipe_lines(cfg, self.source.documents(self.mesh)):
            _log(line)
        for note in split_notes(cfg, self.mesh):
            _log(note)
        for note in ex.notes:  # a plan's (a model from a py: file)
            _log(f"note: {note}")
        warmup = effective_warmup(cfg)
        if warmup != cfg.train.warmup_steps:
            _log(f"note: train.warmup_steps={cfg.train.warmup_steps} would leave no decay in {cfg.train.steps} "
                 f"steps; warming up over {warmup} steps instead")
        self.explanation = ex

    def compile(self) -> None:
        cfg, ts, mesh = self.cfg, self.ts, self.mesh
        t0 = time.perf_counter()
        self.first = next(self.batches)
        self.step_fn = train_step_for(cfg, ts, mesh, separator=self.tokenizer.eot_id).lower(
            ts.state, self.first).compile()
        eval_step = eval_step_for(cfg, ts, mesh, self.tokenizer.token_bytes(), separator=self.tokenizer.eot_id)
        compiled = {size: eval_step.lower(ts.state, jax.ShapeDtypeStruct((size, *self.first.shape[1:]),
                                                                          self.first.dtype,
                                                                          sharding=self.first.sharding)).compile()
                    for size in self.evaluation.batch_sizes}
        self.eval_fn = lambda state, batch: compiled[batch.shape[0]](state, batch)
        self.compile_s = time.perf_counter() - t0
        self.peak, self.peak_label = device_peak(list(mesh.devices.flat), peak_dtype(cfg.model))
        self.flops_per_token = self.source.flops_per_token(self.vocab[0], mesh.shape["tensor"])
        _log(f"compiled in {self.compile_s:.1f}s | {self.flops_per_token / 1e6:.1f} MFLOP/token "
             f"({self.source.flops_convention}) | "
             f"peak {self.peak / 1e12:.3f} TFLOP/s per device ({self.peak_label})")
        self.evaluation.load()

    # --- from here on the run directory is written ------------------------------------------------------------
    def claim_run_dir(self) -> None:
        if self.primary:
            claim(self.run_dir, self.start)
            (self.run_dir / CONFIG_FILE).write_text(self.cfg.to_yaml())
            self.tokenizer.save(self.run_dir)
        distributed.barrier("run-dir-claimed")  # no process opens the checkpoints before process 0 cleared them
        self.ckpts = RunCheckpoints(self.run_dir, keep=self.cfg.checkpoint.keep, also_keep=(self.cfg.train.steps,))
        self.meta = checkpoint_meta(self.cfg, self.mesh, self.data, self.vocab, self.stream, self.schedule)

    def evaluate(self, state, step: int) -> dict:
        """The eval numbers over the fixed validation batches (`evaluation`), and a mixture's epochs per source."""
        row = self.evaluation.run(self.eval_fn, state)
        if self.evaluation.mixture:
            row.update(epochs_seen(self.sources, self.train_data.windows_per_source_epoch,
                                   step * self.cfg.train.batch_size, self.window_schedule()))
        return row

    def window_schedule(self) -> list[tuple[int, list[float]]]:
        """The weight schedule by window of the stream: [(first window, each source's weight, in order)]."""
        bsz = self.cfg.train.batch_size
        return [(step * bsz, [weights.get(s.name, 0.0) for s in self.sources]) for step, weights in self.schedule]

    def save(self, step: int, reason: str) -> None:
        t = time.perf_counter()
        meta = {**self.meta, "step": step, "reason": reason, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        stored.save_state(self.ckpts, step, self.state, self.batches.position, meta, self.source.stacks_blocks,
                          self.source.stack_repeats)
        self.newest = step  # (written in the background: a run that stops waits for it, `loop`)
        _log(f"checkpoint step {step}: writing in the background (training blocked {time.perf_counter() - t:.2f}s)")

    def open_metrics(self) -> None:
        """The metrics log (process 0 writes it) and the untrained baseline: step 0's evaluation."""
        self.logger = MetricsLogger(self.run_dir, resume_step=self.start.resume_step, write=self.primary)
        self.state = self.ts.state
        if self.start.resume_step is None:
            self.first_eval = self.evaluate(self.state, 0)
            self.logger.log({"step": 0, **self.first_eval})
            _log(f"step 0 | eval loss {self.first_eval['eval_loss']:.4f} | {self.first_eval['eval_bpb']:.3f} "
                 f"bits/byte{per_source(self.first_eval)}")
        else:
            base = next((r for r in self.logger.rows if r.get("step") == 0 and "eval_loss" in r), {})
            self.first_eval = {k: base.get(k, math.nan) for k in ("eval_loss", "eval_bpb")}

    def loop(self, stop: StopOnSignal) -> str | None:
        """Train from the step after `resumed` to `train.steps`; the name of the signal that stopped it early."""
        cfg, steps = self.cfg, self.cfg.train.steps
        bsz, seq, n_dev = cfg.train.batch_size, cfg.model.seq_len, self.mesh.devices.size
        bar = tqdm(total=steps, initial=self.resumed, disable=not self.progress, unit="step", dynamic_ncols=True)
        self.last_eval, self.last_row = self.first_eval, {}
        self.skipped = int(jax.device_get(skipped_updates(self.state)))  # the spike guard's count, when resumed
        t_mark, steps_since, stopped, every = time.perf_counter(), 0, None, cfg.checkpoint.every
        try:
            for step in range(self.resumed + 1, steps + 1):
                batch = self.first if step == self.resumed + 1 else next(self.batches)
                self.state, metrics = self.step_fn(self.state, batch)
                steps_since += 1
                bar.update(1)
                if self.on_step is not None:
                    self.on_step(step)
                is_last = step == steps
                reason = stop.check()  # asked at every step, the last too, so that every process asks alike
                stopped = None if is_last else reason  # the last step ends the run anyway
                is_eval = step % cfg.train.eval_interval == 0 or is_last
                if step == self.resumed + 1 or step % cfg.train.log_interval == 0 or is_eval or stopped:
                    metrics = jax.device_get(metrics)  # the only host sync: once per log (or eval) interval
                    tokens_per_s = steps_since * bsz * seq / (time.perf_counter() - t_mark)
                    self.log_step(step, metrics, tokens_per_s, n_dev, is_eval, bar)
                    t_mark, steps_since = time.perf_counter(), 0
                if is_last or stopped or (every and step % every == 0):
                    self.check_skips(step, metrics)  # never a checkpoint of a run the guard has halted
                    self.save(step, "end" if is_last else stopped or "interval")
                if stopped:
                    _log(f"{stopped}: stopping after step {step}; finishing the checkpoint (press Ctrl-C again "
                         "to abort without it)")
                    self.stopped_at = step
                    break
        except KeyboardInterrupt:  # a second signal: leave at once; a write in flight stays incomplete, ignored
            bar.close()
            self.logger.close()
            raise
        except BaseException:
            bar.close()
            self.logger.close()
            try:
                self.ckpts.close()  # let the checkpoints already started complete
            except ShardlmError as e:
                _log(f"also: {e}")
            raise
        bar.close()
        self.logger.close()
        self.ckpts.close()  # waits for the background writes: from here on every checkpoint is complete on disk
        self.ts.state = self.state
        return stopped

    def log_step(self, step: int, metrics: dict, tokens_per_s: float, n_dev: int, is_eval: bool, bar) -> None:
        flops_per_dev = self.flops_per_token * tokens_per_s / n_dev
        row = {"step": step, "loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
               "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tokens_per_s,
               "tflops_per_device": flops_per_dev / 1e12, "mfu": flops_per_dev / self.peak}
        # the objective; a mixture of experts', multi-token prediction's, the z-loss's (`step.model_metrics`)
        for key in ("objective", "aux_loss", "expert_load_max", "expert_load_min", "moe_dropped", "moe_overflow",
                    "mtp_loss", "z_loss", "log_z_squared"):
            if key in metrics:
                row[key] = float(metrics[key])
        if "skipped" in metrics:
            row["skipped"] = int(metrics["skipped"])
            if row["skipped"] > self.skipped:
                _log(f"step {step}: {row['skipped'] - self.skipped} update(s) skipped since the last log (loss or "
                     f"gradient norm not finite, or beyond train.spike_sigmas={self.cfg.train.spike_sigmas} standard "
                     f"deviations of the last updates'); {row['skipped']} in all")
            self.skipped = row["skipped"]
        elif not np.isfinite(row["loss"]):
            raise ShardlmError(f"loss became {row['loss']} at step {step}; lower train.lr or raise warmup_steps")
        if is_eval:  # after the step's time was read: eval time is not step time. Also when stopping on an eval
            self.last_eval = self.evaluate(self.state, step)  # step, so that the resumed run's metrics miss nothing
            row.update(self.last_eval)
        self.logger.log(row)
        self.last_row = row
        self.check_skips(step, metrics)
        if not self.progress:
            m = self.cfg.model
            _log(f"step {step} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | grad norm {row['grad_norm']:.3f} | "
                 f"{tokens_per_s:,.0f} tok/s | MFU {row['mfu']:.1%}"
                 + (f" | aux {row['aux_loss']:.3f} unweighted (x{m.moe_aux_loss_weight:g}), expert load "
                    f"{row['expert_load_min']:.2f}-{row['expert_load_max']:.2f}x" if "aux_loss" in row else "")
                 + (f", {row['moe_dropped']:.1%} dropped" if row.get("moe_dropped") else "")
                 + (f", {row['moe_overflow']:.1%} in later rounds" if row.get("moe_overflow") else "")
                 + (f" | MTP loss {row['mtp_loss']:.4f} unweighted (x{m.mtp_loss_weight:g})" if "mtp_loss" in row
                    else "")
                 + (f" | z-loss {row['z_loss']:.4f} ({self.cfg.train.z_loss:g} x log^2 Z {row['log_z_squared']:.1f})"
                    if "z_loss" in row else "")
                 + (f" | eval loss {row['eval_loss']:.4f}, {row['eval_bpb']:.3f} bpb{per_source(row)}"
                    if "eval_loss" in row else ""))
        bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}", mfu=f"{row['mfu']:.1%}")

    def check_skips(self, step: int, metrics: dict) -> None:
        """Stop the run, in one line, once the spike guard has skipped `train.max_skips` updates in a row
        (`shardlm.train.spikes`): it then skips every update, and no checkpoint is written of it."""
        if "skip_halted" in metrics and bool(jax.device_get(metrics["skip_halted"])):
            raise spikes_halted(self.cfg, step, self.run_dir, self.newest)

    def write_samples(self) -> None:
        """Two unconditional samples (the prompt is the document separator) in samples.txt, the first logged. A
        model from a py: file that cannot be run for generation gets a note saying why instead."""
        cfg = self.cfg
        graphdef, state = nnx.split(nnx.merge(self.ts.graphdef, self.ts.state)["model"])
        gen = self.source.generator(graphdef, state, self.mesh, eot_id=self.tokenizer.eot_id, vocab_size=self.vocab[0])
        try:
            samples = sample_text(gen, self.tokenizer, EOT, n_samples=2, max_new=cfg.train.sample_tokens,
                                  seed=cfg.seed)
        except Exception as e:  # noqa: BLE001 - only for the user's model, whose forward is the user's code
            if self.source.can_cache:
                raise
            _log(f"note: no samples: {cfg.model.preset} could not be run to generate ({type(e).__name__}: "
                 f"{(str(e).splitlines() or [''])[0][:200]}); shardlm generates by running the model on "
                 f"[batch, {cfg.model.seq_len}] tokens and reading each row's logits at its position")
            return
        if self.primary:
            (self.run_dir / "samples.txt").write_text("\n\n-----\n\n".join(samples) + "\n")
        _log("sample:\n" + samples[0].strip())

    def finish(self, stopped: str | None, stop: StopOnSignal, t_start: float) -> dict:
        cfg, run_dir, steps = self.cfg, self.run_dir, self.cfg.train.steps
        if stopped:
            step = self.stopped_at
            _log(f"stopped by {stopped} at step {step}: checkpoint saved in {checkpoint_dir(run_dir) / str(step)}; "
                 f"resume with: shardlm train --run-dir {run_dir}")
            return {"steps": step, "finished": False, "stopped_by": stopped, "resumed_from": self.resumed,
                    "final_loss": self.last_row.get("loss"), "wall_s": time.perf_counter() - t_start}
        first_eval, first_bpb = self.first_eval["eval_loss"], self.first_eval["eval_bpb"]
        last_eval, last_bpb = self.last_eval["eval_loss"], self.last_eval["eval_bpb"]
        row, ex = self.last_row, self.explanation
        _log(f"step {steps} | loss {row['loss']:.4f} | eval loss {last_eval:.4f} (first {first_eval:.4f}, "
             f"ratio {last_eval / first_eval:.3f}) | {last_bpb:.3f} bits/byte{per_source(self.last_eval)}")
        summary = {
            "steps": steps, "finished": True, "resumed_from": self.resumed, "trained_now": steps - self.resumed,
            "first_eval_loss": first_eval, "final_eval_loss": last_eval,
            "first_eval_bpb": first_bpb, "final_eval_bpb": last_bpb, "data": self.data_paths,
            **({"data_schedule": self.schedule} if len(self.sources) > 1 else {}),
            "tokenizer": self.data.meta["tokenizer"],
            "final_loss": row["loss"], "tokens_per_s": row["tokens_per_s"],
            "tflops_per_device": row["tflops_per_device"], "mfu": row["mfu"],
            "mfu_convention": self.source.flops_convention,
            "peak_flops_per_device": self.peak, "peak_source": self.peak_label, "compile_s": self.compile_s,
            "wall_s": time.perf_counter() - t_start, "mesh": dict(self.mesh.shape), "processes": jax.process_count(),
            "param_count": ex.param_count, "param_bytes_per_device": ex.max_param_bytes,
            "optimizer_bytes_per_device": ex.max_opt_bytes,
        }
        if self.primary:
            (run_dir / FINISHED_MARKER).write_text(json.dumps(summary, indent=2) + "\n")  # the run is complete
        # A signal during the last step or since: in a multi-process run, whether any process got one is agreed at
        # one more sync point, since sampling is a collective that all take part in or none.
        late = stop.check()
        if late:
            _log(f"{late} received at the end of the run: finished, without samples")
        elif cfg.train.sample_tokens:
            self.write_samples()
        written = [n for n in ("config.yaml", "metrics.jsonl", "tensorboard/", "loss.png", "samples.txt",
                               FINISHED_MARKER, "tokenizer.json", "checkpoints/") if (run_dir / n.rstrip("/")).exists()]
        _log(f"done in {time.perf_counter() - t_start:.0f}s: {run_dir}/ holds {', '.join(written)}")
        return summary
