"""Tokenizers, named by a spec string: `gpt2`, `bytes`, `bpe` (a trained BPE stored next to the data) or `bpe:PATH`.

- `gpt2`: OpenAI's GPT-2 BPE through tiktoken (50,257 tokens, `<|endoftext|>` = 50256): tiktoken's `r50k_base`,
  GPT-2's ranks in one file (tiktoken's `gpt2` reads the same ranks from two older files; those are used when
  they are the ones cached), kept in tiktoken's cache (`$TIKTOKEN_CACHE_DIR`). Uncached, tiktoken downloads it
  (under a timeout), and failing that shardlm takes the same file from the package registry once (openai-whisper's
  source package ships it): `gpt2_ranks.py`.
- `bytes`: token id = UTF-8 byte value (0-255), `<|endoftext|>` = 256. No files, no training.
- `bpe:PATH`: a Hugging Face `tokenizers` JSON file, such as the byte-level BPE `shardlm tokenizer train` writes,
  or a Hugging Face model's `tokenizer.json`.

Every tokenizer has a document separator, `<|endoftext|>` where it has that token, which separates documents in
token files; a model's own tokenizer without it (Llama's) uses its end-of-sequence token instead, named by the
`tokenizer_config.json` beside the file (`eos_token`), as Hugging Face writes it. `encode` turns that text into the
special token. `encode_batch` tokenizes corpus documents, in parallel inside the Rust libraries; documents never
contain the separator (sources split on it), and tiktoken reads any other special-token text as plain text.
`token_bytes()` gives each token's UTF-8 length (0 for special tokens): it turns a per-token loss into
tokenizer-independent bits per byte. It is exact for byte-level tokenizers (all three kinds here); for a
`tokenizer.json` of another kind (normalizers, `<unk>`) it is the length of each token decoded alone, an estimate.
"""

import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from shardlm.data.gpt2_ranks import load_gpt2
from shardlm.errors import ShardlmError

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # Hugging Face's: names the special tokens


class Tokenizer:
    """What training, evaluation and sampling need from a tokenizer."""

    spec: str  # "gpt2" | "bytes" | "bpe": how `load_tokenizer` finds it again
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Ordinary text (no special tokens), many documents at once."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def token_bytes(self) -> np.ndarray:
        """[vocab_size] int32: each token's UTF-8 byte length, 0 for special tokens."""
        raise NotImplementedError

    def save(self, directory: Path) -> None:
        """Write the files `load_tokenizer(self.spec, directory)` needs (none for built-in tokenizers)."""


class ByteTokenizer(Tokenizer):
    spec = "bytes"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(text.split(EOT)):
            if i:
                ids.append(self.eot_id)
            ids.extend(part.encode("utf-8"))
        return ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            if int(i) == self.eot_id:
                out.append(run.decode("utf-8", errors="replace") + EOT)
                run = bytearray()
            elif 0 <= int(i) < 256:
                run.append(int(i))
        return "".join(out) + run.decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.array([1] * 256 + [0], np.int32)


class TiktokenTokenizer(Tokenizer):
    def __init__(self, encoding, spec: str = "gpt2"):
        self.enc = encoding
        self.spec = spec
        self.vocab_size = encoding.n_vocab
        if EOT not in encoding.special_tokens_set:
            raise ShardlmError(f"tiktoken encoding {encoding.name!r} has no {EOT} token; use gpt2")
        self.eot_id = encoding.encode_single_token(EOT)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special={EOT}, disallowed_special=())

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        ids = self.enc.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)
        return [np.asarray(x, np.int32) for x in ids]

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    def token_bytes(self) -> np.ndarray:
        special = self.enc.special_tokens_set
        out = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            try:
                piece = self.enc.decode_single_token_bytes(i)
            except KeyError:  # a gap in the vocabulary
                continue
            out[i] = 0 if piece.decode("utf-8", errors="ignore") in special else len(piece)
        return out


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer; the file travels with the data and the run as `tokenizer.json`."""

    spec = "bpe"

    def __init__(self, hf, source: str = "trained", eot: str | None = None, hf_config: dict | None = None):
        """`eot`: the document separator's text, when it is not `<|endoftext|>` (a model's end-of-sequence).
        `hf_config`: the Hugging Face tokenizer_config.json the file came with (kept with the run, and exported)."""
        self.hf = hf
        self.hf_config = hf_config or {}
        self.eot = eot or EOT
        eot_id = hf.token_to_id(self.eot)
        if eot_id is None:
            raise ShardlmError(f"tokenizer {source} has no {self.eot} token"
                               + ("; train one with `shardlm tokenizer train`" if eot is None else ""))
        self.eot_id = eot_id
        self.vocab_size = hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int32) for e in self.hf.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        cfg = json.loads(self.hf.to_str())
        byte_level = "ByteLevel" in json.dumps([cfg.get("pre_tokenizer"), cfg.get("decoder")])
        special = {t.content for t in self.hf.get_added_tokens_decoder().values() if t.special}
        out = np.zeros(self.vocab_size, np.int32)
        for token, i in self.hf.get_vocab(with_added_tokens=True).items():
            if token in special or i >= self.vocab_size:
                continue
            # A byte-level token spells each byte as one character; otherwise decode it and count.
            out[i] = len(token) if byte_level else len(self.hf.decode([i]).encode("utf-8"))
        return out

    @property
    def bos_id(self) -> int | None:
        """The beginning-of-sequence token a Hugging Face tokenizer names (shardlm's data does not use it)."""
        bos = _content(self.hf_config.get("bos_token"))
        return None if bos is None else self.hf.token_to_id(bos)

    def save(self, directory: Path) -> None:
        self.hf.save(str(Path(directory) / TOKENIZER_FILE))
        if self.hf_config or self.eot != EOT:  # which token separates documents, as Hugging Face says it
            config = self.hf_config or {"eos_token": self.eot}
            (Path(directory) / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def gpt2_tokenizer(timeout_s: float | None = None) -> TiktokenTokenizer:
    """GPT-2's tokenizer: tiktoken's ranks from its cache, its download (bounded by `timeout_s`) or the package
    registry (`shardlm.data.gpt2_ranks.load_gpt2`)."""
    return TiktokenTokenizer(load_gpt2(timeout_s))


def _content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def hf_tokenizer_config(directory: Path) -> dict:
    """The tokenizer_config.json in `directory` ({} if there is none)."""
    path = Path(directory) / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ShardlmError(f"{path} is not a tokenizer config (JSON)") from None
    if not isinstance(config, dict):
        raise ShardlmError(f"{path} is not a tokenizer config (a JSON object)")
    return config


def load_hf_tokenizer(path: str | Path) -> HFTokenizer:
    from tokenizers import Tokenizer as HF

    path = Path(path)
    if not path.is_file():
        raise ShardlmError(f"tokenizer file {path} does not exist; train one with `shardlm tokenizer train`")
    try:
        hf = HF.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception
        raise ShardlmError(f"{path} is not a Hugging Face tokenizer file ({str(e)[:100]})") from None
    config = hf_tokenizer_config(path.parent)
    eot = None if hf.token_to_id(EOT) is not None else _content(config.get("eos_token"))
    return HFTokenizer(hf, source=str(path), eot=eot, hf_config=config)


def load_hf_dir_tokenizer(directory: str | Path, *, tiktoken: bool = True) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory: its `tokenizer.json`, else GPT-2's slow files (vocab.json
    and merges.txt), else (with `tiktoken`), for a GPT-2 checkpoint of GPT-2's vocabulary, tiktoken's gpt2."""
    directory = Path(directory)
    if (directory / TOKENIZER_FILE).is_file():
        return load_hf_tokenizer(directory / TOKENIZER_FILE)
    if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        from tokenizers import Tokenizer as HF
        from tokenizers import decoders, models, pre_tokenizers

        hf = HF(models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt")))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        config = hf_tokenizer_config(directory)
        eot = EOT if hf.token_to_id(EOT) is not None else _content(config.get("eos_token"))
        if eot is not None and hf.token_to_id(eot) is not None:
            hf.add_special_tokens([eot])  # the separator is one token, never spelled out in pieces
        return HFTokenizer(hf, source=str(directory), eot=eot, hf_config=config)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        config = {}
    if tiktoken and config.get("model_type") == "gpt2" and config.get("vocab_size") == 50257:
        return gpt2_tokenizer()
    raise ShardlmError(f"hf:{directory} holds no tokenizer ({TOKENIZER_FILE}, or vocab.json and merges.txt); save "
                       "the tokenizer there too (tokenizer.save_pretrained), or, training from it (init.from), set "
                       "data.tokenizer")


def check_spec(spec: str, where: str) -> None:
    """Syntax only: `gpt2`, `bytes`, `bpe` or `bpe:PATH`."""
    if spec in ("gpt2", "bytes", "bpe") or (spec.startswith("bpe:") and len(spec) > 4):
        return
    raise ShardlmError(f"{where}={spec!r} is not a tokenizer; use gpt2, bytes, bpe (trained on the data) or bpe:PATH")


def load_tokenizer(spec: str, directory: str | Path | None = None) -> Tokenizer:
    """`gpt2`, `bytes`, `bpe:PATH`, or `bpe` = the `tokenizer.json` in `directory` (a data or run directory)."""
    if spec == "gpt2":
        return gpt2_tokenizer()
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        return load_hf_tokenizer(spec[4:])
    if spec == "bpe" and directory is not None:
        return load_hf_tokenizer(Path(directory) / TOKENIZER_FILE)
    raise ShardlmError(f"unknown tokenizer {spec!r}; use gpt2, bytes or bpe:PATH")


def train_bpe(texts: Iterable[str], vocab_size: int, *, show_progress: bool = False) -> HFTokenizer:
    """A GPT-2-style byte-level BPE with `<|endoftext|>`, trained with Hugging Face `tokenizers`."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ShardlmError(f"a BPE vocabulary needs at least 257 tokens (256 bytes + {EOT}), got {vocab_size}")
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(hf)
