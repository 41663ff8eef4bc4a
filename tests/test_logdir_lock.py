"""logdir_lock: one trainer per logdir; the second is refused at once with the holder's pid, and
a holder killed by -9 frees the logdir for its resume."""

import os
import signal
import subprocess
import sys

import pytest

from tf_gpipe.trainer.logdir_lock import LogdirBusyError, LogdirLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_second_holder_is_refused_with_the_first_ones_pid_and_the_lock_is_released(tmp_path):
    logdir = str(tmp_path)
    with LogdirLock(logdir):
        with pytest.raises(
            LogdirBusyError, match=rf'in use by another trainer \(pid {os.getpid()}'
        ):
            with LogdirLock(logdir):
                pass
    with LogdirLock(logdir):  # released on exit
        pass


def test_a_holder_killed_by_minus_9_frees_the_logdir(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            '-c',
            'import sys, time\n'
            'from tf_gpipe.trainer.logdir_lock import LogdirLock\n'
            'with LogdirLock(sys.argv[1]):\n'
            '    print("locked", flush=True)\n'
            '    time.sleep(600)\n',
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout.readline().strip() == 'locked'  # blocks until it holds the lock
        with pytest.raises(LogdirBusyError, match=rf'pid {holder.pid} on '):
            with LogdirLock(str(tmp_path)):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=300)
    with LogdirLock(str(tmp_path)):  # the kernel dropped the dead holder's lock
        pass
