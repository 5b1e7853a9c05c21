"""What XLA says while it compiles, read rather than shown: its involuntary full rematerialisations.

When XLA's SPMD partitioner cannot move a tensor from one sharding to another with a collective it knows, it
replicates the whole tensor on every device and slices the target sharding out of it, and logs a long warning
("[SPMD] Involuntary full rematerialization ... for HLO operation %reduce = f32[512,96] ..."). That is a fact
about the strategy compiled (its bytes and traffic are in the step), so a plan reports it per strategy, in one
line, and keeps the warning itself off the terminal.

Design choices:
- The warning is read from the compile's native stderr (`accelerator.native_stderr_captured`; libtpu writes its
  warnings there too once `TPU_STDERR_LOG_LEVEL` says so, `perf.targets`): JAX has no API for the partitioner's
  diagnostics, and neither the compiled HLO nor a debug option names the replicated tensor.
- Attribution by program name. A plan compiles in several threads at once, all writing to the one descriptor,
  and XLA:CPU and XLA:TPU compile on threads of their own (the thread id in absl's prefix is not the caller's).
  What the warning does carry is the instruction's `op_name`, which begins with the jitted function's name
  ("jit(step)/jvp(embed)/..."): a plan names each candidate's step after it (`train.step.train_step_for`), and a
  compile keeps the warnings about its own program. A warning without an `op_name` is kept by the compile whose
  thread wrote it (XLA:GPU compiles on the caller's).
- What is kept of a warning: the HLO instruction, the whole tensor's shape and bytes (the partitioner names the
  device's piece; its sharding's tiles give the whole), the JAX operation it came from, and the two shardings.
"""

from __future__ import annotations

import dataclasses
import re

from shardlm.perf.hlo import array_bytes
from shardlm.units import fmt_bytes

# absl's prefix: severity, MMDD, time, thread id, file:line]
_RECORD = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+(\d+) [^\]\s]+\] ", re.M)
_REMAT = re.compile(
    r"Involuntary full rematerialization\. The compiler (?:cannot|was not able to) go from sharding "
    r"(?P<source>\{.*?\}) to (?P<target>\{.*?\}) (?:efficiently |without doing a full rematerialization of the "
    r"tensor )?for HLO operation:? %(?P<name>[\w.\-]+) = (?P<shape>.+?) (?P<opcode>[a-z][\w\-]*)\(", re.S)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ARRAY = re.compile(r"^([a-z][a-z0-9]*)\[([\d,]*)\]$")


@dataclasses.dataclass(frozen=True)
class Rematerialisation:
    """A tensor XLA replicated on every device to reshard it."""

    instruction: str  # the HLO instruction's name, e.g. "reduce.12"
    shape: str  # the whole tensor's, which every device then holds: "f32[1024,768]"
    bytes: int
    op_name: str  # the JAX operation it came from, inside the step: "transpose(jvp(embed))/reduce_sum" ("": none)
    source: str  # the sharding it had
    target: str  # the sharding it was wanted in

    def describe(self) -> str:
        return f"{self.shape} ({fmt_bytes(self.bytes)}) at {self.op_name or '%' + self.instruction}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def rematerialisations(text: str, program: str, thread_id: int) -> list[Rematerialisation]:
    """The involuntary full rematerialisations XLA logged in `text` while compiling the program of jitted function
    `program` (its instructions' op_names begin "jit(program)/"; one without an op_name: if thread `thread_id`
    logged it), in order, each once."""
    found: dict[tuple[str, str, str], Rematerialisation] = {}
    starts = list(_RECORD.finditer(text))
    for i, start in enumerate(starts):
        record = text[start.start():starts[i + 1].start() if i + 1 < len(starts) else len(text)]
        m = _REMAT.search(record)
        if m is None:
            continue
        op = _OP_NAME.search(record, m.end())
        scope, _, inside = (op.group(1) if op else "").partition("/")
        ours = scope == f"jit({program})" if op else int(start.group(1)) == thread_id
        if not ours:
            continue
        r = Rematerialisation(m.group("name"), *_whole(m.group("shape"), m.group("source")), inside,
                              m.group("source"), m.group("target"))
        found.setdefault((r.instruction, r.source, r.target), r)
    return list(found.values())


def _whole(piece: str, sharding: str) -> tuple[str, int]:
    """(shape, bytes) of the whole tensor of which `piece` (an HLO shape, with its layout) is one device's part
    under `sharding` ({devices=[2,8,4]<=[64] last_tile_dim_replicate}: 2 x 8 tiles, each held by 4 devices)."""
    shape = re.sub(r"\{[^{}]*\}", "", piece).strip()
    array, tiles = _ARRAY.match(shape), re.search(r"devices=\[([\d,]+)\]", sharding)
    if array is None or tiles is None:
        return shape, array_bytes(shape)
    dims = [int(d) for d in array.group(2).split(",") if d]
    tile = [int(t) for t in tiles.group(1).split(",")]
    listed = re.search(r"last_tile_dims=\{([^}]*)\}", sharding)
    trailing = 1 if "last_tile_dim_replicate" in sharding else len(listed.group(1).split(",")) if listed else 0
    if len(tile) - trailing != len(dims):
        return shape, array_bytes(shape)
    whole = f"{array.group(1)}[{','.join(str(d * t) for d, t in zip(dims, tile))}]"
    return whole, array_bytes(whole)


def program_name(lowered) -> str:
    """The name of the jitted function a `jax.stages.Lowered` holds (its module is "jit_<name>"): what the op_names
    of its instructions begin with, "jit(<name>)/", for a name that is an identifier."""
    module = str(lowered.compiler_ir().operation.attributes["sym_name"]).strip('"')
    return module.removeprefix("jit_")

