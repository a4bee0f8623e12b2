"""The hidden-state store on a network file system that every node of a job sees (`run.states_layout: shared`).

SQLite's locks are not to be trusted on a network file system, so this store has no database: beside each shard
`<name>.safetensors` lies its manifest `<name>.manifest.json` (the shard's keys, their token counts, its bytes and
the engine that computed it), written by the rank that wrote the shard, to a temp name renamed into place once the
shard is. No file is ever written by two ranks: the index is the union of the manifests, read as they appear. A kill
before a manifest's rename leaves a shard no manifest names (computed again, never read); a manifest always names a
whole shard, and a shard cut short later is found by `drop_torn` as in the SQLite store.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

from draftdata.hidden.state_store import Location, ShardFolder, StateStore
from draftdata.util.files import HOST, atomic_path
from draftdata.util.sqlite import check_db_path, resolve_store_path

MANIFEST = ".manifest.json"


class ManifestStore(ShardFolder):
    def __init__(self, root: Path, key: str = "run.store_path"):
        super().__init__(root, key)
        self._docs: dict[str, dict] = {}  # shard name -> its manifest
        self._where: dict[str, Location] = {}  # key -> where its states are

    def _manifest(self, shard: str) -> Path:
        return self.path(shard.removesuffix(".safetensors") + MANIFEST)

    def refresh(self) -> None:
        """The index brought up to the manifests on disk: the new ones read, the gone ones forgotten. A key in two
        shards (two ranks computed the same ids) is served by the first of them in name order, on every rank."""
        on_disk = {
            p.relative_to(self.root).as_posix().removesuffix(MANIFEST) + ".safetensors": p
            for p in self.root.glob(f"*/*{MANIFEST}")
        }
        gone, new = set(self._docs) - set(on_disk), set(on_disk) - set(self._docs)
        if not gone and not new:
            return
        for name in gone:
            del self._docs[name]
        for name in sorted(new):
            try:
                self._docs[name] = json.loads(on_disk[name].read_text())
            except FileNotFoundError:  # forgotten by another rank meanwhile (a torn shard)
                continue
        self._where = {}
        for name in sorted(self._docs):
            doc = self._docs[name]
            for row, (key, n) in enumerate(zip(doc["keys"], doc["lengths"])):
                self._where.setdefault(key, Location(name, row, n))

    def lookup(self, keys: Iterable[str]) -> dict[str, Location]:
        self.refresh()
        return {k: self._where[k] for k in keys if k in self._where}

    def add_shard(
        self, name: str, settings_hash: str, keys: list[str], lengths: list[int], size: int, engine: str
    ) -> None:
        """The shard's manifest, once its file is in place (see the module's doc)."""
        doc = {
            "shard": name,
            "settings": settings_hash,
            "keys": keys,
            "lengths": lengths,
            "bytes": size,
            "engine": engine,
            "created_at": time.time(),
            "writer": {"host": HOST, "pid": os.getpid()},  # which node's process wrote it
        }
        with atomic_path(self._manifest(name)) as tmp:
            tmp.write_text(json.dumps(doc))
        self._docs[name] = doc
        for row, (key, n) in enumerate(zip(keys, lengths)):
            self._where.setdefault(key, Location(name, row, n))

    def sizes(self, shards: Iterable[str]) -> tuple[int, int]:
        docs = [self._docs[s] for s in set(shards) if s in self._docs]
        return sum(d["bytes"] for d in docs), sum(sum(d["lengths"]) for d in docs)

    def engines(self, shards: Iterable[str]) -> dict[str, str | None]:
        return {s: self._docs[s].get("engine") for s in shards if s in self._docs}

    def _forget(self, shard: str) -> int:
        self._docs.pop(shard, None)
        self._where = {k: loc for k, loc in self._where.items() if loc.shard != shard}
        try:
            self._manifest(shard).unlink()
        except FileNotFoundError:
            return 0  # another rank forgot it first
        return 1


def states_root(run) -> Path:
    """The state store's directory: `run.states_path`, else `states/` beside the response store."""
    return Path(run.states_path) if run.states_path else resolve_store_path(run.store_path).parent / "states"


def states_key(run) -> str:
    """The setting that places the state store, named where it cannot be opened."""
    return "run.states_path" if run.states_path else "run.store_path"


def open_state_store(run) -> StateStore | ManifestStore:
    """The state store of `run` (the config's RunConfig), in its layout."""
    root = states_root(run)
    return (ManifestStore if run.states_layout == "shared" else StateStore)(root, states_key(run))


def check_states_path(run) -> None:
    """check_params' twin of the stage's refusal: the state store's index opens, or its folder can be made."""
    check_db_path(states_root(run) / "index.sqlite", "hidden-state store", states_key(run))
