"""A run's tokenizer as Hugging Face tokenizer files (`tokenizer.json` and `tokenizer_config.json`), so that
`AutoTokenizer.from_pretrained(DIR)` gives shardlm's token ids.

Design choices:
- The tokenizer travels as a Hugging Face `tokenizer.json` whatever the run used: a BPE run's own file; for `gpt2`
  (tiktoken) and `bytes` the same tokens built as a byte-level BPE. tiktoken keeps no merges, so they are
  recovered from its ranks (`_merges_from_ranks`).
- A tokenizer that came from a Hugging Face checkpoint keeps its own `tokenizer_config.json` settings.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardlm.data.tokenizer import EOT, TOKENIZER_FILE
from shardlm.errors import ShardlmError


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters, the alphabet byte-level BPE vocabularies use
    (as in OpenAI's encoder.py and every byte-level tokenizer since)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges of a byte-level BPE given only its ranked tokens (tiktoken stores no merges): each token of two
    or more bytes is the merge of the two parts that BPE with the lower-ranked tokens leaves of it."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = min(((ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))))
            if best[0] >= rank:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def tokenizer_files(tokenizer, run_dir: Path, seq_len: int) -> dict[str, str]:
    """{file name: text}: the run's tokenizer as Hugging Face files."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    eot = getattr(tokenizer, "eot", EOT)
    source = getattr(tokenizer, "hf_config", {})  # a Hugging Face tokenizer's own config travels on as it was
    if tokenizer.spec == "bpe":
        text = (Path(run_dir) / TOKENIZER_FILE).read_text(encoding="utf-8")
    else:
        alphabet = bytes_to_unicode()
        if tokenizer.spec == "gpt2":
            enc = tokenizer.enc
            ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i != tokenizer.eot_id}
        else:  # bytes: token b is byte b, no merges
            ranks = {bytes([b]): b for b in range(256)}
        vocab = {"".join(alphabet[b] for b in token): i for token, i in ranks.items()}
        merges = [("".join(alphabet[b] for b in a), "".join(alphabet[b] for b in b_)) for a, b_ in
                  _merges_from_ranks(ranks)]
        hf = HF(models.BPE(vocab=vocab, merges=merges))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=tokenizer.spec == "gpt2")
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens([EOT])
        if hf.token_to_id(EOT) != tokenizer.eot_id:
            raise ShardlmError(f"internal: {EOT} became id {hf.token_to_id(EOT)}, not {tokenizer.eot_id}")
        text = hf.to_str()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eot, "eos_token": eot, "unk_token": None,
              "clean_up_tokenization_spaces": False, **source, "model_max_length": seq_len}
    return {TOKENIZER_FILE: text, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
