"""Reading a mapping (a config, a plan, a Hugging Face config.json) from a YAML or JSON file, with every way it can
go wrong said in one line.

Design choices:
- One reader for every such file, so a missing file, an unreadable one, bytes that are not UTF-8, a syntax error
  (with its line and column) and a top level that is not a mapping read the same whatever the file is for; the
  caller names what the file is and how to fix it.
- A YAML error keeps PyYAML's position and reason but not its six-line rendering with the source echoed
  (`yaml_problem`).
"""

import json
from pathlib import Path

from shardlm.errors import ShardlmError


def yaml_problem(e: Exception) -> str:
    """A PyYAML error in one line, with its position and reason: "line 4, column 5: expected ',' or ']', but got
    ':' (while parsing a flow sequence that starts at line 3, column 5)". PyYAML's own text spreads that over six
    lines, with the source echoed."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if not problem:
        return (str(e).splitlines() or [type(e).__name__])[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    within = ""
    if context:
        within = f" ({context}" + (f" that starts at line {cmark.line + 1}, column {cmark.column + 1}"
                                   if cmark is not None else "") + ")"
    return f"{where}{problem}{within}"


def read_mapping(path: str | Path, what: str, *, missing: str, not_mapping: str, allow_empty: bool = False) -> dict:
    """The mapping at the top of the YAML (or, for a .json path, JSON) file `path`. Errors read "<what> <path> ...",
    ending with `missing` when the file does not exist and `not_mapping` when it holds something else; an empty
    YAML file is {} with `allow_empty`, else not a mapping."""
    import yaml

    path = Path(path)
    name = f"{what} {path}".strip()
    if not path.is_file():
        raise ShardlmError(f"{name} does not exist; {missing}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ShardlmError(f"{name} is not UTF-8 text; {not_mapping}") from None
    except OSError as e:
        raise ShardlmError(f"{name} could not be read: {e.strerror}") from None
    try:
        tree = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ShardlmError(f"{name} is not valid JSON: line {e.lineno}, column {e.colno}: {e.msg}") from None
    except yaml.YAMLError as e:
        raise ShardlmError(f"{name} is not valid YAML: {yaml_problem(e)}") from None
    if tree is None and allow_empty:
        return {}
    if not isinstance(tree, dict):
        raise ShardlmError(f"{name} must hold a mapping, not {type(tree).__name__}; {not_mapping}")
    return tree
