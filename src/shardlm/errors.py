"""The one exception type a user is meant to read, and the value checks that raise it.

Anything raised as `ShardlmError` is printed by the CLI as a single line (problem and fix) with exit code 2 and no
traceback; every other exception is a bug and keeps its traceback.
"""


class ShardlmError(Exception):
    """Bad input: a config key, a mesh, a path. The message names the problem and the fix."""


# --- value checks that raise it, shared by every config section ----------------------------------------------------

def check_positive(key: str, value: float) -> None:
    import math

    if not (value > 0 and math.isfinite(value)):  # also rejects nan and inf
        raise ShardlmError(f"{key} must be a positive finite number, got {value}")


def check_in_range(key: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value < hi:  # nan fails too
        raise ShardlmError(f"{key} must be in [{lo}, {hi}), got {value}")


def check_one_of(key: str, value: str, allowed, hint: str = "") -> None:
    if value not in allowed:
        raise ShardlmError(f"{key}={value!r} is not one of: {', '.join(allowed)}{hint}")
