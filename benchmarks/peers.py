"""Train-step throughput against nanoGPT's own model.py on the same shapes, measured in one run, alternating.

    python benchmarks/peers.py                      # both shapes, 3 rounds of 6 timed steps each
    python benchmarks/peers.py --shapes head --rounds 5 --steps 8
    python benchmarks/peers.py --nanogpt ~/src/nanoGPT   # a clone (or its model.py) instead of the download

Two shapes, float32 on the CPU, global batch 16 x 128, GPT-2 style (learned positions, biases, tied head, GELU
MLP of 4 d), AdamW with weight decay 0.1 and the gradient norm clipped at 1, dropout 0:
- `head`: 4 layers, 8 heads, d_model 256, vocabulary 50,304. The output head is most of the FLOPs: a newcomer's
  first GPT-2-tokenizer model.
- `layers`: 4 layers, 8 heads, d_model 512, vocabulary 2,048. The layers are most of the FLOPs.

Each side runs in a worker process of its own, started once, compiled and warmed up once (3 steps); then the
rounds alternate between them (shardlm, nanoGPT, shardlm, ...), each round timing `--steps` steps, so that what
else runs on the host weighs on both alike. Prints each round's tokens/s, the medians and their ratio.

nanoGPT (https://github.com/karpathy/nanoGPT) is not vendored: its model.py is downloaded at a fixed commit into
~/.cache/shardlm/nanogpt/ on the first run, or read from `--nanogpt`. Its training step is train.py's, written
out: forward with targets, backward, `clip_grad_norm_`, the optimizer from `configure_optimizers`, in PyTorch
eager mode (train.py's default `compile=True` needs a C compiler and minutes of compiling; eager is what most
people run on a laptop's CPU). shardlm's is `shardlm bench`'s: the real train state and jitted step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

NANOGPT_COMMIT = "3adf61e154c3fe3fca428ad6bc3818b27a3b8291"
NANOGPT_URL = f"https://raw.githubusercontent.com/karpathy/nanoGPT/{NANOGPT_COMMIT}/model.py"
BATCH, SEQ = 16, 128
SHAPES = {  # name -> (layers, heads, d_model, vocabulary)
    "head": (4, 8, 256, 50304),
    "layers": (4, 8, 512, 2048),
}


def nanogpt_model(given: str | None) -> Path:
    """nanoGPT's model.py: `given` (the file or a clone), or the cached download at `NANOGPT_COMMIT`."""
    if given:
        path = Path(given).expanduser()
        path = path / "model.py" if path.is_dir() else path
        if not path.is_file():
            sys.exit(f"peers.py: no nanoGPT model.py at {path}; pass --nanogpt a clone of karpathy/nanoGPT or its "
                     "model.py")
        return path
    cached = Path.home() / ".cache" / "shardlm" / "nanogpt" / NANOGPT_COMMIT / "model.py"
    if not cached.exists():
        try:
            source = urllib.request.urlopen(NANOGPT_URL, timeout=30).read()
        except OSError as e:
            sys.exit(f"peers.py: could not download nanoGPT's model.py ({e}); pass --nanogpt a clone of "
                     "karpathy/nanoGPT or its model.py")
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_bytes(source)
    return cached


# --- the workers: set up once, then time `steps` steps per request on stdin --------------------------------------


def shardlm_worker(shape: str):
    import jax
    import numpy as np

    from shardlm.config import load_config
    from shardlm.mesh import make_mesh
    from shardlm.models.head import recording
    from shardlm.sharding import batch_sharding
    from shardlm.train.state import create_train_state
    from shardlm.train.step import train_step_for

    layers, heads, d, vocab = SHAPES[shape]
    cfg = load_config(None, ["model=tiny", f"model.n_layers={layers}", f"model.n_heads={heads}",
                             f"model.d_model={d}", f"model.d_mlp={4 * d}", f"model.vocab_size={vocab}",
                             f"model.seq_len={SEQ}", f"train.batch_size={BATCH}", "model.dropout=0.0",
                             "data.document_mask=false"])  # nanoGPT attends across documents: the same program
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    ts = create_train_state(cfg, mesh, vocab)
    rng = np.random.default_rng(0)
    batches = [jax.device_put(rng.integers(0, vocab, (BATCH, SEQ + 1)).astype(np.int32), batch_sharding(mesh))
               for _ in range(4)]
    with recording() as traced:
        step = train_step_for(cfg, ts, mesh).lower(ts.state, batches[0]).compile()
    state = ts.state

    def run(n: int):
        nonlocal state
        for i in range(n):
            state, metrics = step(state, batches[i % 4])
        jax.block_until_ready(metrics)
        return float(metrics["loss"])

    return run, {"head": traced[0].describe() if traced else "", "dtype": cfg.model.dtype}


def nanogpt_worker(shape: str, model_py: str):
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("nanogpt_model", model_py)
    nanogpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nanogpt)
    layers, heads, d, vocab = SHAPES[shape]
    torch.manual_seed(0)
    model = nanogpt.GPT(nanogpt.GPTConfig(block_size=SEQ, vocab_size=vocab, n_layer=layers, n_head=heads,
                                          n_embd=d, dropout=0.0, bias=True))
    optimizer = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), "cpu")
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g) for _ in range(4)]
    batches = [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]  # as train.py's get_batch makes them

    def run(n: int):
        for i in range(n):
            x, y = batches[i % 4]
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return run, {"torch": torch.__version__, "threads": torch.get_num_threads()}


def serve(kind: str, shape: str, model_py: str | None) -> None:
    """A worker: set up, warm up, say so; then for each line `N` on stdin, time N steps and print the result."""
    with contextlib.redirect_stdout(sys.stderr):  # setup's prints (nanoGPT's notes): stdout is the protocol
        run, about = shardlm_worker(shape) if kind == "shardlm" else nanogpt_worker(shape, model_py)
        run(3)
    print(json.dumps(about), flush=True)
    for line in sys.stdin:
        n = int(line)
        t0 = time.perf_counter()
        loss = run(n)
        seconds = time.perf_counter() - t0
        print(json.dumps({"tokens_per_s": n * BATCH * SEQ / seconds, "loss": loss}), flush=True)


# --- the parent: start both workers, alternate rounds, print the table --------------------------------------------


class Worker:
    """A worker process: `script --worker KIND ARGS...`, which prints a JSON line once set up (`about`), then one
    per request of N steps (`run`). benchmarks/time_to_loss.py's trainers are workers too."""

    def __init__(self, kind: str, args: list[str], script: str = __file__):
        self.kind, self.script = kind, Path(script).name
        self.proc = subprocess.Popen([sys.executable, script, "--worker", kind, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        self.about = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"{self.script}: the {self.kind} worker stopped (its stderr is above)")
        return json.loads(line)

    def run(self, steps: int) -> dict:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def compare(shape: str, model_py: Path, rounds: int, steps: int) -> dict:
    layers, heads, d, vocab = SHAPES[shape]
    print(f"\n{shape}: {layers} layers, {heads} heads, d_model {d}, MLP {4 * d}, vocabulary {vocab:,}, "
          f"batch {BATCH} x {SEQ}, float32", flush=True)
    workers = [Worker(kind, ["--shape", shape, "--nanogpt", str(model_py)]) for kind in ("shardlm", "nanoGPT")]
    print(f"  shardlm's head and loss: {workers[0].about['head']}")
    print(f"  nanoGPT: PyTorch {workers[1].about['torch']} eager, {workers[1].about['threads']} threads")
    rates: dict[str, list[float]] = {"shardlm": [], "nanoGPT": []}
    for r in range(rounds):
        for w in workers:
            result = w.run(steps)
            rates[w.kind].append(result["tokens_per_s"])
            print(f"  round {r + 1} {w.kind:<8} {result['tokens_per_s']:>9,.0f} tokens/s  (loss {result['loss']:.3f})",
                  flush=True)
    for w in workers:
        w.close()
    medians = {k: statistics.median(v) for k, v in rates.items()}
    return {"shape": shape, **medians, "ratio": medians["shardlm"] / medians["nanoGPT"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per round")
    ap.add_argument("--nanogpt", help="a clone of karpathy/nanoGPT, or its model.py (default: downloaded once)")
    ap.add_argument("--worker", choices=("shardlm", "nanoGPT"), help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        serve(args.worker, args.shape, args.nanogpt)
        return
    model_py = nanogpt_model(args.nanogpt)
    rows = [compare(shape, model_py, args.rounds, args.steps) for shape in args.shapes]
    print(f"\n| shape | shardlm tokens/s | nanoGPT tokens/s | shardlm / nanoGPT |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['shape']} | {row['shardlm']:,.0f} | {row['nanoGPT']:,.0f} | {row['ratio']:.2f}x |")
    print(f"(medians of {args.rounds} rounds of {args.steps} steps, alternating; CPU: {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
