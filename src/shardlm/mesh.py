"""The device mesh: named axes (stage, data, fsdp, expert, context, tensor), degrees with -1 = "the rest", CPU
device simulation.

The axes are always the same six, in this order, so a strategy is nothing but six integers: pipeline stages
(`stage`, the model's depth split), DP (`data`), FSDP (`fsdp`), expert parallelism (`expert`, a mixture of
experts' experts split; FSDP for everything else), context parallelism (`context`, the sequence split) and
Megatron TP (`tensor`); every hybrid is a product, and an axis of degree 1 splits nothing. Axes are created as
`AxisType.Auto`: since JAX 0.9 `jax.make_mesh` defaults to Explicit axes, under which XLA refuses the contracting
dimension sharding that row-parallel (Megatron) weights need.

Across hosts, the devices are laid out process by process (host by host) with `tensor` innermost, then
`context`, `expert`, `fsdp`, `data`, and `stage` outermost: tensor groups, the chattiest (an all-reduce per
layer), stay inside a host whenever the tensor degree divides the devices of one, then the context axis's
key/value all-gathers (per layer, and growing with the sequence), the experts' all-to-alls (per sparse layer),
FSDP's weight all-gathers next, then data parallelism, one gradient reduction per step; pipeline stages, which
send only activations to the next stage, span the hosts first. This is what MaxText's ICI/DCN meshes do; the links
between hosts are an order of magnitude slower. `axes_across_hosts` reads back which axes a mesh stretches over
several hosts.
"""

import math
import numbers
import os
import re

from shardlm.errors import ShardlmError

MESH_AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")


# Simulated devices each compute on one thread: they already keep the host's cores busy between them, and
# Eigen splitting every matmul over XLA:CPU's thread pool too only adds contention (an 8-device data x fsdp x
# tensor run: 4,819 against 3,444 tokens/s on 2 cores). The pool then mostly carries the devices' programs and
# their collectives, which block a thread until every peer arrives (a pool that wedges under multi-threaded
# Eigen is reported upstream; this flag was the workaround there).
SINGLE_THREADED_DEVICES_FLAG = "--xla_cpu_multi_thread_eigen=false"


def simulate_cpu_devices(n: int) -> None:
    """Make JAX see `n` CPU devices. Must run before JAX initialises its backend (before the first array)."""
    if n < 1:
        raise ShardlmError(f"--cpu-devices must be at least 1, got {n}")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    flags += f" --xla_force_host_platform_device_count={n}"
    if n > 1 and "xla_cpu_multi_thread_eigen" not in flags:
        flags += " " + SINGLE_THREADED_DEVICES_FLAG
    os.environ["XLA_FLAGS"] = flags.strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import sys

    if "jax" in sys.modules:
        import jax

        jax.config.update("jax_platforms", "cpu")  # JAX read JAX_PLATFORMS when it was imported
        # The backend may already be up (e.g. in a notebook); then the flag would be silently ignored.
        try:
            initialised = jax._src.xla_bridge.backends_are_initialized()  # noqa: SLF001
        except AttributeError:
            initialised = False
        if initialised and jax.local_device_count() != n:
            raise ShardlmError(
                f"JAX is already running with {jax.local_device_count()} devices; --cpu-devices {n} must be set before "
                "JAX starts (set XLA_FLAGS=--xla_force_host_platform_device_count=N in the environment instead)"
            )


def resolve_degrees(data: int | None, fsdp: int, tensor: int, n_devices: int, context: int = 1, stage: int = 1,
                    expert: int = 1) -> dict[str, int]:
    """Turn configured degrees (None / -1 allowed) into concrete ones whose product is `n_devices`, as
    {axis: degree} in `MESH_AXES` order. `data=None` means "the rest" unless another axis already is."""
    if data is None:
        data = 1 if -1 in (stage, fsdp, expert, context, tensor) else -1
    degrees = {"stage": stage, "data": data, "fsdp": fsdp, "expert": expert, "context": context, "tensor": tensor}
    return resolve_axis_degrees(degrees, n_devices, knobs="mesh.stage, mesh.data, mesh.fsdp, mesh.expert, "
                                                          "mesh.context and mesh.tensor")


def resolve_axis_degrees(degrees: dict[str, int], n_devices: int, knobs: str = "the mesh degrees") -> dict[str, int]:
    """{axis: degree} with at most one -1 ("the rest") -> concrete degrees whose product is `n_devices`."""
    for name, d in degrees.items():
        if not isinstance(d, numbers.Integral) or isinstance(d, bool) or (d < 1 and d != -1):
            raise ShardlmError(f"mesh axis {name} has degree {d!r}; a degree is a positive integer or -1 (\"the rest\")")
    degrees = {name: int(d) for name, d in degrees.items()}
    rest = [k for k, v in degrees.items() if v == -1]
    if len(rest) > 1:
        raise ShardlmError(
            f"mesh axes {' and '.join(rest)} are both -1; at most one degree may be -1 (\"the rest\")"
        )
    fixed = math.prod(v for v in degrees.values() if v != -1)
    out = dict(degrees)
    if rest:
        if n_devices % fixed:
            raise ShardlmError(
                f"mesh degrees {_describe(degrees)} multiply to {fixed}, which does not divide the {n_devices} "
                f"devices; choose degrees whose product divides {n_devices}"
            )
        out[rest[0]] = n_devices // fixed
    elif fixed != n_devices:
        raise ShardlmError(
            f"mesh {_describe(degrees)} uses {fixed} devices but {n_devices} are available; make the product of "
            f"{knobs} equal {n_devices}, or set one of them to -1 (\"the rest\")"
        )
    return out


def _describe(degrees: dict) -> str:
    return " x ".join(f"{k}={'-1' if v == -1 else v}" for k, v in degrees.items())


def make_mesh(data: int | None = None, fsdp: int = 1, tensor: int = 1, devices=None, *, context: int = 1,
              stage: int = 1, expert: int = 1):
    """A `jax.sharding.Mesh` over `devices` (default: all) with axes `MESH_AXES`, all `AxisType.Auto`."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    return make_named_mesh(resolve_degrees(data, fsdp, tensor, len(devices), context, stage, expert), devices)


def make_named_mesh(degrees: dict[str, int], devices=None):
    """A mesh with any axis names (a plan's, or seed 003's ("data", "model")), -1 = "the rest", all Auto axes."""
    import jax
    from jax.sharding import AxisType

    devices = list(jax.devices() if devices is None else devices)
    if not degrees:
        raise ShardlmError("a mesh needs at least one axis, e.g. {data: -1}")
    shape = resolve_axis_degrees(dict(degrees), len(devices))
    if devices[0].platform != "tpu" and len({d.process_index for d in devices}) > 1:
        # Host by host, so the inner axes stay inside hosts (a TPU slice is one network; one process keeps the
        # order it was given).
        devices.sort(key=lambda d: (d.process_index, d.id))
    axis_types = (AxisType.Auto,) * len(shape)
    try:
        return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=axis_types, devices=devices)
    except NotImplementedError:
        # A TPU slice whose torus has no subset of axes of some degree (a v5p-64 is 2x2x8: an axis of 4 must
        # split its 8): JAX then lays the axis across a split physical axis, as MaxText allows
        # (`allow_split_physical_axes`), rather than refuse the mesh.
        from jax.experimental import mesh_utils
        from jax.sharding import Mesh

        grid = mesh_utils.create_device_mesh(tuple(shape.values()), devices, allow_split_physical_axes=True)
        return Mesh(grid, tuple(shape), axis_types=axis_types)


def balanced_degrees(n_devices: int, n_axes: int) -> tuple[int, ...]:
    """Split `n_devices` over `n_axes` as evenly as possible, earlier axes taking the larger share:
    8 over 2 -> (4, 2), 8 over 3 -> (2, 2, 2), 4 over 2 -> (2, 2), 1 -> (1, 1)."""
    primes, n, f = [], n_devices, 2
    while n > 1:
        while n % f == 0:
            primes.append(f)
            n //= f
        f += 1
    out = [1] * n_axes
    for p in sorted(primes, reverse=True):
        out[out.index(min(out))] *= p
    return tuple(sorted(out, reverse=True))


def unresolved(setting: str, example: str) -> ShardlmError:
    """The one-line error for `mesh=auto` or `model.remat=auto` met where the planner has not resolved it."""
    return ShardlmError(f"{setting} is chosen by the planner when `shardlm train` starts a run (or `train "
                        f"--compile-only`); here give it yourself ({example}, ...), or the --run-dir of a run that "
                        "chose it")


def mesh_from_config(mesh_cfg, devices=None):
    if getattr(mesh_cfg, "auto", False):
        raise unresolved("mesh=auto", "mesh.fsdp=8")
    return make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor, devices=devices, context=mesh_cfg.context,
                     stage=mesh_cfg.stage, expert=mesh_cfg.expert)


def describe_mesh(mesh) -> str:
    return " x ".join(f"{name}={size}" for name, size in mesh.shape.items())


def axes_across_hosts(mesh, host_of_process=None) -> dict[str, int]:
    """{axis: the most hosts any one group along it spans} for the axes that leave a host; {} on one host.
    `host_of_process` names each process's host (default: the joined run's, `shardlm.distributed`)."""
    import numpy as np

    if host_of_process is None:
        from shardlm.distributed import host_of_process
    hosts = np.vectorize(lambda d: host_of_process(d.process_index), otypes=[object])(mesh.devices)
    out = {}
    for k, name in enumerate(mesh.axis_names):
        groups = np.moveaxis(hosts, k, -1).reshape(-1, hosts.shape[k])  # one row per group along axis k
        spanned = max(len(set(row)) for row in groups)
        if spanned > 1:
            out[name] = spanned
    return out


def describe_hosts(mesh, host_of_process=None) -> str:
    """'2 hosts; data spans 2 hosts, tensor stays inside each' -- or '' on one host."""
    from shardlm.distributed import host_of_process as joined

    owner = host_of_process or joined
    n_hosts = len({owner(d.process_index) for d in mesh.devices.flat})
    if n_hosts == 1:
        return ""
    across = axes_across_hosts(mesh, owner)
    inside = [a for a in mesh.axis_names if a not in across and mesh.shape[a] > 1]
    parts = [f"{a} spans {h} hosts" for a, h in across.items()]
    if inside:
        parts.append(f"{' and '.join(inside)} inside each")
    return f"{n_hosts} hosts: " + ", ".join(parts)


def check_tensor_inside_hosts(mesh, log, host_of_process=None) -> None:
    """A tensor axis that crosses hosts is allowed, with a warning: it all-reduces across the slow links twice
    per layer."""
    across = axes_across_hosts(mesh, host_of_process)
    if "tensor" in across:
        log(f"warning: mesh.tensor={mesh.shape['tensor']} spans {across['tensor']} hosts, so tensor parallelism's "
            f"all-reduces (two per layer) cross the network between hosts; a tensor degree that divides the "
            f"devices of one host keeps them inside it")
