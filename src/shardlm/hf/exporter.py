"""`shardlm export RUN_DIR --out DIR`: a trained run as a Hugging Face model directory that transformers, vLLM and
llama.cpp's converters read.

DIR gets `config.json` (GPT2LMHeadModel or LlamaForCausalLM), `generation_config.json`, the weights as
`model.safetensors` (or `model-0000i-of-0000n.safetensors` shards and `model.safetensors.index.json` above
`--max-shard-size`, as `save_pretrained` writes them), and the tokenizer (`tokenizer.json` and
`tokenizer_config.json`) so that `AutoTokenizer.from_pretrained(DIR)` and `AutoModelForCausalLM.from_pretrained(DIR)`
both work.

Design choices:
- Streamed: the parameters are read from the checkpoint onto the mesh, then each Hugging Face tensor is gathered
  from the devices, converted (`shardlm.hf.weights.hf_tensors`) and added to the shard being filled; a full shard
  is written and dropped. A host holds one shard and one tensor, never the whole model (above the shard size).
  With several processes every process takes part in the gathers and process 0 writes.
- The vocabulary's padding rows are dropped; a tied head is written once, as the embedding, as transformers
  expects (`tie_word_embeddings`).
- The tokenizer travels as a Hugging Face `tokenizer.json` whatever the run used: a BPE run's own file; for
  `gpt2` (tiktoken) and `bytes` the same tokens built as a byte-level BPE (`tokenizer_files`).
- Atomic: everything is written into a hidden sibling directory and renamed into place, so a failed export leaves
  DIR as it was; an existing non-empty DIR is replaced only with `--force`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from shardlm.atomic import partial_sibling, swap_into_place
from shardlm.errors import ShardlmError
from shardlm.hf.weights import INDEX_FILE, SAFETENSORS_FILE

DTYPES = ("float32", "bfloat16")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default, "5GB"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters, the alphabet byte-level BPE vocabularies use
    (as in OpenAI's encoder.py and every byte-level tokenizer since)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges of a byte-level BPE given only its ranked tokens (tiktoken stores no merges): each token of two
    or more bytes is the merge of the two parts that BPE with the lower-ranked tokens leaves of it."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = min(((ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))))
            if best[0] >= rank:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def tokenizer_files(tokenizer, run_dir: Path, seq_len: int) -> dict[str, str]:
    """{file name: text}: the run's tokenizer as Hugging Face files."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    from shardlm.data.tokenizer import EOT, TOKENIZER_FILE

    eot = getattr(tokenizer, "eot", EOT)
    source = getattr(tokenizer, "hf_config", {})  # a Hugging Face tokenizer's own config travels on as it was
    if tokenizer.spec == "bpe":
        text = (Path(run_dir) / TOKENIZER_FILE).read_text(encoding="utf-8")
    else:
        alphabet = bytes_to_unicode()
        if tokenizer.spec == "gpt2":
            enc = tokenizer.enc
            ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i != tokenizer.eot_id}
        else:  # bytes: token b is byte b, no merges
            ranks = {bytes([b]): b for b in range(256)}
        vocab = {"".join(alphabet[b] for b in token): i for token, i in ranks.items()}
        merges = [("".join(alphabet[b] for b in a), "".join(alphabet[b] for b in b_)) for a, b_ in
                  _merges_from_ranks(ranks)]
        hf = HF(models.BPE(vocab=vocab, merges=merges))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=tokenizer.spec == "gpt2")
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens([EOT])
        if hf.token_to_id(EOT) != tokenizer.eot_id:
            raise ShardlmError(f"internal: {EOT} became id {hf.token_to_id(EOT)}, not {tokenizer.eot_id}")
        text = hf.to_str()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eot, "eos_token": eot, "unk_token": None,
              "clean_up_tokenization_spaces": False, **source, "model_max_length": seq_len}
    return {TOKENIZER_FILE: text, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def _export_mesh(meta: dict, n_devices: int) -> list[str]:
    """The run's mesh if it fits these devices, else FSDP over all of them (keeping the tensor degree, which the
    vocabulary padding depends on, where it divides the device count)."""
    import math

    run = meta["mesh"]
    if math.prod(run.values()) == n_devices:
        return [f"mesh.{k}={v}" for k, v in run.items()]
    tensor = run.get("tensor", 1) if n_devices % run.get("tensor", 1) == 0 else 1
    return ["mesh.data=1", "mesh.fsdp=-1", f"mesh.tensor={tensor}"]


def _gather(array) -> np.ndarray:
    """A whole array on this host, from shards on any devices (of any process)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str = "float32",
           max_shard_bytes: float = DEFAULT_MAX_SHARD_BYTES, force: bool = False, log=print) -> dict:
    """Write the run's checkpoint at `step` (default: newest) to `out` as a Hugging Face model directory; returns
    a summary (files, tensors, bytes, seconds)."""
    import jax
    import ml_dtypes
    from flax import nnx
    from safetensors.numpy import save_file

    from shardlm import distributed
    from shardlm.hf.config import hf_config
    from shardlm.hf.weights import hf_tensors
    from shardlm.load import load_model, run_tokenizer
    from shardlm.sharding.rules import path_str
    from shardlm.train.checkpoint import RunCheckpoints, complete_steps
    from shardlm.train.rundir import CONFIG_FILE

    t0 = time.perf_counter()
    run_dir, out = Path(run_dir), Path(out)
    if dtype not in DTYPES:
        raise ShardlmError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    if max_shard_bytes <= 0:
        raise ShardlmError("--max-shard-size must be positive")
    if out.exists() and not out.is_dir():
        raise ShardlmError(f"--out {out} is a file; pass a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ShardlmError(f"--out {out} exists and is not empty; pass --force to replace it, or another --out")
    if not (run_dir / CONFIG_FILE).is_file():
        raise ShardlmError(f"{run_dir} holds no shardlm run (no {CONFIG_FILE}); pass a training run's directory")
    from shardlm.config import read_config_file

    model = read_config_file(run_dir / CONFIG_FILE).get("model", {})
    if model.get("family", "gpt") == "gpt" and model.get("use_bias") is False:
        raise ShardlmError(f"{run_dir} trained a GPT without biases (model.use_bias=false), which transformers' "
                           "GPT2LMHeadModel cannot hold; only GPT runs with biases export")
    steps = complete_steps(run_dir)
    if not steps:
        raise ShardlmError(f"{run_dir} has no complete checkpoint yet; train it first")
    reader = RunCheckpoints(run_dir, read_only=True)
    try:
        meta = reader.read_meta(steps[-1] if step is None else step) if (step is None or step in steps) else None
    finally:
        reader.close()
    if meta is None:
        raise ShardlmError(f"{run_dir} has no checkpoint at step {step}; it has steps {', '.join(map(str, steps))}")
    m = load_model(run_dir, step=step, overrides=_export_mesh(meta, jax.device_count()))
    vocab = meta["vocab"]["real"]
    leaves = {path_str(p): a for p, a in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(m.state))[0]}
    cast = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    primary = distributed.is_primary()

    tmp = partial_sibling(out)
    if primary:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    try:
        shards, shard, shard_bytes, total, weight_map = [], {}, 0, 0, {}

        def flush():
            nonlocal shard, shard_bytes
            if shard and primary:
                name = f"shard-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                shards.append((name, list(shard)))
            elif shard:
                shards.append((None, list(shard)))
            shard, shard_bytes = {}, 0

        for name, array in hf_tensors(m.cfg.model, vocab, lambda path: _gather(leaves[path])):
            array = np.ascontiguousarray(array.astype(cast))
            if shard and shard_bytes + array.nbytes > max_shard_bytes:
                flush()
            shard[name] = array if primary else None
            shard_bytes += array.nbytes
            total += array.nbytes
        flush()
        if primary:
            files = _name_shards(tmp, shards, weight_map)
            if len(files) > 1:
                (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                          "weight_map": weight_map}, indent=2) + "\n")
            eot = m.tokenizer.eot_id
            bos = getattr(m.tokenizer, "bos_id", None)
            bos = eot if bos is None else bos
            config = hf_config(m.cfg.model, vocab, {"bos_token_id": bos, "eos_token_id": eot})
            config["dtype"] = config["torch_dtype"] = dtype  # transformers 5 reads the first, 4.x the second
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            (tmp / "generation_config.json").write_text(json.dumps(
                {"bos_token_id": bos, "eos_token_id": eot}, indent=2) + "\n")
            for name, text in tokenizer_files(run_tokenizer(m.cfg, run_dir), run_dir, m.cfg.model.seq_len).items():
                (tmp / name).write_text(text, encoding="utf-8")
            mode = 0o666 & ~_umask()  # safetensors writes its files private; give them the others' permissions
            for f in tmp.iterdir():
                f.chmod(mode)
            swap_into_place(tmp, out)
        distributed.barrier("exported")
    except BaseException:
        if primary:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary = {"out": str(out), "step": m.step, "files": len(shards), "bytes": total, "dtype": dtype,
               "seconds": time.perf_counter() - t0}
    log(f"exported {run_dir} step {m.step} to {out}: {total / 2**20:,.1f} MiB of {dtype} weights in "
        f"{len(shards)} file(s), config, generation config and tokenizer, in {summary['seconds']:.1f}s")
    return summary


def _name_shards(tmp: Path, shards: list, weight_map: dict) -> list[str]:
    """Rename the shards as transformers names them, now that their number is known."""
    if len(shards) == 1:
        os.rename(tmp / shards[0][0], tmp / SAFETENSORS_FILE)
        return [SAFETENSORS_FILE]
    files = []
    for i, (name, tensors) in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        os.rename(tmp / name, tmp / final)
        weight_map.update({t: final for t in tensors})
        files.append(final)
    return files


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

