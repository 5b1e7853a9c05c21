"""Data pipeline throughput against the `tiny` model's training consumption, measured in one run.

    python benchmarks/data_pipeline.py                                  # 64 MB of TinyStories-format text
    python benchmarks/data_pipeline.py --input TinyStories-valid.txt    # the real file (download: see docs/data.md)
    python benchmarks/data_pipeline.py --mb 256 --tokenizers bytes,bpe,gpt2

1. Prepare: `shardlm.data.prepare.prepare` on the text with each tokenizer; MB/s of input text (the tokenizer is
   loaded or trained beforehand and not timed). The synthetic text is Shakespeare cut into ~800-character
   "stories" (TinyStories' average) in the published TinyStories layout. `gpt2` needs tiktoken's files: it is
   reported as skipped when they are not cached and there is no network.
2. Loader: the real Grain iterator (shuffled windows, prefetch threads, `make_array_from_process_local_data`)
   over the memory-mapped BPE token file, with the tiny preset's batch (32 x 129 tokens); tokens/s over
   `--batches` batches, each waited for.
3. Training: the tiny preset's real compiled train step on the same devices; tokens/s over `--steps` steps after
   warm-up.

Prints the loader/training ratio; the target is at least 20x, so the loader is never the bottleneck.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def synthetic_stories(mb: float, path: Path) -> None:
    from shardlm.data.corpus import shakespeare_plays

    paragraphs = [p.strip() for play in shakespeare_plays() for p in play.split("\n\n") if p.strip()]
    stories, cur = [], ""
    for p in paragraphs:
        cur = f"{cur}\n{p}" if cur else p
        if len(cur) >= 800:
            stories.append(cur)
            cur = ""
    block = "".join(f"{s}\n<|endoftext|>\n" for s in stories).encode()
    with open(path, "wb") as f:
        for _ in range(max(1, int(mb * 1e6 / len(block) + 0.999))):
            f.write(block)
        f.truncate(int(mb * 1e6))  # cut mid-story: the last one is a partial document, as a cut file would have


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", help="a text file to prepare (default: synthetic TinyStories-format text)")
    ap.add_argument("--mb", type=float, default=64, help="size of the synthetic text")
    ap.add_argument("--tokenizers", default="bytes,bpe,gpt2")
    ap.add_argument("--vocab", type=int, default=2048, help="the BPE's vocabulary (tiny's default)")
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cpu-devices", type=int, default=None, help="simulate N CPU devices (default: the host's)")
    args = ap.parse_args()
    if args.cpu_devices:
        from shardlm.mesh import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)

    import jax

    from shardlm.config import load_config
    from shardlm.data.loader import BatchLoader
    from shardlm.data.prepare import prepare, save_tokenizer_file, train_tokenizer
    from shardlm.errors import ShardlmError
    from shardlm.mesh import make_mesh
    from shardlm.sharding import batch_sharding
    from shardlm.train.state import create_train_state
    from shardlm.train.step import COST_ONLY_SEPARATOR, train_step_for

    quiet = {"progress": False, "log": lambda msg: None}
    work = Path(tempfile.mkdtemp(prefix="shardlm-bench-data-"))
    text = Path(args.input) if args.input else work / "TinyStories-synthetic.txt"
    if not args.input:
        synthetic_stories(args.mb, text)
    size = text.stat().st_size
    print(f"host: {os.cpu_count()} CPU cores | JAX {jax.__version__} on {len(jax.devices())} "
          f"{jax.devices()[0].platform} device(s) | text: {text.name}, {size / 1e6:.1f} MB")

    print("\nprepare (tokenize once into a token file):")
    prepared = {}
    for name in args.tokenizers.split(","):
        spec = name
        if name == "bpe":
            t0 = time.perf_counter()
            tok = train_tokenizer([str(text)], args.vocab, max_bytes=16e6, log=lambda msg: None)
            save_tokenizer_file(tok, work / "bpe.json")
            print(f"  (BPE {args.vocab} trained on the first 16 MB in {time.perf_counter() - t0:.1f}s, not counted)")
            spec = f"bpe:{work / 'bpe.json'}"
        elif name == "gpt2":
            try:
                from shardlm.data.tokenizer import gpt2_tokenizer

                gpt2_tokenizer(timeout_s=20)
            except ShardlmError as e:
                print(f"  {name:6s} skipped: {str(e)[:110]}...")
                continue
        t0 = time.perf_counter()
        data = prepare([str(text)], work / name, tokenizer=spec, val_fraction=0.01, **quiet)
        dt = time.perf_counter() - t0
        n = data.meta["num_tokens"]
        print(f"  {name:6s} {size / 1e6 / dt:8.1f} MB/s | {dt:6.1f}s | {n:,} tokens "
              f"({n / data.meta['num_text_bytes']:.3f} per byte) | {data.meta['num_documents']:,} documents")
        prepared[name] = data

    data = prepared.get("bpe") or next(iter(prepared.values()))
    cfg = load_config(None, ["model=tiny"])
    seq, bsz = cfg.model.seq_len, cfg.train.batch_size
    mesh = make_mesh(devices=jax.devices())
    bsh = batch_sharding(mesh)
    loader = BatchLoader(data.tokens("train"), seq, bsz, bsh, seed=0, shuffle=True)
    it = loader.iterator()
    for _ in range(20):  # threads started, pages touched
        jax.block_until_ready(next(it))
    t0 = time.perf_counter()
    for _ in range(args.batches):
        jax.block_until_ready(next(it))
    loader_tps = args.batches * bsz * seq / (time.perf_counter() - t0)

    ts = create_train_state(cfg, mesh, data.tokenizer.vocab_size)
    batches = [loader.get(i) for i in range(4)]
    step = train_step_for(cfg, ts, mesh, separator=COST_ONLY_SEPARATOR).lower(ts.state, batches[0]).compile()
    state = ts.state
    for i in range(3):
        state, m = step(state, batches[i % 4])
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(args.steps):
        state, m = step(state, batches[i % 4])
    jax.block_until_ready(m)
    train_tps = args.steps * bsz * seq / (time.perf_counter() - t0)

    ratio = loader_tps / train_tps
    print(f"\nloader ({data.meta['tokenizer']} tokens, batch {bsz} x {seq + 1}, mesh {dict(mesh.shape)}): "
          f"{loader_tps:,.0f} tokens/s")
    print(f"tiny model training:                          {train_tps:,.0f} tokens/s")
    print(f"loader / training = {ratio:,.1f}x (target >= 20x): {'PASS' if ratio >= 20 else 'FAIL'}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ratio >= 20 else 1


if __name__ == "__main__":
    sys.exit(main())
