"""Tokenize text once into token files that training memory-maps: `shardlm data prepare`, and `data.path=<text>`.

A prepared directory holds:
- `train.bin`, `val.bin`: the token ids of each split, little-endian uint16 when the vocabulary fits (GPT-2's
  does), else uint32. Every document is preceded by `<|endoftext|>`, so windows cut anywhere in the stream see
  where documents begin, and `num_tokens = tokens of the documents + num_documents`.
- `meta.json`: format version, tokenizer and vocabulary size, dtype, per split `num_tokens`, `num_documents`,
  `num_bytes` (UTF-8 bytes of text) and a SHA-256 of the file; the inputs with their sizes and modification times;
  counts of skipped empty documents and replaced invalid UTF-8; a fingerprint of all of that.
- `tokenizer.json` for a BPE, so the directory is self-contained.

Design choices:
- One pass over the inputs: documents are tokenized in batches of a few MB by the tokenizer's own parallel batch
  encoder (Rust threads in tiktoken and `tokenizers`; numpy for bytes) and appended to the file.
- The validation split is `val_inputs` when given, else the last `val_fraction` of the tokens. It starts at the
  document boundary nearest the cut when that keeps its size within [F/2, 2F]; otherwise (a corpus of a few long
  documents) it starts mid-document, meta.json says so, and that document counts in both splits' `num_documents`
  (the top-level `num_documents` counts it once). `min_val_tokens` (text a run prepares: a few windows of its
  sequence) is a floor on the tail: a small text's split grows past `val_fraction` to hold it, up to half the
  tokens, so that any text a run can train on can also be evaluated.
- Atomic: all files are written into a hidden sibling `.DIR.partial-PID`, then renamed into place. An error or
  Ctrl-C removes it; the leftover of a killed process is removed by the next prepare. One preparer per DIR runs
  at a time (a `flock` on `.DIR.lock`, so concurrent runs and hosts sharing a filesystem wait, then find the data
  ready; the lock file stays, as removing one a waiter holds open would let a newcomer lock a new file). A DIR
  holding other data is replaced only with `force`, and only if it holds nothing but our files; a non-empty DIR
  without `meta.json` (not ours) never.
- A re-run whose fingerprint matches an intact DIR is a no-op. The fingerprint covers each input's path, size and
  mtime (like make), the tokenizer (and its file's hash) and every setting that changes the tokens.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
from tqdm.auto import tqdm

from shardlm.atomic import partial_sibling, swap_into_place
from shardlm.data.sources import INVALID_UTF8_POLICIES, ReadStats, identity, input_bytes, read_documents, resolve_inputs
from shardlm.data.tokenizer import (TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer, check_spec, load_tokenizer,
                                   train_bpe)
from shardlm.errors import ShardlmError

FORMAT, VERSION = "shardlm-tokens", 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
OUR_FILES = {META_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE} | {f"{split}.bin" for split in SPLITS}  # --force may replace
BATCH_CHARS = 4 << 20  # text per tokenizer call: big enough to keep every core busy, small enough for memory
PIECE_CHARS = 1 << 20  # longer documents are tokenized in pieces (see `_pieces`)
BPE_TRAIN_MAX_BYTES = 256 << 20  # a BPE trained by `prepare` sees at most this much text (it plateaus long before)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class PreparedData:
    """An opened prepared directory: its meta, tokenizer and memory-mapped splits."""

    def __init__(self, path: Path, meta: dict, tokenizer: Tokenizer):
        self.path, self.meta, self.tokenizer = path, meta, tokenizer
        self.dtype = np.dtype(meta["dtype"])

    def tokens(self, split: str) -> np.ndarray:
        n = self.meta["splits"][split]["num_tokens"]
        if n == 0:
            return np.zeros((0,), self.dtype)
        return np.memmap(self.path / self.meta["splits"][split]["file"], dtype=self.dtype, mode="r", shape=(n,))


def _read_meta(path: Path) -> dict:
    """The checked meta.json of a prepared directory; a ShardlmError says what is wrong with it."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except FileNotFoundError:
        raise ShardlmError(f"{path} is not a prepared data directory (no {META_FILE}); make one with "
                           "`shardlm data prepare`") from None
    except (OSError, ValueError) as e:
        raise ShardlmError(f"{path / META_FILE} is unreadable ({e}); prepare the data again with --force") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ShardlmError(f"{path / META_FILE} is not a shardlm data description; prepare the data again with "
                           "--force")
    if meta.get("version") != VERSION:
        raise ShardlmError(f"{path} was prepared by a shardlm with data format {meta.get('version')}, this one reads "
                           f"{VERSION}; prepare it again with --force")
    return meta


def _damage(path: Path, meta: dict) -> str | None:
    """Why the token files do not match meta.json (sizes only: cheap enough for every start), or None."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        info = meta["splits"][split]
        f = path / info["file"]
        want = info["num_tokens"] * itemsize
        have = f.stat().st_size if f.exists() else None
        if have != want:
            return f"{f} holds {have if have is not None else 'no'} bytes, meta.json says {want}"
    return None


def open_prepared(path: str | Path) -> PreparedData:
    path = Path(path)
    meta = _read_meta(path)
    damage = _damage(path, meta)
    if damage:
        raise ShardlmError(f"{damage}: the data is incomplete or changed; prepare it again with --force")
    return PreparedData(path, meta, load_tokenizer(meta["tokenizer"], path))


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _settings(inputs, val_inputs, tokenizer, vocab_size, val_fraction, text_field, invalid_utf8,
              min_val_tokens=0) -> dict:
    """Everything that changes the tokens; its hash is the fingerprint."""
    tok = {"spec": tokenizer}
    if tokenizer == "bpe":
        tok["train_vocab_size"] = vocab_size
    elif tokenizer.startswith("bpe:"):
        # The file, and the token that separates documents (a model's own tokenizer may name its end of sequence)
        tok = {"spec": "bpe", "sha256": _sha256(Path(tokenizer[4:])), "eot": load_tokenizer(tokenizer).eot_id}
    return {
        "inputs": identity(inputs), "val_inputs": identity(val_inputs), "tokenizer": tok,
        "val_fraction": None if val_inputs else val_fraction, "text_field": text_field,
        "invalid_utf8": invalid_utf8, "version": VERSION,
        # only when set: directories prepared without the floor keep their fingerprints
        **({"min_val_tokens": min_val_tokens} if min_val_tokens and not val_inputs else {}),
    }


def _fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def _exclusive(out: Path, log: Callable[[str], None]):
    """One preparer per DIR at a time, across processes and hosts sharing the filesystem (`flock`). Whoever holds
    the lock knows that any partial directory left beside DIR belongs to a dead preparer."""
    with open(out.parent / f".{out.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another shardlm that is preparing {out}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _clear_leftovers(out: Path) -> None:
    """Under the lock: remove partial directories of killed preparers; undo a swap killed between its renames."""
    for p in out.parent.glob(f".{out.name}.old-*"):
        if out.exists():
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.rename(p, out)
    for p in out.parent.glob(f".{out.name}.partial-*"):
        shutil.rmtree(p, ignore_errors=True)


def _pieces(docs: Iterator[str]) -> Iterator[tuple[bool, str]]:
    """(starts a document, text): documents longer than PIECE_CHARS (a book in one .txt) are cut after a newline
    that is followed by text, where GPT-2-style pre-tokenizers split anyway, so the tokens do not change; that
    keeps each tokenizer call bounded and parallel."""
    for doc in docs:
        start, first = 0, True
        while len(doc) - start > PIECE_CHARS:
            cut = doc.rfind("\n", start + PIECE_CHARS // 2, start + PIECE_CHARS)
            while cut != -1 and doc[cut + 1].isspace():
                cut = doc.rfind("\n", start + PIECE_CHARS // 2, cut)
            end = cut + 1 if cut != -1 else start + PIECE_CHARS  # one huge line: a plain cut
            yield first, doc[start:end]
            start, first = end, False
        yield first, doc[start:]


def _batches(pieces: Iterator[tuple[bool, str]]) -> Iterator[list[tuple[bool, str]]]:
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[1])
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _write_tokens(docs: Iterator[str], tokenizer: Tokenizer, token_bytes: np.ndarray, dtype: np.dtype, path: Path,
                  stats: ReadStats, bar) -> tuple[np.ndarray, int]:
    """Append `<|endoftext|>` + tokens of each document to `path`; returns where each document starts and the
    UTF-8 bytes the tokens spell (counted here, while each batch is in memory)."""
    starts, pos, nbytes = [], 0, 0
    eot = np.array([tokenizer.eot_id], np.int64)
    with open(path, "wb") as f:
        for batch in _batches(_pieces(docs)):
            ids = tokenizer.encode_batch([text for _, text in batch])
            firsts = np.fromiter((first for first, _ in batch), bool, len(batch))
            out = np.concatenate([part for (first, _), a in zip(batch, ids) for part in ((eot, a) if first else (a,))])
            if out.min() < 0 or out.max() >= tokenizer.vocab_size:  # would wrap around in the file's dtype
                raise ShardlmError(f"the tokenizer produced id {int(out.max())}, outside its vocabulary of "
                                   f"{tokenizer.vocab_size}; use another tokenizer file")
            out.astype(dtype, copy=False).tofile(f)
            nbytes += int(token_bytes[out].sum())
            lengths = np.fromiter((len(a) for a in ids), np.int64, len(ids)) + firsts
            starts.append(pos + (np.cumsum(lengths) - lengths)[firsts])
            pos += len(out)
            bar.update(stats.bytes_read - bar.n)
    return (np.concatenate(starts) if starts else np.zeros((0,), np.int64)), nbytes


def _tail_cut(n: int, starts: np.ndarray, fraction: float, min_tokens: int = 0) -> tuple[int, bool]:
    """Where the validation tail begins, and whether that is inside a document: the last `fraction` of the `n`
    tokens, or at least `min_tokens` of them (up to half)."""
    if fraction == 0 or n < 2:
        return n, False
    floor = min(min_tokens, n // 2)
    if floor > fraction * n:
        cut = n - floor  # the floor is the split's size: a boundary would make it smaller or larger
        return cut, not bool(np.isin(cut, starts))
    target = min(max(int(round(n * (1 - fraction))), 1), n - 1)
    i = int(np.searchsorted(starts, target))
    near = [int(s) for s in starts[max(i - 1, 0) : i + 1] if 0 < s < n]
    if near:
        best = min(near, key=lambda s: abs(s - target))
        if fraction * n / 2 <= n - best <= 2 * fraction * n:
            return best, False
    return target, True


def _split_bytes(tokens: np.ndarray, token_bytes: np.ndarray) -> int:
    total = 0
    for i in range(0, len(tokens), 1 << 24):
        total += int(token_bytes[np.asarray(tokens[i : i + (1 << 24)])].sum())
    return total


def train_tokenizer(inputs: list[str], vocab_size: int, *, max_bytes: float | None = None, text_field: str = "text",
                    invalid_utf8: str = "error", log: Callable[[str], None] = print,
                    show_progress: bool = False) -> Tokenizer:
    """A byte-level BPE trained on the documents of `inputs` (the first `max_bytes` of text, if given)."""
    files = resolve_inputs(list(inputs))
    stats = ReadStats()

    def capped() -> Iterator[str]:
        for doc in read_documents(files, stats, text_field=text_field, invalid_utf8=invalid_utf8):
            yield doc
            if max_bytes is not None and stats.text_bytes >= max_bytes:
                return

    t0 = time.perf_counter()
    tok = train_bpe(capped(), vocab_size, show_progress=show_progress)
    if stats.documents == 0:
        raise ShardlmError("the inputs hold no documents; pass text")
    log(f"trained a {tok.vocab_size}-token byte-level BPE on {stats.documents:,} documents "
        f"({stats.text_bytes / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f}s")
    return tok


def save_tokenizer_file(tok: Tokenizer, out: str | Path) -> None:
    """Write `tok` to the file `out` atomically (a temporary file renamed into place)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        tmp.mkdir(exist_ok=True)
        tok.save(tmp)
        os.replace(tmp / TOKENIZER_FILE, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare(inputs: list[str], out: str | Path, *, tokenizer: str = "bpe", vocab_size: int = 2048,
            val_inputs: Iterable[str] = (), val_fraction: float = 0.05, text_field: str = "text",
            invalid_utf8: str = "error", force: bool = False, progress: bool = True,
            log: Callable[[str], None] = print, what: str = "input", min_val_tokens: int = 0) -> PreparedData:
    """Tokenize `inputs` into `out` (see the module docstring); returns the opened directory.
    `val_fraction` and `min_val_tokens` apply only without `val_inputs`."""
    check_spec(tokenizer, "--tokenizer")
    if not val_inputs and not 0.0 < val_fraction < 0.5:  # nan fails too
        raise ShardlmError(f"the validation fraction must be in (0, 0.5), got {val_fraction}: training evaluates on "
                           "the validation split (or pass validation inputs with --val)")
    if invalid_utf8 not in INVALID_UTF8_POLICIES:
        raise ShardlmError(f"invalid UTF-8 policy {invalid_utf8!r}; use error or replace")
    if tokenizer.startswith("bpe:") and not Path(tokenizer[4:]).is_file():
        raise ShardlmError(f"tokenizer file {tokenizer[4:]} does not exist; train one with `shardlm tokenizer train`")
    files = resolve_inputs(list(inputs), what)
    val_files = resolve_inputs(list(val_inputs), "validation input") if val_inputs else []
    if both := sorted(set(files) & set(val_files)):
        raise ShardlmError(f"{both[0]} is both a training and a validation input; pass it to only one of them")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ShardlmError(f"--out {out} is a file; pass a directory path")
    settings = _settings(files, val_files, tokenizer, vocab_size, val_fraction, text_field, invalid_utf8,
                         min_val_tokens)
    fp = _fingerprint(settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out, log):
        _clear_leftovers(out)
        if _up_to_date(out, fp, force):
            log(f"{out} is up to date; nothing to do")
            return open_prepared(out)
        tok = (train_tokenizer(files, vocab_size, max_bytes=BPE_TRAIN_MAX_BYTES, text_field=text_field,
                               invalid_utf8=invalid_utf8, log=log) if tokenizer == "bpe" else load_tokenizer(tokenizer))
        tmp = partial_sibling(out)
        tmp.mkdir()
        try:
            meta = _write(tmp, files, val_files, tok, token_dtype(tok.vocab_size), (val_fraction, min_val_tokens),
                          text_field, invalid_utf8, progress, log)
            meta |= {"settings": settings, "fingerprint": fp}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            swap_into_place(tmp, out)  # a kill between its renames is undone by the next `_clear_leftovers`
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return open_prepared(out)


def _up_to_date(out: Path, fingerprint: str, force: bool) -> bool:
    """True if `out` already holds exactly this data; raises if it holds something that must not be replaced."""
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    if not names:
        return False
    if META_FILE not in names:
        raise ShardlmError(f"--out {out} is a non-empty directory that shardlm did not prepare; choose a new or "
                           "empty directory")
    try:
        meta, problem = _read_meta(out), None
    except ShardlmError as e:  # unreadable or another format version: replaceable, with --force
        meta, problem = None, e
    if meta is not None and meta.get("fingerprint") == fingerprint and _damage(out, meta) is None:
        return True
    if not force:
        raise problem or ShardlmError(f"--out {out} holds data prepared from other inputs or settings; pass --force "
                                      "to replace it, or choose another --out")
    if foreign := sorted(names - OUR_FILES):
        raise ShardlmError(f"--out {out} also holds {', '.join(foreign)}, which shardlm did not write; move "
                           "them away or choose another --out")
    return False


def _write_val_files(val_files, stats: ReadStats, tok: Tokenizer, token_bytes, dtype, tmp: Path, text_field,
                     invalid_utf8, bar) -> tuple[dict, int]:
    """The validation split from its own inputs: (documents per split, the split's text bytes); `stats` then counts
    both splits' documents."""
    val_stats = ReadStats(bytes_read=stats.bytes_read)
    val_docs = read_documents(val_files, val_stats, text_field=text_field, invalid_utf8=invalid_utf8)
    val_bytes = _write_tokens(val_docs, tok, token_bytes, dtype, tmp / "val.bin", val_stats, bar)[1]
    if val_stats.documents == 0:
        raise ShardlmError("the validation inputs hold no documents; pass text")
    split_docs = {"train": stats.documents, "val": val_stats.documents}
    for k in ("documents", "text_bytes", "empty_skipped", "invalid_utf8_replaced"):
        setattr(stats, k, getattr(stats, k) + getattr(val_stats, k))
    return split_docs, val_bytes


def _split_tail(tmp: Path, n: int, starts, dtype, token_bytes, val_split: tuple[float, int], log
                ) -> tuple[dict, int, bool]:
    """The validation split cut from the tail of the `n` training tokens (documents starting at `starts`): (documents
    per split, the tail's text bytes, whether it starts mid-document)."""
    val_fraction, min_val_tokens = val_split
    cut, mid_document = _tail_cut(n, starts, val_fraction, min_val_tokens)
    if min(min_val_tokens, n // 2) > val_fraction * n:
        log(f"data: the validation split holds {(n - cut) / n:.0%} of the tokens, not {val_fraction:g}: "
            f"the text is small, and evaluation takes at least {min_val_tokens:,} (or half)")
    train_tokens = np.memmap(tmp / "train.bin", dtype=dtype, mode="r", shape=(n,))
    train_tokens[cut:].tofile(tmp / "val.bin")
    val_bytes = _split_bytes(train_tokens[cut:], token_bytes)  # the short tail only
    del train_tokens
    os.truncate(tmp / "train.bin", cut * dtype.itemsize)
    split_docs = {"train": int(np.sum(starts < cut)), "val": int(np.sum(starts >= cut)) + mid_document}
    return split_docs, val_bytes, mid_document


def _write(tmp: Path, files, val_files, tok: Tokenizer, dtype, val_split: tuple[float, int], text_field,
           invalid_utf8, progress, log) -> dict:
    val_fraction, min_val_tokens = val_split
    t0 = time.perf_counter()
    total_in = input_bytes(files) + (input_bytes(val_files) if val_files else 0)
    stats = ReadStats()
    token_bytes = tok.token_bytes()
    split_docs, mid_document = {}, False
    with tqdm(total=total_in, unit="B", unit_scale=True, desc="tokenizing", disable=not progress,
              dynamic_ncols=True) as bar:
        docs = read_documents(files, stats, text_field=text_field, invalid_utf8=invalid_utf8)
        starts, train_bytes = _write_tokens(docs, tok, token_bytes, dtype, tmp / "train.bin", stats, bar)
        n = (tmp / "train.bin").stat().st_size // dtype.itemsize
        if stats.documents == 0:
            raise ShardlmError(f"the inputs hold no documents ({stats.empty_skipped} empty); pass text")
        if val_files:
            split_docs, val_bytes = _write_val_files(val_files, stats, tok, token_bytes, dtype, tmp, text_field,
                                                     invalid_utf8, bar)
        else:
            split_docs, val_bytes, mid_document = _split_tail(tmp, n, starts, dtype, token_bytes, val_split, log)
            train_bytes -= val_bytes

    split_bytes = {"train": train_bytes, "val": val_bytes}
    splits = {}
    for split in SPLITS:
        f = tmp / f"{split}.bin"
        splits[split] = {"file": f.name, "num_tokens": f.stat().st_size // dtype.itemsize,
                         "num_documents": split_docs[split], "num_bytes": split_bytes[split], "sha256": _sha256(f)}
    tok.save(tmp)
    seconds = time.perf_counter() - t0
    log(f"tokenized {stats.documents:,} documents ({stats.text_bytes / 1e6:,.1f} MB of text) into "
        f"{splits['train']['num_tokens']:,} train + {splits['val']['num_tokens']:,} val tokens in {seconds:.1f}s "
        f"({total_in / 1e6 / max(seconds, 1e-9):,.1f} MB/s)"
        + (f"; skipped {stats.empty_skipped} empty documents" if stats.empty_skipped else "")
        + (f"; replaced {stats.invalid_utf8_replaced} invalid UTF-8 sequences" if stats.invalid_utf8_replaced else ""))
    return {
        "format": FORMAT, "version": VERSION, "tokenizer": tok.spec, "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id, "dtype": dtype.name, "num_documents": stats.documents,
        "num_tokens": sum(s["num_tokens"] for s in splits.values()), "num_text_bytes": stats.text_bytes,
        "empty_documents_skipped": stats.empty_skipped, "invalid_utf8_replaced": stats.invalid_utf8_replaced,
        "val_split": ({"inputs": [str(f) for f in val_files]} if val_files
                      else {"fraction": val_fraction, "starts_mid_document": mid_document,
                            **({"min_tokens": min_val_tokens} if min_val_tokens else {})}),
        "splits": splits, "prepare_seconds": round(seconds, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def cache_root() -> Path:
    """`$SHARDLM_CACHE_DIR`, else `$XDG_CACHE_HOME/shardlm`, else `~/.cache/shardlm`."""
    if os.environ.get("SHARDLM_CACHE_DIR"):
        return Path(os.environ["SHARDLM_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "shardlm"


def tokenizer_identity(data: PreparedData) -> tuple:
    """What makes two prepared directories' tokens the same vocabulary: the tokenizer's kind, its BPE file's
    SHA-256 (a trained BPE), and the document separator's id."""
    bpe = data.path / TOKENIZER_FILE
    return data.meta["tokenizer"], _sha256(bpe) if data.meta["tokenizer"] == "bpe" and bpe.is_file() else None, \
        data.meta["eot_id"]


def describe_tokenizer(data: PreparedData) -> str:
    kind = data.meta["tokenizer"]
    return f"the BPE of {data.path / TOKENIZER_FILE}" if kind == "bpe" else f"the {kind} tokenizer"


def shared_tokenizer(spec: str, first: PreparedData) -> str:
    """The tokenizer spec that prepares text into `first`'s vocabulary: for auto or bpe (a BPE trained on the text),
    the BPE `first` holds; otherwise `spec` itself."""
    if spec in ("auto", "bpe") and first.meta["tokenizer"] == "bpe":
        return f"bpe:{first.path / TOKENIZER_FILE}"
    return first.meta["tokenizer"] if spec == "auto" else spec


def training_data(d, *, progress: bool = True, log: Callable[[str], None] = print,
                  min_val_tokens: int = 0, what: str = "data.path") -> PreparedData:
    """The data a run trains on: a prepared directory as is, or text (or the built-in corpus) prepared once into
    the cache, its validation split at least `min_val_tokens` (up to half the text). `d` is the config's
    DataConfig; `what` names `d.path` in errors (a mixture's source: `data.sources[1] (notes)`)."""
    path = Path(d.path)
    if path.is_dir() and (path / META_FILE).exists():
        data = open_prepared(path)
        wanted = d.tokenizer
        if wanted.startswith("bpe:") and data.meta["tokenizer"] == "bpe":
            if not Path(wanted[4:]).is_file() or _sha256(Path(wanted[4:])) != _sha256(path / TOKENIZER_FILE) \
                    or load_tokenizer(wanted).eot_id != data.meta["eot_id"]:
                raise ShardlmError(f"{what}={path} was prepared with another BPE than {wanted[4:]} (or another "
                                   "document separator); prepare the data again with that tokenizer, or train on "
                                   "the directory's own (data.tokenizer=auto, without init.from)")
        elif wanted not in ("auto", data.meta["tokenizer"]):
            raise ShardlmError(f"{what}={path} was prepared with the {data.meta['tokenizer']} tokenizer, not "
                               f"{wanted}; set data.tokenizer=auto, or prepare the data again with {wanted}")
        return data
    spec = "bpe" if d.tokenizer == "auto" else d.tokenizer
    resolve_inputs([d.path], what)  # a missing or empty input fails before anything is announced
    key_settings = [str(path.resolve()) if path.exists() else d.path, spec, d.tokenizer_vocab, d.val_fraction,
                    d.text_field, d.invalid_utf8, min_val_tokens]
    key = hashlib.sha256(json.dumps(key_settings).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.name or "data")[:40]
    tag = "bpe" + str(d.tokenizer_vocab) if spec == "bpe" else re.sub(r"[^A-Za-z0-9]+", "", spec.split(":")[0])
    out = cache_root() / "data" / f"{slug}-{tag}-{key}"
    if not (out / META_FILE).exists():
        log(f"data: preparing {d.path} into {out} (once; later runs reuse it)")
    return prepare([d.path], out, tokenizer=spec, vocab_size=d.tokenizer_vocab, val_fraction=d.val_fraction,
                   text_field=d.text_field, invalid_utf8=d.invalid_utf8, force=True, progress=progress, log=log,
                   what=what, min_val_tokens=min_val_tokens)
