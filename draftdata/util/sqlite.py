"""SQLite as both stores use it (the response store and the hidden-state store): where they live, how they open
(WAL on local disks, rollback journal on network file systems) and migrate, their lookups by many keys, and the model
files' hash cache beside them.
"""

from __future__ import annotations

import os
import random
import sqlite3
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

# File systems where SQLite's WAL is unsafe: its index lives in shared memory that only processes on one host share,
# and these mounts may be written from several (SQLite's docs: "WAL does not work over a network filesystem").
NETWORK_FS = (
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "afs",
    "ceph",
    "glusterfs",
    "lustre",
    "gpfs",
    "beegfs",
    "9p",
    "panfs",
    "wekafs",
    "fuse.sshfs",
    "fuse.glusterfs",
    "fuse.ceph",
    "fuse.s3fs",
    "fuse.gcsfuse",
)


def fs_type(path: Path) -> str:
    """The type of the file system `path` is on, from the kernel's mount table ("" where it cannot tell)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    target = str(Path(path).resolve())
    best, kind = "", ""
    for line in mounts:
        fields_ = line.split()
        if len(fields_) < 3:
            continue
        point = fields_[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields_[2]
    return kind


@contextmanager
def transaction(db: sqlite3.Connection, immediate: bool = False) -> Iterator[None]:
    """One transaction on a connection opened by `open_db` (no implicit ones): committed when the block ends, rolled
    back when anything is raised in it. BEGIN is inside the guard: a Ctrl-C (or the SIGTERM the stages turn into one)
    lands between statements, also right after BEGIN, and a transaction left open there would refuse the commit that
    keeps what was finished on the way out ("cannot start a transaction within a transaction")."""
    try:
        db.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def connect(path: Path, what: str, key: str = "run.store_path") -> sqlite3.Connection:
    """The database at `path`, its folder made; refused in one line naming `key`, the setting that places it, where
    it cannot open."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=600)
        db.execute("PRAGMA schema_version").fetchall()  # opens the file: a directory or a non-database fails here
    except (OSError, sqlite3.Error) as e:
        from draftdata.errors import ConfigError

        raise ConfigError(key, f"cannot open the {what} at {path}: {e}") from None
    return db


def check_store_path(configured: str) -> None:
    """check_params' twin of open_db's refusal for the response store (run.store_path)."""
    check_db_path(resolve_store_path(configured), "response store", "run.store_path")


def check_db_path(path: Path, what: str, key: str) -> None:
    """check_params' twin of open_db's refusal, before DVC deletes any stage's outputs: the database at `path`
    opens, or where there is none yet, its folder can be made and written in (nothing is left behind by the check)."""
    if path.exists():
        connect(path, what, key).close()
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:
        from draftdata.errors import ConfigError

        raise ConfigError(key, f"cannot open the {what} at {path}: {e}") from None


def open_db(path: Path, what: str, schema: str, key: str = "run.store_path") -> sqlite3.Connection:
    """A store's SQLite database with its `schema`: WAL on a local disk; a rollback journal, with a warning, on a
    network file system. A busy timeout lets several processes (torchrun ranks, two generate runs on one store)
    commit side by side. isolation_level=None: no implicit transactions; writers open and commit their own."""
    db = connect(path, what, key)
    kind = fs_type(path.parent)
    network = kind in NETWORK_FS
    if network:
        from draftdata.util.log import log

        log(
            what,
            warning=f"{path} is on a network file system ({kind}), where SQLite's WAL is not safe: using a "
            "rollback journal (slower, and one machine at a time). Put run.store_path on a local disk.",
        )
    _setup(db, network, schema)
    return db


def _setup(db: sqlite3.Connection, network: bool, schema: str, attempts: int = 50) -> None:
    """Journal mode and schema. Processes that open a new store at the same moment (torchrun ranks) can meet
    SQLITE_BUSY where SQLite does not wait on the busy timeout (a journal-mode change on a file another is creating,
    a lock upgrade that would deadlock): such a step is retried after a short pause."""
    for attempt in range(attempts):
        try:
            if network:
                db.execute("PRAGMA journal_mode=DELETE")
                db.execute("PRAGMA synchronous=FULL")
            else:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(
                    "PRAGMA synchronous=NORMAL"
                )  # WAL + NORMAL: a crash never corrupts, may lose the last commit
            db.executescript(schema)
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or attempt == attempts - 1:
                raise
            time.sleep(0.05 + random.random() * 0.1)


# Values bound in one `IN (...)` list: SQLite caps the parameters of a statement (999 before 3.32)
IN_CHUNK = 500


def rows_in(db: sqlite3.Connection, sql: str, values: Iterable, *before) -> Iterator[tuple]:
    """The rows of `sql` for every one of `values`: `{marks}` in `sql` is where their `IN (...)` list goes, run a
    chunk of IN_CHUNK values at a time; `before`: parameters bound ahead of the list."""
    values = list(values)
    for i in range(0, len(values), IN_CHUNK):
        chunk = values[i : i + IN_CHUNK]
        yield from db.execute(sql.format(marks=",".join("?" * len(chunk))), [*before, *chunk])


def add_columns(db: sqlite3.Connection, table: str, columns: dict[str, str]) -> None:
    """Give a store of an older schema the `columns` (name: type) it lacks. Processes that open it at once (torchrun's
    ranks, `dvc exp run --jobs N`) would each see a column missing and each add it, all but the first failing
    ("duplicate column name"): the check and the ALTER run under the write lock, after a look without it (a store
    already migrated, the usual case, takes no lock)."""
    if not _missing(db, table, columns):
        return
    with transaction(db, immediate=True):
        for name in _missing(db, table, columns):  # again under the lock: another process may have added them
            db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {columns[name]}")


def _missing(db: sqlite3.Connection, table: str, columns: dict[str, str]) -> list[str]:
    have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
    return [name for name in columns if name not in have]


def hash_cache_path(store_path: Path) -> Path:
    """Where file hashes of the model are cached between runs (draftdata.model.fingerprint.model_fingerprint):
    beside the store (`store_path`, resolved), so experiments that share the store share the cache."""
    return store_path.parent / "file_hashes.json"


def resolve_store_path(configured: str, cwd: Path | None = None) -> Path:
    """Where the store lives. `DRAFTDATA_STORE` wins; an absolute path stays; a relative one is taken from the
    project root. `dvc exp run --temp` and `--queue` run in a copy of the workspace under
    `<root>/.dvc/tmp/exps/`: the root is then the original workspace, so experiments share one store and every
    response they generate is there for the next run."""
    env = os.environ.get("DRAFTDATA_STORE")
    if env:
        return Path(env)
    path = Path(configured)
    if path.is_absolute():
        return path
    cwd = (cwd or Path.cwd()).resolve()
    parts = cwd.parts
    for i in range(len(parts) - 3):
        if parts[i : i + 4] == (".dvc", "tmp", "exps", parts[i + 3]) and i > 0:
            return Path(*parts[:i]) / path
    return cwd / path
