"""The data of a run: prepared once (by process 0, while the others wait) and checked against the model.

`load_data` is what `shardlm train` opens; `tokenizer_vocab` is the vocabulary a model is built for, which
`plan`, `bench`, `profile` and `explain` need without training (they prepare text that was never prepared, as a
run would).
"""

from tqdm.auto import tqdm

from shardlm import distributed
from shardlm.config import Config
from shardlm.data.prepare import PreparedData, training_data
from shardlm.errors import ShardlmError


def load_data(cfg: Config, progress: bool = False, log=None) -> PreparedData:
    """The prepared data (preparing text into the cache first if needed), checked against model.vocab_size. In a
    run of several processes, process 0 prepares text while the others wait, then they find it ready (on a
    filesystem they share; elsewhere each host prepares its own copy, and `agree` checks that they match)."""
    if distributed.is_multiprocess() and not distributed.is_primary():
        distributed.barrier("data-prepared")
    data = training_data(cfg.data, progress=progress, log=log or tqdm.write)
    if distributed.is_multiprocess() and distributed.is_primary():
        distributed.barrier("data-prepared")
    vocab = data.tokenizer.vocab_size
    if cfg.model.vocab_size and cfg.model.vocab_size < vocab:
        raise ShardlmError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab}; "
            "set model.vocab_size=0 to use the tokenizer's"
        )
    return data


def tokenizer_vocab(cfg: Config, log=None) -> int:
    """The vocabulary the model is built for: `model.vocab_size`, else the data's tokenizer's (preparing the data
    first if it is text that was never prepared)."""
    return cfg.model.vocab_size or load_data(cfg, log=log).tokenizer.vocab_size
