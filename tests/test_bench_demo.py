"""The demo's figures in README and the docs come from `python -m bench.demo` (bench/results/demo.json), rendered by
bench/report_demo.py: each block equals its rendering, and the results are those of the demo params.yaml holds now
(a change to the demo without a new run fails here, not in a newcomer's hands)."""

from __future__ import annotations

import re

import pytest
import yaml
from conftest import ROOT

from bench import report_demo
from draftdata.util.blocks import between

DEMO = report_demo.load()
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


@pytest.mark.parametrize(
    ("page", "name"), [(page, name) for page, blocks in report_demo.BLOCKS.items() for name in blocks]
)
def test_each_demo_block_is_its_rendering_of_the_results(page, name):
    text = (ROOT / page).read_text()
    assert between(text, *report_demo.markers(name)) == report_demo.rendered(page, name, DEMO), (
        f"{page}'s {name} block is stale: python -m bench.report --write"
    )


def test_the_results_are_the_demo_params_yaml_holds():
    assert DEMO["model"]["path"] == PARAMS["model"]["path"]
    assert {name: d["budget"] for name, d in DEMO["datasets"].items()} == {
        name: ds["token_budget"] for name, ds in PARAMS["datasets"].items()
    }, "params.yaml's demo changed since bench/results/demo.json: python -m bench.demo, then bench.report --write"


def test_the_results_hold_no_path_of_the_machine_that_made_them():
    text = (ROOT / "bench" / "results" / "demo.json").read_text()
    assert not re.search(r"/root|/home/|/tmp/|/work/", text)


def test_the_quoted_answer_is_the_demo_s():
    """README quotes one demo answer, cut with `[...]`: every piece of it is in the answer the run gave."""
    readme = (ROOT / "README.md").read_text()
    quote = " ".join(line[2:] for line in readme.splitlines() if line.startswith("> "))
    pieces = [p.strip() for p in quote.split("[...]") if p.strip()]
    answer = " ".join(DEMO["quoted_answer"].split())
    assert pieces and all(p in answer for p in pieces), pieces


def test_the_run_s_progress_lines_held_no_eta_0s_with_work_left():
    progress = DEMO["progress"]
    assert progress["eta_lines"] > 0 and progress["eta_0s_with_work_left"] == 0
