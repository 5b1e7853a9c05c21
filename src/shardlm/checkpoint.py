"""A run's checkpoints: an Orbax `CheckpointManager` over `<run_dir>/checkpoints/<step>/`.

Each step directory holds four items:
- `params`: the model's parameters, the only item readers such as `shardlm generate` restore;
- `optimizer`: the optimizer state (AdamW moments and the step counter);
- `data`: the data iterator's position, `{"next_batch": i}`: JSON, written once, the same for any number of
  processes (checkpoints written before this held Grain's per-process state files, which are still read);
- `meta`: JSON with the step, the resolved config, the mesh, the vocabulary, the data's fingerprint, the RNG
  derivation and the library versions.

Design choices:
- Saves are asynchronous. `save` returns once the arrays have been copied off the devices, so the next step may
  donate them, and a background thread writes the files while training goes on.
- Orbax writes each step into `<step>.orbax-checkpoint-tmp` and renames it when complete. A process killed
  mid-save therefore leaves the earlier checkpoints untouched and the incomplete one recognisable; the next start
  reports it and removes it.
- Restores read each array straight into the sharding the current mesh wants, because the abstract target carries
  it. Orbax and TensorStore then read only the slices each device holds, so a checkpoint moves between meshes,
  strategies and device counts without ever being gathered whole on one device.
- PRNG keys (the RNG streams a user's NNX module may hold) are stored as their key data (uint32) and wrapped
  back on restore: Orbax reads a typed key into a target as its raw data, not as a key.
- Arrays are stored as plain nested dicts (`nnx.to_pure_dict`), so the format does not depend on Flax's Variable
  classes.
- Several processes: every process takes part in every save and restore (Orbax's own barriers); each writes and
  reads only the shards its devices hold, and process 0 writes the JSON items. A checkpoint written by N
  processes loads with M. A manager opened `local=True` (reading metadata on one process while the others wait)
  joins no barrier.
"""

import gc
import json
import logging
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from shardlm.errors import ShardlmError

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_KINDS = {"config": "a training run's", "trainer": "a Trainer's"}  # the key of the meta that says which
INCOMPLETE_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's name for a save in progress


class CheckpointError(ShardlmError):
    """A checkpoint that cannot be read; `step` names it."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"checkpoint step {step} cannot be read ({reason})")
        self.step, self.reason = step, reason


def _reason(e: BaseException) -> str:
    """The first line of the root cause (Orbax wraps TensorStore's precise error), short enough for one line."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text if len(text) <= 200 else text[:197] + "..."


class _QuietFailedReads:
    """After a failed restore, Orbax abandons the other reads in flight: their coroutines are collected unawaited
    and TensorStore's callbacks find Orbax's event loop closed, each printing a traceback through
    `sys.unraisablehook` (hundreds for one bad file), some while the error is still propagating, and asyncio logs
    each unretrieved task. The failure itself is reported in one line, so during a restore, and for the rest of the
    process once one has failed, these echoes are dropped; every other unraisable exception still prints."""

    def __enter__(self):
        self.previous = sys.unraisablehook
        previous = self.previous
        # The abandoned asyncio tasks also log "Task exception was never retrieved" when collected.
        self.asyncio_level = logging.getLogger("asyncio").level
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)

        def hook(unraisable) -> None:
            exc, obj = unraisable.exc_value, unraisable.object
            if (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed") or \
                    getattr(obj, "__qualname__", "") == "_read_array_index_and_device_put":
                return
            previous(unraisable)

        sys.unraisablehook = hook
        return self

    def __exit__(self, exc_type, *rest) -> None:
        if exc_type is None:
            sys.unraisablehook = self.previous
            logging.getLogger("asyncio").setLevel(self.asyncio_level)
        else:
            gc.collect()  # collect the abandoned reads now, while quiet; the hook stays for the late echoes


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def incomplete_steps(run_dir: str | Path) -> list[str]:
    """Names of step directories whose save never finished (the process died while writing them)."""
    d = checkpoint_dir(run_dir)
    return sorted(p.name.split(INCOMPLETE_SUFFIX)[0] for p in d.glob(f"*{INCOMPLETE_SUFFIX}*")) if d.is_dir() else []


def _array_tree_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's handler for the array trees. Replica-parallel saving (the default) slices every replicated array on
    its devices so that several hosts share the writing; with one process there is no one to share with, and the
    slicing costs hundreds of dispatches per save (seconds of compiles at the first), all while training waits."""
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=jax.process_count() > 1)
    return ocp.PyTreeCheckpointHandler(
        type_handler_registry=ocp.type_handlers.create_type_handler_registry((jax.Array, arrays)))


def _quiet_orbax() -> None:
    # Orbax logs every save and restore at INFO/WARNING through absl; shardlm reports checkpoints itself.
    # CRITICAL: a failed background write is also logged by Orbax with a traceback; shardlm reports it in one line.
    logging.getLogger("absl").setLevel(logging.CRITICAL)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _storable(tree):
    """`tree` with every PRNG key array replaced by its key data."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _storable_target(target):
    """A restore target whose PRNG keys are targets for their key data (same sharding, a trailing dimension)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def one(x):
        if not _is_key(x):
            return x
        data = jax.eval_shape(jax.random.key_data, x)
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, P(*sharding.spec, *[None] * (data.ndim - len(sharding.spec))))
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)

    return jax.tree.map(one, target)


def _rewrap_keys(restored, target):
    """Key data read back into PRNG keys of the target's implementation (threefry, rbg, ...). JAX names a key
    dtype's implementation only privately (`dtype._impl`); the default implementation stands in if it moves."""
    def wrap(x, t):
        impl = getattr(t.dtype, "_impl", None) or str(jax.config.jax_default_prng_impl)
        return jax.random.wrap_key_data(x, impl=impl)

    return jax.tree.map(lambda x, t: wrap(x, t) if _is_key(t) else x, restored, target)


def _restore_args(target) -> ocp.args.PyTreeRestore:
    """Read every array of `target` (ShapeDtypeStructs with shardings) into its sharding and dtype."""
    return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


def local_steps(run_dir: str | Path) -> list[int]:
    """The complete checkpoints' steps, oldest first, read by this process alone (no barrier with the others)."""
    reader = RunCheckpoints(run_dir, local=True)
    try:
        return reader.steps()
    finally:
        reader.close()


def complete_steps(run_dir: str | Path) -> list[int]:
    """`local_steps` as process 0 lists them, for every process of a run: a run still writing checkpoints could
    otherwise be listed differently by different processes."""
    from shardlm import distributed

    return distributed.broadcast("checkpoint-steps", lambda: local_steps(run_dir))


class RunCheckpoints:
    """The checkpoints of one run directory. `keep`: how many of the newest to keep; `also_keep`: steps never
    deleted (the run's last step). `read_only` opens without creating, cleaning or deleting anything."""

    def __init__(self, run_dir: str | Path, *, keep: int = 3, also_keep: tuple[int, ...] = (),
                 read_only: bool = False, local: bool = False):
        _quiet_orbax()
        self.read_only = read_only or local
        self.directory = checkpoint_dir(run_dir).absolute()
        preserve = [policies.LatestN(keep)] + ([policies.CustomSteps(list(also_keep))] if also_keep else [])
        me = jax.process_index()
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=not self.read_only,
            preservation_policy=policies.AnyPreservationPolicy(preserve),
            cleanup_tmp_directories=not self.read_only,
            read_only=self.read_only,
            create=not self.read_only,
            # A manager of this process alone: its barriers include no one else.
            multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
            if local else ocp.options.MultiprocessingOptions(),
        )
        if self.read_only and not self.directory.is_dir():
            self.manager = None
        else:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
                "params": _array_tree_handler(), "optimizer": _array_tree_handler(),
                "data": ocp.JsonCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

    # --- reading -----------------------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The complete checkpoints' steps, oldest first."""
        if self.manager is None:
            return []
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def read_meta(self, step: int, kind: str = "config") -> dict:
        """The meta item of `step`, which must hold `kind`: "config" for a run's checkpoints, "trainer" for those
        `shardlm.foreign.Trainer.save` writes."""
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - any failure to read is reported as this step being unreadable
            raise CheckpointError(step, _reason(e)) from e
        if not isinstance(meta, dict) or meta.get("step") != step:
            raise CheckpointError(step, "its meta item is not a shardlm checkpoint's")
        if kind not in meta:
            found = next((who for key, who in CHECKPOINT_KINDS.items() if key in meta), None)
            raise CheckpointError(step, f"it is {found} checkpoint, not {CHECKPOINT_KINDS[kind]}" if found
                                  else "its meta item is not a shardlm checkpoint's")
        return meta

    def stored_tree(self, step: int, item: str = "params") -> dict:
        """The nested keys of an array item as stored (dict keys as strings, leaves Orbax's array metadata), read
        from its metadata without reading any array."""
        try:
            with _QuietFailedReads():  # the metadata lives in the arrays' files: a damaged one fails here first
                return self.manager.item_metadata(step)[item].tree
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(step, f"its {item} metadata cannot be read: {_reason(e)}") from e

    def read_position(self, step: int) -> int:
        """The index of the first batch a run resumed from `step` trains on."""
        old = sorted((self.directory / str(step) / "data").glob("process_*-of-*.json"))
        try:
            if old:  # written by Grain's own handler, one file per process, all holding the same index
                return int(json.loads(old[0].read_text())["next_index"])
            data = self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
            return int(data["next_batch"])
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(step, f"its data position cannot be read: {_reason(e)}") from e

    def restore_trees(self, step: int, params_target, optimizer_target=None):
        """(params, optimizer state) at `step`, read into the shapes, dtypes and shardings of the targets (pytrees
        of ShapeDtypeStructs, the structure they were saved with); the optimizer item is not read without a
        target."""
        items = {"params": _restore_args(_storable_target(params_target))}
        if optimizer_target is not None:
            items["optimizer"] = _restore_args(_storable_target(optimizer_target))
        try:
            with _QuietFailedReads():
                restored = self.manager.restore(step, args=ocp.args.Composite(**items))
            params = _rewrap_keys(restored["params"], params_target)
            opt = _rewrap_keys(restored["optimizer"], optimizer_target) if optimizer_target is not None else None
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(step, _reason(e)) from e
        return params, opt

    # --- writing -----------------------------------------------------------------------------------------------
    def save_trees(self, step: int, params, optimizer, position: int, meta: dict) -> None:
        """Start saving plain pytrees of arrays (the params item, the optimizer item), the data position (the index
        of the next batch) and the meta; returns once the arrays are off the devices, while the files are written
        in the background (`shardlm.train.stored.save_state` saves a train state with it)."""
        args = ocp.args.Composite(
            params=ocp.args.PyTreeSave(_storable(params)),
            optimizer=ocp.args.PyTreeSave(_storable(optimizer)),
            data=ocp.args.JsonSave({"next_batch": int(position)}),
            meta=ocp.args.JsonSave(meta),
        )
        try:
            self.manager.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 - a failed earlier background write surfaces here
            raise ShardlmError(f"saving checkpoint step {step} in {self.directory} failed ({_reason(e)}); check "
                               "that the disk has space and the directory is writable") from e

    def wait(self) -> None:
        """Block until the background writes are done."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise ShardlmError(f"writing a checkpoint in {self.directory} failed ({_reason(e)}); check that the "
                               "disk has space and the directory is writable") from e

    def close(self) -> None:
        """Wait for the background writes (a failed one raises ShardlmError), then release the manager."""
        if self.manager is not None:
            try:
                if not self.read_only:
                    self.wait()
            finally:
                self.manager.close()
