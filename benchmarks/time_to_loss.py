"""Time to a fixed evaluation loss: nanoGPT with AdamW against shardlm with AdamW and with Muon, on this host.

    python benchmarks/time_to_loss.py                          # the default corpus, to eval loss 5.0
    python benchmarks/time_to_loss.py --target 4.8 --max-steps 600 --plot docs/time_to_loss.png
    python benchmarks/time_to_loss.py --nanogpt ~/src/nanoGPT  # a clone (or its model.py) instead of the download

One GPT-2-shaped model sized for a CPU (4 layers, 4 heads, d_model 256, learned positions, biases, tied head,
GELU MLP of 4 d, dropout 0, float32), the same token windows of the built-in corpus in the same order (its BPE of
2,048 tokens, batch 16 x 128), the same learning-rate schedule (`train.lr` 3e-3: linear warmup over 30 steps,
cosine decay to a tenth at `--max-steps`, shardlm's `make_schedule`, evaluated once and handed to every side),
weight decay 0.1, betas (0.9, 0.95), the gradient norm clipped at 1, every `--eval-every` steps the mean loss of
the same 8 validation windows. Three trainers, each a worker process started once:
- nanoGPT: its own model.py and `configure_optimizers` (AdamW), train.py's step written out, PyTorch eager;
- shardlm with `train.optimizer=adamw` and with `train.optimizer=muon`: the real train state and jitted step
  (`data.document_mask=false`: nanoGPT attends across documents, and the comparison is of optimizers and
  programs, not of masks).

The workers take turns, `--eval-every` steps each (then their evaluation, which the clock leaves out), so that what
else runs on the host weighs on all three alike. Each stops at the target or at `--max-steps`. Prints each
one's steps and training seconds to the target, the ratios of nanoGPT's time to shardlm's, and plots eval loss
against seconds (`--plot`). nanoGPT's model.py is read as `benchmarks/peers.py` reads it (downloaded once at a
fixed commit, or `--nanogpt`); PyTorch is not a shardlm dependency: `pip install torch` first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import Worker, nanogpt_model  # noqa: E402

LAYERS, HEADS, D, SEQ, BATCH = 4, 4, 256, 128, 16
LR, WARMUP, MIN_RATIO, WEIGHT_DECAY, BETAS, CLIP = 3e-3, 30, 0.1, 0.1, (0.9, 0.95), 1.0
TRAINERS = ("nanoGPT", "shardlm adamw", "shardlm muon")


def overrides(optimizer: str, steps: int) -> list[str]:
    return ["model=tiny", f"model.n_layers={LAYERS}", f"model.n_heads={HEADS}", f"model.d_model={D}",
            f"model.d_mlp={4 * D}", f"model.seq_len={SEQ}", "model.dropout=0.0", "model.dtype=float32",
            f"train.batch_size={BATCH}", f"train.steps={steps}", f"train.lr={LR}", f"train.warmup_steps={WARMUP}",
            f"train.min_lr_ratio={MIN_RATIO}", f"train.weight_decay={WEIGHT_DECAY}", f"train.beta1={BETAS[0]}",
            f"train.beta2={BETAS[1]}", f"train.grad_clip={CLIP}", f"train.optimizer={optimizer}",
            "data.document_mask=false"]


def prepare(steps: int, eval_batches: int, out: Path) -> dict:
    """The token windows every trainer reads, in order, and the learning rate of each step, into `out`."""
    from shardlm.config import load_config
    from shardlm.data.loader import BatchLoader
    from shardlm.train.data import load_data
    from shardlm.train.optimizers import make_schedule

    cfg = load_config(None, overrides("adamw", steps))
    data = load_data(cfg)
    full = range(BATCH)
    train = BatchLoader(data.tokens("train"), SEQ, BATCH, None, seed=0, shuffle=True, rows=full)
    val = BatchLoader(data.tokens("val"), SEQ, BATCH, None, seed=0, shuffle=False, rows=full, name="validation")
    np.save(out / "train.npy", np.stack([np.asarray(train.local[i]) for i in range(steps)]))
    np.save(out / "val.npy", np.stack([np.asarray(val.local[i]) for i in range(eval_batches)]))
    schedule = make_schedule(cfg)
    np.save(out / "lr.npy", np.array([float(schedule(i)) for i in range(steps)], np.float64))
    return {"vocab": data.tokenizer.vocab_size, "corpus": str(data.path)}


# --- the workers: set up once, then per request train N steps (timed) and evaluate (not timed) ------------------

def shardlm_worker(optimizer: str, work: Path, vocab: int):
    import jax

    from shardlm.config import load_config
    from shardlm.mesh import make_mesh
    from shardlm.sharding import batch_sharding
    from shardlm.train.state import create_train_state
    from shardlm.train.step import eval_step_for, train_step_for

    train, val = np.load(work / "train.npy"), np.load(work / "val.npy")
    cfg = load_config(None, overrides(optimizer, len(train)))
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    ts = create_train_state(cfg, mesh, vocab)
    put = lambda b: jax.device_put(b, batch_sharding(mesh))  # noqa: E731
    step = train_step_for(cfg, ts, mesh).lower(ts.state, put(train[0])).compile()
    evaluate = eval_step_for(cfg, ts, mesh, np.ones(vocab, np.int32)).lower(ts.state, put(val[0])).compile()
    state, done = ts.state, 0

    def run(n: int) -> float:
        nonlocal state, done
        for i in range(done, min(done + n, len(train))):
            state, metrics = step(state, put(train[i]))
        jax.block_until_ready(state)
        done = min(done + n, len(train))
        return done

    def eval_loss() -> float:
        return float(np.mean([float(evaluate(state, put(b))["loss"]) for b in val]))

    return run, eval_loss, {"optimizer": optimizer}


def nanogpt_worker(work: Path, vocab: int, model_py: str):
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("nanogpt_model", model_py)
    nanogpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nanogpt)
    train, val, lrs = np.load(work / "train.npy"), np.load(work / "val.npy"), np.load(work / "lr.npy")
    torch.manual_seed(0)
    model = nanogpt.GPT(nanogpt.GPTConfig(block_size=SEQ, vocab_size=vocab, n_layer=LAYERS, n_head=HEADS, n_embd=D,
                                          dropout=0.0, bias=True))
    optimizer = model.configure_optimizers(WEIGHT_DECAY, LR, BETAS, "cpu")
    as_pair = lambda b: (torch.from_numpy(b[:, :-1]).long(), torch.from_numpy(b[:, 1:]).long())  # noqa: E731
    done = 0

    def run(n: int) -> int:
        nonlocal done
        model.train()
        for i in range(done, min(done + n, len(train))):
            for group in optimizer.param_groups:  # train.py's get_lr, here the shared schedule
                group["lr"] = float(lrs[i])
            x, y = as_pair(train[i])
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        done = min(done + n, len(train))
        return done

    @torch.no_grad()
    def eval_loss() -> float:
        model.eval()
        return float(np.mean([model(*as_pair(b))[1].item() for b in val]))

    return run, eval_loss, {"torch": torch.__version__, "threads": torch.get_num_threads()}


def serve(kind: str, work: Path, vocab: int, model_py: str | None) -> None:
    """A worker: set up and say so; then for each line `N` on stdin, train N steps, evaluate, print both."""
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # setup's prints: stdout is the protocol
        run, eval_loss, about = (nanogpt_worker(work, vocab, model_py) if kind == "nanoGPT"
                                 else shardlm_worker(kind.split()[1], work, vocab))
    print(json.dumps({**about, "eval_loss": eval_loss()}), flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        step = run(int(line))
        seconds = time.perf_counter() - t0
        print(json.dumps({"step": step, "seconds": seconds, "eval_loss": eval_loss()}), flush=True)


class Trainer(Worker):
    """A trainer's worker process (`peers.Worker`) and its curve: (training seconds, step, eval loss)."""

    def __init__(self, kind: str, work: Path, vocab: int, model_py: Path):
        super().__init__(kind, ["--work", str(work), "--vocab", str(vocab), "--nanogpt", str(model_py)], __file__)
        self.curve, self.seconds = [(0.0, 0, self.about["eval_loss"])], 0.0

    def train(self, steps: int) -> dict:
        result = self.run(steps)
        self.seconds += result["seconds"]
        self.curve.append((self.seconds, result["step"], result["eval_loss"]))
        return result

    def reached(self, target: float):
        """(step, seconds) of the first evaluation at or below `target`, or None."""
        return next(((step, s) for s, step, loss in self.curve if loss <= target), None)

def plot(workers, target: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for w in workers:
        seconds, _, losses = zip(*w.curve)
        ax.plot(seconds, losses, marker=".", label=w.kind)
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target}")
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("eval loss")
    ax.set_title(f"GPT {LAYERS}x{D}, batch {BATCH}x{SEQ}, float32, {os.cpu_count()} CPU cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=float, default=5.0, help="the eval loss to reach")
    ap.add_argument("--max-steps", type=int, default=400, help="and the schedule's length")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    ap.add_argument("--plot", help="a PNG of eval loss against training seconds")
    ap.add_argument("--nanogpt", help="a clone of karpathy/nanoGPT, or its model.py (default: downloaded once)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        serve(args.worker, Path(args.work), args.vocab, args.nanogpt)
        return
    model_py = nanogpt_model(args.nanogpt) if "nanoGPT" in args.trainers else Path("-")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        about = prepare(args.max_steps, args.eval_batches, work)
        print(f"GPT {LAYERS} layers x d_model {D}, {HEADS} heads, batch {BATCH} x {SEQ}, vocabulary {about['vocab']:,} "
              f"({about['corpus']}), float32; lr {LR} (warmup {WARMUP}, cosine to {MIN_RATIO:g}x at "
              f"{args.max_steps}); target eval loss {args.target}", flush=True)
        workers = [Trainer(kind, work, about["vocab"], model_py) for kind in args.trainers]
        for w in workers:
            print(f"  {w.kind}: {json.dumps(w.about)}", flush=True)
        active = list(workers)
        while active:
            for w in list(active):
                r = w.train(args.eval_every)
                print(f"  {w.kind:<14} step {r['step']:>4}  {w.seconds:7.1f} s  eval loss {r['eval_loss']:.4f}",
                      flush=True)
                if r["eval_loss"] <= args.target or r["step"] >= args.max_steps:
                    active.remove(w)
        for w in workers:
            w.close()
    print(f"\n| trainer | steps to {args.target} | seconds to {args.target} | final eval loss |\n| --- | --- | --- | --- |")
    for w in workers:
        hit = w.reached(args.target)
        print(f"| {w.kind} | {hit[0] if hit else 'not reached'} | {f'{hit[1]:.1f}' if hit else '-'} | "
              f"{w.curve[-1][2]:.4f} |")
    base = next((w for w in workers if w.kind == "nanoGPT"), None)
    if base and base.reached(args.target):
        for w in workers:
            if w is not base and w.reached(args.target):
                print(f"nanoGPT's time / {w.kind}'s: {base.reached(args.target)[1] / w.reached(args.target)[1]:.2f}x")
    print(f"(evaluations every {args.eval_every} steps, the trainers taking turns; {os.cpu_count()} CPU cores)")
    if args.plot:
        plot(workers, args.target, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
