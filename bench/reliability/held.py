"""Run a stage with every output held whole at its temp name for a while before its rename: the kill suite's seam.

    python -m bench.reliability.held SECONDS stages.<stage> [overrides ...]

A stage writes its outputs in milliseconds, less than a loaded machine takes to schedule the process that is to kill
it then: held, every output gives the suite a window to land in, with the temp file whole and, after the first
output, the outputs renamed so far beside the ones not yet. The product knows nothing of it: this wraps `os.replace`
in the stage's process, holding the renames that put a whole temp file over its final name (`atomic_path`'s, the
one way an output comes into place: `.<name>.<host>.<pid>.<random>.tmp` beside `<name>`), and runs the stage as
`python -m` would.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

from draftdata.util import files


def publishes(src, dst) -> bool:
    """Whether a rename puts this process's whole temp file over its final name (draftdata.util.files.temp_prefix)."""
    src, dst = Path(src), Path(dst)
    return src.parent == dst.parent and src.name.startswith(files.temp_prefix(dst.name)) and src.name.endswith(".tmp")


def main() -> None:
    seconds, module, *args = sys.argv[1:]
    replace = os.replace

    def held(src, dst, **kwargs):
        if publishes(src, dst):
            time.sleep(float(seconds))
        replace(src, dst, **kwargs)

    os.replace = held
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
