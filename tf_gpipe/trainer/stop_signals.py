"""SIGTERM and SIGINT as requests: the trainer finishes its step, saves and returns."""

import signal
import threading


class StopSignals:
    """Within the block, SIGTERM and SIGINT only set `.signal` (main thread only)."""

    def __init__(self):
        self.signal = None
        self._previous = {}

    def _Handle(self, signum, frame):
        del frame
        self.signal = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._Handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False
