"""What a run measures on held-out text: the eval loss and bits per byte of each source's validation split, and of
the mixture.

Design choices:
- The same fixed batches every time: the first `train.eval_batches` batches of each source's unshuffled validation
  split (fewer if the split holds fewer), so that evaluations along a run compare.
- Any text a run trains on is evaluated. A split smaller than `train.batch_size` windows is read in smaller
  batches (`eval_batch_size`): the most that fit, down to the smallest batch the mesh takes (a window per device
  the batch is split over, times a pipeline's microbatches). Text a run prepares holds `MIN_VAL_WINDOWS` at
  least (`data.prepare`'s floor); a prepared directory whose split is below the mesh's floor is a one-line error.
- One source: `eval_loss` and `eval_bpb` over its batches, as before mixtures. A mixture: each source's own as
  `eval_loss/<name>` and `eval_bpb/<name>`, and `eval_loss`/`eval_bpb` their mean weighted by the training weights
  (the loss the training mixture's next window is expected to have). A source of weight 0 is evaluated and left
  out of the mean: a held-out domain.
- Epochs per source (`epochs/<name>`, a mixture's only) are read off the stream's indices (`mixture`), not
  counted as batches are read, so they are the same for any number of processes and after a resume.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from shardlm.data.loader import BatchLoader
from shardlm.data.mixture import Source, windows_per_source
from shardlm.errors import ShardlmError

# Windows the validation split of text a run prepares holds at least (more than any CPU mesh's smallest batch).
MIN_VAL_WINDOWS = 8


def eval_batch_size(batch_size: int, unit: int, windows: int, name: str = "validation split") -> int:
    """The evaluation batch for a split of `windows` windows: `batch_size`, or when the split holds fewer, the most
    windows that are a multiple of `unit` (the smallest batch the mesh takes). Raises below `unit`."""
    if windows >= batch_size:
        return batch_size
    if windows < unit:
        raise ShardlmError(f"the {name} holds {windows} windows, fewer than the {unit} that one evaluation batch "
                           "takes on this mesh (a window per device the batch is split over); use more validation "
                           "text (data.val_fraction, or --val when preparing), or fewer data-parallel devices")
    return windows // unit * unit


class Evaluation:
    """The validation batches of each source, and the numbers they give for a state."""

    def __init__(self, loaders: list[tuple[Source, BatchLoader]], eval_batches: int):
        self.loaders, self.eval_batches = loaders, eval_batches
        self.batches: list[list[jax.Array]] = []

    @property
    def batch_sizes(self) -> set[int]:
        """The batch sizes evaluation reads (the step is compiled for each)."""
        return {loader.batch_size for _, loader in self.loaders}

    @property
    def mixture(self) -> bool:
        return len(self.loaders) > 1

    def load(self) -> None:
        """Read the fixed batches onto the devices (once, after the step is compiled)."""
        for _, loader in self.loaders:
            n = min(self.eval_batches, loader.windows_per_epoch // loader.batch_size)
            self.batches.append([loader.get(i) for i in range(n)])

    def run(self, eval_fn, state) -> dict:
        """{"eval_loss", "eval_bpb"} and, for a mixture, each source's. `eval_fn(state, batch)` takes every size
        in `batch_sizes`."""
        per_source = {}
        for (src, _), batches in zip(self.loaders, self.batches):
            out = jax.device_get([eval_fn(state, b) for b in batches])
            nats, nbytes = sum(float(o["nats"]) for o in out), sum(float(o["bytes"]) for o in out)
            per_source[src.name] = (float(np.mean([o["loss"] for o in out])),
                                    nats / (math.log(2) * max(nbytes, 1.0)), src.weight)
        if not self.mixture:
            loss, bpb, _ = next(iter(per_source.values()))
            return {"eval_loss": loss, "eval_bpb": bpb}
        total = sum(w for _, _, w in per_source.values())
        row = {"eval_loss": sum(loss * w for loss, _, w in per_source.values()) / total,
               "eval_bpb": sum(bpb * w for _, bpb, w in per_source.values()) / total}
        for name, (loss, bpb, _) in per_source.items():
            row[f"eval_loss/{name}"], row[f"eval_bpb/{name}"] = loss, bpb
        return row


def epochs_seen(sources: list[Source], windows_per_epoch: list[int], n_windows: int,
                schedule: list[tuple[int, list[float]]] | None = None) -> dict:
    """{"epochs/<name>": epochs of its training split read} after the stream's first `n_windows` windows (mixed by
    the sources' weights, or by a `schedule` of them), for every source trained on at some point."""
    schedule = schedule or [(0, [s.weight for s in sources])]
    counts = windows_per_source(schedule, n_windows)
    used = [any(w[i] > 0 for _, w in schedule) for i in range(len(sources))]
    return {f"epochs/{s.name}": c / n for s, c, n, u in zip(sources, counts, windows_per_epoch, used) if u and n}
