"""The schedule record (`Schedule`), a pipeline's settings (`PipelineSettings`) and the registry: what
`shardlm.schedules` exports, kept apart from the built-in schedules so that they import it and it imports none of
them."""

from __future__ import annotations

import dataclasses
from typing import Callable

from shardlm.errors import check_one_of
from shardlm.models import remat


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """What a schedule runs with, from the model config and the mesh: the settings the model no longer holds."""

    stages: int  # the mesh's pipeline stages (the rule table splits the stack's `layers` over them)
    microbatches: int  # model.pipeline_microbatches (0 = one per stage)
    repeats: int  # model.pipeline_repeats: circular repeats, each stage holding its layers of every repeat
    remat: str  # model.pipeline_remat: iteration | layer
    aux_loss_weight: float  # a mixture's load-balancing loss weight in the objective (0 for a dense model)

    @classmethod
    def of(cls, m, stages: int) -> PipelineSettings:
        return cls(stages, m.pipeline_microbatches, m.pipeline_repeats, m.pipeline_remat,
                   m.moe_aux_loss_weight if m.moe_experts else 0.0)

    def remat_unit(self, model) -> str:
        """What the model's remat policy rematerialises in the pipeline. Where the policy keeps each layer's input,
        checkpointing the layers inside the iteration too costs no recomputation, and spares the backward pass the
        recomputed elementwise work of all K layers at once."""
        return "layer" if remat.keeps_block_inputs(model.remat, model.remat_offload) else self.remat


def _accepts(m) -> None:
    """The check of a schedule that takes every model config."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str  # model.pipeline_schedule's value
    # (model, tokens, targets, rngs, settings) -> (mean loss, the blocks' statistics): a training step's loss
    loss: Callable
    # (model, tokens, rngs, settings) -> (logits, the blocks' statistics): an evaluation pass
    forward: Callable
    # (stages, microbatches, repeats, n_layers) -> what a stage holds, for `explain`'s line about the pipeline
    holds: Callable[[int, int, int, int], str]
    head_per_microbatch: bool = False  # the fused head and loss run inside the loop, once per microbatch
    check: Callable = _accepts  # model configs it cannot run, each a one-line error


SCHEDULES: dict[str, Schedule] = {}


def register_schedule(schedule: Schedule) -> Schedule:
    SCHEDULES[schedule.name] = schedule
    return schedule


def schedule_named(name: str) -> Schedule:
    check_one_of("model.pipeline_schedule", name, tuple(SCHEDULES))
    return SCHEDULES[name]


def check_schedule(m) -> None:
    """`model.pipeline_schedule` names a registered schedule that can run `m`, or a one-line error."""
    schedule_named(m.pipeline_schedule).check(m)


__all__ = ["PipelineSettings", "SCHEDULES", "Schedule", "check_schedule", "register_schedule",
           "schedule_named"]
