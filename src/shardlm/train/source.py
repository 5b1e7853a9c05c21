"""What is trained: shardlm's own model (`OwnModel`, placed by the rule table) or a model from the user's Python
file (`PlannedModel`, `model=py:FILE:FUNCTION`, placed by a plan). `model_source(cfg)` picks one.

Everything else in training (the state, the step, checkpoints, the loop, and `plan`, `bench`, `profile`, `explain`,
`generate`) is the same for both and asks the source for the few things that differ:

- `factory(vocab_size, tensor_degree, stages)`: a zero-argument constructor of the NNX module (a Linen model comes
  wrapped, see `shardlm.foreign.linen`), traced abstractly for shapes and run inside `jit` for a sharded init;
- `state_shardings(abstract_state, mesh)` and `model_shardings(...)`: a NamedSharding for every leaf of the
  {"model", "optimizer"} train state, or of the model alone (readers), raising on anything that does not place;
- `forward(model, tokens, mesh, train=, key=)`: the forward pass as a step runs it, with its dropout key and its
  activation constraints: (logits, statistics: a mixture of experts' load-balancing loss and expert loads), and
  `logits(...)` the logits alone;
- `vocab_sizes`, `batch_sharding`, `flops_per_token`, `check(mesh, vocab)`, `explain`, `split_notes`, `generator`.

Design choices for a model from a file:
- Dropout keys are a pure function of (seed, step) as for shardlm's models: before each training forward, every
  RNG stream of the module is reseeded from the step's key folded with the stream's path, so layers draw different
  masks and a resumed run draws the same ones without any RNG state in the checkpoint. A Linen model gets the key
  as its `dropout` stream.
- The module is switched to training mode (`model.train()`) for the step and to evaluation mode (`model.eval()`)
  for evaluation and generation, which NNX's Dropout and BatchNorm follow; a call adapter that declares `train`
  gets it as an argument instead.
- Its vocabulary is not padded: `build` gets `model.vocab_size` (or the tokenizer's) and the plan's splits must
  divide it. Its FLOPs are the matmuls of its own forward pass, counted from the jaxpr (3x the forward's, as
  6N + 12LTd is 3 x (2N + 4LTd)), since its architecture is not known to the formula.
- It generates without a KV cache: the whole context is run for every token (`shardlm.generate`), which any
  causal model that maps tokens [batch, seq_len] to logits supports.
"""

from __future__ import annotations

import dataclasses
import inspect
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlm import schedules
from shardlm.config import Config
from shardlm.errors import ShardlmError
from shardlm.explanation import explain_state, explain_trees
from shardlm.families import build_model
from shardlm.flops import flops_per_token, jaxpr_matmul_flops
from shardlm.foreign.activations import check_rules_match, constrained, nnx_module_paths
from shardlm.foreign.layout import resolve_entries
from shardlm.foreign.linen import LinenModel
from shardlm.foreign.modules import build_module, call_spec, is_py, load_function, parse_spec, takes_train_flag
from shardlm.foreign.placement import opt_state_shardings, resolve_layout
from shardlm.foreign.plan import Plan
from shardlm.generate import Generator
from shardlm.kernels.registry import check_attention, uses_ring
from shardlm.losses import cross_entropy
from shardlm.models.attention import kernel_takes_documents
from shardlm.models.config import head_size, sparse_layer_count, stack_layer_count
from shardlm.models.documents import document_ids, document_positions
from shardlm.models.head import plan as head_plan
from shardlm.models.moe import exchange_capacity, round_sizes
from shardlm.models.params import padded_vocab_size
from shardlm.models.precision import cast_once, compute_dtype
from shardlm.models.stack import stacked_repeats
from shardlm.schedules.gpipe import bubble_fraction, check_pipeline, layer_ranges, microbatch_count, stage_layers
from shardlm.sharding import batch_sharding, sequence_parallel_rules, state_shardings, use_mesh_rules, zero_rules
from shardlm.trees import path_str
from shardlm.units import fmt_bytes


def model_source(cfg: Config):
    """The source of `cfg`'s model: a file's model for `model=py:...` (one per model section, plan and seed, and
    versions of their files, for the life of the process: its file is imported and checked once), else
    shardlm's own."""
    if not is_py(cfg.model.preset):
        return OwnModel(cfg)
    key = (dataclasses.astuple(cfg.model), cfg.plan, _mtime(cfg.plan), _mtime(str(parse_spec(cfg.model.preset)[0])),
           cfg.seed)
    if key not in _PLANNED:
        _PLANNED[key] = PlannedModel(cfg)
    return _PLANNED[key]


def model_flops_per_step(cfg: Config, vocab_size: int, tensor_degree: int) -> int:
    """Model FLOPs of one train step of `cfg`: per token (`shardlm.flops`' 6N + 12LTd for shardlm's models, 3x the
    forward pass's matmuls for a model from a py: file), times the global batch's tokens."""
    tokens = cfg.train.batch_size * cfg.model.seq_len
    return model_source(cfg).flops_per_token(vocab_size, tensor_degree) * tokens


def flops_convention(cfg: Config) -> str:
    """How model FLOPs (for MFU) are counted for `cfg`'s model."""
    return (PlannedModel if is_py(cfg.model.preset) else OwnModel).flops_convention


def _mtime(path: str) -> int | None:
    p = Path(path)
    return p.stat().st_mtime_ns if path and p.is_file() else None


_PLANNED: dict[tuple, "PlannedModel"] = {}
_FORWARD_FLOPS: dict[tuple, float] = {}  # a file's model's forward FLOPs per token, by what they depend on


def within_documents(cfg: Config, stages: int = 1, seq_split: int = 1) -> bool:
    """Whether a training step of shardlm's own model over `stages` pipeline stages, its sequence split
    `seq_split` ways, attends within documents (`data.document_mask`): asked for (or positions restarting at
    documents: `data.document_positions`); or auto, off pipeline stages,
    where the kernel the step runs takes documents' ids (`models.attention.kernel_takes_documents`: on GPUs cuDNN's
    does not, and auto keeps it)."""
    asked = cfg.data.document_mask is True or cfg.data.document_positions  # (positions restart at documents)
    auto = cfg.data.document_mask == "auto" and stages == 1
    return asked or (auto and kernel_takes_documents(cfg.model, seq_split))


def train_state_shardings(abstract_state, model, mesh):
    """The shardings of a training state {"model", "optimizer"} whose model is placed by `model` (a tree of
    NamedShardings): each optimizer-state leaf that mirrors a parameter (same path suffix, same shape) as that
    parameter, the rest replicated (`foreign.placement.opt_state_shardings`), whichever optimizer it is."""
    params = nnx.filter_state(abstract_state["model"], nnx.Param)
    optimizer = opt_state_shardings(abstract_state["optimizer"], params, nnx.filter_state(model, nnx.Param), mesh)
    by_path = {f"{part}/{path_str(p)}": s for part, tree in (("model", model), ("optimizer", optimizer))
               for p, s in jax.tree_util.tree_flatten_with_path(tree)[0]}
    return jax.tree_util.tree_map_with_path(lambda p, _: by_path[path_str(p)], abstract_state)


class OwnModel:
    """GPT or Llama, from `cfg.model`: logical axis names placed by the rule table (`shardlm.sharding`)."""

    can_cache = True
    stacks_blocks = True  # checkpoints store the blocks stacked, however they are held (`train.stored`)
    flops_convention = "6*N_matmul + 6*L*T*H*(qk+v) FLOPs per token (attention not halved for causality)"
    placeholder_vocab = 257  # the vocabulary is padded for the tensor degree: any size gives the same verdict

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.stacked_axes = 1 if cfg.model.scan_layers else 0  # leading axes of the blocks' parameters

    def vocab_sizes(self, tokenizer_vocab: int, tensor_degree: int) -> tuple[int, int]:
        """(real, padded): `model.vocab_size` if set, else the tokenizer's, padded for the tensor degree."""
        real = self.cfg.model.vocab_size or tokenizer_vocab
        return real, padded_vocab_size(real, tensor_degree)

    def factory(self, vocab_size: int, tensor_degree: int):
        real, padded = self.vocab_sizes(vocab_size, tensor_degree)
        m, seed = self.cfg.model, self.cfg.seed
        return lambda: build_model(m, real, padded, nnx.Rngs(params=seed))

    def state_shardings(self, abstract_state, mesh):
        """The training state's: the weights by the rule table, split over `data` too where the state is sharded
        over the data-parallel replicas (`storage_rules`); the optimizer's state mirroring a weight (a moment, a
        momentum) as that weight, the rest (Adafactor's row and column statistics, counters) replicated."""
        # (under its "model" key, so that an indivisible weight is named by its path in the state)
        model = state_shardings(nnx.State({"model": abstract_state["model"]}), mesh, self.storage_rules(mesh))
        return train_state_shardings(abstract_state, model["model"], mesh)

    def model_shardings(self, abstract_state, mesh):
        """A reader's (the model alone, no optimizer): the rule table's, never split over `data`."""
        return state_shardings(abstract_state, mesh)

    def rules(self):
        """The table activations are split by: with sequence parallelism if `mesh.sequence_parallel`, else None (the
        rule table's)."""
        return sequence_parallel_rules() if self.cfg.mesh.sequence_parallel else None

    def storage_rules(self, mesh):
        """The table the training state is stored by: `sharding.zero_rules` when `train.shard_optimizer_over_data`
        and the mesh has data-parallel replicas, else None (the rule table's)."""
        return zero_rules() if self.cfg.train.shard_optimizer_over_data and mesh.shape.get("data", 1) > 1 else None

    @property
    def stack_repeats(self) -> int:
        """R of a stack held as [R, n_layers / R] (circular pipeline repeats: `models.stack.in_repeats`), else 1:
        checkpoints store layer order (`train.stored`), a reshape away."""
        m = self.cfg.model
        return stacked_repeats(stack_layer_count(m), m.pipeline_repeats, m.scan_layers)

    def batch_sharding(self, mesh) -> NamedSharding:
        return batch_sharding(mesh)

    @property
    def loss_weights(self) -> dict:
        """The statistics that join the training objective, and their weights: a mixture's load-balancing loss,
        multi-token prediction's loss."""
        m = self.cfg.model
        return {"aux_loss": m.moe_aux_loss_weight if m.moe_experts else 0.0,
                "mtp_loss": m.mtp_loss_weight if m.mtp_depth else 0.0, "z_loss": self.cfg.train.z_loss}

    @property
    def bias_rate(self) -> float:
        """How far the routers' balancing biases move per step (`shardlm.train.balance`; 0: not at all)."""
        return self.cfg.model.moe_bias_rate if self.cfg.model.moe_experts else 0.0

    def forward(self, model, tokens, mesh, *, train: bool, key=None, separator: int | None = None):
        """(logits, the blocks' statistics: `CausalLM.with_stats`); with the documents' `separator`, attending
        within each document as `loss` does (evaluation sees what training sees)."""
        dropout = train and key is not None and self.cfg.model.dropout > 0
        segments, positions = self._documents(tokens, separator)
        with use_mesh_rules(mesh, self.rules()):
            return schedules.with_stats(model, tokens, nnx.Rngs(dropout=key) if dropout else None, self.cfg.model,
                                        segments, positions)

    def _documents(self, tokens, separator: int | None) -> tuple:
        """(each token's document id, its position in its document where `data.document_positions`, else None)
        for attention within the documents of `tokens` that `separator` delimits; (None, None) without one."""
        if separator is None:
            return None, None
        segments = document_ids(tokens, separator)
        return segments, document_positions(segments) if self.cfg.data.document_positions else None

    def logits(self, model, tokens, mesh, *, train: bool, key=None):
        return self.forward(model, tokens, mesh, train=train, key=key)[0]

    def loss(self, model, batch, mesh, *, key=None, separator: int | None = None):
        """(the training loss of `batch` [rows, seq_len + 1], the blocks' statistics): the head and the cross
        entropy fused (`CausalLM.loss`; on pipeline stages, through the schedule: `shardlm.schedules`), under the
        training state's storage rules. With the documents' `separator` token, attention stays within each
        document of a row (`models.documents`), and with `data.document_positions` positions restart at each."""
        dropout = key is not None and self.cfg.model.dropout > 0
        tokens = batch[:, :-1]
        segments, positions = self._documents(tokens, separator)
        with use_mesh_rules(mesh, self.rules(), storage=self.storage_rules(mesh)):
            return schedules.loss(model, tokens, batch[:, 1:], nnx.Rngs(dropout=key) if dropout else None,
                                  self.cfg.model, segments, self.cfg.train.z_loss > 0, positions)

    def documents(self, mesh) -> bool:
        return within_documents(self.cfg, mesh.shape.get("stage", 1), mesh.shape.get("context", 1))

    def cast_once(self, model, params):
        """`params` (`model`'s) as a loop over microbatches differentiates them: cast once to the dtype the forward
        pass reads them in (`precision.cast_once`)."""
        return cast_once(params, model.precision.compute, model.precision.reduce)

    def flops_per_token(self, vocab_size: int, tensor_degree: int) -> int:
        return flops_per_token(self.cfg.model, self.vocab_sizes(vocab_size, tensor_degree)[1])

    def check(self, mesh, vocab_size: int | None = None) -> None:
        """What the mesh cannot do for this architecture, said in its terms (the shardings' own divisibility
        check follows in `train.state.check_shardable`)."""
        m, tp = self.cfg.model, mesh.shape["tensor"]
        cp = mesh.shape.get("context", 1)
        if m.seq_len % cp:
            raise ShardlmError(f"model.seq_len={m.seq_len} is split over mesh.context={cp}, which does not divide it;"
                               f" choose a mesh.context dividing {m.seq_len} or a seq_len that is a multiple of {cp}")
        if cp > 1 and uses_ring(m.attention, m.context_attention) and m.seq_len % (2 * cp):
            raise ShardlmError(
                f"model.seq_len={m.seq_len} does not cut into the {2 * cp} equal chunks ring attention over "
                f"mesh.context={cp} lays out (two per device, the zigzag layout); choose a seq_len that is a multiple "
                f"of {2 * cp}, or model.context_attention=all_gather")
        check_attention(m.attention, cp, m.context_attention)
        stages = mesh.shape.get("stage", 1)
        if stages > 1:
            if self.cfg.train.z_loss:
                raise ShardlmError(f"train.z_loss={self.cfg.train.z_loss}: a pipeline's head (mesh.stage={stages}) "
                                   "returns no log-sum-exp yet; set train.z_loss=0 or drop the stages")
            if self.cfg.data.document_mask is True or self.cfg.data.document_positions:
                raise ShardlmError(f"data.document_mask=true (or document_positions): a pipeline's microbatches (mesh.stage={stages}) carry "
                                   "no documents' ids yet; set data.document_mask=auto (off on stages) or false, or "
                                   "drop the stages")
            if not m.scan_layers:
                raise ShardlmError(f"mesh.stage={stages} splits the stacked blocks over pipeline stages: set "
                                   "model.scan_layers=true (the default)")
            if m.mtp_depth:
                raise ShardlmError(f"mesh.stage={stages}: multi-token prediction (model.mtp_depth={m.mtp_depth}) "
                                   "runs after the main model's blocks, which a pipeline schedule does not hand it; "
                                   "set model.mtp_depth=0 or drop the stages")
            t = self.cfg.train
            check_pipeline(stack_layer_count(m), t.batch_size // t.grad_accum, stages, m.pipeline_microbatches,
                           m.pipeline_repeats)
        kv = m.n_kv_heads or m.n_heads
        if kv % tp and not m.n_heads % tp:  # said in the model's terms before the generic per-parameter message
            raise ShardlmError(f"mesh.tensor={tp} must divide the key/value heads (model.n_kv_heads={kv}) as well as "
                               f"the query heads: choose mesh.tensor dividing {kv}, or more kv heads")

    def explain(self, state, mesh):
        """Where every parameter and optimizer-state leaf of a train state lives (`shardlm.explain`)."""
        return explain_state(state, mesh)

    def split_notes(self, mesh) -> list[str]:
        """What the sequence split and the pipeline do on `mesh`, a line each (none without them)."""
        return [note for note in (self._context_note(mesh), self._pipeline_note(mesh), self._expert_note(mesh))
                if note]

    def _rows_per_device(self, mesh) -> int:
        """Sequences of one gradient-accumulation step on each device (the batch split over data x fsdp x
        expert)."""
        t = self.cfg.train
        return t.batch_size // t.grad_accum // (mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"])

    def _context_note(self, mesh) -> str | None:
        """The tokens each device holds, and the keys and values each layer sends around the ring or all-gathers."""
        cp = mesh.shape.get("context", 1)
        if cp == 1:
            return None
        m = self.cfg.model
        kv_heads = (m.n_kv_heads or m.n_heads) // mesh.shape["tensor"]
        gathered = 2 * self._rows_per_device(mesh) * m.seq_len * kv_heads * head_size(m) \
            * (2 if m.dtype == "bfloat16" else 4)
        held = f"sequence split over context={cp}: each device holds {m.seq_len // cp} of every {m.seq_len} tokens"
        if uses_ring(m.attention, m.context_attention):
            return (held + f" (zigzag: chunks i and {2 * cp - 1}-i of {2 * cp}); ring attention passes keys and "
                    f"values around the context axis, {fmt_bytes(gathered * (cp - 1) // cp)} per layer per device in "
                    f"{cp - 1} hop(s), overlapped with each chunk's attention kernel (in the backward pass they travel again, with "
                    "their gradients)")
        return (held + f"; attention all-gathers keys and values over context, {fmt_bytes(gathered)} per layer per "
                "device (reduce-scattered back as gradients)")

    def _expert_note(self, mesh) -> str | None:
        """Which experts each device holds, and what a sparse layer's dispatch sends (`shardlm.models.moe`)."""
        m = self.cfg.model
        ep = mesh.shape.get("expert", 1)
        if not m.moe_experts:
            return None
        sparse = sparse_layer_count(m)
        what = (f"mixture of experts: {m.moe_experts} experts, top {m.moe_top_k}, in {sparse} of {m.n_layers} layers"
                f" (the load-balancing loss weighs {m.moe_aux_loss_weight:g} in the objective)")
        if ep == 1:
            return what + "; every device holds every expert (mesh.expert=1)"
        tokens = self._rows_per_device(mesh) * m.seq_len // mesh.shape["context"]
        worst = ep * exchange_capacity(tokens, m.moe_top_k, m.moe_experts, ep)
        rows = ep * exchange_capacity(tokens, m.moe_top_k, m.moe_experts, ep, m.moe_capacity_factor)
        row_bytes = m.d_model * (2 if m.dtype == "bfloat16" else 4)
        if rows < worst:
            kind = f"a buffer bounded by model.moe_capacity_factor={m.moe_capacity_factor:g} of"
            then = ""
        elif m.moe_dropless == "rounds":
            first, later = round_sizes(tokens, m.moe_top_k, m.moe_experts, ep)
            rows, kind = ep * first, "dropless in rounds (model.moe_dropless=rounds): a first of"
            then = f", then as many of {fmt_bytes(ep * later * row_bytes)} as routing overflows"
        else:
            kind, then = "a dropless buffer of the worst case (model.moe_dropless=buffer) of", ""
        return (what + f"; experts split over expert={ep}: each device holds {m.moe_experts // ep} of them per "
                f"layer; each sparse layer sends tokens to their experts and back by all-to-all, {kind} "
                f"{fmt_bytes(rows * row_bytes)} per device each way ({rows / (tokens * m.moe_top_k):g} x the "
                f"balanced share){then}, forward and backward")

    def head_note(self, mesh, vocab_size: int) -> str:
        """The fused head and loss's schedule on each device, with its bytes (`models.head.plan`, the schedule the
        step traces: per gradient-accumulation step, or per microbatch where a 1F1B pipeline runs the head)."""
        m, t = self.cfg.model, self.cfg.train
        padded = self.vocab_sizes(vocab_size, mesh.shape["tensor"])[1]
        rows = t.batch_size // t.grad_accum
        one_f_one_b = (mesh.shape.get("stage", 1) > 1
                       and schedules.schedule_named(m.pipeline_schedule).head_per_microbatch)
        if one_f_one_b:
            rows //= microbatch_count(m.pipeline_microbatches, mesh.shape["stage"])
        w_shape = (padded, m.d_model) if m.tie_embeddings else (m.d_model, padded)
        copies = (1,) if one_f_one_b else ()  # a copy per device, whole over the embedding dimension: its shape
        with use_mesh_rules(mesh, self.rules(), storage=self.storage_rules(mesh)):
            schedule = head_plan((rows, m.seq_len, m.d_model), copies + w_shape, tied=m.tie_embeddings,
                                 compute_dtype=compute_dtype(m.dtype), chunks=m.loss_chunks,
                                 token_copies=one_f_one_b)
        return f"output head and loss, per device: {schedule.describe()}"

    def _pipeline_note(self, mesh) -> str | None:
        """Which layers each stage holds, the schedule's bubble, and what a stage hands the next."""
        stages = mesh.shape.get("stage", 1)
        if stages == 1:
            return None
        m = self.cfg.model
        micro, repeats = microbatch_count(m.pipeline_microbatches, stages), m.pipeline_repeats
        first = m.n_layers - stack_layer_count(m)  # layers held before the stack run before the stages
        held = "; ".join(f"stage {s}: layers {layer_ranges([first + i for i in layers])}"
                         for s, layers in enumerate(stage_layers(stack_layer_count(m), stages, repeats)))
        activation = self._rows_per_device(mesh) // micro * m.seq_len // mesh.shape["context"] * m.d_model \
            * (2 if m.dtype == "bfloat16" else 4)
        holds = schedules.schedule_named(m.pipeline_schedule).holds(stages, micro, repeats, stack_layer_count(m))
        return (f"pipeline over stage={stages} ({held}): {micro} microbatches x {repeats} repeat(s) per step, "
                f"{micro * repeats + stages - 1} iterations, bubble (S-1)/(M R+S-1) = "
                f"{bubble_fraction(stages, micro, repeats):.0%}; {holds}; each hand-off to the next stage sends "
                f"{fmt_bytes(activation)} per device (and as much back in the backward pass)")

    def generator(self, graphdef, state, mesh, *, eot_id: int, vocab_size: int, **options):
        return Generator(graphdef, state, mesh, eot_id=eot_id, **options)


class PlannedModel:
    """The module `build` in the user's file returns, placed by `cfg.plan` (`shardlm.foreign`)."""

    can_cache = False
    stacks_blocks = False  # its structure is its own

    stack_repeats = 1
    flops_convention = "3x the forward pass's matmul FLOPs per token, counted from its jaxpr"

    def __init__(self, cfg: Config):
        self.model_cfg, self.seed = cfg.model, cfg.seed  # all of the config it reads, with the plan
        self.spec = cfg.model.preset
        self.plan = Plan.load(cfg.plan or "fsdp")
        self.build = load_function(self.spec)
        self.call = load_function(call_spec(cfg.model.call, self.spec), "model.call") if cfg.model.call else None
        self.placeholder_vocab = cfg.model.vocab_size or None  # the plan's splits must divide the real one
        self.built_vocab = None  # the vocabulary of the last model `factory` made (for error messages)
        self.forward_checked = False
        self.stacked_axes = 0  # its structure is its own
        self.document_mask = cfg.data.document_mask is True or cfg.data.document_positions

    # --- building ----------------------------------------------------------------------------------------------
    def vocab_sizes(self, tokenizer_vocab: int, tensor_degree: int) -> tuple[int, int]:
        real = self.model_cfg.vocab_size or tokenizer_vocab
        return real, real

    def factory(self, vocab_size: int, tensor_degree: int = 1):
        m, seed = self.model_cfg, self.seed
        vocab_size = self.built_vocab = self.vocab_sizes(vocab_size, tensor_degree)[0]

        def make():
            offered = {"vocab_size": vocab_size, "seq_len": m.seq_len, "dtype": jnp.dtype(m.dtype),
                       "param_dtype": jnp.dtype(m.param_dtype), "dropout": m.dropout, "rngs": nnx.Rngs(seed)}
            return build_module(self.build, offered, self.spec, call=self.call, seq_len=m.seq_len, seed=seed)

        return make

    def layout(self, abstract_model_state, mesh):
        """The plan resolved against the model's variables (raising on any problem)."""
        params, rest = nnx.split_state(abstract_model_state, nnx.Param, ...)
        try:
            return resolve_layout(params, rest, self.plan, mesh, warn=False)
        except ShardlmError as e:
            raise ShardlmError(self._vocab_hint(str(e))) from None

    def _vocab_hint(self, message: str) -> str:
        """A degree that does not divide the vocabulary (the tokenizer's, when model.vocab_size is 0) is fixed by
        setting model.vocab_size, which the hint says."""
        if not self.model_cfg.vocab_size and self.built_vocab and f"(size {self.built_vocab})" in message:
            return message + " (the vocabulary: set model.vocab_size to a multiple of the degree)"
        return message

    def model_shardings(self, abstract_model_state, mesh):
        layout = self.layout(abstract_model_state, mesh)
        specs = layout.specs
        return jax.tree_util.tree_map_with_path(lambda p, _: NamedSharding(mesh, specs[path_str(p)]),
                                                abstract_model_state)

    def state_shardings(self, abstract_state, mesh):
        return train_state_shardings(abstract_state, self.model_shardings(abstract_state["model"], mesh), mesh)

    def batch_sharding(self, mesh) -> NamedSharding:
        """Rows split as the plan's `inputs` spec splits the batch dimension (default: data x fsdp), each row whole."""
        rows = resolve_entries(self.plan.inputs[:1], None, mesh, f"{self.plan.name}: inputs")
        return NamedSharding(mesh, P(*rows, None))

    # --- running -----------------------------------------------------------------------------------------------
    loss_weights: dict = {}
    bias_rate = 0.0

    def forward(self, model, tokens, mesh, *, train: bool, key=None):
        """(logits, {}): a model from a file reports no statistics."""
        return self.logits(model, tokens, mesh, train=train, key=key), {}

    def logits(self, model, tokens, mesh, *, train: bool, key=None):
        with constrained(model, self.plan, mesh):
            return self._run(model, tokens, train, key)

    def cast_once(self, model, params):
        """`params` as they are: a user's modules cast their weights where they use them."""
        return params

    def loss(self, model, batch, mesh, *, key=None):
        """(the mean next-token cross entropy of `batch` under the model's logits, {})."""
        return cross_entropy(self.logits(model, batch[:, :-1], mesh, train=True, key=key), batch[:, 1:]), {}

    def documents(self, mesh) -> bool:
        """Its attention is its own: never within documents (`check` refuses data.document_mask=true)."""
        return False

    def _run(self, model, tokens, train: bool, key):
        """The model on `tokens` in training or evaluation mode, through the call adapter, without constraints."""
        linen = isinstance(model, LinenModel)
        model.train() if train else model.eval()
        if train and key is not None and not linen:
            reseed_streams(model, key)
        flag = {"train": train} if self.call is not None and takes_train_flag(self.call) else {}
        if linen:
            rngs = {"dropout": key} if train and key is not None else None
            method = (lambda m, t: self.call(m, t, **flag)) if self.call is not None else None
            return model(tokens, rngs=rngs, method=method)
        return self.call(model, tokens, **flag) if self.call is not None else model(tokens)

    def flops_per_token(self, vocab_size: int, tensor_degree: int = 1) -> int:
        """3x the forward pass's matmul FLOPs per token, counted from its jaxpr on one row (`flops.
        jaxpr_matmul_flops`: loops by their trip counts), cached per file version and vocabulary."""
        m = self.model_cfg
        key = (self.spec, parse_spec(self.spec)[0].stat().st_mtime_ns, m.call, m.seq_len, m.dtype, vocab_size)
        if key not in _FORWARD_FLOPS:
            with nnx.use_eager_sharding(False):
                graphdef, state = nnx.split(nnx.eval_shape(self.factory(vocab_size)))

            def forward(state, tokens):
                return self._run(nnx.merge(graphdef, state), tokens, False, None)

            jaxpr = jax.make_jaxpr(forward)(state, jax.ShapeDtypeStruct((1, m.seq_len), jnp.int32))
            _FORWARD_FLOPS[key] = jaxpr_matmul_flops(jaxpr) / m.seq_len
        return round(3 * _FORWARD_FLOPS[key])

    def check(self, mesh, vocab_size: int | None = None) -> None:
        """The model runs on tokens and returns logits, and every activation rule of the plan matches a module (an
        NNX model's are known before it runs): shapes only, once per process."""
        if self.document_mask is True:
            raise ShardlmError("data.document_mask=true (or document_positions): a model from a py: file attends as its own code says, and "
                               "shardlm cannot hand it documents' ids; set data.document_mask=auto or false")
        for axis in ("stage", "expert"):
            if mesh.shape.get(axis, 1) > 1:
                raise ShardlmError(f"mesh.{axis}={mesh.shape[axis]} applies to shardlm's own models (stacked blocks, "
                                   f"experts); a model from a py: file is placed by its plan: drop mesh.{axis}")
        if self.forward_checked:
            return
        vocab, seq = vocab_size or self.placeholder_vocab or 256, self.model_cfg.seq_len
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(self.factory(vocab))
        if not isinstance(abstract, LinenModel):  # a Linen model's modules are met as it is traced
            check_rules_match(self.plan, nnx_module_paths(abstract))
        graphdef, state = nnx.split(abstract)
        tokens = jax.ShapeDtypeStruct((2, seq), jnp.int32)
        try:
            out = jax.eval_shape(lambda st, t: self._run(nnx.merge(graphdef, st), t, False, None), state, tokens)
        except ShardlmError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code, reported in one line
            raise ShardlmError(f"model={self.spec}: running it on tokens [2, {seq}] failed ({type(e).__name__}: "
                               f"{(str(e).splitlines() or [''])[0][:200]}); shardlm calls model(tokens) -> logits "
                               "[batch, seq, vocab]: for another call, give model.call=NAME (call(model, tokens[, "
                               "train]) in the model's file)") from e
        if not (hasattr(out, "shape") and len(out.shape) == 3 and out.shape[:2] == (2, seq) and out.shape[2] >= vocab):
            got = f"shape {tuple(out.shape)}" if hasattr(out, "shape") else f"a {type(out).__name__}"
            raise ShardlmError(f"model={self.spec}: on tokens [2, {seq}] it returned {got}, not logits [2, {seq}, "
                               f"{vocab}]; give model.call=NAME, a function in its file returning the logits")
        self.forward_checked = True

    def explain(self, state, mesh):
        """Where every parameter and optimizer-state leaf of a train state lives, and the plan's rule that placed
        each parameter; the plan's notes with it."""
        layout = self.layout(state["model"], mesh)
        params = nnx.filter_state(state["model"], nnx.Param)
        placed_by = {p.path: p.placed_by for p in layout.placements}
        return explain_trees(params, state["optimizer"], mesh, placed_by, layout.notes() + self.mode_notes())

    def mode_notes(self) -> list[str]:
        """A model whose call takes its training mode as an argument, run without an adapter that passes it, is
        called with that argument's default in training as in evaluation: worth a note."""
        if self.call is not None:
            return []
        with nnx.use_eager_sharding(False):
            model = nnx.eval_shape(self.factory(self.placeholder_vocab or 256))
        module = model.linen_module if isinstance(model, LinenModel) else model
        named = inspect.signature(type(module).__call__).parameters
        flags = [n for n in ("train", "training", "is_training", "deterministic") if n in named]
        if not flags:
            return []
        return [f"{type(module).__name__}.__call__ takes `{flags[0]}`, and shardlm calls model(tokens), so training "
                f"runs with its default; give model.call=NAME, a function call(model, tokens, train) in the model's "
                f"file, to pass it"]

    def split_notes(self, mesh) -> list[str]:
        return []  # its attention is its own: what a context split costs it is in the compiled step (`plan`)

    def head_note(self, mesh, vocab_size: int) -> None:
        return None  # its head and loss are its own

    def generator(self, graphdef, state, mesh, *, eot_id: int, vocab_size: int, **options):
        options["use_cache"] = False
        return Generator(graphdef, state, mesh, eot_id=eot_id, context=self.model_cfg.seq_len, vocab=vocab_size,
                         forward=lambda model, tokens: self.logits(model, tokens, mesh, train=False), **options)


def reseed_streams(model, key) -> None:
    """Every RNG stream of `model` restarted from `key` folded with the stream's path: a pure function of the key,
    different for every layer."""
    def policy(path, new_key, shape):
        if shape:
            raise ShardlmError(f"the RNG stream at {path_str(path)} holds keys of shape {shape} (a scanned or "
                               "vmapped module); shardlm reseeds scalar streams only")
        return jax.random.fold_in(new_key, zlib.crc32("/".join(map(str, path)).encode()))

    tags = {stream.tag for _, stream in nnx.iter_graph(model) if isinstance(stream, nnx.RngStream)}
    if tags:
        nnx.reseed(model, policy=policy, **{tag: key for tag in tags})
