"""Pytrees as shardlm names and compares them: a leaf's path as a string, a tree's compile signature.

Design choices:
- Paths are `/`-joined, as plans match them and `explain` prints them ('blocks/0/attn/wq'); the `.value`
  attribute of an NNX Variable is not part of a parameter's name.
- A signature is what a jitted function is compiled for (structure, shapes, dtypes), so it keys compile caches.
"""

import jax
import numpy as np


def path_str(path) -> str:
    """A pytree key path as 'blocks/0/mha/value/kernel'. The `.value` attribute of an NNX Variable is dropped;
    a module or dict entry named 'value' (attention's value projection) is kept."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
            continue
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(parts)


def dtype_name(x) -> str:
    """An array's dtype (including JAX key types, which NumPy cannot name), or a Python scalar's."""
    return str(x.dtype) if hasattr(x, "dtype") else str(np.result_type(x))


def signature(tree) -> str:
    """Structure, shapes and dtypes: what a jitted function is compiled for."""
    return str(jax.tree.structure(tree)) + str([(np.shape(x), dtype_name(x)) for x in jax.tree.leaves(tree)])
