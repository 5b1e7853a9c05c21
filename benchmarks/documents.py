"""Attention within documents against across them (`data.document_mask`), on text of short documents, on this host.

    python benchmarks/documents.py                # about 6 minutes on a 2-core VM
    python benchmarks/documents.py --steps 500 --stories 40000

The default model (a 1.1M-parameter GPT, its default schedule cut to `--steps`) trains twice on each corpus, from
the same initial weights on the same windows in the same order: once within documents (`data.document_mask=true`)
and once across them (`false`). Each is then evaluated on the same validation windows both ways: as it trained
(what the run's `eval_loss` reports, evaluation seeing what training sees), and within documents (what generation
from a prompt sees: a new document, with no earlier one in its window). Three corpora, byte-level tokens (one
tokenizer for all three, the separator `<|endoftext|>`):
- the built-in corpus (Shakespeare's plays, 38 documents: a window crosses a document's end rarely);
- `--stories` TinyStories-style stories (`stories`): each with its own characters, object and place, 60 to 400
  bytes, so a window holds several, unrelated to each other;
- a mixture: the two, weighted 1:1, as `data.sources` mixes them (each window from one source).

Prints, per corpus, each run's eval loss both ways, and the difference that chooses the default.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

NAMES = ["Tom", "Lily", "Ben", "Mia", "Sam", "Anna", "Max", "Lucy", "Leo", "Emma", "Jack", "Zoe", "Finn", "Ruby",
         "Noah", "Ella", "Theo", "Ivy", "Oscar", "Rosa", "Hugo", "Nina", "Otto", "Clara"]
ANIMALS = ["dog", "cat", "bird", "frog", "bunny", "duck", "fox", "bear", "mouse", "owl"]
THINGS = ["ball", "kite", "box", "hat", "cake", "book", "drum", "boat", "shell", "key", "map", "bell"]
PLACES = ["park", "garden", "beach", "forest", "kitchen", "school", "farm", "river", "hill", "shop"]
COLOURS = ["red", "blue", "green", "yellow", "big", "little", "shiny", "old"]


def stories(n: int, seed: int = 0) -> list[str]:
    """TinyStories-style stories: each picks its own hero, friend, object and place and keeps to them, so a story's
    own earlier words predict its later ones and another story's do not."""
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    out = []
    for _ in range(n):
        hero, friend, thing, place = pick(NAMES), pick(ANIMALS), pick(THINGS), pick(PLACES)
        colour = pick(COLOURS)
        lines = [f"Once upon a time, {hero} had a {colour} {thing}.",
                 f"{hero} took the {thing} to the {place}."]
        for _ in range(int(rng.integers(1, 6))):
            lines.append(pick([f"A {friend} came to the {place} and saw the {thing}.",
                               f"{hero} and the {friend} played with the {colour} {thing}.",
                               f"The {friend} was sad, so {hero} gave it the {thing}.",
                               f"{hero} smiled at the {friend} in the {place}.",
                               f"The {thing} fell, and the {friend} helped {hero} find it."]))
        lines.append(f"At the end of the day, {hero} went home from the {place} with the {thing}.")
        out.append(" ".join(lines))
    return out


def overrides(path: str, steps: int, masked: bool) -> list[str]:
    return [f"data.path={path}", "data.tokenizer=bytes", f"train.steps={steps}",
            f"data.document_mask={'true' if masked else 'false'}"]


def corpus(path: str, steps: int):
    """(training tokens, validation tokens, the tokenizer) of `path`, prepared as a run prepares it."""
    from shardlm.config import load_config
    from shardlm.train.data import load_data

    data = load_data(load_config(None, overrides(path, steps, True)))
    return data.tokens("train"), data.tokens("val"), data.tokenizer


def train_and_evaluate(parts, cfgs, masked: bool, steps: int, eval_batches: int) -> dict:
    """{"as trained", "within documents"}: eval losses of the default model trained `steps` steps on `parts` (a
    list of (train tokens, val tokens, weight), one tokenizer) within documents or across them."""
    import jax

    from shardlm.data.loader import BatchLoader
    from shardlm.mesh import make_mesh
    from shardlm.sharding import batch_sharding
    from shardlm.train.state import create_train_state
    from shardlm.train.step import eval_step_for, train_step_for

    cfg = cfgs[masked]
    tokenizer = parts[0][3]
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    sharding = batch_sharding(mesh)
    t, m = cfg.train, cfg.model
    weights = [w for _, _, w, _ in parts]
    train = BatchLoader([p[0] for p in parts], m.seq_len, t.batch_size, sharding, seed=cfg.seed, shuffle=True,
                        weights=weights)
    ts = create_train_state(cfg, mesh, tokenizer.vocab_size)
    separator = tokenizer.eot_id
    step = train_step_for(cfg, ts, mesh, separator=separator)
    state = ts.state
    for i in range(steps):
        state, _ = step(state, train.get(i))
    token_bytes = tokenizer.token_bytes()
    evaluations = {"as trained": eval_step_for(cfg, ts, mesh, token_bytes, separator=separator),
                   "within documents": eval_step_for(cfgs[True], ts, mesh, token_bytes, separator=separator)}
    out = {}
    for name, evaluate in evaluations.items():
        losses = []
        for _, val, weight, _ in parts:  # each source's own windows, its mean weighted as `data.sources` does
            loader = BatchLoader(val, m.seq_len, t.batch_size, sharding, seed=0, shuffle=False, name="validation")
            n = min(eval_batches, loader.windows_per_epoch // loader.batch_size)
            losses.append((float(np.mean([float(evaluate(state, loader.get(i))["loss"]) for i in range(n)])),
                           weight))
        out[name] = sum(loss * w for loss, w in losses) / sum(w for _, w in losses)
    return out


def cpu_name() -> str:
    """The host's CPU model, as /proc/cpuinfo names it (figures on AMD and Intel hosts differ)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--stories", type=int, default=20_000)
    p.add_argument("--eval-batches", type=int, default=8)
    a = p.parse_args()

    from shardlm.config import load_config

    work = Path(tempfile.mkdtemp(prefix="shardlm-documents-"))
    story_file = work / "stories.txt"
    story_file.write_text("".join(f"{s}\n<|endoftext|>\n" for s in stories(a.stories)), encoding="utf-8")
    plays, tales = corpus("shakespeare", a.steps), corpus(str(story_file), a.steps)
    corpora = {"built-in corpus": [(*plays[:2], 1.0, plays[2])],
               "stories": [(*tales[:2], 1.0, tales[2])],
               "mixture 1:1": [(*plays[:2], 1.0, plays[2]), (*tales[:2], 1.0, tales[2])]}
    print(f"{cpu_name()}; the default GPT, byte-level tokens, {a.steps} steps, eval loss (nats per byte) over "
          f"{a.eval_batches} validation batches")
    print(f"{'corpus':<18} {'trained':<10} {'as trained':>11} {'within docs':>12}")
    # the model and the schedule (the data come from `corpora`: the config's data.path is not read)
    cfgs = {masked: load_config(None, overrides("shakespeare", a.steps, masked)) for masked in (True, False)}
    for name, parts in corpora.items():
        rows = {masked: train_and_evaluate(parts, cfgs, masked, a.steps, a.eval_batches) for masked in (True, False)}
        for masked in (True, False):
            r = rows[masked]
            print(f"{name:<18} {'within' if masked else 'across':<10} {r['as trained']:>11.4f} "
                  f"{r['within documents']:>12.4f}")
        gain = rows[False]["within documents"] - rows[True]["within documents"]
        print(f"{'':<18} within documents, the masked run's loss is {gain:+.4f} below the unmasked run's")


if __name__ == "__main__":
    sys.exit(main())
