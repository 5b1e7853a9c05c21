"""`shardlm data prepare`: exact counts, token files, no-op re-runs, atomic writes, and the training data path."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import make_stories, write_stories
from shardlm.config import load_config
from shardlm.data import gpt2_ranks
from shardlm.data import prepare as prep
from shardlm.data.prepare import open_prepared, prepare, token_dtype, training_data
from shardlm.data.tokenizer import EOT, ByteTokenizer
from shardlm.errors import ShardlmError

QUIET = {"progress": False, "log": lambda msg: None}


@pytest.fixture
def stories_file(tmp_path):
    stories = make_stories(300)
    path = tmp_path / "TinyStories-valid.txt"
    write_stories(path, stories)
    return path, stories


def test_tinystories_counts_are_exact_with_the_bytes_tokenizer(stories_file, tmp_path):
    path, stories = stories_file
    data = prepare([str(path)], tmp_path / "out", tokenizer="bytes", **QUIET)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    n_bytes = sum(len(s.encode()) for s in stories)
    assert meta["num_documents"] == len(stories) == 300
    assert train["num_documents"] + val["num_documents"] == 300  # the split falls between two stories
    assert train["num_tokens"] + val["num_tokens"] == n_bytes + len(stories)  # one separator per story
    assert meta["num_text_bytes"] == train["num_bytes"] + val["num_bytes"] == n_bytes
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 257 and meta["dtype"] == "uint16"
    # The files are each story preceded by the separator, byte for byte.
    tokens = np.concatenate([np.fromfile(tmp_path / "out" / f"{s}.bin", np.uint16) for s in ("train", "val")])
    assert ByteTokenizer().decode(tokens) == "".join(EOT + s for s in stories)
    np.testing.assert_array_equal(data.tokens("train"), tokens[: train["num_tokens"]])
    assert train["sha256"] == hashlib.sha256(tokens[: train["num_tokens"]].tobytes()).hexdigest()


def test_validation_tail_starts_at_a_story_boundary(stories_file, tmp_path):
    path, stories = stories_file
    data = prepare([str(path)], tmp_path / "out", tokenizer="bytes", val_fraction=0.1, **QUIET)
    train, val = (data.meta["splits"][s] for s in ("train", "val"))
    assert train["num_documents"] + val["num_documents"] == 300
    assert train["num_tokens"] + val["num_tokens"] == sum(len(s.encode()) + 1 for s in stories)
    assert 0.05 <= val["num_tokens"] / (train["num_tokens"] + val["num_tokens"]) <= 0.2
    assert data.tokens("val")[0] == 256 and not data.meta["val_split"]["starts_mid_document"]
    k = val["num_documents"]
    assert ByteTokenizer().decode(data.tokens("val")) == "".join(EOT + s for s in stories[-k:])


def test_tail_cut_rules():
    starts = np.array([0, 100, 200, 300, 400, 500, 600, 700, 800, 900])
    assert prep._tail_cut(1000, starts, 0.1) == (900, False)
    assert prep._tail_cut(1000, starts, 0.0) == (1000, False)
    # Three long documents: no boundary within [F/2, 2F] of the tail, so the tail starts mid-document.
    assert prep._tail_cut(3000, np.array([0, 1000, 2000]), 0.05) == (2850, True)
    assert prep._tail_cut(500, np.array([0]), 0.1) == (450, True)
    # A floor above the fraction sizes the tail exactly (mid-document unless it falls on a start), up to half.
    assert prep._tail_cut(1000, starts, 0.05, min_tokens=200) == (800, False)
    assert prep._tail_cut(1000, starts, 0.05, min_tokens=150) == (850, True)
    assert prep._tail_cut(1000, starts, 0.05, min_tokens=900) == (500, False)
    assert prep._tail_cut(1000, starts, 0.3, min_tokens=200) == (700, False)  # below the fraction: no effect


def test_explicit_validation_inputs(stories_file, tmp_path):
    path, stories = stories_file
    write_stories(tmp_path / "valid.txt", ["A valid story.", "Another one."])
    data = prepare([str(path)], tmp_path / "out", tokenizer="bytes", val_inputs=[str(tmp_path / "valid.txt")],
                   **QUIET)
    assert data.meta["splits"]["train"]["num_documents"] == 300
    assert data.meta["splits"]["val"]["num_documents"] == 2 and data.meta["num_documents"] == 302
    assert ByteTokenizer().decode(data.tokens("val")) == f"{EOT}A valid story.{EOT}Another one."


def test_rerun_is_a_noop_and_other_data_needs_force(stories_file, tmp_path):
    path, _ = stories_file
    out = tmp_path / "out"
    prepare([str(path)], out, tokenizer="bytes", **QUIET)
    stamp = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    logs = []
    prepare([str(path)], out, tokenizer="bytes", progress=False, log=logs.append)
    assert "nothing to do" in logs[-1]
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == stamp
    with pytest.raises(ShardlmError, match="other inputs or settings; pass --force"):
        prepare([str(path)], out, tokenizer="bytes", val_fraction=0.2, **QUIET)
    with path.open("a") as f:  # a changed input is other data too
        f.write("A new story.\n<|endoftext|>\n")
    with pytest.raises(ShardlmError, match="pass --force"):
        prepare([str(path)], out, tokenizer="bytes", **QUIET)
    assert open_prepared(out).meta["num_documents"] == 300  # untouched
    assert prepare([str(path)], out, tokenizer="bytes", force=True, **QUIET).meta["num_documents"] == 301
    # A directory shardlm did not write is never replaced.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ShardlmError, match="non-empty directory that shardlm did not prepare"):
        prepare([str(path)], tmp_path / "mine", tokenizer="bytes", force=True, **QUIET)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_failures_and_interrupts_leave_nothing_half_written(stories_file, tmp_path, monkeypatch):
    path, _ = stories_file
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine story\n<|endoftext|>\nbroken \xff story\n")
    out = tmp_path / "out"
    with pytest.raises(ShardlmError, match="not valid UTF-8 at byte offset 32"):
        prepare([str(path), str(bad)], out, tokenizer="bytes", **QUIET)
    # Only the (empty, hidden) lock file is left beside the inputs.
    assert sorted(os.listdir(tmp_path)) == [".out.lock", "TinyStories-valid.txt", "bad.txt"]

    # Replacing, the bad byte is counted.
    data = prepare([str(path), str(bad)], out, tokenizer="bytes", invalid_utf8="replace", **QUIET)
    assert data.meta["invalid_utf8_replaced"] == 1 and data.meta["num_documents"] == 302
    before = (out / "meta.json").read_text()

    # Ctrl-C in the middle of a forced re-prepare: the old data stays, no partial directory is left.
    monkeypatch.setattr(prep, "BATCH_CHARS", 1000)
    calls = {"n": 0}
    real = ByteTokenizer.encode_batch

    def interrupted(self, texts):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, texts)

    monkeypatch.setattr(ByteTokenizer, "encode_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(path)], out, tokenizer="bytes", force=True, **QUIET)
    assert calls["n"] == 3
    assert (out / "meta.json").read_text() == before
    assert sorted(os.listdir(tmp_path)) == [".out.lock", "TinyStories-valid.txt", "bad.txt", "out"]


def test_leftover_of_a_killed_prepare_is_removed(stories_file, tmp_path):
    path, _ = stories_file
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.partial-{int(dead.stdout)}"
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"\0" * 100)
    prepare([str(path)], tmp_path / "out", tokenizer="bytes", **QUIET)
    assert not stale.exists()


def test_token_dtype_follows_the_vocabulary():
    assert token_dtype(257) == np.uint16 and token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(128256) == np.uint32


def test_no_documents_and_bad_tokenizer_are_errors(tmp_path):
    (tmp_path / "seps.txt").write_text(f"{EOT}\n\n{EOT}\n")
    with pytest.raises(ShardlmError, match="hold no documents"):
        prepare([str(tmp_path / "seps.txt")], tmp_path / "out", tokenizer="bytes", **QUIET)
    with pytest.raises(ShardlmError, match="is not a tokenizer"):
        prepare([str(tmp_path / "seps.txt")], tmp_path / "out", tokenizer="gpt-2", **QUIET)
    assert not (tmp_path / "out").exists()


def test_trained_bpe_travels_with_the_data(stories_file, tmp_path):
    path, stories = stories_file
    data = prepare([str(path)], tmp_path / "out", tokenizer="bpe", vocab_size=400, **QUIET)
    assert data.meta["tokenizer"] == "bpe" and (tmp_path / "out" / "tokenizer.json").exists()
    again = open_prepared(tmp_path / "out")
    ids = again.tokens("train")
    text = again.tokenizer.decode(ids[: data.meta["splits"]["train"]["num_tokens"]])
    assert text.startswith(EOT + stories[0] + EOT + stories[1])
    assert data.meta["splits"]["train"]["num_bytes"] + data.meta["splits"]["val"]["num_bytes"] == sum(
        len(s.encode()) for s in stories)


def test_training_data_prepares_text_once_and_checks_the_tokenizer(stories_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLM_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = stories_file
    cfg = load_config(None, [f"data.path={path}", "data.tokenizer=bytes"])
    logs = []
    data = training_data(cfg.data, progress=False, log=logs.append)
    assert data.path.parent == tmp_path / "cache" / "data" and data.meta["num_documents"] == 300
    assert "preparing" in logs[0]
    logs.clear()
    assert training_data(cfg.data, progress=False, log=logs.append).path == data.path
    assert "nothing to do" in logs[-1]
    # A prepared directory is used as is; asking for another tokenizer is an error.
    assert training_data(load_config(None, [f"data.path={data.path}"]).data, **QUIET).path == data.path
    with pytest.raises(ShardlmError, match="prepared with the bytes tokenizer, not gpt2"):
        training_data(load_config(None, [f"data.path={data.path}", "data.tokenizer=gpt2"]).data, **QUIET)
    # Text too small for evaluation's floor (what a run asks: 8 windows) gets a larger validation split, said.
    floor = 8 * 256 + 1
    small = training_data(cfg.data, progress=False, log=logs.append, min_val_tokens=floor)
    assert small.path != data.path and small.meta["val_split"]["min_tokens"] == floor
    assert small.meta["splits"]["val"]["num_tokens"] == floor > 0.05 * small.meta["num_tokens"]
    assert "the validation split holds" in logs[-2] and "not 0.05" in logs[-2]
    (data.path / "train.bin").write_bytes(b"\0\0")
    with pytest.raises(ShardlmError, match="incomplete or changed; prepare it again"):
        open_prepared(data.path)


def cli(*args):
    """`shardlm ARGS` in this process (the command line's `main`; a subprocess would spend seconds starting): its
    exit code and what it printed."""
    import contextlib
    import io

    from shardlm.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: --help, or arguments it refuses
            code = e.code
    return subprocess.CompletedProcess(["shardlm", *args], code, out.getvalue(), err.getvalue())


def test_cli_prepare_and_tokenizer_train(stories_file, tmp_path):
    path, stories = stories_file
    proc = cli("tokenizer", "train", str(path), "--vocab-size", "300", "--out", str(tmp_path / "tok.json"))
    assert proc.returncode == 0, proc.stderr
    proc = cli("data", "prepare", str(path), "--tokenizer", f"bpe:{tmp_path / 'tok.json'}", "--out",
               str(tmp_path / "data"), "--val-fraction", "0.1", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "300 documents" in proc.stdout and f"shardlm train data.path={tmp_path / 'data'}" in proc.stdout
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] <= 300
    assert (tmp_path / "data" / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    again = cli("tokenizer", "train", str(path), "--vocab-size", "300", "--out", str(tmp_path / "tok.json"))
    assert again.returncode == 2 and again.stderr.startswith("shardlm: error: --out") and "--force" in again.stderr
    missing = cli("data", "prepare", str(tmp_path / "nope.txt"), "--tokenizer", "bytes", "--out",
                  str(tmp_path / "x"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [f"shardlm: error: input {tmp_path / 'nope.txt'} does not "
                                                   "exist; pass an existing text, .jsonl or .parquet file, a folder "
                                                   "of them, or a built-in corpus (shakespeare)"]


def test_cli_prepare_defaults_to_the_tokenizer_train_prepares_text_with(stories_file, tmp_path, monkeypatch):
    """`data prepare FILE --out DIR` without --tokenizer prepares what `shardlm train data.path=FILE` does
    (data.tokenizer=auto: a BPE of data.tokenizer_vocab tokens trained on the text), not an argparse error, and its
    help names the choices and the default."""
    monkeypatch.setenv("SHARDLM_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = stories_file
    proc = cli("data", "prepare", str(path), "--out", str(tmp_path / "data"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "300 documents" in proc.stdout
    data = open_prepared(tmp_path / "data")
    run = training_data(load_config(None, [f"data.path={path}"]).data, **QUIET)
    assert data.meta["tokenizer"] == "bpe" and data.meta["settings"]["tokenizer"]["train_vocab_size"] == 2048
    assert data.meta["fingerprint"] == run.meta["fingerprint"]
    assert (data.path / "tokenizer.json").read_bytes() == (run.path / "tokenizer.json").read_bytes()
    assert data.tokens("train").tolist() == run.tokens("train").tolist()
    usage = cli("data", "prepare", "--help")
    assert usage.returncode == 0
    usage = " ".join(usage.stdout.split())
    assert "[--tokenizer T]" in usage and "bpe (the default" in usage
    assert all(choice in usage for choice in ("gpt2", "bytes", "bpe:PATH", "--vocab-size tokens"))
    proc = cli("data", "prepare", str(path), "--out", str(tmp_path / "x"), "--tokenizer", "bpe2")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "shardlm: error: --tokenizer='bpe2' is not a tokenizer; use gpt2, bytes, bpe (trained on the data) or bpe:PATH"]


def test_force_replaces_unreadable_data_but_never_foreign_files(stories_file, tmp_path):
    path, _ = stories_file
    out = tmp_path / "out"
    prepare([str(path)], out, tokenizer="bytes", **QUIET)
    (out / "meta.json").write_text("{not json")
    with pytest.raises(ShardlmError, match="meta.json is unreadable .*--force"):
        prepare([str(path)], out, tokenizer="bytes", **QUIET)
    assert prepare([str(path)], out, tokenizer="bytes", force=True, **QUIET).meta["num_documents"] == 300
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ShardlmError, match="also holds notes.txt, which shardlm did not write"):
        prepare([str(path)], out, tokenizer="bytes", val_fraction=0.2, force=True, **QUIET)
    assert (out / "notes.txt").read_text() == "mine"


def test_a_swap_killed_between_its_renames_is_undone(stories_file, tmp_path):
    path, _ = stories_file
    out = tmp_path / "out"
    prepare([str(path)], out, tokenizer="bytes", **QUIET)
    os.rename(out, tmp_path / ".out.old-4242")  # killed after moving the old data aside
    logs = []
    prepare([str(path)], out, tokenizer="bytes", progress=False, log=logs.append)
    assert "nothing to do" in logs[-1] and not (tmp_path / ".out.old-4242").exists()


def test_concurrent_prepares_take_turns(stories_file, tmp_path):
    import fcntl
    import threading

    path, _ = stories_file
    out = tmp_path / "out"
    logs, done = [], threading.Event()
    with open(tmp_path / ".out.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another preparer is at work
        worker = threading.Thread(target=lambda: (prepare([str(path)], out, tokenizer="bytes", progress=False,
                                                          log=logs.append), done.set()))
        worker.start()
        assert not done.wait(1.0) and not out.exists()
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(60)
    assert done.is_set() and logs[0].startswith("waiting for another shardlm")
    assert open_prepared(out).meta["num_documents"] == 300


def test_long_documents_are_tokenized_in_pieces_with_the_same_tokens(tmp_path, monkeypatch):
    from shardlm.data.tokenizer import train_bpe

    monkeypatch.setattr(prep, "PIECE_CHARS", 400)
    lines = [f"Line {i}: the fox jumped over {i % 7} dogs." + ("\n\n  indented" if i % 5 == 0 else "")
             for i in range(300)]
    book = "\n".join(lines)
    (tmp_path / "book.txt").write_text(book)
    tok = train_bpe([book], 400)
    tok.save(tmp_path)
    data = prepare([str(tmp_path / "book.txt")], tmp_path / "out", tokenizer=f"bpe:{tmp_path / 'tokenizer.json'}",
                   **QUIET)
    assert data.meta["num_documents"] == 1
    tokens = np.concatenate([data.tokens("train"), data.tokens("val")])
    np.testing.assert_array_equal(tokens, [tok.eot_id] + tok.encode(book))
    # One huge line has no newline to cut after: bytes are still exact.
    (tmp_path / "line.txt").write_text("x" * 1000 + "é" * 500)
    data = prepare([str(tmp_path / "line.txt")], tmp_path / "out2", tokenizer="bytes", **QUIET)
    tokens = np.concatenate([data.tokens("train"), data.tokens("val")])
    assert ByteTokenizer().decode(tokens) == EOT + "x" * 1000 + "é" * 500


def test_uint32_files_for_large_vocabularies_and_ids_are_checked(stories_file, tmp_path, monkeypatch):
    path, stories = stories_file

    class Wide(ByteTokenizer):  # a 70,000-token vocabulary: ids past uint16
        vocab_size, eot_id = 70_000, 69_999

        def encode_batch(self, texts):
            return [a.astype(np.int64) + 65_536 for a in super().encode_batch(texts)]

        def token_bytes(self):
            return np.array([0] * 65_536 + [1] * 256 + [0] * (70_000 - 65_792), np.int32)

    monkeypatch.setattr(prep, "load_tokenizer", lambda spec, directory=None: Wide())
    data = prepare([str(path)], tmp_path / "out", tokenizer="bytes", **QUIET)
    assert data.meta["dtype"] == "uint32" and data.tokens("train").dtype == np.uint32
    train = np.asarray(data.tokens("train"))
    assert train[0] == 69_999 and bytes((train[1:40] - 65_536).tolist()).decode().startswith(stories[0][:20])

    class Broken(Wide):
        vocab_size = 65_600  # claims fewer ids than it produces

    monkeypatch.setattr(prep, "load_tokenizer", lambda spec, directory=None: Broken())
    with pytest.raises(ShardlmError, match="produced id .* outside its vocabulary of 65600"):
        prepare([str(path)], tmp_path / "out2", tokenizer="bytes", **QUIET)


def test_validation_choices_are_checked(stories_file, tmp_path):
    path, _ = stories_file
    with pytest.raises(ShardlmError, match="both a training and a validation input"):
        prepare([str(path)], tmp_path / "out", tokenizer="bytes", val_inputs=[str(path)], **QUIET)
    with pytest.raises(ShardlmError, match="validation fraction must be in \\(0, 0.5\\)"):
        prepare([str(path)], tmp_path / "out", tokenizer="bytes", val_fraction=0, **QUIET)
    proc = cli("data", "prepare", str(path), "--tokenizer", "bytes", "--out", str(tmp_path / "o"), "--val",
               str(path), "--val-fraction", "0.1")
    assert proc.returncode == 2 and "pass one of them" in proc.stderr


# --- GPT-2's ranks from the package registry: which pip runs, and what a failure says ------------------------------

# What a real pip 23.2.1 printed (trailing spaces dropped, long lines continued with a backslash). Preparing
# openai-whisper's metadata with the setuptools 65.5 of a new Python 3.11 venv (no `wheel` package), with
# --no-build-isolation:
PIP_NO_BDIST_WHEEL = """\
WARNING: Location 'file:///opt/pypi/simple/openai-whisper/' is ignored: it is neither a file nor a directory.
WARNING: Location 'file:///opt/pypi-more/simple/openai-whisper/' is ignored: it is neither a file nor a director\
y.
  error: subprocess-exited-with-error

  × Preparing metadata (pyproject.toml) did not run successfully.
  │ exit code: 1
  ╰─> [17 lines of output]
      /tmp/bare62/.venv/lib/python3.11/site-packages/setuptools/config/pyprojecttoml.py:108: _BetaConfiguration:\
 Support for `[tool.setuptools]` in `pyproject.toml` is still *beta*.
        warnings.warn(msg, _BetaConfiguration)
      running dist_info
      creating /tmp/pip-modern-metadata-mn1e0w4m/openai_whisper.egg-info
      writing /tmp/pip-modern-metadata-mn1e0w4m/openai_whisper.egg-info/PKG-INFO
      writing dependency_links to /tmp/pip-modern-metadata-mn1e0w4m/openai_whisper.egg-info/dependency_links.txt
      writing entry points to /tmp/pip-modern-metadata-mn1e0w4m/openai_whisper.egg-info/entry_points.txt
      writing requirements to /tmp/pip-modern-metadata-mn1e0w4m/openai_whisper.egg-info/requires.txt
      writing top-level names to /tmp/pip-modern-metadata-mn1e0w4m/openai_whisper.egg-info/top_level.txt
      writing manifest file '/tmp/pip-modern-metadata-mn1e0w4m/openai_whisper.egg-info/SOURCES.txt'
      file whisper.py (for module whisper) not found
      reading manifest file '/tmp/pip-modern-metadata-mn1e0w4m/openai_whisper.egg-info/SOURCES.txt'
      reading manifest template 'MANIFEST.in'
      adding license file 'LICENSE'
      writing manifest file '/tmp/pip-modern-metadata-mn1e0w4m/openai_whisper.egg-info/SOURCES.txt'
      creating '/tmp/pip-modern-metadata-mn1e0w4m/openai_whisper-20250625.dist-info'
      error: invalid command 'bdist_wheel'
      [end of output]

  note: This error originates from a subprocess, and is likely not a problem with pip.
error: metadata-generation-failed

× Encountered error while generating package metadata.
╰─> See above for output.

note: This is an issue with the package mentioned above, not pip.
hint: See above for details.
"""

# The index's host does not resolve (PIP_INDEX_URL=https://registry.invalid/simple PIP_RETRIES=1):
PIP_NO_REGISTRY = """\
WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after connection broken \
by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object at 0x7f0245bf5bd0>: Failed to est\
ablish a new connection: [Errno -2] Name or service not known')': /simple/openai-whisper/
ERROR: Could not find a version that satisfies the requirement openai-whisper==20250625 (from versions: none)
ERROR: No matching distribution found for openai-whisper==20250625
"""

# A package whose setup.py imports a module that is not there:
PIP_BUILD_RAISES = """\
  error: subprocess-exited-with-error

  × Preparing metadata (pyproject.toml) did not run successfully.
  │ exit code: 1
  ╰─> [16 lines of output]
      Traceback (most recent call last):
        File "/work/main/.venv/lib/python3.11/site-packages/pip/_vendor/pyproject_hooks/_in_process/_in_process.\
py", line 353, in <module>
          main()
        File "/work/main/.venv/lib/python3.11/site-packages/pip/_vendor/pyproject_hooks/_in_process/_in_process.\
py", line 335, in main
          json_out['return_val'] = hook(**hook_input['kwargs'])
                                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^
        File "/work/main/.venv/lib/python3.11/site-packages/pip/_vendor/pyproject_hooks/_in_process/_in_process.\
py", line 149, in prepare_metadata_for_build_wheel
          return hook(metadata_directory, config_settings)
                 ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
        File "/work/main/.venv/lib/python3.11/site-packages/setuptools/build_meta.py", line 380, in prepare_meta\
data_for_build_wheel
          self.run_setup()
        File "/work/main/.venv/lib/python3.11/site-packages/setuptools/build_meta.py", line 317, in run_setup
          exec(code, locals())  # noqa: S102 # exec is intentional here
          ^^^^^^^^^^^^^^^^^^^^
        File "<string>", line 2, in <module>
      ModuleNotFoundError: No module named 'numpy_cuda_helpers'
      [end of output]

  note: This error originates from a subprocess, and is likely not a problem with pip.
error: metadata-generation-failed

× Encountered error while generating package metadata.
╰─> See above for output.

note: This is an issue with the package mentioned above, not pip.
hint: See above for details.
"""

# --no-build-isolation where setuptools is not installed (pip's own frames between the first and the backend's
# cut out):
PIP_NO_SETUPTOOLS = """\
ERROR: Exception:
Traceback (most recent call last):
  File "/tmp/v62/lib/python3.11/site-packages/pip/_internal/cli/base_command.py", line 180, in exc_logging_wrapp\
er
    status = run_func(*args)
    raise BackendUnavailable(data.get('traceback', ''))
pip._vendor.pyproject_hooks._impl.BackendUnavailable: Traceback (most recent call last):
  File "/tmp/v62/lib/python3.11/site-packages/pip/_vendor/pyproject_hooks/_in_process/_in_process.py", line 77, \
in _build_backend
    obj = import_module(mod_path)
          ^^^^^^^^^^^^^^^^^^^^^^^
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/importlib/__init__.py", line 126, in import_module
    return _bootstrap._gcd_import(name[level:], package, level)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "<frozen importlib._bootstrap>", line 1204, in _gcd_import
  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load
  File "<frozen importlib._bootstrap>", line 1126, in _find_and_load_unlocked
  File "<frozen importlib._bootstrap>", line 241, in _call_with_frames_removed
  File "<frozen importlib._bootstrap>", line 1204, in _gcd_import
  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load
  File "<frozen importlib._bootstrap>", line 1140, in _find_and_load_unlocked
ModuleNotFoundError: No module named 'setuptools'
"""


class FakePip:
    """`subprocess.run` standing in for `python -m pip download`: exits 1 with a real pip's recorded output when
    `output(args)` gives one, else puts the archive into the `-d` directory and exits 0, as pip does."""

    def __init__(self, output):
        self.output, self.calls = output, []

    def __call__(self, args, **kwargs):
        self.calls.append(list(args))
        out = self.output(args)
        if out is not None:
            return subprocess.CompletedProcess(args, 1, "", out)
        (Path(args[args.index("-d") + 1]) / "openai_whisper-20250625.tar.gz").write_bytes(b"")
        return subprocess.CompletedProcess(args, 0, "", "")


def setuptools_seen(monkeypatch, version, bdist_wheel):
    """What this interpreter's metadata says of setuptools (None: not installed) and of a `bdist_wheel` command."""
    import importlib.metadata as md

    real_version, real_entry_points = md.version, md.entry_points

    def fake_version(name):
        if name != "setuptools":
            return real_version(name)
        if version is None:
            raise md.PackageNotFoundError(name)
        return version

    def fake_entry_points(**select):
        if select.get("group") == "distutils.commands" and select.get("name") == "bdist_wheel":
            return md.EntryPoints([md.EntryPoint("bdist_wheel", "setuptools.command.bdist_wheel:bdist_wheel",
                                                 "distutils.commands")] * bdist_wheel)
        return real_entry_points(**select)

    monkeypatch.setattr(md, "version", fake_version)
    monkeypatch.setattr(md, "entry_points", fake_entry_points)


def own_setuptools(args) -> bool:
    return "--no-build-isolation" in args


@pytest.mark.parametrize("version, bdist_wheel, own", [
    ("65.5.0", False, False),  # Python 3.11's venv: its metadata step has no bdist_wheel
    (None, False, False),      # Python 3.12's venv: no setuptools
    ("65.5.0", True, True),    # with the wheel package
    ("70.1.0", True, True),    # bdist_wheel in setuptools itself
    ("60.9.3", True, False),   # older than whisper's build requirement
], ids=["venv-3.11", "venv-3.12", "wheel-package", "setuptools-70.1", "setuptools-60"])
def test_registry_fetch_uses_this_setuptools_only_where_it_can_prepare_the_metadata(monkeypatch, tmp_path, version,
                                                                                    bdist_wheel, own):
    """Only a setuptools that can prepare openai-whisper's metadata is used (--no-build-isolation); else pip's
    isolated build. A pip that fails as the real one does with setuptools 65.5 without bdist_wheel."""
    setuptools_seen(monkeypatch, version, bdist_wheel)
    pip = FakePip(lambda args: PIP_NO_BDIST_WHEEL if own_setuptools(args) and not bdist_wheel else None)
    monkeypatch.setattr(subprocess, "run", pip)
    archive = gpt2_ranks.pip_download(gpt2_ranks.WHISPER_REQUIREMENT, tmp_path, sdist=True)
    assert archive == tmp_path / "openai_whisper-20250625.tar.gz"
    assert [own_setuptools(args) for args in pip.calls] == [own]
    # Only whisper from source (not :all:): the isolated build's setuptools may come as a wheel.
    assert pip.calls[0][pip.calls[0].index("--no-binary") + 1] == "openai-whisper"


def test_registry_fetch_retries_in_isolation_when_this_setuptools_fails(monkeypatch, tmp_path):
    """A setuptools that looks able but fails anyway: pip again with build isolation; a registry that has no such
    package: no second try."""
    setuptools_seen(monkeypatch, "70.1.0", True)
    pip = FakePip(lambda args: PIP_NO_BDIST_WHEEL if own_setuptools(args) else None)
    monkeypatch.setattr(subprocess, "run", pip)
    assert gpt2_ranks.pip_download(gpt2_ranks.WHISPER_REQUIREMENT, tmp_path, sdist=True).is_file()
    assert [own_setuptools(args) for args in pip.calls] == [True, False]

    pip = FakePip(lambda args: PIP_NO_REGISTRY)
    monkeypatch.setattr(subprocess, "run", pip)
    with pytest.raises(gpt2_ranks.RegistryFetchError) as e:
        gpt2_ranks.pip_download(gpt2_ranks.WHISPER_REQUIREMENT, tmp_path / "none", sdist=True)
    assert [own_setuptools(args) for args in pip.calls] == [True]
    assert "with this environment's setuptools" not in str(e.value)

    pip = FakePip(lambda args: PIP_NO_BDIST_WHEEL if own_setuptools(args) else PIP_NO_REGISTRY)
    monkeypatch.setattr(subprocess, "run", pip)
    with pytest.raises(gpt2_ranks.RegistryFetchError) as e:  # both fail: both causes, the last first
        gpt2_ranks.pip_download(gpt2_ranks.WHISPER_REQUIREMENT, tmp_path / "none", sdist=True)
    assert str(e.value) == (
        "pip download openai-whisper==20250625 failed: ERROR: Could not find a version that satisfies the "
        "requirement openai-whisper==20250625 (from versions: none) (connection: NewConnectionError('Failed to "
        "establish a new connection: [Errno -2] Name or service not known')) (with this environment's setuptools: "
        "Preparing metadata (pyproject.toml) did not run successfully: error: invalid command 'bdist_wheel')")


@pytest.mark.parametrize("output, says", [
    (PIP_NO_BDIST_WHEEL, "Preparing metadata (pyproject.toml) did not run successfully: error: invalid command "
                         "'bdist_wheel'"),
    (PIP_NO_REGISTRY, "ERROR: Could not find a version that satisfies the requirement openai-whisper==20250625 (from "
                      "versions: none) (connection: NewConnectionError('Failed to establish a new connection: "
                      "[Errno -2] Name or service not known'))"),
    (PIP_BUILD_RAISES, "Preparing metadata (pyproject.toml) did not run successfully: ModuleNotFoundError: No "
                       "module named 'numpy_cuda_helpers'"),
    (PIP_NO_SETUPTOOLS, "ERROR: Exception: ModuleNotFoundError: No module named 'setuptools'"),
], ids=["no-bdist_wheel", "no-registry", "build-raises", "no-setuptools"])
def test_a_failed_registry_fetch_says_what_pip_said(monkeypatch, tmp_path, output, says):
    """The error names pip's cause, recorded from real failures, on one line; not pip's last line ("hint: See above
    for details.")."""
    setuptools_seen(monkeypatch, "65.5.0", False)
    monkeypatch.setattr(subprocess, "run", FakePip(lambda args: output))
    with pytest.raises(gpt2_ranks.RegistryFetchError) as e:
        gpt2_ranks.fetch_gpt2_ranks(tmp_path / "cache", log=None)
    assert str(e.value) == f"pip download openai-whisper==20250625 failed: {says}"
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_registry_fetch_works_in_a_new_venv(tmp_path):
    """Real pip, real registry: `fetch_gpt2_ranks` run by a venv's interpreter as `python -m venv` makes it (the
    README's first command; Python 3.11's holds setuptools 65.5 and no `wheel`, the setup whose metadata step failed;
    3.12's no setuptools), with shardlm's source on its path. About 6 s: 3 to make the venv, 2 to 4 for pip in its
    isolated build."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    script = ("import sys\n"
              "from shardlm.data.gpt2_ranks import RegistryFetchError, builds_metadata_here, fetch_gpt2_ranks\n"
              "print(builds_metadata_here())\n"
              "try:\n"
              "    print(fetch_gpt2_ranks(sys.argv[1], log=None))\n"
              "except RegistryFetchError as e:\n"
              "    sys.exit(f'registry: {e}')\n")
    env = dict(os.environ, PYTHONPATH=str(Path(gpt2_ranks.__file__).parents[2]))
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", script, str(tmp_path / "cache")], capture_output=True,
                          text=True, timeout=600, env=env)
    if "Could not find a version" in proc.stderr:  # the machine reaches no registry (any other failure fails)
        pytest.skip(f"the package registry did not give openai-whisper: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    target = gpt2_ranks.tiktoken_cache_file(gpt2_ranks.R50K_URL, tmp_path / "cache")
    assert proc.stdout.split() == ["False", str(target)]  # this setuptools cannot, so pip's isolated build did
    assert hashlib.sha256(target.read_bytes()).hexdigest() == gpt2_ranks.R50K_SHA256
