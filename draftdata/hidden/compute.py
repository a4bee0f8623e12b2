"""Computing a dataset's hidden states: samples → the target's EAGLE-3 features, in `data/<D>/hidden_states/`.

For every sample the target runs once and the stage keeps the outputs of the chosen decoder layers (physical 0-based
ids) and the final state BEFORE the final norm, with the norm's parameters: SpecForge's post-norm convention and
speculators' pre-norm one both come out exact (draftdata/hidden/reader.py, draftdata/hidden/export.py).

States are computed once per (model, layers, dtype, input ids) and kept in the state store
(draftdata/hidden/state_store.py), outside DVC's outputs: a budget round trip, a queued or temp experiment or a rerun
after a kill reuses them. The output directory (draftdata/hidden/materialise.py) holds hard links to the store's
shards, the list of samples (`samples.parquet`: id, shard, row, loss mask) and `index.json` (settings, layer ids in
every trainer's numbering, the final-state convention).

Work goes in windows of `window_samples` samples streamed from `samples.parquet` (memory stays bounded whatever the
dataset's size); in a window the samples still missing are sorted by length and batched up to `batch_tokens` padded
tokens, and written by a `ShardWriter` (draftdata/hidden/writer.py). Under `torchrun`, ranks take disjoint contiguous
shares of the rows (draftdata/hidden/ranks.py) and rank 0 writes the output once all have finished.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from draftdata.config.schema import Config
from draftdata.hidden.engines.factory import LazyEngine
from draftdata.hidden.ranks import Rank
from draftdata.hidden.shards import FORMAT_VERSION, SampleStates, check, encode
from draftdata.hidden.state_store import StateStore, state_key
from draftdata.hidden.tally import HiddenTally
from draftdata.hidden.writer import ShardWriter
from draftdata.model.compute import vllm_fingerprint, weights_dtype
from draftdata.model.fingerprint import run_model_fingerprint
from draftdata.model.load import model_dir, model_limits
from draftdata.model.tokenizer import check_tokenizer_fits, load_tokenizer
from draftdata.util.hashing import content_hash


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
    keep_states: bool = True  # False: the policy alone (hidden_states.drafters: [])
    _buffer: list = field(default_factory=list)
    _writer: ShardWriter | None = None

    def __post_init__(self):
        self._writer = ShardWriter(self.store, self.settings, self.dtype, self.background_writes)

    @property
    def settings_hash(self) -> str:
        return content_hash(self.settings)

    def run(self, missing: list[tuple[str, list[int]]]) -> None:
        for batch in length_batches(missing, self.batch_tokens):
            t0 = time.perf_counter()
            states = self.engine.get().forward([ids for _, ids in batch])
            self.tally.seconds += time.perf_counter() - t0
            samples = [SampleStates(k, ids, *got) for (k, ids), got in zip(batch, states)]
            if not self.keep_states:  # the policy alone: the final state was computed on the way, not kept
                for s in samples:
                    s.final = None
            check(samples, self.names)
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
            for x in (s.aux, s.final) if s.final is not None else ():
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
CARRIED = ("conversation", "turn", "mode")


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
) -> list[str]:
    """Pass 1 (every rank): compute what the store lacks of this rank's share; returns the share's keys."""
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
        keep_states=bool(hs.drafters),
    )
    share = rank.share(sample_lengths(src)) if rank.world > 1 else range(sys.maxsize)
    try:
        owned = _compute_windows(src, hs.window_samples, computer, store, share, tally)
    finally:
        computer.close()
    tally.pad_tokens = engine.pad_tokens
    return owned


def sample_lengths(src: Path) -> list[int]:
    """Every sample's token count, in the dataset's order, from the ids' list offsets (no id is decoded)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(src)
    return [n for b in pf.iter_batches(columns=["input_ids"]) for n in pc.list_value_length(b.column(0)).to_pylist()]


def _compute_windows(
    src: Path, window_samples: int, computer: Computer, store: StateStore, share: range, tally: HiddenTally
) -> list[str]:
    sh = computer.settings_hash
    checked: set[str] = set()
    mine: list[str] = []
    start = 0  # the window's first row in the dataset
    for ids, input_ids, _ in windows(src, window_samples):
        first, start = start, start + len(ids)
        if first >= share.stop or start <= share.start:
            continue  # another rank's rows
        keys = [state_key(sh, x) for x in input_ids]
        owned = [(k, x) for row, k, x in zip(range(first, start), keys, input_ids) if row in share]
        # only the shards of this rank's samples: their owner alone forgets a torn one and writes its name again, so
        # no rank deletes a shard another has just rewritten under the same name
        found = store.lookup(k for k, _ in owned)
        unchecked = {loc.shard for loc in found.values()} - checked
        torn, forgotten = store.drop_torn(unchecked)  # a shard cut short: its samples are computed again
        tally.torn += forgotten
        checked |= unchecked - set(torn)
        if torn:
            found = store.lookup(k for k, _ in owned)
        tally.owned += len(owned)
        mine += [k for k, _ in owned]
        missing = {k: x for k, x in owned if k not in found}
        computer.names = dict(zip(keys, ids))  # this window's: memory stays bounded
        computer.run(list(missing.items()))
    return mine


def state_settings(cfg: Config, layers: list[int]) -> dict:
    """What a sample's states depend on besides its ids: their key in the state store hashes these."""
    hs = cfg.hidden_states
    settings = {"version": FORMAT_VERSION, "layers": layers, "dtype": hs.dtype, "model": states_fingerprint(cfg)}
    # only where set: the keys of states stored before the policy existed stay what they were
    if hs.policy_top_k:
        settings["policy"] = {"top_k": hs.policy_top_k, "top_p": float(hs.policy_top_p)}
    if not hs.drafters:
        settings["states"] = False  # the policy alone
    return settings


def states_fingerprint(cfg: Config) -> str:
    """The target as the stage's engine computes it: the hf engine in `model.compute_dtype` (resolved), vLLM with
    the dtype, quantization and KV-cache dtype of `hidden_states.vllm_kwargs`. Where either differs from the
    weights' own arithmetic, the states are keyed apart; under both engines' defaults they share the weights'
    fingerprint, so a switch of backend reuses what is stored (within `draftdata verify`'s tolerance)."""
    if cfg.hidden_states.backend == "hf":
        return run_model_fingerprint(cfg, in_process=True)
    return vllm_fingerprint(run_model_fingerprint(cfg), weights_dtype(cfg.model), cfg.hidden_states.vllm_kwargs)


def n_layers_of(cfg: Config) -> int:
    """From the model's config alone, before any weight is loaded; its tokenizer must fit its embeddings."""
    from transformers import AutoConfig

    limits = model_limits(cfg.model)
    check_tokenizer_fits(load_tokenizer(cfg.model, need_template=False), cfg.model, limits)
    conf = AutoConfig.from_pretrained(model_dir(cfg.model), trust_remote_code=cfg.model.trust_remote_code)
    return conf.get_text_config().num_hidden_layers
