"""Sizes and rates as people write them and read them: bytes (`fmt_bytes`, `parse_bytes`) and network rates
(`format_rate`, `parse_rate`).

Design choices:
- Bytes are printed in binary units (KiB, MiB, GiB), as memory is allocated; sizes are read in either system, as
  users write them (`80GB` is 80e9, as an H100's datasheet means it; `24GiB` is 24 * 2**30).
- Rates are bits per second (`400 Gb/s`), as NICs are sold; `B` in a rate means bytes.
"""

import re

from shardlm.errors import ShardlmError


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; below 1 KiB whole bytes ('64 B')."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def parse_bytes(text: str, flag: str = "--memory") -> float:
    """'80GB' -> 80e9, '24GiB' -> 24 * 2**30, '16e9' -> 16e9; `flag` names the option in the error."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b?|b)?\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise ShardlmError(f"{flag} {text!r} is not a size; write e.g. 80GB, 24GiB or 16e9")
    unit = (m.group(2) or "b").rstrip("b") or "b"
    scale = {"b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    return float(m.group(1)) * scale[unit]


def format_rate(bytes_per_s: float) -> str:
    """50e9 -> '400 Gb/s', 400e9 -> '3.2 Tb/s': network rates in bits, as NICs are sold."""
    bits = bytes_per_s * 8
    return f"{bits / 1e12:g} Tb/s" if bits >= 1e12 else f"{bits / 1e9:g} Gb/s"


def parse_rate(text: str) -> float:
    """'400Gb/s', '400 Gbps', '3.2Tb/s', '50GB/s' -> bytes per second. b = bits, B = bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKMGT]?)(b|B)(?:/s|ps)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a rate; write e.g. 400Gb/s, 3.2Tb/s or 50GB/s (b = bits, B = bytes)")
    scale = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[m.group(2)]
    return float(m.group(1)) * scale / (8 if m.group(3) == "b" else 1)


def parse_duration(text: str, flag: str = "--budget") -> float:
    """'5m' -> 300, '90s' -> 90, '1.5h' -> 5400, '300' -> 300 seconds; `flag` names the option in the error."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|sec|m|min|h)?\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise ShardlmError(f"{flag} {text!r} is not a duration; write e.g. 5m, 90s or 1h")
    return float(m.group(1)) * {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[m.group(2) or "s"]


def fmt_duration(seconds: float) -> str:
    """A wall-clock duration as people say it: 45 s, 6 min 20 s, 1 h 05 min."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
