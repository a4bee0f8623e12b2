"""Stage `hidden_states@D`: samples.parquet → the target's hidden states at the chosen layers, in shards.

Each sample's states are computed once per (model, layers, dtype, ids) into the state store
(draftdata/hidden/state_store.py), whatever DVC reruns; the stage output links the dataset's shards.
"""

from __future__ import annotations

import shutil
import signal

from draftdata.config.load import cli
from draftdata.config.schema import Config
from draftdata.drafters.layers import captured, family_layers
from draftdata.errors import UserError
from draftdata.hidden.compute import compute, n_layers_of, state_settings
from draftdata.hidden.engines.factory import LazyEngine
from draftdata.hidden.materialise import materialise
from draftdata.hidden.nodes import agree, gather, node_facts
from draftdata.hidden.output import index_doc, output_metrics
from draftdata.hidden.ranks import Rank, join_group, leave_group
from draftdata.hidden.reader import SKIPPED
from draftdata.hidden.shared_store import open_state_store
from draftdata.hidden.tally import HiddenTally
from draftdata.util.files import data_dir, write_json
from draftdata.util.hashing import content_hash
from draftdata.util.log import log


def main(cfg: Config) -> None:
    out_dir = data_dir(cfg.dataset)
    src = out_dir / "samples.parquet"
    if not src.exists():
        raise UserError(f"{src}: not found; run the tokenize stage first (dvc repro tokenize@{cfg.dataset})")
    if not cfg.ds.store_hidden_states:
        if Rank.from_env().rank == 0:  # under torchrun, one rank writes the marker
            skip(cfg, out_dir)
        return
    hs, rank, tally = cfg.hidden_states, Rank.from_env(), HiddenTally()
    families = family_layers(cfg, n_layers_of(cfg))
    layers = captured(families)
    settings = state_settings(cfg, layers)
    if rank.world > 1:
        join_group(rank, gpu=hs.backend == "hf")
    store = open_state_store(cfg.run)
    engine = LazyEngine(cfg, layers, store, content_hash(settings))
    # SIGTERM (a scheduler's, torchrun's when another rank failed) unwinds like Ctrl-C: the states computed so far
    # are written and indexed on the way out instead of dying with the process
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        # across nodes: the same model, layers, dtype, code and samples on every rank, or none starts
        every = agree(rank, lambda: node_facts(settings, src, cfg.run.states_layout), store.identity(), store.root)
        owned = compute(cfg, src, engine, store, settings, rank, tally)
        # the whole job's, for the metrics (`tally` stays this rank's share); every rank has finished once it returns
        total = rank.add_up(tally)
        total.gathered_shards, total.gathered_bytes = gather(rank, store, every, owned)
        if rank.rank == 0:
            write_outputs(cfg, src, engine, store, settings, families, total)
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()
        store.close()
        if rank.world > 1:
            leave_group()
    log(
        "hidden_states",
        dataset=cfg.dataset,
        rank=rank.rank,
        samples=tally.owned,  # this rank's share: all of them in one process
        computed=tally.computed,
        reused=tally.owned - tally.computed,
        layers=layers,
        dtype=hs.dtype,
    )


def write_outputs(cfg: Config, src, engine, store, settings: dict, families: dict, total: HiddenTally) -> None:
    """Rank 0, once every rank has finished: the output directory rebuilt from the store, its index (each family's
    layers) and the whole job's metrics."""
    out_dir = data_dir(cfg.dataset)
    out, target, layers = out_dir / "hidden_states", engine.target(), captured(families)
    # the writing of the outputs begins: linking every shard and listing every sample takes a while
    log("hidden_states", dataset=cfg.dataset, rank=0, writing=out)
    view = materialise(cfg, src, out, store, settings, target, total)
    write_json(out / "index.json", index_doc(cfg, target, settings, layers, families, view))
    metrics = output_metrics(out, engine, target, cfg.hidden_states, layers, view, total)
    write_json(out_dir / "hidden_states_metrics.json", metrics)


def skip(cfg: Config, out_dir) -> None:
    """`store_hidden_states: false`: no model is loaded and nothing computed; the output holds a marker that says so
    (an export of states refuses it by name), and the metrics say 0 bytes."""
    out = out_dir / "hidden_states"
    shutil.rmtree(out, ignore_errors=True)  # an earlier run's links (DVC removes them itself before it runs a stage)
    out.mkdir()
    why = f"datasets.{cfg.dataset}.store_hidden_states is false: online training computes the states itself"
    write_json(out / SKIPPED, {"stored": False, "reason": why})
    write_json(out_dir / "hidden_states_metrics.json", {"stored": False, "samples": 0, "tokens": 0, "bytes": 0})
    log("hidden_states", dataset=cfg.dataset, stored=False, reason=why)


def _terminated(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    cli(main)
