"""KV-cache generation: cached logits equal the full forward at every position, cached and naive decoding agree,
sharded decoding equals single-device decoding, sampling filters, stopping, bucketing, and `shardlm generate`."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlm.config import ModelConfig
from shardlm.generate import Generator, IncrementalText, bucket
from shardlm.mesh import make_mesh
from shardlm.models.gpt import GPT
from shardlm.sampling import Sampling, filter_logits
from shardlm.sharding import batch_sharding, replicated, state_shardings, use_mesh_rules

CFG = ModelConfig(n_layers=2, n_heads=4, d_model=64, d_mlp=128, seq_len=48)
VOCAB, PADDED = 100, 128
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [4]]  # buckets 16 and 32
SAMPLED = Sampling(temperature=0.9, top_k=50, top_p=0.95)


@pytest.fixture(scope="module")
def model():
    with nnx.use_eager_sharding(False):
        m = GPT(CFG, VOCAB, PADDED, nnx.Rngs(0))
    # GPT-2's init gives logits of ~0.1; scale the weights up so logits are O(1-10), as in a trained model, and a
    # tolerance of 1e-5 is a real bound.
    graphdef, state = nnx.split(m)
    return graphdef, jax.tree.map(lambda x: x * 3, state)


def one_device():
    return make_mesh(1, 1, 1, devices=jax.devices()[:1])


def placed(state, mesh):
    return jax.device_put(state, state_shardings(state, mesh))


def cached_vs_full(graphdef, state, mesh, tokens, lengths):
    """Prefill each row's first lengths[b] tokens (right-padded to a bucket), then feed the rest one token per
    step, each row at its own position; returns (cached logits, full-forward logits), both [rows, seq, vocab],
    with the cached ones at every position a cache produced them for (prefill positions < lengths[b])."""
    rows, seq = tokens.shape
    width = bucket(int(max(lengths)), seq)

    @jax.jit
    def run(state, tokens):
        model = nnx.merge(graphdef, state)
        with use_mesh_rules(mesh):
            full = model(tokens)
            # The prefill sees each prompt right-padded with zeros, as in generation: the cache slots past a prompt
            # hold garbage until decode overwrites them.
            prompt = jnp.where(jnp.arange(width) < jnp.asarray(lengths)[:, None], tokens[:, :width], 0)
            logits, cache = model.prefill(prompt, model.init_cache(rows))
            out = jnp.zeros_like(full).at[:, :width].set(logits)

            def step(carry, pos):  # pos [rows]: each row's next position; rows past the end recompute the last
                out, cache = carry
                at = jnp.minimum(pos, seq - 1)
                logits, cache = model.decode(jnp.take_along_axis(tokens, at[:, None], axis=1), at, cache)
                return (out.at[jnp.arange(rows), at].set(logits[:, 0]), cache), None

            first = jnp.asarray(lengths)
            (out, _), _ = jax.lax.scan(step, (out, cache), first + jnp.arange(seq - min(lengths))[:, None])
        return out, full

    cached, full = run(state, tokens)
    return np.asarray(cached)[..., :VOCAB], np.asarray(full)[..., :VOCAB]


@pytest.mark.parametrize("degrees", [(1, 1, 1), (2, 1, 4)], ids=["1 device", "data 2 x tensor 4"])
def test_cached_logits_equal_the_full_forward_at_every_position(model, degrees):
    graphdef, state = model
    n = int(np.prod(degrees))
    mesh = make_mesh(*degrees, devices=jax.devices()[:n])
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (4, CFG.seq_len), 0, VOCAB), np.int32)
    lengths = [5, 1, 17, 30]  # rows at different positions in every decode step
    cached, full = cached_vs_full(graphdef, placed(state, mesh), mesh, tokens, lengths)
    assert np.abs(full).max() > 5  # logits of a realistic size, so 1e-5 is a tight bound
    for b, length in enumerate(lengths):
        # Prefill positions of the prompt, then every decode position.
        np.testing.assert_allclose(cached[b], full[b], rtol=0, atol=1e-5, err_msg=f"row {b} (prompt {length})")


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), SAMPLED], ids=["greedy", "sampled"])
def test_decoding_with_and_without_the_cache_is_identical(model, sampling):
    graphdef, state = model
    mesh = one_device()
    runs = [Generator(graphdef, state, mesh, eot_id=-1, use_cache=c).generate(PROMPTS, 32, sampling, seed=3)
            for c in (True, False)]
    cached, naive = ([c.ids for c in run] for run in runs)
    assert cached == naive
    # Each row runs to the end of the context or 32 tokens.
    assert [len(ids) for ids in cached] == [32, 31, 32]
    assert [c.stop for c in runs[0]] == ["max_tokens", "context", "max_tokens"]


@pytest.fixture(scope="module")
def single_device_outputs(model):
    graphdef, state = model
    gen = Generator(graphdef, state, one_device(), eot_id=-1)
    return {s: [c.ids for c in gen.generate(PROMPTS, 20, s, seed=7)] for s in (Sampling(temperature=0), SAMPLED)}


# tensor 4 alone: the same split of the heads as data 2 x tensor 4's, without its replicas
@pytest.mark.parametrize("degrees", [(2, 1, 4), (1, 8, 1), (1, 2, 2)],
                         ids=["data 2 x tensor 4", "fsdp 8", "fsdp 2 x tensor 2"])
def test_sharded_generation_equals_single_device(model, single_device_outputs, degrees):
    graphdef, state = model
    n = int(np.prod(degrees))
    mesh = make_mesh(*degrees, devices=jax.devices()[:n])
    gen = Generator(graphdef, placed(state, mesh), mesh, eot_id=-1)
    for sampling, expected in single_device_outputs.items():
        assert [c.ids for c in gen.generate(PROMPTS, 20, sampling, seed=7)] == expected

    # The cache lives on the mesh as the activations do: rows over data x fsdp, heads over tensor.
    rows = gen.rows_multiple * 2
    prefill, _ = gen._compile(rows, 16, SAMPLED)
    by_row = jax.device_put(np.ones(rows, np.int32), gen.row_sharding)
    _, _, cache = prefill(gen.params, jax.device_put(np.ones((rows, 16), np.int32), batch_sharding(mesh)), by_row,
                          by_row, jax.device_put(np.uint32(0), replicated(mesh)))
    k = cache.k  # stacked over the layers: [layers, batch, heads, seq, head_dim]
    assert k.sharding.spec == P(None, ("data", "fsdp"), "tensor", None, None)
    assert k.addressable_shards[0].data.shape == (CFG.n_layers, rows // gen.rows_multiple,
                                                  CFG.n_heads // mesh.shape["tensor"], CFG.seq_len,
                                                  CFG.d_model // CFG.n_heads)


def test_a_sample_does_not_depend_on_its_batch(model):
    graphdef, state = model
    gen = Generator(graphdef, state, one_device(), eot_id=-1, max_batch=2)
    together = gen.generate([[1, 2, 3], [4, 5], [6]], 12, SAMPLED, seed=11)
    alone = gen.generate([[4, 5]], 12, SAMPLED, seed=11)[0]
    assert together[1].ids != alone.ids  # sample 1 in a batch is not sample 0 alone: its own random stream
    shifted = gen.generate([[9], [4, 5]], 12, SAMPLED, seed=11)[1]  # sample 1 again, with another neighbour
    assert shifted.ids == together[1].ids
    assert gen.generate([[4, 5]] * 2, 12, SAMPLED, seed=12)[1].ids != together[1].ids  # the seed matters


def test_generation_stops_at_the_end_of_text_token(model):
    graphdef, state = model
    mesh = one_device()
    free = Generator(graphdef, state, mesh, eot_id=-1).generate(PROMPTS[:1], 20, Sampling(temperature=0))[0].ids
    eot = free[5]
    first = free.index(eot)
    out = Generator(graphdef, state, mesh, eot_id=eot).generate(PROMPTS[:1], 20, Sampling(temperature=0))[0]
    assert out.ids == free[:first] and out.stop == "eot" and out.seconds > 0


def test_one_compile_per_prompt_length_bucket(model):
    graphdef, state = model
    gen = Generator(graphdef, state, one_device(), eot_id=-1)
    greedy = Sampling(temperature=0)
    for prompt in ([1, 2, 3], [1] * 9, [2] * 16):  # all in the 16-token bucket
        gen.generate([prompt], 5, greedy)
    assert len(gen._compiled) == 2  # one prefill, one decode step
    gen.generate([[3] * 17], 5, greedy)  # the 32-token bucket: a second prefill, the same decode step
    assert {key[:2] for key in gen._compiled} == {(1, 16), (1, 32), ("decode", 1)}
    assert [bucket(n, 48) for n in (1, 16, 17, 33, 47)] == [16, 16, 32, 48, 48]


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
    kept = lambda s: np.isfinite(np.asarray(filter_logits(logits, s)))[0].tolist()  # noqa: E731
    assert kept(Sampling(1.0, top_k=2)) == [True, True, False, False]
    assert kept(Sampling(1.0, top_k=0, top_p=0.7)) == [True, True, False, False]  # 0.5 + 0.25 reaches 0.7
    assert kept(Sampling(1.0, top_k=0, top_p=0.75)) == [True, True, False, False]  # exactly reached
    assert kept(Sampling(1.0, top_k=0, top_p=0.76)) == [True, True, True, False]
    assert kept(Sampling(1.0, top_k=0, top_p=0.1)) == [True, False, False, False]  # the likeliest always stays
    scaled = np.asarray(filter_logits(logits, Sampling(0.5, top_k=0)))
    np.testing.assert_allclose(scaled, (np.asarray(logits) - np.log(0.5)) * 2, rtol=1e-6, atol=1e-6)
    # A tiny temperature is greedy in effect, not NaN: the likeliest token keeps all the probability.
    tiny = np.asarray(jax.nn.softmax(filter_logits(logits, Sampling(1e-30, top_k=0, top_p=0.9))))
    assert tiny.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    for bad in (dict(top_p=0), dict(temperature=float("nan")), dict(temperature=-1), dict(top_k=-1)):
        with pytest.raises(Exception, match="top-p"):
            Sampling(**bad)


def test_streamed_text_holds_back_split_characters():
    from shardlm.data.tokenizer import ByteTokenizer

    out = []
    stream = IncrementalText(ByteTokenizer(), out.append)
    for b in "añ€!".encode():  # 1-, 2- and 3-byte characters, one byte per token
        stream.add(b)
    stream.flush()
    assert out == ["a", "ñ", "€", "!"]


# --- the command line --------------------------------------------------------------------------------------------

RUN = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.d_mlp=128", "model.seq_len=64",
       "train.batch_size=16", "train.steps=40", "train.warmup_steps=5", "train.lr=3e-3", "train.eval_interval=40",
       "train.eval_batches=1", "train.sample_tokens=24", "data.tokenizer=bytes", "checkpoint.every=0"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from shardlm.config import load_config
    from shardlm.train.loop import train

    path = tmp_path_factory.mktemp("gen") / "run"
    train(load_config(None, RUN), path, progress=False)
    return path


def gen_json(capsys, *args):
    from shardlm.cli import main

    assert main(["generate", *map(str, args), "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_training_ends_with_samples_from_the_same_decoder(run_dir):
    samples = (run_dir / "samples.txt").read_text().split("\n\n-----\n\n")
    assert len(samples) == 2 and all(s.strip() for s in samples)


def test_generate_cli_json_streaming_and_the_naive_decoder(run_dir, capsys, tmp_path):
    from shardlm.cli import main

    greedy = ["--prompt", "ROMEO:", "--max-tokens", "20", "--temperature", "0"]
    [cached] = gen_json(capsys, run_dir, *greedy)
    assert set(cached) >= {"prompt", "text", "new_tokens", "tokens_per_s"} and cached["prompt"] == "ROMEO:"
    assert cached["new_tokens"] == len(cached["text"].encode()) <= 20 and cached["tokens_per_s"] > 0
    [naive] = gen_json(capsys, run_dir, *greedy, "--no-cache")
    assert naive["text"] == cached["text"]
    # The streamed text is the prompt and the same continuation; the timing line goes to stderr.
    assert main(["generate", str(run_dir), *greedy]) == 0
    out = capsys.readouterr()
    assert out.out == "ROMEO:" + cached["text"] + "\n" and "tokens/s, KV cache" in out.err

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("First Citizen:\n\nKING:\n")
    rows = gen_json(capsys, run_dir, "--prompts-file", prompts, "--num-samples", "3", "--max-tokens", "12",
                    "--top-p", "0.9", "--seed", "4")
    assert [r["prompt"] for r in rows] == ["First Citizen:"] * 3 + ["KING:"] * 3
    assert len({r["text"] for r in rows[:3]}) > 1  # three different samples of one prompt
    assert all(r["new_tokens"] <= 12 for r in rows)


def test_generate_on_a_tensor_parallel_mesh_equals_the_run_mesh(run_dir, capsys):
    args = [run_dir, "--prompt", "ROMEO:", "--max-tokens", "16", "--seed", "2", "--num-samples", "2"]
    texts = lambda *more: [r["text"] for r in gen_json(capsys, *args, *more)]  # noqa: E731
    assert texts("mesh.tensor=4") == texts()  # the run's mesh is data 8


def test_generate_prompt_errors_and_truncation(run_dir, capsys):
    from shardlm.cli import main

    long = "x" * 100  # 100 byte tokens, context 64
    assert main(["generate", str(run_dir), "--prompt", long]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "100 tokens and the model's context is 64" in err and "--truncate" in err
    [row] = gen_json(capsys, run_dir, "--prompt", long, "--truncate", "--max-tokens", "10", "--temperature", "0")
    assert row["prompt_tokens"] == 54 and row["new_tokens"] <= 10
    # A prompt that fits is never cut, whatever --max-tokens asks (it stops at the end of the context instead).
    [row] = gen_json(capsys, run_dir, "--prompt", "ROMEO:", "--truncate", "--max-tokens", "3000000000")
    assert row["prompt_tokens"] == 6 and (row["stop"] == "eot" or row["new_tokens"] == 64 - 6)
    assert main(["generate", str(run_dir), "--prompt", "a", "--top-p", "1.5"]) == 2
    assert "top-p" in capsys.readouterr().err


def test_prompts_file_errors_name_the_line(run_dir, capsys, tmp_path):
    from shardlm.cli import main

    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\n\n\n{"text": "b"}\n')
    notutf8 = tmp_path / "p.txt"
    notutf8.write_bytes(b"ok\n\xff\xfe")
    for path, fragment in ((bad, f"line 4 of {bad} is not a JSON object"), (notutf8, "is not UTF-8 text (byte 3)"),
                           (tmp_path, "is not a file")):
        assert main(["generate", str(run_dir), "--prompts-file", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err, err
