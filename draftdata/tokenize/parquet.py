"""samples.parquet: the tokenized samples (`input_ids`, `loss_mask`, ids and lengths) and their metadata."""

from __future__ import annotations

import json

from draftdata.tokenize.samples import Tokenized
from draftdata.util.files import atomic_path

SCHEMA_VERSION = 1


def write_parquet(path, samples: list[Tokenized], meta: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

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
    table = pa.table(
        {
            "id": [s.id for s in samples],
            "input_ids": [s.input_ids for s in samples],
            "loss_mask": [s.loss_mask for s in samples],
            "n_tokens": [len(s.input_ids) for s in samples],
            "n_trained": [sum(s.loss_mask) for s in samples],
        },
        schema=schema,
    )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_metadata(path) -> dict:
    """The `draftdata` metadata of a samples.parquet: schema version, dataset, tokenizer identity."""
    import pyarrow.parquet as pq

    return json.loads(pq.read_schema(path).metadata[b"draftdata"])
