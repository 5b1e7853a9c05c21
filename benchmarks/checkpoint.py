"""What a checkpoint costs the training loop: the time a save blocks it, against the time the write takes, measured
in one run with the real state, step and checkpoint code.

    python benchmarks/checkpoint.py                          # CPU: model=small on 8 simulated devices, FSDP 8
    python benchmarks/checkpoint.py --gpu model=gpt2-small train.batch_size=8          # on one GPU

The loop trains with a host sync after every step (so each step can be timed). It measures the median step time
without checkpointing, then starts one asynchronous save and keeps training until the write has finished:
- blocked: how long `save` held the loop (copying the arrays off the devices, then returning);
- write: from the save's start until the checkpoint was complete on disk (what a synchronous save would block);
- the median step time while the write ran in the background, against the baseline.
It saves twice: the first save also pays one-time costs, the second shows the steady state.
Then it restores the checkpoint onto the same mesh and, with more than one device, onto data (rest) x tensor 2.
Prints one table and, with --json, one JSON object.
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", default=["model=small", "train.batch_size=16"])
    p.add_argument("--devices", type=int, default=None, help="devices to use (default: all)")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="simulate N CPU devices (default: 8 when no accelerator is named with --gpu)")
    p.add_argument("--gpu", action="store_true", help="run on the accelerator (no simulated CPU devices)")
    p.add_argument("--steps", type=int, default=10, help="timed steps for the baseline")
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not args.gpu:
        from shardlm.mesh import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices or 8)
    import jax
    import numpy as np

    from shardlm.config import load_config
    from shardlm.mesh import make_mesh
    from shardlm.sharding import batch_sharding
    from shardlm.explanation import explain_state
    from shardlm.units import fmt_bytes
    from shardlm.checkpoint import RunCheckpoints
    from shardlm.train import stored
    from shardlm.train.state import abstract_train_state, create_train_state
    from shardlm.train.step import COST_ONLY_SEPARATOR, train_step_for

    cfg = load_config(None, args.overrides)
    n = args.devices or len(jax.devices())
    devices = jax.devices()[:n]
    mesh = make_mesh(1, n, 1, devices=devices)  # FSDP over all devices
    vocab = 50304
    ts = create_train_state(cfg, mesh, vocab)
    ex = explain_state(ts.state, mesh)
    bsh = batch_sharding(mesh)
    rng = np.random.default_rng(0)
    seq, bsz = cfg.model.seq_len, cfg.train.batch_size
    batches = [jax.device_put(rng.integers(0, vocab, (bsz, seq + 1)).astype(np.int32), bsh) for _ in range(4)]
    step = train_step_for(cfg, ts, mesh, separator=COST_ONLY_SEPARATOR).lower(ts.state, batches[0]).compile()
    state = ts.state

    def timed_step(i):
        nonlocal state
        t0 = time.perf_counter()
        state, m = step(state, batches[i % 4])
        jax.block_until_ready(m)
        return time.perf_counter() - t0

    _progress("compiled; timing steps")
    for i in range(3):
        timed_step(i)
    baseline = [timed_step(i) for i in range(args.steps)]

    root = tempfile.mkdtemp(prefix="shardlm-ckpt-bench-", dir=args.dir)
    ck = RunCheckpoints(root, keep=2)
    saves = []
    for save_step in (1, 2):  # the first save pays one-time costs (thread pools, transfer programs); the second not
        _progress(f"save {save_step}: starting")
        t0 = time.perf_counter()
        stored.save_state(ck, save_step, state, save_step, {"step": save_step, "config": cfg.to_dict()},
                          stacks_blocks=True)  # what training runs
        blocked = time.perf_counter() - t0
        during = []
        while ck.manager.is_saving_in_progress():
            during.append(timed_step(len(during)))
        ck.wait()
        saves.append({"blocked_s": blocked, "write_s": time.perf_counter() - t0, "steps_during_write": len(during),
                      "step_s_during_write": statistics.median(during) if during else float("nan")})
        _progress(f"save {save_step}: {saves[-1]}")
    ck.close()
    size = sum(f.stat().st_size for f in (Path(root) / "checkpoints" / "2").rglob("*") if f.is_file())

    restores = {}
    targets = [("same mesh", mesh)]
    if n > 1 and n % 2 == 0:
        targets.append((f"data {n // 2} x tensor 2", make_mesh(n // 2, 1, 2, devices=devices)))
    for name, target in targets:
        _progress(f"restore onto {name}")
        abstract = abstract_train_state(cfg, target, vocab)[2]
        reader = RunCheckpoints(root, read_only=True)
        t0 = time.perf_counter()
        restored = stored.restore_state(reader, 1, abstract)
        jax.block_until_ready(jax.tree.leaves(restored))
        restores[name] = time.perf_counter() - t0
        reader.close()
    shutil.rmtree(root, ignore_errors=True)

    step_s = statistics.median(baseline)
    result = {
        "device": f"{n} x {devices[0].device_kind}", "model": cfg.model.preset, "params": ex.param_count,
        "state_bytes_per_device": ex.max_param_bytes + ex.max_opt_bytes, "checkpoint_bytes_on_disk": size,
        "step_s": step_s, "saves": saves, "restore_s": restores,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['device']} | model {cfg.model.preset} ({ex.param_count / 1e6:.1f}M parameters) | FSDP {n} | "
          f"state {fmt_bytes(result['state_bytes_per_device'])} per device | checkpoint {fmt_bytes(size)} on disk")
    print(f"  train step (median of {len(baseline)}): {step_s * 1e3:.1f} ms")
    for i, sv in enumerate(saves, 1):
        print(f"  save {i}: blocked the loop {sv['blocked_s'] * 1e3:.1f} ms ({sv['blocked_s'] / step_s:.2f} steps) | "
              f"complete on disk after {sv['write_s'] * 1e3:.1f} ms (blocked / write = "
              f"{sv['blocked_s'] / sv['write_s']:.3f}) | {sv['steps_during_write']} steps trained meanwhile "
              f"(median {sv['step_s_during_write'] * 1e3:.1f} ms, {sv['step_s_during_write'] / step_s:.2f}x)")
    for name, s in restores.items():
        print(f"  restore onto {name}: {s * 1e3:.1f} ms")


def _progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
