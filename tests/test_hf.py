"""Hugging Face checkpoints in and out, checked against an independent implementation: transformers (PyTorch, CPU)
builds random-weight GPT-2 and Llama models from configs (no network) and computes the reference logits and greedy
continuations; shardlm's own code is never the reference. Also GPT-2's tokenizer end to end offline, from the
copy of its file that openai-whisper's source package ships."""

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM)

from shardlm.config import load_config
from shardlm.data.gpt2_ranks import RegistryFetchError, fetch_gpt2_ranks
from shardlm.errors import ShardlmError
from shardlm.generate import Generator
from shardlm.exporter import export
from shardlm.load import load_model
from shardlm.sampling import Sampling
from shardlm.sharding import use_mesh_rules
from shardlm.train.loop import train
from test_checkpoint import send_at
from test_cli import assert_one_line_error, shardlm

MESH = ["mesh.fsdp=4", "mesh.tensor=2"]  # FSDP 4 x TP 2 on the 8 simulated devices
VOCAB = 300
RTOL = 1e-4  # float32, two implementations: summation orders differ
GREEDY = 8


def hf_gpt2() -> torch.nn.Module:
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def hf_llama(tied: bool) -> torch.nn.Module:
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=64, tie_word_embeddings=tied, rope_theta=5000.0,
                                        bos_token_id=0, eos_token_id=0))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """save_pretrained directories of random-weight models: GPT-2, and Llama with grouped-query attention (4 query
    heads, 2 kv heads), untied (a tied Llama: test_hf_families)."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, build in (("gpt2", hf_gpt2), ("llama", lambda: hf_llama(False))):
        build().eval().save_pretrained(root / name)
        out[name] = root / name
    return out


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def torch_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def our_logits(m, tokens: np.ndarray, vocab: int) -> np.ndarray:
    model = nnx.merge(m.graphdef, m.state)
    with use_mesh_rules(m.mesh):
        return np.asarray(jax.jit(lambda t: model(t))(tokens))[..., :vocab]


def our_greedy(m, prompt: list[int], n: int) -> list[int]:
    gen = Generator(m.graphdef, m.state, m.mesh, eot_id=-1)  # no stop token: exactly n tokens
    return gen.generate([prompt], n, Sampling(0.0, 0, 1.0))[0].ids


def assert_close(ours, ref):
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < RTOL, err


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 24)).astype(np.int32)


@pytest.mark.parametrize("name", ["gpt2", "llama"])  # a tied Llama: test_hf_families' Llama 3
def test_an_imported_checkpoint_computes_transformers_logits_on_a_mesh(hf_dirs, name):
    m = load_model(f"hf:{hf_dirs[name]}", overrides=MESH)
    params = m.state
    # every array read back sits in its FSDP 4 x TP 2 sharding
    assert m.mesh.shape == {"stage": 1, "data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}
    # the blocks stacked over the layers (a scanned model), read from the per-layer Hugging Face tensors
    assert params["blocks"]["attn"]["wq"][...].sharding.spec == P(None, "fsdp", "tensor", None)
    assert params["blocks"]["attn"]["wk"][...].sharding.spec == P(None, "fsdp", "tensor", None)  # 2 kv heads / tp 2
    assert params["blocks"]["attn"]["wo"][...].sharding.spec == P(None, "tensor", None, "fsdp")
    assert params["wte"][...].sharding.spec == P("tensor", "fsdp") and params["wte"][...].shape == (320, 64)
    wq = params["blocks"]["attn"]["wq"][...]
    assert {s.data.shape for s in wq.addressable_shards} == {(wq.shape[0], 16, 2, 16)}  # (layers, 64/4, 4/2, 16)
    if name == "llama":
        assert params["lm_head"][...].sharding.spec == P("fsdp", "tensor")
    reference = AutoModelForCausalLM.from_pretrained(hf_dirs[name]).eval()
    assert_close(our_logits(m, TOKENS, VOCAB), torch_logits(reference, TOKENS))
    prompt = TOKENS[0, :10].tolist()
    assert our_greedy(m, prompt, GREEDY) == torch_greedy(reference, prompt, GREEDY)


def edit_checkpoint(src: Path, dst: Path, config=None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config:
        tree = json.loads((dst / "config.json").read_text())
        config(tree)
        (dst / "config.json").write_text(json.dumps(tree))
    if tensors:
        weights = load_file(str(dst / "model.safetensors"))
        tensors(weights)
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


BAD = {
    "architecture": (dict(config=lambda t: t.update(model_type="mistral", architectures=["MistralForCausalLM"])),
                     "model_type 'mistral' (MistralForCausalLM) is not supported"),
    "rope scaling": (dict(config=lambda t: t.update(rope_scaling={"rope_type": "dynamic", "factor": 8.0},
                                                    rope_parameters=None)),
                     "rope_scaling={\"rope_type\": \"dynamic\", \"factor\": 8.0} is not supported (rope scaling "
                     "'dynamic'"),
    "biases": (dict(config=lambda t: t.update(attention_bias=True)), "attention_bias=true is not supported"),
    "missing key": (dict(tensors=lambda w: w.pop("model.norm.weight")), "has no tensor 'model.norm.weight'"),
    "extra key": (dict(tensors=lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})),
                  "does not use, e.g. 'model.layers.0.self_attn.q_proj.bias'"),
    "wrong shape": (dict(config=lambda t: t.update(intermediate_size=96)),
                    "model.layers.0.mlp.gate_proj.weight has shape [128, 64], but the model needs [96, 64]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_checkpoint_that_does_not_match_is_a_one_line_error(hf_dirs, tmp_path, case):
    edits, message = BAD[case]
    bad = edit_checkpoint(hf_dirs["llama"], tmp_path / "bad", **edits)
    with pytest.raises(ShardlmError) as e:
        load_model(f"hf:{bad}", overrides=MESH)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_training_from_a_bad_checkpoint_stops_before_writing_anything(hf_dirs, tmp_path):
    bad = edit_checkpoint(hf_dirs["gpt2"], tmp_path / "bad",
                          tensors=lambda w: w.pop("transformer.h.1.mlp.c_fc.weight"))
    proc = shardlm("train", "--cpu-devices", "8", "--run-dir", str(tmp_path / "run"), f"init.from=hf:{bad}",
                   "data.tokenizer=bytes", "model.seq_len=32", *MESH)  # fails before the data is even prepared
    assert_one_line_error(proc, "has no tensor 'transformer.h.1.mlp.c_fc.weight'")
    assert not (tmp_path / "run").exists()


FINETUNE = ["data.tokenizer=bytes", "model.seq_len=32", "train.steps=8", "train.batch_size=16", "train.warmup_steps=2",
            "train.lr=3e-3", "train.log_interval=1", "train.eval_interval=4", "train.eval_batches=2",
            "train.sample_tokens=0", "checkpoint.every=4",
            # data-parallel replicas too: the training state is stored split over `data` (ZeRO), and the imported
            # weights are read straight into that layout (an import into the model's own layout once crashed here)
            "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


def test_fine_tuning_an_imported_model_starts_from_it_resumes_and_exports(hf_dirs, tmp_path):
    """init.from=hf:DIR trains the checkpoint's weights (step 0's eval loss is transformers' loss on the same
    batches), resumes bit for bit, and exports a model transformers computes the same logits with."""
    cfg = load_config(None, [f"init.from=hf:{hf_dirs['gpt2']}", *FINETUNE])
    assert cfg.model.preset == f"hf:{hf_dirs['gpt2']}" and cfg.model.n_layers == 2 and cfg.model.vocab_size == VOCAB
    reference = tmp_path / "reference"
    train(cfg, reference, progress=False)
    rows = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    # step 0: the imported model's loss on the two fixed validation batches, computed by transformers
    from shardlm.train.data import load_data

    val = load_data(load_config(None, FINETUNE)).tokens("val")
    windows = np.stack([val[i * 32: i * 32 + 33] for i in range(32)]).astype(np.int64)
    hf = AutoModelForCausalLM.from_pretrained(hf_dirs["gpt2"]).eval()
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(hf(torch.tensor(b[:, :-1])).logits.flatten(0, 1),
                                                    torch.tensor(b[:, 1:]).flatten()).item()
                  for b in (windows[:16], windows[16:])]
    assert abs(rows[0]["eval_loss"] - np.mean(losses)) < 1e-4 * np.mean(losses), (rows[0], losses)

    run, moved = tmp_path / "run", tmp_path / "ckpt"
    shutil.copytree(hf_dirs["gpt2"], moved)
    cfg = load_config(None, [f"init.from=hf:{moved}", *FINETUNE])
    stopped = train(cfg, run, progress=False, on_step=send_at(5, signal.SIGTERM))
    assert stopped["stopped_by"] == "SIGTERM" and stopped["steps"] == 5
    moved.rename(tmp_path / "gone")  # the resumed run needs nothing from the checkpoint directory
    from shardlm.config import read_config_file

    resumed = train(load_config(None, [], base=read_config_file(run / "config.yaml")), run, progress=False)
    assert resumed["resumed_from"] == 5
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "tflops_per_device", "mfu")}
                        for r in rs]  # noqa: E731
    assert strip([json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]) == strip(rows)

    out = tmp_path / "export"
    export(run, out, log=lambda m: None)
    m = load_model(run)
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert_close(our_logits(m, TOKENS % 257, VOCAB), torch_logits(exported, TOKENS % 257))


def test_init_from_takes_the_checkpoints_architecture_under_the_configs_own_model_settings(hf_dirs, tmp_path):
    """init.from=hf:DIR is the preset when no layer names one, applied under every layer's model fields; a
    built-in preset of the same shapes takes the checkpoint's vocabulary."""
    from shardlm.train.init_from import check_checkpoint, with_checkpoint_defaults
    from shardlm.mesh import make_mesh

    (tmp_path / "ft.yaml").write_text("model: {dtype: bfloat16, remat: full, seq_len: 32}\n")
    cfg = load_config(tmp_path / "ft.yaml", [f"init.from=hf:{hf_dirs['gpt2']}"])
    assert (cfg.model.preset, cfg.model.n_layers, cfg.model.dtype, cfg.model.remat, cfg.model.seq_len) == \
        (f"hf:{hf_dirs['gpt2']}", 2, "bfloat16", "full", 32)
    assert load_config(None, [f"init.from=hf:{hf_dirs['gpt2']}"], base=cfg.to_dict()).model == cfg.model
    same_shape = ["model=tiny", "model.n_layers=2", "model.d_model=64", "model.d_mlp=256", "model.seq_len=32"]
    cfg = with_checkpoint_defaults(load_config(None, [*same_shape, f"init.from=hf:{hf_dirs['gpt2']}",
                                                      "data.tokenizer=bytes"]))
    assert cfg.model.preset == "tiny" and cfg.model.vocab_size == VOCAB
    check_checkpoint(cfg, make_mesh(1, 4, 2))  # the shapes match: no error
    with pytest.raises(ShardlmError, match="drop model.use_bias=false"):
        check_checkpoint(load_config(None, [f"init.from=hf:{hf_dirs['gpt2']}", "model.use_bias=false"]),
                         make_mesh(1, 4, 2))
    # an override that changes the shapes: the error says it is the override, not a checkpoint off its config.json
    with pytest.raises(ShardlmError, match=r"the run's model is not the checkpoint's, it sets model.n_layers=1 "
                                           r"\(the checkpoint's 2\); drop those model settings"):
        check_checkpoint(load_config(None, [f"init.from=hf:{hf_dirs['gpt2']}", "model.n_layers=1"]),
                         make_mesh(1, 4, 2))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Short shardlm runs of each family (byte tokenizer), on FSDP 4 x TP 2."""
    runs = {}
    for family, preset in (("gpt", []), ("llama", ["model=llama-tiny", "model.tie_embeddings=false"])):
        run = tmp_path_factory.mktemp("trained") / family
        train(load_config(None, [*preset, "model.n_layers=2", "model.d_model=64", "model.d_mlp=128", *FINETUNE]),
              run, progress=False)
        runs[family] = run
    return runs


@pytest.mark.parametrize("family", ["gpt"])  # Llama's export: test_hf_families (and trained["llama"] below)
def test_an_exported_run_loads_in_transformers_with_the_same_logits_tokens_and_continuation(trained, tmp_path,
                                                                                          family):
    run, out = trained[family], tmp_path / "export"
    export(run, out, dtype="float32", log=lambda m: None)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    m = load_model(run)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.vocab_size == 257 and hf.config.tie_word_embeddings == (family == "gpt")
    names = load_file(str(out / "model.safetensors"))
    assert ("lm_head.weight" in names) == (family == "llama")  # a tied head is written once
    tokens = TOKENS % 257
    assert_close(our_logits(m, tokens, 257), torch_logits(hf, tokens))
    tok = AutoTokenizer.from_pretrained(out)
    text = "ROMEO: But soft, what light through yonder window breaks?"
    ids = tok(text)["input_ids"]
    assert ids == m.tokenizer.encode(text) and tok.decode(ids) == text
    assert our_greedy(m, ids[:16], GREEDY) == torch_greedy(hf, ids[:16], GREEDY)  # within the 32-token context
    back = load_model(f"hf:{out}", overrides=MESH, require_tokenizer=True)  # and shardlm reads its own export
    assert back.tokenizer.encode(text) == ids
    assert_close(our_logits(back, tokens, 257), torch_logits(hf, tokens))


def test_export_shards_above_the_size_limit_and_is_atomic(trained, tmp_path, monkeypatch):
    run, out = trained["llama"], tmp_path / "export"
    summary = export(run, out, max_shard_bytes=50_000, dtype="bfloat16", log=lambda m: None)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert summary["files"] == len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == summary["bytes"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    m = load_model(run)
    err = np.abs(our_logits(m, TOKENS % 257, 257) - torch_logits(hf, TOKENS % 257)).max()
    assert 0 < err < 0.05 * np.abs(torch_logits(hf, TOKENS % 257)).max()  # bfloat16 weights: close, not equal

    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    with pytest.raises(ShardlmError, match="exists and is not empty; pass --force"):
        export(run, out, log=lambda m: None)
    import shardlm.exporter as exporter

    real = exporter.hf_tensors

    def failing(*args):
        for i, item in enumerate(real(*args)):
            if i == 5:
                raise OSError("disk full")
            yield item

    monkeypatch.setattr(exporter, "hf_tensors", failing)
    with pytest.raises(OSError, match="disk full"):
        export(run, out, force=True, log=lambda m: None)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before  # untouched
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no partial directory left
    monkeypatch.setattr(exporter, "hf_tensors", real)
    (tmp_path / "nobias").mkdir()
    (tmp_path / "nobias" / "config.yaml").write_text("model: {family: gpt, use_bias: false}\n")
    with pytest.raises(ShardlmError, match="GPT without biases"):
        export(tmp_path / "nobias", tmp_path / "never", log=lambda m: None)
    shutil.rmtree(tmp_path / "nobias")
    # --force replaces a model directory, never the run itself, a directory holding it, or one of other files
    for where, why in ((run, "holds the run being exported"), (run.parent, "holds the run being exported"),
                       (tmp_path / "notes", "is not a model directory")):
        if where == tmp_path / "notes":
            where.mkdir()
            (where / "thesis.txt").write_text("a year of work")
        before = sorted(p.relative_to(where) for p in where.rglob("*"))
        with pytest.raises(ShardlmError, match=why):
            export(run, where, force=True, log=lambda m: None)
        assert sorted(p.relative_to(where) for p in where.rglob("*")) == before
    shutil.rmtree(tmp_path / "notes")
    proc = shardlm("export", str(run), "--out", str(out), "--cpu-devices", "8", "--force")
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert_one_line_error(shardlm("export", str(run), "--out", str(out)), "exists and is not empty")


# --- GPT-2's tokenizer, offline ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def gpt2_tiktoken_dir(tmp_path_factory, request):
    """A tiktoken cache holding GPT-2's ranks (r50k_base), put there from openai-whisper's source distribution on the
    package registry by shardlm's own `fetch_gpt2_ranks` (the gpt2 tokenizer's fallback), and kept in pytest's cache
    for later sessions."""
    cache = (request.config.cache.mkdir("gpt2-tiktoken") if getattr(request.config, "cache", None)
             else tmp_path_factory.mktemp("gpt2-tiktoken"))
    try:
        fetch_gpt2_ranks(cache, log=None)
    except RegistryFetchError as e:
        pytest.skip(f"the package registry did not give openai-whisper's source: {e}")
    return Path(cache)


def test_gpt2_tokenizer_prepares_trains_and_exports_offline(gpt2_tiktoken_dir, tmp_path, monkeypatch):
    """`data prepare --tokenizer gpt2` end to end on a TinyStories-format file, a run on it, and its export, whose
    Hugging Face tokenizer gives tiktoken's ids."""
    import tiktoken

    from conftest import make_stories, write_stories

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(gpt2_tiktoken_dir))
    stories = make_stories(400)
    write_stories(tmp_path / "ts.txt", stories)
    proc = shardlm("data", "prepare", str(tmp_path / "ts.txt"), "--tokenizer", "gpt2", "--out", str(tmp_path / "d"),
                   "--no-progress")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    enc = tiktoken.get_encoding("r50k_base")
    expected = sum(len(enc.encode_ordinary(s.strip())) + 1 for s in stories)
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257 and meta["dtype"] == "uint16"
    assert meta["splits"]["train"]["num_tokens"] + meta["splits"]["val"]["num_tokens"] == expected
    train_tokens = np.fromfile(tmp_path / "d" / "train.bin", np.uint16)
    assert train_tokens[0] == 50256 and list(train_tokens[1:6]) == enc.encode_ordinary(stories[0].strip())[:5]

    run = tmp_path / "run"
    train(load_config(None, [f"data.path={tmp_path / 'd'}", "model.n_layers=1", "model.d_model=32",
                             "model.d_mlp=64", "model.seq_len=32", "train.steps=2", "train.batch_size=8",
                             "train.eval_batches=1", "train.sample_tokens=0"]), run, progress=False)
    export(run, tmp_path / "export", log=lambda m: None)
    tok = AutoTokenizer.from_pretrained(tmp_path / "export")
    text = "Once upon a time, Zoë's café had 1,234 kites!\n  Tom's cat said: 'hello'."
    assert tok(text)["input_ids"] == enc.encode_ordinary(text) and tok.decode(enc.encode_ordinary(text)) == text
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 50256


def test_two_processes_export_and_import_like_one(trained, tmp_path):
    """`shardlm export` and `shardlm generate hf:DIR` as a run of 2 processes x 4 devices: each process gathers or
    reads its devices' shards; the files and the tokens are the ones a single process makes."""
    run = trained["llama"]
    export(run, tmp_path / "one", log=lambda m: None)
    launch = [sys.executable, "-m", "shardlm", "launch", "--processes", "2", "--cpu-devices", "4", "--log-dir",
              str(tmp_path / "logs"), "--"]
    proc = subprocess.run([*launch, "export", str(run), "--out", str(tmp_path / "two")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = load_file(str(tmp_path / "one" / "model.safetensors")), load_file(str(tmp_path / "two" /
                                                                                      "model.safetensors"))
    assert sorted(one) == sorted(two) and all(np.array_equal(one[k], two[k]) for k in one)
    gen = ["generate", f"hf:{tmp_path / 'two'}", "--prompt", "ROMEO:", "--max-tokens", "8", "--temperature", "0",
           "--json", *MESH]
    single = shardlm(gen[0], "--cpu-devices", "8", *gen[1:])
    double = subprocess.run([*launch, *gen], capture_output=True, text=True, timeout=300)
    assert single.returncode == 0 and double.returncode == 0, double.stderr[-3000:]
    assert json.loads(single.stdout)["text"] == json.loads(double.stdout)["text"]
