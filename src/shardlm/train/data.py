"""The data of a run: prepared once (by process 0, while the others wait) and checked against the model.

`load_data` is what `shardlm train` opens; `tokenizer_vocab` is the vocabulary a model is built for, which
`plan`, `bench`, `profile` and `explain` need without training (they prepare text that was never prepared, as a
run would).
"""

import dataclasses
import hashlib
import json
from pathlib import Path

from tqdm.auto import tqdm

from shardlm import distributed
from shardlm.config import Config
from shardlm.data.mixture import Source, parse_sources
from shardlm.data.prepare import (META_FILE, PreparedData, describe_tokenizer, shared_tokenizer, tokenizer_identity,
                                  training_data)
from shardlm.data.sources import resolve_inputs
from shardlm.errors import ShardlmError
from shardlm.train.evaluation import MIN_VAL_WINDOWS


def load_data(cfg: Config, progress: bool = False, log=None) -> PreparedData:
    """The prepared data (preparing text into the cache first if needed), checked against model.vocab_size: a
    mixture's first source (`load_sources`)."""
    return load_sources(cfg, progress, log)[0][1]


def load_sources(cfg: Config, progress: bool = False, log=None) -> list[tuple[Source, PreparedData]]:
    """Each source of `data.sources` (or the one `data.path` names) prepared, with one tokenizer: `data.tokenizer`,
    or for auto the first source's (text after the first is prepared with the BPE trained on the first); a source
    prepared with another is a one-line error. Checked against model.vocab_size. In a run of several processes,
    process 0 prepares text while the others wait, then they find it ready (on a filesystem they share; elsewhere
    each host prepares its own copy, and `agree` checks that they match)."""
    sources = parse_sources(cfg.data.sources, cfg.data.path)
    log = log or tqdm.write
    if distributed.is_multiprocess() and not distributed.is_primary():
        distributed.barrier("data-prepared")
    floor = MIN_VAL_WINDOWS * cfg.model.seq_len + 1  # text's validation split holds this many windows at least
    # a mixture's source is named as the config names it, `data.sources[1] (notes)`
    names = [f"data.sources[{i}] ({src.name})" if cfg.data.sources else "data.path" for i, src in enumerate(sources)]
    for src, name in zip(sources, names):  # every source's path, before any is prepared
        if not (Path(src.path) / META_FILE).is_file():
            resolve_inputs([src.path], name)
    first = training_data(dataclasses.replace(cfg.data, path=sources[0].path), progress=progress, log=log,
                          min_val_tokens=floor, what=names[0])
    prepared = [(sources[0], first)]
    shared = shared_tokenizer(cfg.data.tokenizer, first)
    for src, name in zip(sources[1:], names[1:]):
        is_prepared = (Path(src.path) / META_FILE).is_file()
        d = dataclasses.replace(cfg.data, path=src.path, tokenizer=cfg.data.tokenizer if is_prepared else shared)
        prepared.append((src, training_data(d, progress=progress, log=log, min_val_tokens=floor, what=name)))
    if distributed.is_multiprocess() and distributed.is_primary():
        distributed.barrier("data-prepared")
    identity = tokenizer_identity(first)
    for src, data in prepared[1:]:
        if tokenizer_identity(data) != identity:
            raise ShardlmError(f"data.sources: {src.name} ({data.path}) is tokenized with {describe_tokenizer(data)}, "
                               f"{sources[0].name} with {describe_tokenizer(first)}; every source must share one "
                               "tokenizer: prepare them with the same --tokenizer (or leave text unprepared)")
    data = first
    vocab = data.tokenizer.vocab_size
    if cfg.model.vocab_size and cfg.model.vocab_size < vocab:
        raise ShardlmError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab}; "
            "set model.vocab_size=0 to use the tokenizer's"
        )
    return prepared


def stream_identity(prepared: list[tuple[Source, PreparedData]]) -> str:
    """What a checkpoint records of the training sources, checked when a run resumes: one source's training split's
    SHA-256 (as before mixtures), or a digest of every source's name and split, in order (each source's shuffle
    is seeded by its place). The weights may change (`weight_schedule`)."""
    if len(prepared) == 1:
        return prepared[0][1].meta["splits"]["train"]["sha256"]
    parts = [[src.name, data.meta["splits"]["train"]["sha256"]] for src, data in prepared]
    return "mixture:" + hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def weight_schedule(sources: list[Source], meta: dict | None, resume_step: int) -> list[list]:
    """[[first step, {source name: weight}], ...]: the weights a run has trained with and the steps they took
    effect at, from its checkpoint's `meta` (None: a new run), with the configured weights appended at
    `resume_step` when they differ from the last (annealing: the batches follow them from there on)."""
    now = {s.name: s.weight for s in sources}
    if meta is None:
        return [[0, now]]
    saved = meta["data"].get("schedule")
    if not saved:  # a checkpoint from before schedules: its config's sources
        data = meta["config"]["data"]
        saved = [[0, {s.name: s.weight for s in parse_sources(data.get("sources") or [], data["path"])}]]
    return saved if saved[-1][1] == now else [*saved, [resume_step, now]]


def tokenizer_vocab(cfg: Config, log=None) -> int:
    """The vocabulary the model is built for: `model.vocab_size`, else the data's tokenizer's (preparing the data
    first if it is text that was never prepared)."""
    return cfg.model.vocab_size or load_data(cfg, log=log).tokenizer.vocab_size


def inspect_sources(cfg: Config, batches: int, log=None) -> dict:
    """What `shardlm data inspect` prints: per source its tokens, weight, share of the first `batches` global
    batches of the stream and epochs of its training split in a run of `train.steps` (from the stream's indices,
    reading no tokens); preparing text that was never prepared first, as a run would."""
    from shardlm.data.loader import TokenWindows
    from shardlm.data.mixture import windows_per_source

    prepared = load_sources(cfg, log=log)
    seq, bsz, steps = cfg.model.seq_len, cfg.train.batch_size, cfg.train.steps
    weights = [src.weight for src, _ in prepared]
    first = windows_per_source([(0, weights)], batches * bsz)
    run = windows_per_source([(0, weights)], steps * bsz)
    total = sum(weights)
    rows = []
    for (src, data), n_first, n_run in zip(prepared, first, run):
        splits = data.meta["splits"]
        per_epoch = len(TokenWindows(data.tokens("train"), seq))
        rows.append({"name": src.name, "path": str(data.path), "train_tokens": splits["train"]["num_tokens"],
                     "val_tokens": splits["val"]["num_tokens"], "weight": src.weight / total,
                     "share": n_first / (batches * bsz), "epochs": n_run / per_epoch if per_epoch else 0.0})
    return {"batches": batches, "steps": steps, "batch_size": bsz, "seq_len": seq, "sources": rows}


def format_inspection(report: dict) -> str:
    share, epochs = f"share of {report['batches']} batches", f"epochs in {report['steps']} steps"
    lines = [f"{'source':<12} {'train tokens':>14} {'val tokens':>12} {'weight':>7} {share:>22} {epochs:>18}  path"]
    for r in report["sources"]:
        lines.append(f"{r['name']:<12} {r['train_tokens']:>14,} {r['val_tokens']:>12,} {r['weight']:>7.3f} "
                     f"{r['share']:>22.3f} {r['epochs']:>18.3f}  {r['path']}")
    lines.append(f"windows of {report['seq_len'] + 1} tokens, {report['batch_size']} per batch; shares and epochs "
                 "are read off the mixed stream's indices, exact")
    return "\n".join(lines)
