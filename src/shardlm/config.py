"""Typed run configuration: dataclasses, loaded from YAML and overridden by `key=value` arguments.

Design choices:
- Every section is a frozen-free dataclass with typed fields; values from YAML or the command line are checked
  against the field's type, so `train.steps=abc` fails at load time naming the key, not deep inside JAX.
- `model=<preset>` replaces the whole model section with a preset (a family's, `shardlm.families`), or with the
  architecture of a Hugging Face checkpoint (`model=hf:DIR`, `shardlm.hf.config`); field overrides such as
  `model.n_layers=2` then apply on top, whatever their order on the command line. `hf:` names are resolved here
  and nowhere else in the config: as a preset, as `init.from`'s default architecture, and in run labels.
- `model=py:FILE:FUNCTION` names a model in the user's own file (`shardlm.foreign.modules`), placed by `plan`
  (a plan file or preset, default fsdp). Its function decides the architecture, so of the model section only the
  fields it is given (`PY_MODEL_KEYS`) may be set. When no config layer sets a `mesh.*` degree, the plan's mesh is
  the run's (`plan=fsdp` alone is FSDP over every device), and the resolved mesh is what the run saves.
- The model section's own checks live with `ModelConfig` (`shardlm.models.config`); this module checks the rest.
- `mesh.data` defaults to None, meaning "the rest of the devices, unless another axis is -1" so that the
  single override `mesh.fsdp=-1` gives pure FSDP without also writing `mesh.data=1`.
"""

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from shardlm.accelerator import COMPUTE_DTYPES, DTYPE_NAMES, current, multiplies_fp8, resolve_dtype
from shardlm.errors import ShardlmError, check_in_range, check_one_of, check_positive
from shardlm.families import check_model_config, from_hf, model_preset
from shardlm.files import read_mapping
from shardlm.foreign.modules import is_py, parse_spec
from shardlm.foreign.plan import Plan
from shardlm.hf.config import HF_PREFIX, is_hf
from shardlm.hf.config import model_label as hf_model_label
from shardlm.mesh import MESH_AXES
from shardlm.models.config import FP8, ModelConfig
from shardlm.schedules import check_schedule


@dataclasses.dataclass
class MeshConfig:
    # Pipeline stages: splits the model's layers (`model.pipeline_microbatches`, `model.pipeline_repeats`); spans
    # hosts first.
    stage: int = 1
    # None = all remaining devices (unless another axis is -1); -1 = all remaining devices.
    data: int | None = None
    fsdp: int = 1
    # Splits a mixture of experts' experts (tokens travel to them by all-to-all); FSDP for the dense weights.
    expert: int = 1
    # Splits each sequence of the activations (context parallelism): for sequences too long for one device.
    context: int = 1
    tensor: int = 1
    # Megatron's sequence parallelism over the tensor group: the residual stream, norms and layer inputs split along
    # the sequence over tensor (1/tensor of their memory); each all-reduce of a tensor-parallel block becomes a
    # reduce-scatter and an all-gather of the same bytes (`sharding.sequence_parallel_rules`).
    sequence_parallel: bool = False
    # `mesh=auto`: the planner chooses every degree (`shardlm.perf.auto`) when a run starts, and the run's
    # config.yaml records the degrees it chose (auto false), so a resume keeps them.
    auto: bool = False


@dataclasses.dataclass
class DataConfig:
    # A directory from `shardlm data prepare`, or text to prepare once into the cache: a .txt / .jsonl / .parquet
    # file, a folder of them, or "shakespeare" (the built-in offline corpus).
    path: str = "shakespeare"
    # "auto" = the prepared directory's tokenizer, or for text a byte-level BPE of `tokenizer_vocab` tokens trained
    # on it; "gpt2" (tiktoken), "bytes", "bpe" (trained) or "bpe:PATH" (a tokenizer.json).
    tokenizer: str = "auto"
    tokenizer_vocab: int = 2048
    # Text only: the last fraction of the tokens is the validation split.
    val_fraction: float = 0.05
    text_field: str = "text"  # the JSONL field / Parquet column holding the text
    invalid_utf8: str = "error"  # or "replace": bad bytes become U+FFFD, counted in meta.json
    # A mixture: a list of {path, weight, name} read as one stream by the weights (`shardlm.data.mixture`), each
    # source evaluated on its own; empty = the one source data.path names.
    sources: list = dataclasses.field(default_factory=list)
    # Attention within each document packed in a window, as the separator tokens delimit them
    # (`shardlm.models.documents`): true asks for it (refused where it cannot run: pipeline stages, a model from a
    # py: file); "auto" (the default: measured in docs/recipe.md) = wherever the kernel the step runs takes
    # documents' ids (not cuDNN's: off on GPUs) and off pipeline stages; false attends across documents.
    document_mask: bool | str = "auto"
    # With document masks: positions restart at each document (each token's offset in its document), not 0..T-1
    document_positions: bool = False


OPTIMIZERS = ("adamw", "muon", "lion", "adafactor")  # train.optimizer's values (`shardlm.train.optimizers`)


@dataclasses.dataclass
class TrainConfig:
    steps: int = 500
    batch_size: int = 32  # global, in sequences
    # Microbatches per step: the global batch is split into grad_accum slices, run one after another inside the
    # jitted step (a scan) and their gradients averaged: the same update (without dropout), with the activations
    # of one microbatch alive at a time.
    grad_accum: int = 1
    # With mesh.data > 1, the weights and AdamW's moments are split over the data-parallel replicas too (ZeRO-1/2:
    # gradients reduce-scattered, each replica updating its shard, the weights gathered in the compute dtype once
    # per step). false: every replica holds the whole state, as before.
    shard_optimizer_over_data: bool = True
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    z_loss: float = 0.0  # > 0: this weight times the mean of log^2 Z of the logits joins the loss (PaLM's z-loss)
    # adamw, muon (optax's, on the hidden matrices; AdamW on the embedding, head, norms, biases and routers), lion
    # or adafactor: one train.lr and schedule for each (`shardlm.train.optimizers`)
    optimizer: str = "adamw"
    # Muon's own momentum is Nesterov, as in Keller Jordan's Muon and Moonlight's (their reference runs and the
    # rate they tuned assume it); false: plain heavy-ball momentum. The AdamW half of train.optimizer=muon is
    # plain AdamW whatever this says, the same as train.optimizer=adamw.
    muon_nesterov: bool = True
    # Skip an update whose loss or gradient norm is not finite, or beyond spike_sigmas standard deviations of the
    # last spike_window applied updates' (once half of them are in); stop after max_skips skips in a row
    # (`shardlm.train.spikes`)
    skip_spikes: bool = True
    spike_sigmas: float = 6.0
    spike_window: int = 128
    max_skips: int = 8
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 8
    sample_tokens: int = 96


@dataclasses.dataclass
class CheckpointConfig:
    # Save every this many steps (0 = only at the end and when stopped by a signal), asynchronously.
    every: int = 100
    # How many of the newest checkpoints to keep; the one at train.steps is kept as well.
    keep: int = 3


@dataclasses.dataclass
class InitConfig:
    # Where a new run's weights come from: "" = random (the model's initialisers), or "hf:DIR", a Hugging Face
    # checkpoint directory (config.json + *.safetensors), whose architecture also becomes the model section unless
    # `model=` names one. Read only when a run starts at step 0; a resumed run continues from its checkpoint.
    # The config key is `init.from` (`from` is a Python keyword, hence the field's name).
    from_: str = ""


FIELD_KEYS = {"from_": "from"}  # attribute name -> config key, where they differ


@dataclasses.dataclass
class Config:
    name: str = ""
    seed: int = 0
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    # How a model from a py: file is placed: a plan file (.yaml, .yml, .json) or a preset (dp, fsdp, megatron);
    # "" = fsdp. shardlm's own models are placed by the rule table (shardlm.sharding.rules) and take no plan.
    plan: str = ""
    init: InitConfig = dataclasses.field(default_factory=InitConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        tree = dataclasses.asdict(self)
        if is_py(self.model.preset):  # its function builds the architecture: only the fields it is given
            tree["model"] = {k: v for k, v in tree["model"].items() if k in PY_MODEL_KEYS or k == "family"}
        return {k: {FIELD_KEYS.get(f, f): v for f, v in s.items()} if isinstance(s, dict) else s
                for k, s in tree.items()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# The model fields a model from a py: file uses (the rest describe shardlm's own architectures).
PY_MODEL_KEYS = ("preset", "seq_len", "vocab_size", "dropout", "dtype", "param_dtype", "call")
PY_FAMILY = "py"


def model_label(m: ModelConfig) -> str:
    """The preset's name as a file name: 'hf:/ckpt/TinyLlama-1.1B' -> 'hf-TinyLlama-1.1B', 'py:models/lm.py:build'
    -> 'py-lm-build'."""
    if is_py(m.preset):
        path, name = m.preset[3:].rsplit(":", 1)
        return f"py-{Path(path).stem}-{name}"
    return hf_model_label(m.preset) if is_hf(m.preset) else m.preset


def model_section(name: str) -> ModelConfig:
    """`model=NAME`: a built-in preset, `hf:DIR` (the architecture of a Hugging Face checkpoint), or
    `py:FILE:FUNCTION` (a model in the user's file, whose architecture is its own)."""
    if is_py(name):
        parse_spec(name)  # the form, and that the file exists
        return ModelConfig(preset=name, family=PY_FAMILY)
    return from_hf(name) if is_hf(name) else model_preset(name)


def describe(cfg: Config) -> str:
    """One line on the model and its memory levers, for logs and reports."""
    m, t = cfg.model, cfg.train
    if is_py(m.preset):
        text = f"{m.preset} placed by plan {cfg.plan or 'fsdp'}, compute {m.dtype}, weights {m.param_dtype}"
        return text + (f", {t.grad_accum} microbatches per step" if t.grad_accum > 1 else "")
    heads = f"{m.n_heads} heads" + (f" / {m.n_kv_heads} kv heads" if m.n_kv_heads not in (0, m.n_heads) else "")
    text = (f"{m.preset} ({m.family}, {m.n_layers} layers, d_model {m.d_model}, {heads}), compute {m.dtype}, "
            f"weights {m.param_dtype}, remat {m.remat}")
    return text + (f", {t.grad_accum} microbatches per step" if t.grad_accum > 1 else "")


_SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type)}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else tp.__name__


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the field type `tp`; ints are accepted where floats are expected."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ShardlmError:
                pass
    elif tp is type(None):
        if value is None:
            return None
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif tp is float and isinstance(value, str):
        # YAML 1.1 reads "1e-3" (no dot) as a string.
        try:
            return float(value)
        except ValueError:
            pass
    elif tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tp is bool and isinstance(value, bool):
        return value
    elif tp is list and isinstance(value, list):
        return value
    elif tp is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ShardlmError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _unknown(key: str, allowed: list[str]) -> ShardlmError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ShardlmError(f"unknown config key '{key}'{hint}; allowed: {', '.join(allowed)}")


class _Raw(str):
    """A command-line value: YAML-parsed for typed fields, kept verbatim for text fields (name=0123 stays '0123')."""

    def __new__(cls, raw: str, parsed: Any):
        obj = super().__new__(cls, raw)
        obj.parsed = parsed
        return obj


def _value_for(value: Any, tp: Any) -> Any:
    if not isinstance(value, _Raw):
        return value
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return str(value) if str in args else value.parsed


def _set(cfg: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) == 1:
        fields = {f.name: f for f in dataclasses.fields(Config)}
        if key == "model":  # a preset name
            cfg.model = model_section(_coerce(key, _value_for(value, str), str))
            return
        if key == "mesh":  # the planner's choice, or a section's fields
            if str(value) != "auto":
                raise ShardlmError(f"mesh={value}: set the mesh's degrees as mesh.<axis>=N, or mesh=auto to let the "
                                   "planner choose them")
            cfg.mesh = MeshConfig(auto=True, sequence_parallel=cfg.mesh.sequence_parallel)
            return
        if key not in fields or key in _SECTIONS:
            allowed = [n for n in fields if n not in _SECTIONS] + ["model (a preset name)"]
            if key in _SECTIONS:
                raise ShardlmError(f"'{key}' is a section; set its fields as {key}.<field>=value")
            raise _unknown(key, allowed)
        setattr(cfg, key, _coerce(key, _value_for(value, fields[key].type), fields[key].type))
        return
    if len(parts) != 2 or parts[0] not in _SECTIONS:
        raise _unknown(key, [f"{s}.<field>" for s in _SECTIONS] + ["name", "seed"])
    section = getattr(cfg, parts[0])
    fields = {FIELD_KEYS.get(f.name, f.name): f for f in dataclasses.fields(section)}
    if parts[1] not in fields:
        raise _unknown(key, list(fields))
    tp = fields[parts[1]].type
    setattr(section, fields[parts[1]].name, _coerce(key, _value_for(value, tp), tp))


def flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A nested config dict as (dotted key, value) pairs."""
    out: list[tuple[str, Any]] = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.extend(flatten(v, key + "."))
        else:
            out.append((key, v))
    return out


def _parse_override(arg: str) -> tuple[str, Any]:
    if "=" not in arg:
        raise ShardlmError(f"argument '{arg}' is not key=value (for example train.steps=100)")
    key, raw = arg.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), _Raw(raw, value)


_MODEL_FIELDS = {f"model.{f.name}" for f in dataclasses.fields(ModelConfig)}


def _apply(cfg: Config, items: list[tuple[str, Any]]) -> None:
    # The preset goes first so that field overrides apply on top of it, in any order. A whole model section (a
    # run's saved config) needs no preset: its `preset` is only a name then, and a preset read from a directory
    # (`hf:DIR`) need not exist any more.
    keys = {k for k, _ in items}
    presets = [v for k, v in items if k in ("model", "model.preset")]
    if presets and _MODEL_FIELDS <= keys:
        _set(cfg, "model.preset", presets[-1])
    else:
        for value in presets:
            _set(cfg, "model", value)
    # mesh=auto replaces the whole mesh section, before its fields (which `validate` then refuses beside it)
    for value in [v for k, v in items if k == "mesh"]:
        _set(cfg, "mesh", value)
    for key, value in items:
        if key not in ("model", "model.preset", "mesh"):
            _set(cfg, key, value)


def read_config_file(p: Path) -> dict[str, Any]:
    return read_mapping(p, "config file", missing="pass an existing YAML file to --config",
                        not_mapping="a config file holds keys and values (see configs/)", allow_empty=True)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                base: dict[str, Any] | None = None, base_origin: str = "the run's config") -> Config:
    """Build a Config from defaults, then `base` (a run's own config, as a dict, when resuming: read from
    `base_origin`), then the YAML file `path`, then `key=value` overrides, and validate it. A key or value the
    base or the file cannot take is an error that names it."""
    layers = [(flatten(tree), origin) for tree, origin in
              ((base, base_origin), (None if path is None else read_config_file(Path(path)), str(path)))
              if tree is not None]
    return _build([items for items, _ in layers] + [[_parse_override(a) for a in overrides]],
                  [origin for _, origin in layers] + [None])


def config_from_dict(tree: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The inverse of `Config.to_dict` (a checkpoint's saved config), then `key=value` overrides, validated."""
    return _build([flatten(tree), [_parse_override(a) for a in overrides]])


def _build(layers: list[list[tuple[str, Any]]], origins: list[str | None] | None = None) -> Config:
    """Defaults, then each layer of (key, value) items in turn (from `origins`: a file an error names, or None).
    `init.from=hf:DIR`, in any layer, brings that checkpoint's architecture as the preset when no layer names one,
    applied before every layer's model fields. A model from a py: file takes its plan's mesh when no layer sets a
    mesh degree."""
    cfg = Config()
    origins = origins or [None] * len(layers)
    named = any(k in ("model", "model.preset") for layer in layers for k, _ in layer)
    starts = [v for layer in layers for k, v in layer if k == "init.from"]
    if not named and starts and is_hf(str(starts[-1])):
        layers, origins = [[("model", str(starts[-1]))]] + layers, [None] + origins
    for layer, origin in zip(layers, origins):
        try:
            _apply(cfg, layer)
        except ShardlmError as e:
            if origin is None:
                raise
            raise ShardlmError(f"{origin}: {e}") from None
    if is_py(cfg.model.preset):
        _check_py_keys(layers)
        if not any(k.startswith("mesh.") for layer in layers for k, _ in layer):
            cfg.mesh = plan_mesh(cfg.plan)
    validate(cfg)
    # model.dtype=auto becomes the dtype it stands for on the accelerator compiled for (the local devices, or a
    # `--target`'s), so the run's saved config, its header and its FLOP peak all name the real one.
    cfg.model.dtype = resolve_dtype(cfg.model.dtype)
    if cfg.model.matmul_dtype == FP8:
        check_fp8(current())
    return cfg


def check_fp8(accelerator) -> None:
    """A one-line error if `model.matmul_dtype=fp8` is asked of an accelerator without float8 matmuls."""
    if not multiplies_fp8(accelerator):
        raise ShardlmError(f"model.matmul_dtype=fp8 needs FP8 matrix units (NVIDIA compute capability 8.9 or later: "
                           f"H100, H200, L40S), which {accelerator.device_kind} does not have: use "
                           "model.matmul_dtype=auto")


def _check_py_keys(layers: list[list[tuple[str, Any]]]) -> None:
    """A model from a py: file builds its own architecture: setting a field of shardlm's architectures is an
    error (a whole model section, as a run saves it, is fine)."""
    for layer in layers:
        keys = {k for k, _ in layer}
        if _MODEL_FIELDS <= keys:
            continue
        for key in keys:
            if key.startswith("model.") and key.split(".", 1)[1] not in (*PY_MODEL_KEYS, "family"):
                takes = ", ".join(f"model.{k}" for k in PY_MODEL_KEYS[1:])
                raise ShardlmError(f"{key} does not apply to a model from a py: file, whose function builds its "
                                   f"own architecture; of the model section it takes {takes}")


def plan_mesh(plan: str) -> MeshConfig:
    """The mesh a plan names (a preset's: dp -> data -1, fsdp -> fsdp -1, megatron -> tensor -1), as the run's."""
    mesh = Plan.load(plan or "fsdp").mesh or {}
    unknown = [a for a in mesh if a not in ("data", "fsdp", "context", "tensor")]
    if unknown:
        raise ShardlmError(f"plan {plan}: its mesh names axis '{unknown[0]}', but a run's mesh has the axes data, "
                           "fsdp, context and tensor: use those names in the plan, or set the mesh with mesh.*=N")
    out = MeshConfig(data=1 if any(v == -1 for v in mesh.values()) else None)
    for axis, degree in mesh.items():
        if not isinstance(degree, int) or isinstance(degree, bool):
            raise ShardlmError(f"plan {plan}: mesh.{axis} must be a degree (a whole number, or -1 for the rest)")
        setattr(out, axis, degree)
    return out


def _check_py_model(cfg: Config) -> None:
    """The fields of a model from a py: file, and what it cannot be combined with."""
    m = cfg.model
    if m.family != PY_FAMILY:
        raise ShardlmError(f"model.family={m.family} does not apply to a model from a py: file")
    check_positive("model.seq_len", m.seq_len)
    if m.vocab_size < 0:
        raise ShardlmError(f"model.vocab_size must be >= 0 (0 = the tokenizer's), got {m.vocab_size}")
    check_in_range("model.dropout", m.dropout, 0.0, 1.0)
    check_one_of("model.dtype", m.dtype, COMPUTE_DTYPES)
    check_one_of("model.param_dtype", m.param_dtype, DTYPE_NAMES)
    if m.call and not (is_py(m.call) or m.call.isidentifier()):
        raise ShardlmError(f"model.call={m.call}: name a function in the model's file, or py:FILE.py:FUNCTION")
    if cfg.init.from_:
        raise ShardlmError(f"init.from={cfg.init.from_} imports GPT-2 or Llama weights; a model from a py: file builds "
                           "its own: leave init.from empty")
    if cfg.mesh.sequence_parallel:
        raise ShardlmError("mesh.sequence_parallel applies to shardlm's own models; a model from a py: file splits "
                           "its activations by its plan's activations: section (see examples/your_own_model/"
                           "sequence_parallel.yaml)")
    # The plan file is read where the model is placed (`train.source`), not here: a run's saved config names the
    # plan it started with, which a resume may replace and which need not exist any more.


def validate(cfg: Config) -> None:
    """Value checks that need no devices. Mesh/shape divisibility is checked against the mesh in `shardlm.mesh`."""
    if is_py(cfg.model.preset):
        _check_py_model(cfg)
    else:
        check_model_config(cfg.model)
        check_schedule(cfg.model)
        for key, value in (("plan", cfg.plan), ("model.call", cfg.model.call)):
            if value:
                raise ShardlmError(f"{key}={value} is for a model from a py: file (model=py:FILE:FUNCTION); "
                                   f"shardlm's own models are placed by the rule table: drop {key}")
    check_in_range("seed", cfg.seed, 0, 2**32)
    _check_train(cfg.train)
    _check_data(cfg.data)
    if cfg.init.from_ and not is_hf(cfg.init.from_):
        raise ShardlmError(f"init.from={cfg.init.from_!r} is not a checkpoint to start from; use {HF_PREFIX}DIR, a "
                           "Hugging Face model directory (config.json and *.safetensors), or leave it empty")
    if cfg.checkpoint.every < 0:
        raise ShardlmError(f"checkpoint.every must be >= 0 (0 = only at the end), got {cfg.checkpoint.every}")
    if cfg.checkpoint.keep < 1:
        raise ShardlmError(f"checkpoint.keep must be at least 1, got {cfg.checkpoint.keep}")
    _check_mesh(cfg)


def _check_train(t: TrainConfig) -> None:
    for key in ("steps", "batch_size", "grad_accum", "lr", "log_interval", "eval_interval", "eval_batches"):
        check_positive(f"train.{key}", getattr(t, key))
    if t.batch_size % t.grad_accum:
        raise ShardlmError(f"train.batch_size={t.batch_size} does not split into train.grad_accum={t.grad_accum} "
                           "equal microbatches; use a grad_accum dividing the batch size")
    for key in ("warmup_steps", "sample_tokens", "weight_decay", "grad_clip", "z_loss"):
        check_in_range(f"train.{key}", getattr(t, key), 0, math.inf)
    check_one_of("train.optimizer", t.optimizer, OPTIMIZERS)
    for key in ("spike_window", "max_skips"):
        check_positive(f"train.{key}", getattr(t, key))
    if not t.spike_sigmas > 0:  # nan fails too
        raise ShardlmError(f"train.spike_sigmas must be positive, got {t.spike_sigmas}")
    check_in_range("train.beta1", t.beta1, 0.0, 1.0)
    check_in_range("train.beta2", t.beta2, 0.0, 1.0)
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ShardlmError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")


def _check_data(d: DataConfig) -> None:
    if not 0.0 < d.val_fraction < 0.5:  # nan fails too
        raise ShardlmError(f"data.val_fraction must be in (0, 0.5), got {d.val_fraction}")
    if d.tokenizer != "auto":
        from shardlm.data.tokenizer import check_spec

        check_spec(d.tokenizer, "data.tokenizer")
    if isinstance(d.document_mask, str) and d.document_mask.lower() in ("true", "false"):  # as written on a CLI
        d.document_mask = d.document_mask.lower() == "true"
    if d.document_mask not in (True, False, "auto"):
        raise ShardlmError(f"data.document_mask must be true, false or auto, got {d.document_mask!r}")
    if d.document_positions and d.document_mask is False:
        raise ShardlmError("data.document_positions=true restarts positions at the documents the mask keeps apart; "
                           "set data.document_mask=auto or true, or drop document_positions")
    if d.invalid_utf8 not in ("error", "replace"):
        raise ShardlmError(f"data.invalid_utf8 must be error or replace, got {d.invalid_utf8!r}")
    if not d.path or not d.text_field:
        raise ShardlmError("data.path and data.text_field must not be empty")
    if d.sources:
        from shardlm.data.mixture import parse_sources

        parse_sources(d.sources, d.path)
        if d.path != DataConfig.path:  # (a mixture reads its sources alone: data.path would be ignored)
            raise ShardlmError(f"data.path={d.path} and data.sources both name the training data; give the sources "
                               "alone (each path in data.sources), or data.path alone with data.sources=[]")
    if d.tokenizer_vocab < 257:
        raise ShardlmError(f"data.tokenizer_vocab must be at least 257 (bytes + end of text), got {d.tokenizer_vocab}")


def _check_mesh(cfg: Config) -> None:
    for axis in MESH_AXES:
        v = getattr(cfg.mesh, axis)
        if v is not None and v != -1 and v < 1:
            raise ShardlmError(f"mesh.{axis} must be a positive degree or -1 (the rest), got {v}")
    if cfg.mesh.expert != -1:  # (-1 is known only with the devices: `train.state` checks the resolved degree)
        check_expert_degree(cfg.model, cfg.mesh.expert)
    if cfg.mesh.auto:
        fixed = [f"mesh.{a}={getattr(cfg.mesh, a)}" for a in MESH_AXES
                 if getattr(cfg.mesh, a) != getattr(MeshConfig(), a)]
        if fixed:
            raise ShardlmError(f"mesh=auto chooses every degree, and {fixed[0]} sets one: drop one of them")
        if is_py(cfg.model.preset):
            raise ShardlmError("mesh=auto plans shardlm's own models; a model from a py: file is placed by its plan "
                               "(plan=FILE or a preset): drop mesh=auto")


def check_expert_degree(m: ModelConfig, expert: int) -> None:
    """A one-line error if the expert degree `expert` cannot split shardlm's model `m`'s experts. A dense model has
    none: the axis would only be FSDP under another name, so asking for it is refused rather than taken silently.
    A degree that does not divide the experts is said in the experts' terms, before the batch's split (which the
    expert axis joins) or a parameter's could report it in theirs. A model from a py: file is left to its plan,
    whose specs may name the axis."""
    if expert <= 1 or is_py(m.preset):
        return
    if not m.moe_experts:
        raise ShardlmError(f"mesh.expert={expert} splits a mixture of experts' experts, and model {m.preset} is dense "
                           "(model.moe_experts=0): drop mesh.expert, or set model.moe_experts")
    if m.moe_experts % expert:
        divisors = ", ".join(str(d) for d in range(1, m.moe_experts + 1) if m.moe_experts % d == 0)
        raise ShardlmError(f"mesh.expert={expert} does not divide model.moe_experts={m.moe_experts}; choose a "
                           f"divisor: {divisors}")


def check_resolved(cfg: Config) -> None:
    """A one-line error if `mesh=auto` or `model.remat=auto` is still to be chosen (by `shardlm.perf.auto`)."""
    from shardlm.mesh import unresolved
    from shardlm.models.config import AUTO_REMAT

    if cfg.mesh.auto:
        raise unresolved("mesh=auto", "mesh.fsdp=8")
    if cfg.model.remat == AUTO_REMAT:
        raise unresolved("model.remat=auto", "model.remat=full")


def agree_on_config(cfg: Config, **extra) -> None:
    """Every process of a run must have been started with the same config (one-line error on all if not)."""
    from shardlm import distributed

    distributed.agree("config", {**dict(flatten(cfg.to_dict())), **extra}, "the config",
                      "start every process with the same command line and config file")
