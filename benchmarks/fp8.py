"""FP8 matmuls against bfloat16, compiled for 8 H100s from this CPU host (`model.matmul_dtype=fp8`; nothing runs).

Issue 39's case: Llama 3.1 8B's shape (`targets.LLAMA_8B`), FSDP 8, 2 x 8192 tokens per device, `model.remat=full`,
the real train step compiled twice, with the blocks' matmuls in bfloat16 and in FP8. Printed for each: peak memory
per device, the GEMMs of one step by operand dtype (read from the optimised HLO: a float8 GEMM's first operand is
e4m3 forward and e5m2 for an input's gradient), XLA:GPU's own estimate of the step, shardlm's per-kernel estimate
(`shardlm.perf.timeline`: an FP8 GEMM at twice the bfloat16 rate the efficiency table measured for its shape) with
the MFU it implies against each run's own peak, and the ratios; then the share of the FP8 step's kernel time in
kernels that take an amax, the most that delayed scaling could save over current scaling.

Then one GEMM alone (8192 x 8192 x 8192 per device, 8 devices, nothing exchanged), compiled both ways, and the time
XLA:GPU's latency model gives it: the check of whether its step estimate can compare the two at all.

    python benchmarks/fp8.py            # about 3 minutes on a 2-core VM

"Compiled for", not "measured on".
"""

import argparse
import sys
from collections import Counter

from targets import LLAMA_8B, compile_for

CASE = LLAMA_8B + ["mesh.fsdp=8", "train.batch_size=16", "model.remat=full"]


def gemms_by_dtype(report) -> Counter:
    counts = Counter()
    for k in report.step.program.kernels():
        if k.kind == "gemm":
            counts[k.dtype] += k.times
    return counts


def amax_seconds(report) -> tuple[float, float, int]:
    """(seconds of the step's kernels that take an amax, seconds of all its kernels, those kernels' launches),
    by shardlm's per-kernel estimate: an upper bound on what delayed scaling (an amax history, the cast fused with
    the amax it records) could save over current scaling, whose amax must be taken before the cast."""
    import re

    from shardlm.perf import hlo
    from shardlm.perf.timeline import kernel_seconds

    instructions = hlo._parse(report.step.hlo_text)
    by_computation: dict[str, set] = {}
    for ins in instructions:
        by_computation.setdefault(ins.computation, set()).add(ins.opcode)
    takes_amax = {c for c, ops in by_computation.items() if {"abs", "reduce"} <= ops}
    calls = {ins.name: m.group(1) for ins in instructions if ins.opcode == "fusion"
             and (m := re.search(r"calls=%?([\w.\-]+)", ins.attrs))}
    rates = report.hardware.rates()
    total = amax = 0.0
    launches = 0
    for k in report.step.program.kernels():
        t = kernel_seconds(k, rates) * k.times
        total += t
        if calls.get(k.name) in takes_amax:
            amax, launches = amax + t, launches + k.times
    return amax, total, launches


def lone_gemm_seconds(fp8: bool) -> float | None:
    """XLA:GPU's estimate for one 8192^3 GEMM per device on 8 H100s, in bfloat16 or FP8 (e4m3 operands, float32
    accumulation)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardlm.perf import targets
    from shardlm.perf.compiled import compile_step

    n = 8192
    devices = targets.topology(targets.get("h100"), 8).devices
    mesh = Mesh(np.asarray(devices), ("d",))
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    x = jax.ShapeDtypeStruct((8 * n, n), dtype, sharding=NamedSharding(mesh, P("d")))
    w = jax.ShapeDtypeStruct((n, n), dtype, sharding=NamedSharding(mesh, P()))
    # with a sum over the devices: XLA:GPU's latency-hiding scheduler (whose estimate this is) runs on programs
    # with collectives
    f = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16).sum())
    return compile_step(f.lower(x, w), 8, platform="gpu", matmul_flops=2.0 * 8 * n**3).compiler_s


def _s(x):
    return "-" if x is None else f"{x:.3f} s"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    from shardlm.accelerator import cpu_unless_accelerator, start_cpu_quietly

    if cpu_unless_accelerator():
        start_cpu_quietly()
    from shardlm.units import fmt_bytes

    rows = {}
    print("| matmuls | peak/device | GEMMs per step by operand dtype | XLA:GPU's estimate | shardlm's estimate | "
          "its MFU |")
    print("|---|---|---|---|---|---|")
    for name in ("auto", "fp8"):
        print(f"compiling the step with model.matmul_dtype={name} ...", file=sys.stderr, flush=True)
        r, _ = compile_for("h100", 8, CASE + [f"model.matmul_dtype={name}"])
        rows[name] = r
        counts = ", ".join(f"{d} {c}" for d, c in sorted(gemms_by_dtype(r).items()))
        print(f"| {'bfloat16' if name == 'auto' else 'fp8'} | {fmt_bytes(r.step.peak)} | {counts} | "
              f"{_s(r.step.compiler_s)} | {_s(r.est.step_s)} | {r.mfu(r.est.step_s):.1%} |", flush=True)
    bf16, fp8 = rows["auto"], rows["fp8"]
    delta = fp8.step.peak - bf16.step.peak
    print(f"\nFP8 over bfloat16: shardlm's estimate {bf16.est.step_s / fp8.est.step_s:.2f}x faster, peak "
          f"{fp8.step.peak / bf16.step.peak:.4f}x ({fmt_bytes(abs(delta))} {'above' if delta > 0 else 'below'}); "
          "XLA:GPU's estimate "
          + (f"{bf16.step.compiler_s / fp8.step.compiler_s:.2f}x faster" if bf16.step.compiler_s and
             fp8.step.compiler_s else "-"))
    amax, total, launches = amax_seconds(fp8)
    print(f"current scaling's amax: the FP8 step's kernels that take one are {amax:.3f} s of {total:.3f} s "
          f"({amax / total:.1%}, {launches} launches): the most delayed scaling could save")
    lone = {fp8: lone_gemm_seconds(fp8) for fp8 in (False, True)}
    flops = 2.0 * 8192**3
    print("one 8192^3 GEMM per device, XLA:GPU's estimate: " + ", ".join(
        f"{'fp8' if k else 'bfloat16'} {v * 1e3:.2f} ms ({flops / v / 1e12:,.0f} TFLOP/s)" for k, v in lone.items()
        if v))


if __name__ == "__main__":
    main()
