"""Stopping a run cleanly: SIGTERM (a scheduler's preemption notice) or Ctrl-C finishes the current step, saves a
checkpoint and exits 0; a second signal aborts at once.

One process: the handler only records the first signal, and the training loop calls `check()` after each step, so
the step already dispatched completes and the checkpoint holds a consistent state.

Several processes must stop at the same step, or the ones still stepping wait forever in a collective for the
ones saving. That is what JAX's preemption sync point is for: JAX's runtime catches SIGTERM in every process
(its preemption notifier) and tells the coordinator; from then on `reached_preemption_sync_point(n)` returns True
in every process for the same n, one past the furthest any process had reached. So a SIGTERM to any one process,
or the cluster's own preemption notice, stops all of them together. The n passed is this object's own count of
`check()` calls (1, 2, 3, ...), the same sequence in every process and whatever step a run resumed from: a notice
that arrives before the first step (while restoring or compiling) stops the run after its first step. Ctrl-C is
turned into that notice (the handler sends this process SIGTERM); a second Ctrl-C aborts. A second SIGTERM is
absorbed by JAX's notifier: abort a multi-process run with Ctrl-C twice, or SIGKILL.

Python runs signal handlers in the main thread only, so elsewhere (a notebook's worker thread) the handlers are
not installed and signals keep their default meaning.
"""

import os
import signal
import threading

from shardlm.errors import ShardlmError

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What a process that did not receive the signal itself knows (JAX's notifier, not Python, catches SIGTERM).
NOTICE = "a preemption notice (SIGTERM to one of the processes, or the cluster's)"


class StopOnSignal:
    def __init__(self, coordinated: bool = False):
        self.received: str | None = None  # the first signal this process's own handler received, e.g. "SIGINT"
        self.coordinated = coordinated
        self.reason: str | None = None  # why the run stops, once `check` has said so
        self.checks = 0
        self._previous: dict = {}
        if coordinated:
            from jax._src import distributed

            if distributed.global_state.preemption_sync_manager is None:
                raise ShardlmError("JAX's preemption service is off (jax_enable_preemption_service=False), so the "
                                   "processes of this run cannot stop together; turn it back on")

    @property
    def requested(self) -> bool:
        return self.received is not None

    def check(self) -> str | None:
        """Called after every step, in every process alike: why the run stops here, or None to go on. Once it has
        said stop, it keeps saying so."""
        if self.reason is None:
            if not self.coordinated:
                self.reason = self.received
            else:
                from jax.experimental import multihost_utils

                self.checks += 1
                if multihost_utils.reached_preemption_sync_point(self.checks):
                    self.reason = self.received or NOTICE
        return self.reason

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt  # the second signal: abort now, without saving
        self.received = signal.Signals(signum).name
        if self.coordinated:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier tells every process

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            # Coordinated: SIGTERM stays with JAX's preemption notifier.
            for sig in (signal.SIGINT,) if self.coordinated else SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
