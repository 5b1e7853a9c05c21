"""The one exception type a user is meant to read.

Anything raised as `ShardlmError` is printed by the CLI as a single line (problem and fix) with exit code 2 and no
traceback; every other exception is a bug and keeps its traceback.
"""


class ShardlmError(Exception):
    """Bad input: a config key, a mesh, a path. The message names the problem and the fix."""
