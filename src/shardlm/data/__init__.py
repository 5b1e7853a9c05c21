"""Data: corpora, tokenizers and the Grain loader."""
