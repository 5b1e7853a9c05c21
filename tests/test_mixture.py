"""Data mixtures (`data.sources`, `shardlm.data.mixture`): the stream follows the weights, each process reads its rows
of it, a resumed iterator continues it exactly, small sources repeat reshuffled, each source is evaluated and
logged on its own, and bad mixtures are one line. (Exact resumption of whole runs on a mixture, on 8 devices and
on 2 processes x 4: test_checkpoint and test_multihost, whose runs train on `conftest.MIXTURE`.)"""

import struct
from fractions import Fraction
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlm.config import load_config
from shardlm.data.loader import BatchLoader
from shardlm.data.mixture import windows_per_source
from shardlm.errors import ShardlmError
from shardlm.train.evaluation import epochs_seen

SEQ, BATCH = 16, 32
WEIGHTS = [0.6, 0.3, 0.1]
# three sources whose tokens say where they come from: source i holds i * 100000 + its position
SIZES = [20_000, 6_000, 500]


def _loader(rows=None):
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    tokens = [np.arange(i * 100_000, i * 100_000 + n, dtype=np.int32) for i, n in enumerate(SIZES)]
    return BatchLoader(tokens, SEQ, BATCH, NamedSharding(mesh, P("d")), seed=3, shuffle=True, weights=WEIGHTS,
                       names=["web", "code", "notes"], rows=rows)


def test_three_sources_follow_their_weights_and_processes_and_resumes_read_the_same_stream():
    full = _loader()
    batches = [np.asarray(full.local[i]) for i in range(63)]  # 2,016 sequences
    source = np.concatenate([b[:, 0] // 100_000 for b in batches])[:2000]
    shares = np.bincount(source, minlength=3) / len(source)
    assert np.all(np.abs(shares - WEIGHTS) <= 0.001), shares  # within a window of 2,000, not sampled
    assert windows_per_source([(0, WEIGHTS)], 2000) == np.bincount(source, minlength=3).tolist()
    # two processes, each reading its half of every global batch: together, the one-process batches
    halves = [_loader(rows=range(0, 16)), _loader(rows=range(16, 32))]
    for i in (0, 7, 62):
        assert np.array_equal(np.concatenate([np.asarray(h.local[i]) for h in halves]), batches[i])
    # an iterator stopped at batch 5 and a new one sought there continue with the same tokens
    it = full.iterator(prefetch=0)
    for _ in range(5):
        next(it)
    resumed = _loader().iterator(prefetch=0)
    resumed.seek(it.position)
    assert it.position == 5 and all(np.array_equal(np.asarray(next(resumed)), batches[i]) for i in range(5, 9))


def test_new_weights_on_resume_are_followed_from_that_batch_and_each_source_continues_its_stream():
    """Annealing: weights 0.5/0.5/0 for 10 batches, then 0.8/0.1/0.1. The first 10 batches are the unchanged
    mixture's, token for token; from batch 10 on the shares are the new weights'; each source's windows over the
    whole run are its own stream's, in order, none repeated or skipped across the change."""
    from shardlm.data.loader import TokenWindows
    from shardlm.data.mixture import shuffled_windows

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    tokens = [np.arange(i * 100_000, i * 100_000 + n, dtype=np.int32) for i, n in enumerate(SIZES)]

    def loader(schedule):
        return BatchLoader(tokens, SEQ, BATCH, NamedSharding(mesh, P("d")), seed=3, shuffle=True, schedule=schedule)

    before = loader([(0, [0.5, 0.5, 0.0])])
    annealed = loader([(0, [0.5, 0.5, 0.0]), (10 * BATCH, [0.8, 0.1, 0.1])])
    batches = [np.asarray(annealed.local[i]) for i in range(73)]
    assert all(np.array_equal(batches[i], np.asarray(before.local[i])) for i in range(10))
    after = np.concatenate([b[:, 0] // 100_000 for b in batches[10:]])[:2000]
    assert np.all(np.abs(np.bincount(after, minlength=3) / 2000 - [0.8, 0.1, 0.1]) <= 0.02)
    for i in range(3):
        seen = [int(s) for b in batches for s in b[:, 0] if s // 100_000 == i]
        own = shuffled_windows(TokenWindows(tokens[i], SEQ), 3 + i, True)
        assert seen == [int(own[m][0]) for m in range(len(seen))], i
    assert windows_per_source([(0, [0.5, 0.5, 0.0]), (10 * BATCH, [0.8, 0.1, 0.1])], 73 * BATCH) == [
        int(np.sum(np.concatenate([b[:, 0] for b in batches]) // 100_000 == i)) for i in range(3)]


def test_a_small_source_repeats_reshuffled_and_its_epochs_are_counted():
    """`notes` holds 31 windows and gives a tenth of the stream: each epoch is all its windows once, in a new
    order each time; `epochs_seen` reads the count off the stream's indices."""
    full = _loader()
    starts = [int(s) for i in range(63) for s in np.asarray(full.local[i])[:, 0] if s >= 200_000]
    per_epoch = full.windows_per_source_epoch[2]
    assert per_epoch == (SIZES[2] - 1) // SEQ == 31 and len(starts) > 3 * per_epoch
    epochs = [starts[k * per_epoch:(k + 1) * per_epoch] for k in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs) and len(set(epochs[0])) == per_epoch
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled
    from shardlm.data.mixture import Source

    seen = epochs_seen([Source("web", "", 0.6), Source("code", "", 0.3), Source("notes", "", 0.1)],
                       full.windows_per_source_epoch, 63 * BATCH)
    assert seen["epochs/notes"] == pytest.approx(len(starts) / per_epoch)


@pytest.mark.parametrize("weights", [[1, 1.0099], [0.3, 0.3, 0.4]])
def test_each_source_is_within_a_window_of_its_share_at_every_prefix(weights):
    """Over 200,000 windows, at every prefix, each source's count is within one window of its weight's share
    (Grain's mix, which quantizes the weights, gave [1, 1.0099] 0.5/0.5: about 500 windows off); the counts read
    off the indices (`windows_per_source`, what epochs and `data inspect` report) are the stream's own."""
    from shardlm.data.mixture import Interleave

    n, interleave = 200_000, Interleave(weights)
    picks = [interleave[j] for j in range(n)]
    sources = np.array([i for i, _ in picks])
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[sources], axis=0)  # [n, sources]
    ideal = np.arange(1, n + 1)[:, None] * (np.array(weights) / sum(weights))
    assert np.abs(counts - ideal).max() < 1, np.abs(counts - ideal).max()
    # each source's windows are its own stream's, in order: the m-th window a source gives is its window m
    for i in range(len(weights)):
        assert [m for s, m in picks if s == i] == list(range(int(counts[-1, i])))
    for prefix in (1, 2, 3, 999, 123_457, n):
        assert windows_per_source([(0, weights)], prefix) == counts[prefix - 1].tolist()


@given(st.lists(st.floats(1e-6, 1e6), min_size=2, max_size=9), st.integers(0, 10**15))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_any_weights_stay_within_the_interleaves_bound_at_every_prefix(weights, start):
    """For any float weights: every prefix of the first 3,000 windows, and of 3,000 windows from anywhere in the
    stream (`start`, read by index as a resumed run reads them), keeps each source within the tree's bound of its
    share, which is under one window for up to four sources; the index of a window in its source's stream is that
    source's count before it."""
    from shardlm.data.mixture import Interleave

    interleave = Interleave(weights)
    bound = interleave.worst_deviation()
    if len(weights) <= 4:
        assert bound < 1
    shares = [Fraction(w) / sum(map(Fraction, weights)) for w in weights]
    counts = interleave.counts(start)
    for j in range(start, start + 3000):
        i, m = interleave[j]
        assert m == counts[i]
        counts[i] += 1
        assert max(abs(c - (j + 1) * s) for c, s in zip(counts, shares)) <= bound + 1e-9
    assert counts == interleave.counts(start + 3000)


def test_a_batch_of_one_row_reads_the_stream_plain_or_mixed():
    """`train.batch_size=1`, or a process holding one row of the global batch (two processes of one device at
    batch 2, or the context axis at batch 1) read the stream like any batch: Grain once computed a batch of one of
    an endless stream's length in floating point (2^63) and overflowed an index."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    tokens = [np.arange(i * 100_000, i * 100_000 + n, dtype=np.int32) for i, n in enumerate(SIZES)]
    for parts, weights in ((tokens[0], None), (tokens, WEIGHTS)):
        def loader(batch, rows=None):
            return BatchLoader(parts, SEQ, batch, NamedSharding(mesh, P("d")), seed=3, shuffle=True,
                               weights=weights, rows=rows)

        two = loader(2)
        ones, halves = loader(1), [loader(2, range(0, 1)), loader(2, range(1, 2))]
        for i in (0, 1, 5):
            expected = np.asarray(two.local[i])
            assert np.array_equal(np.concatenate([np.asarray(ones.local[2 * i]), np.asarray(ones.local[2 * i + 1])]),
                                  expected)
            assert np.array_equal(np.concatenate([np.asarray(h.local[i]) for h in halves]), expected)
        it = ones.iterator(prefetch=0)
        assert np.array_equal(np.asarray(next(it)), np.asarray(ones.local[0])) and it.position == 1


@pytest.mark.parametrize("sources, message", [
    ("[{path: a.txt, weight: 0}, {path: b.txt, weight: 0}]", "weights sum to 0"),
    ("[{path: a.txt, weight: -0.5}]", "has weight -0.5; a weight is a number >= 0"),
    ("[{path: a.txt, weight: 1}, {path: b/a.txt, weight: 1}]", "names ['a'] more than one source"),
    ("[{weight: 1}]", "must be {path: ..., weight: ...} with a path"),
])
def test_a_bad_mixture_is_one_line(sources, message):
    with pytest.raises(ShardlmError, match=None) as e:
        load_config(None, [f"data.sources={sources}"])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_data_path_beside_sources_is_one_line_not_ignored():
    """A mixture reads its sources alone: a data.path given beside them (in a new run, or on resuming a mixture run,
    which once said `changed: data.path` and trained on the sources) is refused, not ignored."""
    sources = "data.sources=[{path: a.txt, weight: 1}]"
    for base in (None, {"data": {"sources": [{"path": "a.txt", "weight": 1}]}}):  # a run's saved config
        with pytest.raises(ShardlmError, match=r"data.path=b.txt and data.sources both name the training data"):
            load_config(None, ["data.path=b.txt"] + ([] if base else [sources]), base=base)


def test_sources_with_different_tokenizers_or_without_validation_text_stop_before_the_run(tmp_path):
    from shardlm.data.prepare import prepare
    from shardlm.train.loop import train

    text = tmp_path / "notes.txt"
    text.write_text("a small note about nothing much. " * 400)
    prepare([str(text)], tmp_path / "as-bytes", tokenizer="bytes", vocab_size=0, val_fraction=0.05,
            text_field="text", invalid_utf8="error", force=True, progress=False, log=lambda m: None)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short to hold a validation batch. " * 40)
    base = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_mlp=64", "model.seq_len=32",
            "train.batch_size=8", "train.steps=2", "train.sample_tokens=0", "data.tokenizer=auto"]
    cases = [(f"[{{path: shakespeare}}, {{path: '{tmp_path / 'as-bytes'}'}}]",
              "is tokenized with the bytes tokenizer, shakespeare with the BPE of"),
             (f"[{{path: shakespeare, weight: 0.9}}, {{name: tiny, path: '{tiny}', weight: 0.1}}]",
              "the tiny source's validation split holds"),
             (f"[{{path: shakespeare}}, {{name: notes, path: '{tmp_path / 'gone.txt'}'}}]",
              f"data.sources[1] (notes) {tmp_path / 'gone.txt'} does not exist")]
    for sources, message in cases:
        run_dir = tmp_path / "run"
        with pytest.raises(ShardlmError) as e:
            train(load_config(None, base + [f"data.sources={sources}"]), run_dir, progress=False)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert not run_dir.exists()  # nothing written


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a run's TensorBoard event files: tag -> [(step, value)], read from the TFRecord framing."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list] = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_each_source_is_evaluated_and_logged(tmp_path, capsys):
    """A run on the two-source mixture logs each source's eval loss and bits per byte, and its epochs, in
    metrics.jsonl and TensorBoard; the mixture's eval loss is their mean by the training weights."""
    import json

    from conftest import MICRO, MIXTURE
    from shardlm.train.loop import train

    run_dir = tmp_path / "run"
    train(load_config(None, MICRO + [MIXTURE, "data.tokenizer=bytes", "train.steps=4", "train.eval_interval=2",
                                     "train.eval_batches=2", "train.sample_tokens=0"]), run_dir, progress=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    (last,) = [line for line in capsys.readouterr().out.splitlines() if " (first " in line]  # the run's last line
    end = evals[-1]
    assert last.endswith(f"bits/byte (plays {end['eval_loss/plays']:.4f}, docs {end['eval_loss/docs']:.4f})")
    for r in evals:
        assert r["eval_loss"] == pytest.approx(0.75 * r["eval_loss/plays"] + 0.25 * r["eval_loss/docs"])
        assert r["eval_bpb/plays"] > 0 and r["eval_bpb/docs"] > 0
    assert evals[-1]["eval_loss/docs"] < evals[0]["eval_loss/docs"]
    assert evals[0]["epochs/plays"] == 0 and 0 < evals[-1]["epochs/docs"] and evals[-1]["epochs/plays"] > 0
    scalars = tensorboard_scalars(run_dir)
    for tag in ("eval_loss/plays", "eval_loss/docs", "eval_bpb/docs", "epochs/docs"):
        assert [s for s, _ in scalars[tag]] == [0, 2, 4], tag
        assert [v for _, v in scalars[tag]] == pytest.approx([r[tag] for r in evals], rel=1e-6), tag
    # annealing: resumed at step 4 with the weights turned around, trained to step 8 by them, the change recorded
    annealed = MIXTURE.replace("0.75", "w1").replace("0.25", "0.75").replace("w1", "0.25")
    summary = train(load_config(None, MICRO + [annealed, "data.tokenizer=bytes", "train.steps=8",
                                               "train.eval_interval=2", "train.eval_batches=2",
                                               "train.sample_tokens=0"]), run_dir, progress=False)
    assert summary["resumed_from"] == 4
    assert summary["data_schedule"] == [[0, {"plays": 0.75, "docs": 0.25}], [4, {"plays": 0.25, "docs": 0.75}]]
    assert set(summary["data"]) == {"plays", "docs"} and all(Path(p).is_dir() for p in summary["data"].values())
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert rows[8]["eval_loss"] == pytest.approx(0.25 * rows[8]["eval_loss/plays"] + 0.75 * rows[8]["eval_loss/docs"])
    windows = lambda step, name: rows[step][f"epochs/{name}"] * full_epoch[name]  # noqa: E731
    full_epoch = {name: 1 / (rows[2][f"epochs/{name}"] / (2 * 16 * share))
                  for name, share in (("plays", 0.75), ("docs", 0.25))}  # windows per epoch, from steps 1-2
    assert windows(8, "docs") - windows(4, "docs") == pytest.approx(4 * 16 * 0.75, abs=1)
    assert windows(8, "plays") - windows(4, "plays") == pytest.approx(4 * 16 * 0.25, abs=1)


def test_data_inspect_reports_each_sources_tokens_share_and_epochs(tmp_path, capsys):
    """`shardlm data inspect`: three sources at 0.6/0.3/0.1, their shares of the first 63 batches (2,016
    sequences) within 2 points of the weights, and the epochs each will see in train.steps."""
    import json

    from conftest import DOCS_PAGE
    from shardlm import cli

    notes = tmp_path / "notes.txt"
    notes.write_text("a note on the weather, and on nothing else. " * 600)
    sources = (f"data.sources=[{{name: plays, path: shakespeare, weight: 6}}, {{name: docs, path: '{DOCS_PAGE}', "
               f"weight: 3}}, {{name: notes, path: '{notes}', weight: 1}}]")
    code = cli.main(["data", "inspect", "--batches", "63", "--json", sources, "data.tokenizer=bytes",
                     "model.seq_len=32", "train.batch_size=32", "train.steps=500"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["name"] for r in report["sources"]] == ["plays", "docs", "notes"]
    for r, weight in zip(report["sources"], (0.6, 0.3, 0.1)):
        assert r["weight"] == pytest.approx(weight) and abs(r["share"] - weight) <= 0.02
        windows = (r["train_tokens"] - 1) // 32
        assert r["epochs"] == pytest.approx(500 * 32 * weight / windows, abs=1 / windows)
    assert report["sources"][2]["epochs"] > 1  # the small source repeats
