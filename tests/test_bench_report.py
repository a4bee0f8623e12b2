"""docs/benchmarks.md's figures are bench/report.py's rendering of bench/results/*.json, and no figure of a benchmark
is written by hand elsewhere in the README or the docs."""

from __future__ import annotations

import json
import re

from conftest import ROOT

from bench import report, report_demo

DOC = ROOT / "docs" / "benchmarks.md"


def test_docs_block_is_the_reports_output():
    assert report.DOC == DOC  # where `python -m bench.report --write` writes
    text = DOC.read_text()
    assert text.count(report.START) == 1 and text.count(report.END) == 1
    assert report.block(text) == report.render(), (
        "docs/benchmarks.md's benchmark figures differ from bench/results/*.json: run `python -m bench.report --write`"
    )


def test_every_results_file_is_rendered():
    rendered = {name for name, _, _ in report.SECTIONS}
    assert rendered == {p.name for p in (ROOT / "bench" / "results").glob("*.json")}
    assert "is missing" not in report.render()


def test_the_block_follows_the_json(tmp_path):
    """Rendered from the files, not fixed: a changed figure changes the block; a missing file names its command."""
    for src in (ROOT / "bench" / "results").glob("*.json"):
        (tmp_path / src.name).write_text(src.read_text())
    client = json.loads((tmp_path / "client.json").read_text())
    client["medians"]["ours"]["16"]["rps"] = 12345.6
    (tmp_path / "client.json").write_text(json.dumps(client))
    assert "| ours (streamed, the default) | 12,345.6 |" in report.render(tmp_path)
    (tmp_path / "tokenize.json").unlink()
    assert "`bench/results/tokenize.json` is missing: `python -m bench.tokenize` writes it." in report.render(tmp_path)


def test_replace_block_keeps_the_prose_around_it():
    text = f"before\n{report.START}\nold\n{report.END}\nafter\n"
    new = report.replace_block(text, "new\n")
    assert new == f"before\n{report.START}\nnew\n{report.END}\nafter\n"
    assert report.block(new) == "new\n"


def renderings(x: float) -> set[str]:
    """How prose would write `x`: rounded to 0-3 decimals, with or without thousands separators, keeping only
    renderings of at least 3 significant digits (fewer would match unrelated numbers: a round 500.0 µs is written
    "500", as an HTTP status or a prompt length is; zeros that only round it are not significant)."""
    out = set()
    for decimals in range(4):
        for s in (f"{x:,.{decimals}f}", f"{x:.{decimals}f}"):
            if len(s.replace(",", "").replace(".", "").strip("0")) >= 3:
                out.add(s)
    return out


def test_no_hand_written_benchmark_figures_outside_the_block():
    """The headline figures of the JSON appear in the generated block only, not restated in prose anywhere in the
    README or the docs (where they would go stale when a benchmark is rerun)."""
    r = {p.stem: json.loads(p.read_text()) for p in (ROOT / "bench" / "results").glob("*.json")}
    client, tok, hs, rel = r["client"], r["tokenize"], r["hidden_states"], r["reliability"]
    values = [
        *client["ratios"].values(),
        *(client["medians"][k]["16"]["cpu_us_per_request"] for k in ("ours", "openai", "raw")),
        *(client["per_token"][k]["cpu_us_per_token"] for k in ("ours", "openai", "raw")),
        *(t[k] for t in tok["templates"].values() for k in ("ratio", "stage_tok_s", "raw_tok_s", "id_path_tok_s")),
        *(d[k] for d in tok["drift"].values() for k in ("samples_differ_pct", "tokens_differ_pct")),
        *(hs[k] for k in ("ratio", "ours_tok_s", "naive_tok_s", "bytes_per_token", "fp8_bytes_per_token")),
        *(hs[k] for k in ("peak_rss_mb", "fp8_rel_err")),
        *(r[name][k]["cached"] for name in ("noop", "noop_turns") for k in ("median_wall_s", "median_cpu_s")),
    ]
    patterns = [rf"(?<![\d.,]){re.escape(s)}(?!\d|\.\d)" for v in values for s in renderings(v)]
    patterns += [rf"\b{rel['kill_trials']} kills", rf"\b{rel['bad_inputs']} bad inputs"]
    doc = DOC.read_text()
    outside = doc[: doc.index(report.START)] + doc[doc.index(report.END) :]
    pages = {"README.md": (ROOT / "README.md").read_text(), "docs/benchmarks.md, outside its block": outside}
    pages |= {f"docs/{p.name}": p.read_text() for p in (ROOT / "docs").glob("*.md") if p != DOC}
    for name, text in pages.items():
        for start, end in (report_demo.markers(b) for blocks in report_demo.BLOCKS.values() for b in blocks):
            text = re.sub(re.escape(start) + ".*?" + re.escape(end), "", text, flags=re.S)  # generated: the demo's
        found = [m.group(0) for pattern in patterns for m in [re.search(pattern, text)] if m]
        assert not found, f"{name} restates benchmark figures by hand: {found}; leave them to `python -m bench.report`"


def test_committed_results_hold_no_path_of_the_machine_that_ran_them():
    """Results are read from any checkout: no absolute path of the project or of a suite's temp directory."""
    import tempfile

    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        text = path.read_text()
        assert str(ROOT) not in text and f"{tempfile.gettempdir()}/" not in text, path.name


def test_the_reliability_suites_record_portable_paths():
    import tempfile

    from bench.reliability.__main__ import ROOT as PROJECT
    from bench.reliability.__main__ import portable

    work = f"{tempfile.gettempdir()}/draftdata-inputs-ab12_cd3"
    got = portable(
        {
            "rows": [{"got": f"the tokenizer at '{work}/variants/x' has no chat template"}, 3],
            "source": f"{PROJECT}/sources/demo/B3_magicoder.jsonl.gz",
        }
    )
    assert got == {
        "rows": [{"got": "the tokenizer at '<workdir>/variants/x' has no chat template"}, 3],
        "source": "sources/demo/B3_magicoder.jsonl.gz",
    }
