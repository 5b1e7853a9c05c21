"""`shardlm launch`: N processes of one shardlm command on this host, joined into one run (torchrun's job).

    shardlm launch --processes 2 --cpu-devices 4 -- train mesh.fsdp=4 mesh.tensor=2

Design choices:
- The processes are plain `shardlm` commands that find their place through the environment (`SHARDLM_COORDINATOR`,
  `SHARDLM_NUM_PROCESSES`, `SHARDLM_PROCESS_ID`, see `shardlm.distributed`), the way a cluster scheduler would
  start them: the launcher adds nothing the runtime needs and is not needed on a cluster.
- The coordinator listens on a free port of 127.0.0.1 that the launcher picks.
- Output: process 0 writes to this terminal (its progress bar included); process i writes to
  `<log dir>/process-<i>.log`. The launcher names every process's pid and log as it starts them.
- Signals: each process runs in its own session, so a Ctrl-C at the terminal reaches only the launcher, which
  passes SIGINT or SIGTERM on to every process once per signal received (the processes stop together at the next
  step and save; a second Ctrl-C aborts them). On Linux a process also dies if the launcher is killed.
- Failure: when a process exits with an error or is killed, the launcher says which and where its log is, lets
  the others end on their own for up to the heartbeat timeout (they stop by themselves, each saying why; see
  `shardlm.distributed`), kills any that remain, and exits non-zero. The process to blame is the first that
  failed other than by stopping for another's failure (exit code 3): process 0 serves the coordinator, so when
  it is the one that failed it leaves after the others.
- `--cpu-devices K` gives every process K simulated CPU devices and its own host name, since it stands for a
  host. Without it, on an accelerator host, process i gets the accelerators i*D .. i*D+D-1
  (`--devices-per-process D`, default 1: one process per GPU).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from shardlm.distributed import DEFAULT_HEARTBEAT_TIMEOUT, ENV, EXIT_PEER_FAILED, HOST_ENV
from shardlm.errors import ShardlmError

MODEL_COMMANDS = ("train", "generate", "explain", "bench", "profile", "export")
EXTRA_GRACE_S = 15  # beyond the heartbeat timeout, for the survivors to print why they stop and exit
POLL_S = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, SIGKILL when the launcher dies (it cannot forward anything then)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Launcher:
    def __init__(self, processes: int, command: list[str], *, cpu_devices: int | None = None,
                 devices_per_process: int = 1, log_dir: Path | None = None, heartbeat_timeout: int | None = None,
                 port: int | None = None, out=sys.stderr):
        if processes < 1:
            raise ShardlmError(f"--processes must be at least 1, got {processes}")
        if cpu_devices is not None and cpu_devices < 1:
            raise ShardlmError(f"--cpu-devices must be at least 1, got {cpu_devices}")
        if devices_per_process < 1:
            raise ShardlmError(f"--devices-per-process must be at least 1, got {devices_per_process}")
        if not command:
            raise ShardlmError("name the command to launch after --, e.g. shardlm launch --processes 2 -- train")
        if command[0] not in MODEL_COMMANDS:
            raise ShardlmError(f"shardlm launch runs {', '.join(MODEL_COMMANDS)}, not {command[0]!r}; e.g. "
                               "shardlm launch --processes 2 -- train")
        self.n, self.command, self.cpu_devices = processes, command, cpu_devices
        self.devices_per_process = devices_per_process
        self.log_dir = Path(log_dir) if log_dir else Path("runs") / f"launch-{time.strftime('%Y%m%d-%H%M%S')}"
        env_timeout = os.environ.get(ENV["heartbeat_timeout"], "")
        self.heartbeat_timeout = heartbeat_timeout or (int(env_timeout) if env_timeout.isdigit()
                                                       else DEFAULT_HEARTBEAT_TIMEOUT)
        # The processes' own --heartbeat-timeout, if the command gives one, is the one they stop by.
        given = [command[i + 1] for i, a in enumerate(command[:-1]) if a == "--heartbeat-timeout"]
        given += [a.split("=", 1)[1] for a in command if a.startswith("--heartbeat-timeout=")]
        self.stop_within = max([self.heartbeat_timeout] + [int(g) for g in given if g.isdigit()])
        self.port = port or free_port()
        self.out = out
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path | None] = []
        self.signals_received = 0

    def say(self, msg: str) -> None:
        print(f"shardlm launch: {msg}", file=self.out, flush=True)

    def child_env(self, i: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({ENV["coordinator"]: f"127.0.0.1:{self.port}", ENV["num_processes"]: str(self.n),
                    ENV["process_id"]: str(i), ENV["heartbeat_timeout"]: str(self.heartbeat_timeout),
                    "PYTHONUNBUFFERED": "1"})
        if self.cpu_devices is not None:
            env[HOST_ENV] = f"{socket.gethostname()}-process{i}"
        else:
            d = self.devices_per_process
            env[ENV["local_devices"]] = ",".join(str(k) for k in range(i * d, (i + 1) * d))
        return env

    def child_argv(self) -> list[str]:
        argv = [sys.executable, "-m", "shardlm.cli", self.command[0]]
        if self.cpu_devices is not None:
            argv += ["--cpu-devices", str(self.cpu_devices)]
        return argv + self.command[1:]

    def start(self) -> None:
        if self.n > 1:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.say(f"{self.n} process(es) of `shardlm {' '.join(self.command)}`, coordinator 127.0.0.1:{self.port}"
                 + (f", {self.cpu_devices} CPU device(s) each" if self.cpu_devices else ""))
        for i in range(self.n):
            log = None if i == 0 else self.log_dir / f"process-{i}.log"
            stream = None if log is None else open(log, "wb")
            try:
                p = subprocess.Popen(self.child_argv(), env=self.child_env(i), stdout=stream,
                                     stderr=None if stream is None else subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            finally:
                if stream is not None:
                    stream.close()
            self.procs.append(p)
            self.logs.append(log)
            self.say(f"process {i}: pid {p.pid}, " + ("output below" if log is None else f"log {log}"))

    def forward(self, signum, frame) -> None:
        self.signals_received += 1
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    def where(self, i: int) -> str:
        return "its output is above" if self.logs[i] is None else f"its log: {self.logs[i]}"

    def wait(self) -> int:
        """Until every process has ended; the exit code (0 only if all exited 0)."""
        grace = self.stop_within + EXTRA_GRACE_S
        failed: list[tuple[int, int]] = []  # (process, exit code) in the order they ended
        deadline = None
        while True:
            codes = [p.poll() for p in self.procs]
            for i, code in enumerate(codes):
                if code not in (None, 0) and all(i != j for j, _ in failed):
                    failed.append((i, code))
                    running = [j for j, c in enumerate(codes) if c is None]
                    why = " (it stopped because another process failed)" if code == EXIT_PEER_FAILED else ""
                    self.say(f"process {i} {_describe_exit(code)}{why}; {self.where(i)}"
                             + (f". Waiting up to {grace} s for process(es) {', '.join(map(str, running))} to stop"
                                if running and deadline is None else ""))
                    if deadline is None:
                        deadline = time.monotonic() + grace
            if all(c is not None for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                left = [i for i, c in enumerate(codes) if c is None]
                self.say(f"killing process(es) {', '.join(map(str, left))}, still running {grace} s after process "
                         f"{failed[0][0]} ended")
                for i in left:
                    self.procs[i].kill()
                deadline = float("inf")
            time.sleep(POLL_S)
        if not failed:
            return 0
        i, code = next(((i, c) for i, c in failed if c != EXIT_PEER_FAILED), failed[0])
        others = [f"process {j} {_describe_exit(c)}" for j, c in failed if j != i]
        self.say(f"the run failed: process {i} {_describe_exit(code)} ({self.where(i)})"
                 + (f"; then {', '.join(others)}" if others else ""))
        return code if code > 0 else 128 - code


def launch(processes: int, command: list[str], **kwargs) -> int:
    launcher = Launcher(processes, command, **kwargs)
    previous = {s: signal.signal(s, launcher.forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        return launcher.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in launcher.procs:  # an exception in the launcher itself must not leave processes behind
            if p.poll() is None:
                p.kill()
