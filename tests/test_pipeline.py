"""The chain prompts → generate → tokenize → hidden_states, in-process, on the embedded backend with the real
tiny model and a real SQLite store."""

from __future__ import annotations

import json
import sqlite3

import pyarrow.parquet as pq

from draftdata.util.files import read_jsonl


def metrics(project, dataset: str, stage: str) -> dict:
    return json.loads((project.data(dataset) / f"{stage}_metrics.json").read_text())


def store_rows(project) -> int:
    with sqlite3.connect(project.path / "store.sqlite") as db:
        return db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]


def test_generate_meets_budget_and_reuses_the_store(backend_project):
    project = backend_project
    project.run("prompts", "B3")
    project.run("generate", "B3")
    m = metrics(project, "B3", "generate")
    assert m["budget_met"] and m["budget_tokens"] >= 400
    # the last selected response may cross the budget, never by more than one response
    assert m["overshoot_tokens"] < 48
    rows = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert sum(r["completion_tokens"] for r in rows) == m["budget_tokens"]
    assert len({r["id"] for r in rows}) == len(rows)
    n_stored = store_rows(project)
    assert n_stored == m["newly_generated"] >= len(rows)

    # Same budget again: nothing is sent, the output is identical.
    before = (project.data("B3") / "responses.jsonl").read_bytes()
    project.run("generate", "B3")
    m2 = metrics(project, "B3", "generate")
    assert m2["newly_generated"] == 0 and store_rows(project) == n_stored
    assert (project.data("B3") / "responses.jsonl").read_bytes() == before

    # Lower budget: nothing generated, a prefix of the earlier output but for its last response (the shortest of
    # the rest that reaches the lower budget).
    project.set("datasets.B3.token_budget", 150)
    project.run("generate", "B3")
    m3 = metrics(project, "B3", "generate")
    assert m3["newly_generated"] == 0 and m3["budget_tokens"] >= 150
    lower = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert [r["id"] for r in lower[:-1]] == [r["id"] for r in rows[: len(lower) - 1]]

    # Higher budget: only the difference is generated; earlier responses are kept as they were.
    project.set("datasets.B3.token_budget", 800)
    project.run("generate", "B3")
    m4 = metrics(project, "B3", "generate")
    assert m4["budget_met"] and 0 < m4["newly_generated"] < m["newly_generated"] * 2 + 8
    higher = {r["id"]: r for r in read_jsonl(project.data("B3") / "responses.jsonl")}
    for r in rows:
        if r["id"] in higher:
            assert (higher[r["id"]]["output_ids"], higher[r["id"]]["text"]) == (r["output_ids"], r["text"])


def test_tokenize_is_token_exact(project):
    for stage in ("prompts", "generate", "tokenize"):
        project.run(stage, "B3")
    responses = {r["id"]: r for r in read_jsonl(project.data("B3") / "responses.jsonl")}
    table = pq.read_table(project.data("B3") / "samples.parquet")
    meta = json.loads(table.schema.metadata[b"draftdata"])
    assert meta["tokenizer"]["chat_template_sha256"]
    rows = table.to_pylist()
    assert len(rows) == len(responses)
    for row in rows:
        r = responses[row["id"]]
        assert row["input_ids"] == r["prompt_ids"] + r["output_ids"]
        assert row["loss_mask"] == [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"])
        assert row["n_trained"] == r["completion_tokens"]


def test_truncation_policy_drop_counts_and_excludes(project):
    project.set("datasets.B3.max_tokens", 4)  # almost every response hits max_tokens
    project.set("datasets.B3.on_truncation", "drop")
    project.set("datasets.B3.token_budget", 40)
    project.run("prompts", "B3")
    project.run("generate", "B3")
    m = metrics(project, "B3", "generate")
    assert m["skipped"].get("truncated_dropped", 0) > 0
    rows = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert all(r["finish_reason"] != "length" for r in rows)


def test_total_unit_budget_counts_prompts_and_completions(project):
    project.set("datasets.B3.budget_unit", "total")
    project.set("datasets.B3.token_budget", 3000)
    project.run("prompts", "B3")
    project.run("generate", "B3")
    m = metrics(project, "B3", "generate")
    rows = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    totals = [r["prompt_tokens"] + r["completion_tokens"] for r in rows]
    assert m["budget_met"] and sum(totals) == m["budget_tokens"] >= 3000
    assert m["overshoot_tokens"] < max(totals)  # the last response may cross the budget, by less than itself
    # the prompts count: fewer responses than the same budget in completion tokens would take
    assert sum(r["completion_tokens"] for r in rows) < 3000


def test_plot_files_and_the_summary(project, capsys):
    import csv

    from draftdata.util.plots import HISTOGRAM_BINS
    from stages.summary import main as summary

    for stage in ("prompts", "generate", "tokenize", "hidden_states"):
        project.run(stage, "B3")
    plots = project.data("B3") / "plots"
    m = metrics(project, "B3", "generate")
    hist = list(csv.DictReader((plots / "completion_lengths.csv").open()))
    assert len(hist) == HISTOGRAM_BINS and sum(int(r["responses"]) for r in hist) == m["responses"]
    assert [r["length"] for r in hist] == sorted(r["length"] for r in hist)  # labels sort as the bins do
    fill = [(float(r["seconds"]), int(r["tokens"])) for r in csv.DictReader((plots / "budget_fill.csv").open())]
    # the line ends at the count the last progress line gives: every finished response the policies keep, so past
    # the output's total when responses that finished together crossed the budget; time and tokens only grow
    last = [line for line in capsys.readouterr().out.splitlines() if line.startswith("generate B3: ")][-1]
    assert fill[-1][1] == int(last.split()[2].split("/")[0].replace(",", "")) >= m["budget_tokens"]
    assert fill[-1][1] <= m["kept_tokens"] and fill == sorted(fill)
    assert {r["budget"] for r in csv.DictReader((plots / "budget_fill.csv").open())} == {str(m["budget"])}
    skips = {r["reason"]: int(r["responses"]) for r in csv.DictReader((plots / "skips.csv").open())}
    t = metrics(project, "B3", "tokenize")
    kept = skips.pop("kept")
    assert "no_end_of_turn" in skips and sum(skips.values()) == sum(t["skipped"].values())
    assert kept + sum(skips.values()) == t["responses"]

    summary("B3")
    s = json.loads((project.data("B3") / "summary.json").read_text())
    assert s["tokens"] == m["budget_tokens"] and s["budget"] == 400 and s["samples"] == t["samples"]
    assert s["new"] + s["reused"] == m["completion_tokens"] and s["new"] > 0
    assert s["samples"] + s["skipped"] == m["responses"]
    # what tokenize kept of the budget: every token of samples.parquet, and the trained ones against the budget
    table = pq.read_table(project.data("B3") / "samples.parquet")
    assert t["tokens"] == sum(table.column("n_tokens").to_pylist())
    assert t["trained_tokens"] == sum(table.column("n_trained").to_pylist()) > 0
    assert s["trained"] == round(100 * t["trained_tokens"] / 400, 2)
    # and against every token of samples.parquet: the single-turn B3 trains its answers, not its prompts
    trained, every = sum(table.column("n_trained").to_pylist()), sum(table.column("n_tokens").to_pylist())
    assert s["trained_share"] == round(trained / every, 3) and 0 < s["trained_share"] < 1
    # a second run reuses every token
    project.run("generate", "B3")
    summary("B3")
    again = json.loads((project.data("B3") / "summary.json").read_text())
    assert again["new"] == 0 and again["reused"] == m["completion_tokens"]


def test_the_summary_reports_what_tokenize_kept_of_the_budget():
    """The budget is met on responses; tokenize may then skip some (too long, say): the summary says what was
    trained against the budget, beside the tokens generate met it with."""
    from stages.summary import summarise

    generate = {"budget_tokens": 1050, "budget": 1000, "overshoot_pct": 5.0, "completion_tokens": 1050}
    tokenize = {"samples": 9, "skipped": {"over_max_seq_len": 1}, "tokens": 2400, "trained_tokens": 940}
    s = summarise(generate, tokenize)
    assert (s["tokens"], s["trained"], s["trained_share"]) == (1050, 94.0, 0.392)
    assert max(len(k) for k in s) <= 14  # `dvc exp show` names each column by its key


def test_a_datasets_template_kwargs_reach_generate_and_tokenize_alike(project):
    """Two datasets of the same prompts under a thinking template, the model's kwargs saying thinking on and one
    dataset's saying off: that dataset's requests end with the empty thinking block the template writes for "off",
    the other's do not, and tokenize's text path (the responses stripped of their ids, as a server that sends text
    back leaves them) renders each dataset's samples with the same kwargs, so their context is exactly the ids sent."""
    from conftest import ROOT

    from draftdata.config.load import load_config
    from draftdata.model.tokenizer import load_tokenizer
    from draftdata.util.files import write_jsonl

    project.set("model.chat_template", str(ROOT / "conf" / "templates" / "qwen3_thinking.jinja"))
    project.set("model.template_kwargs", {"enable_thinking": True})
    project.set("datasets.B3.token_budget", 150)
    project.params["datasets"]["B3_off"] = dict(
        project.params["datasets"]["B3"], template_kwargs={"enable_thinking": False}
    )
    project.save()
    sent = {}
    for d in ("B3", "B3_off"):
        for stage in ("prompts", "generate"):
            project.run(stage, d)
        rows = list(read_jsonl(project.data(d) / "responses.jsonl"))
        sent[d] = {r["id"]: r["prompt_ids"] for r in rows}
        write_jsonl(project.data(d) / "responses.jsonl", [dict(r, prompt_ids=None, output_ids=None) for r in rows])
        project.run("tokenize", d)
        assert metrics(project, d, "tokenize")["text_path_samples"] == len(rows) > 0
        for s in pq.read_table(project.data(d) / "samples.parquet").to_pylist():
            context = s["input_ids"][: s["loss_mask"].index(1)]
            assert context == sent[d][s["id"]]  # tokenize rendered what generate sent

    tok = load_tokenizer(load_config("B3", [], params_path=project.path / "params.yaml").model)
    both = sent["B3"].keys() & sent["B3_off"].keys()
    assert both
    for rid in both:
        on, off = sent["B3"][rid], sent["B3_off"][rid]
        assert off[: len(on)] == on and tok.decode(off[len(on) :]) == "<think>\n\n</think>\n\n"
