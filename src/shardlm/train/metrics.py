"""Where a run's numbers go: metrics.jsonl (one object per logged step), TensorBoard events, and loss.png."""

import json
import math
import sys
from pathlib import Path


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch. tensorboardX's writer imports torch whenever it is
    installed (the `test` extras and many GPU hosts have it), only to accept torch tensors, which shardlm never
    passes; that import took 3-5 s of every `shardlm` command's start on a 2-core host. Its other uses of torch are
    imports inside functions shardlm does not call. A process that already imported torch keeps it."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


SummaryWriter = _summary_writer_class()


class MetricsLogger:
    """`resume_step`: continue a run from that checkpoint step. Rows logged after it (by the interrupted process)
    are dropped from metrics.jsonl, and TensorBoard is told to purge its events from the next step on, so each
    step appears once in both. `write=False` (the processes of a run other than process 0) keeps the rows in
    memory and writes nothing."""

    def __init__(self, run_dir: Path, resume_step: int | None = None, write: bool = True):
        self.run_dir = Path(run_dir)
        self.write = write
        path = self.run_dir / "metrics.jsonl"
        self.rows: list[dict] = []
        if resume_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a kill
                    continue
                if row.get("step", resume_step + 1) <= resume_step:
                    self.rows.append(row)
        if not write:
            return
        if resume_step is not None and path.exists():
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            tmp.replace(path)
        self.jsonl = path.open("a" if resume_step is not None else "w", buffering=1)
        purge = None if resume_step is None else resume_step + 1
        self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)

    def log(self, row: dict) -> None:
        row = {k: (float(v) if isinstance(v, float) or hasattr(v, "item") else v) for k, v in row.items()}
        self.rows.append(row)
        if not self.write:
            return
        self.jsonl.write(json.dumps(row) + "\n")
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if not self.write:
            return
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
    for name in dict.fromkeys(k.split("/", 1)[1] for r in rows for k in r if k.startswith("eval_loss/")):
        points = [(r["step"], r[f"eval_loss/{name}"]) for r in rows if f"eval_loss/{name}" in r]
        ax.plot(*zip(*points), "o--", label=f"eval loss: {name}")  # a mixture's sources, beside the mixture's
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
