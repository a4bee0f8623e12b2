"""Rows of a prompt source, each with the place it came from (file:line), so a bad row is reported where a user
can open it. Local .jsonl / .json / .parquet files (optionally .gz) and HF `datasets`."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftdata.config.schema import SourceConfig, file_kind
from draftdata.errors import UserError
from draftdata.util.files import sha256_of


class SourceError(UserError):
    """The source could not be read at all."""


@dataclass(frozen=True)
class Row:
    where: str  # "path:line" or "hf:name/config/split:row"
    value: Any = None
    error: str | None = None  # set when the raw line itself could not be parsed
    reason: str = "bad_json"  # the drop reason of such a line


def iter_rows(src: SourceConfig) -> Iterator[Row]:
    if src.path is not None:
        yield from iter_local(Path(src.path))
    else:
        yield from iter_hf(src)


def iter_local(path: Path) -> Iterator[Row]:
    kind = file_kind(path)
    if kind == ".jsonl":
        yield from _iter_jsonl(path)
    elif kind == ".json":
        yield from _iter_json(path)
    elif kind == ".parquet":
        yield from _iter_parquet(path)
    else:  # SourceConfig.check refuses these before any work; this guards direct callers
        raise ValueError(f"unsupported file type {path.name!r}: use .jsonl, .json or .parquet (.gz ok)")


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _unreadable(path: Path, e: Exception) -> SourceError:
    """A file that cannot be read at all (a cut-short or corrupt .gz, bytes that are not text): one line."""
    if isinstance(e, UnicodeDecodeError):
        return SourceError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})")
    return SourceError(f"{path}: cannot be read to the end, the file is cut short or corrupt ({type(e).__name__}: {e})")


def _iter_jsonl(path: Path) -> Iterator[Row]:
    """Line by line as bytes, so a line that is not UTF-8 is one bad row (file:line), not the end of the file."""
    try:
        with _open_binary(path) as f:
            for lineno, raw in enumerate(f, 1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield Row(where, error=f"not UTF-8 ({e.reason} at column {e.start + 1})", reason="not_utf8")
                    continue
                if not line.strip():
                    continue
                try:
                    yield Row(where, json.loads(line))
                except json.JSONDecodeError as e:
                    yield Row(where, error=f"invalid JSON: {e.msg} at column {e.colno}")
    except (EOFError, OSError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise _unreadable(path, e) from None


def _iter_json(path: Path) -> Iterator[Row]:
    try:
        with _open_binary(path) as f:
            text = f.read().decode("utf-8")
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as e:
        raise _unreadable(path, e) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        yield Row(f"{path}:{e.lineno}", error=f"invalid JSON: {e.msg} at column {e.colno}")
        return
    if isinstance(data, dict):  # {"data": [...]} or similar single-key wrappers
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else [data]
    for i, value in enumerate(data):
        yield Row(f"{path}:row {i}", value)


def _iter_parquet(path: Path) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    i = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for value in batch.to_pylist():
                yield Row(f"{path}:row {i}", value)
                i += 1
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None


def iter_hf(src: SourceConfig) -> Iterator[Row]:
    import datasets

    try:
        ds = datasets.load_dataset(
            src.hf_name,
            src.hf_config,
            split=src.split,
            revision=src.revision,
            data_files=src.data_files,
            streaming=True,
        )
    except Exception as e:  # the hub, auth and file errors all land here; name what the user set
        raise SourceError(f"cannot load {src.hf_name!r} ({src.hf_config}/{src.split}): {e}") from None
    label = f"hf:{src.hf_name}/{src.hf_config or 'default'}/{src.split}"
    for i, value in enumerate(ds):
        yield Row(f"{label}:row {i}", value)


def identity(src: SourceConfig) -> dict:
    """What a dataset's prompts are read from, as one small record: a local file by its path and content hash (a hub
    source by its pinned name, revision and files). check_params writes it per dataset, and each prompts stage
    depends on its own dataset's record rather than on the whole `sources/` folder, so DVC reruns the prompts of the
    dataset whose file changed and no other."""
    if src.path is not None:
        return {"path": src.path, "sha256": sha256_of(src.path)}
    files = None if src.data_files is None else list(src.data_files)
    return {
        "hf_name": src.hf_name,
        "hf_config": src.hf_config,
        "split": src.split,
        "revision": src.revision,
        "data_files": files,
    }
