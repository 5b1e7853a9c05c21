"""What both foreign-model examples share: offline text batches, and training one model under several plans."""

import argparse
import time

import numpy as np


def parse_args(doc: str, argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--explain", action="store_true")
    args = parser.parse_args(argv)
    import shardlm

    shardlm.simulate_cpu_devices(args.cpu_devices)
    return args


def text_batches(n: int, batch_size: int, seq_len: int):
    """Byte-level windows of the built-in Shakespeare corpus (offline), [batch, seq + 1] each."""
    from shardlm.data.corpus import builtin_documents

    data = np.frombuffer("\n".join(builtin_documents("shakespeare")).encode("utf-8"), np.uint8).astype(np.int32)
    rng = np.random.default_rng(0)
    for _ in range(n):
        starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
        yield np.stack([data[s:s + seq_len + 1] for s in starts])


def compare_strategies(shard_with, hand_plan, batches, explain: bool = False) -> None:
    """Train a fresh copy of the model under each strategy (`shard_with(plan, mesh)` places it) on the same
    batches, and print each run's losses next to the unsharded run's."""
    import jax
    import optax

    import shardlm

    strategies = {
        "unsharded (1 device)": ("dp", shardlm.make_mesh(devices=jax.devices()[:1])),
        "dp": ("dp", None),
        "fsdp": ("fsdp", None),
        "megatron": ("megatron", None),
        "megatron, data=2 x tensor=4": ("megatron", shardlm.make_mesh(data=2, tensor=4)),
        f"hand-written plan ({hand_plan.name})": (hand_plan, None),
    }
    reference = None
    for label, (plan, mesh) in strategies.items():
        sharded = shard_with(plan, mesh)
        trainer = sharded.trainer(optax.adamw(3e-3))
        start = time.perf_counter()
        losses = [float(trainer.step(b)["loss"]) for b in batches]
        elapsed = time.perf_counter() - start
        reference = reference or losses
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        mesh_text = " x ".join(f"{k}={v}" for k, v in sharded.mesh.shape.items())
        print(f"{label:<42} mesh {mesh_text:<24} loss {losses[0]:.4f} -> {losses[-1]:.4f}  "
              f"max rel. diff vs unsharded {worst:.1e}  ({elapsed:.1f} s, {trainer.compiles} compile)")
        if explain and plan == hand_plan:
            print(shardlm.explain(trainer))
