"""DeepSeek-V3's auxiliary-loss-free balancing, run on this host: the per-expert router bias (`model.moe_bias_rate`,
`shardlm.train.balance`) brings skewed expert loads back toward balance, with no auxiliary loss in the objective.

deepseek-tiny (8 routed experts in 4 groups, top 2, beside a shared expert; 3 sparse layers; the auxiliary loss's
weight 0) first trains `--skew-steps` steps with the bias held still, so that its routing drifts out of balance
as unbalanced routers do. That run then continues for `--steps` more steps twice, from the same checkpoint: once
with the bias moving (`--rate` a step) and once, the control, still held. Printed every `--every` steps: the
busiest expert's load over the mean load (`expert_load_max` in metrics.jsonl, the experts' assignments summed
over the sparse layers; 1.0 is perfect balance) in both runs, and the evaluation loss of each at its end.

    python benchmarks/balance.py                # about 2.5 minutes on a 2-core VM
    python benchmarks/balance.py --model qwen3-moe-tiny   # a Llama-family mixture routed by sigmoid, the same bias

Any block with a sigmoid router and a bias rate balances so: `--model` takes another preset (a Llama-family one is
given `model.moe_router=sigmoid`, Qwen3-MoE-style aux-free balancing).
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from shardlm.mesh import simulate_cpu_devices

simulate_cpu_devices(4)  # before JAX starts

from shardlm.config import load_config  # noqa: E402
from shardlm.train.loop import train  # noqa: E402

BASE = ["data.tokenizer=bytes", "model.seq_len=64", "train.batch_size=16",
        "train.lr=3e-3", "train.warmup_steps=10", "train.log_interval=1", "train.sample_tokens=0",
        "train.eval_batches=4", "model.moe_aux_loss_weight=0", "mesh.expert=2", "mesh.fsdp=2"]


def run(run_dir: Path, model: str, steps: int, rate: float, eval_every: int) -> list[dict]:
    router = [] if model.startswith("deepseek") else ["model.moe_router=sigmoid"]
    cfg = load_config(None, [f"model={model}", *router, *BASE, f"train.steps={steps}",
                             f"model.moe_bias_rate={rate}",
                             f"train.eval_interval={eval_every}", f"checkpoint.every={eval_every}"])
    train(cfg, run_dir, progress=False)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skew-steps", type=int, default=100)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rate", type=float, default=1e-2, help="the bias's step (DeepSeek-V3 pretrained with 1e-3)")
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--model", default="deepseek-tiny", help="a mixture-of-experts preset")
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shardlm-balance-"))
    try:
        total = a.skew_steps + a.steps
        skewed = root / "skewed"
        run(skewed, a.model, a.skew_steps, 0.0, a.skew_steps)
        rows = {}
        for name, rate in (("balanced", a.rate), ("control", 0.0)):
            shutil.copytree(skewed, root / name)
            rows[name] = {r["step"]: r for r in run(root / name, a.model, total, rate, a.steps) if "loss" in r}
        print(f"{a.model}, expert 2 x fsdp 2 on 4 CPU devices, no auxiliary loss: busiest expert's load over the "
              f"mean, bias held for steps 1-{a.skew_steps}, then moving {a.rate:g} a step (balanced) or held "
              "(control)")
        print(f"{'step':>6} {'balanced':>9} {'control':>9}")
        for step in range(a.skew_steps, total + 1, a.every):
            b, c = rows["balanced"].get(step), rows["control"].get(step)
            if b and c:
                print(f"{step:>6} {b['expert_load_max']:>8.2f}x {c['expert_load_max']:>8.2f}x")
        last = {k: v[total] for k, v in rows.items()}
        print(f"eval loss at step {total}: balanced {last['balanced'].get('eval_loss', float('nan')):.4f}, control "
              f"{last['control'].get('eval_loss', float('nan')):.4f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
