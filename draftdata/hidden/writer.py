"""Writing computed states to the state store: shards packed and written beside the compute, indexed once whole."""

from __future__ import annotations

from dataclasses import dataclass

from draftdata.hidden.shards import SampleStates, ShardBuffer, write
from draftdata.hidden.state_store import StateStore
from draftdata.util.hashing import content_hash


class ShardWriter:
    """Writes shards on a background thread while the target computes the next batches: on a GPU, packing and
    writing a shard (tens of GB per million tokens for a large target) would otherwise leave the GPU idle. One shard
    is in flight at a time, so memory holds at most two. A shard enters the store's index (SQLite, on the calling
    thread) only once its file is complete; a kill before that leaves an unindexed temp file, never a bad entry.
    When the target computes on the CPU (`background=False`) there is nothing to overlap: a writer thread would
    only take cores from the compute threads, so shards are written in line."""

    def __init__(self, store: StateStore, settings: dict, dtype: str, background: bool = True):
        from concurrent.futures import ThreadPoolExecutor

        self.store, self.settings, self.dtype = store, settings, dtype
        self.settings_hash = content_hash(settings)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shard-writer") if background else None
        self._pending: tuple | None = None
        self._buffer = ShardBuffer()  # one shard's image at a time: the one in flight

    def submit(self, samples: list[SampleStates], engine: str) -> None:
        self.wait()
        keys = [s.key for s in samples]
        name = self.store.new_shard_name(self.settings_hash, keys)
        args = (self.store.path(name), samples, self.dtype, self.settings, self._buffer)
        job = self._pool.submit(write, *args) if self._pool is not None else _Done(write(*args))
        self._pending = (job, name, keys, [len(s.input_ids) for s in samples], engine)

    def wait(self) -> None:
        """The shard in flight, written and indexed (a write's error is raised here). A Ctrl-C while it waits keeps
        the shard pending: `close`, on the way out, indexes it (its file is written, or being written)."""
        if self._pending is None:
            return
        job, name, keys, lengths, engine = self._pending
        try:
            size = job.result()
            self.store.add_shard(name, self.settings_hash, keys, lengths, size, engine)
        except KeyboardInterrupt:
            raise
        except BaseException:
            self._pending = None  # a failed write is not indexed, nor raised again by `close`
            raise
        self._pending = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            self._buffer.close()


@dataclass
class _Done:
    """A write already made (in line), with the interface of a future's result."""

    size: int

    def result(self) -> int:
        return self.size
