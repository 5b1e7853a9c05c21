"""Does FP8 train as well as bfloat16? The same run twice on this CPU host, the blocks' matmuls in bfloat16 and in
FP8 (`model.matmul_dtype=fp8`; XLA:CPU emulates float8, so this is the GPU's code path, not its speed).

`shardlm train` on the built-in corpus, `model=tiny` (GPT-2's layout, 4 layers of 128), computing in bfloat16, 300
steps, the loss logged every step, both runs from the same seed and data order. Printed: each run's final eval
loss and FP8's over bfloat16's; plotted: both per-step loss curves (`fp8.png`).

    python benchmarks/fp8_quality.py                 # about 10 minutes on a 2-core VM
    python benchmarks/fp8_quality.py --steps 100 --out /tmp/fp8.png
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(run_dir: Path, steps: int, fp8: bool) -> list[dict]:
    cmd = [sys.executable, "-m", "shardlm", "train", "--run-dir", str(run_dir), "--overwrite", "--no-progress",
           "model=tiny", "model.dtype=bfloat16", f"train.steps={steps}", "train.log_interval=1",
           f"train.eval_interval={steps}", "train.eval_batches=16", "checkpoint.every=0"]
    if fp8:
        cmd.append("model.matmul_dtype=fp8")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="fp8.png")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: run(Path(tmp) / name, args.steps, name == "fp8") for name in ("bfloat16", "fp8")}
    final = {name: [r["eval_loss"] for r in rs if "eval_loss" in r][-1] for name, rs in rows.items()}
    for name, loss in final.items():
        print(f"{name}: eval loss {loss:.4f} after {args.steps} steps")
    print(f"fp8 / bfloat16 eval loss: {final['fp8'] / final['bfloat16']:.4f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rs in rows.items():
        steps = [r["step"] for r in rs if "loss" in r]
        ax.plot(steps, [r["loss"] for r in rs if "loss" in r], label=f"{name} (eval {final[name]:.3f})", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"model=tiny, bfloat16 compute: the blocks' matmuls in bfloat16 and in FP8\n"
                 f"({args.steps} steps on a CPU, which emulates float8)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
