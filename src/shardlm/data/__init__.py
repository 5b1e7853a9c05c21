"""Data: documents from text files and the built-in corpus (`sources`, `corpus`), tokenizers (`tokenizer`), token
files prepared once (`prepare`), and the Grain loader of sharded global batches (`loader`). Nothing here knows of
models or meshes beyond the batch sharding it is handed."""
