"""Deprecated spelling of `python -m tf_gpipe.runtime.worker` (the runtime has its own package
now): runs it, after one line that says so."""

import runpy
import sys

if __name__ == '__main__':
    print(
        'tf_gpipe.worker: deprecated; run python -m tf_gpipe.runtime.worker (the same worker).',
        file=sys.stderr,
        flush=True,
    )
    runpy.run_module('tf_gpipe.runtime.worker', run_name='__main__', alter_sys=True)
