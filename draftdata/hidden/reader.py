"""Reading the hidden-states stage's output: a sample at a time, in either trainer's convention.

    from draftdata.hidden.reader import HiddenStates

    hs = HiddenStates("data/B3_magicoder/hidden_states")
    hs.layers["vllm_speculators"]        # the layer ids in a trainer's numbering (also physical, sglang_specforge)
    hs.families["dflash"]["positions"]   # a drafter family's layers, as indices into s.aux's dim 1
    for s in hs:                         # samples in the dataset's order
        s.id, s.input_ids, s.loss_mask   # int64 [T]
        s.aux                            # float32 [T, k, H]: outputs of the chosen layers (fp8 dequantized)
        s.final_pre_norm                 # float32 [T, H]: the last layer's output (speculators' hidden state)
        s.final_post_norm                # float32 [T, H]: after the target's final norm (SpecForge's hidden state)
        s.policy                         # (tokens, log-probs) [T, p] where hidden_states.policy_top_k kept it

Shards are opened lazily and read a sample at a time, so iterating a dataset of any size holds one sample's states in
memory (and the sample list, columnar).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from draftdata.hidden.norm import FinalNorm
from draftdata.hidden.shards import ShardReader

# what the hidden_states stage writes in place of states where datasets.<D>.store_hidden_states is false
SKIPPED = "skipped.json"


@dataclass
class Sample:
    id: str
    input_ids: object
    loss_mask: object
    aux: object
    final_pre_norm: object
    norm: FinalNorm
    conversation: str | None = None  # a regenerated conversation's id and its last trained turn (`turns: all`)
    turn: int | None = None
    mode: str | None = None  # its generation mode (datasets.<D>.modes)
    # the target's policy for the next token at every position, where kept (hidden_states.policy_top_k):
    # (tokens int64 [T, p], log-probs float32 [T, p]); row t predicts token t + 1 (draftdata/hidden/policy.py)
    policy: tuple | None = None

    @property
    def final_post_norm(self):
        return self.norm.apply(self.final_pre_norm)


class HiddenStates:
    def __init__(self, path: str | Path):
        import pyarrow.parquet as pq
        from safetensors.torch import load_file

        self.path = Path(path)
        self.index = json.loads((self.path / "index.json").read_text())
        self.layers: dict = self.index["layers"]
        self.hidden_size: int = self.index["model"]["hidden_size"]
        spec = self.index["final_norm"]
        params = load_file(str(self.path / spec["file"]))
        self.norm = FinalNorm(spec["kind"], spec["eps"], params["weight"], params.get("bias"), spec["weight_offset"])
        # kept columnar (a few dozen bytes a sample), not as Python objects: datasets run to millions of samples
        names = pq.read_schema(self.path / "samples.parquet").names
        self.carries_turns = "conversation" in names  # `turns: all`: each sample's conversation and turn
        self.carries_mode = "mode" in names  # datasets.<D>.modes: each sample's mode
        columns = ["id", "shard", "row"] + (["conversation", "turn"] if self.carries_turns else [])
        columns += ["mode"] if self.carries_mode else []
        self._rows = pq.read_table(self.path / "samples.parquet", columns=columns)
        self._shards: dict[str, ShardReader] = {}
        # loss masks are read a row group at a time, when asked for
        self._pf = pq.ParquetFile(self.path / "samples.parquet")
        sizes = [self._pf.metadata.row_group(g).num_rows for g in range(self._pf.num_row_groups)]
        self._group_starts = [sum(sizes[:g]) for g in range(len(sizes))]
        self._group: tuple[int, list] = (-1, [])

    @property
    def families(self) -> dict:
        """The drafter families the states serve, as index.json records them (output/families_doc); an output
        written before it recorded them served EAGLE-3 alone, with every captured layer."""
        every = {"layers": self.layers, "positions": list(range(len(self.layers["physical"])))}
        return self.index.get("families") or {"eagle3": every}

    def __len__(self) -> int:
        return self._rows.num_rows

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]

    def __getitem__(self, i: int) -> Sample:
        import torch

        name, row = self._rows["shard"][i].as_py(), self._rows["row"][i].as_py()
        shard = self._shards.get(name)
        if shard is None:
            shard = self._shards[name] = ShardReader(self.path / "shards" / name)
        ids, aux, final = shard.sample(row)
        sample_id, mask = self._rows["id"][i].as_py(), self._mask(i)
        if len(mask) != len(ids):  # the sample list and the shards of two different runs
            raise ValueError(
                f"{self.path}: sample {i} ({sample_id}) has {len(ids)} tokens in {name} but a loss mask of "
                f"{len(mask)} in samples.parquet: the output was mixed from two runs; rerun the hidden_states stage"
            )
        turns = (self._rows["conversation"][i].as_py(), self._rows["turn"][i].as_py()) if self.carries_turns else ()
        mode = self._rows["mode"][i].as_py() if self.carries_mode else None
        return Sample(
            sample_id,
            ids,
            torch.tensor(mask, dtype=torch.long),
            aux,
            final,
            self.norm,
            *turns,
            mode=mode,
            policy=shard.policy(row),
        )

    def _mask(self, i: int) -> list[int]:
        g = bisect.bisect_right(self._group_starts, i) - 1
        if self._group[0] != g:
            self._group = (g, self._pf.read_row_group(g, columns=["loss_mask"]).column(0).to_pylist())
        return self._group[1][i - self._group_starts[g]]
