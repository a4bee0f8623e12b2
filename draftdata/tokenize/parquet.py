"""samples.parquet: the tokenized samples (`input_ids`, `loss_mask`, ids and lengths) and their metadata."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from draftdata.tokenize.samples import Tokenized
from draftdata.util.files import atomic_path

SCHEMA_VERSION = 1


def samples_table(samples: list[Tokenized], meta: dict) -> pa.Table:
    """The samples as the pyarrow table samples.parquet holds, `meta` in its schema's metadata."""
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("n_tokens", pa.int32()),
            ("n_trained", pa.int32()),
        ],
        metadata={"draftdata": json.dumps(meta, sort_keys=True)},
    )
    return pa.table(
        {
            "id": [s.id for s in samples],
            "input_ids": [s.input_ids for s in samples],
            "loss_mask": [s.loss_mask for s in samples],
            "n_tokens": [len(s.input_ids) for s in samples],
            "n_trained": [sum(s.loss_mask) for s in samples],
        },
        schema=schema,
    )


def write_parquet(path, table: pa.Table) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_metadata(path) -> dict:
    """The `draftdata` metadata of a samples.parquet: schema version, dataset, tokenizer identity."""
    return json.loads(pq.read_schema(path).metadata[b"draftdata"])
