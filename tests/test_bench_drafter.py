"""`python -m bench.drafter`: its variants cut the states they claim to, its figures reach the README only through
`python -m bench.report --write`, and (under the `trainers` marker) a short run trains a drafter on our export that
beats one trained on the same states by a trainer that expects the post-norm final state (the error this small target
shows beyond the seeds' spread; the aux layers off by one cost it less than that, see docs/benchmarks.md) and one
that sees no states at all."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from bench import drafter, drafter_runs, drafter_train, report
from bench.drafter_train import Select

TRAINERS_PYTHON = os.environ.get("DRAFTDATA_TRAINERS_PYTHON")
README = ROOT / "README.md"


def test_select_cuts_the_variants_layers_and_final_state():
    """An export sample holds every layer (k=4 here, H=2): a variant's layers come out in its order; `post` applies
    the norm it is given to the final state."""
    t, k, h = 3, 4, 2
    states = torch.arange(t * k * h, dtype=torch.float32).reshape(t, k, h)
    item = {"hidden_states": states.flatten(1), "verifier_last_hidden_states": torch.ones(t, h)}
    got = Select([3, 1], h, k)(dict(item))
    assert torch.equal(got["hidden_states"], torch.cat([states[:, 3], states[:, 1]], dim=1))
    assert torch.equal(got["verifier_last_hidden_states"], torch.ones(t, h))
    doubled = Select([0], h, k, norm=lambda x: 2 * x)(dict(item))
    assert torch.equal(doubled["verifier_last_hidden_states"], torch.full((t, h), 2.0))


def test_the_variants_are_the_errors_they_name():
    layers = {name: v[1] for name, v in drafter.VARIANTS.items()}
    assert layers["correct"] == [1, 3, 4]  # EAGLE-3's default for 8 layers: [1, N//2 - 1, N - 4]
    assert layers["aux_off_by_one"] == [2, 4, 5] and layers["aux_reversed"] == [4, 3, 1]
    assert {drafter.VARIANTS[n][2] for n in ("post_norm_as_pre", "pre_norm_as_post")} == {"post", "pre_as_post"}


def test_the_block_variants_read_their_familys_export_and_layers():
    """dflash and dspark train on their family's export of `all` with the block drafters' default layers (z-lab's rule
    for 5, physical ids); dflash's error reads each layer one above out of `all` (which holds it), dspark's the
    post-norm last state; the capture holds every layer any variant reads."""
    v = drafter.VARIANTS
    block = [1, 2, 3, 4, 5]  # round(1 + i(N - 4)/4) for N = 8
    assert v["dflash"] == ("all_dflash", block, "pre", "dflash")
    assert v["dflash_layers_off_by_one"] == ("all", [2, 3, 4, 5, 6], "pre", "dflash")
    assert v["dspark"] == ("all_dspark", block, "pre", "dspark")
    assert v["dspark_post_norm_as_pre"] == ("all_dspark", block, "post", "dspark")
    assert all(x[3] == "eagle3" for n, x in v.items() if not n.startswith(("dflash", "dspark", "peagle", "domino")))
    assert [drafter.correct_for(n) for n in drafter.ERRORS] == ["correct"] * 4 + [
        "dflash",
        "dflash2",
        "dspark",
        "peagle",
        "domino",
    ]
    # SpecForge's Domino reads DFlash's layers and rows (speculators has no export for it), its error DFlash's
    assert v["domino"] == ("all_dflash", block, "pre", "domino")
    assert v["domino_layers_off_by_one"] == v["dflash_layers_off_by_one"][:3] + ("domino",)
    assert drafter.captured_layers(8) == [1, 2, 3, 4, 5, 6]
    deep = drafter.variants_for(16)
    assert deep["dflash"][1] == [1, 4, 7, 10, 13] and deep["dflash_layers_off_by_one"][1] == [2, 5, 8, 11, 14]
    assert set(drafter.captured_layers(16)) == {1, 2, 4, 5, 7, 8, 10, 11, 12, 13, 14}


def test_dflash2_and_peagle_read_their_familys_export_beside_their_own_errors():
    """dflash2 as dflash (its export of `all`, the block layers; its error each layer one above, out of `all`);
    peagle EAGLE-3's layers from its own export, its error the post-norm last state as EAGLE-3's `post_norm_as_pre`;
    each error judged against its own family's drafter, and both families exported from `all`'s states."""
    v = drafter.VARIANTS
    block, eagle3 = [1, 2, 3, 4, 5], v["correct"][1]
    assert v["dflash2"] == ("all_dflash2", block, "pre", "dflash2")
    assert v["dflash2_layers_off_by_one"] == ("all", [i + 1 for i in block], "pre", "dflash2")
    assert v["peagle"] == ("all_peagle", eagle3, "pre", "peagle")
    assert v["peagle_post_norm_as_pre"] == ("all_peagle", eagle3, "post", "peagle")
    assert v["peagle_post_norm_as_pre"][2] == v["post_norm_as_pre"][2]
    assert drafter.correct_for("dflash2_layers_off_by_one") == "dflash2"
    assert drafter.correct_for("peagle_post_norm_as_pre") == "peagle"
    assert drafter.CUT_FROM["all_dflash2"] == ("all", "dflash2") and drafter.CUT_FROM["all_peagle"] == ("all", "peagle")
    assert drafter.captured_layers(8) == sorted({i for x in v.values() for i in x[1]})  # nothing new to capture


def test_a_dflash2_variant_with_a_draft_vocabulary_is_refused_before_any_work(capsys):
    """speculators' DFlash2 drafts over the target's whole vocabulary: a large target's default draft vocabulary
    would fail in its constructor after the data, so the pair is one line up front; the other families take it."""
    ap = argparse.ArgumentParser(prog="bench.drafter")
    with pytest.raises(SystemExit) as err:
        drafter.check_vocab(ap, ["correct", "dflash2", "dflash2_layers_off_by_one"], 8192)
    msg = capsys.readouterr().err
    assert err.value.code == 2 and "dflash2,dflash2_layers_off_by_one" in msg and "--draft-vocab 0" in msg
    drafter.check_vocab(ap, ["correct", "dflash2"], 0)
    drafter.check_vocab(ap, ["correct", "peagle", "dflash", "dspark"], 8192)


def test_peagle_is_judged_on_every_depth_of_every_rollout_and_trained_without_padding():
    """P-EAGLE's sampler replaced when judged: every position at depth 0, then a rollout from each trained position
    through every depth that stays in the sample; a pack is cut before its padding (document id -1), which its mask
    leaves no key."""
    anchor, depth = drafter_train.full_rollouts(5, torch.tensor([[0, 1, 1, 0, 1]]), 3)
    assert list(zip(anchor.tolist(), depth.tolist())) == [
        *((i, 0) for i in range(5)),
        (1, 1),
        (2, 1),  # anchor 4's slot 5 is past the sample
        (1, 2),
        (2, 2),
    ]
    batch = {"document_ids": torch.tensor([[0, 0, 1, -1, -1]]), "input_ids": torch.arange(5).unsqueeze(0)}
    cut = drafter_train.unpadded(batch)
    assert cut["input_ids"].tolist() == [[0, 1, 2]] and cut["document_ids"].tolist() == [[0, 0, 1]]


def test_the_capture_serves_every_family_with_the_layers_the_variants_read(tmp_path):
    """bench.drafter's hidden_states settings through the project's own resolution: EAGLE-3's list is the whole
    union (so `all` holds every layer an error reads), the block families get their default layers."""
    from draftdata.config.load import load_config
    from draftdata.drafters.layers import family_layers

    args = argparse.Namespace(layers=16, max_tokens=64, concurrency=4, temperature=0.3, embedded_batching="auto")
    p = drafter.params(tmp_path, tmp_path / "target", {"all": 300, "mid": 200, "small": 100}, args)
    import yaml

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    cfg = load_config("all", [], params_path=tmp_path / "params.yaml")
    got = family_layers(cfg, 16)
    block = [1, 4, 7, 10, 13]
    union = drafter.captured_layers(16)
    assert got == {"eagle3": union, "peagle": union, "dflash": block, "dflash2": block, "dspark": block}


def test_a_block_familys_export_rows_are_the_samples_it_can_train_on(tmp_path):
    """A block family's export leaves out a sample without two adjacent trained tokens; its rows map to the others'
    source lines, in order (EAGLE-3's keep every sample)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data" / "all"
    (data / "hidden_states").mkdir(parents=True)
    prompts = [{"id": f"p{i}", "where": f"src.jsonl:{i + 1}"} for i in range(3)]
    (data / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in prompts))
    responses = [{"id": f"r{i}", "conversation": f"p{i}", "messages": []} for i in range(3)]
    (data / "responses.jsonl").write_text("".join(json.dumps(x) + "\n" for x in responses))
    masks = [[0, 1, 1], [1, 0, 1], [0, 1, 1, 0]]  # the second has no two adjacent trained tokens
    table = pa.table({"id": [f"r{i}" for i in range(3)], "loss_mask": masks})
    pq.write_table(table, data / "hidden_states" / "samples.parquet")
    assert drafter.source_lines(tmp_path, "all") == ["src.jsonl:1", "src.jsonl:2", "src.jsonl:3"]
    assert drafter.source_lines(tmp_path, "all", "dflash") == ["src.jsonl:1", "src.jsonl:3"]
    assert drafter.source_lines(tmp_path, "all", "dspark") == ["src.jsonl:1", "src.jsonl:3"]


def test_a_block_error_needs_its_familys_own_variant_and_a_deep_enough_target_before_any_work(capsys, tmp_path):
    for variants, missing in (
        ("correct,dflash_layers_off_by_one", "dflash"),
        ("dspark", "correct"),
        ("correct,dflash2_layers_off_by_one", "dflash2"),
        ("correct,peagle_post_norm_as_pre", "peagle"),
    ):
        with pytest.raises(SystemExit) as err:
            drafter.main(["--variants", variants, "--workdir", str(tmp_path / "w")])
        assert err.value.code == 2 and f"also give {missing}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:  # the capture serves the block layers: 5 distinct ones need 8 layers
        drafter.main(["--layers", "7", "--workdir", str(tmp_path / "w")])
    assert err.value.code == 2 and "not distinct" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_the_variants_follow_the_targets_depth_and_no_states_zeroes_them():
    """A deeper target (--layers) gets EAGLE-3's layers for its depth and every error cut from them; `no_states`
    hands the drafter zeros of the states' shape."""
    deep = drafter.variants_for(16)
    assert deep["correct"][1] == [1, 7, 12] and deep["aux_off_by_one"][1] == [2, 8, 13]
    assert deep["aux_reversed"][1] == [12, 7, 1] and deep["no_states"][2] == "no_states"
    states = torch.randn(3, 4 * 2)
    got = Select([2, 0], 2, 4, zero=True)({"hidden_states": states, "verifier_last_hidden_states": torch.ones(3, 2)})
    assert got["hidden_states"].shape == (3, 4) and not got["hidden_states"].any()


def test_device_cuda_without_a_gpu_stops_before_any_work(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as err:
        drafter.main(["--device", "cuda", "--workdir", str(tmp_path / "w")])
    assert "--device cuda" in str(err.value) and "no GPU" in str(err.value)
    assert not (tmp_path / "w").exists()


def test_a_given_target_brings_its_shape_and_its_figures(tiny_model):
    """--target: the shape comes from the model's config (before any work), the figures from the demo's held-out
    conversations, and nothing is trained."""
    ap = argparse.ArgumentParser()
    args = argparse.Namespace(target=Path(tiny_model), hidden=None, layers=None, device="cpu", draft_vocab=None)
    drafter.shape_from(args, ap)
    cfg = json.loads((Path(tiny_model) / "config.json").read_text())
    assert (args.hidden, args.layers) == (cfg["hidden_size"], cfg["num_hidden_layers"])
    assert args.draft_vocab == 0 and args.vocab_size == cfg["vocab_size"]  # a small vocabulary: drafted whole
    info = drafter.given_target(args.target, "cpu")
    assert info["given"] == Path(tiny_model).name and info["train_s"] == 0.0 and "before" not in info
    assert info["shape"]["num_layers"] == cfg["num_hidden_layers"] and info["after"]["tokens"] > 0
    assert len(info["after"]["adjacent_layer_cosine"]) == cfg["num_hidden_layers"] - 2
    from safetensors.torch import load_file

    norm = load_file(Path(tiny_model) / "model.safetensors")["model.norm.weight"].float()
    assert info["final_norm_weight"] == {"mean": round(norm.mean().item(), 4), "std": round(norm.std().item(), 4)}
    assert "`" + info["given"] + "`" in report.which_target(info)


@pytest.mark.parametrize("argv", [["--target", "{tmp}"], ["--target", "{model}", "--layers", "4"]])
def test_a_bad_target_is_one_error_before_any_work(tiny_model, tmp_path, capsys, argv):
    argv = [a.format(tmp=tmp_path, model=tiny_model) for a in argv]
    with pytest.raises(SystemExit) as err:
        drafter.main([*argv, "--workdir", str(tmp_path / "w")])
    assert err.value.code == 2 and "--target" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_a_draft_vocabulary_maps_back_to_the_targets_ids_and_says_what_it_covers(tmp_path):
    """A large vocabulary's drafter predicts over its trained tokens' most frequent (speculators' rule, chosen from
    the training rows only); its drafts are judged as the target's ids (d2t), and the coverage of the held-out
    trained tokens is measured, not assumed."""
    from datasets import Dataset

    from bench.drafter_train import to_target_ids

    rows = [
        {"input_ids": [5, 9, 9, 7, 3], "loss_mask": [0, 1, 1, 1, 0]},  # trains 9, 9, 7
        {"input_ids": [2, 9, 8, 4, 4], "loss_mask": [0, 1, 1, 1, 1]},  # trains 9, 8, 4, 4
        {"input_ids": [6, 6, 1], "loss_mask": [1, 1, 1]},  # held out: 6, 6, 1
    ]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "all"))
    paths, coverage = drafter.vocab_mappings(tmp_path, {"all": tmp_path / "all"}, {"all": [0, 1]}, [2], 2, 12)
    m = torch.load(paths["all"])
    assert torch.nonzero(m["t2d"]).flatten().tolist() == [4, 9]  # 9 (3 times), then 4 (twice) over 7 and 8 (once)
    assert to_target_ids(argparse.Namespace(d2t=m["d2t"]), torch.tensor([0, 1, 1])).tolist() == [4, 9, 9]
    assert coverage["all"] == {"distinct_trained_tokens": 4, "train": round(5 / 7, 5), "held_out": 0.0}


def test_budgets_are_three_largest_first_and_jobs_at_least_one(capsys, tmp_path):
    assert drafter.budgets_arg("9,5,2") == {"all": 9, "mid": 5, "small": 2}
    for bad in ("9,5", "9,9,2", "2,5,9", "9,5,x", "9,5,0"):
        with pytest.raises(SystemExit) as err:
            drafter.main(["--budgets", bad, "--workdir", str(tmp_path / "w")])
        assert err.value.code == 2 and "--budgets" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        drafter.main(["--jobs", "0", "--workdir", str(tmp_path / "w")])
    assert err.value.code == 2 and "--jobs" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_every_demo_conversation_is_one_messages_row(tmp_path):
    """The drafter's source: each demo file's conversations as the project's readers read them (tools, tool calls
    and system turns kept), in one file the `messages` shape reads back the same."""
    from bench.drafter_target import demo_sources
    from draftdata.sources.files import iter_local
    from draftdata.sources.shapes import BadRecord, to_prompt

    want = []
    for shape, src in demo_sources():  # read here without demo_prompts, which conversations() uses
        for row in iter_local(src):
            try:
                want.append(to_prompt(shape, row.value))
            except BadRecord:
                pass
    path = drafter.conversations(tmp_path)
    got = [to_prompt("messages", row.value) for row in iter_local(path)]
    assert len(demo_sources()) == 8 and len(got) == len(want) > 1000
    assert [(g.conversation, g.tools) for g in got] == [(w.conversation, w.tools) for w in want]
    assert any(g.tools for g in got) and any(m["role"] == "tool" for g in got for m in g.conversation)


def test_goals_need_a_margin_of_three_spreads():
    def v(mean, spread):
        return {"accepted_length": {"mean": mean, "spread": spread}}

    results = {"correct": v(2.0, 0.05), "aux_off_by_one": v(1.8, 0.02), "aux_reversed": v(1.9, 0.04)}
    assert drafter.goals(results) == {"correct_beats_aux_off_by_one": True, "correct_beats_aux_reversed": False}


def test_each_block_error_is_judged_against_its_own_family():
    """dflash's error against dflash and dspark's against dspark, never against EAGLE-3's `correct` (which leads
    both here): the goal by means and spreads, the paired lead seed by seed."""

    def v(*runs, spread=0.01):
        mean = sum(runs) / len(runs)
        return {
            "accepted_length": {"mean": mean, "spread": spread},
            "runs": [{"seed": s, "accepted_length": a} for s, a in enumerate(runs)],
        }

    results = {
        "correct": v(3.0, 3.0),
        "dflash": v(1.6, 1.5),
        "dflash_layers_off_by_one": v(1.3, 1.3),
        "dspark": v(2.0, 2.1),
        "dspark_post_norm_as_pre": v(2.0, 2.05),
    }
    assert drafter.goals(results) == {
        "dflash_beats_dflash_layers_off_by_one": True,
        "dspark_beats_dspark_post_norm_as_pre": False,
    }
    paired = drafter.paired(results)
    assert paired["dflash_layers_off_by_one"] == {"per_seed": [0.3, 0.2], "mean": 0.25, "every_seed": True}
    assert paired["dspark_post_norm_as_pre"]["per_seed"] == [0.0, 0.05]
    assert not paired["dspark_post_norm_as_pre"]["every_seed"]


def test_the_report_gives_the_block_drafters_their_own_table():
    """A result with the block drafters: their rows, each error's lead over its own family's drafter and its goal, in
    a table of their own after EAGLE-3's, whose table and goals keep EAGLE-3's variants alone; the README's block
    names them after EAGLE-3's."""
    r = json.loads((ROOT / "bench" / "results" / "drafter.json").read_text())
    recipe = {"model": "DFlashDraftModel", "draft_layers": 1, "block_size": 16, "loss_fn": "ce"}
    recipe |= {"per_position_loss_weight": "dpace", "max_anchors": 512}
    runs = [
        {"seed": run["seed"], "accepted_length": 1.5 + 0.01 * run["seed"], "train_s": 30.0}
        for run in r["variants"]["correct"]["runs"]
    ]
    cell = {"mean": 1.5, "spread": 0.02}
    block = {"accepted_length": cell, "full_acc": cell, "position_1_acc": cell, "position_2_acc": cell, "runs": runs}
    wrong = dict(
        block, accepted_length={"mean": 1.2, "spread": 0.02}, runs=[dict(x, accepted_length=1.2) for x in runs]
    )
    r["variants"]["dflash"] = block | {"variant": {"export": "all_dflash", "family": "dflash"}, "drafter": recipe}
    r["variants"]["dflash_layers_off_by_one"] = wrong | {"variant": {"export": "all", "family": "dflash"}}
    r["goals"]["dflash_beats_dflash_layers_off_by_one"] = True
    r["paired"]["dflash_layers_off_by_one"] = {"per_seed": [0.3, 0.31, 0.32], "every_seed": True}
    lines = report.drafter(r)
    eagle3_table = [line for line in lines if line.startswith("| our export as it is")]
    assert len(eagle3_table) == 1 and not any(line.startswith("| DFlash on our export") for line in lines[:20])
    (ours,) = [line for line in lines if line.startswith("| DFlash on our export for dflash")]
    (off,) = [line for line in lines if line.startswith("| DFlash given the layers one above")]
    assert "`all_dflash` | 1.500 (0.020)" in ours and "`all` | 1.200 (0.020)" in off and "+0.300, +0.310, +0.320" in off
    text = "\n".join(lines)
    assert "`DFlashDraftModel` (1 draft layer" in text and "`dflash_layers_off_by_one` yes (15.0)" in text
    assert "Ours beats each convention error" in text and "`dflash_layers_off_by_one` +0.300" not in text
    quality = report.readme_quality(r)
    # EAGLE-3's part as it was: the results' own block paragraph (where they hold block drafters) comes after it
    eagle3 = report.readme_quality(json.loads((ROOT / "bench" / "results" / "drafter.json").read_text()))
    assert quality.startswith(eagle3.split("\nBlock")[0])
    assert (
        "`dflash` 1.500 (0.02)" in quality and "Beaten by more than 3× the larger spread of the two: DFlash" in quality
    )


def smoke_shaped(name: str, seeds: list[int], base: float, positions: range) -> dict:
    """A variant's entry as bench.drafter writes it (drafter_train `main`, `summary`, `built`): its row of
    VARIANTS, a run per seed with its accepted length, accuracies and training time, their means and spreads, and a
    block or P-EAGLE drafter's recipe (a block family's named by hand: its class needs speculators)."""
    export, layers, final, fam = drafter.VARIANTS[name]
    variant = {"name": name, "export": export, "layers": layers, "final": final, "family": fam}
    accs = {f"position_{k}_acc": base / (k + 2) for k in positions}
    runs = [
        {"accepted_length": base + 0.01 * s, "blocks": 100, "full_acc": base / 4, **accs, "seed": s, "train_s": 2.0}
        for s in seeds
    ]
    spec = {"max_anchors": 16}
    if fam in ("peagle", "domino"):
        recipe = drafter_train.built(variant, spec)
    else:
        model = {"dflash2": "DFlash2DraftModel"}[fam]
        recipe = {
            "drafter": {"model": model, "draft_layers": drafter_train.BLOCK_DRAFT_LAYERS, **drafter_train.BLOCK[fam]}
        }
        recipe["drafter"]["max_anchors"] = spec["max_anchors"]
    return {"variant": variant, "runs": runs, **drafter_runs.summary(runs)} | recipe


def test_the_report_renders_dflash2_and_peagle_beside_their_errors():
    """A block run holding DFlash2 and P-EAGLE (the shape bench.drafter writes): their rows and recipes, each error's
    paired lead and goal against its own family, P-EAGLE's way of being judged, and the README's paragraph naming
    both; EAGLE-3's table keeps EAGLE-3's variants alone."""
    r = json.loads((ROOT / "bench" / "results" / "drafter_blocks.json").read_text())
    seeds = [run["seed"] for run in r["variants"]["correct"]["runs"]]
    r["variants"] = {"correct": r["variants"]["correct"]}
    for name, base in (("dflash2", 2.0), ("dflash2_layers_off_by_one", 1.5)):
        r["variants"][name] = smoke_shaped(name, seeds, base, range(1, drafter_train.BLOCK["dflash2"]["block_size"]))
    for name, base in (("peagle", 1.8), ("peagle_post_norm_as_pre", 1.79)):
        r["variants"][name] = smoke_shaped(name, seeds, base, range(drafter_train.PEAGLE["num_depths"]))
    r["goals"], r["paired"] = drafter.goals(r["variants"]), drafter.paired(r["variants"])
    assert set(r["goals"]) == {"dflash2_beats_dflash2_layers_off_by_one", "peagle_beats_peagle_post_norm_as_pre"}
    text = "\n".join(report.drafter_blocks(r))
    v = r["variants"]
    for name in ("dflash2", "dflash2_layers_off_by_one", "peagle", "peagle_post_norm_as_pre"):
        (row,) = [line for line in text.splitlines() if line.startswith(f"| {report.DRAFTER_LABELS[name]} |")]
        assert f"`{v[name]['variant']['export']}` | {report.pm(v[name]['accepted_length'])}" in row
    lead = ", ".join(f"{d:+.3f}" for d in r["paired"]["peagle_post_norm_as_pre"]["per_seed"])
    assert lead in text and "`DFlash2DraftModel` (1 draft layer" in text and "`PEagleDraftModel` (1 draft layer" in text
    assert f"{drafter_train.PEAGLE['num_depths']} parallel depths" in text and "Block and parallel drafters" in text
    assert "at most the block size for DFlash2," in text and "P-EAGLE reads EAGLE-3's layers" in text
    for goal, ok in r["goals"].items():
        assert f"`{report.goal_parts(goal)[1]}` {'yes' if ok else '**no**'}" in text
    assert "`dflash2_layers_off_by_one` yes" in text and "`peagle_post_norm_as_pre`: the family's own" in text
    assert "the post-norm last state moves the targets" in text and "layer's output and the next" not in text
    quality = report.block_quality(r)
    assert (
        "speculators' own DFlash2 and P-EAGLE" in quality
        and report.DRAFTER_LABELS["peagle_post_norm_as_pre"] in quality
    )
    eagle3 = [line for line in report.drafter(r) if line.startswith("| our export as it is")]
    assert len(eagle3) == 1


def test_the_report_renders_domino_as_specforges_beside_its_error():
    """Domino (SpecForge's model, judged as its own decoding loop drafts) in the block table beside its layers error:
    its recipe names SpecForge's model and its GRU head, the intro names the trainers' models and how Domino is
    judged, and the README's paragraph names SpecForge's Domino."""
    r = json.loads((ROOT / "bench" / "results" / "drafter_blocks.json").read_text())
    seeds = [run["seed"] for run in r["variants"]["correct"]["runs"]]
    r["variants"] = {"correct": r["variants"]["correct"]}
    for name, base in (("domino", 2.2), ("domino_layers_off_by_one", 2.1)):
        r["variants"][name] = smoke_shaped(name, seeds, base, range(drafter_train.DOMINO["block_size"] - 1))
    r["goals"], r["paired"] = drafter.goals(r["variants"]), drafter.paired(r["variants"])
    assert set(r["goals"]) == {"domino_beats_domino_layers_off_by_one"}
    text = "\n".join(report.drafter_blocks(r))
    assert "the trainers' own models: SpecForge's `DominoDraftModel` (1 draft layer" in text
    assert "its GRU 0.25 and its embedding 0.0625 of the target's width" in text
    assert "each block drafts what SpecForge's decoding loop drafts" in text
    (row,) = [line for line in text.splitlines() if line.startswith(f"| {report.DRAFTER_LABELS['domino']} |")]
    assert f"`all_dflash` | {report.pm(r['variants']['domino']['accepted_length'])}" in row
    assert "(SpecForge's own Domino, one draft layer" in report.block_quality(r)


def test_the_report_names_only_the_missed_errors_with_their_lead_and_shift():
    r = {
        "goals": {"correct_beats_aux_off_by_one": True, "correct_beats_post_norm_as_pre": False},
        "paired": {
            "aux_off_by_one": {"per_seed": [0.05, 0.07], "every_seed": True},
            "post_norm_as_pre": {"per_seed": [-0.002, 0.004], "every_seed": False},
        },
        "variants": {"post_norm_as_pre": {"target_shift": {"kl_nats": 0.00074, "argmax_changed": 0.01}}},
    }
    text = report.unseparated(r)
    assert "post-norm final state" in text and "off by one" not in text
    assert "-0.002 to +0.004" in text and "KL of 0.00074 nats" in text
    assert report.unseparated(dict(r, goals={k: True for k in r["goals"]})) == ""
    shift = report.shift_line(r["variants"])
    assert "`post_norm_as_pre` KL 0.00074 nats" in shift and "1.0 %" in shift
    assert report.shift_line({"correct": {}}) == ""


def test_the_datas_choices_are_reported_seed_by_seed_with_the_larger_spread():
    def v(*runs):
        xs = [r for _, r in runs]
        al = {"mean": sum(xs) / len(xs), "spread": max(xs) - min(xs)}
        return {"accepted_length": al, "runs": [{"seed": s, "accepted_length": r} for s, r in runs]}

    variants = {"correct": v((0, 2.0), (1, 2.1)), "source_answers": v((1, 1.9), (0, 1.6))}  # seeds in any order
    lines = report.choice_lines(variants)
    (row,) = [line for line in lines if line.startswith("| regenerated")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:] == ["2.050 − 1.750", "+0.300", "0.300", "+1.0", "+0.400, +0.200"]
    assert report.choice_lines({"correct": variants["correct"]}) == []  # nothing to compare with


def test_the_draft_vocabulary_line_says_what_it_covers_of_each_set():
    r = {
        "draft_vocab": {
            "size": 8192,
            "target_vocab": 49152,
            "coverage": {"all": {"distinct_trained_tokens": 5000, "train": 0.99871, "held_out": 0.98512}},
        }
    }
    text = " ".join(report.vocab_lines(r))
    assert "8,192 most frequent" in text and "49,152" in text and "`all` 99.87 %" in text and "98.51 %" in text
    assert report.vocab_lines({"draft_vocab": {"size": "the target's", "coverage": "the whole vocabulary"}}) == []


def test_readme_quality_block_is_the_reports_output():
    text = README.read_text()
    assert text.count(report.QUALITY_START) == 1 and text.count(report.QUALITY_END) == 1
    from draftdata.util.blocks import between

    assert between(text, report.QUALITY_START, report.QUALITY_END) == report.render_quality(), (
        "README.md's quality block differs from bench/results/drafter.json: run `python -m bench.report --write`"
    )


def test_no_hand_written_drafter_figures():
    """The accepted lengths appear in the generated blocks only, never restated by hand in the README or the docs:
    as the report writes them, to 3 decimals (at 2, the means of some twenty variants between 1 and 4 match unrelated
    numbers: an example table's 1.57, a capture's 3.44 TB)."""
    r = json.loads((ROOT / "bench" / "results" / "drafter.json").read_text())
    values = [x["accepted_length"]["mean"] for x in r["variants"].values()]
    patterns = [rf"(?<![\d.,]){re.escape(f'{v:.3f}')}(?!\d|\.\d)" for v in values]
    readme = README.read_text()
    doc = report.DOC.read_text()
    pages = {
        "README.md, outside its quality block": readme[: readme.index(report.QUALITY_START)]
        + readme[readme.index(report.QUALITY_END) :],
        "docs/benchmarks.md, outside its block": doc[: doc.index(report.START)] + doc[doc.index(report.END) :],
    }
    pages |= {f"docs/{p.name}": p.read_text() for p in (ROOT / "docs").glob("*.md") if p != report.DOC}
    for name, text in pages.items():
        found = [m.group(0) for pattern in patterns for m in [re.search(pattern, text)] if m]
        assert not found, f"{name} restates the drafter's figures by hand: {found}"


SHIFTS = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from drafter_train import Select, preprocess
t, h = 5, 2
states = torch.arange(t * h, dtype=torch.float32).reshape(t, h)
item = {"input_ids": torch.arange(t), "hidden_states": states, "verifier_last_hidden_states": 100 + states,
        "loss_mask": torch.tensor([0, 1, 1, 1, 0]), "lengths": torch.tensor([t]), "position_ids": torch.arange(t)}
got = {f: preprocess(f, Select([0], h, 1))(dict(item)) for f in ("eagle3", "peagle", "dflash", "dspark")}
print(json.dumps({f: {k: v.tolist() for k, v in b.items()} for f, b in got.items()}))
"""


@pytest.mark.trainers
@pytest.mark.skipif(not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with speculators")
def test_eagle3_and_peagle_samples_are_shifted_as_the_trainers_cli_shifts_them():
    """speculators' CLI shifts EAGLE-3's and P-EAGLE's samples (`shift_batch`): position t's states beside token
    t + 1, the target's state and the loss mask there, as vLLM serves the drafter; unshifted, its first step would
    predict the token its own states already encode. The block drafters read their samples as exported."""
    import subprocess

    r = subprocess.run(
        [TRAINERS_PYTHON, "-c", SHIFTS, str(ROOT / "bench")], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    rows = [[2.0 * i, 2.0 * i + 1] for i in range(5)]
    for family in ("eagle3", "peagle"):
        b = got[family]
        assert b["input_ids"] == [1, 2, 3, 4] and b["position_ids"] == [1, 2, 3, 4], family
        assert b["hidden_states"] == rows[:4], family  # the states at t beside token t + 1
        assert b["verifier_last_hidden_states"] == [[100 + x for x in r] for r in rows[1:]], family
        assert b["loss_mask"] == [1, 1, 1, 0] and b["lengths"] == [4], family
    for family in ("dflash", "dspark"):
        assert got[family]["input_ids"] == [0, 1, 2, 3, 4] and got[family]["hidden_states"] == rows, family


@pytest.mark.trainers
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with speculators")
def test_a_drafter_trained_on_our_export_beats_a_convention_error(tmp_path):
    out = tmp_path / "drafter.json"
    drafter.main(
        [
            *("--seeds", "1", "--budgets", "8000,4000,2000", "--variants", "correct,pre_norm_as_post,no_states"),
            *(
                "--target-steps",
                "400",
                "--steps",
                "150",
            ),  # a few minutes, where the bench's defaults take most of an hour
            *("--workdir", str(tmp_path / "work"), "--out", str(out)),
        ]
    )
    r = json.loads(out.read_text())
    assert r["target"]["after"]["top1_prob"] > 5 * r["target"]["before"]["top1_prob"]  # the target learned
    correct, wrong, blind = (
        r["variants"][n]["accepted_length"]["mean"] for n in ("correct", "pre_norm_as_post", "no_states")
    )
    assert correct > wrong, (correct, wrong)
    assert correct > blind, (correct, blind)  # the states are worth something to the drafter
    assert len(r["target"]["after"]["adjacent_layer_cosine"]) == r["target"]["shape"]["num_layers"] - 2


# SpecForge's own greedy block sampler (`DominoDraftModel._sample_draft_tokens`, what its `spec_generate` drafts a block
# with) beside the bench's judge, on the same draft hidden states: given the sampler's own drafts to read, the judge's
# forward drafts exactly them, so given the target's choices it drafts what the sampler would up to its first miss
DOMINO_SAMPLER = """
import json, sys, types, torch
from unittest import mock
sys.path.insert(0, sys.argv[1])
import drafter_train as dt
spec = json.loads(open(sys.argv[2]).read())
for name, e in spec["exports"].items():
    dt.EXPORTS[name] = dt.load_export(e["path"], spec["max_len"])
torch.manual_seed(0)
model = dt.build_domino(spec).float().eval()
for p in model.draft_model.parameters():  # weights far from their start, so that drafts differ block to block
    p.data.normal_(0, 0.5)
_, batch = next(dt.held_out(spec, "domino", "block_layers", "cpu"))
ids, mask, block = batch["input_ids"][0], batch["loss_mask"][0].bool(), model.block_size
anchors = torch.nonzero(mask[:-1] & mask[1:])[:, 0]
anchors = anchors[anchors + block <= len(ids)][:12]
hidden, inputs = [], model._build_domino_head_inputs
def grab(**kw):
    h, p = inputs(**kw)
    hidden.append(h)
    return h, p
with torch.no_grad(), mock.patch.object(model, "_build_domino_head_inputs", grab):
    dt.judge_domino(model, batch, anchors, torch.zeros(len(anchors), block, dtype=torch.long))
target = types.SimpleNamespace(lm_head=model.lm_head, model=types.SimpleNamespace(embed_tokens=model.embed_tokens))
drafts = []
with torch.no_grad():
    for n, a in enumerate(anchors.tolist()):
        start = torch.full((1, block), model.mask_token_id, dtype=torch.long)
        start[0, 0] = ids[a]
        drafts.append(model.draft_model._sample_draft_tokens(target, hidden[0][0, n][None], start)[0])
    drafts = torch.stack(drafts)
    judged = dt.judge_domino(model, batch, anchors, torch.cat([ids[anchors][:, None], drafts], dim=1))
print(json.dumps({"sampled": drafts.tolist(), "judged": judged[:, : block - 1].argmax(-1).tolist()}))
"""


@pytest.mark.trainers
@pytest.mark.timeout(1500)
@pytest.mark.skipif(not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with speculators")
def test_the_block_drafters_train_on_their_familys_export_and_are_judged(tmp_path):
    """A short run of speculators' DFlash and DSpark and SpecForge's Domino on our exports (few steps and anchors: the
    path, not the figures): each export holds its family's layers, each drafter is judged on the same held-out blocks
    as its error, its accepted length between 1 (the bonus token alone) and its block's longest, its per-position
    accuracies fractions. Domino's judge drafts what SpecForge's own greedy sampler drafts."""
    import subprocess

    out, work = tmp_path / "drafter.json", tmp_path / "work"
    variants = "correct,dflash,dflash_layers_off_by_one,dspark,domino,domino_layers_off_by_one"
    drafter.main(
        [
            *("--seeds", "1", "--budgets", "8000,4000,2000", "--variants", variants),
            *("--target-steps", "100", "--steps", "20", "--max-anchors", "64"),
            *("--workdir", str(work), "--out", str(out)),
        ]
    )
    r = json.loads(out.read_text())
    exports = json.loads((work / "spec.json").read_text())["exports"]
    assert exports["all_dflash"]["layers"] == exports["all_dspark"]["layers"] == [1, 2, 3, 4, 5]
    assert exports["all"]["layers"] == [1, 2, 3, 4, 5, 6]  # EAGLE-3's export: every captured layer
    for name, longest, positions in (
        ("dflash", 16, range(1, 16)),  # its first slot is the anchor, the verifier's token
        ("dflash_layers_off_by_one", 16, range(1, 16)),
        ("dspark", 9, range(8)),  # every slot drafts
        ("domino", 16, range(15)),  # its labels shifted: the slot after the anchor drafts, the last one does not
        ("domino_layers_off_by_one", 16, range(15)),
    ):
        (run,) = r["variants"][name]["runs"]
        assert math.isfinite(run["accepted_length"]) and 1 <= run["accepted_length"] <= longest, (name, run)
        assert sorted(k for k in run if k.startswith("position_")) == sorted(f"position_{k}_acc" for k in positions)
        assert all(0 <= run[k] <= 1 for k in run if k.startswith(("position_", "full_acc"))), (name, run)
    for family in ("dflash", "domino"):
        blocks = [r["variants"][n]["runs"][0]["blocks"] for n in (family, f"{family}_layers_off_by_one")]
        assert blocks[0] == blocks[1] > 0, family
    assert r["variants"]["dspark"]["drafter"]["model"] == "DSparkDraftModel"
    assert r["variants"]["domino"]["drafter"]["model"] == "DominoDraftModel"
    assert set(r["goals"]) == {"dflash_beats_dflash_layers_off_by_one", "domino_beats_domino_layers_off_by_one"}

    (tmp_path / "sampler.py").write_text(DOMINO_SAMPLER)
    cmd = [TRAINERS_PYTHON, "-I", str(tmp_path / "sampler.py"), str(ROOT / "bench"), str(work / "spec.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["judged"] == got["sampled"]
    assert len({tuple(d) for d in got["sampled"]}) > 1  # blocks that differ: the check could fail


def test_eagle3_beside_the_block_drafters_is_quoted_only_where_its_samples_were_shifted():
    """A results file from before the bench shifted EAGLE-3's samples trained an easier task than serving's: its
    figure is not quoted beside the block drafters, and the line says why."""
    m = {"mean": 3.22, "spread": 0.008}
    assert "reaches 3.220" in report.eagle3_beside({"accepted_length": m, "samples": "shifted"})
    old = report.eagle3_beside({"accepted_length": m})
    assert "3.220" not in old and "unshifted" in old


def test_the_families_no_variant_trains_are_named_with_why():
    """Every family the stage serves is trained by a variant, or named in the report with the reason it is not."""
    from draftdata.drafters.families import FAMILIES

    trained = {v[3] for v in drafter.VARIANTS.values()}
    assert set(FAMILIES) == trained | set(drafter.UNTRAINED) and not trained & set(drafter.UNTRAINED)
    line = report.untrained_lines({"correct": {"variant": {"family": "eagle3"}}})[-1]
    assert "MTP:" in line and "Domino" not in line  # SpecForge's Domino is trained
    assert report.untrained_lines({f: {"variant": {"family": f}} for f in drafter.UNTRAINED}) == []
