"""Decode throughput with the KV cache against the naive full-recompute decoder, measured in one run.

    python benchmarks/generate.py                          # CPU, 1 device: model=small (context 256), batch 1, 2 and 8
    python benchmarks/generate.py --batches 1 --new-tokens 240 --prompt-tokens 16
    python benchmarks/generate.py --cpu-devices 8 mesh.tensor=4   # decoding on a simulated data 2 x tensor 4 mesh
    python benchmarks/generate.py --gpu model=gpt2-small          # on the accelerator

Three decoders: `cached` and `naive` are the real `shardlm.generate.Generator` with and without the KV cache (the
naive one re-runs the whole padded context every step but applies the output head at one position, as nanoGPT
does); `seed 002` (batch 1 only, as in the seed) is seed 002's `generate_text` loop: the padded context built on
the host, the whole model with the logits of every position, the token read back, every step.
The Generator decoders run on a freshly initialised model (decoding speed does not
depend on the weights' values) with the GPT-2 vocabulary size by default, greedily, with the end-of-text token
disabled so that every row produces exactly --new-tokens tokens after a --prompt-tokens prompt; prompt plus new
tokens fill the context. For each batch size the two decoders alternate --repeats times (the host is shared and
noisy) and the median is kept. Decode tokens/s counts the new tokens of all rows after the first, over the time
from the first token to the last (the steady decode rate); the time to the first token (the prefill for the cache,
one full step for the naive decoder) is printed apart. Compiles are excluded. The script also checks that both
decoders produced the same tokens.

Why the ratio grows with the batch: a cached decode step reads every weight once to produce one token per row, so
at batch 1 it is bound by memory bandwidth; a naive step multiplies the same weights by the whole context, so it is
bound by FLOPs. At batch 1 their ratio is therefore about context/2 x B/F for float32 weights, B the host's memory
bandwidth in bytes/s and F its FLOP/s, whatever the model; batching amortises the cached step's weight reads and
the ratio grows with it.
"""

import argparse
import json
import statistics
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", default=[], help="config overrides (default: model=small)")
    p.add_argument("--batches", default="1,2,8", help="comma-separated batch sizes (default 1,2,8)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default: half the context")
    p.add_argument("--new-tokens", type=int, default=None, help="default: the rest of the context")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary size (default GPT-2's)")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N", help="simulate N CPU devices")
    p.add_argument("--gpu", action="store_true", help="run on the accelerator")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not args.gpu:
        from shardlm.mesh import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices or 1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from shardlm.config import load_config
    from shardlm.generate import Generator
    from shardlm.mesh import mesh_from_config
    from shardlm.sampling import Sampling
    from shardlm.train.state import init_model

    overrides = list(args.overrides)
    if not any(o.startswith("model=") for o in overrides):
        overrides.insert(0, "model=small")
    cfg = load_config(None, overrides)
    mesh = mesh_from_config(cfg.mesh)
    context = cfg.model.seq_len
    prompt_tokens = args.prompt_tokens or context // 2
    new_tokens = args.new_tokens or context - prompt_tokens
    if prompt_tokens + new_tokens > context:
        sys.exit(f"--prompt-tokens + --new-tokens must fit the context of {context}")
    graphdef, state = init_model(cfg, mesh, args.vocab)
    greedy = Sampling(temperature=0)
    rng = np.random.default_rng(0)
    gens = {name: Generator(graphdef, state, mesh, eot_id=-1, use_cache=cached, max_batch=1024)
            for name, cached in (("cached", True), ("naive", False))}

    def seed002_tokens_per_s(prompt: list[int]) -> tuple[float, list[int]]:
        """Seed 002's loop (greedy here): per token, the padded context from the host through a jitted forward
        that computes all positions' logits, then the token at the last position read back."""
        model_step = jax.jit(lambda s, buf, i: jnp.argmax(nnx.merge(graphdef, s)(buf)[0, i]))
        def one(tokens):
            padded = np.zeros((1, context), np.int32)
            padded[0, : len(tokens)] = tokens
            return int(model_step(state, padded, len(tokens) - 1))
        one(prompt)  # compile
        out, t0 = [], 0.0
        for i in range(new_tokens):
            out.append(one(prompt + out))
            if i == 0:
                t0 = time.perf_counter()
        return (new_tokens - 1) / (time.perf_counter() - t0), out

    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [rng.integers(0, args.vocab, prompt_tokens).tolist() for _ in range(batch)]
        speeds = {name: [] for name in gens}
        first = {name: [] for name in gens}
        outputs = {}
        for name, gen in gens.items():  # compile (and warm up) both first
            gen.generate(prompts, 2, greedy)
        for _ in range(args.repeats):
            for name, gen in gens.items():
                done = gen.generate(prompts, new_tokens, greedy)
                assert all(len(c.ids) == new_tokens for c in done)
                decode_s = max(c.seconds for c in done) - done[0].first_token_s
                speeds[name].append(batch * (new_tokens - 1) / decode_s)
                first[name].append(done[0].first_token_s)
                outputs[name] = [c.ids for c in done]
        if batch == 1:
            runs = [seed002_tokens_per_s(prompts[0]) for _ in range(args.repeats)]
            seed002 = statistics.median(r[0] for r in runs)
            seed002_same = runs[0][1] == outputs["cached"][0]
        cached, naive = (statistics.median(speeds[n]) for n in ("cached", "naive"))
        results.append({"batch": batch, "cached_tokens_per_s": round(cached, 1), "naive_tokens_per_s": round(naive, 1),
                        "ratio": round(cached / naive, 1), "same_tokens": outputs["cached"] == outputs["naive"],
                        **({"seed002_tokens_per_s": round(seed002, 1), "ratio_to_seed002": round(cached / seed002, 1),
                            "seed002_same_tokens": seed002_same} if batch == 1 else {}),
                        "cached_first_token_ms": round(1e3 * statistics.median(first["cached"]), 1),
                        "naive_first_token_ms": round(1e3 * statistics.median(first["naive"]), 1),
                        "cached_runs": [round(s, 1) for s in speeds["cached"]],
                        "naive_runs": [round(s, 1) for s in speeds["naive"]]})

    n_params = sum(x.size for x in jax.tree.leaves(state))
    head = {"device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
            "mesh": dict(mesh.shape), "model": cfg.model.preset, "params": int(n_params), "context": context,
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": args.repeats}
    if args.json:
        print(json.dumps({**head, "results": results}, indent=2))
        return
    print(f"{head['model']} ({n_params / 1e6:.1f}M parameters, vocabulary {args.vocab}), context {context}: "
          f"{prompt_tokens}-token prompts + {new_tokens} new tokens, greedy; {head['device']}, mesh "
          + " x ".join(f"{k} {v}" for k, v in mesh.shape.items()) + f"; median of {args.repeats}")
    print(f"{'batch':>5}  {'cached tok/s':>12}  {'naive tok/s':>11}  {'ratio':>6}  "
          f"{'first token ms (cached/naive)':>29}  same tokens")
    for r in results:
        print(f"{r['batch']:>5}  {r['cached_tokens_per_s']:>12.1f}  {r['naive_tokens_per_s']:>11.1f}  "
              f"{r['ratio']:>5.1f}x  {r['cached_first_token_ms']:>14.1f} / {r['naive_first_token_ms']:<12.1f}  "
              f"{'yes' if r['same_tokens'] else 'NO'}")
    for r in results:
        if "seed002_tokens_per_s" in r:
            print(f"batch {r['batch']}, seed 002's loop: {r['seed002_tokens_per_s']:.1f} tok/s; cached / seed 002 = "
                  f"{r['ratio_to_seed002']:.1f}x; same tokens: {'yes' if r['seed002_same_tokens'] else 'NO'}")


if __name__ == "__main__":
    main()
