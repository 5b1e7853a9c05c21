"""Compiled steps as shardlm read them, kept on disk and found again by their program: a plan run again (with a
larger `--budget`, after an interruption, with one more `--remat`) compiles only what it has not compiled before.

    with caching_steps(directory):        # `shardlm plan --cache DIR` (default: `default_directory`)
        ... compile_step(...) ...         # `shardlm.perf.compiled` looks an entry up before compiling

Design choices:
- What is kept is shardlm's reading of a compile (a `CompiledStep`: the memory analysis, the collectives, the
  kernel program, XLA:GPU's schedule, what the partitioner logged), not the executable. JAX's persistent
  compilation cache keeps executables, and a plan reads more than an executable carries: XLA:GPU's
  latency-hiding schedule comes from a dump written while compiling and the partitioner's rematerialisations
  from its log, neither of which a cached executable gives back; and a plan never runs what it compiles.
- The key is a SHA-256 of everything a reading depends on: the lowered program's text (StableHLO, without source
  locations, its module's name, and the callback addresses `custom_partitioning` writes into it), the caller's parts
  (device count, platform, the devices compiled for, XLA options, the matmul FLOPs counted from the jaxpr),
  XLA_FLAGS, JAX's and jaxlib's versions, and shardlm's own source (a change to any reader is a new key: no entry
  outlives the code that read it).
- One file per entry, written under a temporary name and renamed into place (`shardlm.atomic.install_file`):
  an interrupted write leaves no half entry. An entry that does not load (another Python, a truncated file) is
  treated as absent and rewritten.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import re
from pathlib import Path

import shardlm
from shardlm.atomic import install_file
from shardlm.data.prepare import cache_root

_active: StepCache | None = None


def default_directory() -> Path:
    """steps/ in shardlm's cache directory (`shardlm.data.prepare.cache_root`: $SHARDLM_CACHE_DIR, else
    $XDG_CACHE_HOME/shardlm, else ~/.cache/shardlm)."""
    return cache_root() / "steps"


@functools.cache
def _source_digest() -> str:
    """SHA-256 of shardlm's own source files, in path order."""
    h = hashlib.sha256()
    root = Path(shardlm.__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


# A `custom_partitioning` call (cuDNN attention's) names its Python callback by address in its backend config: a
# new number every process, the same program. JAX's own cache key drops it too (`jax._src.cache_key`).
_CALLBACK_ADDRESS = re.compile(r'(@CustomSPMDPartitioning\(.*?backend_config = )"\d+"')


# The planner names each program after its candidate (`jit_step_fsdp8_remat_full`), and the same program is named
# after another candidate when the remat policy comes from `--remat` rather than from the config.
_MODULE_NAME = re.compile(r"^module @\S+", re.M)


def program_text(lowered) -> str:
    """The lowered program's text, with what differs between processes or names for the same program taken out."""
    return _MODULE_NAME.sub("module @step", _CALLBACK_ADDRESS.sub(r'\1"callback"', lowered.as_text()), count=1)


class StepCache:
    """Entries in `directory`, one file each; `hits` counts the lookups that found one."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.hits = 0
        self.unwritable: str | None = None  # why an entry could not be written, if one could not

    def key(self, lowered, **parts) -> str:
        import jax
        import jaxlib

        h = hashlib.sha256(program_text(lowered).encode())
        extra = sorted((k, repr(v)) for k, v in parts.items())
        for item in (extra, os.environ.get("XLA_FLAGS", ""), jax.__version__, jaxlib.__version__, _source_digest()):
            h.update(repr(item).encode())
        return h.hexdigest()

    def get(self, key: str):
        try:
            with open(self.directory / f"{key}.pkl", "rb") as f:
                value = pickle.load(f)
        except Exception:  # absent, truncated, or written by another Python: compile again
            return None
        self.hits += 1
        return value

    def put(self, key: str, value) -> None:
        """Keep `value` under `key`, written whole or not at all (`install_file`). A directory that cannot be
        written (read-only, full) costs the cache, not the plan: the reason is kept in `unwritable` for the caller
        to say."""
        try:
            install_file(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), self.directory / f"{key}.pkl")
        except OSError as e:
            self.unwritable = str(e)


def active() -> StepCache | None:
    """The cache compiles look up, if one is on (`caching_steps`)."""
    return _active


@contextlib.contextmanager
def caching_steps(directory: Path | str | None):
    """Look compiled steps up in `directory` (and keep new ones there) within the block; None turns it off."""
    global _active
    before, _active = _active, (StepCache(Path(directory)) if directory is not None else None)
    try:
        yield _active
    finally:
        _active = before


__all__ = ["StepCache", "active", "caching_steps", "default_directory"]
