"""shardlm: pretrain GPT-style language models with JAX on any device mesh.

Importing `shardlm` starts no JAX backend, so `shardlm.mesh.simulate_cpu_devices` (and the CLI's `--cpu-devices`)
can still take effect; the names below load on first use. On a host without accelerators it makes JAX start on the
CPU quietly (`accelerator.quiet_on_hosts_without_accelerators`): the accelerator plugins the `targets` extra
installs would otherwise print their start-up failures into every script that imports shardlm.
"""

from shardlm.accelerator import quiet_on_hosts_without_accelerators as _quiet

_quiet()

__version__ = "0.1.0"

_LAZY = {
    "Config": "shardlm.config",
    "load_config": "shardlm.config",
    "ShardlmError": "shardlm.errors",
    "make_mesh": "shardlm.mesh",
    "make_named_mesh": "shardlm.mesh",
    "simulate_cpu_devices": "shardlm.mesh",
    "GPT": "shardlm.models.gpt",
    "Llama": "shardlm.models.llama",
    "LOGICAL_AXIS_RULES": "shardlm.sharding.rules",
    "Plan": "shardlm.foreign.plan",
    "shard": "shardlm.foreign.shard",
    "Sharded": "shardlm.foreign.shard",
    "Trainer": "shardlm.foreign.trainer",
    "explain": "shardlm.explanation",
    "create_train_state": "shardlm.train.state",
    "explain_state": "shardlm.explanation",
    "format_explanation": "shardlm.explanation",
    "load_model": "shardlm.load",
    "export": "shardlm.exporter",
}
# `shardlm.train` is a subpackage; the training loop's entry point is `shardlm.train.loop.train`.

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardlm' has no attribute {name!r}")
