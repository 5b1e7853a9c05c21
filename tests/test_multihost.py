"""Runs of several processes, as a user starts them: `shardlm launch` (or `shardlm train --coordinator ...` by
hand), each process simulating its share of the devices, JAX's distributed runtime joining them over 127.0.0.1
and gloo carrying the collectives. Checked against one process with all 8 devices: the same losses, checkpoints
that move between process counts, stopping together on SIGTERM, a killed process, and bad input.

The runs are few and small (a 2-layer model, 8 steps): each launch costs a few seconds of start-up per process
on top of its compile, and each step on gloo about a second on 2 cores; the suite has a budget. 8 steps are enough
for what the tests read: a checkpoint mid-run (4) with an evaluation (6) after it, so that every resume here (of a
one-process checkpoint, of a stopped launch, of a killed one) continues past an evaluation to the end."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlm.config import load_config
from shardlm.checkpoint import RunCheckpoints
from shardlm.train.loop import train

from conftest import MIXTURE

# Dropout on, so that parity also covers the RNG stream across processes. An evaluation mid-run (6) and at the end,
# checkpoints at 4 and 8 (warm-up 5 steps, then decay). A two-source mixture: each process reads its rows of the
# mixed stream.
STEPS = 8
RUN = ["model.n_layers=2", "model.n_heads=4", "model.d_model=64", "model.d_mlp=128", "model.seq_len=32",
       "model.dropout=0.1", "train.batch_size=16", f"train.steps={STEPS}", "train.warmup_steps=5", "train.lr=1e-2",
       "train.log_interval=1", "train.eval_interval=6", "train.eval_batches=2", "train.sample_tokens=0",
       "data.tokenizer=bytes", "checkpoint.every=4", MIXTURE]
FSDP4_TP2 = ["mesh.fsdp=4", "mesh.tensor=2"]
# Pipeline stages outermost: on 4 processes of 2 devices each stage spans two processes, and the hand-offs between
# stages cross processes (gloo), as between hosts.
PP2_FSDP2_TP2 = ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2"]
LAUNCH_TIMEOUT = 300


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


def checkpoint_steps(run_dir: Path) -> list[int]:
    ck = RunCheckpoints(run_dir, read_only=True)
    try:
        return ck.steps()
    finally:
        ck.close()


def shardlm_command(*args) -> list[str]:
    return [sys.executable, "-m", "shardlm", *args]


def launch(processes: int, devices: int, run_dir: Path, *overrides, log_dir: Path, heartbeat: int | None = None,
           background: bool = False):
    """`shardlm launch --processes P --cpu-devices D -- train --run-dir RUN ...`; its own output goes to
    `log_dir/launcher.log` (process 0's is in it), the other processes' to `log_dir/process-<i>.log`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = shardlm_command("launch", "--processes", str(processes), "--cpu-devices", str(devices), "--log-dir",
                          str(log_dir), *(["--heartbeat-timeout", str(heartbeat)] if heartbeat else []),
                          "--", "train", "--run-dir", str(run_dir), "--no-progress", *RUN, *overrides)
    out = open(log_dir / "launcher.log", "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out.close()
    if background:
        return proc
    proc.wait(timeout=LAUNCH_TIMEOUT)
    return proc


def launcher_log(log_dir: Path) -> str:
    return (log_dir / "launcher.log").read_text()


def pid_of(log_dir: Path, process: int) -> int:
    for line in launcher_log(log_dir).splitlines():
        if line.startswith(f"shardlm launch: process {process}: pid "):
            return int(line.split("pid ")[1].split(",")[0])
    raise AssertionError(f"no pid for process {process} in\n{launcher_log(log_dir)}")


def wait_for(predicate, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def assert_close_losses(got: dict, want: dict, steps, first_tol: float, last_tol: float):
    for step in steps:
        tol = first_tol if step == min(steps) else last_tol
        assert abs(got[step] - want[step]) <= tol * abs(want[step]), (step, got[step], want[step])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process with all 8 devices, per strategy: the runs every multi-process run must reproduce."""
    runs = {}

    def get(name: str, mesh: list[str]) -> Path:
        if name not in runs:
            run_dir = tmp_path_factory.mktemp("reference") / name
            train(load_config(None, RUN + mesh), run_dir, progress=False)
            runs[name] = run_dir
        return runs[name]

    return get


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Runs of `processes` x `devices`, per strategy, each launched once for the module; (run dir, log dir)."""
    runs = {}

    def get(processes: int, devices: int, name: str, mesh: list[str]) -> tuple[Path, Path]:
        key = (processes, devices, name)
        if key not in runs:
            root = tmp_path_factory.mktemp(f"launched-{processes}x{devices}-{name}")
            proc = launch(processes, devices, root / "run", *mesh, log_dir=root / "logs")
            assert proc.returncode == 0, launcher_log(root / "logs")[-3000:]
            runs[key] = root / "run", root / "logs"
        return runs[key]

    return get


# Each layout once and each hybrid once (the suite's budget: a launched run costs ~30 s on 2 cores); the multihost
# benchmark runs more hybrids on both layouts.
@pytest.mark.parametrize("processes, devices, name, mesh", [(2, 4, "fsdp4_tp2", FSDP4_TP2),
                                                             (4, 2, "pp2_fsdp2_tp2", PP2_FSDP2_TP2)])
def test_processes_train_like_one_process(reference, launched, processes, devices, name, mesh):
    ref = reference(name, mesh)
    run_dir, logs = launched(processes, devices, name, mesh)
    log = launcher_log(logs)
    assert f"{processes} processes on {processes} hosts" in log  # the run header says how the mesh sits on hosts
    assert "[Gloo]" not in log  # gloo's line per communicator only with --verbose
    got, want = losses(run_dir), losses(ref)
    assert sorted(got) == list(range(1, STEPS + 1))  # every step logged once: one writer, process 0
    # gloo sums in another order than one process's in-memory all-reduce: equal to float32 rounding
    assert_close_losses(got, want, range(1, STEPS + 1), first_tol=1e-6, last_tol=1e-4)
    assert max(abs(got[s] - want[s]) / want[s] for s in got) < 5e-5  # rounding differences grow with the steps
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert [p.name for p in run_dir.parent.rglob("metrics.jsonl")] == ["metrics.jsonl"]
    for i in range(1, processes):
        text = (logs / f"process-{i}.log").read_text()
        assert f"step {STEPS} | loss" in text and "Traceback" not in text  # the others trained and logged, not wrote


def test_generate_on_two_processes_equals_one(launched, tmp_path, capsys):
    """`shardlm generate` joins a multi-process run too: greedy tokens equal one process's, and stdout holds only
    the result (gloo's own lines, shown with `launch --verbose`, go to stderr)."""
    from shardlm.cli import main

    run_dir, _ = launched(2, 4, "fsdp4_tp2", FSDP4_TP2)
    gen = ["generate", str(run_dir), "--prompt", "ROMEO:", "--max-tokens", "12", "--temperature", "0", "--json",
           "--num-samples", "2"]
    # one process with 8 devices: this one (the session's 8 simulated devices), as test_generate runs the command,
    # rather than one more process to start
    assert main(gen) == 0
    one = capsys.readouterr().out
    two = subprocess.run(shardlm_command("launch", "--processes", "2", "--cpu-devices", "4", "--verbose", "--log-dir",
                                         str(tmp_path / "logs"), "--", *gen), capture_output=True, text=True,
                         timeout=LAUNCH_TIMEOUT)
    assert two.returncode == 0, two.stderr[-3000:]
    texts = [[json.loads(line)["text"] for line in out.splitlines()] for out in (one, two.stdout)]
    assert len(texts[0]) == 2 and texts[0] == texts[1] and texts[0][0]
    assert "[Gloo]" in two.stderr


def copy_until(src: Path, dst: Path, step: int) -> Path:
    """`src` as it was when its newest checkpoint was `step` (later checkpoints and the finished marker gone)."""
    shutil.copytree(src, dst)
    for s in checkpoint_steps(dst):
        if s > step:
            shutil.rmtree(dst / "checkpoints" / str(s))
    (dst / "summary.json").unlink()
    return dst


def test_a_one_process_checkpoint_resumes_on_two_processes(reference, tmp_path):
    """A checkpoint of one process with 8 devices resumes on 2 processes of 4 and continues with the uninterrupted
    run's batches and losses. (The other way, a 2-process checkpoint resumed on one process of 8 devices:
    test_a_killed_process_stops_the_others_and_its_checkpoint_resumes_on_one_process.)"""
    ref = reference("fsdp4_tp2", FSDP4_TP2)
    one = copy_until(ref, tmp_path / "one", 4)
    logs = tmp_path / "logs"
    assert launch(2, 4, one, *FSDP4_TP2, log_dir=logs).returncode == 0, launcher_log(logs)[-3000:]
    assert "resuming" in launcher_log(logs) and "data continues at batch 4" in launcher_log(logs)
    # the steps on gloo differ from one process's in the last bits (its summation order): equal to float32
    # rounding, which the steps grow
    assert_close_losses(losses(one), losses(ref), range(5, STEPS + 1), first_tol=1e-5, last_tol=5e-5)


def test_sigterm_to_one_process_stops_all_at_the_same_step_saved_and_the_resume_is_bit_identical(launched,
                                                                                                    tmp_path):
    """Also the determinism of a launch: the interrupted and resumed launch logs every number the uninterrupted
    launch of the same command logged (its own launch, not a second one: the suite's budget), exactly."""
    uninterrupted, _ = launched(2, 4, "fsdp4_tp2", FSDP4_TP2)
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    proc = launch(2, 4, run_dir, *FSDP4_TP2, log_dir=logs, background=True)
    log1 = logs / "process-1.log"
    wait_for(lambda: log1.exists() and "step 2 |" in log1.read_text(), "process 1's step 2")
    os.kill(pid_of(logs, 1), signal.SIGTERM)  # process 1 alone
    assert proc.wait(timeout=LAUNCH_TIMEOUT) == 0, launcher_log(logs)[-3000:]
    texts = [launcher_log(logs), log1.read_text()]
    stops = [int(t.split("stopping after step ")[1].split(";")[0]) for t in texts]
    assert stops[0] == stops[1] < STEPS, texts  # both processes stopped after the same step...
    assert checkpoint_steps(run_dir)[-1] == stops[0]  # ...and saved it
    assert not (run_dir / "summary.json").exists()
    # the resume, on the same two processes, continues from it: every step's loss is the uninterrupted launch's,
    # exactly (a resume on one process differs from two in gloo's summation order, which the steps grow:
    # test_a_killed_process_stops_the_others_and_its_checkpoint_resumes_on_one_process)
    assert launch(2, 4, run_dir, *FSDP4_TP2, log_dir=tmp_path / "resumed").returncode == 0
    assert f"from its checkpoint at step {stops[0]} " in launcher_log(tmp_path / "resumed")
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "tflops_per_device", "mfu")}
                        for r in rs]  # noqa: E731 - timings differ, every computed number must not
    resumed = strip(rows(run_dir))
    assert [r["step"] for r in resumed if "loss" in r] == list(range(1, STEPS + 1))  # each step once, none lost or repeated
    assert resumed == strip(rows(uninterrupted))


def test_a_killed_process_stops_the_others_and_its_checkpoint_resumes_on_one_process(reference, tmp_path):
    """The run resumes from the 2 processes' newest checkpoint on 1 process of 8 devices, with the uninterrupted
    run's batches and losses."""
    ref = reference("fsdp4_tp2", FSDP4_TP2)
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    heartbeat = 5
    proc = launch(2, 4, run_dir, *FSDP4_TP2, log_dir=logs, heartbeat=heartbeat, background=True)
    log1 = logs / "process-1.log"
    # killed once the checkpoint of step 4 is complete on disk (Orbax renames it from <step>.orbax-checkpoint-tmp
    # when every process has written its part), before the run can end: the next save is the last step's
    wait_for(lambda: (run_dir / "checkpoints" / "4").is_dir(), "the checkpoint of step 4")
    os.kill(pid_of(logs, 1), signal.SIGKILL)
    killed_at = time.monotonic()
    code = proc.wait(timeout=LAUNCH_TIMEOUT)
    waited = time.monotonic() - killed_at
    text = launcher_log(logs)
    assert code != 0 and waited < heartbeat + 20, (code, waited)
    assert "shardlm launch: process 1 was killed by SIGKILL" in text and str(log1) in text
    # process 0 ended by itself, non-zero, JAX's runtime naming the process that stopped sending heartbeats
    assert "killing process" not in text and "then process 0 was killed by SIGABRT" in text
    assert "tasks are unhealthy (stopped sending heartbeats):\n1\n" in text
    saved = checkpoint_steps(run_dir)[-1]
    assert saved >= 4
    assert json.loads((run_dir / f"checkpoints/{saved}/meta/metadata").read_text())["processes"] == 2
    assert json.loads((run_dir / f"checkpoints/{saved}/data/metadata").read_text()) == {"next_batch": saved}
    summary = train(load_config(None, RUN + FSDP4_TP2), run_dir, progress=False)  # 1 process, 8 devices
    assert summary["resumed_from"] == saved and summary["finished"]
    # resumed in one process: after steps on gloo, whose summation order differs by up to the 5e-5 of the
    # processes-against-one-process parity test
    assert_close_losses(losses(run_dir), losses(ref), range(1, STEPS + 1), first_tol=1e-5, last_tol=5e-5)


# --- bad input: one line on every process, nothing written ------------------------------------------------------

def start_by_hand(tmp_path: Path, port: int, per_process: list[list[str]], cwds=None, timeout=120):
    """Processes started as a scheduler would, each with its own command line; [(exit code, stderr)]."""
    procs = []
    for i, extra in enumerate(per_process):
        cmd = shardlm_command(extra[0], "--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}",
                              "--num-processes", str(len(per_process)), "--process-id", str(i), *extra[1:])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=(cwds or [tmp_path] * len(per_process))[i]))
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


def assert_error_on_every_process(results, fragment):
    """Each process ends with the one line: exit 2 where it found the problem, 3 where it stopped because another
    process did (a process may be told before it finds the problem itself)."""
    for code, err in results:
        errors = [ln for ln in err.splitlines() if ln.startswith("shardlm: error: ")]
        assert code in (2, 3) and len(errors) == 1 and fragment in errors[0], err
        assert "Traceback" not in err and errors[0] == [ln for ln in err.splitlines() if ln.strip()][-1], err
    assert 2 in [code for code, _ in results]


def free_port() -> int:
    from shardlm.launch import free_port as pick

    return pick()


def test_processes_given_different_configs_or_data_stop_with_one_line(tmp_path):
    micro = ["--run-dir", str(tmp_path / "run"), *RUN, *FSDP4_TP2]
    results = start_by_hand(tmp_path, free_port(), [["train", *micro], ["train", *micro, "train.lr=0.02"]])
    assert_error_on_every_process(results, "the command line differs between processes: process 1's overrides hold "
                                           "train.lr=0.02, which process 0's do not")
    # the same command, but a relative data.path that names different text on each host
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for i, h in enumerate(hosts):
        h.mkdir()
        (h / "corpus.txt").write_text(f"host {i} has its own text. " * 3000)
    same = ["train", *micro, "data.sources=[]", "data.path=corpus.txt", "data.val_fraction=0.2"]
    results = start_by_hand(tmp_path, free_port(), [same, same], cwds=hosts)
    assert_error_on_every_process(results, "the training data differs between processes: process 1 has "
                                           "train_sha256=")
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_run_directory_that_is_not_shared_stops_every_process(tmp_path):
    """A relative --run-dir from two working directories: two different directories, as on two hosts without a
    shared filesystem."""
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for h in hosts:
        h.mkdir()
    cmd = ["train", "--run-dir", "runs/x", *RUN, *FSDP4_TP2]
    results = start_by_hand(tmp_path, free_port(), [cmd, cmd], cwds=hosts)
    assert_error_on_every_process(results, "--run-dir runs/x is not shared between the processes: process(es) 1")
    assert not any(h.joinpath("runs").exists() for h in hosts)  # process 0 removed what it made to look


def test_wrong_process_count_id_or_coordinator(tmp_path):
    port = free_port()
    results = start_by_hand(tmp_path, port, [["explain", *RUN], ["explain", *RUN, "--num-processes", "3"]])
    assert_error_on_every_process(results, "process 1 was started with --num-processes 3, but the coordinator's run "
                                           "has 2 processes")
    lone = shardlm_command("explain", "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2",
                           "--process-id", "1", "--connect-timeout", "3", "--cpu-devices", "4", *RUN)
    t0 = time.monotonic()
    proc = subprocess.run(lone, capture_output=True, text=True, timeout=60)
    assert_error_on_every_process([(proc.returncode, proc.stderr)], "could not reach the coordinator at 127.0.0.1:")
    assert time.monotonic() - t0 < 30
    bad_id = subprocess.run(shardlm_command("explain", "--coordinator", "127.0.0.1:1234", "--num-processes", "2",
                                            "--process-id", "2", *RUN), capture_output=True, text=True, timeout=60)
    assert_error_on_every_process([(bad_id.returncode, bad_id.stderr)], "--process-id 2 is out of range")
    partial = subprocess.run(shardlm_command("explain", "--num-processes", "2", *RUN), capture_output=True,
                             text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                         if not k.startswith("SLURM_")})
    assert_error_on_every_process([(partial.returncode, partial.stderr)], "missing --coordinator")


def test_explain_across_hosts_and_data_prepared_once(tmp_path):
    """`explain` on 4 processes of 2 devices says which axes cross hosts and warns that tensor 4 does; the text
    behind each source of the mixture is prepared by one process while the others wait, into a cache no one
    prepared yet."""
    env = dict(os.environ, SHARDLM_CACHE_DIR=str(tmp_path / "cache"))
    cmd = shardlm_command("launch", "--processes", "4", "--cpu-devices", "2", "--log-dir", str(tmp_path / "logs"),
                          "--", "explain", "--json", *RUN, "mesh.data=2", "mesh.tensor=4")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ex = json.loads(proc.stdout)  # process 0 alone prints the result
    assert ex["axes_across_hosts"] == {"data": 2, "tensor": 2}
    assert "warning: mesh.tensor=4 spans 2 hosts" in proc.stderr
    outputs = [proc.stderr] + [(tmp_path / "logs" / f"process-{i}.log").read_text() for i in range(1, 4)]
    assert outputs[0].count("data: preparing") == 2 and len(list((tmp_path / "cache" / "data").glob("[!.]*"))) == 2
    assert all("data: preparing" not in o and "is up to date; nothing to do" in o for o in outputs[1:]), outputs


def test_the_cluster_recipes_are_commands_shardlm_accepts():
    """examples/multihost: every `shardlm train` line of the SLURM, Kubernetes and ssh recipes parses, names only
    config keys that exist, and joins with the options it gives (shell variables stand in as placeholders)."""
    import re
    import shlex

    import yaml

    from shardlm.cli import parse_args
    from shardlm.distributed import JoinOptions

    root = Path(__file__).resolve().parents[1] / "examples" / "multihost"
    texts = [(root / "slurm.sbatch").read_text(), (root / "ssh.sh").read_text()]
    texts += [doc["spec"]["template"]["spec"]["containers"][0]["args"][0]
              for doc in yaml.safe_load_all((root / "kubernetes.yaml").read_text()) if doc["kind"] == "Job"]
    commands = []
    for text in texts:
        joined = re.sub(r"\\\n\s*", " ", text)
        for line in joined.splitlines():
            if "shardlm train" in line and not line.lstrip().startswith("#") and "pkill" not in line:
                line = line.split("shardlm train", 1)[1].split(">")[0].replace('"$@"', "")
                for var, value in (('"${#hosts[@]}"', "2"), ("${hosts[0]}", "gpu-a"), ("$PORT", "8476")):
                    line = line.replace(var, value)
                line = re.sub(r'"?\$\{?(\w+)[^"\s]*"?', lambda m: "1" if m.group(1) in ("i", "JOB_COMPLETION_INDEX")
                              else "/x", line)
                commands.append(["train", *shlex.split(line)])
    assert len(commands) == 3
    for argv in commands:
        args = parse_args(argv)
        load_config(None, args.overrides)  # every key exists and every value type-checks
        options = JoinOptions(args.coordinator, args.num_processes, args.process_id)
        if args.coordinator is not None:
            options.check()


STOP_SCRIPT = """
import os, signal, sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from shardlm.train.preemption import StopOnSignal
import time
if jax.process_index() == 1:
    os.kill(os.getpid(), signal.SIGTERM)  # before the first step: a run still restoring or compiling
time.sleep(3)  # the notice reaches every process meanwhile
with StopOnSignal(coordinated=True) as stop:
    # a run resumed from step 40: steps 41, 42, ... but the sync point counts the loop's own checks
    stopped = next(step for step in range(41, 60) if stop.check())
print("STOPPED", stopped, stop.check(), flush=True)
"""


def test_a_stop_signal_before_the_first_step_stops_every_process_after_it():
    """JAX's sync point falls one past the furthest check any process made; `StopOnSignal` counts its own checks,
    so a notice that came before the loop stops a resumed run after its first step (not never)."""
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", STOP_SCRIPT, address, str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "STOPPED 41 a preemption notice" in out, out
