"""Model families: one record each (`Family`), and the registry every other layer reads instead of branching on a
family's name.

Design choices:
- A family is its module (the nnx model class, math with logical axis names, in `shardlm.models`), the checks
  its config must pass beyond the shared ones (`shardlm.models.config.check_model`), its Hugging Face mapping
  (`shardlm.hf.format.HfFormat`), its part of the FLOP formula (the matrices of a dense MLP) and its presets.
  Adding a family is one `register(Family(...))`: configs, presets, training, `plan`, `explain`, import and
  export find it here (tests/test_extending.py adds one from a test file alone).
- The built-in families name their model class ("module:Class"), imported when a model is built, so that reading
  a config imports neither Flax nor the model code; a family registered from elsewhere may hand the class itself.
- This layer sits above the models and the converters and below everything that uses a family (the FLOP count,
  the config, the trainer): `family == ...` is written nowhere else.
"""

from shardlm.families.spec import (FAMILIES, Family, build_model, check_model_config, family_of, from_hf,
                                   hf_format, model_preset, preset_names, register)
# the built-in families register themselves, in this order (presets are listed in it)
from shardlm.families import gpt, llama, qwen, deepseek  # noqa: F401, I001

__all__ = ["FAMILIES", "Family", "build_model", "check_model_config", "family_of", "from_hf", "hf_format",
           "model_preset", "preset_names", "register"]
