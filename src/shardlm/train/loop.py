"""The training loop: config -> mesh -> data -> sharded state -> compiled step -> metrics, checkpoints, samples.

Design choices:
- Everything is built and checked before the first compile: a mesh that does not fit the devices, a degree that
  does not divide a parameter or the batch, a resume that would change the model, or an unreadable checkpoint
  fails in seconds, before the run directory is touched.
- A run directory that already holds a run is resumed from its newest checkpoint (see `rundir`), with the
  optimizer state, the step and the data iterator's position, so the continued run is the uninterrupted one.
- The train step is compiled ahead of time (`lower().compile()`), so the compile time is reported on its own and
  the first logged tokens/s is a real step's.
- The host syncs with the devices only when it logs: the first step, every `train.log_interval` and every
  `train.eval_interval` steps, and the last. Checkpoints are saved every `checkpoint.every` steps and at the end,
  in the background (see `checkpoint`).
- SIGTERM or Ctrl-C ends the run after the current step with a checkpoint (see `preemption`).
- Eval loss and bits per byte are measured at step 0 (the untrained baseline), every `train.eval_interval` steps
  and at the end, on the same fixed batches of the validation split each time.
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

from shardlm.config import Config, describe
from shardlm.data.loader import BatchLoader
from shardlm.data.prepare import PreparedData, training_data
from shardlm.data.tokenizer import EOT
from shardlm.errors import ShardlmError
from shardlm.generate import sample_text
from shardlm.mesh import describe_mesh, mesh_from_config
from shardlm.perf.flops import device_peak, flops_per_token
from shardlm.sharding import batch_sharding
from shardlm.sharding.explain import explain_state, fmt_bytes, format_explanation
from shardlm.train.checkpoint import CheckpointError, RunCheckpoints, checkpoint_dir
from shardlm.train.metrics import MetricsLogger
from shardlm.train.preemption import StopOnSignal
from shardlm.train.rundir import (CONFIG_FILE, FINISHED_MARKER, RunStart, check_vocab_padding, claim,
                                  default_run_dir, plan_start, unreadable)
from shardlm.train.state import (TrainState, abstract_train_state, check_shardable, create_train_state,
                                 effective_warmup, vocab_sizes)
from shardlm.train.step import make_eval_step, train_step_for


def check_batch(cfg: Config, mesh) -> None:
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.train.batch_size % dp:
        raise ShardlmError(
            f"train.batch_size={cfg.train.batch_size} is split over data x fsdp = {dp} devices, which does not "
            f"divide it; use a multiple of {dp}"
        )
    k = cfg.train.grad_accum
    if (cfg.train.batch_size // k) % dp:
        raise ShardlmError(
            f"train.grad_accum={k} microbatches of {cfg.train.batch_size // k} sequences do not split over data x "
            f"fsdp = {dp} devices; use a train.batch_size that is a multiple of {k * dp}, or a smaller grad_accum"
        )
    if cfg.train.batch_size % jax.process_count():
        raise ShardlmError(f"train.batch_size must be a multiple of the {jax.process_count()} processes")


def load_data(cfg: Config, progress: bool = False, log=None) -> PreparedData:
    """The prepared data (preparing text into the cache first if needed), checked against model.vocab_size."""
    data = training_data(cfg.data, progress=progress, log=log or _log)
    vocab = data.tokenizer.vocab_size
    if cfg.model.vocab_size and cfg.model.vocab_size < vocab:
        raise ShardlmError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab}; "
            "set model.vocab_size=0 to use the tokenizer's"
        )
    return data


def tokenizer_vocab(cfg: Config, log=None) -> int:
    """The vocabulary the model is built for: `model.vocab_size`, else the data's tokenizer's (preparing the data
    first if it is text that was never prepared)."""
    return cfg.model.vocab_size or load_data(cfg, log=log).tokenizer.vocab_size


def _log(msg: str) -> None:
    tqdm.write(msg)


def checkpoint_meta(cfg: Config, mesh, data: PreparedData, vocab: tuple[int, int]) -> dict:
    """What every checkpoint records besides the arrays (the step is added per save)."""
    import orbax.checkpoint

    import shardlm

    return {
        "config": cfg.to_dict(),
        "mesh": dict(mesh.shape),
        "vocab": {"real": vocab[0], "padded": vocab[1]},
        "data": {"path": str(data.path), "train_sha256": data.meta["splits"]["train"]["sha256"]},
        # Dropout keys are a pure function of the seed and the optimizer's step (see `step`): the step restored
        # with the optimizer state and this seed give the identical stream.
        "rng": {"seed": cfg.seed, "dropout_key": "fold_in(key(seed), optimizer step)",
                "prng_impl": str(jax.config.jax_default_prng_impl)},
        "versions": {"shardlm": shardlm.__version__, "jax": jax.__version__, "orbax": orbax.checkpoint.__version__},
    }


def check_same_run(meta: dict, mesh, data: PreparedData, vocab: tuple[int, int], run_dir: Path) -> None:
    """The checks of a resume that need the data: the same training tokens, vocabulary and RNG."""
    if meta["data"]["train_sha256"] != data.meta["splits"]["train"]["sha256"]:
        raise ShardlmError(f"the training data ({data.path}) differs from the data the run in {run_dir} trained on "
                           f"({meta['data']['path']}); resume on the same data, or pass another --run-dir")
    if meta["vocab"]["real"] != vocab[0]:
        raise ShardlmError(f"the tokenizer's vocabulary ({vocab[0]}) differs from the run's ({meta['vocab']['real']});"
                           " resume with the run's tokenizer, or pass another --run-dir")
    check_vocab_padding(meta, vocab[1], mesh.shape["tensor"], "resume")
    if meta["rng"]["prng_impl"] != str(jax.config.jax_default_prng_impl):
        raise ShardlmError(f"the run used the {meta['rng']['prng_impl']} PRNG, this process uses "
                           f"{jax.config.jax_default_prng_impl}; set jax_default_prng_impl to the run's")


def restore_state(run_dir: Path, step: int, cfg: Config, mesh, vocab_size: int, iterator) -> TrainState:
    """The checkpoint at `step`, read straight into this mesh's shardings, and the iterator moved to its position.
    If it cannot be read, the error names the newest older checkpoint that can."""
    _, graphdef, abstract, shardings = abstract_train_state(cfg, mesh, vocab_size)
    reader = RunCheckpoints(run_dir, read_only=True)
    try:
        state = reader.restore(step, abstract, iterator=iterator)
    except CheckpointError as e:
        older = [s for s in reader.steps() if s < step]
        raise unreadable(run_dir, e, older, reader,
                         check=lambda s: (reader.read_meta(s), reader.restore(s, abstract))) from None
    finally:
        reader.close()
    return TrainState(graphdef, state, shardings)


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
    mesh = mesh_from_config(cfg.mesh, devices)
    check_batch(cfg, mesh)
    check_shardable(cfg, mesh)  # before the data, which may take minutes to prepare
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    start = plan_start(run_dir, cfg, overwrite, _log)
    if start.finished:
        return _finished(run_dir, start)
    _log(f"shardlm: run {run_dir} | mesh {describe_mesh(mesh)} on {mesh.devices.size} {jax.devices()[0].platform} "
         f"device(s)")

    # Everything that can reject the input runs before the run directory is written.
    data = load_data(cfg, progress)
    tokenizer, splits = data.tokenizer, data.meta["splits"]
    _log(f"data: {data.path} | {data.meta['tokenizer']} tokenizer, vocabulary {tokenizer.vocab_size} | "
         f"{splits['train']['num_tokens']:,} train / {splits['val']['num_tokens']:,} validation tokens, "
         f"{data.meta['num_documents']:,} documents")
    # `auto` resolved (gpt2, bytes or bpe = the run's tokenizer.json), so the run names its tokenizer; an explicit
    # choice (bpe:PATH) stays as given, so that replaying config.yaml prepares the same data.
    if cfg.data.tokenizer == "auto":
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=data.meta["tokenizer"]))
    vocab = vocab_sizes(cfg, tokenizer.vocab_size, mesh.shape["tensor"])
    if start.meta is not None:
        check_same_run(start.meta, mesh, data, vocab, run_dir)

    bsh = batch_sharding(mesh)
    seq, bsz = cfg.model.seq_len, cfg.train.batch_size
    train_data = BatchLoader(data.tokens("train"), seq, bsz, bsh, seed=cfg.seed, shuffle=True)
    eval_data = BatchLoader(data.tokens("val"), seq, bsz, bsh, seed=cfg.seed, shuffle=False, name="validation",
                            hint="use more validation text (data.val_fraction, or --val when preparing)")
    batches = train_data.iterator()

    resumed = start.resume_step or 0
    if start.resume_step is None:
        ts = create_train_state(cfg, mesh, tokenizer.vocab_size)
    else:
        t0 = time.perf_counter()
        ts = restore_state(run_dir, resumed, cfg, mesh, tokenizer.vocab_size, batches.grain_iterator)
        _log(f"restored step {resumed} onto mesh {describe_mesh(mesh)} in {time.perf_counter() - t0:.1f}s "
             f"(saved on {' x '.join(f'{k}={v}' for k, v in start.meta['mesh'].items())})")
    ex = explain_state(ts.state, mesh)
    if explain:
        _log(format_explanation(ex))
    _log(f"model: {describe(cfg)} | {ex.param_count:,} parameters | per device: params "
         f"{fmt_bytes(ex.max_param_bytes)}, optimizer {fmt_bytes(ex.max_opt_bytes)}")
    warmup = effective_warmup(cfg)
    if warmup != cfg.train.warmup_steps:
        _log(f"note: train.warmup_steps={cfg.train.warmup_steps} would leave no decay in {cfg.train.steps} steps; "
             f"warming up over {warmup} steps instead")

    claim(run_dir, start)
    (run_dir / CONFIG_FILE).write_text(cfg.to_yaml())
    tokenizer.save(run_dir)
    steps = cfg.train.steps
    ckpts = RunCheckpoints(run_dir, keep=cfg.checkpoint.keep, also_keep=(steps,))
    meta = checkpoint_meta(cfg, mesh, data, vocab)

    t0 = time.perf_counter()
    first = next(batches)
    step_fn = train_step_for(cfg, ts, mesh)
    step_fn = step_fn.lower(ts.state, first).compile()
    eval_fn = make_eval_step(ts, mesh, bsh, tokenizer.token_bytes()).lower(ts.state, first).compile()
    compile_s = time.perf_counter() - t0

    n_dev = mesh.devices.size
    peak, peak_label = device_peak(list(mesh.devices.flat), cfg.model.dtype)
    fpt = flops_per_token(cfg.model, vocab[1])
    _log(f"compiled in {compile_s:.1f}s | {fpt / 1e6:.1f} MFLOP/token (6N + 12LTd) | peak "
         f"{peak / 1e12:.3f} TFLOP/s per device ({peak_label})")

    eval_batches = [eval_data.get(i) for i in range(min(cfg.train.eval_batches, eval_data.windows_per_epoch // bsz))]

    def evaluate(state) -> tuple[float, float]:
        """(mean loss, bits per byte) over the fixed validation batches."""
        out = jax.device_get([eval_fn(state, b) for b in eval_batches])
        nats, nbytes = sum(float(o["nats"]) for o in out), sum(float(o["bytes"]) for o in out)
        return float(np.mean([o["loss"] for o in out])), nats / (math.log(2) * max(nbytes, 1.0))

    logger = MetricsLogger(run_dir, resume_step=start.resume_step)
    state = ts.state
    if start.resume_step is None:
        first_eval, first_bpb = evaluate(state)
        logger.log({"step": 0, "eval_loss": first_eval, "eval_bpb": first_bpb})
        _log(f"step 0 | eval loss {first_eval:.4f} | {first_bpb:.3f} bits/byte")
    else:
        base = next((r for r in logger.rows if r.get("step") == 0 and "eval_loss" in r), {})
        first_eval, first_bpb = base.get("eval_loss", math.nan), base.get("eval_bpb", math.nan)

    def save(step: int, reason: str) -> None:
        t = time.perf_counter()
        ckpts.save(step, state, batches.grain_iterator, {**meta, "step": step, "reason": reason,
                                                         "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        _log(f"checkpoint step {step}: writing in the background (training blocked {time.perf_counter() - t:.2f}s)")

    bar = tqdm(total=steps, initial=resumed, disable=not progress, unit="step", dynamic_ncols=True)
    last_eval, last_bpb, last_row = first_eval, first_bpb, {}
    t_mark, steps_since = time.perf_counter(), 0
    stopped = None
    every = cfg.checkpoint.every
    # Signals are handled until train() returns: after the loop, a first one lets the run finish (without samples)
    # and a second aborts.
    with StopOnSignal() as stop:
        try:
            for step in range(resumed + 1, steps + 1):
                batch = first if step == resumed + 1 else next(batches)
                state, metrics = step_fn(state, batch)
                steps_since += 1
                bar.update(1)
                if on_step is not None:
                    on_step(step)
                is_last = step == steps
                stopped = None if is_last else stop.received  # the last step ends the run anyway
                is_eval = step % cfg.train.eval_interval == 0 or is_last
                if step == resumed + 1 or step % cfg.train.log_interval == 0 or is_eval or stopped:
                    metrics = jax.device_get(metrics)  # the only host sync: once per log (or eval) interval
                    elapsed = time.perf_counter() - t_mark
                    tokens_per_s = steps_since * bsz * seq / elapsed
                    flops_per_dev = fpt * tokens_per_s / n_dev
                    row = {"step": step, "loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
                           "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tokens_per_s,
                           "tflops_per_device": flops_per_dev / 1e12, "mfu": flops_per_dev / peak}
                    if not np.isfinite(row["loss"]):
                        raise ShardlmError(f"loss became {row['loss']} at step {step}; lower train.lr or raise "
                                           "warmup_steps")
                    # After `elapsed` was read: eval time is not step time. Also when stopping on an eval step, so
                    # that the resumed run's metrics miss nothing.
                    if is_eval:
                        last_eval, last_bpb = evaluate(state)
                        row["eval_loss"], row["eval_bpb"] = last_eval, last_bpb
                    logger.log(row)
                    last_row = row
                    if not progress:
                        _log(f"step {step} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | grad norm "
                             f"{row['grad_norm']:.3f} | {tokens_per_s:,.0f} tok/s | MFU {row['mfu']:.1%}"
                             + (f" | eval loss {row['eval_loss']:.4f}, {row['eval_bpb']:.3f} bpb"
                                if "eval_loss" in row else ""))
                    bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                                    mfu=f"{row['mfu']:.1%}")
                    t_mark, steps_since = time.perf_counter(), 0
                if is_last or stopped or (every and step % every == 0):
                    save(step, "end" if is_last else stopped or "interval")
                if stopped:
                    _log(f"{stopped}: stopping after step {step}; finishing the checkpoint (press Ctrl-C again "
                         "to abort without it)")
                    break
        except KeyboardInterrupt:  # a second signal: leave at once; a write in flight stays incomplete, ignored later
            bar.close()
            logger.close()
            raise
        except BaseException:
            bar.close()
            logger.close()
            try:
                ckpts.close()  # let the checkpoints already started complete
            except ShardlmError as e:
                _log(f"also: {e}")
            raise
        bar.close()
        logger.close()
        ckpts.close()  # waits for the background writes: from here on every checkpoint is complete on disk
        ts.state = state

        if stopped:
            _log(f"stopped by {stopped} at step {step}: checkpoint saved in {checkpoint_dir(run_dir) / str(step)}; "
                 f"resume with: shardlm train --run-dir {run_dir}")
            return {"steps": step, "finished": False, "stopped_by": stopped, "resumed_from": resumed,
                    "final_loss": last_row.get("loss"), "wall_s": time.perf_counter() - t_start}

        _log(f"step {steps} | loss {last_row['loss']:.4f} | eval loss {last_eval:.4f} (first {first_eval:.4f}, "
             f"ratio {last_eval / first_eval:.3f}) | {last_bpb:.3f} bits/byte")
        summary = {
            "steps": steps, "finished": True, "resumed_from": resumed, "trained_now": steps - resumed,
            "first_eval_loss": first_eval, "final_eval_loss": last_eval,
            "first_eval_bpb": first_bpb, "final_eval_bpb": last_bpb, "data": str(data.path),
            "tokenizer": data.meta["tokenizer"],
            "final_loss": last_row["loss"], "tokens_per_s": last_row["tokens_per_s"],
            "tflops_per_device": last_row["tflops_per_device"], "mfu": last_row["mfu"],
            "mfu_convention": "6*N_matmul + 12*L*T*d FLOPs per token (attention not halved for causality)",
            "peak_flops_per_device": peak, "peak_source": peak_label, "compile_s": compile_s,
            "wall_s": time.perf_counter() - t_start, "mesh": dict(mesh.shape), "param_count": ex.param_count,
            "param_bytes_per_device": ex.max_param_bytes, "optimizer_bytes_per_device": ex.max_opt_bytes,
        }
        (run_dir / FINISHED_MARKER).write_text(json.dumps(summary, indent=2) + "\n")  # the run is complete
        if stop.received:
            _log(f"{stop.received} received at the end of the run: finished, without samples")
        elif cfg.train.sample_tokens:  # unconditional samples: the prompt is the document separator
            model_graphdef, model_state = nnx.split(nnx.merge(ts.graphdef, ts.state)["model"])
            samples = sample_text(model_graphdef, model_state, mesh, tokenizer, EOT, n_samples=2,
                                  max_new=cfg.train.sample_tokens, seed=cfg.seed)
            (run_dir / "samples.txt").write_text("\n\n-----\n\n".join(samples) + "\n")
            _log("sample:\n" + samples[0].strip())
    written = [n for n in ("config.yaml", "metrics.jsonl", "tensorboard/", "loss.png", "samples.txt", "checkpoints/")
               if (run_dir / n.rstrip("/")).exists()]
    _log(f"done in {time.perf_counter() - t_start:.0f}s: {run_dir}/ holds {', '.join(written)}")
    return summary
