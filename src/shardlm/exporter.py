"""`shardlm export RUN_DIR --out DIR`: a trained run as a Hugging Face model directory that transformers, vLLM and
llama.cpp's converters read.

DIR gets `config.json` (GPT2LMHeadModel, LlamaForCausalLM, or MixtralForCausalLM for a mixture of experts in
every layer), `generation_config.json`, the weights as
`model.safetensors` (or `model-0000i-of-0000n.safetensors` shards and `model.safetensors.index.json` above
`--max-shard-size`, as `save_pretrained` writes them), and the tokenizer (`tokenizer.json` and
`tokenizer_config.json`) so that `AutoTokenizer.from_pretrained(DIR)` and `AutoModelForCausalLM.from_pretrained(DIR)`
both work.

Design choices:
- Streamed: the parameters are read from the checkpoint onto the mesh (`shardlm.load`), then each Hugging Face
  tensor is gathered from the devices, converted by the family's mapping (`shardlm.hf.weights.hf_tensors`) and
  handed to the writer (`shardlm.hf.writer`), which fills one shard at a time. A host holds one shard and one tensor, never the whole
  model (above the shard size). With several processes every process takes part in the gathers and process 0
  writes.
- The vocabulary's padding rows are dropped; a tied head is written once, as the embedding, as transformers
  expects (`tie_word_embeddings`). The tokenizer travels as Hugging Face files (`shardlm.hf.tokenizer`).
- Atomic, and checked first: every argument and the run are checked before anything is read, and the writer puts
  the directory in place only when it is complete, so a failed export leaves DIR as it was; an existing non-empty
  DIR is replaced only with `--force`.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from shardlm import distributed
from shardlm.config import read_config_file
from shardlm.errors import ShardlmError
from shardlm.families import FAMILIES, hf_format
from shardlm.hf.config import hf_config
from shardlm.hf.tokenizer import tokenizer_files
from shardlm.hf.weights import hf_tensors
from shardlm.hf.writer import DEFAULT_MAX_SHARD_BYTES, ModelDirWriter
from shardlm.load import LoadedModel, load_model, run_tokenizer
from shardlm.models.config import ModelConfig, stack_layer_count
from shardlm.models.stack import layer_index, split_layer_path
from shardlm.checkpoint import RunCheckpoints, complete_steps
from shardlm.train.rundir import CONFIG_FILE, require_run
from shardlm.train.source import model_source
from shardlm.trees import path_str

DTYPES = ("float32", "bfloat16")


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str = "float32",
           max_shard_bytes: float = DEFAULT_MAX_SHARD_BYTES, force: bool = False, log=print) -> dict:
    """Write the run's checkpoint at `step` (default: newest) to `out` as a Hugging Face model directory; returns
    a summary (files, tensors, bytes, seconds)."""
    t0 = time.perf_counter()
    run_dir, out = Path(run_dir), Path(out)
    _check_arguments(run_dir, out, dtype, max_shard_bytes, force)
    meta = _checkpoint_meta(run_dir, step)
    m = load_model(run_dir, step=step)  # the run's mesh, or FSDP over these devices (`load.mesh_that_fits`)
    vocab = meta["vocab"]["real"]
    writer = ModelDirWriter(out, max_shard_bytes=max_shard_bytes, write=distributed.is_primary())
    try:
        _add_tensors(writer, m, vocab, dtype)
        tokenizer = tokenizer_files(run_tokenizer(m.cfg, run_dir), run_dir, m.cfg.model.seq_len) if writer.write \
            else {}
        files = writer.finish(*_configs(m, vocab, dtype), tokenizer)
        distributed.barrier("exported")
    except BaseException:
        writer.abort()
        raise
    summary = {"out": str(out), "step": m.step, "files": files, "bytes": writer.total, "dtype": dtype,
               "seconds": time.perf_counter() - t0}
    log(f"exported {run_dir} step {m.step} to {out}: {writer.total / 2**20:,.1f} MiB of {dtype} weights in "
        f"{files} file(s), config, generation config and tokenizer, in {summary['seconds']:.1f}s")
    return summary


def _check_arguments(run_dir: Path, out: Path, dtype: str, max_shard_bytes: float, force: bool) -> None:
    if dtype not in DTYPES:
        raise ShardlmError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    if max_shard_bytes <= 0:
        raise ShardlmError("--max-shard-size must be positive")
    if out.exists() and not out.is_dir():
        raise ShardlmError(f"--out {out} is a file; pass a directory path")
    if not (out.is_dir() and any(out.iterdir())):
        return
    if not force:
        raise ShardlmError(f"--out {out} exists and is not empty; pass --force to replace it, or another --out")
    _check_replaceable(run_dir, out)


def _check_replaceable(run_dir: Path, out: Path) -> None:
    """`--force` replaces a model directory, nothing else: not the run being exported or a directory holding it,
    and not a directory of other files (which the replacement would delete with it)."""
    if out.resolve() == run_dir.resolve() or out.resolve() in run_dir.resolve().parents:
        raise ShardlmError(f"--out {out} holds the run being exported ({run_dir}), which --force would delete; "
                           "choose another --out")
    if not (out / "config.json").is_file() or any(p.is_dir() for p in out.iterdir()):
        raise ShardlmError(f"--out {out} is not a model directory (config.json and its files, no subdirectories), "
                           "and --force replaces only one; choose a new or empty --out")


def _checkpoint_meta(run_dir: Path, step: int | None) -> dict:
    """The meta item of the checkpoint to export, after checking the run can be exported at all."""
    require_run(run_dir, "pass a training run's directory")
    model = read_config_file(run_dir / CONFIG_FILE).get("model", {})
    if model.get("family") not in FAMILIES:
        raise ShardlmError(f"{run_dir} trained {model.get('preset')}, a model from the user's file, whose architecture "
                           "has no Hugging Face counterpart shardlm knows; read its variables with "
                           "shardlm.load_model(run_dir) instead (the module's state, on any mesh)")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    trained = ModelConfig(**{k: v for k, v in model.items() if k in fields})
    hf_format(trained).exportable(trained, str(run_dir))
    steps = complete_steps(run_dir)
    if not steps:
        raise ShardlmError(f"{run_dir} has no complete checkpoint yet; train it first")
    if step is not None and step not in steps:
        raise ShardlmError(f"{run_dir} has no checkpoint at step {step}; it has steps {', '.join(map(str, steps))}")
    reader = RunCheckpoints(run_dir, read_only=True)
    try:
        return reader.read_meta(steps[-1] if step is None else step)
    finally:
        reader.close()


def _add_tensors(writer: ModelDirWriter, m: LoadedModel, vocab: int, dtype: str) -> None:
    """Every Hugging Face tensor, gathered from the mesh one at a time, cast and handed to the writer."""
    import jax
    import ml_dtypes
    from flax import nnx

    leaves = {path_str(p): a for p, a in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(m.state))[0]}
    cast = np.float32 if dtype == "float32" else ml_dtypes.bfloat16

    # A per-layer path; a scanned model holds layer i in a row of the stacked parameter (row (r, j) of a stack held
    # with repeats: `stack.layer_index`). `index`: a part of the parameter (one expert's matrix), sliced on the
    # devices before the gather, so that the host receives that part only.
    repeats, n_layers = model_source(m.cfg).stack_repeats, stack_layer_count(m.cfg.model)

    def get(path, *index):
        if path not in leaves and (hit := split_layer_path(path)):
            return _gather(leaves[hit[1]][(*layer_index(hit[0], n_layers, repeats), *index)])
        return _gather(leaves[path][index] if index else leaves[path])

    for name, array in hf_tensors(m.cfg.model, hf_format(m.cfg.model), vocab, get):
        writer.add(name, np.ascontiguousarray(array.astype(cast)))


def _gather(array) -> np.ndarray:
    """A whole array on this host, from shards on any devices (of any process)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _configs(m: LoadedModel, vocab: int, dtype: str) -> tuple[dict, dict]:
    """(config.json, generation_config.json) of the exported model."""
    eot = m.tokenizer.eot_id
    bos = getattr(m.tokenizer, "bos_id", None)
    bos = eot if bos is None else bos
    config = hf_config(m.cfg.model, hf_format(m.cfg.model), vocab, {"bos_token_id": bos, "eos_token_id": eot})
    config["dtype"] = config["torch_dtype"] = dtype  # transformers 5 reads the first, 4.x the second
    return config, {"bos_token_id": bos, "eos_token_id": eot}
