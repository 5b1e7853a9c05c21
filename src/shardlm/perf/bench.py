"""`shardlm bench`: run strategies on the local (or simulated) devices and measure them against each other.

Every strategy gets its own mesh over all the devices, a state initialised from the same seed and the same batches
(random tokens: this times the train step, not the data pipeline; `benchmarks/data_pipeline.py` does that). All
states are built and compiled first, then the strategies take turns, one step each per round, in an order that
rotates every round, so that drift of a shared, noisy machine falls on every strategy alike. Every strategy's
state and program stay on the devices for the whole run: benchmarking K strategies needs K times the memory of
one (a model near the limit is benched one strategy per call). Reported per strategy: median step time, tokens/s,
model TFLOP/s per device and MFU (convention in `shardlm.flops`; the peak a datasheet's, or on a CPU host the
measured one the estimate beside it is costed with), and the loss after the last step, equal across strategies up
to float rounding, since they compute the same training run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from shardlm.config import Config
from shardlm.perf.strategies import Strategy


@dataclasses.dataclass
class BenchResult:
    strategy: Strategy
    step_times: list[float]
    tokens_per_step: int
    model_flops_per_step: float
    peak_flops: float  # per device
    compile_s: float
    final_loss: float
    est_step_s: float | None = None  # the cost model's estimate of this step (`plan`'s), on the devices at hand

    @property
    def step_s(self) -> float:
        return statistics.median(self.step_times)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def tflops_per_device(self) -> float:
        return self.model_flops_per_step / self.step_s / self.strategy.devices / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_device * 1e12 / self.peak_flops

    def to_dict(self) -> dict:
        return {"name": self.strategy.name, "mesh": self.strategy.mesh, "step_s": self.step_s,
                "step_s_min": min(self.step_times), "step_s_max": max(self.step_times), "steps": len(self.step_times),
                "tokens_per_s": self.tokens_per_s, "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
                "compile_s": self.compile_s, "final_loss": self.final_loss, "est_step_s": self.est_step_s,
                "measured_over_est": self.step_s / self.est_step_s if self.est_step_s else None}


@dataclasses.dataclass
class Bench:
    results: list[BenchResult]
    peak_label: str
    device_kind: str
    n_devices: int
    hardware: str = ""  # what the estimates are costed on

    def to_dict(self) -> dict:
        return {"device": self.device_kind, "devices": self.n_devices, "peak_source": self.peak_label,
                "estimated_on": self.hardware, "strategies": [r.to_dict() for r in self.results]}


def bench(cfg: Config, strategies: list[Strategy], steps: int = 10, warmup: int = 2, log=None) -> Bench:
    import jax

    from shardlm.errors import ShardlmError

    try:
        return _bench(cfg, strategies, steps, warmup, log)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        if len(strategies) == 1:
            raise ShardlmError(f"the devices ran out of memory running {strategies[0].name}; it does not fit "
                               "this config (`shardlm plan` shows each strategy's peak)") from None
        raise ShardlmError(f"the devices ran out of memory holding {len(strategies)} strategies' states at once; "
                           "bench fewer strategies per call (one, for a model near the memory limit)") from None


def random_batches(cfg: Config, vocab: int, mesh, n: int) -> list:
    """`n` global batches of uniformly random tokens, the same for every mesh (seeded by `cfg.seed`), placed."""
    import jax
    import numpy as np

    from shardlm.sharding import batch_sharding

    rng = np.random.default_rng(cfg.seed)
    shape = (cfg.train.batch_size, cfg.model.seq_len + 1)
    return [jax.device_put(rng.integers(0, vocab, shape, dtype=np.int32), batch_sharding(mesh)) for _ in range(n)]


def warmed_up_step(cfg: Config, mesh, vocab: int, n_batches: int, warmup: int):
    """(compiled train step, its state after `warmup` steps, `n_batches` random batches, compile seconds): the
    real step of `cfg` on `mesh`, ready to time (bench) or trace (profile)."""
    import jax

    from shardlm.train.state import create_train_state
    from shardlm.train.step import COST_ONLY_SEPARATOR, train_step_for

    ts = create_train_state(cfg, mesh, vocab)
    batches = random_batches(cfg, vocab, mesh, n_batches)
    t0 = time.perf_counter()
    step = train_step_for(cfg, ts, mesh, separator=COST_ONLY_SEPARATOR).lower(ts.state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    state = ts.state
    for i in range(warmup):
        state, metrics = step(state, batches[i % n_batches])
    jax.block_until_ready(state)
    return step, state, batches, compile_s


def _bench(cfg: Config, strategies: list[Strategy], steps: int, warmup: int, log) -> Bench:
    import jax

    from shardlm.errors import ShardlmError
    from shardlm.flops import device_peak, peak_dtype
    from shardlm.train.source import model_flops_per_step
    from shardlm.perf.host import local_hardware
    from shardlm.perf.strategies import rejection
    from shardlm.train.data import tokenizer_vocab

    log = log or (lambda m: None)
    devices = jax.devices()
    for s in strategies:
        why = rejection(cfg, s)
        if why:
            raise ShardlmError(f"strategy {s.name}: {why}")
    vocab = tokenizer_vocab(cfg, log=log)
    b, t = cfg.train.batch_size, cfg.model.seq_len
    hardware = local_hardware(jax.local_devices(), cfg.model.dtype)  # measured on this process's devices
    runs = []
    for s in strategies:
        mesh = s.make_mesh(devices)
        step, state, batches, compile_s = warmed_up_step(cfg, mesh, vocab, 4, warmup)
        log(f"{s.name}: compiled in {compile_s:.1f} s")
        runs.append({"s": s, "step": step, "state": state, "batches": batches, "times": [], "compile_s": compile_s,
                     "loss": float("nan"), "est": _estimate(step, s.devices, hardware, devices[0].platform)})
    for r in range(steps):
        for k in range(len(runs)):
            run = runs[(k + r) % len(runs)]  # rotate who goes first
            i = (warmup + r) % len(run["batches"])
            t0 = time.perf_counter()
            run["state"], metrics = run["step"](run["state"], run["batches"][i])
            jax.block_until_ready(metrics)
            run["times"].append(time.perf_counter() - t0)
            run["loss"] = float(metrics["loss"])
        log(f"round {r + 1}/{steps}")
    peak, label = device_peak(devices, peak_dtype(cfg.model))  # on a CPU host: the estimate's, kept
    results = [BenchResult(run["s"], run["times"], b * t, model_flops_per_step(cfg, vocab, run["s"].tensor), peak,
                           run["compile_s"], run["loss"], run["est"]) for run in runs]
    return Bench(results, label, devices[0].device_kind, len(devices), hardware.describe())


def _estimate(compiled, n_devices: int, hardware, platform: str) -> float | None:
    """The step time `shardlm plan` would rank this compiled step by: its kernels on a timeline, costed with this
    host's measured figures (`shardlm.perf.timeline`). On the CPU only, where those figures are measured here."""
    from shardlm.perf import kernels
    from shardlm.perf.timeline import estimate

    if platform == "cpu":
        return estimate(kernels.program(compiled.as_text(), n_devices), n_devices, hardware,
                        hardware.rates()).step_s
    return None


def format_bench(bench: Bench, cfg: Config) -> str:
    from shardlm.config import describe
    from shardlm.train.source import flops_convention

    m, t = cfg.model, cfg.train
    base = bench.results[0].tokens_per_s
    lines = [f"bench on {bench.n_devices} x {bench.device_kind}: {describe(cfg)}; global batch {t.batch_size} x "
             f"{m.seq_len} tokens, "
             f"{len(bench.results[0].step_times)} interleaved steps per strategy (median)", ""]
    estimated = any(r.est_step_s for r in bench.results)
    head = (f"{'strategy':<16} {'step ms':>9} " + (f"{'est ms':>9} {'meas/est':>8} " if estimated else "")
            + f"{'tokens/s':>10} {'TFLOP/s/dev':>11} {'MFU':>7} {'vs first':>8} {'compile s':>9} {'loss':>8}")
    lines += [head, "-" * len(head)]
    for r in bench.results:
        est = (f"{r.est_step_s * 1e3:>9.1f} {r.step_s / r.est_step_s:>7.2f}x " if r.est_step_s
               else f"{'-':>9} {'-':>8} ") if estimated else ""
        lines.append(f"{r.strategy.name:<16} {r.step_s * 1e3:>9.1f} {est}{r.tokens_per_s:>10.0f} "
                     f"{r.tflops_per_device:>11.4f} {r.mfu:>7.1%} {r.tokens_per_s / base:>7.2f}x "
                     f"{r.compile_s:>9.1f} {r.final_loss:>8.4f}")
    lines += ["", f"MFU against {bench.results[0].peak_flops / 1e12:.3f} TFLOP/s per device ({bench.peak_label}); "
              f"FLOPs = {flops_convention(cfg)}"]
    if estimated:
        lines.append(f"est = the step time `shardlm plan` and mesh=auto rank by, costed on {bench.hardware}; "
                     "meas/est = the measured step over it")
    if bench.device_kind.lower().startswith("cpu") and bench.n_devices > 1:
        lines.append("simulated CPU devices share the host's cores: the ratios measure sharding overhead, not "
                     "speed-up")
    return "\n".join(lines)


def plot_bench(bench: Bench, cfg: Config, path) -> None:
    """A bar chart: tokens/s and MFU per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.strategy.name for r in bench.results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(7, 1.3 * len(names) + 4), 3.8))
    for ax, values, title, fmt in ((ax1, [r.tokens_per_s for r in bench.results], "tokens/s", "{:.0f}"),
                                   (ax2, [100 * r.mfu for r in bench.results], "MFU (%)", "{:.1f}")):
        bars = ax.bar(names, values, color="#4C72B0")
        ax.set_title(title)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8)
        ax.tick_params(axis="x", rotation=30)
        ax.margins(y=0.15)
    fig.suptitle(f"{cfg.model.preset}, batch {cfg.train.batch_size} x {cfg.model.seq_len}, {bench.n_devices} x "
                 f"{bench.device_kind}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
