"""The rejection ledger: every source row the chain reads is kept (a sample holds what came of it) or listed once in
`data/<D>/rejected.jsonl` with the stage that dropped it and why, on every demo dataset."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import DEMO, ROOT

from draftdata.util.files import read_jsonl

DEMO_PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())["datasets"]


@pytest.mark.parametrize("name", sorted(DEMO_PARAMS))
def test_kept_and_rejected_rows_add_up_to_the_rows_read(project, name):
    """The demo's own settings for the source, small budgets, a cap on the prompts and a max_seq_len tight enough
    that tokenize skips some: the rows kept and the ledger's rows add up to the rows read, the ledger names each
    prompt the output lacks once, and its reasons are the stages' own counts."""
    import stages.summary

    ds = dict(DEMO_PARAMS[name], concurrency=8, max_prompts=24, max_tokens=48, token_budget=240)
    ds["source"] = dict(ds["source"], path=str(DEMO / Path(ds["source"]["path"]).name))
    project.params["datasets"] = {name: ds}
    project.params["tokenize"].update(max_seq_len=160, max_skip_pct=100.0)
    project.save()
    for stage in ("prompts", "generate", "tokenize"):
        project.run(stage, name)
    stages.summary.main(name)
    out = project.data(name)
    metrics = {s: json.loads((out / f"{s}_metrics.json").read_text()) for s in ("prompts", "generate", "tokenize")}
    lines = list(read_jsonl(out / "rejected.jsonl"))
    rows = [line for line in lines if line["unit"] == "row"]
    assert metrics["tokenize"]["rows_kept"] + len(rows) == metrics["prompts"]["rows_read"]
    for stage in ("prompts", "generate", "tokenize"):  # each stage's lines are its own counts
        assert Counter(line["reason"] for line in rows if line["stage"] == stage) == Counter(
            metrics[stage]["dropped" if stage == "prompts" else "rejected"]
        )
    # generate: each prompt the output holds no line of, once; the others are in it
    prompts = [rec["id"] for rec in read_jsonl(out / "prompts.jsonl")]
    answered = {rec.get("conversation", rec["id"]) for rec in read_jsonl(out / "responses.jsonl")}
    missing = [line["id"] for line in rows if line["stage"] == "generate"]
    assert sorted(missing + sorted(answered)) == sorted(prompts)
    # tokenize: the rows kept are the rows a sample holds
    table = pq.read_table(out / "samples.parquet").to_pylist()
    assert metrics["tokenize"]["rows_kept"] == len({s.get("conversation") or s["id"] for s in table})
    assert all(line.get("id") or line.get("where") for line in lines)


def test_an_empty_ledger_is_said_to_be_the_reason_for_dvc_s_warning(project, capsys):
    """DVC warns `'data/<D>/tokenize_rejected.jsonl' is empty.` after a clean tokenize: the stage says first what
    that means, and only where its ledger is empty."""
    for stage in ("prompts", "generate", "tokenize"):
        project.run(stage, "B3")
    out = capsys.readouterr().out
    for stage in ("prompts", "generate", "tokenize"):
        ledger = project.data("B3") / f"{stage}_rejected.jsonl"
        line = f"{stage} rejected=0 ledger=data/B3/{stage}_rejected.jsonl is empty (DVC's warning of it: nothing was"
        assert (line in out) == (ledger.stat().st_size == 0), stage
    assert (project.data("B3") / "prompts_rejected.jsonl").stat().st_size > 0  # one each way: the demo's duplicates
    assert (project.data("B3") / "tokenize_rejected.jsonl").stat().st_size == 0
