"""Hugging Face interop: checkpoints in (`init.from=hf:DIR`, `load_model("hf:DIR")`) and out (`shardlm export`).

`config` maps config.json to shardlm's model config and refuses what shardlm would compute differently;
`weights` says which safetensors tensor is which parameter, in which layout; `importer` reads every device's
shards straight into place; `exporter` writes a run as a directory transformers loads.
"""
