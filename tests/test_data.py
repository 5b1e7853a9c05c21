"""Tokenizers, document sources and the Grain loader."""

import json
import threading
import time

import jax
import numpy as np
import pytest

from conftest import make_stories, write_stories
from shardlm.data.corpus import shakespeare_plays
from shardlm.data.loader import BatchLoader, TokenWindows, process_rows
from shardlm.data.sources import ReadStats, read_documents, resolve_inputs
from shardlm.data.tokenizer import (EOT, ByteTokenizer, TiktokenTokenizer, gpt2_tokenizer, load_tokenizer,
                                    train_bpe)
from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh
from shardlm.sharding import batch_sharding


def docs_of(paths, **kw):
    stats = ReadStats()
    return list(read_documents(resolve_inputs([str(p) for p in paths]), stats, **kw)), stats


# --- tokenizers -------------------------------------------------------------------------------------------------


def test_builtin_corpus_is_shakespeare_one_play_per_document():
    plays = shakespeare_plays()
    assert len(plays) >= 36 and sum(map(len, plays)) > 4_000_000
    hamlet = [p for p in plays if "HAMLET:" in p]
    assert len(hamlet) == 1 and "To be, or not to be" in hamlet[0]
    assert not any("**" in p for p in plays)  # Markdown markup is rewritten


def test_bpe_round_trip_save_load_and_token_bytes(tmp_path):
    docs = ["Once upon a time there was a little fox. " * 50] * 20
    tok = train_bpe(docs, 300)
    assert tok.vocab_size <= 300 and tok.spec == "bpe"
    text = "Once upon a time, café ☃"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(EOT) == [tok.eot_id]
    # Byte lengths of the tokens add up to the UTF-8 length of the text; the separator spells no bytes.
    tb = tok.token_bytes()
    assert tb[ids].sum() == len(text.encode()) and tb[tok.eot_id] == 0
    tok.save(tmp_path)
    for again in (load_tokenizer("bpe", tmp_path), load_tokenizer(f"bpe:{tmp_path / 'tokenizer.json'}")):
        assert again.encode("little fox") == tok.encode("little fox")
    [batch_ids] = tok.encode_batch([text])
    np.testing.assert_array_equal(batch_ids, ids)
    with pytest.raises(ShardlmError, match="does not exist"):
        load_tokenizer(f"bpe:{tmp_path / 'missing.json'}")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ShardlmError, match="not a Hugging Face tokenizer file"):
        load_tokenizer(f"bpe:{tmp_path / 'bad.json'}")


def test_byte_tokenizer_ids_are_bytes():
    tok = ByteTokenizer()
    s = "naïve text\n"
    assert tok.encode(s) == list(s.encode()) and tok.vocab_size == 257 and tok.eot_id == 256
    assert tok.encode(f"a{EOT}b") == [97, 256, 98]
    assert tok.decode(tok.encode(f"é{EOT}z")) == f"é{EOT}z"
    np.testing.assert_array_equal(tok.encode_batch([s])[0], np.frombuffer(s.encode(), np.uint8))
    assert tok.token_bytes().sum() == 256


def test_tiktoken_wrapper_on_an_offline_encoding():
    """The real tiktoken code path, on a byte-level encoding with one merge (GPT-2's files need the network)."""
    import tiktoken

    ranks = {bytes([i]): i for i in range(256)} | {b"th": 256}
    enc = tiktoken.Encoding("test", pat_str=r"""'s|\w+| ?[^\s\w]+|\s+""", mergeable_ranks=ranks,
                            special_tokens={EOT: 257})
    tok = TiktokenTokenizer(enc, spec="test")
    assert tok.vocab_size == 258 and tok.eot_id == 257
    ids = tok.encode(f"the{EOT}")
    assert ids == [256, ord("e"), 257] and tok.decode(ids) == f"the{EOT}"
    [ordinary] = tok.encode_batch([f"the{EOT}"])  # corpus text: the separator string is just text
    assert 257 not in ordinary.tolist()
    tb = tok.token_bytes()
    assert tb[256] == 2 and tb[257] == 0 and tb[:256].tolist() == [1] * 256


def test_gpt2_offline_is_a_clear_error_not_a_hang(monkeypatch, tmp_path):
    import tiktoken

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))

    def unreachable(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.setattr(tiktoken, "get_encoding", unreachable)
    with pytest.raises(ShardlmError, match="TIKTOKEN_CACHE_DIR") as e:
        load_tokenizer("gpt2")
    assert str(tmp_path) in str(e.value) and "ConnectionError" in str(e.value) and "bytes" in str(e.value)

    hang = threading.Event()
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: hang.wait(60))
    t0 = time.perf_counter()
    with pytest.raises(ShardlmError, match="no answer in 0s"):
        gpt2_tokenizer(timeout_s=0.3)
    assert time.perf_counter() - t0 < 5
    hang.set()


# --- sources ----------------------------------------------------------------------------------------------------


def test_tinystories_layout_splits_on_separator_lines(tmp_path):
    stories = make_stories(50)
    write_stories(tmp_path / "ts.txt", stories)
    docs, stats = docs_of([tmp_path / "ts.txt"])
    assert docs == stories and stats.documents == 50 and stats.empty_skipped == 0
    assert stats.text_bytes == sum(len(s.encode()) for s in stories)
    # No trailing separator, an empty story between two separators, Windows line ends.
    (tmp_path / "b.txt").write_bytes(b"one\r\n<|endoftext|>\r\n\r\n<|endoftext|>\r\ntwo")
    docs, stats = docs_of([tmp_path / "b.txt"])
    assert docs == ["one", "two"] and stats.empty_skipped == 1


def test_plain_text_jsonl_parquet_and_folders(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "book.txt").write_text("A whole book.\n\nWith paragraphs.\n")
    (tmp_path / "d" / "skip.md").write_text("not read: not a text suffix")
    lines = [{"text": "first doc", "id": 1}, {"text": f"second{EOT}third"}, {"text": "  "}]
    (tmp_path / "d" / "sub").mkdir()
    (tmp_path / "d" / "sub" / "x.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    pq.write_table(pa.table({"text": ["pq one", None, "pq two"]}), tmp_path / "d" / "shard.parquet")
    docs, stats = docs_of([tmp_path / "d"])
    # Sorted paths: book.txt, shard.parquet, sub/x.jsonl.
    assert docs == ["A whole book.\n\nWith paragraphs.", "pq one", "pq two", "first doc", "second", "third"]
    assert stats.documents == 6 and stats.empty_skipped == 2  # the null and the blank JSONL text

    pq.write_table(pa.table({"story": ["x"]}), tmp_path / "other.parquet")
    with pytest.raises(ShardlmError, match="has no 'text' column \\(columns: story\\)"):
        docs_of([tmp_path / "other.parquet"])
    assert docs_of([tmp_path / "other.parquet"], text_field="story")[0] == ["x"]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ShardlmError, match="bad.jsonl:2 is not valid JSON"):
        docs_of([tmp_path / "bad.jsonl"])


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(ShardlmError, match="input .*nope.txt does not exist"):
        resolve_inputs([str(tmp_path / "nope.txt")])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ShardlmError, match="empty.txt is an empty file"):
        resolve_inputs([str(tmp_path / "empty.txt")])
    (tmp_path / "dir").mkdir()
    with pytest.raises(ShardlmError, match="holds no .txt"):
        resolve_inputs([str(tmp_path / "dir")])


def test_invalid_utf8_fails_at_its_offset_or_is_replaced_and_counted(tmp_path):
    good = "story one\n<|endoftext|>\nstory two ".encode()
    (tmp_path / "bad.txt").write_bytes(good + b"\xff\xfe ok\n<|endoftext|>\nfine \xc3\n")
    with pytest.raises(ShardlmError, match=f"bad.txt is not valid UTF-8 at byte offset {len(good)} "):
        docs_of([tmp_path / "bad.txt"])
    docs, stats = docs_of([tmp_path / "bad.txt"], invalid_utf8="replace")
    assert docs == ["story one", "story two \ufffd\ufffd ok", "fine \ufffd"]
    assert stats.invalid_utf8_replaced == 3


# --- loader -----------------------------------------------------------------------------------------------------


def test_windows_and_batches_are_deterministic_and_sharded():
    tokens = np.arange(1000, dtype=np.uint16)
    w = TokenWindows(tokens, 8)
    assert len(w) == 124
    np.testing.assert_array_equal(w[3], np.arange(24, 33))
    assert w[3].dtype == np.int32
    mesh = make_mesh(2, 2, 2)
    a = BatchLoader(tokens, 8, 8, batch_sharding(mesh), seed=1, shuffle=True)
    b = BatchLoader(tokens, 8, 8, batch_sharding(mesh), seed=1, shuffle=True)
    x = a.get(5)
    assert x.shape == (8, 9) and x.sharding.spec[0] == ("data", "fsdp")
    assert x.addressable_shards[0].data.shape == (2, 9)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(b.get(5)))
    rows = np.asarray(x)
    np.testing.assert_array_equal(rows[:, 1:] - rows[:, :-1], 1)  # each row is a contiguous window
    # One epoch visits every window exactly once; the next epoch is another order.
    epoch = np.concatenate([np.asarray(a.get(i))[:, 0] for i in range(124 // 8)])
    assert len(set(epoch.tolist())) == len(epoch)
    assert not np.array_equal(a.windows[0], a.windows[124])
    assert not np.array_equal(np.asarray(a.get(0)), np.asarray(BatchLoader(
        tokens, 8, 8, batch_sharding(mesh), seed=2, shuffle=True).get(0)))
    # The iterator yields the same batches as random access.
    it = a.iterator()
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(next(it)), np.asarray(a.get(i)))


def test_restored_iterator_yields_exactly_the_next_batches():
    tokens = np.arange(5000, dtype=np.uint16)
    mesh = make_mesh(4, 2, 1)

    def loader():
        return BatchLoader(tokens, 16, 8, batch_sharding(mesh), seed=7, shuffle=True)

    straight = loader().iterator()
    for _ in range(45):  # 312 windows = 39 batches per epoch: stop inside the second epoch
        next(straight)
    state = json.loads(json.dumps(straight.get_state()))  # it survives a JSON round trip (a checkpoint)
    expected = [np.asarray(next(straight)) for _ in range(6)]
    resumed = loader().iterator()
    resumed.set_state(state)
    got = [np.asarray(next(resumed)) for _ in range(6)]
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e, g)
    assert not np.array_equal(expected[0], np.asarray(next(loader().iterator())))


def test_two_processes_read_disjoint_shards_that_cover_the_epoch():
    """Two processes, each holding half of the batch rows (as `process_rows` gives them on a 2-host mesh)."""
    seq, batch, windows = 8, 8, 64
    tokens = np.arange(windows * seq + 1, dtype=np.uint32)
    procs = [BatchLoader(tokens, seq, batch, None, seed=3, shuffle=True, rows=range(p * 4, p * 4 + 4))
             for p in range(2)]
    whole = BatchLoader(tokens, seq, batch, None, seed=3, shuffle=True, rows=range(batch))
    seen = [set(), set()]
    for i in range(windows // batch):
        parts = [loader.local[i] for loader in procs]
        assert all(p.shape == (batch // 2, seq + 1) for p in parts)
        # Process 0 holds the first half of the global batch's rows, process 1 the second.
        np.testing.assert_array_equal(np.concatenate(parts), whole.local[i])
        for p, part in enumerate(parts):
            seen[p] |= set((part[:, 0] // seq).tolist())
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(windows))


def test_process_rows_come_from_the_sharding():
    mesh = make_mesh(2, 2, 2)
    assert process_rows(batch_sharding(mesh), 16, 33) == range(16)  # one process holds every row
    shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    one_device = {d: i for d, i in shard.addressable_devices_indices_map((16, 33)).items() if d.id == 3}

    class OneDevice:  # what process_rows sees on a host that owns only device 3
        def addressable_devices_indices_map(self, shape):
            return one_device

    rows = process_rows(OneDevice(), 16, 33)
    assert len(rows) == 4 and rows.start % 4 == 0


def test_too_little_data_is_a_clear_error():
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    with pytest.raises(ShardlmError, match="fewer than one batch"):
        BatchLoader(np.arange(50, dtype=np.int32), 8, 16, batch_sharding(mesh), seed=0, shuffle=False)


def test_bom_and_unpaired_surrogates(tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfFirst story.\n<|endoftext|>\nSecond.\n")
    assert docs_of([tmp_path / "bom.txt"])[0] == ["First story.", "Second."]
    (tmp_path / "s.jsonl").write_text('{"text": "ok"}\n{"text": "a\\ud800b"}\n')
    with pytest.raises(ShardlmError, match="s.jsonl:2 holds an unpaired surrogate \\(\\\\ud800\\)"):
        docs_of([tmp_path / "s.jsonl"])
    docs, stats = docs_of([tmp_path / "s.jsonl"], invalid_utf8="replace")
    assert docs == ["ok", "a\ufffdb"] and stats.invalid_utf8_replaced == 1
