"""The target's identity: a hash over its weight and config files (hub snapshots read the sha256 their blobs are
named by; a hub id is its cached snapshot at the commit its revision resolves to; local files are hashed once and
cached by size and mtime beside the store).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftdata.model.compute import compute_dtype, computed_fingerprint, weights_dtype
from draftdata.model.load import check_model_path, hub_snapshot
from draftdata.model.tokenizer import _SHA256_HEX
from draftdata.util.files import atomic_path
from draftdata.util.hashing import content_hash
from draftdata.util.log import log
from draftdata.util.sqlite import hash_cache_path, resolve_store_path

if TYPE_CHECKING:
    from draftdata.config.schema import Config

_CHUNK_BYTES = 8 << 20  # hashlib releases the GIL on updates this big, so threads read and hash in parallel


_HASH_THREADS = 4


_LOG_ABOVE_BYTES = 1 << 30


# huggingface_hub trusts its download metadata while the file's mtime is within 1 s of the recorded timestamp
# (stat times may be imprecise); the same slack applies here, to ctime.
_METADATA_SLACK_S = 1.0


# A file changed less than this before it was read may be changed again with the same stat times (filesystems
# with coarse timestamps), so its hash is not cached ("racily clean", as git calls it). Covers 2 s FAT times.
_RACY_NS = 2_000_000_000


_HASH_CACHE_VERSION = 1


def run_model_fingerprint(cfg: Config, in_process: bool = False, on_gpu: bool | None = None) -> str:
    """The fingerprint of a run's target (`model.path` at `model.revision`), its file hashes cached beside the store
    (run.store_path): what the response store's keys, the render cache's and the state store's name, derived here
    for every stage. `in_process`: the step runs the target itself (the embedded backend, the hf hidden-states
    engine), so the dtype it computes in (`model.compute_dtype`, resolved) is part of it where it is not the
    weights' own (model/compute.py); `on_gpu`: where it computes (default: a GPU if there is one)."""
    fp = model_fingerprint(cfg.model.path, cfg.model.revision, hash_cache_path(resolve_store_path(cfg.run.store_path)))
    if not in_process:
        return fp
    return computed_fingerprint(fp, compute_dtype(cfg.model, on_gpu), weights_dtype(cfg.model))


@lru_cache(maxsize=8)
def model_fingerprint(path: str, revision: str | None, cache_path: Path | None = None) -> str:
    """Identity of the target for the response-store and state-store keys: a local directory by the sha256 of every
    top-level file, a hub id by the same of its snapshot in the local HF cache, its revision resolved to a commit.

    A hub id's branch or tag (null: the default branch) is followed through the cache's refs/ to the commit it
    names, and the formula is that of the snapshot folder given as a local path with that commit as its revision.
    Weights re-uploaded under the same branch are a new commit, so a new target; so is any new commit, one that
    only edits a README too: the cache may hold only some of the repo's files (the tokenizer, for a target served
    elsewhere), and then only the commit tells the weights apart. A hub id not cached here is refused
    (`hf download` it first): its name and branch cannot tell which weights answered.

    Every byte counts (two fine-tunes of one base have equal file names and sizes), yet a 600 GB checkpoint stays
    cheap: in an HF cache snapshot, or a directory written by `hf download --local-dir` and untouched since, the
    sha256 of each weight file is already on disk and nothing is read. Otherwise each file is read once, the same
    price DVC already pays to hash `model.path` as a dependency, and its hash is kept in `cache_path` until the
    file's size, mtime, ctime or inode changes. Without a `cache_path` such files are read on every call."""
    check_model_path(path)  # a mistyped local path must not pass for a hub id
    root = Path(path)
    if not root.is_dir():
        root, revision = hub_snapshot(path, revision)
    return files_fingerprint(str(root), revision, cache_path)


def files_fingerprint(folder: str, revision: str | None, cache_path: Path | None = None) -> str:
    """`model_fingerprint` of a target found already (`model.load.locate`: its directory, its revision resolved)."""
    root = Path(folder)
    files = [f for f in sorted(root.iterdir()) if f.is_file() and not f.name.startswith(".")]
    # The same formula as when every file was read in full, so existing response stores keep their keys.
    return content_hash({"files": _files_sha256(root, files, cache_path), "revision": revision})


def _files_sha256(root: Path, files: list[Path], cache_path: Path | None) -> dict[str, str]:
    """File name -> sha256 hex of its content, from the cheapest source that is known to be current."""
    known: dict[str, str] = {}
    unknown: list[Path] = []
    for f in files:
        sha = _hub_blob_sha256(f) or _download_metadata_sha256(root, f)
        if sha is None:
            unknown.append(f)
        else:
            known[f.name] = sha
    if unknown:
        known.update(_read_sha256(unknown, cache_path))
    return known


def _hub_blob_sha256(f: Path) -> str | None:
    """The HF hub cache stores LFS files as blobs/<sha256 of the content>, linked from snapshots/<rev>/."""
    if not f.is_symlink():
        return None
    target = f.resolve()
    if target.parent.name == "blobs" and _SHA256_HEX.fullmatch(target.name):
        return target.name
    return None


def _download_metadata_sha256(root: Path, f: Path) -> str | None:
    """The etag `hf download --local-dir` recorded for `f`, if it is a sha256 (LFS files) and `f` is unchanged since.

    huggingface_hub's metadata file holds three lines: commit hash, etag, time.time() when written (after the file
    was moved into place). ctime, not mtime, decides "unchanged": `cp -p` or `touch -d` can set mtime back, nothing
    sets ctime back."""
    meta = root / ".cache" / "huggingface" / "download" / f"{f.name}.metadata"
    try:
        lines = meta.read_text().splitlines()
        etag, written_at = lines[1].strip(), float(lines[2])
        changed_at = f.stat().st_ctime
    except (OSError, IndexError, ValueError):
        return None  # no metadata, or not huggingface_hub's format: read the file instead
    if not _SHA256_HEX.fullmatch(etag) or changed_at - _METADATA_SLACK_S > written_at:
        return None
    return etag


def _read_sha256(files: list[Path], cache_path: Path | None) -> dict[str, str]:
    """sha256 of each file by reading it, unless `cache_path` holds a hash taken at the file's current stat."""
    cache = _load_hash_cache(cache_path)
    out: dict[str, str] = {}
    todo: list[tuple[Path, os.stat_result]] = []
    for f in files:
        st = f.stat()
        entry = cache.get(_cache_key(f))
        if entry is not None and entry.get("stat") == _stat_id(st):
            out[f.name] = entry["sha256"]
        else:
            todo.append((f, st))
    if not todo:
        return out
    total = sum(st.st_size for _, st in todo)
    if total > _LOG_ABOVE_BYTES:
        log(
            "fingerprint",
            hashing_files=len(todo),
            gb=round(total / 1e9, 1),
            note="one-time; cached by size/mtime/ctime/inode",
        )
    started_ns = time.time_ns()
    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, len(todo))) as pool:
        hashes = list(pool.map(_hash_file, [f for f, _ in todo]))
    for (f, st), sha in zip(todo, hashes):
        out[f.name] = sha
        if _settled(f, st, started_ns):
            cache[_cache_key(f)] = {"stat": _stat_id(st), "sha256": sha}
    _save_hash_cache(cache_path, cache)
    return out


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _stat_id(st: os.stat_result) -> list[int]:
    """What must be unchanged for a cached hash to hold; ctime moves on any write, rename or utime."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _cache_key(f: Path) -> str:
    return os.path.abspath(f)


def _settled(f: Path, before: os.stat_result, started_ns: int) -> bool:
    """Whether the hash just read may be cached: the file did not change while it was read, nor shortly before."""
    try:
        after = f.stat()
    except OSError:
        return False
    return _stat_id(after) == _stat_id(before) and before.st_ctime_ns < started_ns - _RACY_NS


def _load_hash_cache(cache_path: Path | None) -> dict[str, dict]:
    """A missing, unreadable or foreign cache is an empty one: it only ever saves a re-read."""
    if cache_path is None:
        return {}
    try:
        data = json.loads(Path(cache_path).read_text())
        files = data["files"] if data.get("version") == _HASH_CACHE_VERSION else {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if _valid_entry(v)}


def _valid_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("sha256"), str)
        and bool(_SHA256_HEX.fullmatch(entry["sha256"]))
        and isinstance(entry.get("stat"), list)
    )


def _save_hash_cache(cache_path: Path | None, cache: dict[str, dict]) -> None:
    """Replace the cache atomically; a concurrent writer's entries may be lost, which costs only a re-read."""
    if cache_path is None:
        return
    try:
        with atomic_path(cache_path) as tmp:
            tmp.write_text(json.dumps({"version": _HASH_CACHE_VERSION, "files": cache}, sort_keys=True))
    except OSError:
        pass  # a read-only place: the fingerprint is still right, the next run reads the files again
