"""A model from the user's own Python file, named `py:path/to/file.py:build`, for `shardlm train`, `plan`, `bench`,
`explain`, `profile` and `generate` (`model=py:...`).

    def build(vocab_size: int, seq_len: int, rngs: nnx.Rngs) -> nnx.Module:   # any of these, or none
        return MyLM(vocab_size, rngs=rngs)

Design choices:
- The file is imported as a module of its own, under a name derived from its resolved path and not placed on
  `sys.path`, so two models in files of the same name never shadow each other or the user's packages; it is
  imported once per process. A missing file, a file that fails to import (its exception's first line is kept), a
  missing function and a name that is not a function are one-line errors.
- `build` is called with the keyword arguments it declares among those shardlm offers (`OFFERED`): the
  vocabulary and sequence length the run's data needs, the compute and parameter dtypes, the dropout rate, and
  an `nnx.Rngs` from the run's seed. A required parameter shardlm does not offer is an error naming it, since a
  default is the only way shardlm could call it.
- What it returns becomes an NNX module: an `nnx.Module` as it is; a Linen module, initialised on a [1, seq_len]
  token array through the call adapter (or its `__call__`) and wrapped as `LinenModel` (`foreign.linen`); or a
  (Linen module, variables) pair. Anything else is an error naming the type, so the trainer, its checkpoints and the plan's
  patterns deal with one kind of model.
- A call adapter (`model.call=NAME`, a function in the same file, or `py:FILE:NAME`) runs the model when it is not
  `model(tokens) -> logits`: `call(model, tokens)`, or `call(model, tokens, train)` when it declares `train`
  (True in the train step, False in evaluation and generation), for models whose training mode is an argument.

Importing this module does not import JAX: the run config checks `py:` names before JAX starts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Callable

from shardlm.errors import ShardlmError

PY_PREFIX = "py:"
# What `build` may declare, by name; anything else it requires is an error.
OFFERED = ("vocab_size", "seq_len", "dtype", "param_dtype", "dropout", "rngs")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_py(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PY_PREFIX)


def parse_spec(spec: str, key: str = "model") -> tuple[Path, str]:
    """'py:path/to/file.py:build' -> (Path('path/to/file.py'), 'build'), checking the form and that the file
    exists (the function is looked up when the file is imported)."""
    body = spec[len(PY_PREFIX):] if is_py(spec) else spec
    path, sep, name = body.rpartition(":")
    if not sep or not path.endswith(".py") or not _NAME.fullmatch(name):
        raise ShardlmError(f"{key}={spec}: name a function in a Python file as py:PATH.py:FUNCTION, e.g. "
                           "py:models/my_lm.py:build")
    if not Path(path).is_file():
        raise ShardlmError(f"{key}={spec}: there is no file {path}; check the path (relative to the directory "
                           "shardlm runs in)")
    return Path(path), name


def load_function(spec: str, key: str = "model") -> Callable:
    """The function `spec` names ('py:FILE:NAME'), its file imported once per process."""
    path, name = parse_spec(spec, key)
    module = _import_file(path, key, spec)
    if not hasattr(module, name):
        defined = sorted(n for n, v in vars(module).items()
                         if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise ShardlmError(f"{key}={spec}: {path} defines no '{name}'"
                           + (f" (its functions: {', '.join(defined)})" if defined else "") + "; name one of them")
    fn = getattr(module, name)
    if not callable(fn) or inspect.isclass(fn):
        raise ShardlmError(f"{key}={spec}: '{name}' in {path} is a {type(fn).__name__}, not a function; name a "
                           "function that builds the model")
    return fn


def call_spec(call: str, model_spec: str) -> str:
    """`model.call`: a function NAME in the model's file, or a full py:FILE:NAME."""
    if is_py(call):
        return call
    path, _ = parse_spec(model_spec)
    return f"{PY_PREFIX}{path}:{call}"


def file_sha256(spec: str) -> str:
    """The fingerprint of the file that defines the model (recorded with every checkpoint)."""
    path, _ = parse_spec(spec)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _import_file(path: Path, key: str, spec: str):
    resolved = path.resolve()
    name = "shardlm_user_" + hashlib.sha1(str(resolved).encode()).hexdigest()[:12] + "_" + re.sub(r"\W", "_",
                                                                                                    path.stem)
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module  # before executing: dataclasses and pickling look the module up by name
    try:
        loader.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's code: any exception is reported in one line
        del sys.modules[name]
        where = ""
        if isinstance(e, SyntaxError) and e.lineno:
            where = f" (line {e.lineno})"
        first = (str(e).splitlines() or [""])[0]
        raise ShardlmError(f"{key}={spec}: importing {path} failed{where}: {type(e).__name__}: {first}; fix the file "
                           "(SHARDLM_DEBUG=1 shows the traceback)") from e
    return module


def declared(fn: Callable) -> tuple[set[str], set[str], bool]:
    """(parameters it accepts by keyword, those it requires, whether it takes **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    positional_only = [p.name for p in params if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
    if positional_only:
        required |= set(positional_only)  # reported as unmet below
    return named, required, any(p.kind == p.VAR_KEYWORD for p in params)


def offered_arguments(fn: Callable, offered: dict[str, Any], spec: str) -> dict[str, Any]:
    """The keyword arguments of `offered` that `fn` declares (all of them if it takes **kwargs); raises if it
    requires one shardlm does not offer."""
    named, required, var_kw = declared(fn)
    unmet = sorted(required - set(offered))
    if unmet:
        raise ShardlmError(f"model={spec}: {fn.__name__}() requires {', '.join(unmet)}, which shardlm does not pass "
                           f"(it passes any of {', '.join(OFFERED)} that the function declares); give "
                           f"{'it' if len(unmet) == 1 else 'them'} a default")
    return dict(offered) if var_kw else {k: v for k, v in offered.items() if k in named}


def takes_train_flag(call: Callable) -> bool:
    named, _, _ = declared(call)
    return "train" in named


def build_module(build: Callable, offered: dict[str, Any], spec: str, *, call: Callable | None = None,
                 seq_len: int, seed: int):
    """`build(**declared offers)` as an NNX module (a Linen module is initialised and wrapped: `LinenModel`).
    `call` is the model's call adapter (`call(model, tokens[, train])`), used to initialise a Linen module."""
    from flax import linen, nnx

    from shardlm.foreign.linen import initialised

    made = build(**offered_arguments(build, offered, spec))
    if isinstance(made, nnx.Module):
        return made
    init_call = None
    if call is not None:
        flag = {"train": False} if takes_train_flag(call) else {}
        init_call = lambda m, tokens: call(m, tokens, **flag)  # noqa: E731
    if isinstance(made, linen.Module):
        return initialised(made, None, init_call, seq_len, seed, spec)
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], linen.Module):
        variables = made[1]() if callable(made[1]) else made[1]
        return initialised(made[0], variables, init_call, seq_len, seed, spec)
    raise ShardlmError(f"model={spec}: {build.__name__}() returned a {type(made).__name__}; it must return an "
                       "nnx.Module, a Linen module, or a (Linen module, variables) pair")
