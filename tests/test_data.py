import jax
import numpy as np
import pytest

from shardlm.data.corpus import load_corpus, shakespeare
from shardlm.data.loader import BatchLoader, TokenWindows
from shardlm.data.tokenizer import EOT, Tokenizer, byte_tokenizer, train_bpe
from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh
from shardlm.sharding import batch_sharding


def test_builtin_corpus_is_shakespeare():
    text = shakespeare()
    assert len(text) > 4_000_000
    assert "HAMLET:" in text and "To be, or not to be" in text
    assert "**" not in text  # Markdown markup is rewritten


def test_corpus_from_file_and_errors(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world\n")
    assert load_corpus(str(f)) == "hello world\n"
    with pytest.raises(ShardlmError, match="neither a built-in corpus"):
        load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ShardlmError, match="not UTF-8"):
        load_corpus(str(tmp_path / "bin"))


def test_bpe_round_trip_and_save(tmp_path):
    text = ("Once upon a time there was a little fox. " * 50 + f"\n{EOT}\n") * 20
    tok = train_bpe(text, 300)
    assert tok.vocab_size <= 300 and tok.eot_id == 0
    ids = tok.encode("Once upon a time, café")
    assert tok.decode(ids) == "Once upon a time, café"
    assert tok.encode(EOT) == [tok.eot_id]
    tok.save(tmp_path / "tok.json")
    again = Tokenizer.load(tmp_path / "tok.json")
    assert again.encode("little fox") == tok.encode("little fox")
    np.testing.assert_array_equal(tok.encode_corpus(text, chunk_chars=100), np.asarray(tok.encode(text)))


def test_byte_tokenizer():
    tok = byte_tokenizer()
    assert tok.vocab_size == 257
    s = "naïve text\n"
    ids = tok.encode(s)
    assert len(ids) == len(s.encode()) and tok.decode(ids) == s


def test_windows_and_batches_are_deterministic_and_sharded():
    tokens = np.arange(1000, dtype=np.int32)
    w = TokenWindows(tokens, 8)
    assert len(w) == 124
    np.testing.assert_array_equal(w[3], np.arange(24, 33))
    mesh = make_mesh(2, 2, 2)
    a = BatchLoader(tokens, 8, 8, batch_sharding(mesh), seed=1, shuffle=True)
    b = BatchLoader(tokens, 8, 8, batch_sharding(mesh), seed=1, shuffle=True)
    x = a.get(5)
    assert x.shape == (8, 9) and x.sharding.spec[0] == ("data", "fsdp")
    assert x.addressable_shards[0].data.shape == (2, 9)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(b.get(5)))
    rows = np.asarray(x)
    np.testing.assert_array_equal(rows[:, 1:] - rows[:, :-1], 1)  # each row is a contiguous window
    # One epoch visits every window exactly once.
    starts = np.concatenate([np.asarray(a.get(i))[:, 0] for i in range(124 // 8)])
    assert len(set(starts.tolist())) == len(starts)
    assert not np.array_equal(np.asarray(a.get(0)), np.asarray(BatchLoader(
        tokens, 8, 8, batch_sharding(mesh), seed=2, shuffle=True).get(0)))


def test_too_little_data_is_a_clear_error():
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    with pytest.raises(ShardlmError, match="fewer than one batch"):
        BatchLoader(np.arange(50, dtype=np.int32), 8, 16, batch_sharding(mesh), seed=0, shuffle=False)
