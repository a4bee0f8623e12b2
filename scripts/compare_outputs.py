"""Compare the outputs of two runs of the pipeline, dataset by dataset: `python scripts/compare_outputs.py A B`.

A and B are project directories after `dvc repro`. Per dataset: responses.jsonl byte for byte, samples.parquet as an
Arrow table with its metadata, and every hidden-state tensor as the reader returns it (ids, loss mask, aux states,
pre- and post-norm final states) with torch.equal. Exits 1 on any difference. Used to show that a change to the code
leaves the data as it was (give the second run the first one's response store: which responses a run completes
before its budget's cut depends on timing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch

from draftdata.hidden import HiddenStates


def parquet_meta(path: Path) -> dict:
    return json.loads(pq.read_schema(path).metadata[b"draftdata"])


def same_states(a: Path, b: Path) -> tuple[bool, int]:
    n, same = 0, True
    for x, y in zip(HiddenStates(a), HiddenStates(b), strict=True):
        n += 1
        same &= x.id == y.id and torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        same &= torch.equal(x.aux, y.aux) and torch.equal(x.final_pre_norm, y.final_pre_norm)
        same &= torch.equal(x.final_post_norm, y.final_post_norm)
    return same, n


def compare(a: Path, b: Path) -> tuple[bool, str]:
    responses = (a / "responses.jsonl").read_bytes() == (b / "responses.jsonl").read_bytes()
    ta, tb = pq.read_table(a / "samples.parquet"), pq.read_table(b / "samples.parquet")
    samples = ta.equals(tb) and parquet_meta(a / "samples.parquet") == parquet_meta(b / "samples.parquet")
    try:
        states, n = same_states(a / "hidden_states", b / "hidden_states")
    except ValueError:  # zip(strict=True): not the same number of samples
        states, n = False, -1
    line = f"responses.jsonl identical={responses}  samples.parquet equal={samples} ({ta.num_rows} rows)  "
    line += f"hidden states equal={states} ({n} samples)"
    return responses and samples and states, line


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    a, b = (Path(p) / "data" for p in argv)
    names = sorted(p.name for p in a.iterdir() if p.is_dir())
    ok = bool(names)
    for name in names:
        same, line = compare(a / name, b / name)
        ok &= same
        print(f"{name}: {line}")
    print("identical" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
