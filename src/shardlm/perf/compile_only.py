"""`shardlm train --compile-only` (and `shardlm explain --target`): everything a run does up to its first step,
then a report instead of the step.

The config is checked as a run checks it, the data is prepared (a run needs its vocabulary), the mesh is laid
over the devices (the local ones, or a target's abstract ones: `--target h100 --devices 8`), the training state
is laid out abstractly (nothing allocated), and the train step `shardlm train` would run is lowered and compiled
by the compiler of the devices it is for. The report says what that compiler found: bytes per device and whether
they fit, the collectives of the step, its FLOPs, the compiler's own estimate of its time and the MFU it implies,
beside shardlm's estimate (`shardlm.perf.timeline`). Nothing is written: no run directory, no checkpoint.
Bytes, the compiler's estimate and MFU read as `shardlm plan` reads them: temporaries are the rest of the peak
beside the state, XLA:TPU's estimate is withheld for a step with loops (it counts their bodies once), an MFU over
100% is called the estimator's error, and the tensors XLA replicated to reshard them are named.

A step the compiler refuses for its memory (XLA:TPU does) is reported, not raised: "does not fit" is an answer.
"""

from __future__ import annotations

import contextlib
import dataclasses

from shardlm.config import Config, describe
from shardlm.flops import jaxpr_matmul_flops, mfu, peak_dtype, possible_mfu
from shardlm.foreign.modules import is_py
from shardlm.mesh import describe_mesh, mesh_from_config
from shardlm.models.head import recording
from shardlm.models.attention import attention_summary
from shardlm.perf import hlo
from shardlm.perf.compiled import CompiledStep, CompileFailed, compile_step
from shardlm.perf.costmodel import Estimate, Hardware, h100_peak
from shardlm.perf.planner import shard_bytes
from shardlm.perf.targets import Target, topology, tracing_for
from shardlm.perf.timeline import step_estimate
from shardlm.train.data import tokenizer_vocab
from shardlm.train.source import model_flops_per_step, within_documents
from shardlm.train.state import TrainState, abstract_train_state, check_batch, check_shardable
from shardlm.train.step import COST_ONLY_SEPARATOR, batch_struct, step_compiler_options, train_step_for
from shardlm.units import fmt_bytes


@dataclasses.dataclass
class CompileReport:
    cfg: Config
    mesh: str  # described
    devices: int
    target: Target | None
    hardware: Hardware
    step: CompiledStep
    params: int  # bytes per device
    optimizer: int
    model_flops: float  # per step, all devices
    est: Estimate  # shardlm's estimate: the per-kernel timeline
    attention: str = ""  # the kernel the step compiled with, and why (`models.attention.attention_summary`)
    head: str = ""  # the fused head and loss's schedule per device, with its bytes (`kernels.fused_head.Schedule`)

    @property
    def fits(self) -> bool:
        return self.step.refusal is None and self.peak <= self.hardware.memory_bytes

    @property
    def peak(self) -> int:
        return self.step.at_peak(self.params + self.optimizer)[0]

    @property
    def temporaries(self) -> int:
        """The rest of the peak beside the state (`CompiledStep.at_peak`), as `shardlm plan` counts them."""
        return self.step.at_peak(self.params + self.optimizer)[1]

    def mfu(self, step_s: float | None) -> float | None:
        """The MFU a step of `step_s` implies; None where it would exceed 100% (`planner.StrategyPlan.mfu`)."""
        return possible_mfu(self.implied_mfu(step_s))

    def implied_mfu(self, step_s: float | None) -> float | None:
        """The MFU a step of `step_s` implies, however high."""
        return mfu(self.model_flops / self.devices, step_s, self.hardware.peak_flops)

    @property
    def gemms_by_dtype(self) -> dict[str, int]:
        """The GEMMs one device runs per step, by operand dtype (a float8 GEMM's first operand: e4m3 forward,
        e5m2 for an input's gradient), read from the compiled program."""
        counts: dict[str, int] = {}
        for k in self.step.program.kernels() if self.step.program else ():
            if k.kind == "gemm" and k.dtype:
                counts[k.dtype] = counts.get(k.dtype, 0) + k.times
        return counts

    def to_dict(self) -> dict:
        s = self.step
        return {"target": self.target.name if self.target else None, "devices": self.devices, "mesh": self.mesh,
                "bytes_per_device": {"params": self.params, "optimizer": self.optimizer,
                                     "temporaries": self.temporaries, "peak": self.peak,
                                     "host_temporaries": s.host_temp_bytes, "compiler_temporaries": s.temp_bytes},
                "memory_bytes": self.hardware.memory_bytes, "fits": self.fits, "refusal": s.refusal,
                "collectives": hlo.summarize(s.collectives), "flops_per_device": s.flops_per_device,
                "model_flops": self.model_flops, "compiler_step_s": s.compiler_s,
                "compiler_step_withheld": s.compiler_withheld,
                "compiler_mfu": self.mfu(s.compiler_s), "est_step_s": self.est.step_s,
                "est_mfu": self.mfu(self.est.step_s), "compile_s": s.compile_s, "attention": self.attention,
                "head": self.head,
                "gemms_by_dtype": self.gemms_by_dtype,
                "rematerialisations": [x.to_dict() for x in s.rematerialisations]}


def compile_train_step(cfg: Config, *, target: Target | None = None, n_devices: int | None = None,
                       hosts: int | None = None, log=None) -> CompileReport:
    """Lay out and compile `cfg`'s train step on the local devices, or on `n_devices` of `target` over `hosts`."""
    import jax

    log = log or (lambda m: None)
    devices = list(topology(target, n_devices or 1, hosts).devices) if target else jax.devices()
    mesh = mesh_from_config(cfg.mesh, devices)
    check_shardable(cfg, mesh)
    check_batch(cfg, mesh)
    vocab = tokenizer_vocab(cfg, log=log)
    with tracing_for(target) if target else contextlib.nullcontext():
        _, graphdef, abstract, shardings = abstract_train_state(cfg, mesh, vocab)
        with recording() as heads:
            traced = train_step_for(cfg, TrainState(graphdef, abstract, shardings), mesh,
                                    separator=COST_ONLY_SEPARATOR).trace(
                abstract, batch_struct(cfg, mesh))
        lowered = traced.lower()
        attention = "" if is_py(cfg.model.preset) else attention_summary(
            cfg.model, mesh.shape["context"], within_documents(cfg, mesh.shape.get("stage", 1), mesh.shape["context"]))
        options = step_compiler_options(cfg)
    n = mesh.devices.size
    platform = target.platform if target else devices[0].platform
    log(f"compiling the train step for {n} {target.label if target else platform} device(s)")
    try:
        step = compile_step(lowered, n, platform=platform, matmul_flops=jaxpr_matmul_flops(traced.jaxpr),
                            keep_hlo=True, options=options)
    except CompileFailed as e:  # one line, naming the strategy
        raise CompileFailed(f"{e} (mesh {describe_mesh(mesh)})") from e
    hardware = (target.hardware(peak_dtype(cfg.model), n, hosts) if target
                else Hardware(peak_flops=h100_peak(peak_dtype(cfg.model))))
    return CompileReport(cfg, describe_mesh(mesh), n, target, hardware, step, shard_bytes(abstract["model"]),
                         shard_bytes(abstract["optimizer"]), model_flops_per_step(cfg, vocab, mesh.shape["tensor"]),
                         step_estimate(step.program, step.flops_per_device, step.collectives, n, hardware),
                         attention, heads[0].describe() if heads else "")


def _seconds(s: float | None) -> str:
    if s is None:
        return "none"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


def _percent(r: CompileReport, step_s: float | None) -> str:
    """The MFU a step of `step_s` implies, in parentheses; over 100%, said to be impossible rather than given."""
    if step_s is None:
        return ""
    implied = r.implied_mfu(step_s)
    return (f" (MFU {implied:.1%})" if implied <= 1 else
            f" (an MFU of {implied:.0%}, faster than the peak allows: the estimator's error, not the step's)")


def _compiler_line(r: CompileReport, compiler: str) -> str:
    """The target compiler's estimate of the step, or why there is none."""
    s = r.step
    why = ("it gives none for a program of one device" if s.compiler_s is None and s.platform == "gpu"
           and r.devices == 1 else s.compiler_withheld)
    return f"{compiler}'s estimate of the step: {_seconds(s.compiler_s)}{_percent(r, s.compiler_s)}" + (
        f" ({why})" if why else "")


def format_report(r: CompileReport) -> str:
    s, hw = r.step, r.hardware
    where = f"{r.devices} {r.target.label}" if r.target else f"{r.devices} local {s.platform}"
    compiler = {"gpu": "XLA:GPU", "tpu": "XLA:TPU"}.get(s.platform, "XLA:CPU")
    lines = [f"compile-only: {describe(r.cfg)}; global batch {r.cfg.train.batch_size} x {r.cfg.model.seq_len}",
             f"mesh {r.mesh} on {where} device(s); compiled by {compiler} in {s.compile_s:.1f} s"
             + (" (abstract devices: nothing ran)" if r.target else "")]
    if r.attention:
        lines.append(f"attention: {r.attention}")
    if r.head:
        lines.append(f"output head and loss, per device: {r.head}")
    if s.refusal:
        lines.append(f"memory per device: the train step refused by the compiler: {s.refusal}")
        lines.append(f"fits: NO (the target has {fmt_bytes(hw.memory_bytes)} per device)")
    else:
        lines.append(f"memory per device: params {fmt_bytes(r.params)}, optimizer {fmt_bytes(r.optimizer)}, "
                     f"temporaries {fmt_bytes(r.temporaries)}, peak {fmt_bytes(r.peak)} of "
                     f"{fmt_bytes(hw.memory_bytes)}" + (f"; in host memory: {fmt_bytes(s.host_temp_bytes)} of "
                                                        "offloaded activations" if s.host_temp_bytes else ""))
        lines.append(f"fits: {'yes' if r.fits else 'NO'}")
        what = ", ".join(f"{c['kind']} {c['count']}x {fmt_bytes(c['bytes'])}" for c in hlo.summarize(s.collectives))
        lines.append(f"collectives per step: {what or 'none'}")
        if s.schedule:
            lines.append("hidden behind compute in the compiler's schedule: " + ", ".join(
                f"{k} {v:.0%}" for k, v in s.schedule.hidden_by_kind().items()))
    gemms = r.gemms_by_dtype
    if fp8 := sum(n for d, n in gemms.items() if d.startswith("f8")):
        lines.append(f"GEMMs per step in FP8: {fp8} of {sum(gemms.values())} (the rest: attention, the output head)")
    lines.append(f"FLOPs per device per step: {s.flops_per_device / 1e12:.3f} TFLOP (model: "
                 f"{r.model_flops / r.devices / 1e12:.3f})" + ("; counted from the program the compiler was "
                                                                  "given, before it refused it" if s.refusal else ""))
    if s.platform != "cpu":
        lines.append(_compiler_line(r, compiler))
    kinds = ", ".join(f"{k} {_seconds(v)}" for k, v in sorted(r.est.by_kind.items(), key=lambda kv: -kv[1]) if v)
    lines.append(f"shardlm's estimate: {_seconds(r.est.step_s)}{_percent(r, r.est.step_s)} = "
                 f"{_seconds(r.est.compute_s)} of kernels{f' ({kinds})' if kinds else ''} + "
                 f"{_seconds(r.est.comm_s)} of collectives the schedule leaves exposed, of "
                 f"{_seconds(r.est.comm_total_s)} ({hw.name})")
    if s.rematerialisations:
        lines.append(f"{compiler} replicated to reshard (involuntary full rematerialisation): "
                     + "; ".join(x.describe() for x in s.rematerialisations))
    return "\n".join(lines)
