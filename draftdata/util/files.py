"""Files the stages write and read: every final file is written to a temp name and renamed, so a kill never
leaves a half-written output that a later run would take as done."""

from __future__ import annotations

import csv
import errno
import glob
import hashlib
import json
import os
import socket
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


# A temp file is named for its final name and its writer: `.<name>.<host>.<pid>.<random>.tmp`. A writer removes the
# temp files of its final name that no live writer holds (one killed mid-write), never another live writer's: under
# torchrun several ranks write the same file at once, and each must find its own temp file where it left it.
HOST = socket.gethostname().replace(".", "-")
STALE_S = 3600.0  # a temp file from another host (a shared file system) is taken as abandoned after this long


def temp_prefix(name: str) -> str:
    return f".{name}.{HOST}.{os.getpid()}."


def abandoned(tmp: Path, now: float | None = None) -> bool:
    """Whether a temp file's writer is gone: a process of this host that no longer runs, or (another host's, or a
    name this cannot read) older than STALE_S."""
    parts = tmp.name.rsplit(".", 4)  # [.name, host, pid, random, tmp]
    if len(parts) == 5 and parts[1] == HOST and parts[2].isdigit():
        return not _alive(int(parts[2]))
    try:
        return (now or time.time()) - tmp.stat().st_mtime > STALE_S
    except FileNotFoundError:
        return False


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep_abandoned(folder: Path, pattern: str = ".*.tmp") -> int:
    """Remove the abandoned temp files matching `pattern` in `folder`; how many."""
    removed = 0
    for tmp in folder.glob(pattern):
        if abandoned(tmp):
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temp path beside `path`; rename it over `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_abandoned(path.parent, f".{glob.escape(path.name)}.*.tmp")  # left by a writer that was killed
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, FILE_MODE)  # after the block: a writer may have replaced the file (safetensors makes it 0600)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if disk_full(e):
            raise DiskFull(
                f"{path}: No space left on device; the earlier {path.name}, if any, is kept: free space and run again"
            ) from None
        raise


@contextmanager
def staged_path(path: Path | str) -> Iterator[Path]:
    """Yield `path` itself, for a file of a staging directory that is renamed into place whole once complete (an
    export's `.<dir>.partial`): that rename is what keeps a half-written output from being taken as done, so the
    file needs no temp name of its own, and a killed writer's leftovers go with the staging directory. Nor does it
    sweep the directory for them, as `atomic_path` does: a sweep lists the directory, and one per file makes writing
    n files into one directory cost n² (an export of 100k samples into one directory: hours of listings, where its
    writing takes minutes; `python -m bench.export_scaling`). The file gets the mode any new file gets."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield path
        os.chmod(path, FILE_MODE)  # safetensors makes its files 0600
    except BaseException as e:
        if disk_full(e):
            raise DiskFull(f"{path}: No space left on device; free space and run again") from None
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


def sha256_of(path: Path | str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_json(path: Path | str, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def data_dir(dataset: str) -> Path:
    return Path("data") / dataset


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
