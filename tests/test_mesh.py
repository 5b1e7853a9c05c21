import os

import jax
import pytest
from jax.sharding import AxisType

from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh, resolve_degrees


@pytest.mark.parametrize(
    "degrees, expected",
    [
        ((None, 1, 1), (8, 1, 1)),  # default: pure DP over everything
        ((None, -1, 1), (1, 8, 1)),  # mesh.fsdp=-1 alone gives pure FSDP
        ((None, 1, 2), (4, 1, 2)),
        ((2, 2, 2), (2, 2, 2)),
        ((2, -1, 2), (2, 2, 2)),
        ((-1, 4, 2), (1, 4, 2)),
        ((None, 1, 1, -1), (1, 1, 1, 8)),  # mesh.context=-1 alone: the whole sequence split
        ((None, 2, 2, 2), (1, 2, 2, 2)),
        ((None, 1, 2, 2), (2, 1, 2, 2)),
    ],
)
def test_resolve_degrees(degrees, expected):
    data, fsdp, tensor, *context = degrees
    got = resolve_degrees(data, fsdp, tensor, n_devices=8, context=context[0] if context else 1)
    want = {"stage": 1, "expert": 1,
            **dict(zip(("data", "fsdp", "tensor", "context"), expected + (1,) * (4 - len(expected))))}
    assert got == want and list(got) == ["stage", "data", "fsdp", "expert", "context", "tensor"]


@pytest.mark.parametrize(
    "degrees, fragment",
    [
        ((3, 1, 1), "uses 3 devices but 8 are available"),
        ((-1, -1, 1), "at most one degree may be -1"),
        ((None, 3, 1), "does not divide the 8 devices"),
        ((2, 2, 4), "uses 16 devices"),
    ],
)
def test_bad_mesh(degrees, fragment):
    with pytest.raises(ShardlmError, match=fragment):
        resolve_degrees(*degrees, n_devices=8)


def test_make_mesh_has_named_auto_axes():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert mesh.devices.size == jax.device_count() == 8


def test_simulated_devices_compute_one_thread_each_unless_the_user_says_otherwise(monkeypatch):
    from shardlm.mesh import SINGLE_THREADED_DEVICES_FLAG, simulate_cpu_devices

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    simulate_cpu_devices(8)  # JAX is up with 8 already: only the flags are (re)written
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8",
                                               SINGLE_THREADED_DEVICES_FLAG]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
    simulate_cpu_devices(8)
    assert "--xla_cpu_multi_thread_eigen=true" in os.environ["XLA_FLAGS"]
    assert SINGLE_THREADED_DEVICES_FLAG not in os.environ["XLA_FLAGS"]
