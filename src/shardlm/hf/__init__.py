"""Hugging Face interop, as pure converters: config.json <-> `ModelConfig`, safetensors <-> parameters, a tokenizer
-> tokenizer files. Nothing here knows of runs, training or loading; `shardlm.train.init_from` (`init.from=hf:DIR`),
`shardlm.load` (`hf:DIR` readers) and `shardlm.exporter` (`shardlm export`) put these pieces to work.

`config` reads and writes config.json and `weights` checks a checkpoint's tensors against the model and reads them
by slices, both through a family's mapping (`format.HfFormat`: `gpt2` and `llama` are the built-in families',
each registered with its family in `shardlm.families`), whose parameters are `views` of the tensors; `importer`
reads every device's shards straight into place; `tokenizer` turns a run's tokenizer into Hugging Face files;
`writer` writes a model directory (sharded safetensors, index, configs) atomically.
"""
