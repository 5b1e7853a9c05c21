"""Documents from text inputs: TinyStories-style `.txt`, plain text, JSONL, Parquet, folders, the built-in corpus.

Rules (the same for every format):
- A line or run of text `<|endoftext|>` separates documents. A `.txt` file without one is one document, which is
  how TinyStories' published files (`TinyStories-train.txt`, `TinyStories-valid.txt`) and plain books both work.
- JSONL: one JSON object per line, the document in its `text` field (`--text-field` / `data.text_field`).
  Parquet (e.g. the Hugging Face TinyStories shards): the `text` column.
- A folder is read recursively: its `.txt`, `.jsonl` and `.parquet` files in sorted path order.
- Surrounding whitespace is stripped from each document; empty documents (between two separators, or an empty
  record) are skipped and counted. A UTF-8 byte-order mark at the start of a file is dropped.
- Invalid UTF-8 is an error naming the file and the byte offset, unless `invalid_utf8="replace"`: then each bad
  byte sequence becomes U+FFFD and is counted (`meta.json` reports the count). An unpaired surrogate spelled by
  a JSON escape is treated the same way, naming the line.
- A missing input, an empty file, or inputs holding no documents at all are one-line errors.
"""

import dataclasses
import json
import mmap
import re
from pathlib import Path
from typing import Iterator

from shardlm.data.corpus import BUILTIN_CORPORA, builtin_documents, builtin_version
from shardlm.data.tokenizer import EOT
from shardlm.errors import ShardlmError

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
INVALID_UTF8_POLICIES = ("error", "replace")
_SEP = EOT.encode()
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark (Windows editors) opens a file, not a document


@dataclasses.dataclass
class ReadStats:
    """What reading the inputs found; `bytes_read` drives the progress bar."""

    documents: int = 0
    text_bytes: int = 0  # UTF-8 bytes of the documents kept (after stripping)
    empty_skipped: int = 0
    invalid_utf8_replaced: int = 0
    bytes_read: int = 0


def resolve_inputs(inputs: list[str], what: str = "input") -> list[str]:
    """Input names -> files (folders expanded) or built-in corpus names, checked to exist and be non-empty.
    `what` names the inputs in error messages (`input`, `data.path`, ...)."""
    if not inputs:
        raise ShardlmError("no inputs given; pass text files, folders, .jsonl or .parquet files")
    out: list[str] = []
    for name in inputs:
        if name in BUILTIN_CORPORA and not Path(name).exists():
            out.append(name)
            continue
        path = Path(name)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not files:
                raise ShardlmError(f"folder {path} holds no {', '.join(TEXT_SUFFIXES)} files; pass a folder of text")
        elif path.is_file():
            files = [path]
        else:
            prepared = "a prepared data directory, " if what.startswith("data.") else ""
            raise ShardlmError(f"{what} {name} does not exist; pass an existing text, .jsonl or .parquet file, a "
                               f"folder of them, {prepared}or a built-in corpus ({', '.join(BUILTIN_CORPORA)})")
        for f in files:
            if f.stat().st_size == 0:
                raise ShardlmError(f"{what} {f} is an empty file; remove it from the inputs")
            out.append(str(f.resolve()))
    return out


def identity(inputs: list[str]) -> list[dict]:
    """Path, size and modification time of each resolved input: what decides whether prepared data is current."""
    ids = []
    for name in inputs:
        if name in BUILTIN_CORPORA:
            ids.append({"builtin": name, "version": builtin_version(name)})
        else:
            st = Path(name).stat()
            ids.append({"path": name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    return ids


_FIX = "replace bad bytes with U+FFFD and count them with --invalid-utf8 replace (data.invalid_utf8=replace)"
_REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")


def _decoder(policy: str, stats: ReadStats):
    def decode(raw: bytes, path: str, offset: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if policy == "error":
                raise ShardlmError(f"{path} is not valid UTF-8 at byte offset {offset + e.start} ({e.reason}); fix "
                                   f"the file, or {_FIX}") from None
            text = raw.decode("utf-8", errors="replace")
            # Each bad sequence became one U+FFFD; the U+FFFDs spelled correctly in the input are not repairs.
            stats.invalid_utf8_replaced += text.count(_REPLACEMENT) - raw.count(_REPLACEMENT.encode())
            return text

    return decode


def _unicode(value: str, policy: str, stats: ReadStats, where: str) -> str:
    """JSON escapes can spell unpaired surrogates (\\ud800), which no UTF-8 encodes: the same policy applies."""
    bad = _SURROGATE.findall(value)
    if not bad:
        return value
    if policy == "error":
        raise ShardlmError(f"{where} holds an unpaired surrogate (\\u{ord(bad[0]):04x}), which is not valid Unicode; "
                           f"fix the file, or {_FIX}")
    stats.invalid_utf8_replaced += len(bad)
    return _SURROGATE.sub(_REPLACEMENT, value)


def _keep(doc: str, stats: ReadStats, count_empty: bool = True) -> str | None:
    doc = doc.strip()
    if not doc:
        stats.empty_skipped += count_empty
        return None
    stats.documents += 1
    stats.text_bytes += len(doc.encode("utf-8"))
    return doc


def _record_documents(value: str, stats: ReadStats) -> Iterator[str]:
    """A JSONL or Parquet record: usually one document; a separator inside it splits it like a .txt file."""
    parts = [d for d in (_keep(p, stats, count_empty=False) for p in value.split(EOT)) if d is not None]
    stats.empty_skipped += not parts
    yield from parts


def _text_documents(path: str, decode, stats: ReadStats) -> Iterator[str]:
    base = stats.bytes_read
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        start, size = len(_BOM) if mm[: len(_BOM)] == _BOM else 0, len(mm)
        while start <= size:
            end = mm.find(_SEP, start)
            end = size if end == -1 else end
            raw = mm[start:end]
            stripped = raw.lstrip()
            offset = start + len(raw) - len(stripped)
            # Whitespace before the first or after the last separator is layout, not an empty document.
            interior = start > len(_BOM) and end < size
            doc = _keep(decode(stripped.rstrip(), path, offset), stats, count_empty=interior)
            stats.bytes_read = base + end
            if doc is not None:
                yield doc
            start = end + len(_SEP)


def _jsonl_documents(path: str, field: str, decode, policy: str, stats: ReadStats) -> Iterator[str]:
    offset = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if lineno == 1 and line.startswith(_BOM):
                line, offset = line[len(_BOM) :], len(_BOM)
                stats.bytes_read += len(_BOM)
            text = decode(line, path, offset)
            offset += len(line)
            stats.bytes_read += len(line)
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ShardlmError(f"{path}:{lineno} is not valid JSON ({e.msg}); JSONL needs one object per line") from None
            if not isinstance(obj, dict) or field not in obj:
                raise ShardlmError(f"{path}:{lineno} has no {field!r} field; name the text field with --text-field "
                                   "(data.text_field)")
            value = obj[field]
            if value is None:
                stats.empty_skipped += 1
                continue
            if not isinstance(value, str):
                raise ShardlmError(f"{path}:{lineno}: field {field!r} is {type(value).__name__}, not text")
            yield from _record_documents(_unicode(value, policy, stats, f"{path}:{lineno}"), stats)


def _parquet_documents(path: str, field: str, stats: ReadStats) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ShardlmError(f"{path} is not a readable Parquet file ({str(e)[:100]})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise ShardlmError(f"{path} has no {field!r} column (columns: {', '.join(names)}); name it with "
                           "--text-field (data.text_field)")
    size, rows, done = Path(path).stat().st_size, max(pf.metadata.num_rows, 1), 0
    base = stats.bytes_read
    for batch in pf.iter_batches(batch_size=8192, columns=[field]):
        column = batch.column(0)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise ShardlmError(f"{path}: column {field!r} is {column.type}, not text")
        for value in column.to_pylist():  # Arrow strings are valid UTF-8 by construction
            if value is None:
                stats.empty_skipped += 1
                continue
            yield from _record_documents(value, stats)
        done += len(column)
        stats.bytes_read = base + size * done // rows


def _builtin_documents(name: str, stats: ReadStats) -> Iterator[str]:
    for text in builtin_documents(name):
        stats.bytes_read += len(text.encode("utf-8"))
        yield from _record_documents(text, stats)


def read_documents(inputs: list[str], stats: ReadStats, *, text_field: str = "text",
                   invalid_utf8: str = "error") -> Iterator[str]:
    """Every document of the resolved inputs, in order. Fills `stats` as it goes."""
    if invalid_utf8 not in INVALID_UTF8_POLICIES:
        raise ShardlmError(f"invalid_utf8={invalid_utf8!r}; use error or replace")
    decode = _decoder(invalid_utf8, stats)
    for name in inputs:
        if name in BUILTIN_CORPORA:
            yield from _builtin_documents(name, stats)
        elif name.lower().endswith(".jsonl"):
            yield from _jsonl_documents(name, text_field, decode, invalid_utf8, stats)
        elif name.lower().endswith(".parquet"):
            yield from _parquet_documents(name, text_field, stats)
        else:
            yield from _text_documents(name, decode, stats)


def input_bytes(inputs: list[str]) -> int:
    return sum(len("".join(builtin_documents(n)).encode()) if n in BUILTIN_CORPORA else Path(n).stat().st_size
               for n in inputs)
