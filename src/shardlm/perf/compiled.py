"""Compiling a lowered step for the devices it was lowered on (local, simulated, or a target's abstract ones) and
reading what the compiler says about it: memory per device, collectives, FLOPs, and the compiler's own estimate
of its time.

What each compiler gives:
- XLA:CPU (plans on a CPU host): memory analysis, cost analysis (FLOPs), no time estimate. Always through its
  fusion emitters, the default, whatever XLA_FLAGS asks (`CPU_COSTING_OPTIONS`).
- XLA:GPU, deviceless (`--target h100`): memory analysis and the optimised HLO; no cost analysis. The time
  estimate is the latency-hiding scheduler's (`shardlm.perf.schedule`), dumped to a temporary directory. It is
  compiled with the options a run on GPUs gets (`accelerator.GPU_COMPILER_OPTIONS`).
- XLA:TPU (`--target tpu-v5p`): memory analysis (with its own peak), cost analysis with `optimal_seconds` (its
  estimate of the step's time, withheld for a program with loops: `tpu_seconds`). A program too large for the
  chip's memory is refused with RESOURCE_EXHAUSTED: that is reported (`CompiledStep.refusal`, with the
  temporaries it asked for), not raised.

What every compiler logs while compiling is captured, not shown (`xla_log`): the tensors its SPMD partitioner
replicated to reshard them are the step's `rematerialisations`.

FLOPs inside loops: XLA's cost analyses count a `while` body once, and the blocks of a scanned model, the
microbatches of gradient accumulation and a pipeline's iterations are all loops. XLA:CPU's are counted from its
compiled program (`hlo.compiled_flops`: each loop's matmuls times its trip count). For a GPU or TPU the caller
counts the program's matmuls from its jaxpr (`flops.jaxpr_matmul_flops`, loops by their trip counts, fused
attention kernels by their shapes), spread over the devices: the compiled program's loops do not all carry
their trip counts (XLA:GPU's gradient-accumulation loop does not).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import tempfile
import time
from pathlib import Path

from shardlm.accelerator import GPU_COMPILER_OPTIONS, native_stderr_captured
from shardlm.errors import ShardlmError
from shardlm.perf import hlo, kernels, step_cache, xla_log
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
    reported_peak: int = 0  # the compiler's own peak, if it gives one (counting host buffers too: see `peak`)
    # why the compiler's estimate of the step's time is not given although it made one (XLA:TPU's, of a program
    # with loops: `tpu_seconds`)
    compiler_withheld: str | None = None
    host_temp_bytes: int = 0  # temporaries in host memory: activations a remat policy offloads (`model.remat_offload`)
    program: kernels.Program | None = None  # its kernels and collectives in schedule order (none if refused)
    # tensors XLA's partitioner replicated to reshard them (`xla_log`): read from what it logged while compiling
    rematerialisations: list[xla_log.Rematerialisation] = dataclasses.field(default_factory=list)
    cached: bool = False  # read from the step cache (`step_cache`), compiled by an earlier run

    @property
    def peak(self) -> int:
        """Everything the step holds in device memory at its peak: the compiler's figure where it gives one, else
        XLA's device allocations, arguments + outputs - donated aliases + temporaries (an upper bound: a buffer may
        be freed before another is made). Not the compiler's figure for a program that offloads activations to the
        host: XLA:TPU's then counts the host's buffers too, and the allocations bound it instead. Measured on v6e
        (Llama 3.1 8B's layers, FSDP 8, q/k/v, out and layer inputs offloaded; 8 and 32 layers, 3 and 12 rows a
        chip), its peak was the arguments plus the host temporaries each time, to 0.01 GiB: 32.22 GiB = 11.22 +
        21.00 for the full model, whose allocations are 23.41 GiB, and 52.1 GiB for Mistral 7B's recipe, which
        libtpu compiled for a 31.25 GiB chip. Without offload XLA:TPU's peak is the one to hold to HBM: on
        v5e-4, gpt2-small at 640 rows of 1024 compiled with 18.2 GiB of temporaries over the chip's 15.75 GiB,
        under a reported peak of 12.2 GiB (its temporaries are never all live together)."""
        allocations = self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
        if self.host_temp_bytes:
            return allocations
        return self.reported_peak or allocations

    def at_peak(self, state_bytes: int) -> tuple[int, int]:
        """(peak, what the step holds beside its state at the peak: activations, gradients, gathered weights, the
        batch) per device, for a state (parameters and optimizer state) of `state_bytes` per device: so that
        peak = state + the rest, whatever the compiler's own split. Where the peak is XLA:TPU's own figure, its
        temporary allocation (`temp_bytes`) is no part of it, and can exceed it (an unrolled 8-layer llama-tiny on
        8 v5p chips: 35.6 MB of temporaries under a peak of 8.4 MB). A refused program: the temporaries the
        compiler asked for, over the state."""
        if self.refusal is not None:
            return state_bytes + self.temp_bytes, self.temp_bytes
        return self.peak, max(self.peak - state_bytes, 0)


def _first(cost) -> dict:
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return dict(cost or {})


class CompileFailed(ShardlmError):
    """The compiler failed on a step (not a refusal for memory, which is reported): what it said, in one line."""


# Compiler failures whose cause and way round are known: (what the compiler says, what to do).
KNOWN_FAILURES = (
    # XLA:GPU's Triton GEMM emitter finds no tiling for some matmul shapes (for an A100, a [1280, 96] output of a
    # model of width 96); XLA's other GEMM paths (cuBLAS) compile them
    ("Couldn't find output tile sizes", "XLA:GPU's Triton GEMM emitter cannot tile one of the step's matmuls; "
                                        "compile without it: XLA_FLAGS=--xla_gpu_enable_triton_gemm=false"),
)


def _failure(platform: str, error: Exception) -> CompileFailed:
    """`error` from a compiler as one line: the compiler and the first line of what it said (XLA's errors run to
    pages: a C++ stack, the module, the flags), and the way round it where the cause is known (`KNOWN_FAILURES`)."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    compiler = {"gpu": "XLA:GPU", "tpu": "XLA:TPU"}.get(platform, "XLA:CPU")
    hint = next((f" ({fix})" for said, fix in KNOWN_FAILURES if said in first), "")
    return CompileFailed(f"{compiler} failed to compile the step: {first[:400 - len(hint) // 2]}{hint}")


def compile_step(lowered, n_devices: int, *, platform: str = "cpu", matmul_flops: float = 0.0,
                 keep_hlo: bool = False, options: dict | None = None, devices: str = "") -> CompiledStep:
    """Compile `lowered` (a `jax.stages.Lowered`) and read it. `platform` is what it was lowered for.
    `matmul_flops`: the whole program's matrix-multiply FLOPs, counted from its jaxpr with every loop's trip count
    (`shardlm.flops.jaxpr_matmul_flops`): a GPU's or TPU's FLOPs per device, which their compiled programs do not
    show (cuBLAS and fusions hide the matmuls, and cost analysis counts a loop's body once). A compiler's failure
    is raised as `CompileFailed`, one line. What the compiler logs while it compiles is read, not shown: the
    tensors it had to replicate to reshard them become the step's `rematerialisations` (`xla_log`), and the rest
    (a target's runtime noise about hardware this host does not have, libtpu's notes) is dropped. `options`: the
    step's own XLA options (`train.step.step_compiler_options`), over the platform's, as a run compiles it.
    Under `step_cache.caching_steps`, a step compiled before for the same `devices` (what they are: a target's
    name and hosts) is read from the cache instead (`cached` set)."""
    cache = step_cache.active()
    key = cache.key(lowered, n_devices=n_devices, platform=platform, matmul_flops=matmul_flops, keep_hlo=keep_hlo,
                    options=options or {}, devices=devices) if cache else None
    if key is not None and (step := cache.get(key)) is not None:
        step.cached = True
        return step
    program = xla_log.program_name(lowered)
    with native_stderr_captured() as said:
        step = (_compile_gpu(lowered, n_devices, matmul_flops, keep_hlo, options or {}) if platform == "gpu" else
                _compile(lowered, n_devices, platform, matmul_flops, keep_hlo))
    step.rematerialisations = xla_log.rematerialisations(said.text, program, said.thread_id)
    if key is not None:
        cache.put(key, step)
    return step


# XLA:CPU compiles what it costs with its fusion emitters (the default), even where XLA_FLAGS picks its older LLVM
# IR emitters (`--xla_cpu_use_fusion_emitters=false`, which the test suite sets: they compile 2-3x quicker to the
# same buffers). Those expand every scatter into a loop over its indices (an embedding's gradient becomes a `while`
# loop of a trip per token), a program no accelerator runs, which the cost model charges trip by trip: a plan of
# the tiny model read 23 ms a step rather than 2.5.
CPU_COSTING_OPTIONS = {"xla_cpu_use_fusion_emitters": True}


def _compile(lowered, n_devices: int, platform: str, matmul_flops: float, keep_hlo: bool) -> CompiledStep:
    """XLA:CPU or XLA:TPU: memory and cost analysis of the compiled step (XLA:TPU's refusal reported)."""
    t0 = time.perf_counter()
    try:
        compiled = compile_with(lowered, CPU_COSTING_OPTIONS if platform == "cpu" else {})
    except Exception as e:  # XLA:TPU refuses a program larger than HBM (XlaRuntimeError, RESOURCE_EXHAUSTED)
        refusal = out_of_memory(str(e)) if platform == "tpu" else None
        if refusal is None:
            raise _failure(platform, e) from e
        return _refused(n_devices, platform, refusal, time.perf_counter() - t0, matmul_flops)
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    estimate, withheld = tpu_seconds(_first(compiled.cost_analysis()), text) if platform == "tpu" else (None, None)
    flops = hlo.compiled_flops(compiled) if platform == "cpu" else matmul_flops / n_devices
    ops = hlo.collectives(text, n_devices)
    return CompiledStep(mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes,
                        mem.temp_size_in_bytes, ops, flops,
                        compile_s, platform, estimate, hlo_text=text if keep_hlo else "",
                        # XLA:CPU's plans keep the sum below (their numbers predate this field)
                        reported_peak=0 if platform == "cpu" else getattr(mem, "peak_memory_in_bytes", 0) or 0,
                        host_temp_bytes=host_temps(mem), program=kernels.program(text, n_devices, ops),
                        compiler_withheld=withheld)


def compile_with(lowered, options: dict):
    """`lowered.compile()` with the XLA `options`, which are preferences: an option this XLA does not know (a later
    release dropped it, and what it asked for is then the only behaviour) is left out when its error names it (as
    jaxlib 0.10's does), and if the compile fails otherwise, it is tried once as the environment's flags alone
    would have it. If that fails too, the first failure is raised."""
    try:
        return lowered.compile(compiler_options=options or None)
    except Exception as e:
        if not options:
            raise
        unknown = re.search(r"No such compile option: '(\w+)'", str(e))
        if unknown and unknown.group(1) in options:
            return compile_with(lowered, {k: v for k, v in options.items() if k != unknown.group(1)})
        try:
            return lowered.compile()
        except Exception:
            raise e from None


def host_temps(memory_analysis) -> int:
    """Bytes of temporaries the compiler placed in host memory (pinned host: offloaded activations)."""
    return int(getattr(memory_analysis, "host_temp_size_in_bytes", 0) or 0)


def tpu_seconds(cost: dict, hlo_text: str) -> tuple[float | None, str | None]:
    """(XLA:TPU's own estimate of the step's time, or None; why it is withheld, if it is). The estimate is the
    cost analysis's `optimal_seconds`. libtpu 0.0.4x adds -1 to it for every `ConcatBitcast` custom call of the
    program (a sentinel, seen in every program that has them), so those are added back; what is still not
    positive is no estimate. Like its FLOPs, XLA:TPU's cost analysis counts a `while` loop's body once: for a
    step with loops (the scanned layers, gradient accumulation's microbatches, windowed einsums) it is a fraction
    of the step (llama-tiny scanned, 2 then 8 layers: 29 then 49 us; unrolled: 38 then 111 us; llama-1b's 16
    scanned layers on 8 v5p chips read as 399-647% MFU). There it is withheld, with the reason."""
    seconds = cost.get("optimal_seconds")
    if seconds is None:
        return None, None
    seconds = float(seconds) + hlo_text.count('custom_call_target="ConcatBitcast"')
    if seconds <= 0:
        return None, None
    loops = hlo.loop_trips(hlo_text)
    if loops:
        known = sorted({n for n in loops if n is not None}, reverse=True)
        what = ", ".join(f"{n} iterations" for n in known) + (", " if known and None in loops else "") + (
            "a count XLA does not say" if None in loops else "")
        return None, (f"XLA:TPU's optimal_seconds ({seconds * 1e3:.3g} ms) counts a loop's body once, and this step "
                      f"runs {len(loops)} loop{'s' if len(loops) > 1 else ''} ({what})")
    return seconds, None


# What a deviceless XLA:GPU compile changes from a run's, and why: XLA:GPU rewrites a large sort (a mixture of
# experts' routing sort at 2,048-token sequences) into CUB's radix sort, whose kernel it loads from the CUDA
# libraries a CPU host does not have ("Error loading CUDA libraries"). Compiled for, the sort stays XLA's own
# sorting network: the same result, costed as XLA's sort rather than CUB's.
DEVICELESS_GPU_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}


def _compile_gpu(lowered, n_devices: int, matmul_flops: float, keep_hlo: bool, options: dict) -> CompiledStep:
    """XLA:GPU, with the latency-hiding schedule dumped to a directory of our own and read back."""
    dump = Path(tempfile.mkdtemp(prefix="shardlm-xla-gpu-"))
    try:
        t0 = time.perf_counter()
        try:
            compiled = lowered.compile(compiler_options={
                **GPU_COMPILER_OPTIONS, **options,  # as a run on GPUs compiles (`shardlm.accelerator`)
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
