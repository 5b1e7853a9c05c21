"""Training shardlm's own models: the sharded state (`state`) and the jitted step (`step`) at the bottom; the run's
data (`data`), its checkpoints (`checkpoint`); a run directory's life and resumed config (`rundir`), a start from a
Hugging Face checkpoint (`init_from`), metrics and signals; and on top the loop (`loop.train`) and `shardlm
explain`'s view of a run's state (`explain`). The entry point is `shardlm.train.loop.train`."""
