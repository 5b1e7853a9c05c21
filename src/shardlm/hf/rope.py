"""Rotary settings in config.json, both ways: `rope_theta` with `rope_scaling` (transformers 4.x, most checkpoints
on the Hub) or `rope_parameters` (transformers 5), read into shardlm's `model.rope_*` fields
(`shardlm.models.rope.Rope`), and written back in the 4.x spelling, which 5.x reads.

Design choices:
- The scalings shardlm computes (`default`, `llama3`, `yarn`) are read with every number they use; the others
  (linear, dynamic, longrope, a partial rotary factor) are refused by name, as the model would compute another
  model.
- Missing numbers take transformers' defaults (YaRN's beta_fast 32 and beta_slow 1; `original_max_position_
  embeddings` from the config's top level, where DeepSeek's and Qwen's configs may put it).
"""

from __future__ import annotations

from pathlib import Path

from shardlm.hf.config import refuse

_READ = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
         "beta_slow", "mscale", "mscale_all_dim")
_FIELDS = ("rope_factor", "rope_original_context", "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast",
           "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim")


def read_rope(t: dict, d: Path, default_theta: float) -> dict:
    """The `model.rope_*` fields of config.json `t` (in directory `d`)."""
    params = t.get("rope_parameters") or {}
    scaling = t.get("rope_scaling") or {}
    source, key = (scaling, "rope_scaling") if scaling else (params, "rope_parameters")
    kind = source.get("rope_type", source.get("type", "default"))
    theta = float(t.get("rope_theta", params.get("rope_theta", default_theta)))
    if source.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse(d, key, source, "shardlm rotates every feature of a head")
    if kind in (None, "default"):
        return dict(rope_theta=theta, rope_scaling="none")
    if kind not in ("llama3", "yarn"):
        raise refuse(d, key, source, f"rope scaling {kind!r}: shardlm implements plain, llama3 and yarn rotary "
                                     "embeddings")
    if source.get("attention_factor") is not None:
        raise refuse(d, key, source, "shardlm derives YaRN's attention factor from factor and mscale")
    values = {k: source[k] for k in _READ if source.get(k) is not None}
    values.setdefault("original_max_position_embeddings", t.get("original_max_position_embeddings",
                                                                t.get("max_position_embeddings")))
    if "factor" not in values or values["original_max_position_embeddings"] is None:
        raise refuse(d, key, source, f"{kind} scaling needs factor and original_max_position_embeddings")
    fields = {f: type_(values[k]) for k, f, type_ in zip(_READ, _FIELDS, (float, int, *[float] * 6)) if k in values}
    return dict(rope_theta=theta, rope_scaling=kind, **fields)


def write_rope(m) -> dict:
    """config.json's rotary keys for model config `m`: rope_theta, and rope_scaling (null when plain)."""
    if m.rope_scaling == "none":
        return {"rope_theta": m.rope_theta, "rope_scaling": None}
    scaling = {"rope_type": m.rope_scaling, "factor": m.rope_factor,
               "original_max_position_embeddings": m.rope_original_context}
    if m.rope_scaling == "llama3":
        scaling.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor)
    else:
        scaling.update(beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow)
        if m.rope_mscale and m.rope_mscale_all_dim:
            scaling.update(mscale=m.rope_mscale, mscale_all_dim=m.rope_mscale_all_dim)
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling}
