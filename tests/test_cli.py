"""The CLI as a user runs it: exit codes and one-line errors, as real subprocesses and in this process (the
commands' runs and the files they write are the README's, in `test_quickstart`)."""

import os
import subprocess
import sys

import pytest


def shardlm(*args, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "shardlm", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_one_line_error(proc, fragment):
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardlm: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert fragment in lines[0], lines[0]


BAD_INPUT = [
    (["mesh.data=3"], "uses 3 devices but 8 are available"),
    (["mesh.fsdp=-1", "mesh.tensor=-1"], "at most one degree may be -1"),
    (["mesh.tensor=8"], "is split 8 ways over mesh.tensor"),  # tiny has 4 heads
    (["mesh.data=8", "train.batch_size=12"], "train.batch_size=12 is split over data x fsdp = 8"),
    (["train.stepz=3"], "unknown config key 'train.stepz'"),
    (["train.steps=many"], "train.steps: expected int, got 'many'"),
    (["data.path=/no/such/file.txt"], "data.path /no/such/file.txt does not exist"),
    (["data.tokenizer=gpt3"], "data.tokenizer='gpt3' is not a tokenizer"),
]


@pytest.mark.parametrize("args, fragment", BAD_INPUT[:1] + BAD_INPUT[-2:-1])
def test_bad_input_is_a_one_line_error(tmp_path, args, fragment):
    """As a process: exit code 2, one line on stderr, no traceback, nothing written."""
    proc = shardlm("train", "--cpu-devices", "8", "--run-dir", str(tmp_path / "run"), *args)
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "run").exists()  # nothing written for a rejected run


@pytest.mark.parametrize("args, fragment", BAD_INPUT[1:-2] + BAD_INPUT[-1:])
def test_more_bad_input_is_a_one_line_error(tmp_path, capsys, args, fragment):
    """The same path in this process (a process each costs seconds of starting JAX; tests/test_properties.py draws
    many more refusals through `train` itself)."""
    from shardlm import cli

    code = cli.main(["train", "--run-dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("shardlm: error: ") and fragment in lines[0], err
    assert not (tmp_path / "run").exists()
