"""Files the stages write and read: every final file is written to a temp name and renamed, so a kill never
leaves a half-written output that a later run would take as done."""

from __future__ import annotations

import errno
import glob
import json
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; an output must get the mode any other new file gets (0644 under the usual umask,
# 0664 under a group's 002), or teammates sharing a cluster's project directory cannot read it
FILE_MODE = 0o666 & ~_umask()


# Seconds a complete output is held at its temp name before the rename; unset (0) but in the kill suite
# (bench/reliability/kill.py). A stage writes its outputs in milliseconds, less than a loaded machine takes to
# schedule the process that is to kill it then: held, every output gives the suite a window to land in, with the
# temp file whole and, after the first output, the outputs renamed so far beside the ones not yet.
HOLD_ENV = "DRAFTDATA_HOLD_BEFORE_RENAME_S"


class DiskFull(OSError):
    """Out of disk while writing: one line naming the file (a UserError for `cli`)."""


def disk_full(e: BaseException) -> bool:
    """ENOSPC from the OS, from pyarrow (its OSError carries the errno only in the text) or from SQLite."""
    text = str(e).lower()
    return (
        getattr(e, "errno", None) == errno.ENOSPC
        or "no space left" in text
        or "errno 28" in text
        or "database or disk is full" in text
    )


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temp path beside `path`; rename it over `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):  # left by a writer that was killed
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, FILE_MODE)  # after the block: a writer may have replaced the file (safetensors makes it 0600)
        if hold := float(os.environ.get(HOLD_ENV) or 0):
            time.sleep(hold)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if disk_full(e):
            raise DiskFull(
                f"{path}: No space left on device; the earlier {path.name}, if any, is kept: free space and run again"
            ) from None
        raise


def write_jsonl(path: Path | str, records: Iterable[dict]) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n")
            n += 1
    return n


def read_jsonl(path: Path | str) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def write_json(path: Path | str, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def data_dir(dataset: str) -> Path:
    return Path("data") / dataset
