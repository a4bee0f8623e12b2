"""samples.parquet: the tokenized samples (`input_ids`, `loss_mask`, ids and lengths, the conversation and turn of
a regenerated conversation's) and their metadata."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from draftdata.tokenize.samples import Tokenized
from draftdata.util.files import atomic_path

SCHEMA_VERSION = 1


def samples_table(samples: list[Tokenized], meta: dict) -> pa.Table:
    """The samples as the pyarrow table samples.parquet holds, `meta` in its schema's metadata."""
    columns = [
        ("id", pa.string(), [s.id for s in samples]),
        ("input_ids", pa.list_(pa.int32()), [s.input_ids for s in samples]),
        ("loss_mask", pa.list_(pa.int8()), [s.loss_mask for s in samples]),
        ("n_tokens", pa.int32(), [len(s.input_ids) for s in samples]),
        ("n_trained", pa.int32(), [sum(s.loss_mask) for s in samples]),
    ]
    # Regenerated conversations (`turns: all`) name theirs, so a split can keep one conversation's samples
    # together; responses regenerated alone keep the columns above only, the file as it always was.
    if any(s.conversation is not None for s in samples):
        columns += [
            ("conversation", pa.string(), [s.conversation for s in samples]),
            ("turn", pa.int32(), [s.turn for s in samples]),
        ]
    if any(s.mode is not None for s in samples):  # a dataset with modes: each sample's (datasets.<D>.modes)
        columns.append(("mode", pa.string(), [s.mode for s in samples]))
    schema = pa.schema(
        [(name, kind) for name, kind, _ in columns], metadata={"draftdata": json.dumps(meta, sort_keys=True)}
    )
    return pa.table({name: values for name, _, values in columns}, schema=schema)


def write_parquet(path, table: pa.Table) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_metadata(path) -> dict:
    """The `draftdata` metadata of a samples.parquet: schema version, dataset, tokenizer identity."""
    return json.loads(pq.read_schema(path).metadata[b"draftdata"])
