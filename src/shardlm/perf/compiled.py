"""Compiling a lowered step for the devices it was lowered on (local, simulated, or a target's abstract ones) and
reading what the compiler says about it: memory per device, collectives, FLOPs, and the compiler's own estimate
of its time.

What each compiler gives:
- XLA:CPU (plans on a CPU host): memory analysis, cost analysis (FLOPs), no time estimate.
- XLA:GPU, deviceless (`--target h100`): memory analysis and the optimised HLO; no cost analysis. The time
  estimate is the latency-hiding scheduler's (`shardlm.perf.schedule`), dumped to a temporary directory. It is
  compiled with the options a run on GPUs gets (`accelerator.GPU_COMPILER_OPTIONS`).
- XLA:TPU (`--target tpu-v5p`): memory analysis, cost analysis with `optimal_seconds` (its estimate of the
  step's time). A program too large for the chip's memory is refused with RESOURCE_EXHAUSTED: that is reported
  (`CompiledStep.refusal`, with the temporaries it asked for), not raised.

FLOPs inside loops: XLA's cost analyses count a `while` body once, and the blocks of a scanned model, the
microbatches of gradient accumulation and a pipeline's iterations are all loops. XLA:CPU's are counted from its
compiled program (`hlo.compiled_flops`: each loop's matmuls times its trip count). For a GPU or TPU the caller
counts the program's matmuls from its jaxpr (`flops.jaxpr_matmul_flops`, loops by their trip counts, fused
attention kernels by their shapes), spread over the devices: the compiled program's loops do not all carry
their trip counts (XLA:GPU's gradient-accumulation loop does not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import tempfile
import time
from pathlib import Path

from shardlm.accelerator import GPU_COMPILER_OPTIONS, native_stderr_silenced
from shardlm.errors import ShardlmError
from shardlm.perf import hlo, kernels
from shardlm.perf.schedule import Schedule, read_schedule


@dataclasses.dataclass
class CompiledStep:
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    collectives: list[hlo.CollectiveOp]
    flops_per_device: float
    compile_s: float
    platform: str  # what it was compiled for: cpu, gpu, tpu
    compiler_s: float | None = None  # the compiler's own estimate of the step's time
    schedule: Schedule | None = None  # XLA:GPU's, when it has a time model
    hlo_text: str = ""
    refusal: str | None = None  # why the compiler refused the program (it does not fit), if it did
    reported_peak: int = 0  # the compiler's own peak (XLA:TPU's is what it checks against HBM), if it gives one
    host_temp_bytes: int = 0  # temporaries in host memory: activations a remat policy offloads (`model.remat_offload`)
    program: kernels.Program | None = None  # its kernels and collectives in schedule order (none if refused)

    @property
    def peak(self) -> int:
        """Everything the step holds at its peak: the compiler's figure where it gives one, else arguments +
        outputs - donated aliases + temporaries (an upper bound: a buffer may be freed before another is made)."""
        return self.reported_peak or (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes)


def _first(cost) -> dict:
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return dict(cost or {})


class CompileFailed(ShardlmError):
    """The compiler failed on a step (not a refusal for memory, which is reported): what it said, in one line."""


def _failure(platform: str, error: Exception) -> CompileFailed:
    """`error` from a compiler as one line: the compiler and the first line of what it said (XLA's errors run to
    pages: a C++ stack, the module, the flags)."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    compiler = {"gpu": "XLA:GPU", "tpu": "XLA:TPU"}.get(platform, "XLA:CPU")
    return CompileFailed(f"{compiler} failed to compile the step: {first[:400]}")


def compile_step(lowered, n_devices: int, *, platform: str = "cpu", matmul_flops: float = 0.0,
                 keep_hlo: bool = False) -> CompiledStep:
    """Compile `lowered` (a `jax.stages.Lowered`) and read it. `platform` is what it was lowered for.
    `matmul_flops`: the whole program's matrix-multiply FLOPs, counted from its jaxpr with every loop's trip count
    (`shardlm.flops.jaxpr_matmul_flops`): a GPU's or TPU's FLOPs per device, which their compiled programs do not
    show (cuBLAS and fusions hide the matmuls, and cost analysis counts a loop's body once). A compiler's failure
    is raised as `CompileFailed`, one line."""
    if platform == "gpu":
        with native_stderr_silenced():  # XLA:GPU's C++ warnings (e.g. rematerialisation falling short): the
            return _compile_gpu(lowered, n_devices, matmul_flops, keep_hlo)  # report says what they say
    t0 = time.perf_counter()
    try:
        with native_stderr_silenced() if platform == "tpu" else contextlib.nullcontext():
            compiled = lowered.compile()
    except Exception as e:  # XLA:TPU refuses a program larger than HBM (XlaRuntimeError, RESOURCE_EXHAUSTED)
        refusal = out_of_memory(str(e)) if platform == "tpu" else None
        if refusal is None:
            raise _failure(platform, e) from e
        return _refused(n_devices, platform, refusal, time.perf_counter() - t0, matmul_flops)
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    estimate = tpu_seconds(_first(compiled.cost_analysis()), text) if platform == "tpu" else None
    flops = hlo.compiled_flops(compiled) if platform == "cpu" else matmul_flops / n_devices
    ops = hlo.collectives(text, n_devices)
    return CompiledStep(mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes,
                        mem.temp_size_in_bytes, ops, flops,
                        compile_s, platform, estimate, hlo_text=text if keep_hlo else "",
                        # XLA:CPU's plans keep the sum below (their numbers predate this field)
                        reported_peak=0 if platform == "cpu" else getattr(mem, "peak_memory_in_bytes", 0) or 0,
                        host_temp_bytes=host_temps(mem), program=kernels.program(text, n_devices, ops))


def host_temps(memory_analysis) -> int:
    """Bytes of temporaries the compiler placed in host memory (pinned host: offloaded activations)."""
    return int(getattr(memory_analysis, "host_temp_size_in_bytes", 0) or 0)


def tpu_seconds(cost: dict, hlo_text: str) -> float | None:
    """XLA:TPU's own estimate of the step's time (`optimal_seconds`). libtpu 0.0.4x adds -1 to it for every
    `ConcatBitcast` custom call of the program (a sentinel, seen in every program that has them), so those are
    added back; what is still not positive is no estimate."""
    seconds = cost.get("optimal_seconds")
    if seconds is None:
        return None
    seconds = float(seconds) + hlo_text.count('custom_call_target="ConcatBitcast"')
    return seconds if seconds > 0 else None


# What a deviceless XLA:GPU compile changes from a run's, and why: XLA:GPU rewrites a large sort (a mixture of
# experts' routing sort at 2,048-token sequences) into CUB's radix sort, whose kernel it loads from the CUDA
# libraries a CPU host does not have ("Error loading CUDA libraries"). Compiled for, the sort stays XLA's own
# sorting network: the same result, costed as XLA's sort rather than CUB's.
DEVICELESS_GPU_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}


def _compile_gpu(lowered, n_devices: int, matmul_flops: float, keep_hlo: bool) -> CompiledStep:
    """XLA:GPU, with the latency-hiding schedule dumped to a directory of our own and read back."""
    dump = Path(tempfile.mkdtemp(prefix="shardlm-xla-gpu-"))
    try:
        t0 = time.perf_counter()
        try:
            compiled = lowered.compile(compiler_options={
                **GPU_COMPILER_OPTIONS,  # as a run on GPUs compiles (`shardlm.accelerator`)
                **DEVICELESS_GPU_OPTIONS,
                "xla_dump_to": str(dump), "xla_dump_latency_hiding_schedule": True,
                # Only the schedule is read: no IR, PTX or pass-by-pass HLO written beside it.
                "xla_dump_hlo_pass_re": "^$", "xla_dump_hlo_as_text": False})
        except Exception as e:
            raise _failure("gpu", e) from e
        compile_s = time.perf_counter() - t0
        text = compiled.as_text()
        files = sorted(dump.glob("*.schedule.txt"))
        schedule = read_schedule(files[0].read_text(), text) if files else None
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    mem = compiled.memory_analysis()
    ops = hlo.collectives(text, n_devices)
    return CompiledStep(mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes,
                        mem.temp_size_in_bytes, ops, matmul_flops / n_devices, compile_s, "gpu",
                        schedule.step_s if schedule else None, schedule, text if keep_hlo else "",
                        host_temp_bytes=host_temps(mem), program=kernels.program(text, n_devices, ops))


_BYTES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(number: str, unit: str) -> int:
    return int(float(number) * _BYTES[unit.upper()[:1]])


def out_of_memory(message: str) -> str | None:
    """XLA:TPU's refusal of a program too large for the chip's memory, in one line ("Ran out of memory on HBM,
    the total memory required for HLO temporaries (49.20G) exceeds available HBM (95.74G)."), or None if
    `message` is not one."""
    if "RESOURCE_EXHAUSTED" not in message or "memory" not in message.lower():
        return None
    line = next((x for x in message.splitlines() if "RESOURCE_EXHAUSTED" in x), message)
    return re.sub(r"^.*?RESOURCE_EXHAUSTED:\s*(XLA:TPU compile permanent error\.\s*)?", "", line).strip()


# Both spellings libtpu uses: the one-line form of libtpu 0.0.4x, and the older detailed report's first line.
_REFUSED = (re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) "
                       r"exceeds available HBM \(([\d.]+)([KMGT]?)\)"),
            re.compile(r"Used ([\d.]+)([KMGT]?)B? of ([\d.]+)([KMGT]?)B? hbm"))


def refused_bytes(message: str) -> tuple[int, int] | None:
    """(bytes the program asked for, bytes the chip has) from XLA:TPU's out-of-memory message (G = GiB)."""
    for pattern in _REFUSED:
        if m := pattern.search(message):
            return _size(m.group(1), m.group(2)), _size(m.group(3), m.group(4))
    return None


def _refused(n_devices, platform, refusal, compile_s, matmul_flops: float) -> CompiledStep:
    used = refused_bytes(refusal)
    return CompiledStep(0, 0, 0, used[0] if used else 0, [], matmul_flops / n_devices, compile_s, platform,
                        refusal=refusal)
