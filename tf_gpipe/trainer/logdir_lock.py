"""One trainer per logdir: an exclusive lock on `<logdir>/.trainer.lock` while it trains.

Two trainers on one logdir would interleave their checkpoints and event files. The lock is an
OS advisory lock (fcntl.flock) on an open file, so the kernel drops it when its process ends,
even by kill -9: a crashed run never blocks its own resume. The file says who holds it. Paths
that are not local files (gs://, ...) cannot be locked this way and are left unlocked.
"""

import fcntl
import os
import socket
import sys
import time

_NAME = '.trainer.lock'


class LogdirBusyError(RuntimeError):
    """Another live trainer holds the logdir."""


class LogdirLock:
    """`with LogdirLock(logdir):` trains alone in logdir, or raises LogdirBusyError at once."""

    def __init__(self, logdir, what='trainer'):
        self.logdir = logdir
        self.what = what  # who takes it: 'trainer', 'evaler', ...
        self._file = None

    def __enter__(self):
        if '://' in self.logdir:
            return self  # a remote filesystem: no flock there
        path = os.path.join(self.logdir, _NAME)
        f = open(path, 'a+')  # noqa: SIM115 (held open until __exit__: the lock lives with it)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or 'an unknown process'
            f.close()
            raise LogdirBusyError(
                f'{self.logdir!r} is in use by another {self.what} ({holder}): two would '
                'interleave their checkpoints and event files. Stop that one first, or pass '
                'another --logdir.'
            ) from None
        f.seek(0)
        f.truncate()
        f.write(
            f'pid {os.getpid()} on {socket.gethostname()}, since '
            f'{time.strftime("%Y-%m-%d %H:%M:%S")}: {" ".join(sys.argv)[:300]}\n'
        )
        f.flush()
        self._file = f
        return self

    def __exit__(self, *exc):
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
        return False
