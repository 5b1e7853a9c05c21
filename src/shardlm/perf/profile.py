"""`shardlm profile`: a `jax.profiler` trace of a few train steps after warm-up, and where their time went.

The model names its parts with `jax.named_scope` (`embed`, `layer0` ... `layerN` or, its blocks scanned, `layers`
for all of them, `head`) and the train step
names `loss` and `optimizer`; each step runs under a `StepTraceAnnotation`, so viewers split the timeline by step.
The scopes live in the compiled program's op metadata (backward ops as `transpose(jvp(layer3))`), so the summary
joins each device op of the trace to its scope through the compiled HLO. The trace itself is written for
TensorBoard's profile plugin / XProf (`DIR/plugins/profile/<time>/*.xplane.pb`) and as a Perfetto file. In a run
of several processes each traces its own devices into `DIR/process-<i>/`, and the summary is process 0's.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import time
from collections import defaultdict
from pathlib import Path

from shardlm.config import Config

_SCOPE = re.compile(r"\b(embed|layer\d+|layers|head|loss|optimizer)\b")


@dataclasses.dataclass
class ScopeTime:
    scope: str
    forward_s: float  # per step, averaged over devices
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclasses.dataclass
class Profile:
    log_dir: Path
    trace_file: Path | None  # the Perfetto trace
    steps: int
    step_s: list[float]  # wall time of each traced step
    scopes: list[ScopeTime]
    unscoped_s: float  # device time per step in ops under no named scope (collectives' glue, copies)


def _scope_order(name: str) -> tuple:
    order = {"embed": 0, "layers": 1, "head": 2, "loss": 3, "optimizer": 4}
    m = re.fullmatch(r"layer(\d+)", name)
    return (1, int(m.group(1))) if m else (order.get(name, 5), 0)


def _scope(op_name: str) -> tuple[str, bool] | None:
    """(scope, is backward) of an op. XLA joins the names of ops it merged with ':' (a gradient's reduction and
    the optimizer's partial norm in one fused op: `(optimizer/reduce_sum:transpose(jvp(layer2))/reduce_sum)`); a
    model scope then wins over `loss` and `optimizer`, whose share in such an op is the small part."""
    found = []
    for part in op_name.split(":"):
        m = _SCOPE.search(part)
        if m:
            found.append((m.group(1), "transpose(" in part))
    model = [f for f in found if f[0] not in ("loss", "optimizer")]
    return (model or found or [None])[0]


def summarize_trace(trace_file: Path, hlo_text: str, module: str, steps: int, n_devices: int
                    ) -> tuple[list[ScopeTime], float]:
    """Device time per named scope per step, from the Perfetto trace's op events joined with the HLO metadata."""
    from shardlm.perf.hlo import op_scopes

    scope_of = op_scopes(hlo_text)
    events = json.load(gzip.open(trace_file))["traceEvents"]
    fwd: dict[str, float] = defaultdict(float)
    bwd: dict[str, float] = defaultdict(float)
    unscoped = 0.0
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args or not str(args.get("hlo_module", "")).startswith(module):
            continue
        seconds = float(e.get("dur", 0)) * 1e-6
        found = _scope(scope_of.get(args["hlo_op"], ""))
        if found is None:
            unscoped += seconds
            continue
        (bwd if found[1] else fwd)[found[0]] += seconds
    per = 1.0 / (steps * n_devices)
    names = sorted(set(fwd) | set(bwd), key=_scope_order)
    return [ScopeTime(n, fwd[n] * per, bwd[n] * per) for n in names], unscoped * per


def profile(cfg: Config, log_dir: str | Path, steps: int = 3, warmup: int = 2, log=None) -> Profile:
    import jax

    from shardlm.mesh import mesh_from_config
    from shardlm.perf.bench import warmed_up_step
    from shardlm.train.data import tokenizer_vocab
    from shardlm.train.state import check_batch, check_shardable

    log = log or (lambda m: None)
    mesh = mesh_from_config(cfg.mesh)
    check_batch(cfg, mesh)
    check_shardable(cfg, mesh)
    vocab = tokenizer_vocab(cfg, log=log)
    compiled, state, batches, _ = warmed_up_step(cfg, mesh, vocab, 2, warmup)
    log_dir = Path(log_dir)
    if jax.process_count() > 1:  # one trace per process (they would overwrite each other's files)
        log_dir = log_dir / f"process-{jax.process_index()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    before = set(log_dir.glob("plugins/profile/*"))
    step_s = []
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        for i in range(steps):
            t0 = time.perf_counter()
            with jax.profiler.StepTraceAnnotation("train_step", step_num=i):
                state, metrics = compiled(state, batches[i % 2])
                jax.block_until_ready(metrics)
            step_s.append(time.perf_counter() - t0)
    new = sorted(set(log_dir.glob("plugins/profile/*")) - before)
    traces = sorted(new[-1].glob("*perfetto_trace.json.gz")) if new else []
    trace_file = traces[0] if traces else None
    scopes, unscoped = ([], 0.0)
    if trace_file is not None:
        hlo_text = compiled.as_text()
        module = re.search(r"^HloModule (\S+?)[,\s]", hlo_text, re.M)
        scopes, unscoped = summarize_trace(trace_file, hlo_text, module.group(1) if module else "jit_step", steps,
                                           len(mesh.local_devices))  # the trace holds this process's devices
    return Profile(log_dir, trace_file, steps, step_s, scopes, unscoped)


def format_profile(p: Profile) -> str:
    lines = [f"traced {p.steps} steps after warm-up: median {sorted(p.step_s)[len(p.step_s) // 2] * 1e3:.1f} ms "
             "per step (wall)"]
    if p.scopes:
        total = max(sum(s.total_s for s in p.scopes) + p.unscoped_s, 1e-12)
        lines += ["", "device time per step by named scope (mean over devices):",
                  f"{'scope':<12} {'forward ms':>11} {'backward ms':>12} {'total ms':>9} {'share':>7}"]
        for s in p.scopes:
            lines.append(f"{s.scope:<12} {s.forward_s * 1e3:>11.2f} {s.backward_s * 1e3:>12.2f} "
                         f"{s.total_s * 1e3:>9.2f} {s.total_s / total:>7.1%}")
        lines.append(f"{'(unscoped)':<12} {'':>11} {'':>12} {p.unscoped_s * 1e3:>9.2f} {p.unscoped_s / total:>7.1%}")
    lines += ["", f"trace written to {p.log_dir}; open it with one of:",
              f"  XProf:       pip install xprof && xprof --logdir {p.log_dir} --port 8791   (then Trace Viewer)",
              f"  TensorBoard: pip install tensorboard xprof && tensorboard --logdir {p.log_dir}   (Profile tab)"]
    if p.trace_file is not None:
        lines.append(f"  Perfetto:    open https://ui.perfetto.dev and load {p.trace_file}")
    return "\n".join(lines)
