"""Where a run's numbers go: metrics.jsonl (one object per logged step), TensorBoard events, and loss.png."""

import json
import math
from pathlib import Path

from tensorboardX import SummaryWriter


class MetricsLogger:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.jsonl = (self.run_dir / "metrics.jsonl").open("a", buffering=1)
        self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.rows: list[dict] = []

    def log(self, row: dict) -> None:
        row = {k: (float(v) if isinstance(v, float) or hasattr(v, "item") else v) for k, v in row.items()}
        self.rows.append(row)
        self.jsonl.write(json.dumps(row) + "\n")
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()
        plot_losses(self.rows, self.run_dir / "loss.png")


def plot_losses(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
