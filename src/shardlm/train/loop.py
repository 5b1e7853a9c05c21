"""The training loop: config -> mesh -> data -> sharded state -> compiled step -> metrics, samples.

Design choices:
- Everything is built and checked before the first compile: a mesh that does not fit the devices, a degree that
  does not divide a parameter or the batch, or a run directory that already holds a run fails in under a second,
  before the data (which may need minutes of tokenizing on first use) is prepared.
- The train step is compiled ahead of time (`lower().compile()`), so the compile time is reported on its own and
  step 1's tokens/s is a real step's.
- The host syncs with the devices only when it logs: step 1, every `train.log_interval` and every
  `train.eval_interval` steps, and the last.
- Eval loss and bits per byte are measured at step 0 (the untrained baseline), every `train.eval_interval` steps
  and at the end, on the same fixed batches of the validation split each time.
"""

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from shardlm.config import Config
from shardlm.data.loader import BatchLoader
from shardlm.data.prepare import PreparedData, training_data
from shardlm.data.tokenizer import EOT
from shardlm.errors import ShardlmError
from shardlm.sharding.explain import explain_state, fmt_bytes, format_explanation
from shardlm.generate import sample_text
from shardlm.mesh import describe_mesh, mesh_from_config
from shardlm.perf.flops import device_peak, flops_per_token
from shardlm.sharding import batch_sharding
from shardlm.train.metrics import MetricsLogger
from shardlm.train.state import check_shardable, create_train_state, effective_warmup, make_schedule, vocab_sizes
from shardlm.train.step import make_eval_step, make_train_step

FINISHED_MARKER = "summary.json"


def default_run_dir(cfg: Config) -> Path:
    name = cfg.name or f"{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path("runs") / name


def check_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse to mix a new run into an existing one (writes nothing)."""
    for parent in (run_dir, *run_dir.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ShardlmError(f"--run-dir {run_dir}: {parent} is a file; pass a directory path")
            if not os.access(parent, os.W_OK):
                raise ShardlmError(f"--run-dir {run_dir}: {parent} is not writable; pass a directory you can write")
            break
    if (run_dir / "config.yaml").exists() and not overwrite:
        state = "a finished run" if (run_dir / FINISHED_MARKER).exists() else "an unfinished run"
        raise ShardlmError(
            f"--run-dir {run_dir} already holds {state}; pass another --run-dir, or --overwrite to replace it"
        )


def claim_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Create the run directory; with `overwrite`, remove only the files a previous shardlm run wrote there."""
    check_run_dir(run_dir, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for name in ("config.yaml", "metrics.jsonl", "loss.png", "samples.txt", "tokenizer.json", FINISHED_MARKER):
            (run_dir / name).unlink(missing_ok=True)
        tb = run_dir / "tensorboard"
        if tb.is_dir():
            for f in tb.glob("events.out.tfevents.*"):
                f.unlink()


def check_batch(cfg: Config, mesh) -> None:
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.train.batch_size % dp:
        raise ShardlmError(
            f"train.batch_size={cfg.train.batch_size} is split over data x fsdp = {dp} devices, which does not "
            f"divide it; use a multiple of {dp}"
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


def _log(msg: str) -> None:
    tqdm.write(msg)


def train(cfg: Config, run_dir: str | Path | None = None, *, overwrite: bool = False, progress: bool = True,
          explain: bool = False, devices=None) -> dict:
    """Run the configured job; returns the summary also written to `<run_dir>/summary.json`."""
    t_start = time.perf_counter()
    mesh = mesh_from_config(cfg.mesh, devices)
    check_batch(cfg, mesh)
    check_shardable(cfg, mesh)  # before the data, which may take minutes to prepare
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    check_run_dir(run_dir, overwrite)
    _log(f"shardlm: run {run_dir} | mesh {describe_mesh(mesh)} on {mesh.devices.size} {jax.devices()[0].platform} "
         f"device(s)")

    # Everything that can reject the input runs before the run directory is written.
    data = load_data(cfg, progress)
    tokenizer, splits = data.tokenizer, data.meta["splits"]
    _log(f"data: {data.path} | {data.meta['tokenizer']} tokenizer, vocabulary {tokenizer.vocab_size} | "
         f"{splits['train']['num_tokens']:,} train / {splits['val']['num_tokens']:,} validation tokens, "
         f"{data.meta['num_documents']:,} documents")

    bsh = batch_sharding(mesh)
    seq, bsz = cfg.model.seq_len, cfg.train.batch_size
    train_data = BatchLoader(data.tokens("train"), seq, bsz, bsh, seed=cfg.seed, shuffle=True)
    eval_data = BatchLoader(data.tokens("val"), seq, bsz, bsh, seed=cfg.seed, shuffle=False, name="validation",
                            hint="use more validation text (data.val_fraction, or --val when preparing)")

    ts = create_train_state(cfg, mesh, tokenizer.vocab_size)
    ex = explain_state(ts.state, mesh)
    if explain:
        _log(format_explanation(ex))
    padded_vocab = vocab_sizes(cfg, tokenizer.vocab_size, mesh.shape["tensor"])[1]
    _log(f"model: {cfg.model.preset} | {ex.param_count:,} parameters | per device: params "
         f"{fmt_bytes(ex.max_param_bytes)}, optimizer {fmt_bytes(ex.max_opt_bytes)}")
    warmup = effective_warmup(cfg)
    if warmup != cfg.train.warmup_steps:
        _log(f"note: train.warmup_steps={cfg.train.warmup_steps} would leave no decay in {cfg.train.steps} steps; "
             f"warming up over {warmup} steps instead")
    schedule = make_schedule(cfg)
    claim_run_dir(run_dir, overwrite)
    # `auto` resolved (gpt2, bytes or bpe = the run's tokenizer.json), so the run names its tokenizer; an explicit
    # choice (bpe:PATH) stays as given, so that replaying config.yaml prepares the same data.
    if cfg.data.tokenizer == "auto":
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=data.meta["tokenizer"]))
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    tokenizer.save(run_dir)

    t0 = time.perf_counter()
    batches = train_data.iterator()
    first = next(batches)
    step_fn = make_train_step(ts, mesh, bsh, schedule, cfg.seed, cfg.model.dropout > 0)
    step_fn = step_fn.lower(ts.state, first).compile()
    eval_fn = make_eval_step(ts, mesh, bsh, tokenizer.token_bytes()).lower(ts.state, first).compile()
    compile_s = time.perf_counter() - t0

    n_dev = mesh.devices.size
    peak, peak_label = device_peak(list(mesh.devices.flat))
    fpt = flops_per_token(cfg.model, padded_vocab)
    _log(f"compiled in {compile_s:.1f}s | {fpt / 1e6:.1f} MFLOP/token (6N + 12LTd) | peak "
         f"{peak / 1e12:.3f} TFLOP/s per device ({peak_label})")

    eval_batches = [eval_data.get(i) for i in range(min(cfg.train.eval_batches, eval_data.windows_per_epoch // bsz))]

    def evaluate(state) -> tuple[float, float]:
        """(mean loss, bits per byte) over the fixed validation batches."""
        out = jax.device_get([eval_fn(state, b) for b in eval_batches])
        nats, nbytes = sum(float(o["nats"]) for o in out), sum(float(o["bytes"]) for o in out)
        return float(np.mean([o["loss"] for o in out])), nats / (math.log(2) * max(nbytes, 1.0))

    logger = MetricsLogger(run_dir)
    state = ts.state
    steps = cfg.train.steps
    first_eval, first_bpb = evaluate(state)
    logger.log({"step": 0, "eval_loss": first_eval, "eval_bpb": first_bpb})
    _log(f"step 0 | eval loss {first_eval:.4f} | {first_bpb:.3f} bits/byte")

    bar = tqdm(total=steps, disable=not progress, unit="step", dynamic_ncols=True)
    last_eval, last_bpb, last_row = first_eval, first_bpb, {}
    t_mark, steps_since = time.perf_counter(), 0
    for step in range(1, steps + 1):
        batch = first if step == 1 else next(batches)
        state, metrics = step_fn(state, batch)
        steps_since += 1
        bar.update(1)
        is_last = step == steps
        is_eval = step % cfg.train.eval_interval == 0 or is_last
        if step == 1 or step % cfg.train.log_interval == 0 or is_eval:
            metrics = jax.device_get(metrics)  # the only host sync: once per log (or eval) interval
            elapsed = time.perf_counter() - t_mark
            tokens_per_s = steps_since * bsz * seq / elapsed
            flops_per_dev = fpt * tokens_per_s / n_dev
            row = {"step": step, "loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
                   "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tokens_per_s,
                   "tflops_per_device": flops_per_dev / 1e12, "mfu": flops_per_dev / peak}
            if not np.isfinite(row["loss"]):
                logger.close()
                raise ShardlmError(f"loss became {row['loss']} at step {step}; lower train.lr or raise warmup_steps")
            if is_eval:  # after `elapsed` was read, and the timer restarts below: eval time is not step time
                last_eval, last_bpb = evaluate(state)
                row["eval_loss"], row["eval_bpb"] = last_eval, last_bpb
            logger.log(row)
            last_row = row
            if not progress:
                _log(f"step {step} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | grad norm {row['grad_norm']:.3f} | "
                     f"{tokens_per_s:,.0f} tok/s | MFU {row['mfu']:.1%}"
                     + (f" | eval loss {row['eval_loss']:.4f}, {row['eval_bpb']:.3f} bpb" if "eval_loss" in row else ""))
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}", mfu=f"{row['mfu']:.1%}")
            t_mark, steps_since = time.perf_counter(), 0
    bar.close()
    logger.close()
    ts.state = state
    _log(f"step {steps} | loss {last_row['loss']:.4f} | eval loss {last_eval:.4f} (first {first_eval:.4f}, "
         f"ratio {last_eval / first_eval:.3f}) | {last_bpb:.3f} bits/byte")

    if cfg.train.sample_tokens:  # unconditional samples: the prompt is the document separator
        samples = sample_text(ts, mesh, tokenizer, EOT, n_samples=2, max_new=cfg.train.sample_tokens,
                              seq_len=seq, seed=cfg.seed)
        (run_dir / "samples.txt").write_text("\n\n-----\n\n".join(samples) + "\n")
        _log("sample:\n" + samples[0].strip())

    summary = {
        "steps": steps, "first_eval_loss": first_eval, "final_eval_loss": last_eval,
        "first_eval_bpb": first_bpb, "final_eval_bpb": last_bpb, "data": str(data.path),
        "tokenizer": data.meta["tokenizer"],
        "final_loss": last_row["loss"], "tokens_per_s": last_row["tokens_per_s"],
        "tflops_per_device": last_row["tflops_per_device"], "mfu": last_row["mfu"],
        "mfu_convention": "6*N_matmul + 12*L*T*d FLOPs per token (attention not halved for causality)",
        "peak_flops_per_device": peak, "peak_source": peak_label, "compile_s": compile_s,
        "wall_s": time.perf_counter() - t_start, "mesh": dict(mesh.shape), "param_count": ex.param_count,
        "param_bytes_per_device": ex.max_param_bytes, "optimizer_bytes_per_device": ex.max_opt_bytes,
    }
    (run_dir / FINISHED_MARKER).write_text(json.dumps(summary, indent=2) + "\n")
    _log(f"done in {summary['wall_s']:.0f}s: {run_dir}/ holds config.yaml, metrics.jsonl, tensorboard/, loss.png, "
         "samples.txt")
    return summary
