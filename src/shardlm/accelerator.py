"""Which accelerator the programs being traced are for: the seam between "where shardlm runs" and "what it compiles
for".

Two choices depend on the accelerator and are made while a program is traced: the compute dtype that
`model.dtype=auto` stands for (bfloat16 over float32 master weights on GPUs and TPUs, float32 on a CPU, which
emulates bfloat16 slowly), and the attention implementation that `model.attention=auto` picks (cuDNN's fused
kernel on NVIDIA GPUs of compute capability 8.0 or newer). Both read `current()`.

Design choices:
- `current()` describes the devices JAX runs on, unless a compile for another target is being traced:
  `compiling_for(Accelerator(...))` says so for the duration of a block (`shardlm.perf.targets` uses it when it
  compiles for an H100 or a TPU from a CPU host, and tests use it to resolve the GPU defaults without a GPU).
- A module-level value, not a context variable: tracing happens on the thread that calls `lower`, and XLA's
  compile threads never read it.
- This module imports JAX only when asked about the host or its devices; `import shardlm` asks about the host
  (`quiet_on_hosts_without_accelerators`), and no backend starts until the first array.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class Accelerator:
    platform: str  # "cpu", "gpu" or "tpu", as jax.Device.platform
    device_kind: str  # e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite", "cpu"
    compute_capability: float | None = None  # NVIDIA GPUs only, e.g. 9.0


_override: Accelerator | None = None


def local() -> Accelerator:
    """The accelerator of the devices this process runs on."""
    import jax

    device = jax.devices()[0]
    try:
        capability = float(device.compute_capability) if device.platform == "gpu" else None
    except (AttributeError, TypeError, ValueError):
        capability = None
    return Accelerator(device.platform, device.device_kind, capability)


def current() -> Accelerator:
    """The accelerator being compiled for: a target inside `compiling_for`, else the local devices'."""
    return _override if _override is not None else local()


@contextlib.contextmanager
def compiling_for(accelerator: Accelerator):
    """Trace for `accelerator` within the block, whatever devices this process has."""
    global _override
    before, _override = _override, accelerator
    try:
        yield accelerator
    finally:
        _override = before


# XLA:GPU options for the programs shardlm compiles: with the blocks scanned (`model.scan_layers`), the gathers of
# a layer's FSDP shards, the reduce-scatters of its gradients and its all-reduces sit inside the scan's loop, and
# XLA:GPU overlaps them with the neighbouring iterations' compute only when told to pipeline them (compiled for
# gpt2-small FSDP 8 on 8 H100s: 3% of the gathers' time hidden without, 76% with). The target compiles
# (`shardlm.perf.compiled`) pass them as compiler options; a run on GPUs gets them in XLA_FLAGS (`gpu_xla_flags`).
GPU_COMPILER_OPTIONS = {
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
}


# What a step under sequence parallelism (`mesh.sequence_parallel`) changes: its all-gathers of the residual stream
# depend on the microbatch, and XLA:GPU's collective pipeliner pipelines them across gradient accumulation's loop
# by running the next microbatch's forward pass a second time (compiled for 16 H100s, Nemotron-4 15B's shape at
# TP 4, 4 microbatches: 9% more FLOPs, the forward layers' loop twice per iteration; Llama 3.1 70B's pipeline on
# 64: 22% more). Without pipelined all-gathers it runs the model's FLOPs (`shardlm.train.step`).
SEQUENCE_PARALLEL_GPU_OPTIONS = {"xla_gpu_enable_pipelined_all_gather": False}


def gpu_xla_flags() -> None:
    """On a host with an NVIDIA GPU, add `GPU_COMPILER_OPTIONS` to XLA_FLAGS (those the user set win). Before JAX
    starts its backends."""
    import os

    try:
        from jax._src import hardware_utils as hw

        if not hw.has_visible_nvidia_gpu():
            return
    except Exception:  # noqa: BLE001 - a JAX that moved its checks, or a host it cannot read: leave the flags
        return
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f"--{k}={str(v).lower()}" for k, v in GPU_COMPILER_OPTIONS.items() if f"--{k}=" not in flags]
    os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


DTYPE_NAMES = ("float32", "bfloat16")  # what a model stores (model.param_dtype) and computes (model.dtype) in
COMPUTE_DTYPES = ("auto", *DTYPE_NAMES)  # auto: bfloat16 on GPUs and TPUs, float32 on a CPU


def default_compute_dtype(platform: str) -> str:
    """What `model.dtype=auto` computes in: bfloat16 where the matrix units run it natively (GPU, TPU)."""
    return "bfloat16" if platform in ("gpu", "tpu") else "float32"


def resolve_dtype(name: str) -> str:
    """A compute dtype's name with "auto" resolved for the accelerator being compiled for."""
    return default_compute_dtype(current().platform) if name == "auto" else name


def multiplies_fp8(accelerator: Accelerator) -> bool:
    """Whether `accelerator` runs float8 matmuls: NVIDIA GPUs of compute capability 8.9 and up (Ada, Hopper and
    later: FP8 tensor cores), and the CPU, whose XLA emulates the float8 types (so the tests run the real code)."""
    if accelerator.platform == "cpu":
        return True
    return accelerator.platform == "gpu" and (accelerator.compute_capability or 0.0) >= 8.9


def visible_accelerator() -> bool:
    """Whether this host shows an NVIDIA or AMD GPU or a TPU chip to JAX (read from /proc and /sys by JAX's own
    checks; nothing is initialised)."""
    try:
        from jax._src import hardware_utils as hw
    except ImportError:  # a JAX that moved its checks: assume there may be one
        return True
    try:
        return bool(hw.has_visible_nvidia_gpu() or hw.num_available_amd_gpus(stop_at=1)
                    or hw.num_available_tpu_chips_and_device_id()[0])
    except Exception:  # noqa: BLE001 - a check that cannot read the host says nothing either way
        return True


@contextlib.contextmanager
def native_stderr_silenced():
    """File descriptor 2 is kept from the terminal inside the block. libtpu and the CUDA plugin log from C++ when
    they load on a host without their hardware ("could not determine TPU accelerator type", "Could not find cuda
    drivers"): expected there, and nothing the user can act on. Python's errors still reach the caller as
    exceptions, and Python's own writes to `sys.stderr` (progress lines from other threads) still reach the
    terminal: `sys.stderr` writes to a copy of the real descriptor meanwhile (if it wrote to descriptor 2; a
    stream of Python's own, such as a test's capture, is left as it is). Reentrant across threads (a plan
    compiles in several): the first block in redirects, the last one out restores, so a block ending while
    another runs can neither restore too early nor restore the redirection."""
    with _native_stderr_redirected():
        yield


@dataclasses.dataclass
class NativeOutput:
    """What native code wrote to file descriptor 2 while a `native_stderr_captured` block ran (every thread's:
    other blocks may run at once), and the native id of the thread that ran the block, which XLA's log lines
    carry (absl's prefix), so a reader can keep its own."""

    thread_id: int
    text: str = ""


@contextlib.contextmanager
def native_stderr_captured():
    """`native_stderr_silenced`, keeping what native code wrote meanwhile: the block's `NativeOutput` holds it once
    the block ends (a compiler's warnings, read rather than shown: `shardlm.perf.xla_log`)."""
    import os

    out = NativeOutput(threading.get_native_id())
    with _native_stderr_redirected() as sink:
        start = os.fstat(sink).st_size
        try:
            yield out
        finally:  # read before the last block out closes the sink
            end = os.fstat(sink).st_size
            out.text = os.pread(sink, end - start, start).decode("utf-8", "replace")


@contextlib.contextmanager
def _native_stderr_redirected():
    """Descriptor 2 into an unnamed temporary file (the sink, yielded) while any block is in: a captured block reads
    its part of it, a silenced one does not; the file goes when the last block ends."""
    import os
    import sys
    import tempfile

    with _SILENCED_LOCK:
        if _silenced["depth"] == 0:
            sys.stderr.flush()
            _silenced["saved"] = os.dup(2)
            _silenced["stderr"], _silenced["copy"] = sys.stderr, None
            if _writes_to_descriptor_2(sys.stderr):  # else Python's lines go where they went (a test's capture)
                _silenced["copy"] = sys.stderr = os.fdopen(os.dup(_silenced["saved"]), "w", buffering=1,
                                                           encoding=sys.stderr.encoding, errors=sys.stderr.errors)
            _silenced["sink"] = tempfile.TemporaryFile()
            os.dup2(_silenced["sink"].fileno(), 2)
        _silenced["depth"] += 1
        sink = _silenced["sink"].fileno()
    try:
        yield sink
    finally:
        with _SILENCED_LOCK:
            _silenced["depth"] -= 1
            if _silenced["depth"] == 0:
                sys.stderr.flush()
                if _silenced["copy"] is not None:
                    _silenced["copy"].close()
                    if sys.stderr is _silenced["copy"]:
                        sys.stderr = _silenced["stderr"]
                os.dup2(_silenced["saved"], 2)
                os.close(_silenced["saved"])
                _silenced["sink"].close()


def _writes_to_descriptor_2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False


_SILENCED_LOCK = threading.Lock()
_silenced: dict = {"depth": 0, "saved": -1, "stderr": None, "copy": None, "sink": None}


def cpu_unless_accelerator() -> bool:
    """With the `targets` extra installed (the CUDA PJRT plugin, libtpu) on a host without a GPU or TPU, JAX
    would try every plugin at start-up and print their failures (a traceback from the CUDA plugin, libtpu's
    errors) before settling on the CPU. When the user has chosen no platform and the host shows no accelerator,
    start on the CPU directly. True if JAX will run on the CPU alone (so chosen here or by the user). Call before
    JAX's backends start; then `start_cpu_quietly`."""
    import logging
    import os

    # The CUDA plugin's optional extension (GPU memory stats) is absent without a GPU runtime; nothing needs it.
    logging.getLogger("jax_plugins.xla_cuda12").setLevel(logging.ERROR)

    chosen = os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME")
    if chosen:
        return chosen.strip().lower() == "cpu"
    if visible_accelerator():
        return False
    import jax

    jax.config.update("jax_platforms", "cpu")
    return True


def quiet_on_hosts_without_accelerators() -> None:
    """What `import shardlm` does so that a script (an example, a user's) starts JAX as quietly as the CLI: on a
    host that shows no accelerator, run on the CPU unless the user chose a platform, and register JAX's plugins
    now, with their C++ start-up lines silenced (the CUDA plugin says it found no driver even when JAX runs on
    the CPU alone). Registering starts no backend, so `--cpu-devices`, XLA_FLAGS and `jax.distributed` still take
    effect afterwards. A JAX without the private registration hook is left as it is: only noisier."""
    import logging
    import os

    logging.getLogger("jax_plugins.xla_cuda12").setLevel(logging.ERROR)
    if visible_accelerator():
        return
    import jax
    from jax._src import xla_bridge

    if not (os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME")):
        jax.config.update("jax_platforms", "cpu")
    register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if register is not None and not xla_bridge.backends_are_initialized():
        with native_stderr_silenced():
            register()


def start_cpu_quietly() -> None:
    """Start JAX's backends (the CPU's, with the installed plugins registered) with the plugins' C++ start-up
    lines silenced: on a host `cpu_unless_accelerator` found without accelerators they only say so. After a
    multi-process run has joined (`jax.distributed` must come before the backends)."""
    import jax

    with native_stderr_silenced():
        jax.devices()
