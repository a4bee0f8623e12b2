"""The hidden-state store: every sample's states computed once, kept outside DVC's outputs.

A persisted DVC output is never restored from DVC's run cache and a stage's output is deleted before it reruns, so
states kept only there were recomputed by every budget round trip, queued experiment or rerun after a kill. Here
they live beside the response store (`<store dir>/states/`), keyed by a content hash of (model, layers, dtype,
input ids): shard files written once, and an SQLite index from sample key to (shard, row). The stage's output links
the shards it needs (hard links: no second copy on disk), so any run that needs a sample already computed under the
same settings reuses it, whatever DVC did to the output directory.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from draftdata.errors import ConfigError
from draftdata.hidden.shards import torn
from draftdata.util.files import FILE_MODE, sweep_abandoned, temp_prefix
from draftdata.util.hashing import content_hash
from draftdata.util.sqlite import add_columns, open_db, rows_in, transaction

SCHEMA = """
CREATE TABLE IF NOT EXISTS states (
    key TEXT PRIMARY KEY,
    shard TEXT NOT NULL,
    row INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS shards (
    name TEXT PRIMARY KEY,
    settings TEXT NOT NULL,
    n_samples INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    engine TEXT
);
"""
# The engine that computed a shard's states (`hf`, `vllm:hook`, `vllm:extract`): the states of one sample are the same
# within their dtype's rounding whichever computed them (`draftdata verify` checks it), so a store serves every engine,
# and says which one each sample came from. NULL: a shard of a store older than the column, which gets it on opening.
ADDED_COLUMNS = {"engine": "TEXT"}


@dataclass
class NormAndSizes:
    norm: object  # draftdata.hidden.engines.hf.FinalNorm
    n_layers: int
    hidden_size: int


@dataclass(frozen=True)
class Location:
    shard: str  # file name, relative to the store's directory
    row: int
    n_tokens: int


def state_key(settings_hash: str, input_ids: list[int]) -> str:
    return content_hash({"settings": settings_hash, "input_ids": input_ids}, n=32)


class ShardFolder:
    """The store's files, whatever indexes them: `<settings hash>/<name>.safetensors` shards, each settings folder's
    target (final norm, sizes) and the store's identity. Its two indexes: `StateStore` (SQLite, a local disk) and
    draftdata/hidden/shared_store.py's `ManifestStore` (a network file system that several nodes write)."""

    def __init__(self, root: Path, key: str = "run.store_path"):
        """`key`: the setting that places `root` (run.states_path, else run.store_path), named where it cannot be
        made."""
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(key, f"cannot open the hidden-state store at {self.root}: {e}") from None
        self._sweep_temp_files()

    def _sweep_temp_files(self) -> None:
        """Shards half-written by a killed run (temp names, never indexed), in the settings folders where shards are
        written. Only a dead writer's: a torchrun job's other ranks may be writing theirs right now."""
        for folder in [self.root, *(p for p in self.root.iterdir() if p.is_dir())]:
            sweep_abandoned(folder)

    def close(self) -> None:
        pass

    def path(self, shard: str) -> Path:
        return self.root / shard

    def identity(self) -> str:
        """A random id made once for this store's directory: ranks whose stores have the same id share one store
        (one node's disk, or a shared file system); the others' shards are gathered (draftdata/hidden/nodes.py). The
        first writer wins: a hard link does not replace a file that a rank beside this one made meanwhile."""
        path = self.root / "store.id"
        if not path.exists():
            fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=".tmp", dir=self.root)
            os.write(fd, uuid.uuid4().hex.encode())
            os.close(fd)
            os.chmod(tmp, FILE_MODE)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        return path.read_text().strip()

    def new_shard_name(self, settings_hash: str, keys: list[str]) -> str:
        """Named by the samples it holds (their keys are their settings and ids): the same samples, the same name,
        so two runs of the same params write the same index; the ranks of a job write different samples."""
        return f"{settings_hash}/{content_hash(keys, n=32)}.safetensors"

    def drop_torn(self, shards: Iterable[str]) -> tuple[list[str], int]:
        """Forget shards whose file is missing or cut short (their samples are then computed again): the torn ones
        among `shards`, and how many of them this call forgot. Under torchrun each rank checks the shards of its own
        samples only (compute.py): the one that writes a forgotten shard's name again is the one that forgot it. Where
        two ranks share a shard (a job of another size wrote it), the rank that forgets it first counts it, so the job
        counts it once."""
        bad = [s for s in set(shards) if torn(self.path(s))]
        forgotten = 0
        for s in bad:
            forgotten += self._forget(s)
            self.path(s).unlink(missing_ok=True)
        return bad, forgotten

    def save_target(self, settings_hash: str, target: NormAndSizes) -> None:
        """What the output needs of the target besides its states (its final norm, sizes), kept with the states so
        that a run that computes nothing never loads the model."""
        from safetensors.torch import save_file

        from draftdata.util.files import atomic_path

        folder = self.root / settings_hash
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {"weight": target.norm.weight.contiguous()}
        if target.norm.bias is not None:
            tensors["bias"] = target.norm.bias.contiguous()
        with atomic_path(folder / "final_norm.safetensors") as tmp:
            save_file(tensors, str(tmp))
        with atomic_path(folder / "target.json") as tmp:
            tmp.write_text(
                json.dumps(
                    {"norm": target.norm.describe(), "n_layers": target.n_layers, "hidden_size": target.hidden_size}
                )
            )

    def target(self, settings_hash: str) -> NormAndSizes | None:
        from safetensors.torch import load_file

        from draftdata.hidden.norm import FinalNorm

        folder = self.root / settings_hash
        try:
            doc = json.loads((folder / "target.json").read_text())
            params = load_file(str(folder / "final_norm.safetensors"))
        except (OSError, ValueError):
            return None
        spec = doc["norm"]
        norm = FinalNorm(spec["kind"], spec["eps"], params["weight"], params.get("bias"), spec["weight_offset"])
        return NormAndSizes(norm, doc["n_layers"], doc["hidden_size"])

    def _forget(self, shard: str) -> int:
        """Take a shard out of the index: 1 if this call did, 0 if it was not there."""
        raise NotImplementedError


class StateStore(ShardFolder):
    """The index in SQLite (WAL): the ranks of one node share it. Not on a network file system (its locks are not to
    be trusted there): across nodes, `ManifestStore` or a store per node."""

    def __init__(self, root: Path, key: str = "run.store_path"):
        super().__init__(root, key)
        self.db = open_db(self.root / "index.sqlite", "hidden-state store", SCHEMA, key)
        add_columns(self.db, "shards", ADDED_COLUMNS)

    def close(self) -> None:
        self.db.close()

    def lookup(self, keys: Iterable[str]) -> dict[str, Location]:
        rows = rows_in(self.db, "SELECT key, shard, row, n_tokens FROM states WHERE key IN ({marks})", keys)
        return {k: Location(s, r, n) for k, s, r, n in rows}

    def add_shard(
        self, name: str, settings_hash: str, keys: list[str], lengths: list[int], size: int, engine: str
    ) -> None:
        """Record a shard already renamed into place: a kill before this commit leaves an unreferenced file,
        never a reference to a missing one."""
        with transaction(self.db, immediate=True):
            self.db.execute(
                "INSERT OR REPLACE INTO shards (name, settings, n_samples, n_tokens, bytes, created_at, engine) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (name, settings_hash, len(keys), sum(lengths), size, time.time(), engine),
            )
            self.db.executemany(
                "INSERT OR REPLACE INTO states VALUES (?, ?, ?, ?)",
                [(k, name, row, n) for row, (k, n) in enumerate(zip(keys, lengths))],
            )

    def sizes(self, shards: Iterable[str]) -> tuple[int, int]:
        """(bytes, tokens) of these shards, as recorded when they were written."""
        rows = list(rows_in(self.db, "SELECT bytes, n_tokens FROM shards WHERE name IN ({marks})", shards))
        return sum(b for b, _ in rows), sum(t for _, t in rows)

    def engines(self, shards: Iterable[str]) -> dict[str, str | None]:
        """The engine each of these shards was computed by (None: not recorded)."""
        return dict(rows_in(self.db, "SELECT name, engine FROM shards WHERE name IN ({marks})", shards))

    def _forget(self, shard: str) -> int:
        with transaction(self.db, immediate=True):
            forgotten = self.db.execute("DELETE FROM shards WHERE name = ?", (shard,)).rowcount
            self.db.execute("DELETE FROM states WHERE shard = ?", (shard,))
        return forgotten
