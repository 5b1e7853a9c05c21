"""Train-step throughput of the reference shape on 1 device and on 8 (simulated) devices, measured in one run.

Reference shape: GPT, 4 layers, 8 heads, d_model 256, MLP 1024, vocabulary 50304, context 128, global batch 16,
float32. Each configuration runs in its own process (the device count is fixed when JAX starts), with the real
state/step code: compile, 3 warm-up steps, then the median of `--steps` timed steps.

    python benchmarks/throughput.py            # 1 CPU device, then 8 simulated CPU devices as FSDP 4 x TP 2
    python benchmarks/throughput.py --steps 20 --configs 1:1,1,1 8:1,4,2 8:8,1,1

Prints tokens/s, step time, TFLOP/s per device and MFU (convention and peak in `shardlm.flops`), and the
ratio of each configuration's tokens/s to the first one's. On a CPU host the 8 simulated devices share the same
cores, so the ratio measures sharding overhead, not speed-up.
"""

import argparse
import json
import subprocess
import sys
import time

REFERENCE = [
    "model.n_layers=4", "model.n_heads=8", "model.d_model=256", "model.d_mlp=1024", "model.vocab_size=50304",
    "model.seq_len=128", "train.batch_size=16",
]


def child(n_devices: int, degrees: tuple[int, int, int], steps: int, platform: str) -> dict:
    from shardlm.mesh import simulate_cpu_devices

    if platform == "cpu":
        simulate_cpu_devices(n_devices)
    import jax
    import numpy as np

    from shardlm.config import load_config
    from shardlm.mesh import make_mesh
    from shardlm.flops import device_peak, flops_per_token
    from shardlm.sharding import batch_sharding
    from shardlm.train.state import create_train_state
    from shardlm.train.step import COST_ONLY_SEPARATOR, train_step_for

    cfg = load_config(None, REFERENCE)
    mesh = make_mesh(*degrees, devices=jax.devices()[:n_devices])
    ts = create_train_state(cfg, mesh, cfg.model.vocab_size)
    bsh = batch_sharding(mesh)
    rng = np.random.default_rng(0)
    batches = [jax.device_put(rng.integers(0, 50257, (16, 129)).astype(np.int32), bsh) for _ in range(4)]
    t0 = time.perf_counter()
    step = train_step_for(cfg, ts, mesh, separator=COST_ONLY_SEPARATOR).lower(ts.state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    state = ts.state
    for i in range(3):
        state, m = step(state, batches[i % 4])
    jax.block_until_ready(m)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batches[i % 4])
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    tokens_per_s = 16 * 128 / step_s
    fpt = flops_per_token(cfg.model, cfg.model.vocab_size)
    peak, peak_label = device_peak(list(mesh.devices.flat))
    per_dev = fpt * tokens_per_s / n_devices
    return {
        "devices": n_devices, "mesh": dict(mesh.shape), "platform": jax.devices()[0].device_kind,
        "step_s": step_s, "tokens_per_s": tokens_per_s, "tflops_per_device": per_dev / 1e12,
        "mfu": per_dev / peak, "peak_tflops_per_device": peak / 1e12, "peak_source": peak_label,
        "flops_per_token": fpt, "compile_s": compile_s, "loss": float(m["loss"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--configs", nargs="+", default=["1:1,1,1", "8:1,4,2"],
                    help="DEVICES:DATA,FSDP,TENSOR for each configuration")
    ap.add_argument("--platform", choices=("cpu", "default"), default="cpu",
                    help="cpu: simulate the devices on the host CPU; default: JAX's own devices (e.g. GPUs)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        n, degs = args.child.split(":")
        degrees = tuple(int(d) for d in degs.split(","))
        print("RESULT " + json.dumps(child(int(n), degrees, args.steps, args.platform)))
        return

    print("reference: GPT 4 layers, 8 heads, d_model 256, MLP 1024, vocab 50304, context 128, global batch 16, fp32")
    results = []
    for spec in args.configs:
        proc = subprocess.run([sys.executable, __file__, "--child", spec, "--steps", str(args.steps),
                               "--platform", args.platform],
                              capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.exit(f"configuration {spec} failed:\n{proc.stderr[-2000:]}")
        results.append(json.loads(line[len("RESULT "):]))

    base = results[0]["tokens_per_s"]
    print(f"{'devices':>7}  {'mesh (data x fsdp x context x tensor)':<38} {'step ms':>8} {'tokens/s':>9} "
          f"{'TFLOP/s/dev':>11} {'MFU':>6} {'vs first':>8}")
    for r in results:
        mesh = " x ".join(str(v) for v in r["mesh"].values())
        print(f"{r['devices']:>7}  {mesh:<38} {r['step_s'] * 1e3:>8.1f} {r['tokens_per_s']:>9.0f} "
              f"{r['tflops_per_device']:>11.4f} {r['mfu']:>6.1%} {r['tokens_per_s'] / base:>7.2f}x")
    print(f"FLOPs/token {results[0]['flops_per_token'] / 1e6:.1f}M (6*N_matmul + 12*L*T*d, attention not halved)")
    for r in results:
        print(f"peak for {r['devices']} device(s): {r['peak_tflops_per_device']:.3f} TFLOP/s per device "
              f"({r['peak_source']}); platform {r['platform']}")


if __name__ == "__main__":
    main()
