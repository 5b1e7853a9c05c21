"""Every test process sees 8 simulated CPU devices; this must happen before JAX is imported anywhere."""

import os

# Cheap machine code (LLVM at -O0), as `shardlm plan` compiles (`shardlm.perf.planner.planning_flags`): tests
# compile hundreds of tiny programs and run each for a few steps, so compiling dominates, and this takes a third
# off the suite. Processes the tests start (the CLI) inherit the flags. Not plan's memory-minimising scheduler
# (--xla_cpu_enable_concurrency_optimized_scheduler=false): programs that run collectives inside loops (scanned
# blocks) intermittently deadlock under it in XLA:CPU's runtime (2 of 3 runs of test_cli's hybrid command, a
# collective's rendezvous waiting on a device that is in another); plans only compile, so they keep it.
# And one thread per simulated device, as `--cpu-devices` runs get (`shardlm.mesh.SINGLE_THREADED_DEVICES_FLAG`).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_multi_thread_eigen=false"
).strip()
# And XLA:CPU's older (LLVM IR) fusion emitters rather than its MLIR ones: each compile 2-3x quicker (an 8-device
# Llama step with context and tensor splits: 3.6 -> 1.9 s) to the same buffers (a plan's temporaries within 64
# bytes), the same losses to the last bit, and steps as fast. They expand every scatter into a loop over its
# indices, which the cost model would charge trip by trip, so what shardlm compiles to cost keeps the default
# (`shardlm.perf.compiled.CPU_COSTING_OPTIONS`): plans here cost the programs users' plans cost. XLA aborts on a
# flag it does not know, and flag names move between releases: this one is set on the jaxlib it was measured on.
from importlib.metadata import version  # noqa: E402

if version("jaxlib").startswith("0.10."):
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ["JAX_PLATFORMS"] = "cpu"
# Data prepared on the fly (the built-in corpus, test text) goes to a per-session cache, shared with the CLI
# subprocesses, never to the user's ~/.cache.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ["SHARDLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardlm-test-cache-")
atexit.register(shutil.rmtree, os.environ["SHARDLM_CACHE_DIR"], True)
# JAX's persistent compilation cache, one per session (made by the first process, inherited by pytest-xdist's
# workers and the CLI subprocesses): a step the tests compile again in another test or process (a run and its
# resumption, each process of a multi-process run) is loaded, not compiled. Every entry, however quick to compile.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardlm-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# A model small enough that six strategies x 20 steps compile and run in well under a minute on 2 cores. Its tests
# train on synthetic streams that hold no documents (`structured_tokens`), so it attends across them; the default
# (data.document_mask=auto) is run by the tests that train on text (the quickstart, the loop's, test_documents).
MICRO = [
    "model.n_layers=2", "model.n_heads=4", "model.d_model=64", "model.d_mlp=128", "model.seq_len=32",
    "train.batch_size=16", "train.steps=20", "train.warmup_steps=5", "train.lr=1e-2", "data.document_mask=false",
]


# A two-source mixture (`data.sources`): the built-in corpus and a page of this repository's docs, 3:1. The
# checkpoint and multi-process tests train on it, so that exact resumption and every process reading its rows
# cover mixtures (one source is the same code with one stream).
DOCS_PAGE = str(Path(__file__).resolve().parents[1] / "docs" / "strategies.md")
MIXTURE = (f"data.sources=[{{name: plays, path: shakespeare, weight: 0.75}}, "
           f"{{name: docs, path: '{DOCS_PAGE}', weight: 0.25}}]")


# (data, fsdp, tensor) degrees that every model family must train identically on (the parity tests).
PARITY_STRATEGIES = {
    "1 device": (1, 1, 1),
    "DP 8": (8, 1, 1),
    "FSDP 8": (1, 8, 1),
    "DP 4 x TP 2": (4, 1, 2),
    "FSDP 4 x TP 2": (1, 4, 2),
    "DP 2 x FSDP 2 x TP 2": (2, 2, 2),
}


@pytest.fixture(autouse=True)
def _keep_the_sessions_flags(monkeypatch):
    """Whatever a test runs in-process (`shardlm plan --devices N` sets the planning flags: `planning_flags`), the
    flags go back afterwards: the CLI subprocesses of later tests inherit this process's environment, and a
    training run under plan's memory-minimising scheduler is one XLA:CPU may deadlock (see the top)."""
    for key in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(key, os.environ[key])


@pytest.fixture
def micro_overrides():
    return list(MICRO)


def structured_tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """A learnable stream: runs of arithmetic progressions mod `vocab` with random starts and strides."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < n:
        length = int(rng.integers(8, 40))
        start, stride = int(rng.integers(0, vocab)), int(rng.integers(1, 5))
        out.append((start + stride * np.arange(length)) % vocab)
        total += length
    return np.concatenate(out)[:n].astype(np.int32)


def run_steps(overrides, degrees, steps=None, vocab=500, tokens=None, grad_norms: list | None = None,
              separator: int | None = None):
    """Train with the real state/step/loader code on a synthetic stream; returns (losses, final TrainState, mesh).
    Each step's gradient norm is appended to `grad_norms` if given. `separator`: the documents' separator token,
    for a step that attends within documents."""
    import jax

    from shardlm.config import load_config
    from shardlm.data.loader import BatchLoader
    from shardlm.mesh import make_mesh
    from shardlm.sharding import batch_sharding
    from shardlm.train.state import create_train_state
    from shardlm.train.step import train_step_for

    cfg = load_config(None, overrides)
    degrees = degrees if isinstance(degrees, dict) else dict(zip(("data", "fsdp", "tensor"), degrees))
    n = int(np.prod(list(degrees.values())))
    mesh = make_mesh(**degrees, devices=jax.devices()[:n])
    ts = create_train_state(cfg, mesh, vocab)
    bsh = batch_sharding(mesh)
    tokens = structured_tokens(40_000, vocab) if tokens is None else tokens
    loader = BatchLoader(tokens, cfg.model.seq_len, cfg.train.batch_size, bsh, seed=cfg.seed, shuffle=True)
    step = train_step_for(cfg, ts, mesh, separator=separator)
    losses = []
    for i in range(steps or cfg.train.steps):
        ts.state, metrics = step(ts.state, loader.get(i))
        losses.append(float(metrics["loss"]))
        if grad_norms is not None:
            grad_norms.append(float(metrics["grad_norm"]))
    return losses, ts, mesh


def write_stories(path, stories) -> None:
    """A file in the published TinyStories layout: each story, then a line holding only <|endoftext|>."""
    path.write_text("".join(f"{s}\n<|endoftext|>\n" for s in stories), encoding="utf-8")


def make_stories(n: int, seed: int = 0) -> list[str]:
    """Short made-up stories, some multi-line and non-ASCII, with varied lengths."""
    rng = np.random.default_rng(seed)
    names, things = ["Tom", "Lily", "Ben", "Zoë", "Mia"], ["ball", "cat", "tree", "café", "kite"]
    stories = []
    for i in range(n):
        k = int(rng.integers(1, 6))
        sents = [f"{names[int(rng.integers(5))]} saw a {things[int(rng.integers(5))]} number {i}." for _ in range(k)]
        stories.append(("\n" if i % 3 == 0 else " ").join(sents))
    return stories
