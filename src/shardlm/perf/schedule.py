"""Reading XLA:GPU's latency-hiding schedule: the compiler's own estimate of a step's time, and how much of each
kind of collective it hides behind compute.

XLA:GPU writes the schedule it chose when asked (`--xla_dump_latency_hiding_schedule` with `--xla_dump_to`): a
text `ScheduleProto` holding the optimised module (`hlo_module { computations { instructions { name, opcode, id,
operand_ids } } }`) and, per scheduled computation, each instruction's start and end time in the scheduler's
cycles, with statistics: `total_cycles` and the cycles spent waiting on all-gathers and reduce-scatters
(`*_wasted_cycles`). `cycles_per_microsecond` converts them.

Design choices:
- The step's time is the entry computation's total plus each loop body's total times its trip count (read from
  the compiled HLO, as `shardlm.perf.hlo` counts collectives): the scheduler costs a `while` as one cheap op.
- An async collective is "in flight" from its `-start` to the end of its `-done`; the waiting the scheduler
  reports for its kind is the part compute did not hide. Hidden = 1 - waited / in flight, per kind.
- On Hopper GPUs XLA uses its speed-of-light estimator (GEMMs at the tensor cores' rate, collectives from the
  interconnect); it charges a cuDNN fused-attention call a flat 10 us, so attention is under-counted. Elsewhere
  (an A100) it has no time model and this module reports no estimate.
"""

from __future__ import annotations

import dataclasses
import re

from shardlm.perf.hlo import KINDS, _kind, _parse, _trip_counts

_KIND_WAIT = {"all-gather": "all_gather_wasted_cycles", "reduce-scatter": "reduce_scatter_wasted_cycles"}


@dataclasses.dataclass
class Schedule:
    step_s: float  # the scheduler's estimate of one call of the program
    in_flight_s: dict[str, float]  # per collective kind: summed time from -start to -done
    waited_s: dict[str, float]  # per kind (all-gather, reduce-scatter): time the schedule waits on them

    def hidden_by_kind(self) -> dict[str, float]:
        """{kind: fraction hidden} for the kinds the schedule reports waits on that the step has."""
        return {k: v for k in _KIND_WAIT if (v := self.hidden(k)) is not None}

    def hidden(self, kind: str) -> float | None:
        """The fraction of `kind`'s time in flight that compute hides (None if the step has none)."""
        flight = self.in_flight_s.get(kind, 0.0)
        if flight <= 0 or kind not in _KIND_WAIT:
            return None
        return max(0.0, 1.0 - self.waited_s.get(kind, 0.0) / flight)


def _module_tables(module_text: str) -> tuple[dict[int, str], dict[int, tuple[str, str, list[int]]]]:
    """({computation id: name}, {instruction id: (name, opcode, operand ids)}) from the schedule's hlo_module."""
    computations = {}
    for block in module_text.split("\n  computations {\n")[1:]:
        name = re.match(r'\s*name: "([^"]+)"', block)
        cid = re.search(r"\n    id: (\d+)\n", block)
        if name and cid:
            computations[int(cid.group(1))] = name.group(1)
    instructions = {}
    for block in module_text.split("\n    instructions {\n")[1:]:
        name = re.match(r'\s*name: "([^"]+)"\n\s*opcode: "([^"]+)"', block)
        iid = re.search(r"\n      id: (\d+)\n", block)
        if name and iid:
            operands = [int(x) for x in re.findall(r"\n      operand_ids: (\d+)", block)]
            instructions[int(iid.group(1))] = (name.group(1), name.group(2), operands)
    return computations, instructions


def _async_kind(name: str, opcode: str) -> str | None:
    """The collective an async start begins: its opcode says (`all-gather-start`), or, for the generic
    `async-start` wrapping a reduce-scatter, its name does (`reduce-scatter-start.1`)."""
    if not opcode.endswith("-start"):
        return None
    kind = _kind(name.split(".")[0] if opcode == "async-start" else opcode)
    return kind if kind in KINDS else None


def read_schedule(schedule_text: str, hlo_text: str) -> Schedule | None:
    """The schedule's estimate for the compiled program `hlo_text` (its `as_text()`), or None if the schedule
    holds no time model (every total zero)."""
    module_text, _, rest = schedule_text.partition("\ncomputation_schedules {")
    computations, instructions = _module_tables(module_text)
    times = _trip_counts(_parse(hlo_text))
    done_of = {operands[0]: iid for iid, (_, opcode, operands) in instructions.items()
               if opcode.endswith("-done") and operands}  # an async start's id -> its done's
    step = 0.0
    flight: dict[str, float] = {}
    waited: dict[str, float] = {}
    for block in ("computation_schedules {" + rest).split("\ncomputation_schedules {"):
        cid = re.search(r"computation_id: (\d+)", block)
        total = re.search(r"\n    total_cycles: ([-\d.e+]+)", block)
        if not cid or not total:
            continue
        per_us = float(m.group(1)) if (m := re.search(r"cycles_per_microsecond: ([\d.e+]+)", block)) else 1.0
        scale = times.get(computations.get(int(cid.group(1)), ""), 1) / per_us * 1e-6
        step += float(total.group(1)) * scale
        for kind, stat in _KIND_WAIT.items():
            if m := re.search(rf"\n    {stat}: ([-\d.e+]+)", block):
                waited[kind] = waited.get(kind, 0.0) + float(m.group(1)) * scale
        spans = {}
        for entry in block.split("\n  instructions {\n")[1:]:
            iid = int(re.match(r"\s*id: (\d+)", entry).group(1))
            start = re.search(r"start_timestamp_cycles: ([-\d.e+]+)", entry)
            end = re.search(r"end_timestamp_cycles: ([-\d.e+]+)", entry)
            spans[iid] = (float(start.group(1)) if start else 0.0, float(end.group(1)) if end else 0.0)
        for iid, (start, _) in spans.items():
            name, opcode, _ = instructions.get(iid, ("", "", []))
            kind = _async_kind(name, opcode)
            if kind is None:
                continue
            done = done_of.get(iid)
            if done in spans:
                flight[kind] = flight.get(kind, 0.0) + max(0.0, spans[done][1] - start) * scale
    if step <= 0:
        return None
    return Schedule(step, flight, waited)
