"""Generation modes (`datasets.<D>.modes`): each row's mode drawn from its content key and the weights, each mode's
settings over the dataset's, the budget split by weight with each share landed exactly, and the mode recorded on
every row of every output."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow.parquet as pq
import pytest
from conftest import ROOT

from draftdata.config.modes import budget_shares, mode_of
from draftdata.config.schema import DatasetConfig, ModeConfig
from draftdata.errors import ConfigError
from draftdata.util.files import read_jsonl

THINK_PLAIN = {
    "think": {"weight": 0.7, "template_kwargs": {"enable_thinking": True}},
    "plain": {"weight": 0.3, "template_kwargs": {"enable_thinking": False}, "sampling": {"temperature": 0.6}},
}


def modes(**weights: float) -> dict[str, ModeConfig]:
    return {name: ModeConfig(weight=w) for name, w in weights.items()}


def test_a_rows_mode_is_its_key_and_the_weights_and_the_shares_add_up_to_the_budget():
    ds = DatasetConfig(token_budget=1_001, modes=modes(think=0.7, plain=0.3))
    ids = [f"row{i}" for i in range(4_000)]
    drawn = [mode_of(i, ds) for i in ids]
    assert drawn == [mode_of(i, ds) for i in ids]  # a function of the key: the same on every run
    assert Counter(drawn)["think"] / len(ids) == pytest.approx(0.7, abs=0.03)
    assert budget_shares(ds) == {"plain": 300, "think": 701}  # whole tokens, adding up to the budget
    # a third mode takes its share from the others' rows, and a row moves only into it: the rows stored under
    # the other modes stay theirs
    three = DatasetConfig(token_budget=1_001, modes=modes(think=0.7, plain=0.3, alt=0.5))
    moved = [mode_of(i, three) for i in ids]
    assert all(new in (old, "alt") for old, new in zip(drawn, moved))
    assert Counter(moved)["alt"] / len(ids) == pytest.approx(0.5 / 1.5, abs=0.03)
    assert mode_of("row0", DatasetConfig(token_budget=1)) is None  # no modes


@pytest.mark.parametrize(
    "mode, key",
    [
        ({"weight": 0.0}, "datasets.B3.modes.m.weight"),
        ({"weight": float("nan")}, "datasets.B3.modes.m.weight"),
        ({"sampling": {"temprature": 0.5}}, "datasets.B3.modes.m.sampling.temprature"),
        ({"sampling": {"top_p": 1.5}}, "datasets.B3.modes.m.sampling.top_p"),
    ],
)
def test_a_bad_mode_is_refused_naming_its_key(project, mode, key):
    """In params.yaml, before any work: the stage stops on the config, not on its missing prompts."""
    project.params["datasets"]["B3"]["modes"] = {"m": mode}
    project.save()
    with pytest.raises(ConfigError) as e:
        project.run("generate", "B3")
    assert key in str(e.value)
    project.params["datasets"]["B3"]["modes"] = {"a b": {}}
    project.save()
    with pytest.raises(ConfigError, match="datasets.B3.modes.a b"):
        project.run("generate", "B3")


def test_modes_on_the_thinking_template_split_land_and_record(project, capsys):
    """think 0.7 / plain 0.3 on the tiny target with the shipped qwen3_thinking template: each share lands exactly
    (past it by less than its last answer), each row's prompt is rendered in its mode, and the mode is on every
    row of responses.jsonl, samples.parquet, the hidden states and speculators' export; a rerun and a raised budget
    keep every row's mode."""
    from transformers import AutoTokenizer

    from draftdata.hidden.reader import HiddenStates

    project.params["model"]["chat_template"] = str(ROOT / "conf" / "templates" / "qwen3_thinking.jinja")
    # the tiny target's answers are short with thinking off: every prompt of the source, small budgets
    project.params["datasets"]["B3"].update(token_budget=300, max_prompts=None, modes=THINK_PLAIN)
    project.save()
    for stage in ("prompts", "generate"):
        project.run(stage, "B3")
    said = capsys.readouterr().out
    assert all(f"generate dataset=B3 mode={name} committed=0 budget=" in said for name in THINK_PLAIN)  # whose share
    out = project.data("B3")
    rows = list(read_jsonl(out / "responses.jsonl"))
    metrics = json.loads((out / "generate_metrics.json").read_text())
    max_tokens = project.params["datasets"]["B3"]["max_tokens"]
    ds = DatasetConfig(token_budget=300, modes={k: ModeConfig(**v) for k, v in THINK_PLAIN.items()})
    assert {r["mode"] for r in rows} == {"think", "plain"}
    assert all(r["mode"] == mode_of(r["id"], ds) for r in rows)
    for name, share in budget_shares(ds).items():
        mine = metrics["modes"][name]
        assert mine["budget"] == share and share <= mine["budget_tokens"] < share + max_tokens
        assert mine["budget_tokens"] == sum(r["completion_tokens"] for r in rows if r["mode"] == name)
    assert metrics["budget_tokens"] == sum(m["budget_tokens"] for m in metrics["modes"].values())
    # each mode's reasoning counted apart, and the dataset's (the tiny target writes no </think>: none here)
    assert metrics["reasoning_tokens"] == sum(m["reasoning_tokens"] for m in metrics["modes"].values())
    # the plain rows' prompts end in the empty think block the template writes with thinking off
    tok = AutoTokenizer.from_pretrained(project.params["model"]["path"])
    for r in rows:
        tail = tok.decode(r["prompt_ids"][-8:])
        assert ("</think>" in tail) == (r["mode"] == "plain"), (r["mode"], tail)
    first = (out / "responses.jsonl").read_bytes()
    project.run("generate", "B3")
    assert (out / "responses.jsonl").read_bytes() == first  # the same params: the same rows, the same modes
    # downstream: every output row names its mode
    for stage in ("tokenize", "hidden_states"):
        project.run(stage, "B3")
    modes_of = {r["id"]: r["mode"] for r in rows}
    samples = pq.read_table(out / "samples.parquet").to_pylist()
    assert samples and all(s["mode"] == modes_of[s["id"]] for s in samples)
    hs = HiddenStates(out / "hidden_states")
    assert [s.mode for s in hs] == [s["mode"] for s in samples]
    project.run("export", "B3", "export.format=speculators")
    from datasets import load_from_disk

    exported = load_from_disk(str(out / "export-speculators-eagle3"))
    assert list(exported["mode"]) == [s["mode"] for s in samples]
    project.run("export", "B3", "export.format=specforge")
    import torch

    from draftdata.hidden.export import specforge_path

    files = [out / "export-specforge-eagle3" / specforge_path(i) for i in range(len(samples))]
    assert [torch.load(f, weights_only=False)["mode"] for f in files] == [s["mode"] for s in samples]
    # tokenize.empty_think: train: each plain sample trains its empty think block too, a think sample nothing more
    project.set("tokenize.empty_think", "train")
    project.run("tokenize", "B3")
    again = pq.read_table(out / "samples.parquet").to_pylist()
    more = {(a["mode"], sum(b["loss_mask"]) - sum(a["loss_mask"])) for a, b in zip(samples, again)}
    assert ("think", 0) in more and len(more) == 2 and min(n for m, n in more if m == "plain") > 0
    project.set("tokenize.empty_think", "auto")
    check_mode_rows(project, metrics, ds, samples)
    # a raised budget: every row of the smaller output is in the larger one, with its mode
    project.set("datasets.B3.token_budget", 380)
    project.run("generate", "B3")
    raised = {r["id"]: r["mode"] for r in read_jsonl(out / "responses.jsonl")}
    assert all(raised.get(i) == m for i, m in modes_of.items())


def check_mode_rows(project, metrics: dict, ds: DatasetConfig, samples: list[dict]) -> None:
    """Each mode's row in summary.json, compare, plan, and the online exports' mode on every row."""
    from datasets import load_from_disk

    out = project.data("B3")
    modes_of = {s["id"]: s["mode"] for s in samples}
    # the summary counts the modes' rows as the dataset's; plan reads the config without tripping on them
    from stages.summary import main as summary

    summary("B3")
    summed = json.loads((out / "summary.json").read_text())
    assert summed["tokens"] == metrics["budget_tokens"]
    # and gives each mode's row: its tokens against its share, as compare prints them beneath the dataset's
    for name, m in metrics["modes"].items():
        assert summed["modes"][name] == {
            "tokens": m["budget_tokens"],
            "budget": m["budget"],
            "responses": m["responses"],
            "reasoning_share": m["reasoning_share"],
        }
    from draftdata.cli.compare import table

    printed = table([("workspace", {"B3": summed})], "B3")
    assert [line.split()[:3] for line in printed[3:]] == [
        ["mode", name, f"{budget_shares(ds)[name]:,}"] for name in sorted(ds.modes)
    ]
    from draftdata.cli.plan import main as plan
    from draftdata.cli.plan_table import render
    from draftdata.config.load import load_config

    cfg = load_config(None, [], params_path=project.path / "params.yaml", need_dataset=False)
    (planned,) = plan(cfg, None)
    # each mode's requests keyed as generate keys them: every stored answer is found, nothing is left to generate
    assert planned.dataset == "B3" and planned.budget == 300
    assert planned.reusable >= metrics["budget_tokens"] and planned.to_generate == 0
    assert [(m.mode, m.budget, m.prompts, m.to_generate) for m in planned.modes] == [
        (name, share, metrics["modes"][name]["prompts"], 0) for name, share in budget_shares(ds).items()
    ]
    assert all(m.reusable >= metrics["modes"][m.mode]["budget_tokens"] for m in planned.modes)
    shown = [line.split()[:3] for line in render([planned], None, cfg).splitlines() if line.startswith("  mode ")]
    assert shown == [["mode", m.mode, f"{m.prompts:,}"] for m in planned.modes]  # beneath the dataset's row
    # the online exports: speculators' rows and SpecForge's conversations name their mode
    project.run("export", "B3", "export.format=speculators_online")
    assert list(load_from_disk(str(out / "export-speculators_online-eagle3"))["mode"]) == [s["mode"] for s in samples]
    project.run("export", "B3", "export.format=specforge_online")
    convs = list(read_jsonl(out / "export-specforge_online-eagle3" / "conversations.jsonl"))
    assert convs and all(c["mode"] == modes_of[c["id"]] for c in convs)


def test_one_mode_equal_to_the_datasets_settings_regenerates_nothing(project):
    project.run("prompts", "B3")
    project.run("generate", "B3")
    before = [r["key"] for r in read_jsonl(project.data("B3") / "responses.jsonl")]
    project.params["datasets"]["B3"]["modes"] = {"all": {"weight": 1.0}}
    project.save()
    project.run("generate", "B3")
    rows = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    metrics = json.loads((project.data("B3") / "generate_metrics.json").read_text())
    assert [r["key"] for r in rows] == before and {r["mode"] for r in rows} == {"all"}
    assert metrics["newly_generated"] == 0 and metrics["modes"]["all"]["budget"] == metrics["budget"]


def test_the_reasoning_is_counted_apart_where_the_server_or_the_template_separates_it(tiny_model):
    from transformers import AutoTokenizer

    from draftdata.generate.land.output import reasoning_figures, reasoning_tokens
    from draftdata.generate.store import StoredResponse

    tok = AutoTokenizer.from_pretrained(tiny_model)

    def answer(text: str, reasoning: str | None = None, n: int = 40) -> StoredResponse:
        return StoredResponse("k", "D", "p", text, 2, n, "stop", "s", 0.1, reasoning=reasoning)

    think = "<think>\nThe sum of 2 and 2 is 4.\n</think>"
    in_text = answer(f"{think}\n\nIt is 4.")  # a thinking template's answer: the reasoning ends at </think>
    assert reasoning_tokens(in_text, tok) == len(tok.encode(think, add_special_tokens=False)) > 0
    parsed = answer("It is 4.", reasoning="The sum of 2 and 2 is 4.")  # a server's reasoning parser moved it out
    assert reasoning_tokens(parsed, tok) == len(tok.encode("The sum of 2 and 2 is 4.", add_special_tokens=False))
    assert reasoning_tokens(answer("It is 4."), tok) == 0  # thinking off, or a chat answer
    figures = reasoning_figures([(None, in_text), (None, answer("It is 4."))], tok)
    assert figures == {
        "reasoning_tokens": reasoning_tokens(in_text, tok),
        "reasoning_share": round(reasoning_tokens(in_text, tok) / 80, 4),
    }


def test_an_empty_think_setting_the_template_cannot_meet_is_refused_by_check_params(project):
    """The tiny target's own template writes no think block: `train` has nothing to act on, said before any stage
    runs, naming the key."""
    project.set("tokenize.empty_think", "train")
    with pytest.raises(ConfigError, match="tokenize.empty_think"):
        project.run("check_params", None)
    project.set("model.chat_template", str(ROOT / "conf" / "templates" / "qwen3_thinking.jinja"))
    project.run("check_params", None)  # Qwen3's writes one with thinking off


def test_modes_on_a_real_server_and_in_process(backend_project):
    """Two modes that differ in sampling only, on the embedded engine and on `transformers serve` (text back, no
    ids: tokenize renders each mode's rows on the text path): each share lands, the rows and samples name their
    mode, and a rerun sends nothing and writes the same bytes."""
    project = backend_project
    project.params["datasets"]["B3"]["modes"] = {
        "cold": {"weight": 1.0, "sampling": {"temperature": 0.7}},  # lower, the tiny target answers empty
        "warm": {"weight": 1.0, "sampling": {"temperature": 1.0}},
    }
    project.save()
    for stage in ("prompts", "generate", "tokenize"):
        project.run(stage, "B3")
    out = project.data("B3")
    metrics = json.loads((out / "generate_metrics.json").read_text())
    max_tokens = project.params["datasets"]["B3"]["max_tokens"]
    for name in ("cold", "warm"):
        mine = metrics["modes"][name]
        assert mine["budget"] == 200 and 200 <= mine["budget_tokens"] < 200 + max_tokens
    rows = list(read_jsonl(out / "responses.jsonl"))
    assert Counter(r["mode"] for r in rows).keys() == {"cold", "warm"}
    samples = pq.read_table(out / "samples.parquet").to_pylist()
    modes_of = {r["id"]: r["mode"] for r in rows}
    assert samples and all(s["mode"] == modes_of[s["id"]] for s in samples)
    first = (out / "responses.jsonl").read_bytes()
    project.run("generate", "B3")
    again = json.loads((out / "generate_metrics.json").read_text())
    assert again["newly_generated"] == 0 and (out / "responses.jsonl").read_bytes() == first


def test_weights_that_do_not_add_up_to_one_are_said_to_be_shares(project, capsys):
    project.params["datasets"]["B3"]["modes"] = {"think": {"weight": 2}, "plain": {"weight": 1}}
    project.save()
    project.run("check_params", None)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "modes:" in x]
    assert "datasets.B3.modes: the weights add up to 3, not 1; taken as shares: plain 33%, think 67%" in line
    project.params["datasets"]["B3"]["modes"] = {"think": {"weight": 0.7}, "plain": {"weight": 0.3}}
    project.save()
    project.run("check_params", None)
    assert "modes:" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides",
    [
        ["datasets.B3.modes={think: {weight: 0.7}, plain: {weight: 0.3}}"],
        ["++datasets.B3.modes={think: {weight: 0.7}, plain: {weight: 0.3}}"],
        ["+datasets.B3.modes.think.weight=0.7", "+datasets.B3.modes.plain.weight=0.3"],
        ["datasets.B3.modes.think.weight=0.7", "datasets.B3.modes.plain={weight: 0.3}"],
    ],
)
def test_modes_are_set_from_the_command_line_in_each_form(project, overrides):
    """The plain mapping failed with "unknown key 'think'", the dotted `+` form with "dict is not a subclass of
    ModeConfig": only `++` worked."""
    from draftdata.config.load import load_config

    cfg = load_config(
        "B3", [*overrides, "datasets.B3.modes.think.sampling.temperature=0.6"], project.path / "params.yaml"
    )
    modes = cfg.datasets["B3"].modes
    assert {name: m.weight for name, m in modes.items()} == {"think": 0.7, "plain": 0.3}
    assert modes["think"].sampling == {"temperature": 0.6} and modes["plain"].sampling == {}


def test_a_mode_given_as_a_number_is_refused_naming_the_forms_that_work(project):
    from draftdata.config.load import load_config

    with pytest.raises(ConfigError) as err:
        load_config("B3", ["datasets.B3.modes={think: 0.7}"], project.path / "params.yaml")
    assert str(err.value).startswith("datasets.B3.modes.think: ") and (
        "datasets.B3.modes={think: {weight: 0.5}}, or a key at a time: datasets.B3.modes.think.weight=0.5"
        in str(err.value)
    )


def test_generate_says_the_weights_are_taken_as_shares(project, capsys):
    """A mode set on the command line meets no check_params: the stage says it too."""
    project.run("prompts", "B3")
    project.run("generate", "B3", "datasets.B3.modes.think.weight=2", "datasets.B3.modes.plain.weight=1")
    out = capsys.readouterr().out
    assert "warning=datasets.B3.modes: the weights add up to 3, not 1; taken as shares: plain 33%, think 67%" in out
