"""Pipeline schedules: the order in which a pipeline's stages run their microbatches forward and backward, chosen by
name (`model.pipeline_schedule`), applied to a model from outside it.

Design choices:
- A schedule is one record (`Schedule`): its training loss and its evaluation pass, each given the model and
  `PipelineSettings` (stages, microbatches, circular repeats, the remat unit, a mixture's loss weight), a line
  saying what a stage holds, and the configs it refuses. The built-in ones are GPipe (`gpipe`: a timetable
  scanned as one loop that autodiff differentiates) and 1F1B (`one_f_one_b`: each microbatch's backward pass as
  soon as its loss is known, interleaved under circular repeats). Adding a third is one `register_schedule` in
  this package.
- The model holds no pipeline setting and no schedule branch: it exposes the pieces a schedule composes (its
  embedding `enter`, a block's `block_step`, its `finish` and `head_loss`, the compute view its pass runs on), and
  the trainer asks `loss` and `with_stats` here, which run the model as it is when the blocks are not split over
  stages.
- This layer sits above the models (it runs their pieces) and below the trainer and the planner.
"""

from shardlm.models.stack import LAYERS
from shardlm.schedules.spec import (SCHEDULES, PipelineSettings, Schedule, check_schedule, register_schedule,
                                    schedule_named)
from shardlm.sharding import active_degree

from shardlm.schedules import gpipe, one_f_one_b  # noqa: F401 - the built-in schedules register themselves


def loss(model, tokens, targets, rngs, m, segments=None, z_loss: bool = False, positions=None) -> tuple:
    """(the training loss, the blocks' statistics) of `model` (config `m`) under the active mesh rules: through its
    pipeline schedule when the rules split the stack's layers over stages, else the model's own pass. `segments`:
    documents' ids, which the model's own pass attends within (a pipeline takes none: `train.source` refuses or
    leaves them off). `z_loss`: the statistics hold the mean of log^2 Z too (not on stages: refused there). `positions`: each
    token's, restarting at each document (with the ids)."""
    stages = active_degree(LAYERS)
    if stages <= 1:
        return model.loss(tokens, targets, rngs, segments=segments, z_loss=z_loss, positions=positions)
    return schedule_named(m.pipeline_schedule).loss(model, tokens, targets, rngs, PipelineSettings.of(m, stages))


def with_stats(model, tokens, rngs, m, segments=None, positions=None) -> tuple:
    """(logits, the blocks' statistics) of an evaluation pass, as `loss` runs it: within documents where `segments`
    are given (never on stages, as for `loss`)."""
    stages = active_degree(LAYERS)
    if stages <= 1:
        return model.with_stats(tokens, rngs, segments=segments, positions=positions)
    assert segments is None and positions is None, "a pipeline's schedule takes no documents"
    return schedule_named(m.pipeline_schedule).forward(model, tokens, rngs, PipelineSettings.of(m, stages))


__all__ = ["SCHEDULES", "PipelineSettings", "Schedule", "check_schedule", "loss", "register_schedule",
           "schedule_named", "with_stats"]
