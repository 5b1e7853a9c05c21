"""Joining a multi-process run on JAX's distributed runtime, and the few things its processes must agree on.

A multi-process run is N processes (one per host, or one per accelerator) that JAX's runtime (`jax.distributed`)
joins into one set of devices: a coordination service in process 0, heartbeats, a key-value store, and the
backend's collectives (NCCL on GPUs, ICI/DCN on TPUs, gloo on CPUs). shardlm adds nothing to that engine. This
module decides when to join, checks the input first, and uses the runtime's key-value store for what must be
decided once (a run directory's fate), agreed (the config, the data) or told to everyone (a failure).

Design choices:
- Joining: explicit options (`--coordinator HOST:PORT --num-processes N --process-id I`, or the environment
  variables in `ENV`), else JAX's own cluster detection (SLURM, Open MPI, Kubernetes, Cloud TPU) when it finds a
  job of more than one process; otherwise one process, and nothing is initialised.
- A bounded start. When registration with the coordinator times out, JAX aborts the process (a C++ fatal error
  with a stack trace). shardlm gives JAX a longer timeout than its own timer, which fires first and exits with one
  line saying whether the coordinator could not be reached or only some of the processes joined.
- Failures. An error in one process (bad input, an exception) is published in the key-value store before that
  process exits; a watcher thread in every other process reads it and exits at once with the same message,
  instead of waiting in a collective for a peer that will never come. Process 0 serves the coordinator, so it
  leaves last (after the others said they read it, or a few seconds). A process that dies without a word
  (SIGKILL, out of memory) stops sending heartbeats, and JAX's runtime terminates every other process after
  `--heartbeat-timeout` seconds with its own message naming the lost process. That message cannot be replaced
  by a shardlm line: jaxlib's `missed_heartbeat_callback` cannot carry its status to Python (it aborts with
  std::bad_cast), and the `jax_enable_recoverability` mode that would let a watcher see lost processes is
  experimental and still aborts when the coordinator is lost.
- Hosts. Processes are grouped into hosts by host name; `SHARDLM_HOST` overrides it (`shardlm launch
  --cpu-devices` gives each simulated process its own, since it stands for a host).
- Everything here is a no-op for one process, so callers need no branches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
import warnings
from typing import Any, Callable

from shardlm.errors import ShardlmError

ENV = {
    "coordinator": "SHARDLM_COORDINATOR",
    "num_processes": "SHARDLM_NUM_PROCESSES",
    "process_id": "SHARDLM_PROCESS_ID",
    "heartbeat_timeout": "SHARDLM_HEARTBEAT_TIMEOUT",
    "connect_timeout": "SHARDLM_CONNECT_TIMEOUT",
    "local_devices": "SHARDLM_LOCAL_DEVICES",
}
HOST_ENV = "SHARDLM_HOST"
DEFAULT_HEARTBEAT_TIMEOUT = 30  # seconds: a dead process is noticed well within a minute
DEFAULT_CONNECT_TIMEOUT = 120  # seconds for every process to join (process 0 may start later than the others)
JAX_TIMEOUT_MARGIN = 30  # JAX's own registration timeout exceeds shardlm's timer by this much
EXIT_USAGE = 2
EXIT_PEER_FAILED = 3  # this process stopped because another process of the run failed
FAILED_KEY = "shardlm/failed"
STOPPED_DIR = "shardlm/stopped/"
COORDINATOR_GRACE_S = 10.0  # how long process 0 keeps the coordinator up for the others to read a failure
# How long process 0 stays up after every process has said it is stopping. Each exits right after saying so, but
# if the coordinator goes first, JAX's error poller in a process still exiting aborts it (SIGABRT, a stack trace
# after its one line): seen once in a suite run on a loaded 2-core host.
COORDINATOR_LINGER_S = 2.0


def add_options(parser) -> None:
    """The options of every command that runs a model (train, generate, explain, bench, profile)."""
    g = parser.add_argument_group("multi-process runs (all optional: one process needs none; each has an "
                                  "environment variable, e.g. SHARDLM_COORDINATOR)")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address and a free port; every process passes the same")
    g.add_argument("--num-processes", type=int, metavar="N", help="how many processes the run has")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's number, 0 to N-1")
    g.add_argument("--heartbeat-timeout", type=int, metavar="S",
                   help=f"stop every process S seconds after one stops responding (default "
                        f"{DEFAULT_HEARTBEAT_TIMEOUT})")
    g.add_argument("--connect-timeout", type=int, metavar="S",
                   help=f"seconds for all processes to join (default {DEFAULT_CONNECT_TIMEOUT})")


@dataclasses.dataclass(frozen=True)
class JoinOptions:
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT
    connect_timeout: int = DEFAULT_CONNECT_TIMEOUT
    local_devices: tuple[int, ...] | None = None  # accelerators this process uses (the launcher's one per process)

    @property
    def explicit(self) -> bool:
        return any(v is not None for v in (self.coordinator, self.num_processes, self.process_id))

    @classmethod
    def from_args(cls, args, environ=None) -> "JoinOptions":
        """Options given on the command line win over their environment variables."""
        environ = os.environ if environ is None else environ

        def pick(name: str, cast):
            value = getattr(args, name, None)
            if value is not None:
                return value
            text = environ.get(ENV[name], "").strip()
            if not text:
                return None
            try:
                return cast(text)
            except ValueError:
                raise ShardlmError(f"{ENV[name]}={text!r} is not valid; give "
                                   f"{'a list of integers like 0,1' if name == 'local_devices' else 'an integer'}")

        local = pick("local_devices", lambda t: tuple(int(x) for x in t.split(",")))
        heartbeat, connect = pick("heartbeat_timeout", int), pick("connect_timeout", int)
        opts = cls(pick("coordinator", str), pick("num_processes", int), pick("process_id", int),
                   DEFAULT_HEARTBEAT_TIMEOUT if heartbeat is None else heartbeat,
                   DEFAULT_CONNECT_TIMEOUT if connect is None else connect, local)
        opts.check()
        return opts

    def check(self) -> None:
        for flag, value in (("--heartbeat-timeout", self.heartbeat_timeout),
                            ("--connect-timeout", self.connect_timeout)):
            if value < 1:
                raise ShardlmError(f"{flag} must be at least 1 second, got {value}")
        if not self.explicit:
            return
        missing = [f"--{k.replace('_', '-')} (or {ENV[k]})" for k in ("coordinator", "num_processes", "process_id")
                   if getattr(self, k) is None]
        if missing and detected_cluster() is None:
            raise ShardlmError(f"a multi-process run needs --coordinator, --num-processes and --process-id "
                               f"together; missing {' and '.join(missing)}")
        if self.coordinator is not None:
            parse_address(self.coordinator)
        if self.num_processes is not None and self.num_processes < 1:
            raise ShardlmError(f"--num-processes must be at least 1, got {self.num_processes}")
        if self.process_id is not None and self.num_processes is not None \
                and not 0 <= self.process_id < self.num_processes:
            raise ShardlmError(f"--process-id {self.process_id} is out of range for --num-processes "
                               f"{self.num_processes}: number the processes 0 to {self.num_processes - 1}")


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ShardlmError(f"--coordinator {text!r} is not HOST:PORT; give process 0's address and a free port, "
                           "e.g. 10.0.0.1:8476")
    return host.strip("[]"), int(port)


def detected_cluster() -> str | None:
    """The name of the cluster environment JAX detects (SLURM, Open MPI, Kubernetes, Cloud TPU) if it describes a
    job of more than one process; else None. Reads only the environment (and a TPU VM's metadata server)."""
    try:
        from jax._src import clusters  # JAX's own detection; private, so any failure means "none"

        kinds = list(clusters.ClusterEnv._cluster_types)  # noqa: SLF001
    except Exception:  # noqa: BLE001
        return None
    with warnings.catch_warnings():  # Kubernetes without the `kubernetes` package warns; it is just not detected
        warnings.simplefilter("ignore")
        for kind in kinds:
            if getattr(kind, "opt_in_only_method", False):
                continue
            try:
                if kind.is_env_present() and kind.get_process_count() > 1:
                    return kind.__name__
            except Exception:  # noqa: BLE001
                continue
    return None


# --- the joined run ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Run:
    client: Any
    process_id: int
    num_processes: int
    hosts: list[str]  # host name of each process
    stopping: threading.Event
    watcher: threading.Thread | None = None
    counter: int = 0

    def next_key(self, name: str) -> str:
        # Every process makes the same calls in the same order, so the n-th call has the same key everywhere.
        self.counter += 1
        return f"shardlm/{self.counter}-{name}"


_run: _Run | None = None


def is_multiprocess() -> bool:
    return _run is not None


def process_index() -> int:
    return _run.process_id if _run else 0


def process_count() -> int:
    return _run.num_processes if _run else 1


def is_primary() -> bool:
    """Process 0: the one that writes a run's files and prints a command's result."""
    return process_index() == 0


def host_of_process(p: int) -> str:
    return _run.hosts[p] if _run else _host_name()


def host_count() -> int:
    return len(set(_run.hosts)) if _run else 1


def _host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def join(options: JoinOptions, log: Callable[[str], None] | None = None) -> bool:
    """Join the multi-process run these options (or the cluster) describe; False (nothing done) for one process.
    Must run before JAX starts its backends."""
    global _run
    if _run is not None:
        return True
    cluster = None if options.explicit else detected_cluster()
    if not options.explicit and cluster is None:
        return False
    if options.explicit and options.num_processes == 1:
        return False
    import jax

    if options.coordinator is not None and options.process_id == 0:
        _check_port_free(options.coordinator)
    # gloo carries cross-process collectives on CPU devices (JAX's default where it knows the option), unless the
    # environment chose another (JAX_CPU_COLLECTIVES_IMPLEMENTATION=mpi).
    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception:  # noqa: BLE001 - a JAX without the option has its own default
            pass
    timer = threading.Timer(options.connect_timeout, _join_timed_out, (options, cluster))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            coordinator_address=options.coordinator, num_processes=options.num_processes,
            process_id=options.process_id,
            local_device_ids=list(options.local_devices) if options.local_devices is not None else None,
            initialization_timeout=options.connect_timeout + JAX_TIMEOUT_MARGIN,
            heartbeat_timeout_seconds=options.heartbeat_timeout,
            shutdown_timeout_seconds=max(60, options.heartbeat_timeout))
    except (ValueError, TypeError, RuntimeError) as e:  # JAX's checks of the arguments, or of the environment
        raise ShardlmError(f"could not join the multi-process run: {str(e).splitlines()[0]}") from e
    finally:
        timer.cancel()
    from jax._src import distributed as jax_distributed  # the runtime's client: barriers and key-value store

    client = jax_distributed.global_state.client
    count, index = jax.process_count(), jax.process_index()
    _run = _Run(client, index, count, [], threading.Event())
    _run.watcher = threading.Thread(target=_watch_failures, name="shardlm-failure-watcher", daemon=True)
    _run.watcher.start()
    if options.num_processes is not None and options.num_processes != count:
        raise ShardlmError(f"process {index} was started with --num-processes {options.num_processes}, but the "
                           f"coordinator's run has {count} processes; give every process the same --num-processes")
    _run.hosts = all_gather("host", _host_name())
    if log:
        log(f"joined a run of {count} processes on {host_count()} host(s) as process {index} "
            f"({'coordinator ' + options.coordinator if options.coordinator else cluster}); "
            f"{jax.local_device_count()} of {jax.device_count()} devices here")
    return True


def _check_port_free(address: str) -> None:
    host, port = parse_address(address)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind(("::" if ":" in host else "", port))
        except OSError as e:
            raise ShardlmError(f"process 0 serves the coordinator on port {port}, but it cannot listen there "
                               f"({e.strerror}); choose another port in --coordinator") from None


def _reachable(address: str) -> str | None:
    """None if a TCP connection to HOST:PORT opens, else why not."""
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=3):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def _join_timed_out(options: JoinOptions, cluster: str | None) -> None:
    """Runs on a timer thread while `jax.distributed.initialize` is still waiting: one line, then exit."""
    n, i, t = options.num_processes, options.process_id, options.connect_timeout
    who = f"process {i} of {n}" if n is not None and i is not None else "this process"
    if options.coordinator and i != 0 and (why := _reachable(options.coordinator)) is not None:
        msg = (f"{who} could not reach the coordinator at {options.coordinator} within {t} s ({why}); start "
               f"process 0 (it serves the coordinator), check that the address is its own and reachable from "
               f"this host, or raise --connect-timeout")
    elif options.coordinator and n is not None:
        msg = (f"{who}: the coordinator at {options.coordinator} is up, but not all {n} processes joined within "
               f"{t} s; start every process with the same --num-processes {n} and its own --process-id (0 to "
               f"{n - 1}), or raise --connect-timeout")
    else:
        msg = (f"{who}: not every process of the {cluster or 'multi-process'} run joined "
               f"{'the coordinator at ' + options.coordinator + ' ' if options.coordinator else ''}within {t} s; "
               f"check that all of them started with the same options, or raise --connect-timeout")
    print(f"shardlm: error: {msg}", file=sys.stderr, flush=True)
    os._exit(EXIT_USAGE)


def shutdown() -> None:
    """The normal end: every process waits for the others here (JAX's shutdown barrier), then leaves."""
    global _run
    if _run is None:
        return
    import jax

    _run.stopping.set()
    if _run.watcher is not None:
        _run.watcher.join(timeout=5)
    _run = None
    jax.distributed.shutdown()


# --- agreeing through the key-value store -----------------------------------------------------------------------

BLOCKING_GET_MS = 60_000


def _get(key: str) -> str:
    """Wait for `key` however long it takes: a peer that died or failed ends this process (heartbeats or
    `fail`), so waiting cannot outlive the run."""
    while True:
        try:
            return _run.client.blocking_key_value_get(key, BLOCKING_GET_MS)
        except Exception as e:  # noqa: BLE001
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


def all_gather(name: str, value) -> list:
    """Each process's JSON-able `value`, in process order (one process: [value])."""
    if _run is None:
        return [value]
    key = _run.next_key(name)
    _run.client.key_value_set(f"{key}/{_run.process_id}", json.dumps(value))
    return [json.loads(_get(f"{key}/{p}")) for p in range(_run.num_processes)]


def broadcast(name: str, compute: Callable[[], Any]):
    """`compute()` run once, on process 0; every process returns its (JSON-able) result. If it raises, process 0
    fails and the others stop (see `fail`)."""
    if _run is None:
        return compute()
    key = _run.next_key(name)
    if _run.process_id == 0:
        value = compute()
        _run.client.key_value_set(key, json.dumps(value))
        return value
    return json.loads(_get(key))


def barrier(name: str) -> None:
    if _run is None:
        return
    _run.client.wait_at_barrier(_run.next_key(name), 24 * 3600 * 1000)


def agree(name: str, value: dict, what: str, fix: str) -> None:
    """Raise on every process if any process's flat dict `value` (JSON-able) differs from process 0's, naming the
    first key that differs: "{what} differs between processes: process 1 has k=a, process 0 has k=b; {fix}"."""
    values = all_gather(name, value)
    for p, other in enumerate(values[1:], 1):
        for k in sorted(set(values[0]) | set(other)):
            mine, theirs = values[0].get(k), other.get(k)
            if mine == theirs:
                continue
            if isinstance(mine, list) and isinstance(theirs, list):  # say what differs, not the whole lists
                extra, missing = [x for x in theirs if x not in mine], [x for x in mine if x not in theirs]
                diff = ", and ".join(part for part in (
                    f"hold {' '.join(map(str, extra))}, which process 0's do not" if extra else "",
                    f"lack {' '.join(map(str, missing))}, which process 0's hold" if missing else "") if part)
                order = "come in another order than process 0's"
                raise ShardlmError(f"{what} differs between processes: process {p}'s {k} {diff or order}; {fix}")
            raise ShardlmError(f"{what} differs between processes: process {p} has {k}={theirs}, process 0 has "
                               f"{k}={mine}; {fix}")


# --- failures ---------------------------------------------------------------------------------------------------

_exiting = threading.Lock()  # whoever holds it (the main thread, or the watcher) says why this process ends


def fail(message: str, code: int, *, raising: bool = False) -> None:
    """This process ends with an error: print it (`shardlm: error: ...`) and, in a run of several processes, tell
    the others, then exit with `code` (never returns). With one process it returns after printing, or at once
    with `raising` (the caller re-raises to show a traceback, which says it all)."""
    if _run is None:
        if not raising:
            print(f"shardlm: error: {message}", file=sys.stderr, flush=True)
        return
    if not _exiting.acquire(blocking=False):  # another process's failure is already ending this one
        time.sleep(COORDINATOR_GRACE_S + 5)
        os._exit(code)
    if not raising:
        print(f"shardlm: error: {message}", file=sys.stderr, flush=True)
    try:
        _run.client.key_value_set(FAILED_KEY, json.dumps({"process": _run.process_id, "message": message,
                                                          "code": code}))
    except Exception:  # noqa: BLE001 - another process failed first (the key exists), or the coordinator is gone
        pass
    _exit(code)


def _exit(code: int) -> None:
    try:
        _run.client.key_value_set(f"{STOPPED_DIR}{_run.process_id}", "1")
        if _run.process_id == 0:  # keep the coordinator up until the others have read the failure
            deadline = time.monotonic() + COORDINATOR_GRACE_S
            while time.monotonic() < deadline and \
                    len(_run.client.key_value_dir_get(STOPPED_DIR)) < _run.num_processes:
                time.sleep(0.05)
            time.sleep(COORDINATOR_LINGER_S)
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watch_failures() -> None:
    """Another process's failure ends this one at once, whatever its main thread is waiting for."""
    run = _run
    while not run.stopping.is_set():
        try:
            text = run.client.blocking_key_value_get(FAILED_KEY, 500)
        except Exception:  # noqa: BLE001 - not set yet (a timeout), or the runtime is shutting down
            time.sleep(0.05)
            continue
        failure = json.loads(text)
        if failure["process"] == run.process_id or not _exiting.acquire(blocking=False):
            return  # the main thread published it, or is already ending this process with its own error
        print(f"shardlm: error: process {failure['process']} failed: {failure['message']}", file=sys.stderr,
              flush=True)
        _exit(EXIT_PEER_FAILED)
