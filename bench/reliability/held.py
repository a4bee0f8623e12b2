"""Run a stage with every output held whole at its temp name for a while before its rename: the kill suite's seam.

    python -m bench.reliability.held SECONDS stages.<stage> [overrides ...]

A stage writes its outputs in milliseconds, less than a loaded machine takes to schedule the process that is to kill
it then: held, every output gives the suite a window to land in, with the temp file whole and, after the first
output, the outputs renamed so far beside the ones not yet. The product knows nothing of it: this wraps
`draftdata.util.files._publish`, the one place a temp file is renamed into place, and runs the stage as `python -m`
would.
"""

from __future__ import annotations

import runpy
import sys
import time

from draftdata.util import files


def main() -> None:
    seconds, module, *args = sys.argv[1:]
    publish = files._publish

    def held(tmp, path):
        time.sleep(float(seconds))
        publish(tmp, path)

    files._publish = held
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
