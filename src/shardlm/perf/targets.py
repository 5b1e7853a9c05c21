"""Accelerators shardlm compiles for without having them: `--target h100`, `--target tpu-v5p`, ...

A target is a name a user types, what the cost model needs to know of the chip (dense peak, memory, links), and
how to get abstract devices of it that XLA compiles for from any host:

- NVIDIA GPUs through XLA:GPU's deviceless compile: `jax.experimental.topologies.get_topology_desc(platform=
  "cuda", target_config=TEXT, topology="slices x hosts x devices")`, where TEXT is the GPU's target description
  (a `GpuTargetConfigProto` in text form: openxla/xla's `xla/backends/gpu/target_config/specs/`, shipped in
  `gpu_specs/` with the fields a deviceless compile needs beside `gpu_device_info`). It needs the
  `jax-cuda12-pjrt` package at exactly the installed jaxlib's version (the `targets` extra).
- TPUs through libtpu (`jax[tpu]` at the installed JAX's version): `get_topology_desc(platform="tpu",
  topology_name="v5e:2x4", ...)`, the way MaxText's `train_compile.py` does it.

Design choices:
- The table holds datasheet numbers, each with its source in a comment; the compiler's own description of the
  chip (memory size) wins where it has one.
- Between hosts, GPUs talk over the network (InfiniBand per GPU); a TPU slice is one ICI network across its
  hosts, so a TPU target's "hosts" cost like its links.
- A missing package or an unknown name is a one-line error that names the fix (`TargetUnavailable`).
- The runtime's noise (libtpu's "no TPU found" logs, the CUDA plugin's missing-driver lines) is kept from the
  user: `shardlm.accelerator.native_stderr_silenced` around the calls that print it. libtpu is told to log its
  warnings to stderr (`TPU_STDERR_LOG_LEVEL`) rather than only to /tmp/tpu_logs, so that a compile reads what
  XLA:TPU's partitioner says about the step (`shardlm.perf.xla_log`), as XLA:CPU's and XLA:GPU's is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import os
from pathlib import Path

from shardlm.accelerator import Accelerator, native_stderr_silenced
from shardlm.errors import ShardlmError
from shardlm.models.config import FP8
from shardlm.perf.costmodel import Hardware, devices_per_host, inter_host_bw_per_device

SPECS = Path(__file__).with_name("gpu_specs")


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # what --target takes
    label: str
    platform: str  # "gpu" or "tpu"
    device_kind: str  # as jax.Device.device_kind reports it
    memory_bytes: float  # per device
    peak_flops: dict  # dense, per device, by compute dtype
    link_bw: float  # bytes/s per device, one direction, within a host (NVLink) or a slice (ICI)
    network_bw: float  # bytes/s per device between hosts (a GPU's NIC); ICI for a TPU slice
    devices_per_host: int
    compute_capability: float | None = None  # GPUs
    spec: str = ""  # GPUs: the file in gpu_specs/
    tpu_version: str = ""  # TPUs: "v4", "v5e", "v5p" ("v5" to libtpu), "v6e"
    chip_config: str = "default"  # TPUs: "megacore" where two TensorCores act as one device (v4, v5p)
    memory_bw: float = 0.0  # HBM bytes/s per device (datasheet)
    efficiency: str = ""  # its table in perf/efficiency/ ("": kernels at the peak and memory bandwidth)

    @property
    def accelerator(self) -> Accelerator:
        return Accelerator(self.platform, self.device_kind, self.compute_capability)

    def hardware(self, dtype: str, n_devices: int, hosts: int | None = None,
                 memory_bytes: float | None = None, inter_host_bandwidth: str | None = None) -> Hardware:
        """The cost model's view of `n_devices` of this target over `hosts` hosts (default: full hosts), their
        network the target's NICs unless `inter_host_bandwidth` (a host's, e.g. '100Gb/s') says otherwise."""
        # A TPU slice is one ICI network across its hosts: unless told otherwise, cost it as one "host".
        default = n_devices if self.platform == "tpu" else self.devices_per_host
        per_host = devices_per_host(n_devices, hosts, None) if hosts else default
        network = self.network_bw if inter_host_bandwidth is None else inter_host_bw_per_device(
            per_host, inter_host_bandwidth, None)
        return Hardware(name=self.label, peak_flops=self.peak_flops[dtype],
                        memory_bytes=memory_bytes or self.memory_bytes, intra_node_bw=self.link_bw,
                        inter_node_bw=network, devices_per_node=per_host, latency_s=10e-6,
                        memory_bw=self.memory_bw, efficiency=self.efficiency,
                        fp8_peak_flops=self.peak_flops.get(FP8))


GiB = 2**30
TARGETS = {t.name: t for t in (
    # NVIDIA datasheets: H100 SXM 989 TFLOP/s dense bf16 (494.5 TF32, 1,979 FP8), 3.35 TB/s HBM3, NVLink 4 at
    # 900 GB/s both directions, one 400 Gb/s NIC per GPU; H200 the same chip with 141 GB of HBM3e at 4.8 TB/s (so
    # H100's kernel tables, with its memory bandwidth); A100 SXM 312 TFLOP/s bf16, 2,039 GB/s HBM2e, NVLink 3 at
    # 600 GB/s both directions, one 200 Gb/s NIC per GPU.
    Target("h100", "H100 SXM 80GB", "gpu", "NVIDIA H100 80GB HBM3", 80 * GiB,
           {"bfloat16": 989e12, "float32": 494.5e12, FP8: 1979e12}, 450e9, 50e9, 8, 9.0, spec="h100_sxm.txtpb",
           memory_bw=3.35232e12, efficiency="h100"),
    Target("h200", "H200 SXM 141GB", "gpu", "NVIDIA H200", 141e9,
           {"bfloat16": 989e12, "float32": 494.5e12, FP8: 1979e12}, 450e9, 50e9, 8, 9.0, spec="h200.txtpb",
           memory_bw=4.8e12, efficiency="h100"),
    Target("a100-80gb", "A100 SXM 80GB", "gpu", "NVIDIA A100-SXM4-80GB", 80 * GiB,
           {"bfloat16": 312e12, "float32": 156e12}, 300e9, 25e9, 8, 8.0, spec="a100_sxm_80.txtpb",
           memory_bw=2.039e12),
    # Google Cloud TPU system architecture pages: peak bf16 per chip, ICI bandwidth per chip (half of it counted
    # per direction), HBM bandwidth per chip (v4 1,200, v5e 819, v5p 2,765, v6e 1,640 GB/s); float32 matmuls run
    # as bf16 passes at JAX's default precision. No per-shape kernel table is published for TPUs: their kernels are
    # costed at these peaks and bandwidths (`shardlm.perf.rates`). Memory: the HBM libtpu says
    # a program may use (its out-of-memory message's "available HBM"), a little under the datasheet's.
    Target("tpu-v4", "TPU v4", "tpu", "TPU v4", 30.75 * GiB, {"bfloat16": 275e12, "float32": 275e12},
           150e9, 150e9, 4, tpu_version="v4", chip_config="megacore", memory_bw=1.2e12),
    Target("tpu-v5e", "TPU v5e", "tpu", "TPU v5 lite", 15.75 * GiB, {"bfloat16": 197e12, "float32": 197e12},
           100e9, 100e9, 4, tpu_version="v5e", memory_bw=8.19e11),
    Target("tpu-v5p", "TPU v5p", "tpu", "TPU v5", 95.74 * GiB, {"bfloat16": 459e12, "float32": 459e12},
           300e9, 300e9, 4, tpu_version="v5", chip_config="megacore", memory_bw=2.765e12),
    Target("tpu-v6e", "TPU v6e (Trillium)", "tpu", "TPU v6 lite", 31.25 * GiB, {"bfloat16": 918e12, "float32": 918e12},
           224e9, 224e9, 4, tpu_version="v6e", memory_bw=1.64e12),
)}


class TargetUnavailable(ShardlmError):
    """A target whose compiler is not installed here."""


def get(name: str) -> Target:
    if name not in TARGETS:
        raise ShardlmError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    return TARGETS[name]


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_installed(target: Target) -> None:
    """Raise `TargetUnavailable` (one line, with the install command) if `target`'s compiler is missing here."""
    jaxlib, jax = _installed("jaxlib"), _installed("jax")
    if target.platform == "gpu":
        have = _installed("jax-cuda12-pjrt")
        if have != jaxlib:
            what = f"jax-cuda12-pjrt {have} does not match jaxlib {jaxlib}" if have else "XLA:GPU is not installed"
            raise TargetUnavailable(f"--target {target.name}: {what}; install it with pip install "
                                    f"'shardlm[targets]' (or pip install jax-cuda12-pjrt=={jaxlib})")
    else:
        have = _installed("libtpu")
        if not have:
            raise TargetUnavailable(f"--target {target.name}: XLA:TPU (libtpu) is not installed; install it with "
                                    f"pip install 'shardlm[targets]' (or pip install 'jax[tpu]=={jax}')")


def topology(target: Target, n_devices: int, hosts: int | None = None):
    """Abstract devices of `target`: `n_devices` of them over `hosts` hosts (default: full hosts). Nothing is
    allocated; XLA compiles for them as for real ones."""
    check_installed(target)
    if n_devices < 1:
        raise ShardlmError(f"--devices must be at least 1, got {n_devices}")
    try:
        return _topology(target.name, n_devices, hosts)
    except ShardlmError:
        raise
    except Exception as e:  # the plugin's own refusal (JaxRuntimeError): its first line says what
        raise ShardlmError(f"--target {target.name} --devices {n_devices}: its compiler cannot lay out these "
                           f"devices: {str(e).splitlines()[0]}") from None


@functools.lru_cache(maxsize=None)
def _topology(name: str, n_devices: int, hosts: int | None):
    from jax.experimental import topologies

    target = TARGETS[name]
    with native_stderr_silenced():
        if target.platform == "gpu":
            return topologies.get_topology_desc(platform="cuda", target_config=(SPECS / target.spec).read_text(),
                                                topology=_gpu_topology(target, n_devices, hosts))
        bounds, chips_per_host = _tpu_bounds(target, n_devices)
        # libtpu refuses a second process loading it at the same time without this (two plans at once).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        # libtpu logs warnings to a file of /tmp/tpu_logs unless told to write them to stderr, where a compile
        # reads them (the partitioner's involuntary rematerialisations, `perf.xla_log`) and keeps them off the
        # terminal. Read when libtpu loads, which is here.
        os.environ.setdefault("TPU_STDERR_LOG_LEVEL", "1")
        return topologies.get_topology_desc(
            platform="tpu", topology_name=f"{target.tpu_version}:{'x'.join(map(str, bounds))}",
            chip_config_name=target.chip_config, chips_per_host_bounds=chips_per_host, num_slices=1,
            wrap=(False, False, False))


def _gpu_topology(target: Target, n: int, hosts: int | None) -> str:
    """XLA:GPU's topology string, slices x hosts x devices per host."""
    hosts = hosts or -(-n // target.devices_per_host)  # default: as few hosts as hold them
    return f"1x{hosts}x{devices_per_host(n, hosts, None)}"


def _tpu_bounds(target: Target, n: int) -> tuple[tuple[int, ...], tuple[int, int, int]]:
    """(chip grid of the slice, chips per host) for n chips, shaped as Cloud TPU slices are (MaxText's
    accelerator_to_spec_map): 2-D grids for v5e and v6e (v5e-8 is 2x4), 3-D for v4 and v5p (v5p-16, 8 chips, is
    2x2x2), hosts of up to 2x2 chips."""
    if n & (n - 1):
        raise ShardlmError(f"--devices {n}: a {target.label} slice has a power-of-two number of chips; choose "
                           "1, 2, 4, 8, ...")
    dims = [1, 1, 1] if target.tpu_version in ("v4", "v5") else [1, 1]
    axis = 0
    while _prod(dims) < n:  # double the axes in turn: 1x1, 1x2 -> 2x2, 2x4, 4x4 (x, y, then z for 3-D)
        if len(dims) == 3 and dims[0] == dims[1] == 2 and axis < 2:
            axis = 2  # 3-D slices grow along z past 2x2x1, as v5p-16 = 2x2x2 and v5p-32 = 2x2x4
        dims[axis if len(dims) == 3 and axis == 2 else (1 if dims[1] <= dims[0] else 0)] *= 2
    return tuple(dims), (min(dims[0], 2), min(dims[1], 2), 1)


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


@contextlib.contextmanager
def tracing_for(target: Target):
    """Trace (lower) programs for `target` inside the block: `model.dtype=auto` and `model.attention=auto`
    resolve for it (`shardlm.accelerator`), and on a GPU target cuDNN's fused attention traces without the cuDNN
    library. JAX asks the installed cuDNN for its version, and the local backend for the compute capability,
    while it builds the kernel's call; here there is neither, so those three checks answer for the target (a
    cuDNN 9.1 and the target's compute capability) until the block ends. The compiler does not call them."""
    from shardlm.accelerator import compiling_for

    with compiling_for(target.accelerator):
        if target.platform != "gpu":
            yield target
            return
        from jax._src.cudnn import fused_attention_stablehlo as fused

        capability = (int(target.compute_capability), round(target.compute_capability % 1 * 10))
        as_tuple = lambda text: tuple(int(x) for x in text.split("."))  # noqa: E731
        patches = {"check_cudnn_version": lambda: 91000,
                   "check_compute_capability": lambda c: capability >= as_tuple(c),
                   "is_cuda_compute_capability_equal": lambda c: capability == as_tuple(c)}
        saved = {name: getattr(fused, name) for name in patches}
        for name, f in patches.items():
            setattr(fused, name, f)
        try:
            yield target
        finally:
            for name, f in saved.items():
                setattr(fused, name, f)
