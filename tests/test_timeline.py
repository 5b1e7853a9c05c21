"""The per-kernel step-time model on small hand-written programs in XLA's optimised-HLO text: each kernel costed by
its kind's table, collectives hidden where the schedule overlaps them, loops charged by their trip counts."""

import math

import pytest

from shardlm.perf import kernels, timeline
from shardlm.perf.rates import table
from shardlm.perf.targets import get

H100 = get("h100").hardware("bfloat16", 8)
RATES = H100.rates()

GEMM = """
%gemm_computation (p0: bf16[4096,4096], p1: bf16[4096,4096]) -> bf16[4096,4096] {
  %p0 = bf16[4096,4096]{1,0} parameter(0)
  %p1 = bf16[4096,4096]{1,0} parameter(1)
  ROOT %dot.1 = bf16[4096,4096]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
ADD = """
%add_computation (q0: f32[8192,8192], q1: f32[8192,8192]) -> f32[8192,8192] {
  %q0 = f32[8192,8192]{1,0} parameter(0)
  %q1 = f32[8192,8192]{1,0} parameter(1)
  ROOT %add.1 = f32[8192,8192]{1,0} add(%q0, %q1)
}
"""


def _program(body: str, computations: str = GEMM + ADD):
    text = "HloModule m, is_scheduled=true\n" + computations + """
ENTRY %main (a: bf16[4096,4096], b: bf16[4096,4096], x: f32[8192,8192], w: bf16[512,4096]) -> bf16[4096,4096] {
  %a = bf16[4096,4096]{1,0} parameter(0)
  %b = bf16[4096,4096]{1,0} parameter(1)
  %x = f32[8192,8192]{1,0} parameter(2)
  %w = bf16[512,4096]{1,0} parameter(3)
""" + body + "\n}\n"
    return kernels.program(text, 8)


def _step(program) -> float:
    return timeline.estimate(program, 8, H100, RATES).step_s


def test_a_large_gemm_on_an_h100_costs_its_flops_at_the_tables_measured_throughput():
    p = _program("  ROOT %gemm = bf16[4096,4096]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_computation")
    (k,) = p.kernels()
    measured = next(bf16 for m, n, kk, bf16, f32 in table("h100")["gemm"]["gemm_points"] if (m, n, kk) == (4096,) * 3)
    assert (k.kind, k.dims, k.dtype) == ("gemm", (1, 4096, 4096, 4096), "bf16")
    assert k.flops == 2 * 4096**3
    assert _step(p) == pytest.approx(2 * 4096**3 / measured, rel=1e-9)
    assert 0.7 < measured / 989e12 < 0.85  # below the datasheet peak, as measured GEMMs are


def test_an_elementwise_fusion_costs_its_bytes_at_hbm_bandwidth():
    p = _program("  ROOT %sum = f32[8192,8192]{1,0} fusion(%x, %x), kind=kLoop, calls=%add_computation")
    (k,) = p.kernels()
    assert (k.kind, k.flops, k.bytes) == ("memory", 0.0, 3 * 8192 * 8192 * 4)  # two operands read, one written
    assert _step(p) == pytest.approx(k.bytes / H100.memory_bw, rel=1e-9)


def _with_gather(between: str):
    return _program(f"""
  %ag = (bf16[512,4096]{{1,0}}, bf16[4096,4096]{{1,0}}) all-gather-start(%w), channel_id=1, replica_groups=[1,8]<=[8], dimensions={{0}}, use_global_device_ids=true
{between}
  %gathered = bf16[4096,4096]{{1,0}} all-gather-done(%ag)
  ROOT %out = bf16[4096,4096]{{1,0}} fusion(%gathered, %b), kind=kCustom, calls=%gemm_computation""")


def test_a_collective_the_schedule_hides_behind_compute_adds_nothing():
    hidden = _with_gather("  %busy = bf16[4096,4096]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_computation")
    exposed = _with_gather("")
    (op,) = hidden.collectives
    gather_s = timeline.collective_seconds(op, H100, RATES, 8)
    gemm_s = timeline.kernel_seconds(hidden.kernels()[0], RATES)
    assert 0 < gather_s < gemm_s  # 32 MiB over NVLink: shorter than one 4096^3 GEMM
    both = timeline.estimate(hidden, 8, H100, RATES)
    assert both.comm_s == 0.0 and both.comm_total_s == pytest.approx(gather_s)
    assert both.step_s == pytest.approx(2 * gemm_s)  # two GEMMs, the gather under the first
    alone = timeline.estimate(exposed, 8, H100, RATES)
    assert alone.comm_s == pytest.approx(gather_s) and alone.step_s == pytest.approx(gemm_s + gather_s)


def _loop_of_one_gemm(counter_step: str = "", condition: str = "  ROOT %c = pred[] constant(true)",
                      annotation: str = ""):
    """A program whose `while` body runs one 4096^3 GEMM. `counter_step`: lines computing %next_i from the counter
    %i (else it stays %i); `condition`: the condition's body over its parameter %cstate; `annotation`: what
    follows the while's operands (XLA's backend_config)."""
    loop = GEMM + ADD + f"""
%body (state: (s32[], bf16[4096,4096])) -> (s32[], bf16[4096,4096]) {{
  %state = (s32[], bf16[4096,4096]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %h = bf16[4096,4096]{{1,0}} get-tuple-element(%state), index=1
  %next = bf16[4096,4096]{{1,0}} fusion(%h, %h), kind=kCustom, calls=%gemm_computation
{counter_step}
  ROOT %t = (s32[], bf16[4096,4096]{{1,0}}) tuple({"%next_i" if counter_step else "%i"}, %next)
}}

%cond (cstate: (s32[], bf16[4096,4096])) -> pred[] {{
  %cstate = (s32[], bf16[4096,4096]{{1,0}}) parameter(0)
{condition}
}}
"""
    return _program(f"""  %zero = s32[] constant(0)
  %init = (s32[], bf16[4096,4096]{{1,0}}) tuple(%zero, %a)
  %loop = (s32[], bf16[4096,4096]{{1,0}}) while(%init), condition=%cond, body=%body{annotation}
  ROOT %last = bf16[4096,4096]{{1,0}} get-tuple-element(%loop), index=1""", loop)


def test_work_inside_a_scan_is_charged_times_its_trip_count():
    p = _loop_of_one_gemm(annotation=', backend_config={"known_trip_count":{"n":"12"}}')
    (k,) = p.kernels()
    assert k.times == 12
    assert _step(p) == pytest.approx(12 * timeline.kernel_seconds(k, RATES))


def test_a_scanned_layer_reading_its_slice_of_stacked_weights_counts_the_slice():
    stacked = """
%take (s0: f32[32,1024,1024], s1: s32[]) -> f32[1024,1024] {
  %s0 = f32[32,1024,1024]{2,1,0} parameter(0)
  %s1 = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  %slice.1 = f32[1,1024,1024]{2,1,0} dynamic-slice(%s0, %s1, %zero.1, %zero.1), dynamic_slice_sizes={1,1024,1024}
  ROOT %r = f32[1024,1024]{1,0} bitcast(%slice.1)
}
"""
    text = "HloModule m, is_scheduled=true\n" + stacked + """
ENTRY %main (ws: f32[32,1024,1024], i: s32[]) -> f32[1024,1024] {
  %ws = f32[32,1024,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %layer = f32[1024,1024]{1,0} fusion(%ws, %i), kind=kLoop, calls=%take
}
"""
    (k,) = kernels.program(text, 1).kernels()
    assert k.bytes == 2 * 1024 * 1024 * 4 + 4  # one layer read, one written (and the index), not all 32


def test_causal_fused_attention_is_charged_half_the_flops_and_backward_two_and_a_half_times():
    q = "bf16[2,1024,32,128]"
    config = ('{"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["2","32","1024","1024"]},'
              '"mask_type":"CAUSAL"}}')
    text = f"""HloModule m, is_scheduled=true
ENTRY %main (q: {q}, k: {q}, v: {q}) -> {q} {{
  %q = {q}{{3,2,1,0}} parameter(0)
  %k = {q}{{3,2,1,0}} parameter(1)
  %v = {q}{{3,2,1,0}} parameter(2)
  %fwd = ({q}{{3,2,1,0}}, f32[2,32,1024]{{2,1,0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={config}
  %o = {q}{{3,2,1,0}} get-tuple-element(%fwd), index=0
  %bwd = ({q}{{3,2,1,0}}, {q}{{3,2,1,0}}) custom-call(%q, %k, %v, %o), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={config}
  ROOT %dq = {q}{{3,2,1,0}} get-tuple-element(%bwd), index=0
}}
"""
    fwd, bwd = kernels.program(text, 1).kernels()
    full = 4 * 2 * 32 * 1024 * 1024 * 128
    assert (fwd.kind, fwd.flops, fwd.dims) == ("attention", full / 2, (1024, 1024, 128, 0))
    assert (bwd.flops, bwd.dims) == (2.5 * full / 2, (1024, 1024, 128, 1))
    measured = table("h100")["attention"]
    assert timeline.kernel_seconds(fwd, RATES) == pytest.approx(full / 2 / measured["forward"]["128"][1])
    assert timeline.kernel_seconds(bwd, RATES) == pytest.approx(2.5 * full / 2 / measured["backward"]["128"][1])
    assert math.isclose(RATES.attention_flops_per_s(3000, 128, False),
                        RATES.attention_flops_per_s(3000, 100, False))  # the nearest measured head dim


def test_an_offloaded_layer_moves_its_slice_over_the_host_link_hidden_behind_compute():
    """XLA:TPU offloads a layer's activations with an asynchronous dynamic-update-slice into a stacked buffer in
    host memory: the copy moves the layer's slice (not the buffer) over the host link, on its own stream."""
    host = "bf16[32,1024,4096]{2,1,0:S(5)}"
    text = "HloModule m, is_scheduled=true\n" + GEMM + f"""
ENTRY %main (a: bf16[4096,4096], b: bf16[4096,4096], buf: bf16[32,1024,4096], i: s32[], x: bf16[1,1024,4096]) -> bf16[4096,4096] {{
  %a = bf16[4096,4096]{{1,0}} parameter(0)
  %b = bf16[4096,4096]{{1,0}} parameter(1)
  %buf = {host} parameter(2)
  %i = s32[] parameter(3)
  %layer = bf16[1,1024,4096]{{2,1,0}} parameter(4)
  %zero = s32[] constant(0)
  %put = (({host}, bf16[1,1024,4096]{{2,1,0}}, s32[], s32[], s32[]), {host}, u32[]) dynamic-update-slice-start(%buf, %layer, %i, %zero, %zero)
{{between}}
  %stored = {host} dynamic-update-slice-done(%put)
  ROOT %out = bf16[4096,4096]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%gemm_computation
}}
"""
    busy = "  %busy = bf16[4096,4096]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_computation"
    hidden = kernels.program(text.replace("{between}", busy), 1)
    exposed = kernels.program(text.replace("{between}", ""), 1)
    copy_s = 1024 * 4096 * 2 / RATES.host_bytes_per_s  # one layer, not the 32 of the buffer
    gemm_s = timeline.kernel_seconds(hidden.kernels()[0], RATES)
    assert copy_s < gemm_s
    assert timeline.estimate(hidden, 1, H100, RATES).step_s == pytest.approx(2 * gemm_s)
    assert timeline.estimate(exposed, 1, H100, RATES).step_s == pytest.approx(copy_s + gemm_s)


def test_a_conditional_costs_its_costliest_branch_once():
    """One branch of a conditional runs (the ring's two zigzag cases, a causal block computed or skipped): the
    step is charged the costlier branch, not both."""
    branches = GEMM + ADD + """
%matmul_branch (mp: (bf16[4096,4096], f32[8192,8192])) -> bf16[4096,4096] {
  %mp = (bf16[4096,4096]{1,0}, f32[8192,8192]{1,0}) parameter(0)
  %ma = bf16[4096,4096]{1,0} get-tuple-element(%mp), index=0
  ROOT %mm = bf16[4096,4096]{1,0} fusion(%ma, %ma), kind=kCustom, calls=%gemm_computation
}

%add_branch (ap: (bf16[4096,4096], f32[8192,8192])) -> bf16[4096,4096] {
  %ap = (bf16[4096,4096]{1,0}, f32[8192,8192]{1,0}) parameter(0)
  %ax = f32[8192,8192]{1,0} get-tuple-element(%ap), index=1
  %as = f32[8192,8192]{1,0} fusion(%ax, %ax), kind=kLoop, calls=%add_computation
  ROOT %aa = bf16[4096,4096]{1,0} get-tuple-element(%ap), index=0
}
"""
    p = _program("""  %which = s32[] constant(1)
  %operands = (bf16[4096,4096]{1,0}, f32[8192,8192]{1,0}) tuple(%a, %x)
  ROOT %picked = bf16[4096,4096]{1,0} conditional(%which, %operands, %operands), branch_computations={%matmul_branch, %add_branch}""", branches)
    gemm, add = sorted(p.kernels(), key=lambda k: k.kind)
    assert (gemm.kind, add.kind) == ("gemm", "memory")
    costs = timeline.kernel_seconds(gemm, RATES), timeline.kernel_seconds(add, RATES)
    assert 0.5 < costs[0] / costs[1] < 2  # comparable, so the sum is far from the max
    assert _step(p) == pytest.approx(max(costs), rel=1e-9)


def test_an_unannotated_loop_counts_its_trips_from_its_condition_and_its_step():
    """XLA:TPU leaves a windowed einsum's loop (an FSDP all-gather fused with its matmul) without a trip count and
    unrolls it by two: `i < 8` stepping by 2 runs 4 times, not 8."""
    p = _loop_of_one_gemm(counter_step="  %two = s32[] constant(2)\n  %next_i = s32[] add(%i, %two)",
                          condition="""  %ci = s32[] get-tuple-element(%cstate), index=0
  %eight = s32[] constant(8)
  ROOT %c = pred[] compare(%ci, %eight), direction=LT""")
    (k,) = [k for k in p.kernels() if k.kind == "gemm"]
    assert k.times == 4


def test_a_ragged_all_to_all_costs_the_rows_its_caller_expects_to_send():
    """XLA:GPU's `ragged-all-to-all-start` of a dropless exchange buffer (4,096 rows of 4,096) whose caller expects
    1,024 rows in use (`shardlm.kernels.exchange`, in the op's frontend attributes): an all-to-all of a quarter
    of the buffer's bytes; without the attribute, the whole buffer's."""
    def program(attributes: str):
        return _program(f"""  %o = s64[8]{{0}} constant({{0, 0, 0, 0, 0, 0, 0, 0}})
  %ra = ((bf16[4096,4096]{{1,0}}, bf16[4096,4096]{{1,0}}, s64[8]{{0}}, s64[8]{{0}}, s64[8]{{0}}, s64[8]{{0}}), bf16[4096,4096]{{1,0}}) ragged-all-to-all-start(%a, %b, %o, %o, %o, %o), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}{attributes}
  ROOT %got = bf16[4096,4096]{{1,0}} ragged-all-to-all-done(%ra)""")

    (op,) = program(', frontend_attributes={shardlm_routed="ragged_exchange_routed_1024_of_4096"}').collectives
    assert (op.kind, op.group_size, op.bytes) == ("all-to-all", 8, 4096 * 4096 * 2 // 4)
    (whole,) = program("").collectives
    assert whole.bytes == 4096 * 4096 * 2
    assert _step(program(', frontend_attributes={shardlm_routed="ragged_exchange_routed_1024_of_4096"}')) < \
        0.6 * _step(program(""))  # a quarter of the bytes, at the table's all-to-all rate for that size


def test_an_in_place_update_counts_the_slice_it_writes_and_what_it_reads_of_the_buffer():
    """A fusion whose root is a dynamic-update-slice writes into its operand in place: of a 256 MiB buffer it moves
    the 8 MiB slice it writes, the 4 MiB update, and, where it adds into the slice (an accumulator's block), the
    8 MiB it reads of it."""
    def program(new_rows: str):
        update = f"""
%update_computation (r0: f32[8,1024,8192], r1: bf16[512,4096], r2: s32[]) -> f32[8,1024,8192] {{
  %r0 = f32[8,1024,8192]{{2,1,0}} parameter(0)
  %r1 = bf16[512,4096]{{1,0}} parameter(1)
  %r2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %up = bf16[1,256,8192]{{2,1,0}} bitcast(%r1)
  %upf = f32[1,256,8192]{{2,1,0}} convert(%up)
{new_rows}
  ROOT %acc = f32[8,1024,8192]{{2,1,0}} dynamic-update-slice(%r0, %new, %r2, %zero, %zero)
}}
"""
        (k,) = _program("""  %buf = f32[8,1024,8192]{2,1,0} bitcast(%x)
  %i = s32[] constant(3)
  ROOT %out = f32[8,1024,8192]{2,1,0} fusion(%buf, %w, %i), kind=kLoop, calls=%update_computation""",
                        GEMM + ADD + update).kernels()
        return k

    stacked = program("  %new = f32[1,256,8192]{2,1,0} negate(%upf)")
    added = program("""  %old = f32[1,256,8192]{2,1,0} dynamic-slice(%r0, %r2, %zero, %zero), dynamic_slice_sizes={1,256,8192}
  %new = f32[1,256,8192]{2,1,0} add(%old, %upf)""")
    assert stacked.bytes == 4 * 2**20 + 8 * 2**20
    assert added.bytes == 4 * 2**20 + 8 * 2**20 + 8 * 2**20


def test_an_async_all_to_all_counts_its_buffer_once():
    """XLA:GPU's `all-to-all-start` is typed ((operands), results): the exchange moves one buffer of 32 MiB, not
    the 64 MiB the whole tuple holds (as an embedding's output moves from an FSDP split of its features to a split
    of the batch)."""
    p = _program("""  %s = ((bf16[4096,4096]{1,0}), bf16[4096,4096]{1,0}) all-to-all-start(%a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %d = bf16[4096,4096]{1,0} all-to-all-done(%s)""")
    (op,) = p.collectives
    assert (op.kind, op.group_size, op.bytes) == ("all-to-all", 8, 4096 * 4096 * 2)


def test_an_xla_tpu_async_collective_fusion_is_one_collective_hidden_behind_the_compute_it_rides_in():
    """XLA:TPU writes an asynchronous all-gather as fusions: a start (`AsyncCollectiveStart`), a continuation that
    computes (here a GEMM) while a clone of the collective moves the data, and a done (`AsyncCollectiveDone`);
    all three hold the collective, with one channel id. It is one gather of 32 MiB, hidden behind the GEMM."""
    v5e = get("tpu-v5e").hardware("bfloat16", 8)
    group = "replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true"
    state = "bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}, u32[]"
    start_done = f"""
%start_computation (s0: bf16[512,4096]) -> ({state}) {{
  %s0 = bf16[512,4096]{{1,0}} parameter(0)
  %ag.1 = bf16[4096,4096]{{1,0}} all-gather(%s0), channel_id=7, {group}
  ROOT %cc.1 = ({state}) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}}

%done_computation (d0: bf16[512,4096], d1: bf16[4096,4096], d2: u32[]) -> bf16[4096,4096] {{
  %d0 = bf16[512,4096]{{1,0}} parameter(0)
  %d1 = bf16[4096,4096]{{1,0}} parameter(1)
  %d2 = u32[] parameter(2)
  %ag.3 = bf16[4096,4096]{{1,0}} all-gather(%d0), channel_id=7, {group}
  ROOT %cc.3 = bf16[4096,4096]{{1,0}} custom-call(%d0, %d1, %ag.3, %d2), custom_call_target="AsyncCollectiveDone"
}}
"""
    continuation = f"""
%async_collective_fusion.1 (c0: bf16[512,4096], c1: bf16[4096,4096], c2: u32[], c3: bf16[4096,4096], c4: bf16[4096,4096]) -> (bf16[4096,4096], {state}) {{
  %c0 = bf16[512,4096]{{1,0}} parameter(0)
  %c1 = bf16[4096,4096]{{1,0}} parameter(1)
  %c2 = u32[] parameter(2)
  %c3 = bf16[4096,4096]{{1,0}} parameter(3)
  %c4 = bf16[4096,4096]{{1,0}} parameter(4)
  %dot.2 = bf16[4096,4096]{{1,0}} dot(%c3, %c4), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %ag.2 = bf16[4096,4096]{{1,0}} all-gather(%c0), channel_id=7, {group}
  ROOT %t.2 = (bf16[4096,4096]{{1,0}}, {state}) tuple(%dot.2, %c0, %ag.2, %c2)
}}
"""

    def program(computes: bool):
        between = f"""  %busy = (bf16[4096,4096]{{1,0}}, {state}) fusion(%in, %out, %flag, %a, %b), kind=kOutput, calls=%async_collective_fusion.1
  %in2 = bf16[512,4096]{{1,0}} get-tuple-element(%busy), index=1
  %out2 = bf16[4096,4096]{{1,0}} get-tuple-element(%busy), index=2
  %flag2 = u32[] get-tuple-element(%busy), index=3""" if computes else """  %in2 = bf16[512,4096]{1,0} bitcast(%in)
  %out2 = bf16[4096,4096]{1,0} bitcast(%out)
  %flag2 = u32[] bitcast(%flag)"""
        return _program(f"""  %start = ({state}) fusion(%w), kind=kCustom, calls=%start_computation
  %in = bf16[512,4096]{{1,0}} get-tuple-element(%start), index=0
  %out = bf16[4096,4096]{{1,0}} get-tuple-element(%start), index=1
  %flag = u32[] get-tuple-element(%start), index=2
{between}
  %gathered = bf16[4096,4096]{{1,0}} fusion(%in2, %out2, %flag2), kind=kCustom, calls=%done_computation
  ROOT %result = bf16[4096,4096]{{1,0}} fusion(%gathered, %b), kind=kCustom, calls=%gemm_computation""",
                        GEMM + start_done + (continuation if computes else ""))

    hidden, exposed = program(computes=True), program(computes=False)
    (op,) = hidden.collectives  # once, not once per fusion that holds it
    assert (op.kind, op.bytes, op.group_size) == ("all-gather", 4096 * 4096 * 2, 8)
    assert [k.kind for k in hidden.kernels()] == ["gemm", "gemm"]  # the continuation's GEMM and the last one
    gather_s = timeline.collective_seconds(op, v5e, v5e.rates(), 8)
    gemm_s = timeline.kernel_seconds(hidden.kernels()[1], v5e.rates())
    assert 0 < gather_s < gemm_s
    under = timeline.estimate(hidden, 8, v5e, v5e.rates())
    assert under.comm_s == 0.0 and under.comm_total_s == pytest.approx(gather_s)
    assert under.step_s == pytest.approx(2 * gemm_s)
    alone = timeline.estimate(exposed, 8, v5e, v5e.rates())
    assert alone.comm_s == pytest.approx(gather_s) and alone.step_s == pytest.approx(gemm_s + gather_s)
