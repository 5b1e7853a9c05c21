"""Train-step throughput of the reference shape split over processes: 2 x 4 and 4 x 2 against 1 x 8, in one run.

Reference shape (as `throughput.py`): GPT, 4 layers, 8 heads, d_model 256, MLP 1024, vocabulary 50304, context
128, global batch 16, float32. Each layout runs `shardlm bench --json` (the real state, step and strategies,
every strategy interleaved step by step within the run), one process of 8 simulated CPU devices
(`shardlm bench --cpu-devices 8`), or 2 or 4 processes through `shardlm launch`, joined by JAX's distributed
runtime over 127.0.0.1 with gloo carrying the collectives between processes. The layouts take turns for
`--rounds` rounds (drift of a shared machine falls on all of them), and each layout's median over the rounds is
reported, with its ratio to 1 x 8.

    python benchmarks/multihost.py                       # fsdp4+tp2 and dp8, 2 rounds
    python benchmarks/multihost.py --strategies dp8 --rounds 3 --steps 10

On one CPU host the simulated devices of all processes share the same cores, so a ratio below 1 is the cost of
crossing processes (gloo over TCP instead of memory copies within one process), not a speed-up; across real
hosts the same layouts add network time, which `shardlm plan --hosts` estimates.
"""

import argparse
import json
import statistics
import subprocess
import sys

REFERENCE = [
    "model.n_layers=4", "model.n_heads=8", "model.d_model=256", "model.d_mlp=1024", "model.vocab_size=50304",
    "model.seq_len=128", "train.batch_size=16", "data.tokenizer=bytes",
]
LAYOUTS = ((1, 8), (2, 4), (4, 2))  # processes x devices per process


def bench_once(processes: int, devices: int, strategies: str, steps: int) -> dict[str, dict]:
    """{strategy name: shardlm bench's JSON row} for one run of the layout."""
    bench = ["bench", "--strategies", strategies, "--steps", str(steps), "--json", *REFERENCE]
    if processes == 1:
        cmd = [sys.executable, "-m", "shardlm", bench[0], "--cpu-devices", str(devices), *bench[1:]]
    else:
        cmd = [sys.executable, "-m", "shardlm", "launch", "--processes", str(processes), "--cpu-devices",
               str(devices), "--log-dir", f"runs/bench-multihost-{processes}x{devices}", "--", *bench]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{processes} x {devices} failed:\n{proc.stderr[-3000:]}")
    return {r["name"]: r for r in json.loads(proc.stdout)["strategies"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", default="fsdp4+tp2,dp8", help="as shardlm bench names them")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per strategy per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every layout, taking turns")
    args = ap.parse_args()

    runs: dict[tuple[int, int], list[dict[str, dict]]] = {layout: [] for layout in LAYOUTS}
    for r in range(args.rounds):
        for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
            print(f"round {r + 1}: {layout[0]} process(es) x {layout[1]} devices ...", file=sys.stderr, flush=True)
            runs[layout].append(bench_once(*layout, args.strategies, args.steps))

    names = list(runs[LAYOUTS[0]][0])
    print("reference: GPT 4 layers, 8 heads, d_model 256, MLP 1024, vocab 50304, context 128, global batch 16, fp32; "
          f"8 simulated CPU devices in all; median over {args.rounds} run(s) of {args.steps} steps each")
    print(f"{'strategy':<12} {'processes x devices':<20} {'step ms':>8} {'tokens/s':>9} {'vs 1 x 8':>9} "
          f"{'final loss':>10}")
    for name in names:
        base = statistics.median(run[name]["tokens_per_s"] for run in runs[LAYOUTS[0]])
        for layout in LAYOUTS:
            tps = statistics.median(run[name]["tokens_per_s"] for run in runs[layout])
            step = statistics.median(run[name]["step_s"] for run in runs[layout])
            loss = runs[layout][-1][name]["final_loss"]
            print(f"{name:<12} {f'{layout[0]} x {layout[1]}':<20} {step * 1e3:>8.1f} {tps:>9.0f} "
                  f"{tps / base:>8.2f}x {loss:>10.4f}")


if __name__ == "__main__":
    main()
