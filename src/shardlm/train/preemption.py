"""Stopping a run cleanly: SIGTERM (a scheduler's preemption notice) or Ctrl-C finishes the current step, saves a
checkpoint and exits 0; a second signal aborts at once.

The handler only records the first signal: the training loop polls `requested` after each step, so the step
already dispatched completes and the checkpoint holds a consistent state. Python runs signal handlers in the main
thread only, so elsewhere (a notebook's worker thread) the handlers are not installed and signals keep their
default meaning.
"""

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnSignal:
    def __init__(self):
        self.received: str | None = None  # the first signal's name, e.g. "SIGTERM"
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt  # the second signal: abort now, without saving
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
