"""Computing a dataset's hidden states: samples → the target's EAGLE-3 features, in `data/<D>/hidden_states/`.

For every sample the target runs once and the stage keeps the outputs of the chosen decoder layers (physical 0-based
ids) and the final state BEFORE the final norm, with the norm's parameters: SpecForge's post-norm convention and
speculators' pre-norm one both come out exact (draftdata/hidden/reader.py, draftdata/hidden/export.py).

States are computed once per (model, layers, dtype, input ids) and kept in the state store
(draftdata/hidden/state_store.py), outside DVC's outputs: a budget round trip, a queued or temp experiment or a rerun
after a kill reuses them. The output directory holds hard links to the store's shards, the list of samples
(`samples.parquet`: id, shard, row, loss mask) and `index.json` (settings, layer ids in every trainer's numbering, the
final-state convention).

Work goes in windows of `window_samples` samples streamed from `samples.parquet` (memory stays bounded whatever the
dataset's size); in a window the samples still missing are sorted by length and batched up to `batch_tokens` padded
tokens. Under `torchrun`, ranks take disjoint samples (by key) and rank 0 writes the output once all have finished.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from draftdata.config.schema import Config
from draftdata.errors import UserError
from draftdata.hidden.engines.base import Engine
from draftdata.hidden.shards import FORMAT_VERSION, SampleStates, ShardBuffer, check, encode, write
from draftdata.hidden.state_store import NormAndSizes, StateStore, state_key
from draftdata.model.fingerprint import run_model_fingerprint
from draftdata.model.load import check_tokenizer_fits, model_dir, model_limits
from draftdata.model.tokenizer import load_tokenizer
from draftdata.util.files import atomic_path
from draftdata.util.hashing import content_hash
from draftdata.util.log import log
from draftdata.util.timing import Timers

# ---- layers: which, in every numbering ------------------------------------------------------------------------- #


# ---- the run ----------------------------------------------------------------------------------------------------- #


@dataclass
class Rank:
    """This process's place in a torchrun job (rank 0 of 1 without one)."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @classmethod
    def from_env(cls) -> Rank:
        return cls(
            int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
        )

    def owns(self, key: str) -> bool:
        return int(key[:8], 16) % self.world == self.rank

    def add_up(self, tally: HiddenTally) -> HiddenTally:
        """Every rank's compute tally summed, its time the longest rank's: what rank 0's metrics report for the
        whole job (each rank's own tally counts its share alone). A collective: it returns once every rank has
        finished computing, so it is also the barrier before rank 0 writes the output."""
        if self.world == 1:
            return tally
        import torch
        import torch.distributed as dist

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
        fields = ("owned", "computed", "computed_tokens", "pad_tokens", "fp8_err_num", "fp8_err_den")
        sums = torch.tensor([float(getattr(tally, f)) for f in fields], dtype=torch.float64, device=device)
        longest = torch.tensor([tally.seconds], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        summed = {f: type(getattr(tally, f))(v) for f, v in zip(fields, sums.tolist())}
        return replace(tally, **summed, seconds=longest.item())


@dataclass
class HiddenTally:
    samples: int = 0  # in the output (rank 0's, as it writes the output)
    tokens: int = 0
    trained_tokens: int = 0  # under the loss mask
    owned: int = 0  # samples this rank answers for, found in the store or computed
    computed: int = 0
    computed_tokens: int = 0
    pad_tokens: int = 0  # padded positions the engine computed and dropped
    torn: int = 0
    seconds: float = 0.0
    fp8_err_num: float = 0.0
    fp8_err_den: float = 0.0
    engines: dict = field(default_factory=dict)  # samples of the output by the engine that computed them


class LazyEngine:
    """The engine is started only when a sample is missing: a run that finds everything in the store never loads
    the model. The target's norm and sizes are kept in the store the first time."""

    def __init__(self, cfg: Config, layers: list[int], store: StateStore, settings_hash: str):
        self.cfg, self.layers, self.store, self.settings_hash = cfg, layers, store, settings_hash
        self.engine: Engine | None = None

    def get(self) -> Engine:
        if self.engine is None:
            self.engine = make_engine(self.cfg, self.layers)
            e = self.engine
            self.store.save_target(self.settings_hash, NormAndSizes(e.final_norm, e.n_layers, e.hidden_size))
        return self.engine

    @property
    def vllm_path(self) -> tuple[str, str | None] | None:
        """The vllm engine's path (extract or hook) and why not extract; None if no vllm engine ran."""
        path = getattr(self.engine, "vllm_path", None)
        return None if path is None else (path, getattr(self.engine, "fallback", None))

    @property
    def name(self) -> str:
        """What computes the states, as the state store records it per shard: `hf`, `vllm:hook`, `vllm:extract`."""
        path = getattr(self.get(), "vllm_path", None)
        return "hf" if path is None else f"vllm:{path}"

    @property
    def pad_tokens(self) -> int:
        return self.engine.pad_tokens if self.engine is not None else 0

    def target(self) -> NormAndSizes:
        found = self.store.target(self.settings_hash)
        if found is None:  # never recorded (the states came from elsewhere): the engine reads it from the model
            self.get()
            found = self.store.target(self.settings_hash)
        return found

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class ShardWriter:
    """Writes shards on a background thread while the target computes the next batches: on a GPU, packing and
    writing a shard (tens of GB per million tokens for a large target) would otherwise leave the GPU idle. One shard
    is in flight at a time, so memory holds at most two. A shard enters the store's index (SQLite, on the calling
    thread) only once its file is complete; a kill before that leaves an unindexed temp file, never a bad entry.
    When the target computes on the CPU (`background=False`) there is nothing to overlap: a writer thread would
    only take cores from the compute threads, so shards are written in line."""

    def __init__(
        self, store: StateStore, settings: dict, dtype: str, background: bool = True, timers: Timers | None = None
    ):
        from concurrent.futures import ThreadPoolExecutor

        self.store, self.settings, self.dtype = store, settings, dtype
        self.timers = timers or Timers()
        self.settings_hash = content_hash(settings)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shard-writer") if background else None
        self._pending: tuple | None = None
        self._buffer = ShardBuffer()  # one shard's image at a time: the one in flight

    def submit(self, samples: list[SampleStates], engine: str) -> None:
        self.wait()
        name = self.store.new_shard_name(self.settings_hash)
        args = (self.store.path(name), samples, self.dtype, self.settings, self.timers, self._buffer)
        job = self._pool.submit(write, *args) if self._pool is not None else _Done(write(*args))
        self._pending = (job, name, [s.key for s in samples], [len(s.input_ids) for s in samples], engine)

    def wait(self) -> None:
        """The shard in flight, written and indexed (a write's error is raised here). A Ctrl-C while it waits keeps
        the shard pending: `close`, on the way out, indexes it (its file is written, or being written)."""
        if self._pending is None:
            return
        job, name, keys, lengths, engine = self._pending
        try:
            with self.timers("waiting for the writer"):
                size = job.result()
            with self.timers("state store"):
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


@dataclass
class Computer:
    """Computes the states of missing samples, length-sorted and batched, and writes them to the store."""

    engine: LazyEngine
    store: StateStore
    settings: dict
    dtype: str
    batch_tokens: int
    shard_max_tokens: int
    tally: HiddenTally
    names: dict = field(default_factory=dict)  # key -> sample id of the current window, for error messages
    background_writes: bool = True  # see ShardWriter: True where the target computes off the CPU
    timers: Timers = field(default_factory=Timers)  # where the time outside the engine goes
    _buffer: list = field(default_factory=list)
    _writer: ShardWriter | None = None

    def __post_init__(self):
        self._writer = ShardWriter(self.store, self.settings, self.dtype, self.background_writes, self.timers)

    @property
    def settings_hash(self) -> str:
        return content_hash(self.settings)

    def run(self, missing: list[tuple[str, list[int]]]) -> None:
        for batch in length_batches(missing, self.batch_tokens):
            t0 = time.perf_counter()
            states = self.engine.get().forward([ids for _, ids in batch])
            self.tally.seconds += time.perf_counter() - t0
            samples = [SampleStates(k, ids, aux, final) for (k, ids), (aux, final) in zip(batch, states)]
            with self.timers("checks"):
                check(samples, self.names)
            with self.timers("fp8 error"):
                self._fp8_error(samples)
            self._buffer += samples
            self.tally.computed += len(samples)
            self.tally.computed_tokens += sum(len(ids) for _, ids in batch)
            if sum(len(s.input_ids) for s in self._buffer) >= self.shard_max_tokens:
                self.flush()

    def flush(self) -> None:
        """The buffered samples to a shard (written in the background)."""
        if self._buffer:
            self._writer.submit(self._buffer, self.engine.name)
            self._buffer = []

    def sync(self) -> None:
        """Everything computed so far on disk and indexed."""
        self.flush()
        self._writer.wait()

    def close(self) -> None:
        """Keep what was computed (also after Ctrl-C or a bad sample: the buffer holds only checked samples)."""
        try:
            self.flush()
        finally:
            self._writer.close()

    def _fp8_error(self, samples: list[SampleStates]) -> None:
        """fp8 against what bf16 would have stored: the error the metrics report."""
        if self.dtype != "fp8":
            return
        from draftdata.hidden.shards import dequantize_fp8

        for s in samples:
            for x in (s.aux, s.final):
                q = encode(x, "fp8")
                ref = x.bfloat16().float()
                self.tally.fp8_err_num += float((dequantize_fp8(q[""], q["_scale"]) - ref).pow(2).sum())
                self.tally.fp8_err_den += float(ref.pow(2).sum())


def length_batches(samples: list[tuple[str, list[int]]], batch_tokens: int, max_pad_share: float = 0.02):
    """Samples sorted by length, cut into batches whose padded size stays within batch_tokens (a sample longer than
    that goes alone) and whose padding stays under max_pad_share: a batch is for throughput, and padding is compute
    thrown away, so a sample that would pad its batch too much starts the next one. Sorting keeps the padding small
    wherever the window holds many samples of similar lengths."""
    batch: list = []
    real = 0
    for s in sorted(samples, key=lambda s: len(s[1])):
        n = len(s[1])
        padded = n * (len(batch) + 1)
        if batch and (padded > batch_tokens or 1 - (real + n) / padded > max_pad_share):
            yield batch
            batch, real = [], 0
        batch.append(s)
        real += n
    if batch:
        yield batch


def computes_off_cpu(hs) -> bool:
    """Whether the target runs on an accelerator (vLLM's workers, or a GPU for the hf backend)."""
    import torch

    return hs.backend == "vllm" or torch.cuda.is_available()


# tokenize's columns the hidden-states output carries on, so that it is whole without samples.parquet beside it
CARRIED = ("conversation", "turn")


def windows(src: Path, size: int, carried: bool = False):
    """(ids, input_ids, loss_masks) of `size` samples at a time, streamed from samples.parquet; with `carried`, a
    dict of the CARRIED columns tokenize wrote (`turns: all`) as a fourth item."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(src)
    extra = [c for c in CARRIED if c in pf.schema_arrow.names] if carried else []
    for batch in pf.iter_batches(batch_size=size, columns=["id", "input_ids", "loss_mask", *extra]):
        main = tuple(batch.column(i).to_pylist() for i in range(3))
        yield (*main, {c: batch.column(3 + i).to_pylist() for i, c in enumerate(extra)}) if carried else main


def compute(
    cfg: Config, src: Path, engine: LazyEngine, store: StateStore, settings: dict, rank: Rank, tally: HiddenTally
) -> None:
    """Pass 1 (every rank): compute what the store lacks."""
    hs = cfg.hidden_states
    computer = Computer(
        engine,
        store,
        settings,
        hs.dtype,
        hs.batch_tokens,
        hs.shard_max_tokens,
        tally,
        background_writes=computes_off_cpu(hs),
    )
    try:
        _compute_windows(src, hs.window_samples, computer, store, rank, tally)
    finally:
        computer.close()
    tally.pad_tokens = engine.pad_tokens


def _compute_windows(
    src: Path, window_samples: int, computer: Computer, store: StateStore, rank: Rank, tally: HiddenTally
) -> None:
    sh = computer.settings_hash
    checked: set[str] = set()
    for ids, input_ids, _ in windows(src, window_samples):
        keys = [state_key(sh, x) for x in input_ids]
        found = store.lookup(keys)
        unchecked = {loc.shard for loc in found.values()} - checked
        dropped = store.drop_torn(unchecked)  # a shard cut short: its samples are computed again
        tally.torn += len(dropped)
        checked |= unchecked - set(dropped)
        if dropped:
            found = store.lookup(keys)
        owned = [(k, x) for k, x in zip(keys, input_ids) if rank.owns(k)]
        tally.owned += len(owned)
        missing = {k: x for k, x in owned if k not in found}
        computer.names = dict(zip(keys, ids))  # this window's: memory stays bounded
        computer.run(list(missing.items()))


def materialise(
    cfg: Config, src: Path, out: Path, store: StateStore, settings: dict, target: NormAndSizes, tally: HiddenTally
) -> dict:
    """Pass 2 (rank 0): the output directory, rebuilt from the store: shard links, the sample list, the index."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.torch import save_file

    if out.exists():
        shutil.rmtree(out)  # an earlier run's view: it is rebuilt whole, from the store
    (out / "shards").mkdir(parents=True)
    sh = content_hash(settings)
    linked: dict[str, str] = {}
    how = "hardlink"
    carried = [c for c in CARRIED if c in pq.read_schema(src).names]
    fields = [("id", pa.string()), ("shard", pa.string()), ("row", pa.int32()), ("n_tokens", pa.int32())]
    fields += [("loss_mask", pa.list_(pa.int8())), ("engine", pa.string())]
    fields += [(c, pq.read_schema(src).field(c).type) for c in carried]
    schema = pa.schema(fields)
    engines: dict[str, str | None] = {}
    with atomic_path(out / "samples.parquet") as tmp, pq.ParquetWriter(tmp, schema) as writer:
        for ids, input_ids, masks, extra in windows(src, cfg.hidden_states.window_samples, carried=True):
            keys = [state_key(sh, x) for x in input_ids]
            found = store.lookup(keys)
            lost = [i for i, k in zip(ids, keys) if k not in found]
            if lost:
                raise UserError(
                    f"hidden_states: {len(lost)} samples have no states in the store (first: {lost[0]})"
                    "; a rank failed, or the store was changed meanwhile: run again"
                )
            for loc in {found[k].shard for k in keys} - set(linked):
                linked[loc], how = _link(store.path(loc), out / "shards", how)
            engines.update(store.engines({found[k].shard for k in keys} - set(engines)))
            rows = [found[k] for k in keys]
            columns = {
                "id": ids,
                "shard": [linked[r.shard] for r in rows],
                "row": [r.row for r in rows],
                "n_tokens": [r.n_tokens for r in rows],
                "loss_mask": masks,
                "engine": [engines.get(r.shard) for r in rows],
            }
            writer.write_table(pa.table(columns | extra, schema=schema))
            tally.samples += len(ids)
            tally.tokens += sum(r.n_tokens for r in rows)
            tally.trained_tokens += sum(map(sum, masks))
            for r in rows:
                name = engines.get(r.shard) or "unrecorded"
                tally.engines[name] = tally.engines.get(name, 0) + 1
    norm = target.norm
    tensors = {"weight": norm.weight.contiguous()}
    if norm.bias is not None:
        tensors["bias"] = norm.bias.contiguous()
    with atomic_path(out / "final_norm.safetensors") as tmp:
        save_file(tensors, str(tmp))
    return {"link": how, "shards": sorted(linked.values()), "sizes": store.sizes(linked)}


def _link(src: Path, dest_dir: Path, how: str) -> tuple[str, str]:
    """Hard-link a store shard into the output (one copy on disk); copy where the file systems differ."""
    dest = dest_dir / src.name
    if how == "hardlink":
        try:
            os.link(src, dest)
            return src.name, how
        except OSError:
            log(
                "hidden_states",
                warning="the state store is on another file system than the output: shards "
                "are copied (twice the disk); keep run.store_path on the same file system",
            )
    shutil.copyfile(src, dest)
    return src.name, "copy"


def make_engine(cfg: Config, layers: list[int]) -> Engine:
    hs = cfg.hidden_states
    if hs.backend == "vllm":
        from draftdata.hidden.engines.vllm import VLLMEngine

        # vLLM packs sequences (no padding): a batch must hold the longest sample the tokenize stage lets through
        return VLLMEngine(
            cfg.model,
            layers,
            python=hs.vllm_python,
            tensor_parallel_size=hs.tensor_parallel_size,
            data_parallel_size=hs.data_parallel_size,
            llm_kwargs=dict(hs.vllm_kwargs),
            path=hs.vllm_path,
            max_batch_tokens=max(hs.batch_tokens, cfg.tokenize.max_seq_len + 1),
        )
    from draftdata.hidden.engines.hf import HFEngine

    return HFEngine(cfg.model, layers, device_map=hs.device_map)


def join_group(rank: Rank) -> None:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(rank.local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def state_settings(cfg: Config, layers: list[int]) -> dict:
    """What a sample's states depend on besides its ids: their key in the state store hashes these."""
    return {
        "version": FORMAT_VERSION,
        "layers": layers,
        "dtype": cfg.hidden_states.dtype,
        "model": run_model_fingerprint(cfg),
    }


def n_layers_of(cfg: Config) -> int:
    """From the model's config alone, before any weight is loaded; its tokenizer must fit its embeddings."""
    from transformers import AutoConfig

    limits = model_limits(cfg.model)
    check_tokenizer_fits(load_tokenizer(cfg.model, need_template=False), cfg.model, limits)
    conf = AutoConfig.from_pretrained(model_dir(cfg.model), trust_remote_code=cfg.model.trust_remote_code)
    return conf.get_text_config().num_hidden_layers
