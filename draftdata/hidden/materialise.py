"""The hidden-states stage's output directory, rebuilt from the state store once every sample is in it: the shards
linked in (hard links: the states are on disk once), the sample list (`samples.parquet`) and the final norm."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from draftdata.config.schema import Config
from draftdata.errors import UserError
from draftdata.hidden.compute import CARRIED, windows
from draftdata.hidden.state_store import NormAndSizes, StateStore, state_key
from draftdata.hidden.tally import HiddenTally
from draftdata.util.files import atomic_path
from draftdata.util.hashing import content_hash
from draftdata.util.log import log


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
