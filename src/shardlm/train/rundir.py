"""A run directory's life: new, resumed from its newest checkpoint, finished, or replaced with --overwrite.

Design choices:
- Re-running `shardlm train` on a directory that holds a run continues it from its newest complete checkpoint;
  nothing is deleted. A run without any complete checkpoint (killed before its first save) starts again from
  step 0, and a run whose checkpoint has reached `train.steps` is not trained again.
- What may change on resume: the mesh (a checkpoint is read into any sharding), `train.steps` (raising it
  extends a finished run; the learning-rate schedule then decays over the new length), intervals, checkpoint
  settings, optimizer hyperparameters, and how a step computes: gradient accumulation and the model's compute
  dtype, remat policy and attention kernel (with dropout on, a new grad_accum draws new masks, as a new dropout
  rate would). What may not: the model's shape and parameter dtype, the seed, the global batch size and the
  training data (checked by its SHA-256), because the checkpoint or the batch order would no longer be the run's.
- Several processes: the decision is made once, by process 0, and shared (`decide_start`), so no two processes
  can race to different verdicts on the same directory; only process 0 writes the run's files. A run directory
  must be one directory that every host sees: process 0 leaves a file in it that every other process must find,
  before anything is written or removed.
"""

import copy
import dataclasses
import os
import re
import secrets
import shutil
import time
from pathlib import Path

from shardlm import distributed
from shardlm.config import (
    Config,
    MeshConfig,
    ModelConfig,
    config_from_dict,
    flatten,
    load_config,
    model_label,
    read_config_file,
)
from shardlm.models.config import AUTO_REMAT
from shardlm.errors import ShardlmError
from shardlm.foreign.modules import is_py
from shardlm.checkpoint import CheckpointError, RunCheckpoints, checkpoint_dir, incomplete_steps

FINISHED_MARKER = "summary.json"
CONFIG_FILE = "config.yaml"
# The files a shardlm run writes at the top of its directory (--overwrite removes these and nothing else).
RUN_FILES = (CONFIG_FILE, "metrics.jsonl", "loss.png", "samples.txt", "tokenizer.json", "tokenizer_config.json",
             FINISHED_MARKER)
# Keys that must be equal to the checkpoint's for a run to resume. Dropout and the compute settings (dtype, remat,
# the gradients' reduction dtype, the loss's chunks, attention kernel) change how the step computes, not what the
# checkpoint holds, so they may change.
CHANGEABLE_MODEL_KEYS = ("dropout", "dtype", "remat", "remat_offload", "grad_reduce_dtype", "matmul_dtype",
                         "loss_chunks", "attention", "scan_layers", "pipeline_microbatches", "pipeline_repeats",
                         "pipeline_remat", "pipeline_schedule",
                         # training coefficients, not the architecture: DeepSeek-V3 stopped moving its balancing
                         # bias for the last 500B tokens of its pretraining
                         "moe_aux_loss_weight", "moe_bias_rate", "mtp_loss_weight")
# the optimizer's state is in the checkpoint, in its shape: another optimizer (or none of the spike guard's window)
# cannot read it; the weights go on with another by export and init.from (docs/recipe.md)
OPTIMIZER_KEYS = ("train.optimizer", "train.skip_spikes", "train.spike_window")
FIXED_KEYS = tuple(f"model.{f.name}" for f in dataclasses.fields(ModelConfig)
                   if f.name not in CHANGEABLE_MODEL_KEYS) + ("seed", "train.batch_size", *OPTIMIZER_KEYS)
# Settings whose default changed: a run saved before they existed resumes with what it trained with.
EARLIER_DEFAULTS = {"train": {"skip_spikes": False}}


def default_run_dir(cfg: Config) -> Path:
    """runs/<name>, or runs/<preset>-<date>-<time> (process 0's clock, in a run of several processes)."""
    # Asked of process 0 whatever the config says, so that every process makes this call (configs are compared
    # only later, and a key-value call made by some processes only would leave the others waiting).
    name = distributed.broadcast("run-name",
                                 lambda: cfg.name or f"{model_label(cfg.model)}-{time.strftime('%Y%m%d-%H%M%S')}")
    return Path("runs") / name


def require_run(run_dir: Path, hint: str = "pass the --run-dir of a training run") -> None:
    """A one-line error unless `run_dir` holds a shardlm run, saying whether it exists at all."""
    if (run_dir / CONFIG_FILE).is_file():
        return
    if not run_dir.exists():
        raise ShardlmError(f"{run_dir} does not exist; {hint}")
    what = "a directory" if run_dir.is_dir() else "a file"
    raise ShardlmError(f"{run_dir} is {what} without a shardlm run (no {CONFIG_FILE}); {hint}")


def holds_run(run_dir: Path) -> bool:
    return (Path(run_dir) / CONFIG_FILE).exists()


def run_config(config_file: str | None, overrides: list[str], run_dir: str | None,
               overwrite: bool = False) -> tuple[Config, Path]:
    """(config, run directory) of `shardlm train [--config FILE] [--run-dir DIR] [overrides]`. Resuming, the run's
    own config is the base, so `shardlm train --run-dir DIR` alone continues it; the file and the overrides (more
    steps, a new mesh) apply on top. mesh.* overrides describe the whole new mesh (as for `generate`):
    `mesh.tensor=4` alone means tensor 4 x data for the rest. Process 0 reads the run's config for every process
    of a run (the others look into the run directory only once it is known to exist)."""
    # Without --run-dir the config names the directory; with it, the run there (if any) is read first, so that
    # overrides that only make sense on top of it (plan= for a run of a model from a py: file) are checked so.
    cfg = None if run_dir else load_config(config_file, overrides)
    run_dir = Path(run_dir) if run_dir else default_run_dir(cfg)
    base = distributed.broadcast("resume-config", lambda: read_config_file(run_dir / CONFIG_FILE)
                                 if holds_run(run_dir) and not overwrite else None)
    if base is not None:
        # mesh.* overrides describe the whole new mesh; a new plan without them brings its own (its mesh:, or the
        # preset's), as for a new run
        keys = [o.split("=", 1)[0].strip() for o in overrides]
        if any(k.startswith("mesh.") or k == "plan" for k in keys):
            base.pop("mesh", None)
        cfg = _keep_resolved(load_config(config_file, overrides, base=base, base_origin=str(run_dir / CONFIG_FILE)),
                             base)
    return cfg or load_config(config_file, overrides), run_dir


def with_earlier_defaults(saved: dict) -> dict:
    """A run's saved config (a dict) with `EARLIER_DEFAULTS` where it has none of those keys."""
    saved = {**saved}
    for section, defaults in EARLIER_DEFAULTS.items():
        saved[section] = {**defaults, **saved.get(section, {})}
    return saved


def adopt_earlier_defaults(cfg: Config, saved: dict) -> Config:
    """`cfg` (changed in place, and returned) resuming a run whose saved config has none of `EARLIER_DEFAULTS`'
    keys takes their earlier values: the run resumes as it trained (its checkpoint's optimizer state has no spike
    guard), however `cfg` was made."""
    for section, defaults in EARLIER_DEFAULTS.items():
        for key, value in defaults.items():
            if key not in saved.get(section, {}):
                setattr(getattr(cfg, section), key, value)
    return cfg


def _keep_resolved(cfg: Config, saved: dict) -> Config:
    """`cfg` with what mesh=auto and model.remat=auto chose when the run started (its saved config) in place of
    another plan: a resume keeps the choice."""
    if cfg.mesh.auto and "mesh" in saved:
        cfg.mesh = MeshConfig(**{k: v for k, v in saved["mesh"].items() if k != "auto"})
    if cfg.model.remat == AUTO_REMAT and "remat" in saved.get("model", {}):
        cfg.model.remat = saved["model"]["remat"]
    return cfg


def check_writable(run_dir: Path) -> None:
    for parent in (run_dir, *run_dir.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ShardlmError(f"--run-dir {run_dir}: {parent} is a file; pass a directory path")
            if not os.access(parent, os.W_OK):
                raise ShardlmError(f"--run-dir {run_dir}: {parent} is not writable; pass a directory you can write")
            break


@dataclasses.dataclass
class RunStart:
    """How a run begins: `resume_step` is the checkpoint it continues from (None: from step 0); `meta` is that
    checkpoint's meta item; `reset` says the directory's earlier files are to be replaced."""

    resume_step: int | None = None
    meta: dict | None = None
    reset: bool = False
    finished: bool = False


def check_optimizer_layout(saved: dict, step: int, run_dir: Path) -> None:
    """Refuse, in one line, a Muon run saved before its AdamW half became `train.optimizer=adamw`'s (its saved
    config has no `train.muon_nesterov`, which came with the change): its optimizer state holds optax.contrib.muon's
    own AdamW branch, laid out otherwise, and that branch decayed its norms and biases. Its weights go on in a new
    run."""
    train = saved.get("train", {})
    if train.get("optimizer") == "muon" and "muon_nesterov" not in train:
        raise ShardlmError(
            f"{run_dir}'s checkpoint step {step} holds Muon's state from before its AdamW half became plain AdamW with "
            "the decay mask (docs/recipe.md), laid out otherwise; continue its weights in a new run: shardlm export "
            f"{run_dir} --out DIR, then shardlm train init.from=hf:DIR train.optimizer=muon ...")


def config_changes(cfg: Config, saved: Config, step: int, run_dir: Path | None = None) -> list[str]:
    """Raise if a fixed key differs from the checkpoint's config; else the changed keys as 'key old -> new'. Another
    optimizer is refused with the way to it that keeps the weights: the run exported (`shardlm export`) and a new
    run started from the export (`init.from=hf:`), which docs/recipe.md recommends; a model from a py: file does not
    export, so for it the refusal says only to start over."""
    new, old = dict(flatten(cfg.to_dict())), dict(flatten(saved.to_dict()))
    for key in FIXED_KEYS:  # a model from a py: file has no architecture fields: absent on both sides
        if new.get(key) != old.get(key):
            problem = f"{key}={new[key]} differs from the run's {old[key]} (checkpoint step {step})"
            if key in OPTIMIZER_KEYS and not is_py(cfg.model.preset):
                run = run_dir or "RUN"
                raise ShardlmError(
                    f"{problem}; the checkpoint holds the state of the run's optimizer, which another cannot read: "
                    f"drop the override to resume, or continue the run's weights in a new run: shardlm export {run} "
                    f"--out DIR, then shardlm train init.from=hf:DIR {key}={new[key]} ... (docs/recipe.md)")
            raise ShardlmError(
                f"{problem}; a run's model, seed, batch size and optimizer cannot change when it resumes: drop that "
                "override, or pass another --run-dir"
            )
    skip = {"data.tokenizer"} if cfg.data.tokenizer == "auto" else set()  # resolved only once the data is read
    return [f"{k} {old[k]} -> {new[k]}" for k in new if k not in skip and new[k] != old.get(k)]


STEP_DIR = re.compile(r"^\d+(\.orbax-checkpoint-tmp.*)?$")


def check_checkpoint_dir(run_dir: Path) -> None:
    """Refuse a `checkpoints/` that holds anything but step directories: it is not shardlm's to write into or
    (with --overwrite) delete."""
    d = checkpoint_dir(run_dir)
    if d.exists():
        foreign = [p.name for p in d.iterdir() if not (p.is_dir() and STEP_DIR.match(p.name))] if d.is_dir() \
            else [d.name]
        if foreign:
            raise ShardlmError(f"{d} holds files shardlm did not write ({', '.join(sorted(foreign)[:3])}); pass "
                               "another --run-dir")


def check_vocab_padding(meta: dict, padded: int, tensor: int, verb: str) -> None:
    """The vocabulary is padded for the tensor degree; a checkpoint holds the padded rows of the mesh it was written
    on, so a mesh that pads differently cannot read it."""
    if meta["vocab"]["padded"] != padded:
        was = meta["mesh"]["tensor"]
        raise ShardlmError(f"checkpoint step {meta['step']} holds a vocabulary padded to {meta['vocab']['padded']} "
                           f"rows (for its mesh.tensor={was}), but mesh.tensor={tensor} pads it to {padded}; {verb} "
                           f"with mesh.tensor={was}")


def plan_start(run_dir: Path, cfg: Config, overwrite: bool, log) -> RunStart:
    """Decide, reading only metadata, whether this run is new, resumed, restarted or already finished."""
    check_writable(run_dir)
    check_checkpoint_dir(run_dir)
    if overwrite:
        return RunStart(reset=True)
    if not holds_run(run_dir):
        if checkpoint_dir(run_dir).is_dir() and any(checkpoint_dir(run_dir).iterdir()):
            raise ShardlmError(f"{checkpoint_dir(run_dir)} holds checkpoints but {run_dir} has no {CONFIG_FILE}; "
                               "pass another --run-dir, or --overwrite to replace them")
        return RunStart()
    for name in incomplete_steps(run_dir):
        log(f"ignoring the incomplete checkpoint {checkpoint_dir(run_dir) / name}: its save did not finish "
            "(the process was killed while writing it)")
    reader = RunCheckpoints(run_dir, local=True)  # this process alone (process 0 decides for all)
    try:
        steps = reader.steps()
        if not steps:
            if (run_dir / FINISHED_MARKER).exists():
                raise ShardlmError(f"--run-dir {run_dir} holds a finished run without checkpoints; pass another "
                                   "--run-dir, or --overwrite to replace it")
            log(f"{run_dir} holds a run that has no complete checkpoint yet: starting it again from step 0")
            return RunStart(reset=True)
        step = steps[-1]
        try:
            meta = reader.read_meta(step)
        except CheckpointError as e:
            raise unreadable(run_dir, e, [s for s in steps if s < step], reader) from None
    finally:
        reader.close()
    check_optimizer_layout(meta["config"], step, run_dir)
    # (compared as `decide_start` will make it on every process; process 0 alone may be deciding here)
    resumed = adopt_earlier_defaults(copy.deepcopy(cfg), meta["config"])
    changes = config_changes(resumed, config_from_dict(with_earlier_defaults(meta["config"])), step, run_dir)
    if step >= cfg.train.steps:
        log(f"{run_dir} has already trained to step {step} (train.steps={cfg.train.steps}): nothing to do; raise "
            "train.steps to train it further")
        return RunStart(resume_step=step, meta=meta, finished=True)
    log(f"resuming {run_dir} from its checkpoint at step {step} (of {cfg.train.steps})"
        + (f"; changed: {', '.join(changes)}" if changes else ""))
    return RunStart(resume_step=step, meta=meta)


PROBE_PREFIX = ".shardlm-shared-"


def decide_start(run_dir: Path, cfg: Config, overwrite: bool, log) -> RunStart:
    """`plan_start`, decided by process 0 alone and shared with every process; in a run of several processes,
    also checks that they all see the same run directory (a shared filesystem) before anything is written. A
    resumed run's settings from before `EARLIER_DEFAULTS` are adopted into `cfg` on every process."""
    start = _shared_start(run_dir, cfg, overwrite, log)
    if start.meta is not None:
        adopt_earlier_defaults(cfg, start.meta["config"])
    return start


def _shared_start(run_dir: Path, cfg: Config, overwrite: bool, log) -> RunStart:
    if not distributed.is_multiprocess():
        return plan_start(run_dir, cfg, overwrite, log)

    def decide() -> dict:
        start = plan_start(run_dir, cfg, overwrite, log)
        probe, created = None, [str(d) for d in (run_dir, *run_dir.parents) if not d.exists()]
        if not start.finished:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = f"{PROBE_PREFIX}{secrets.token_hex(8)}"
            (run_dir / probe).write_text("process 0 of a shardlm run checks that the other processes see this file\n")
        return {"start": dataclasses.asdict(start), "probe": probe, "created": created}

    shared = distributed.broadcast("run-start", decide)
    if shared["probe"] is not None:
        seen = distributed.all_gather("run-dir-shared", _sees(run_dir, shared["probe"]))
        if distributed.is_primary():  # leave the directories as they were: the run claims them later, if at all
            (run_dir / shared["probe"]).unlink(missing_ok=True)
            for d in shared["created"]:
                try:
                    Path(d).rmdir()
                except OSError:
                    break
        blind = [p for p, ok in enumerate(seen) if not ok]
        if blind:
            hosts = sorted({distributed.host_of_process(p) for p in blind})
            raise ShardlmError(f"--run-dir {run_dir} is not shared between the processes: process(es) "
                               f"{', '.join(map(str, blind))} (on {', '.join(hosts)}) do not see the file process 0 "
                               f"wrote there; put the run directory on a filesystem every host mounts at the same "
                               f"path (NFS, Lustre, a bucket through FUSE)")
    return RunStart(**shared["start"])


SHARED_WAIT_S = 5.0  # network filesystems may answer from a cache for a moment after process 0 wrote the file


def _sees(run_dir: Path, name: str) -> bool:
    deadline = time.monotonic() + SHARED_WAIT_S
    while True:
        try:
            if name in os.listdir(run_dir):  # a directory listing, not a (possibly cached) lookup of the name
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def unreadable(run_dir: Path, error: CheckpointError, older: list[int], reader: RunCheckpoints,
               check=None) -> ShardlmError:
    """The one-line error for an unreadable checkpoint, naming the newest older one that reads (`check(step)`
    raises CheckpointError if it does not; by default only its meta item is read). In a run of several processes
    the older ones are named unchecked: this process must fail at once, since the reads are collectives and a
    process whose shards did read may already be waiting in the next one."""
    where = checkpoint_dir(run_dir)
    if distributed.is_multiprocess():
        fix = (f"move {where / str(error.step)} out of {where} to resume from step {max(older)}, the newest older one"
               if older else "no older checkpoint exists: pass --overwrite or another --run-dir to start over")
        return ShardlmError(f"checkpoint step {error.step} in {where} cannot be read ({error.reason}); {fix}")
    good = None
    for s in sorted(older, reverse=True):
        try:
            (check or reader.read_meta)(s)
            good = s
            break
        except CheckpointError:
            continue
    fix = (f"the newest readable one is step {good}: move {where / str(error.step)} out of {where} to resume from it"
           if good is not None else "no older checkpoint reads either: pass --overwrite or another --run-dir to "
                                    "start over")
    return ShardlmError(f"checkpoint step {error.step} in {where} cannot be read ({error.reason}); {fix}")


def claim(run_dir: Path, start: RunStart) -> None:
    """Create the directory; on reset, remove only the files an earlier shardlm run wrote there."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if start.reset:
        for name in RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
        tb = run_dir / "tensorboard"
        if tb.is_dir():
            for f in tb.glob("events.out.tfevents.*"):
                f.unlink()
        if checkpoint_dir(run_dir).is_dir():
            shutil.rmtree(checkpoint_dir(run_dir))
    elif start.resume_step is not None:
        (run_dir / FINISHED_MARKER).unlink(missing_ok=True)  # the run is under way again
