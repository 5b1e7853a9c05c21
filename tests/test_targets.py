"""Compiling for accelerators this host does not have (`shardlm.perf.targets`): XLA:GPU for H100s and XLA:TPU for
TPU slices, from the CPU. Each test compiles a small model once, by the target's own compiler, and reads what it
produced: the HLO's kernels and collectives, its memory analysis, its schedule and its estimate."""

import collections
import re

import jax.numpy as jnp
import pytest

from shardlm import cli
from shardlm.accelerator import compiling_for, resolve_dtype
from shardlm.config import load_config
from shardlm.kernels.registry import attention_impl, ring_chunk
from shardlm.models.moe import grouped_kernel
from shardlm.perf import hlo, targets
from shardlm.perf.compile_only import compile_train_step, format_report

H100, V5E = targets.get("h100"), targets.get("tpu-v5e")


def config_for(target, *overrides):
    with compiling_for(target.accelerator):
        return load_config(None, list(overrides))


def gpt2_small(target, *overrides):
    return config_for(target, "model=gpt2-small", "model.vocab_size=50257", *overrides)


def dot_operand_dtypes(hlo_text: str) -> set[str]:
    """The element types of every matmul's operands in a compiled program: `dot`s (inside Triton or loop
    fusions) and cuBLAS GEMM calls."""
    instructions = hlo._parse(hlo_text)
    shapes = {i.name: i.shape for i in instructions}
    dtypes = set()
    for ins in instructions:
        if ins.opcode == "dot" or (ins.opcode == "custom-call" and "__cublas$" in ins.attrs):
            dtypes |= {shapes[o].split("[")[0] for o in ins.operands[:2] if o in shapes}
    return dtypes


def test_the_gpu_defaults_resolve_for_an_h100_target_on_a_cpu_host():
    # What `shardlm train` picks on a GPU, resolved through the seam without one: bfloat16 compute over float32
    # weights, cuDNN's fused attention where it applies.
    assert resolve_dtype("auto") == "float32" and attention_impl("auto", jnp.bfloat16, 64) == "xla"
    assert grouped_kernel("auto") == "xla"  # the experts' grouped matmuls: XLA's ragged_dot on the CPU
    with compiling_for(H100.accelerator):
        assert resolve_dtype("auto") == "bfloat16" and grouped_kernel("auto") == "triton"
        assert attention_impl("auto", jnp.bfloat16, 64) == "cudnn"
        # a sequence split over context: the ring, cuDNN's kernel on each chunk of keys (16-bit inputs only)
        assert attention_impl("auto", jnp.bfloat16, 64, seq_split=2) == "ring"
        assert ring_chunk("auto", jnp.bfloat16, 64, 8192, 2) == "cudnn"
        assert ring_chunk("auto", jnp.float32, 64, 8192, 2) == "flash"
        assert attention_impl("auto", jnp.float32, 64) == "xla"
        assert attention_impl("auto", jnp.float32, 64, length=8192) == "flash"  # cuDNN takes 16-bit inputs only
    with compiling_for(targets.get("a100-80gb").accelerator):
        assert attention_impl("auto", jnp.bfloat16, 128) == "cudnn"
    with compiling_for(V5E.accelerator):
        assert resolve_dtype("auto") == "bfloat16" and attention_impl("auto", jnp.bfloat16, 64) == "xla"
        assert grouped_kernel("auto") == "megablox"
        assert attention_impl("auto", jnp.bfloat16, 64, length=8192) == "splash"  # Pallas's TPU kernel
        assert attention_impl("auto", jnp.bfloat16, 64, length=500) == "xla"  # not a multiple of 128, short
        assert attention_impl("auto", jnp.bfloat16, 32, length=8192) == "flash"  # a head size splash does not take
        assert ring_chunk("auto", jnp.bfloat16, 64, 8192, 4) == "splash"  # chunks of 1024: splash in the ring
        assert ring_chunk("auto", jnp.bfloat16, 64, 8192, 64) == "flash"  # chunks of 64, under its lane width
    cfg = gpt2_small(H100)
    assert (cfg.model.dtype, cfg.model.param_dtype) == ("bfloat16", "float32")
    assert load_config(None, ["model=gpt2-small"]).model.dtype == "float32"  # this CPU host's own default


@pytest.fixture(scope="module")
def fsdp8_h100s():
    return compile_train_step(gpt2_small(H100, "mesh.fsdp=8", "train.batch_size=64"), target=H100, n_devices=8)


def calls_per_step(hlo_text: str, target: str) -> int:
    """How many times a step runs custom calls of `target`: each call site times its loops' trip counts."""
    instructions = hlo._parse(hlo_text)
    times = hlo._trip_counts(instructions)
    return sum(times[i.computation] for i in instructions
               if i.opcode == "custom-call" and f'custom_call_target="{target}"' in i.attrs)


def test_gpt2_small_fsdp8_for_h100s_uses_cudnn_fused_attention_and_bf16_gemms_and_the_models_flops(fsdp8_h100s):
    r, text = fsdp8_h100s, fsdp8_h100s.step.hlo_text
    assert r.step.platform == "gpu" and r.fits and r.step.refusal is None
    # One fused forward and one fused backward attention kernel per layer, from cuDNN: one call of each in the
    # scanned blocks' loop body, run once per layer.
    assert calls_per_step(text, "__cudnn$fmhaSoftmax") == 12
    assert calls_per_step(text, "__cudnn$fmhaSoftmaxBackward") == 12
    assert dot_operand_dtypes(text) == {"bf16"}  # every matmul's operands, forward and backward
    # Memory from XLA:GPU: an eighth of the float32 master weights and AdamW moments, plus temporaries.
    assert r.params == pytest.approx(4 * 124.5e6 / 8, rel=0.01)
    # two moments, the step count, and the spike guard's window of losses and gradient norms
    assert r.optimizer == pytest.approx(2 * r.params + 2 * 4 * r.cfg.train.spike_window, abs=64)
    assert r.params + r.optimizer < r.step.peak < H100.memory_bytes
    # FLOPs: the program's (cuDNN attention counted from its calls) within 0.1% of the model's 6N + 12LTd: the
    # fused loss takes the head's gradients in its forward pass, three head matmuls as a plain head has (its
    # backward pass recomputed the logits before, a fourth: 2 d V per token, 10% more than the model's)
    assert r.step.flops_per_device == pytest.approx(r.model_flops / 8, rel=1e-3)
    report = format_report(r)
    assert "compiled by XLA:GPU" in report and "fits: yes" in report
    assert ("output head and loss, per device: gradients in the forward pass, three head matmuls: 4 block(s) of "
            "2,048 tokens x all 50,304 vocabulary rows, 393.00 MiB of float32 logits a block") in report


def test_fsdp8_on_h100s_overlaps_async_gathers_and_reduce_scatters_and_runs_fp8_gemms():
    """With model.matmul_dtype=fp8 (the bfloat16 step's GEMMs: test_gpt2_small_fsdp8_for_h100s_...): all of each
    block's matmuls (q, k, v, o, MLP in and out) are float8 GEMMs forward (e4m3 x e4m3), for d x and for d w (e5m2
    with e4m3): their FLOPs, counted from the GEMMs' shapes, are exactly the blocks' (XLA merges the q, k and v
    products that share their quantized input into one GEMM, so there are fewer than 3 x 6 per layer). The head
    stays bfloat16, the weights are all-gathered in float8, and the report counts the GEMMs."""
    layers, d, tokens = 12, 768, 8 * 512 // 8
    cfg = gpt2_small(H100, "mesh.fsdp=8", "train.batch_size=8", "model.seq_len=512", "model.matmul_dtype=fp8")
    r = compile_train_step(cfg, target=H100, n_devices=8)
    text = r.step.hlo_text
    gemms = r.gemms_by_dtype
    fp8 = [k for k in r.step.program.kernels() if k.kind == "gemm" and k.dtype.startswith("f8")]
    # 12 d^2 weights per block (4 d^2 attention, 8 d^2 MLP), 2 FLOPs a multiply-add, 3 products each
    assert sum(k.flops * k.times for k in fp8) == 3 * 2 * 12 * d**2 * tokens * layers, gemms
    n_fp8 = sum(n for dt, n in gemms.items() if dt.startswith("f8"))
    assert gemms.get("bf16") and n_fp8 >= 3 * 4 * layers, gemms
    assert {"f8e4m3fn", "f8e5m2"} <= dot_operand_dtypes(text)
    gathered = [i.shape for i in hlo._parse(text) if i.opcode == "all-gather-start"]
    assert gathered and all("f8e4m3fn[" in shape for shape in gathered if "bf16[" not in shape
                            and "f32[" not in shape), gathered
    assert any("f8e4m3fn[" in shape for shape in gathered)
    assert r.hardware.peak_flops == 1979e12  # MFU and the cost model hold it against the FP8 peak
    assert f"GEMMs per step in FP8: {n_fp8} of {n_fp8 + gemms['bf16']}" in format_report(r)
    kinds = {c["kind"] for c in hlo.summarize(r.step.collectives)}
    assert {"all-gather", "reduce-scatter"} <= kinds
    opcodes = [i.opcode for i in hlo._parse(text)]
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):  # every collective an async start/done pair
        assert opcodes.count(kind) == 0
        assert opcodes.count(f"{kind}-start") == opcodes.count(f"{kind}-done")
    assert sum(1 for c in r.step.collectives if c.kind == "all-gather") >= 2
    # XLA:GPU's schedule runs compute while weights are gathered: most of the gathers' time is hidden.
    assert r.step.schedule is not None and r.step.compiler_s > 0
    assert r.step.schedule.hidden("all-gather") > 0.5
    assert r.params == pytest.approx(4 * 124.5e6 / 8, rel=0.02)


def permutes_across_attention(hlo_text: str) -> int:
    """Async collective-permutes of a scheduled program in flight (between their start and done, in schedule
    order) across a fused attention kernel: a cuDNN or TPU custom call, or a conditional holding one."""
    by_computation: dict[str, list] = {}
    for ins in hlo._parse(hlo_text):
        by_computation.setdefault(ins.computation, []).append(ins)
    across = 0
    for instructions in by_computation.values():
        in_flight: dict[str, bool] = {}
        for ins in instructions:
            if ins.opcode == "collective-permute-start":
                in_flight[ins.name] = False
            elif ins.opcode == "collective-permute-done" and ins.operands[0] in in_flight:
                across += in_flight.pop(ins.operands[0])
            elif ins.opcode == "conditional" or (ins.opcode == "custom-call" and (
                    "__cudnn$fmha" in ins.attrs or "tpu_custom_call" in ins.attrs)):
                in_flight = dict.fromkeys(in_flight, True)
    return across


# (context 2, the smallest ring, on the CPU: test_context's test_the_ring_passes_keys_and_values_around_context_
# and_never_holds_t_by_t)
# Splash takes documents' ids (in the ring too); cuDNN's does not, and document masks asked for on H100s run the
# blockwise kernel in the ring
RING_CASES = {"h100 context 8": (H100, 8, 2048, "__cudnn$fmhaSoftmax", []),
              "h100 context 2, document masks": (H100, 2, 2048, None, ["data.document_mask=true"]),
              "tpu-v5p context 4, document masks": (targets.get("tpu-v5p"), 4, 1024, "tpu_custom_call",
                                                     ["data.document_mask=true"])}
KERNEL_NAMES = {"__cudnn$fmhaSoftmax": "cuDNN's fused kernel", "tpu_custom_call": "Pallas splash attention",
                None: "the blockwise kernel"}


def test_sequence_parallelism_compiles_for_h100s_without_pipelined_gathers():
    """Under `mesh.sequence_parallel` the step compiles for GPUs without XLA:GPU's pipelined all-gathers (what a run
    on GPUs gets too: `train.step.step_compiler_options`): with them, XLA's pipeliner restructured this step's
    gradient-accumulation loop around the residual stream's gathers (at 4 layers 39 all-gathers instead of 14, 11
    of them pipelined; at the one layer compiled here 16 instead of 8, all 16 pipelined). FSDP's weight gathers are
    still pipelined without it."""
    def gathers(sequence_parallel: str) -> tuple[int, int]:
        # one layer: the loop the pipeliner restructures is gradient accumulation's, and 4 layers, looped, took
        # 40% more compile time for the same answer
        cfg = config_for(H100, "model=llama-tiny", "model.n_layers=1", "model.n_kv_heads=4", "mesh.fsdp=2",
                         "mesh.tensor=2", "train.batch_size=8", "train.grad_accum=2",
                         f"mesh.sequence_parallel={sequence_parallel}")
        starts = [line for line in compile_train_step(cfg, target=H100, n_devices=4).step.hlo_text.splitlines()
                  if "all-gather-start(" in line]
        return len(starts), sum('"is_pipelined":true' in line for line in starts)

    plain, sequence_parallel = gathers("false"), gathers("true")
    assert plain[1] > 0  # FSDP's weight gathers, pipelined across the loop's iterations
    assert sequence_parallel[0] > plain[0] and sequence_parallel[1] == 0


def _gathered_twice(hlo_text: str) -> list[str]:
    """The buffers some computation of `hlo_text` all-gathers more than once."""
    gathered = collections.Counter((i.computation, i.operands[0]) for i in hlo._parse(hlo_text)
                                   if i.opcode == "all-gather-start")
    return [f"{computation}: {buffer}" for (computation, buffer), n in gathered.items() if n > 1]


def test_sequence_parallelism_gathers_each_activation_once_for_h100s():
    """Under sequence parallelism with the sequence also split over context, compiled for 8 H100s with every layer
    recomputed: each norm's output is gathered once for the projections that read it, and each row-parallel
    projection's output gradient once for both of its transposes (`models.layers._projections_input`,
    `_residual_branch`). Left to XLA's propagation, 8 buffers of this step were gathered twice, some over the
    context devices as well (the 70B row of docs/targets.md gathered each norm output 5 times)."""
    cfg = config_for(H100, "model=llama-1b", "model.n_layers=2", "model.seq_len=4096", "mesh.tensor=4",
                     "mesh.context=2", "mesh.sequence_parallel=true", "train.batch_size=2", "model.remat=full")
    report = compile_train_step(cfg, target=H100, n_devices=8)
    assert report.fits and _gathered_twice(report.step.hlo_text) == []
    assert sum(op.kind == "all-gather" for op in report.step.collectives) > 0


@pytest.mark.parametrize("case", list(RING_CASES))
def test_the_ring_runs_the_targets_fused_kernel_and_never_holds_t_by_t(case):
    """The ring on the context axis, compiled by XLA:GPU and XLA:TPU: keys and values permuted around it, each
    chunk attended by the platform's fused kernel (cuDNN's on H100s, splash on TPUs: every layer runs it at least
    once per device of the ring, forward and backward), and no buffer of the compiled step pairs two
    sequence-sized dimensions (the local or the whole length; the model's sizes avoid both). Within documents too:
    on the TPU (splash takes their ids, which travel with the keys) and on H100s asked for (the blockwise kernel
    in each chunk). The cuDNN case also compiles the KV-cache decode step."""
    from test_context import _sequence_pairs

    target, context, length, kernel, overrides = RING_CASES[case]
    # One layer: the ring, its kernels and permutes are each layer's own (4 layers, looped, quadrupled the calls
    # and took 40-70% more compile time). Calls counted through the layers' loop: test_gpt2_small_fsdp8_for_h100s_...
    cfg = config_for(target, "model=llama-tiny", "model.n_layers=1", "model.vocab_size=512",
                     f"model.seq_len={length}", f"mesh.context={context}", "train.batch_size=2", "model.d_model=192",
                     "model.n_heads=3", "model.n_kv_heads=1", "model.d_mlp=320", *overrides)
    r = compile_train_step(cfg, target=target, n_devices=context)
    text = r.step.hlo_text
    assert r.fits and r.attention.startswith(f"ring over context={context}")
    assert KERNEL_NAMES[kernel] in r.attention
    if kernel is not None:
        assert calls_per_step(text, kernel) >= cfg.model.n_layers * context
    if kernel == "__cudnn$fmhaSoftmax":
        assert calls_per_step(text, "__cudnn$fmhaSoftmaxBackward") >= cfg.model.n_layers * context
    assert any(c.kind == "collective-permute" for c in r.step.collectives)  # keys and values around the ring
    # ... asynchronously, some of them while a chunk's kernel runs (where, the compiler's scheduler decides)
    assert permutes_across_attention(text) >= 1
    assert _sequence_pairs(text, {length // context, length}) == []
    if kernel != "__cudnn$fmhaSoftmax":
        return

    import jax

    from shardlm.generate import Generator
    from shardlm.mesh import make_mesh
    from shardlm.sampling import Sampling
    from shardlm.train.state import abstract_model

    # 4 heads, 2 kv heads: tensor 2 splits them; one layer has its reductions (4 took twice the compile time)
    cfg = config_for(H100, "model=llama-tiny", "model.n_layers=1", "model.vocab_size=512")
    mesh = make_mesh(1, 1, 2, devices=targets.topology(H100, 2).devices)
    graphdef, abstract = abstract_model(cfg, mesh, 512)
    with targets.tracing_for(H100):
        prefill, decode = Generator(graphdef, abstract, mesh, eot_id=0).compile_for(2, 32, Sampling(0.0, 0, 1.0))
    decode_text = decode.as_text()
    assert "all-reduce" in decode_text  # tensor parallelism's per-layer reductions, compiled by XLA:GPU
    assert jax.tree.leaves(prefill.output_shardings)[0].mesh.devices.flat[0].platform == "gpu"


@pytest.mark.parametrize("target", [H100, V5E], ids=["h100", "tpu-v5e"])
def test_experts_compile_to_grouped_kernels_whose_work_is_the_routed_rows(target):
    """A mixture of experts under expert 2 x fsdp 2, compiled for 4 H100s (shardlm's Triton grouped matmul) and a
    v5e slice (Megablox): forward, d rows and d weights each run as a grouped kernel per matmul of every sparse
    layer, and the step's FLOPs per device are the model's (the routed rows), where XLA's ragged_dot multiplied
    every row by every local expert; the tokens travel by ragged all-to-all, costed at the rows in use."""
    # One sparse layer: kernels, FLOPs and exchange are per layer. Two put the layers in a loop, which doubles
    # every count below (18 grouped calls and 8 exchanges, against 9 and 4) and the compile's time (31 s of CPU
    # against 16 for H100s). Calls counted through the layers' loop: test_gpt2_small_fsdp8_for_h100s_... And 128
    # positions, not 256: the exchange's bytes halve, as below, and XLA:TPU's compile takes a quarter less time.
    cfg = config_for(target, "model=moe-tiny", "model.n_layers=1", "model.d_model=256", "model.n_heads=4",
                     "model.n_kv_heads=2", "model.moe_d_ff=512", "model.vocab_size=512", "model.seq_len=128",
                     "train.batch_size=8", "mesh.expert=2", "mesh.fsdp=2", "model.attention=xla",
                     "model.moe_exchange=ragged")
    r = compile_train_step(cfg, target=target, n_devices=4)
    assert r.fits
    kernel = "__gpu$xla.gpu.triton" if target is H100 else "tpu_custom_call"
    sparse_layers = cfg.model.n_layers // cfg.model.moe_every
    assert calls_per_step(r.step.hlo_text, kernel) >= 3 * 3 * sparse_layers  # 3 matmuls: forward, d rows, d weights
    assert r.step.flops_per_device == pytest.approx(r.model_flops / r.devices, rel=0.2)
    # The ragged exchange sends the rows in use (`ragged_all_to_all`), there and back in both passes of each layer.
    # Dropless in rounds: the first round's buffer is the balanced share, EP x T x k / EP = 512 rows of 256, which
    # balanced routing fills; a later round's (as many as routing overflows; costed once) is an eighth of it.
    ragged = [op for op in r.step.collectives if "ragged" in op.name]  # ragged-all-to-all-start, ragged_all_to_all
    assert sum(op.times for op in ragged) >= 4 * sparse_layers
    assert {(op.kind, op.bytes) for op in ragged} == {("all-to-all", 512 * 256 * 2), ("all-to-all", 64 * 256 * 2)}


def test_a_mesh_whose_axis_splits_a_torus_axis_is_made_not_refused():
    """A v5p-64 (32 chips) is a 2x2x8 torus: an axis of 4 after two of 2 must split its 8, which `jax.make_mesh`
    refuses (NotImplementedError, a traceback out of `shardlm plan --target tpu-v5p --devices 32`). The mesh is
    made over the split axis instead, every chip once."""
    from shardlm.mesh import make_named_mesh

    chips = targets.topology(targets.get("tpu-v5p"), 32).devices
    mesh = make_named_mesh({"data": 2, "fsdp": 2, "tensor": 4, "context": 2}, chips)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 4, "context": 2}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in chips)


@pytest.mark.parametrize("devices", [4])
def test_the_step_compiles_for_a_tpu_v5e_slice_with_activations_offloaded(devices):
    """FSDP 4 on a v5e slice, the MLP's hidden activations offloaded to the host (`model.remat_offload`): XLA:TPU
    places them in host memory (memory space S(5) in the compiled program, host temporaries in its memory
    analysis), and the report says so beside the device bytes; attention is Pallas splash attention."""
    # GPT-2's block at a third of GPT-2 small's width (d_model 256, 4 heads of 64, which splash takes; MLP 1,024) and
    # a vocabulary of 512: what is offloaded, and where XLA:TPU puts it, is the same, and XLA:TPU's compile time
    # grows with the sizes (20 s of CPU at GPT-2 small's width and a vocabulary of 512, 30 s with 50,257; 8 s here)
    cfg = config_for(V5E, "model=gpt2-small", "model.d_model=256", "model.n_heads=4", "model.d_mlp=1024",
                     "model.vocab_size=512", f"mesh.fsdp={devices}", "model.n_layers=2", "model.seq_len=256",
                     "train.batch_size=8", "model.remat_offload=mlp_hidden")
    r = compile_train_step(cfg, target=V5E, n_devices=devices)
    assert r.step.platform == "tpu" and r.fits
    # XLA:TPU's own estimate: given, as XLA:TPU unrolled the two layers' loop (it counts a loop's body once, so an
    # estimate of a step that still loops is withheld: `compiled.tpu_seconds`)
    assert hlo.loop_trips(r.step.hlo_text) == [] and r.step.compiler_withheld is None
    assert r.step.compiler_s is not None and r.step.compiler_s > 0 and 0 < r.to_dict()["compiler_mfu"] <= 1
    # the peak is XLA's device allocations, not XLA:TPU's own peak, which counts the host's buffers too (it rose
    # when the activations left the device); the report's temporaries are the rest of the peak beside the state
    s = r.step
    assert r.peak == s.argument_bytes + s.output_bytes - s.alias_bytes + s.temp_bytes != s.reported_peak
    assert r.peak == r.params + r.optimizer + r.temporaries
    kinds = {c["kind"] for c in hlo.summarize(r.step.collectives)}
    assert "all-gather" in kinds and ("reduce-scatter" in kinds or "all-reduce" in kinds)
    # the fused loss's gradients in its forward pass: no head matmul beyond a plain head's
    assert r.step.flops_per_device == pytest.approx(r.model_flops / devices, rel=0.1)
    # two layers' [8 / 4 rows x 256 positions x 1024] bfloat16 pre-activations, in host memory
    assert r.step.host_temp_bytes >= 2 * 2 * 256 * 1024 * 2 and "S(5)" in r.step.hlo_text
    text = format_report(r)
    assert "compiled by XLA:TPU" in text and "in host memory" in text
    assert re.search(r"\nXLA:TPU's estimate of the step: [\d.]+ ms \(MFU [\d.]+%\)\n", text), text
    # attention=auto on a TPU: Pallas splash attention, the kernel's calls in the program (forward, dq, dkv)
    assert "attention: Pallas splash attention" in text and r.step.hlo_text.count('custom_call_target="tpu_custom_call"') >= 3


def test_a_layer_keeps_what_its_remat_policy_names_compiled_for_h100s():
    """`benchmarks/memory.py` at a small size: compiled for 2 H100s at 2 and 4 layers, one GPT layer under
    `remat=none` keeps its analytic bytes per token x d_model (the named matmul outputs and its gradient shard)
    within 15%. (The benchmark prints every family and policy at d_model 2048 on 8.)"""
    from test_benchmarks import load

    memory = load("memory")
    shape = memory.Shape(d=256, heads=4, seq=1024, per_device=4, devices=2, vocab=512, gpt_mlp=1024)
    gpt = memory.measure("gpt", "none", "", shape, depths=(2, 4))
    assert gpt["device"] / memory.analytic("gpt", "none", "", shape)[0] == pytest.approx(1.0, abs=0.15)


def test_a_step_xla_tpu_refuses_for_its_memory_is_reported_not_raised(capsys):
    # XLA's attention: 32 x 8192^2 float32 scores per layer, which no v5e chip holds (the blockwise kernel fits)
    code, out, err = run_cli(capsys, "train", "--compile-only", "--target", "tpu-v5e", "model=llama-tiny",
                             "model.vocab_size=512", "model.seq_len=8192", "train.batch_size=32", "model.attention=xla")
    assert code == 1 and "fits: NO" in out, err  # a step that does not fit ends in a failing exit, for scripts
    needed, available = re.search(r"refused by the compiler: Ran out of memory .* \(([0-9.]+)G\) exceeds available "
                                  r"HBM \(([0-9.]+)G\)", out).groups()
    assert float(needed) > float(available) == pytest.approx(V5E.memory_bytes / 2**30, abs=0.01)


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_and_compile_only_take_a_target(capsys):
    """`train --compile-only --target h100 --devices 2 mesh=auto`: the target's plan (every split of 2 H100s,
    compiled by XLA:GPU, costed on the H100's figures) chooses, and the step compiled is the one chosen."""
    # one layer: four XLA:GPU compiles (three strategies, then the one chosen), each nearly twice as long with the
    # layers in a loop; what is read here is the plan's table and its choice, whatever the depth
    code, out, err = run_cli(capsys, "train", "--compile-only", "--target", "h100", "--devices", "2", "mesh=auto",
                             "model=tiny", "model.n_layers=1", "model.vocab_size=512", "train.batch_size=4")
    assert code == 0, err
    rows = [line for line in out.splitlines() if re.match(r"\s+\d\s+(fsdp2|dp2|tp2)\s", line)]
    assert len(rows) >= 2 and all(" yes " in row for row in rows), out
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for row in rows:  # params, optimizer, grads*, temps, peak: peak = params + optimizer + temps (to the rounding)
        params, optimizer, _, temps, peak = [float(n) * units[u] for n, u in re.findall(r"([\d.]+) (B|KiB|MiB|GiB)\b",
                                                                                        row)[:5]]
        assert peak >= temps and peak == pytest.approx(params + optimizer + temps, rel=0.01), row
        assert all(float(mfu) <= 100 for mfu in re.findall(r"([\d.]+)%", row)), row  # both estimators' MFU
    from test_strategy_plan import assert_progress_counts_to

    assert_progress_counts_to(err, len(rows))
    took = re.search(r"\nmesh=auto took (\S+): the fastest estimated step that fits: .* per device, on H100 SXM 80GB",
                     out)
    assert took and rows[0].split()[1] == took.group(1), out
    from shardlm.perf.strategies import parse_strategy

    mesh = " x ".join(f"{a}={d}" for a, d in parse_strategy(took.group(1), 2).mesh.items())
    assert f"\nmesh {mesh} on 2 H100 SXM 80GB device(s); compiled by XLA:GPU" in out and "\nfits: yes" in out
    assert "\nattention: cuDNN's fused kernel (an NVIDIA GPU" in out


def test_plan_compares_fp8_with_bfloat16_each_at_its_own_peak():
    """`plan --target h100 --matmul-dtype auto,fp8`: each strategy compiled both ways, the FP8 step's GEMMs in
    float8 and the other's in bfloat16, each costed and its MFU held against its own dense peak (989 and 1,979
    TFLOP/s), the table naming the variant and its override, and a line comparing the two steps."""
    from shardlm.perf.planner import format_plan, plan
    from shardlm.perf.strategies import Strategy

    cfg = config_for(H100, "model=tiny", "model.n_layers=1", "model.vocab_size=512", "model.seq_len=64",
                     "train.batch_size=2")
    hw = H100.hardware("bfloat16", 2)
    p = plan(cfg, 2, hw, strategies=[Strategy(1, 2, 1)], target=H100, matmul_dtypes=["auto", "fp8"])
    rows = {r.matmul_dtype: r for r in p.strategies}
    assert sorted(rows) == ["auto", "fp8"]
    gemm_dtypes = {m: {k.dtype for k in r.program.kernels() if k.kind == "gemm"} for m, r in rows.items()}
    assert gemm_dtypes["auto"] == {"bf16"} and {"f8e4m3fn", "f8e5m2"} <= gemm_dtypes["fp8"], gemm_dtypes
    for m, peak in (("auto", 989e12), ("fp8", 1979e12)):
        r = rows[m]
        assert r.mfu(r.est.step_s, hw) == pytest.approx(r.model_flops / 2 / r.est.step_s / peak)
        assert r.overrides()[-1] == f"model.matmul_dtype={m}" and r.to_dict(hw)["matmul_dtype"] == m
    text = format_plan(p)
    assert " fsdp2 matmul_dtype=fp8 " in text and " fsdp2 matmul_dtype=auto " in text
    speedup = rows["auto"].est.step_s / rows["fp8"].est.step_s
    assert f"FP8 matmuls against the compute dtype's, per strategy: fsdp2: {speedup:.2f}x faster" in text


def test_a_known_compiler_failure_says_the_way_round_it():
    """XLA:GPU's Triton GEMM emitter fails on some matmul shapes (compiled for 4 A100s: moe-tiny at d_model 96,
    seq_len 640, fsdp 2 x context 2); the one line names XLA's flag that compiles them another way (checked by
    hand: with it that step compiles)."""
    from shardlm.perf.compiled import _failure

    said = ("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot.156 = bf16[1280,96]{1,0} dot("
            "%bitcast.1496, %parameter_1.3), lhs_contracting_dims={1}, " + "x" * 400 + "\n\n*** Begin stack trace")
    message = str(_failure("gpu", RuntimeError(said)))
    assert "\n" not in message and message.startswith("XLA:GPU failed to compile the step: INTERNAL: Couldn't find")
    assert message.endswith("compile without it: XLA_FLAGS=--xla_gpu_enable_triton_gemm=false)")


def test_a_compiler_failure_is_one_line_naming_the_strategy(capsys, monkeypatch):
    """A compiler that fails (here XLA:CPU, made to fail as XLA:GPU fails when ptxas does) on one strategy of a
    plan: that strategy's line says so and the others rank, as text and as JSON; on every strategy, or under
    `--compile-only`: one line and a failing exit, no traceback."""
    import json
    import threading

    import jax

    compile_for_real, lock, fail = jax.stages.Lowered.compile, threading.Lock(), {"first": None, "all": False}
    said = "INTERNAL: ptxas exited with non-zero error code 65280, output: ptxas fatal"

    def compile_or_fail(self, *args, **kwargs):
        """The first program compiled fails every time it is compiled, as a compiler's own failure would (a plan
        tries an XLA:CPU program once more without its options: `perf.compiled.compile_with`)."""
        with lock:
            fail["first"] = fail["first"] or self
            failing = fail["all"] or fail["first"] is self
        if failing:
            raise jax.errors.JaxRuntimeError(said + "\n\n*** Begin stack trace ***\n\tabsl::Status ...\n")
        return compile_for_real(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_or_fail)
    # the 8 devices every test process sees (conftest): JAX may already be running with them
    plan = ["plan", "--devices", "8", "--strategies", "fsdp8,dp8", "model=tiny", "model.vocab_size=512"]
    code, out, err = run_cli(capsys, *plan)
    failed = [line for line in out.splitlines() if line.startswith("failed to compile: ")]
    assert code == 0 and len(failed) == 1, (out, err)
    assert failed[0].endswith(f": XLA:CPU failed to compile the step: {said}") and "Traceback" not in out + err
    other = "dp8" if "fsdp8" in failed[0] else "fsdp8"
    assert re.search(rf"\n\s+1\s+{other}\s", out) and "recommended: " + other in out
    fail["first"] = None
    code, out, err = run_cli(capsys, *plan, "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0 and [row["failed"] for row in rows.values() if "failed" in row] == [
        f"XLA:CPU failed to compile the step: {said}"]
    fail["all"] = True
    for argv in (plan + ["--json"], ["train", "--compile-only", "model=tiny", "model.vocab_size=512",
                                     "mesh.fsdp=8"]):
        code, out, err = run_cli(capsys, *argv)
        # beside the progress lines ("[1/2] fsdp2: ...", "compiling the train step ..."), one line: the error
        (line,) = [line for line in err.splitlines() if line.startswith("shardlm: error: ")]
        assert code == 2 and out == "" and "Traceback" not in err, (argv, out, err)
        assert "XLA:CPU failed to compile the step: INTERNAL: ptxas exited" in line
        assert ("no strategy compiled: fsdp8: " in line) if argv[0] == "plan" else line.endswith(
            f"{said} (mesh stage=1 x data=1 x fsdp=8 x expert=1 x context=1 x tensor=1)")


@pytest.mark.parametrize("argv, message", [
    (["plan", "--target", "h999"], "unknown target 'h999'; known targets: h100, h200, a100-80gb, tpu-v4"),
    (["train", "--target", "h100"], "add --compile-only"),
    (["explain", "--devices", "8"], "pass --target too"),
    (["plan", "--target", "tpu-v5e", "--devices", "3", "model=tiny"], "power-of-two number of chips"),
    (["train", "--compile-only", "--target", "a100-80gb", "--devices", "8", "model=tiny", "model.matmul_dtype=fp8"],
     "model.matmul_dtype=fp8 needs FP8 matrix units"),
    (["plan", "--target", "a100-80gb", "--devices", "2", "--matmul-dtype", "auto,fp8", "model=tiny"],
     "model.matmul_dtype=fp8 needs FP8 matrix units"),
])
def test_bad_target_input_is_one_line(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_missing_compiler_names_the_extra(capsys, monkeypatch):
    monkeypatch.setattr(targets, "_installed", lambda package: None if package == "libtpu" else "0.10.2")
    code, _, err = run_cli(capsys, "plan", "--target", "tpu-v5p", "model=tiny")
    assert code == 2 and "pip install 'shardlm[targets]'" in err and "jax[tpu]==" in err
    monkeypatch.setattr(targets, "_installed", lambda package: "0.9.0" if package == "jax-cuda12-pjrt" else "0.10.2")
    code, _, err = run_cli(capsys, "train", "--compile-only", "--target", "h100")
    assert code == 2 and "jax-cuda12-pjrt 0.9.0 does not match jaxlib 0.10.2" in err


def test_compiles_at_once_each_report_the_tensors_xla_replicated_to_reshard_them(capfd):
    """Two programs compiled at once, as a plan compiles its strategies, each moving a table's split from its
    columns (over context x data) to its rows (over context), which XLA's partitioner can only do by replicating
    the table: each compile names its own tensor (whole, with its bytes, and the operation it came from), and
    XLA's multi-line warning does not reach the terminal."""
    import threading

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from shardlm.perf.compiled import compile_step

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "context"))

    def lowered(name: str, rows: int):
        def positions(table):
            broadcast = jnp.broadcast_to(table[None], (1, *table.shape)) * 2
            return jax.lax.with_sharding_constraint(broadcast, NamedSharding(mesh, P(None, "context", None)))

        positions.__name__ = name  # what a plan does to tell its compiles apart (`train.step.make_train_step`)
        return jax.jit(positions, in_shardings=NamedSharding(mesh, P(None, ("context", "data")))).lower(
            jax.ShapeDtypeStruct((rows, 64), jnp.float32))

    programs = {"step_a": lowered("step_a", 32), "step_b": lowered("step_b", 64)}
    steps = {}
    threads = [threading.Thread(target=lambda name=name: steps.update({name: compile_step(programs[name], 8)}))
               for name in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    found = {name: [(x.shape, x.bytes, x.op_name) for x in step.rematerialisations] for name, step in steps.items()}
    assert found == {"step_a": [("f32[1,32,64]", 32 * 64 * 4, "broadcast_in_dim")],
                     "step_b": [("f32[1,64,64]", 64 * 64 * 4, "broadcast_in_dim")]}, found
    assert "Involuntary" not in capfd.readouterr().err


def test_silencing_native_stderr_from_several_threads_restores_it():
    """Compiles in a plan's threads each silence XLA's C++ stderr; blocks that overlap and end out of order leave
    descriptor 2 where it was (before, the one that began second restored /dev/null), and Python's own lines
    written meanwhile are not lost."""
    import os
    import threading

    from shardlm.accelerator import native_stderr_silenced

    before = os.fstat(2)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with native_stderr_silenced():
            first_in.set()
            second_in.wait()
        first_out.set()

    def second():
        first_in.wait()
        with native_stderr_silenced():
            second_in.set()
            first_out.wait()
            assert os.fstat(2).st_ino != before.st_ino  # still silenced: the other block ended, this one did not

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)


def test_muon_on_fsdp4_and_tensor2_for_h100s_gathers_and_holds_what_adamw_does_plus_its_own_exchange():
    """A small Llama's step compiled for 8 H100s on fsdp 4 x tensor 2 (the layout of issue 76's 8B, where Muon's
    step held 65.55 GiB per device against AdamW's 38.93 and gathered 185 GiB against 14): XLA replicates nothing
    to reshard, Muon's peak is within 10% of AdamW's (below it: one momentum per matrix, not two moments), it
    gathers what AdamW gathers, and its own traffic is its exchange, five all-to-alls of its matrices' share per
    device (a gradient, its momentum and its weight to the owners, the update and the momentum back). Before: 3.0x
    AdamW's peak and 13x its gathers here."""
    small = ["model=llama-3.1-8b", "model.n_layers=8", "model.d_model=512", "model.n_heads=8", "model.n_kv_heads=4",
             "model.d_mlp=2048", "model.seq_len=512", "model.vocab_size=8192", "train.batch_size=8", "mesh.fsdp=4",
             "mesh.tensor=2", "model.remat=full"]
    muon, adamw = (compile_train_step(config_for(H100, *small, f"train.optimizer={name}"), target=H100, n_devices=8)
                   for name in ("muon", "adamw"))
    assert muon.step.rematerialisations == [] and "replicated to reshard" not in format_report(muon)
    assert muon.peak <= 1.1 * adamw.peak, (muon.peak, adamw.peak)
    kinds = [{c["kind"]: c["bytes"] for c in hlo.summarize(r.step.collectives)} for r in (muon, adamw)]
    assert kinds[0]["all-gather"] <= 1.1 * kinds[1]["all-gather"], kinds
    momentum = adamw.optimizer - muon.optimizer  # AdamW's two moments per matrix against Muon's one
    assert kinds[0]["all-to-all"] - kinds[1].get("all-to-all", 0) == pytest.approx(5 * momentum, rel=0.01), kinds
