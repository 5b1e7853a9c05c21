"""The one exception type a user is meant to read.

Anything raised as `ShardlmError` is printed by the CLI as a single line (problem and fix) with exit code 2 and no
traceback; every other exception is a bug and keeps its traceback.
"""


class ShardlmError(Exception):
    """Bad input: a config key, a mesh, a path. The message names the problem and the fix."""


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
