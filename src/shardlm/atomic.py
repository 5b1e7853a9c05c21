"""Directories and files that appear whole or not at all: built in a hidden sibling, then renamed into place.

`partial_sibling(out)` names the hidden directory to build in (`.<name>.partial-<pid>`), and `swap_into_place`
renames it to `out`. An existing `out` is first renamed aside (`.<name>.old-<pid>`) and removed after, so a
process killed between the two renames leaves the old directory beside its name, where the next writer (which
looks for these names) puts it back; never a half-written `out`. `install_file(data, target)` does the same for
one file (a hidden sibling named uniquely, fsynced, then `os.replace`).
"""

import os
import shutil
import uuid
from pathlib import Path


def partial_sibling(out: Path) -> Path:
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def swap_into_place(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def install_file(data: bytes, target: Path) -> Path:
    """Write `data` to `target` atomically: a new file beside it (mode from the umask, as tiktoken's own), then
    os.replace."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target
