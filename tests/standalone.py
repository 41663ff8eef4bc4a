"""Runs a script in a fresh interpreter where `import tf_gpipe` fails: an exported artifact
must load and serve on its own."""

import os
import subprocess
import sys

# Prepended to every script: tf_gpipe cannot be imported, whatever the path says.
_BLOCK = "import sys\nsys.modules['tf_gpipe'] = None\n"


def run_without_tf_gpipe(code, *args, cwd):
    """Runs `code` with `args` as sys.argv[1:]; asserts it succeeded; returns the result."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    env.pop('PYTHONPATH', None)
    done = subprocess.run(
        [sys.executable, '-c', _BLOCK + code, *[str(a) for a in args]],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(cwd),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done
