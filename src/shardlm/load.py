"""Loading a trained model from a run directory, or a Hugging Face checkpoint (`hf:DIR`), for readers such as
`shardlm generate` and `shardlm export`.

Readers restore the `params` item of a checkpoint and nothing else: no optimizer state (two thirds of the bytes
under AdamW) is read or allocated. The parameters are read straight into the shardings of the mesh the reader
asks for, which need not be the mesh the run trained on. Without one, a reader gets the run's own mesh where it
fits the devices at hand, else FSDP over all of them (`mesh_that_fits`): a run trained on 8 devices generates on a
1-device host without the reader spelling out a mesh, and says so (`LoadedModel.note`).
"""

import dataclasses
import math
from pathlib import Path

import jax

from shardlm.config import Config, config_from_dict, load_config
from shardlm.data.tokenizer import Tokenizer, load_hf_dir_tokenizer, load_tokenizer
from shardlm.errors import ShardlmError
from shardlm.hf.config import hf_dir, is_hf
from shardlm.mesh import mesh_from_config, unresolved
from shardlm.checkpoint import CheckpointError, RunCheckpoints, complete_steps
from shardlm.train.init_from import import_params
from shardlm.train.rundir import check_vocab_padding, require_run, unreadable
from shardlm.train import stored
from shardlm.train.source import model_source
from shardlm.train.state import abstract_model, vocab_sizes


@dataclasses.dataclass
class LoadedModel:
    cfg: Config
    mesh: object
    graphdef: object  # the model's (nnx.split(model))
    state: object  # its parameters, sharded on `mesh`
    tokenizer: Tokenizer | None  # None: a Hugging Face checkpoint saved without one
    step: int
    note: str = ""  # why the mesh is not the run's own, for the reader to print

    def generator(self, **options):
        """A `Generator` for this model on its mesh (a model from a py: file decodes without a KV cache)."""
        return model_source(self.cfg).generator(self.graphdef, self.state, self.mesh,
                                                eot_id=self.tokenizer.eot_id if self.tokenizer else -1,
                                                vocab_size=self.tokenizer.vocab_size if self.tokenizer else None,
                                                **options)


def run_tokenizer(cfg: Config, run_dir: Path) -> Tokenizer:
    """The run's tokenizer: a trained BPE travels with the run as tokenizer.json; gpt2 and bytes need no file."""
    spec = cfg.data.tokenizer
    return load_tokenizer("bpe" if spec.startswith("bpe") else spec, run_dir)


def mesh_that_fits(run_mesh: dict[str, int], n_devices: int) -> list[str]:
    """`mesh.*` overrides for `n_devices` where the run's mesh (`run_mesh`, its concrete degrees) uses another
    number: FSDP over all of them, keeping the tensor degree (the vocabulary's padding depends on it) where it
    divides the device count: the weights stay sharded, so a model that fit the run's devices fits these unless
    there are fewer of them."""
    tensor = run_mesh.get("tensor", 1) if n_devices % run_mesh.get("tensor", 1) == 0 else 1
    return ["mesh.data=1", "mesh.fsdp=-1", f"mesh.tensor={tensor}"]


def load_model(run_dir: str | Path, *, step: int | None = None, overrides: list[str] | tuple[str, ...] = (),
               devices=None, require_tokenizer: bool = False) -> LoadedModel:
    """The model of the run in `run_dir` at `step` (default: the newest checkpoint), or of the Hugging Face
    checkpoint `hf:DIR`. `overrides` (`mesh.*=...`) choose the mesh to load onto; by default the run's own mesh
    settings where they fit the devices, else `mesh_that_fits` (a Hugging Face checkpoint: data parallel over every
    device)."""
    if is_hf(run_dir):
        if step is not None:
            raise ShardlmError("--step applies to a training run's checkpoints, not to a Hugging Face directory")
        return load_hf_model(str(run_dir), overrides=overrides, devices=devices, require_tokenizer=require_tokenizer)
    run_dir = Path(run_dir)
    require_run(run_dir)
    steps = complete_steps(run_dir)
    reader = RunCheckpoints(run_dir, read_only=True)
    try:
        if not steps:
            raise ShardlmError(f"{run_dir} has no complete checkpoint yet; train it first "
                               f"(shardlm train --run-dir {run_dir})")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ShardlmError(f"{run_dir} has no checkpoint at step {step}; it has steps "
                               f"{', '.join(map(str, steps))}")
        _check_mesh_only(overrides, "can change when loading a trained model")
        try:
            meta = reader.read_meta(step)
        except CheckpointError as e:
            raise unreadable(run_dir, e, [s for s in steps if s < step], reader) from None
        note = ""
        trained_on = math.prod(meta["mesh"].values())
        n_devices = len(devices) if devices is not None else jax.device_count()
        if not overrides and trained_on != n_devices:
            overrides = mesh_that_fits(meta["mesh"], n_devices)
            note = (f"{run_dir} trained on {trained_on} devices; loading onto the {n_devices} here as "
                    f"{' '.join(overrides)} (pass mesh.*= to choose)")
        # mesh.* overrides describe the whole mesh to load onto (unset axes take their defaults), not changes to
        # the run's: `mesh.tensor=2` alone means tensor 2 x data for the rest.
        cfg = config_from_dict({**meta["config"], "mesh": {}} if overrides else meta["config"], overrides)
        mesh = mesh_from_config(cfg.mesh, devices)
        real, padded = vocab_sizes(cfg, meta["vocab"]["real"], mesh.shape["tensor"])
        check_vocab_padding(meta, padded, mesh.shape["tensor"], "load")
        graphdef, abstract = abstract_model(cfg, mesh, real)
        source = model_source(cfg)

        def read(s: int):
            return stored.restore_state(reader, s, abstract, optimizer=False, stacks_blocks=source.stacks_blocks,
                                        repeats=source.stack_repeats)

        try:
            state = read(step)
        except CheckpointError as e:
            older = [s for s in steps if s < step]
            raise unreadable(run_dir, e, older, reader, check=lambda s: (reader.read_meta(s), read(s))) from None
    finally:
        reader.close()
    return LoadedModel(cfg, mesh, graphdef, state, run_tokenizer(cfg, run_dir), step, note)


def load_hf_model(spec: str, *, overrides=(), devices=None, require_tokenizer: bool = False) -> LoadedModel:
    """The checkpoint `hf:DIR` for readers: the architecture from config.json, the weights onto the mesh
    `overrides` (`mesh.*=...`) describe (default: data parallel over every device), the tokenizer from the
    directory's tokenizer files (None if it has none, unless `require_tokenizer`)."""
    _check_mesh_only(overrides, "can be given when loading a Hugging Face model")
    cfg = load_config(None, [f"model={spec}", f"init.from={spec}", *overrides])
    try:  # tiktoken's gpt2 (a download, if not cached) only when the tokenizer is needed
        tokenizer = load_hf_dir_tokenizer(hf_dir(spec), tiktoken=require_tokenizer)
    except ShardlmError:
        if require_tokenizer:
            raise
        tokenizer = None  # a model without its tokenizer still computes logits of token ids
    if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ShardlmError(f"hf:{hf_dir(spec)}: its tokenizer has {tokenizer.vocab_size} tokens but config.json's "
                           f"vocab_size is {cfg.model.vocab_size}")
    mesh = mesh_from_config(cfg.mesh, devices)
    graphdef, state = import_params(spec, cfg, mesh, cfg.model.vocab_size)
    return LoadedModel(cfg, mesh, graphdef, state, tokenizer, 0)


def _check_mesh_only(overrides, what: str) -> None:
    bad = [o for o in overrides if not o.split("=", 1)[0].strip().startswith("mesh.")]
    if bad and bad[0].replace(" ", "") == "mesh=auto":  # a mesh setting, but one only a training run plans
        raise unresolved("mesh=auto", "mesh.fsdp=8")
    if bad:
        raise ShardlmError(f"{bad[0]}: only mesh.* settings {what}")
