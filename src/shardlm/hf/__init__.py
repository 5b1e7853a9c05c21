"""Hugging Face interop, as pure converters: config.json <-> `ModelConfig`, safetensors <-> parameters, a tokenizer
-> tokenizer files. Nothing here knows of runs, training or loading; `shardlm.train.init_from` (`init.from=hf:DIR`),
`shardlm.load` (`hf:DIR` readers) and `shardlm.exporter` (`shardlm export`) put these pieces to work.

`config` maps config.json to shardlm's model config and back, and refuses what shardlm would compute differently;
`weights` says which safetensors tensor is which parameter, in which layout; `importer` reads every device's
shards straight into place; `tokenizer` turns a run's tokenizer into Hugging Face files; `writer` writes a model
directory (sharded safetensors, index, configs) atomically.
"""
