"""Directories that appear whole or not at all: built in a hidden sibling, then renamed into place.

`partial_sibling(out)` names the hidden directory to build in (`.<name>.partial-<pid>`), and `swap_into_place`
renames it to `out`. An existing `out` is first renamed aside (`.<name>.old-<pid>`) and removed after, so a
process killed between the two renames leaves the old directory beside its name, where the next writer (which
looks for these names) puts it back; never a half-written `out`.
"""

import os
import shutil
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
