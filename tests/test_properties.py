"""Every configuration a user can write trains, or refuses in one line: whole configurations drawn over the config
space by `hypothesis`, each run through `shardlm.train.loop.train` as `shardlm train` runs it.

A drawn configuration is a model family and its sizes (odd, prime and tiny lengths, head sizes, vocabularies the
tensor split does not divide; Llama 3's and Qwen's settings, DeepSeek's latent attention, dense first layers, MTP
and routing), a batch from 1 up, a mesh of 1 to 8 simulated devices over every axis (pipeline
stages, data, FSDP, experts, context, tensor), an attention kernel and block, a remat policy, gradient
accumulation, a pipeline schedule with repeats and microbatches, experts with their capacity, kernel and exchange,
FP8, dropout, dtypes, and a data mixture (with, now and then, a source that does not exist). Each must either
train a step to a finite loss (and evaluate it), or raise `ShardlmError` with a one-line message before anything
is written. Any other exception fails the test and prints the configuration as the command line that reproduces
it (`--cpu-devices N` and its overrides).

The suite runs a fixed, derandomised set (`EXAMPLES`, about two minutes on two cores). Before a release run many
more: `SHARDLM_PROPERTY_EXAMPLES=300 python -m pytest -n 0 -s tests/test_properties.py`, a fresh draw each time,
each configuration and its outcome printed as it runs (the compiles for accelerators take a quarter of that
number).
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import shlex
import shutil
import tempfile
import uuid
from pathlib import Path

import jax
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from conftest import DOCS_PAGE
from shardlm.config import load_config
from shardlm.errors import ShardlmError

LONG = int(os.environ.get("SHARDLM_PROPERTY_EXAMPLES", "0"))
EXAMPLES = LONG or 16
TARGET_EXAMPLES = LONG // 4 or 3  # compiles for H100s and TPUs: about ten seconds each
MESH_AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")
PRIMES = (2, 3, 5, 7)
LENGTHS = (1, 2, 3, 7, 8, 13, 16, 31, 33, 64, 97, 127, 128, 131, 160, 256)
REMATS = ("none", "full", "save_attention", "save_qkv_proj", "dots_saveable", "dots_with_no_batch_dims_saveable",
          "save:attention_out,mlp_out")


@dataclasses.dataclass(frozen=True)
class Drawn:
    """A whole configuration: the devices it runs on and its overrides, shown as the command that runs it."""

    devices: int
    overrides: tuple[str, ...]

    def __repr__(self) -> str:
        return f"shardlm train --cpu-devices {self.devices} {' '.join(map(shlex.quote, self.overrides))}"


@dataclasses.dataclass(frozen=True)
class Mesh:
    devices: int
    degrees: dict  # as written: {axis: degree or -1}; mesh.data left out takes the rest
    sizes: dict  # every axis's size, resolved


@st.composite
def meshes(draw) -> Mesh:
    """1 to 8 devices: each prime factor of the count to an axis; now and then one axis is left to take the rest
    (-1, or mesh.data's default)."""
    devices = draw(st.integers(1, 8))
    sizes = dict.fromkeys(MESH_AXES, 1)
    n = devices
    for p in PRIMES:
        while n % p == 0:
            sizes[draw(st.sampled_from(MESH_AXES))] *= p
            n //= p
    degrees = {a: d for a, d in sizes.items() if d > 1}
    rest = draw(st.sampled_from([None, None, "-1", "data"]))
    if rest and degrees:
        axis = draw(st.sampled_from(sorted(degrees)))
        if rest == "-1":
            degrees[axis] = -1
        elif axis == "data":
            degrees.pop("data")  # mesh.data's default: the devices the other axes leave
    return Mesh(devices, degrees, sizes)


def _multiple(draw, tidy: bool, of: int, wild) -> int:
    """A multiple of `of` (1 or 2 times) when `tidy`, else a draw from `wild`."""
    return of * draw(st.integers(1, 2)) if tidy else draw(wild)


@st.composite
def models(draw, mesh: Mesh, tidy: bool) -> list[str]:
    """A family and its sizes. Drawn `tidy`, the sizes are what the mesh splits (heads by tensor, the sequence in
    2 x context chunks, layers by stages); else anything, for the refusals."""
    family = draw(st.sampled_from(["gpt", "llama", "moe", "qwen", "deepseek"]))
    tensor, context, stages = mesh.sizes["tensor"], mesh.sizes["context"], mesh.sizes["stage"]
    heads = _multiple(draw, tidy, tensor, st.sampled_from([1, 2, 3, 4, 6, 8]))
    head_dim = draw(st.sampled_from([2, 4, 8, 16]))
    lengths = st.one_of(st.sampled_from(LENGTHS), st.integers(1, 160))
    length = draw(lengths) if not tidy or context == 1 else 2 * context * draw(st.sampled_from([1, 3, 8, 13]))
    layers = draw(st.integers(1, 4)) if not tidy or stages == 1 else stages * draw(st.integers(1, 2))
    preset = {"gpt": "tiny", "llama": "llama-tiny", "moe": "moe-tiny", "qwen": "qwen3-tiny", "deepseek": "deepseek-tiny"}
    out = [f"model={preset[family]}",
           f"model.n_layers={layers}", f"model.n_heads={heads}", f"model.d_model={heads * head_dim}",
           f"model.d_mlp={draw(st.sampled_from([4, 8, 24, 64]))}", f"model.seq_len={length}"]
    if family in ("llama", "moe", "qwen"):
        kv = [k for k in (1, 2, 3, 4) if heads % k == 0 and (not tidy or k % tensor == 0)]
        out.append(f"model.n_kv_heads={draw(st.sampled_from([0] + kv))}")
        out += draw(llama_settings(family))
    if family == "deepseek":
        out += draw(latent_attention(mesh, tidy, layers))
    if family in ("moe", "deepseek"):
        experts = _multiple(draw, tidy, mesh.sizes["expert"], st.sampled_from([2, 3, 4, 8]))
        experts = max(experts, 2)
        top_k = draw(st.integers(1, experts))
        out += [f"model.moe_experts={experts}", f"model.moe_top_k={top_k}",
                f"model.moe_d_ff={draw(st.sampled_from([0, 4, 12]))}",
                f"model.moe_capacity_factor={draw(st.sampled_from([0.0, 0.5, 1.0, 1.25]))}",
                f"model.moe_shared_expert={draw(st.booleans())}",
                f"model.moe_kernel={draw(st.sampled_from(['auto', 'xla', 'triton', 'megablox']))}",
                f"model.moe_exchange={draw(st.sampled_from(['auto', 'all_to_all', 'ragged']))}",
                f"model.moe_dropless={draw(st.sampled_from(['rounds', 'buffer']))}"]
        if draw(st.booleans()) and not (tidy and stages > 1) and family == "moe":
            out += ["model.moe_every=2", "model.scan_layers=false", f"model.n_layers={draw(st.sampled_from([2, 4]))}"]
        out += draw(routing(experts, top_k, tidy))
    if family == "gpt":
        out += [f"model.use_bias={draw(st.booleans())}", f"model.qk_norm={draw(st.booleans())}"]
    out.append(f"model.tie_embeddings={draw(st.booleans())}")
    return out


@st.composite
def llama_settings(draw, family: str) -> list[str]:
    """The Llama block's settings Llama 3 and Qwen brought: rotary scaling, a head size of its own, q/k norms and
    q/k/v biases (head_dim 0: d_model / heads; the qwen family's preset sets one)."""
    out = [f"model.head_dim={draw(st.sampled_from([0, 0, 6, 8, 16]))}", f"model.qk_norm={draw(st.booleans())}",
           f"model.qkv_bias={draw(st.booleans())}"]
    scaling = draw(st.sampled_from(["none", "none", "llama3", "yarn"]))
    out.append(f"model.rope_scaling={scaling}")
    if scaling != "none":
        out += [f"model.rope_factor={draw(st.sampled_from([1.0, 4.0, 8.0]))}",
                f"model.rope_original_context={draw(st.sampled_from([0, 8, 64]))}"]
    return out


@st.composite
def latent_attention(draw, mesh: Mesh, tidy: bool, layers: int) -> list[str]:
    """DeepSeek's: latent sizes, the heads' plain, rotary and value widths, dense first layers, MTP (which
    pipeline stages refuse)."""
    stages = mesh.sizes["stage"]
    first = draw(st.integers(0, max(layers - 1, 0)))
    if tidy and stages > 1:  # the stack (the layers after the dense ones) splits over the stages
        first = 0
    return [f"model.mla_kv_rank={draw(st.sampled_from([4, 16, 32]))}",
            f"model.mla_q_rank={draw(st.sampled_from([0, 8, 24]))}",
            f"model.mla_rope_dim={draw(st.sampled_from([2, 8, 16] + ([] if tidy else [3])))}",
            f"model.mla_nope_dim={draw(st.sampled_from([4, 16]))}", f"model.mla_v_dim={draw(st.sampled_from([4, 8]))}",
            f"model.moe_first_dense={first}",
            f"model.mtp_depth={0 if tidy and stages > 1 else draw(st.sampled_from([0, 1, 2]))}"]


@st.composite
def routing(draw, experts: int, top_k: int, tidy: bool) -> list[str]:
    """How tokens choose experts: softmax or sigmoid (DeepSeek's, with its balancing bias), renormalised or not,
    limited to groups (drawn tidy, enough of them kept for the top k), scaled."""
    router = draw(st.sampled_from(["softmax", "sigmoid"]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if experts % g == 0]))
    fewest = -(-top_k * groups // experts) if tidy else 1
    return [f"model.moe_router={router}", f"model.moe_norm_topk={draw(st.booleans())}",
            f"model.moe_groups={groups}", f"model.moe_group_top_k={draw(st.integers(fewest, groups))}",
            f"model.moe_routed_scale={draw(st.sampled_from([1.0, 2.5]))}",
            f"model.moe_bias_rate={draw(st.sampled_from([0.0, 1e-3])) if router == 'sigmoid' else 0.0}"]


@st.composite
def numerics(draw, mesh: Mesh, tidy: bool) -> list[str]:
    """Kernels, remat, dtypes, the pipeline's schedule: what a model computes with."""
    remat = draw(st.sampled_from(REMATS))
    out = [f"model.attention={draw(st.sampled_from(['auto', 'auto', 'xla', 'flash', 'splash', 'cudnn']))}",
           f"model.attention_block={draw(st.sampled_from([512, 512, 16, 100, 7]))}",
           f"model.context_attention={draw(st.sampled_from(['ring', 'ring', 'all_gather']))}",
           f"model.remat={remat}",
           f"model.dtype={draw(st.sampled_from(['auto', 'float32', 'bfloat16']))}",
           f"model.grad_reduce_dtype={draw(st.sampled_from(['auto', 'float32']))}",
           f"model.matmul_dtype={draw(st.sampled_from(['auto', 'auto', 'auto', 'fp8']))}",
           f"model.dropout={draw(st.sampled_from([0.0, 0.0, 0.1]))}",
           f"model.loss_chunks={draw(st.sampled_from([0, 0, 1, 3]))}"]
    if mesh.sizes["stage"] > 1 or not tidy:
        schedule = draw(st.sampled_from(['gpipe', '1f1b']))
        out += [f"model.pipeline_schedule={schedule}",
                f"model.pipeline_repeats={1 if tidy else draw(st.sampled_from([1, 1, 2]))}",
                f"model.pipeline_microbatches={draw(st.sampled_from([0, 0, 2, 3, 4]))}",
                f"model.pipeline_remat={draw(st.sampled_from(['iteration', 'layer']))}"]
        if tidy and remat == "none":
            out[-1] = "model.pipeline_remat=iteration"
    if draw(st.integers(0, 9)) == 0 and not (tidy and (remat.startswith("dots") or mesh.sizes["stage"] > 1)):
        out.append("model.remat_offload=block_input")
    if draw(st.integers(0, 4)) == 0 and not (tidy and mesh.sizes["stage"] > 1):
        out.append("model.scan_layers=false")
    return out


@st.composite
def data(draw, notes: str, tidy: bool) -> list[str]:
    kind = draw(st.sampled_from(["bytes", "bytes", "bytes", "bpe", "mixture"] + ["missing"] * (not tidy)))
    if kind in ("bytes", "bpe"):
        out = [f"data.tokenizer={kind}"]
    else:
        second = notes if kind == "mixture" else str(Path(notes).with_name("missing.txt"))
        weights = draw(st.sampled_from([(1, 1.0099), (0.3, 0.7), (3, 0), (0.9, 0.1)]))
        out = ["data.tokenizer=bytes", f"data.sources=[{{name: plays, path: shakespeare, weight: {weights[0]}}}, "
                                       f'{{name: notes, path: "{second}", weight: {weights[1]}}}]']
    if draw(st.integers(0, 4)) == 0:
        out.append(f"model.vocab_size={draw(st.sampled_from([300, 1000]))}")
    return out


def _setting(overrides: list[str], key: str, default):
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    return type(default)(values[-1]) if values else default


@st.composite
def recipe(draw) -> list[str]:
    """The training recipe's settings: the optimizer (Muon's momentum Nesterov or not), the spike guard, z-loss and
    document masks."""
    return [f"train.optimizer={draw(st.sampled_from(['adamw', 'adamw', 'muon', 'lion', 'adafactor']))}",
            f"train.muon_nesterov={draw(st.booleans())}",
            f"train.skip_spikes={draw(st.booleans())}", f"train.spike_window={draw(st.sampled_from([2, 128]))}",
            f"train.z_loss={draw(st.sampled_from([0.0, 0.0, 1e-4]))}",
            f"data.document_mask={draw(st.sampled_from(['auto', 'auto', 'true', 'false']))}"]


@st.composite
def configurations(draw, notes: str) -> Drawn:
    """A whole configuration. Seven in ten are drawn tidy (sizes the mesh splits), so that most reach training;
    the rest anywhere."""
    mesh = draw(meshes())
    tidy = draw(st.integers(0, 9)) < 7
    model, maths = draw(models(mesh, tidy)), draw(numerics(mesh, tidy))
    grad_accum = draw(st.sampled_from([1, 1, 2, 3, 4]))
    stages = mesh.sizes["stage"]
    micro = (_setting(maths, "model.pipeline_microbatches", 0) or stages) if stages > 1 else 1
    split = mesh.sizes["data"] * mesh.sizes["fsdp"] * mesh.sizes["expert"] * grad_accum * micro
    batch = _multiple(draw, tidy, split, st.one_of(st.integers(1, 4), st.integers(1, 16)))
    out = [*model, *maths, *draw(data(notes, tidy)), *draw(recipe()),
           *(f"mesh.{axis}={degree}" for axis, degree in mesh.degrees.items()),
           f"mesh.sequence_parallel={draw(st.booleans())}",
           f"train.batch_size={batch}", f"train.grad_accum={grad_accum}",
           f"train.shard_optimizer_over_data={draw(st.booleans())}",
           f"train.sample_tokens={draw(st.sampled_from([0, 0, 0, 0, 3]))}",
           "train.steps=1", "train.eval_batches=1", "train.warmup_steps=0", "seed=1"]
    return Drawn(mesh.devices, tuple(out))


def attempt(drawn: Drawn, root: Path) -> str:
    """Train the drawn configuration for a step: "ran" (finite losses) or "refused: <its one line>" (nothing
    written). Anything else raises."""
    from shardlm.train.loop import train

    run_dir = root / f"run-{uuid.uuid4().hex[:8]}"
    try:
        summary = train(load_config(None, list(drawn.overrides)), run_dir, progress=False,
                        devices=jax.devices()[:drawn.devices])
    except ShardlmError as e:
        message = str(e)
        assert message.strip() and "\n" not in message, f"{drawn}: a refusal of more than one line: {message!r}"
        assert not run_dir.exists(), f"{drawn}: refused after writing {run_dir}: {message}"
        return f"refused: {message}"
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary["final_eval_loss"]), (drawn, summary)
    shutil.rmtree(run_dir)
    return "ran"


def notes_file() -> str:
    """A second source for the drawn mixtures: a page of this repository's docs, as text, in a directory of its own
    (its tokens are cached beside it by path)."""
    root = Path(tempfile.mkdtemp(prefix="shardlm-properties-"))
    atexit.register(shutil.rmtree, root, True)
    (root / "notes.txt").write_text(Path(DOCS_PAGE).read_text()[:20_000])
    return str(root / "notes.txt")


_settings = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG, database=None,
                     phases=[Phase.explicit, Phase.generate], print_blob=False,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_settings
@given(configurations(notes_file()))
def test_every_drawn_configuration_trains_a_step_or_refuses_in_one_line(tmp_path_factory, drawn):
    outcome = attempt(drawn, tmp_path_factory.getbasetemp())
    if LONG:
        print(f"{outcome[:160]}  <-  {drawn!r}", flush=True)



@dataclasses.dataclass(frozen=True)
class TargetDrawn:
    """A compile for an accelerator this host does not have: `train --compile-only` or `plan`, its arguments."""

    argv: tuple[str, ...]

    def __repr__(self) -> str:
        return "shardlm " + " ".join(map(shlex.quote, self.argv))


@st.composite
def target_compiles(draw) -> TargetDrawn:
    """Shapes an accelerator's kernels care about: head sizes of 64 and 128 (and others), lengths that are and are
    not multiples of 128, meshes of 1 to 4 devices over every axis, each attention kernel and remat policy."""
    target = draw(st.sampled_from(["h100", "h100", "tpu-v5p", "tpu-v5e", "tpu-v6e", "a100-80gb"]))
    devices = draw(st.sampled_from([1, 2, 4]))
    heads, head_dim = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([64, 64, 128, 32, 48]))
    family = draw(st.sampled_from(["tiny", "llama-tiny", "moe-tiny"]))
    split = devices
    degrees: dict[str, int] = {}
    while split > 1:
        axis = draw(st.sampled_from(["data", "fsdp", "tensor", "context", "stage"]
                                    + (["expert"] if family == "moe-tiny" else [])))
        degrees[axis] = degrees.get(axis, 1) * 2
        split //= 2
    overrides = [f"model={family}", f"model.n_layers={draw(st.sampled_from([1, 2]))}", f"model.n_heads={heads}",
                 f"model.d_model={heads * head_dim}", f"model.d_mlp={draw(st.sampled_from([128, 384]))}",
                 f"model.seq_len={draw(st.sampled_from([128, 256, 640, 1280, 97, 1000]))}",
                 "model.vocab_size=1000", f"model.attention={draw(st.sampled_from(['auto', 'auto', *ATTENTION]))}",
                 f"model.remat={draw(st.sampled_from(['none', 'full', 'save_attention']))}",
                 f"train.batch_size={draw(st.sampled_from([devices, 2 * devices, 1]))}"]
    if family != "tiny":
        overrides.append(f"model.n_kv_heads={draw(st.sampled_from([0, 1]))}")
    if draw(st.integers(0, 5)) == 0:
        return TargetDrawn(("plan", "--target", target, "--devices", str(min(devices, 2)), *overrides))
    overrides += [f"mesh.{axis}={degree}" for axis, degree in degrees.items()]
    return TargetDrawn(("train", "--compile-only", "--target", target, "--devices", str(devices), *overrides))


ATTENTION = ("xla", "flash", "splash", "cudnn")
# Splash attention at 640 positions, whose blocks were once the largest divisor up to 512 (320: not a multiple of
# the 128 its kernel takes), compiled by XLA:TPU
TPU_AT_640 = TargetDrawn(("train", "--compile-only", "--target", "tpu-v5p", "--devices", "4", "model=tiny",
                          "model.n_layers=1", "model.n_heads=2", "model.d_model=128", "model.seq_len=640",
                          "model.vocab_size=1000", "model.attention=splash", "mesh.fsdp=4", "train.batch_size=4"))


@settings(max_examples=TARGET_EXAMPLES, deadline=None, derandomize=not LONG, database=None,
          phases=[Phase.explicit, Phase.generate], print_blob=False,  # capsys is read out before each example
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(target_compiles())
@example(TPU_AT_640)
def test_every_drawn_compile_for_an_accelerator_reports_or_refuses_in_one_line(capsys, drawn):
    """`train --compile-only --target T` and `plan --target T` over drawn shapes: a report (exit 0, or 1 when the
    step does not fit), or a one-line error (exit 2). Any other exception fails, naming the command."""
    from shardlm import cli

    capsys.readouterr()
    code = cli.main(list(drawn.argv))
    out = capsys.readouterr()
    if code == 2:
        errors = [line for line in out.err.splitlines() if line.startswith("shardlm: error:")]
        assert len(errors) == 1 and "Traceback" not in out.err, f"{drawn}: {out.err[-2000:]}"
    else:
        assert code in (0, 1), f"{drawn}: exit {code}\n{out.err[-2000:]}"
    if drawn == TPU_AT_640:
        assert code == 0 and "attention: Pallas splash attention" in out.out, f"{drawn}: {out.out[-3000:]}"
    if LONG:
        with capsys.disabled():
            print(f"exit {code}  <-  {drawn!r}", flush=True)
