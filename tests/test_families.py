"""Every drafter family from one capture: each family's layers, their union captured once, the index's record per
family, and each family's export in the layout its trainer reads (the trainers' own readers: test_export.py).

The tiny target has 8 decoder layers: EAGLE-3's default is [1, 3, 4], a block drafter's of 5 layers [1, 2, 3, 4, 5]
(round(1 + i·(8 - 4)/4)), so the union of the two is [1, 2, 3, 4, 5].
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import textwrap
from types import SimpleNamespace

import pytest
import torch

from draftdata.config.load import load_config
from draftdata.drafters.families import FAMILIES, block_default_layers
from draftdata.drafters.layers import captured, family_layers
from draftdata.errors import ConfigError, UserError
from draftdata.hidden.export import MARKER, ExportTally, Picked, specforge_path
from draftdata.hidden.reader import HiddenStates

TRAINERS_PYTHON = os.environ.get("DRAFTDATA_TRAINERS_PYTHON")


def test_block_default_layers_are_z_lab_s():
    """z-lab's build_target_layer_ids, as the trainers copy it (the issue's example: L = 36, n = 5)."""
    assert block_default_layers(36, 5) == [1, 9, 17, 25, 33]
    assert block_default_layers(36, 1) == [18]
    assert block_default_layers(30, 5) == [1, 8, 14, 20, 27]  # 7.5 and 20.5 round to even, as Python's round does
    assert block_default_layers(8, 5) == [1, 2, 3, 4, 5]


def cfg_with(project, *overrides: str):
    return load_config("B3", list(overrides), params_path=project.path / "params.yaml")


def test_each_family_s_layers_and_their_union(project):
    cfg = cfg_with(project, "hidden_states.drafters=[eagle3,dflash,dspark,mtp]")
    fams = family_layers(cfg, 30)
    assert fams == {"eagle3": [1, 14, 26], "dflash": [1, 8, 14, 20, 27], "dspark": [1, 8, 14, 20, 27], "mtp": []}
    assert captured(fams) == [1, 8, 14, 20, 26, 27]
    one = cfg_with(project, "hidden_states.drafters=[dflash]", "hidden_states.block_draft_layers=1")
    assert family_layers(one, 30) == {"dflash": [15]}
    given = cfg_with(project, "hidden_states.drafters=[eagle3,domino]", "hidden_states.block_layers=[7,2]")
    assert family_layers(given, 30)["domino"] == [2, 7]


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["hidden_states.drafters=[eagle3,medusa]"], "hidden_states.drafters", "unknown drafter family 'medusa'"),
        (["hidden_states.drafters=[]"], "hidden_states.drafters", "is empty"),
        (["hidden_states.drafters=[dflash,dflash]"], "hidden_states.drafters", "names a family twice"),
        (["hidden_states.block_draft_layers=0"], "hidden_states.block_draft_layers", ""),
        (["hidden_states.block_layers=[-1]"], "hidden_states.block_layers", "0-based"),
        (["export.family=eagle"], "export.family", "must be one of"),
    ],
)
def test_a_bad_family_setting_is_refused_naming_its_key(project, overrides, key, words):
    with pytest.raises(ConfigError) as err:
        cfg_with(project, *overrides)
    assert err.value.key == key and words in str(err.value)


def test_layers_for_a_family_not_served_or_not_in_the_target_are_refused(project):
    with pytest.raises(ConfigError, match="hidden_states.block_layers: is set but no family that reads it"):
        family_layers(cfg_with(project, "hidden_states.block_layers=[1,2]"), 8)
    with pytest.raises(ConfigError, match=r"hidden_states.layers: is set but no family that reads it \(eagle3, peagle"):
        family_layers(cfg_with(project, "hidden_states.drafters=[dflash]", "hidden_states.layers=[1,2,3]"), 8)
    with pytest.raises(ConfigError, match="hidden_states.block_layers: layer ids \\[9\\] out of range"):
        family_layers(cfg_with(project, "hidden_states.drafters=[dflash]", "hidden_states.block_layers=[1,9]"), 8)
    # six layers evenly from 1 to N - 3 = 5 cannot be distinct: the default is refused, naming what to change
    with pytest.raises(UserError, match="hidden_states.block_draft_layers"):
        family_layers(cfg_with(project, "hidden_states.drafters=[dflash]", "hidden_states.block_draft_layers=6"), 8)


def test_check_params_refuses_a_family_the_target_cannot_serve(project):
    project.set("hidden_states.drafters", ["eagle3", "dflash"])
    project.set("hidden_states.block_draft_layers", 6)
    with pytest.raises(UserError, match="block_draft_layers"):
        project.run("check_params", None)
    project.set("datasets.B3.store_hidden_states", False)  # online training only: no layer is captured
    project.run("check_params", None)


def sample(mask: list[int]):
    n = len(mask)
    return SimpleNamespace(input_ids=torch.arange(n), loss_mask=torch.tensor(mask), aux=torch.zeros(n, 2, 4))


def test_a_block_drafter_skips_rows_without_two_adjacent_supervised_tokens():
    tally = ExportTally()
    dflash, eagle = Picked(FAMILIES["dflash"], [0]), Picked(FAMILIES["eagle3"], [0, 1])
    assert dflash.trainable(sample([0, 1, 1, 0]), tally)
    assert not dflash.trainable(sample([1, 0, 1, 0, 1]), tally)  # supervised tokens, never two in a row
    assert not dflash.trainable(sample([0, 0, 0]), tally)
    assert eagle.trainable(sample([1, 0, 1, 0, 1]), tally)  # EAGLE-3 trains on any supervised token
    assert tally.skipped == {"no_adjacent_supervised": 2}


# ---- one capture, every family ---------------------------------------------------------------------------------- #


@pytest.fixture
def captured_project(project):
    """B3 through hidden_states, captured for EAGLE-3 and DFlash."""
    project.set("hidden_states.drafters", ["eagle3", "dflash"])
    for stage in ("prompts", "generate", "tokenize", "hidden_states"):
        project.run(stage, "B3")
    return project


def states_metrics(project) -> dict:
    return json.loads((project.data("B3") / "hidden_states_metrics.json").read_text())


def test_one_capture_holds_the_union_and_the_index_records_each_family(captured_project):
    hs = HiddenStates(captured_project.data("B3") / "hidden_states")
    assert hs.layers["physical"] == [1, 2, 3, 4, 5]
    assert next(iter(hs)).aux.shape[1] == 5  # each layer once, though both families read 1, 3 and 4
    eagle, dflash = hs.families["eagle3"], hs.families["dflash"]
    assert eagle["layers"]["physical"] == [1, 3, 4] and eagle["positions"] == [0, 2, 3]
    assert eagle["layers"]["vllm_speculators"] == [2, 4, 5]
    assert dflash["layers"]["physical"] == [1, 2, 3, 4, 5] and dflash["positions"] == [0, 1, 2, 3, 4]
    assert eagle["last_state"] == {"specforge": "post_norm", "speculators": "pre_norm", "modelopt": "post_norm"}
    assert dflash["last_state"] == {"specforge": None, "speculators": "pre_norm", "modelopt": "post_norm"}
    assert eagle["trainers"] == dflash["trainers"] == ["specforge", "speculators", "modelopt"]
    assert dflash["needs_adjacent_supervised"] and not eagle["needs_adjacent_supervised"]
    assert states_metrics(captured_project)["computed_samples"] > 0


def test_adding_a_family_whose_layers_are_stored_computes_nothing(captured_project):
    project = captured_project
    n = states_metrics(project)["samples"]
    project.set("hidden_states.drafters", ["eagle3", "dflash", "dspark", "mtp", "peagle", "domino", "dflash2"])
    project.run("hidden_states", "B3")
    m = states_metrics(project)
    assert (m["computed_samples"], m["reused_samples"]) == (0, n)
    assert set(HiddenStates(project.data("B3") / "hidden_states").families) == set(FAMILIES)


def export(project, fmt: str, family: str, *overrides: str):
    project.run("export", "B3", f"export.format={fmt}", f"export.family={family}", *overrides)
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("export.dir=")]
    return project.path / given[0] if given else project.data("B3") / f"export-{fmt}-{family}"


def kept(hs: HiddenStates, needs_adjacent: bool) -> list:
    return [s for s in hs if not needs_adjacent or any(a and b for a, b in zip(s.loss_mask, s.loss_mask[1:]))]


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_specforge_block_files_hold_the_family_s_layers(captured_project, family):
    project = captured_project
    project.set("hidden_states.drafters", ["eagle3", "dflash", "dspark"])
    project.run("hidden_states", "B3")
    out = export(project, "specforge", family)
    hs = HiddenStates(project.data("B3") / "hidden_states")
    samples = kept(hs, True)
    h = hs.hidden_size
    assert len(list(out.rglob("*.ckpt"))) == len(samples) > 0
    for i, s in enumerate(samples):
        rec = torch.load(out / specforge_path(i), weights_only=True)
        n = s.input_ids.shape[0]
        want = {"input_ids", "loss_mask", "hidden_states"} | (
            {"target_last_hidden_states"} if family == "dspark" else set()
        )
        assert set(rec) == want
        assert torch.equal(rec["input_ids"], s.input_ids) and torch.equal(rec["loss_mask"], s.loss_mask)
        assert rec["hidden_states"].shape == (1, n, 5 * h) and rec["hidden_states"].dtype == torch.bfloat16
        for j in range(5):
            assert torch.equal(rec["hidden_states"][0, :, j * h : (j + 1) * h].float(), s.aux[:, j])
        if family == "dspark":  # the post-norm last state, made from the stored pre-norm one and the norm
            assert torch.equal(rec["target_last_hidden_states"][0], s.final_post_norm.to(torch.bfloat16))
    meta = json.loads((out / MARKER).read_text())
    assert meta["family"] == family and meta["aux_layer_ids"] == [1, 2, 3, 4, 5]
    assert meta["draft_config_key"] == "dflash_config.target_layer_ids"
    assert meta["skipped"] == ({"no_adjacent_supervised": len(hs) - len(samples)} if len(hs) > len(samples) else {})


@pytest.mark.parametrize("family, positions", [("eagle3", [0, 2, 3]), ("dflash", [0, 1, 2, 3, 4]), ("mtp", [])])
def test_speculators_files_hold_the_family_s_layers_then_the_pre_norm_state(captured_project, family, positions):
    from safetensors.torch import load_file

    project = captured_project
    if family == "mtp":
        project.set("hidden_states.drafters", ["eagle3", "dflash", "mtp"])
        project.run("hidden_states", "B3")
    out = export(project, "speculators", family)
    hs = HiddenStates(project.data("B3") / "hidden_states")
    samples = kept(hs, FAMILIES[family].needs_adjacent)
    for i, s in enumerate(samples):
        states = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"]
        assert states.shape == (s.input_ids.shape[0], len(positions) + 1, hs.hidden_size)
        assert torch.equal(states[:, :-1].float(), s.aux[:, positions])
        assert torch.equal(states[:, -1], s.final_pre_norm.to(torch.bfloat16))
    meta = json.loads((out / MARKER).read_text())
    want_ids = {"eagle3": [2, 4, 5], "dflash": [2, 3, 4, 5, 6], "mtp": []}[family]  # vLLM's numbering: L + 1
    assert meta["aux_layer_ids"] == want_ids and meta["final_state"] == "pre_norm"
    assert meta["draft_config_key"] == FAMILIES[family].speculators


def test_an_export_the_capture_or_the_trainer_cannot_serve_is_refused_before_any_file(captured_project):
    project = captured_project
    with pytest.raises(ConfigError, match="export.family: dspark: the states .* were captured for dflash, eagle3"):
        export(project, "specforge", "dspark")
    # the trainer's lack first: no capture would mend it
    with pytest.raises(ConfigError, match="export.family: specforge has no offline data path for peagle"):
        export(project, "specforge", "peagle")
    project.set("hidden_states.drafters", ["eagle3", "dflash", "peagle", "dflash2"])
    project.run("hidden_states", "B3")
    with pytest.raises(
        ConfigError, match="export.family: specforge has no offline data path for peagle; export it for speculators"
    ):
        export(project, "specforge", "peagle")
    with pytest.raises(ConfigError, match="export.draft_vocab_size: SpecForge's dflash reads no vocabulary mapping"):
        export(project, "specforge", "dflash", "export.draft_vocab_size=64")
    assert not list(project.data("B3").glob("export-specforge*"))


# ---- the trainers' own readers ---------------------------------------------------------------------------------- #

# Runs under DRAFTDATA_TRAINERS_PYTHON: each block family's exports through the trainer's own offline data path
# (SpecForge: the family's provider reader, normalizer and collator, as `specforge train` runs them; speculators:
# its ArrowDataset), dumping what they return.
FAMILY_READERS = textwrap.dedent("""
    import re, sys
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    out, BIG = Path(sys.argv[1]), 1 << 20
    exports = dict(arg.split("=", 1) for arg in sys.argv[2:])

    def dump(name, items):
        save_file({f"{key}/{k}": v.contiguous() for key, d in items for k, v in d.items()
                   if isinstance(v, torch.Tensor)}, str(out / f"{name}.safetensors"))

    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    for name in ("dflash", "dspark", "domino"):
        alg = builtin_algorithm_registry().resolve(name)
        provider = alg.providers.offline_for("text")
        refs = provider.build_reader(exports[name], run_id="t", ttt_length=1, max_len=BIG).read()
        path_of = {r.sample_id: r.feature_store_uri[len("file://"):] for r in refs}
        loader = FeatureDataLoader(LocalFeatureStore("t"), refs=refs, batch_size=1, drop_last=False,
                                   collate_fn=provider.build_collator(),
                                   per_sample_transform=provider.build_normalizer(BIG), strategy=alg.name)
        index = lambda b: int(re.search(r"data_(\\d+)\\.ckpt$", path_of[b.sample_ids[0]]).group(1))
        dump(f"specforge_{name}", [(index(b), b.tensors) for b in loader])

    from speculators.train.data import ArrowDataset

    for name in ("dflash", "dspark"):
        ds = ArrowDataset(max_len=BIG, datapath=exports["speculators_" + name], on_missing="raise")
        dump(f"speculators_{name}", [(i, ds[i]) for i in range(len(ds))])

    # MTP: the rows its CLI trains on, packed by CollateFn with the CLI's own preprocess for it (shift_batch_mtp: the
    # verifier's last state as the states), each cut back to its sample's length
    import json
    from speculators.models.mtp.data import shift_batch_mtp
    from speculators.train.data import CollateFn

    ds = ArrowDataset(max_len=4096, datapath=exports["speculators_mtp"], on_missing="raise")
    width = json.loads((Path(exports["speculators_mtp"]) / "draftdata_export.json").read_text())["hidden_size"]
    mtp = CollateFn(4096, width, 0, torch.float32, shift_batch_mtp)
    rows = [(i, mtp([ds[i]]), len(ds[i]["input_ids"])) for i in range(len(ds))]
    cut = lambda b, n: {k: v[0, :n] for k, v in b.items() if torch.is_tensor(v) and k != "document_ids"}
    dump("speculators_mtp", [(i, cut(b, n)) for i, b, n in rows])

    # speculators' own model of each family, built as its trainer builds it (from_training_args, a one-layer draft
    # from create_transformer_layer_config, the layer ids from the export's marker, the family's default loss),
    # trained two steps on a packed batch of the export (its CollateFn): the loss it reports, before and after a step
    import json
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dflash2 import DFlash2DraftModel
    from speculators.models.dspark import DSparkDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.data import CollateFn

    losses = {}
    for name, cls in (("dflash", DFlashDraftModel), ("dflash2", DFlash2DraftModel), ("dspark", DSparkDraftModel)):
        path = exports["speculators_" + name]
        meta = json.loads((Path(path) / "draftdata_export.json").read_text())
        verifier = meta["model"]["path"]
        torch.manual_seed(0)
        layer = create_transformer_layer_config(verifier_name_or_path=verifier, num_layers=1, draft_arch="llama",
                                                hidden_act=None, sliding_window=4096, full_attention_indices=[0])
        model = cls.from_training_args(verifier_config=layer, verifier_name_or_path=verifier,
                                       draft_vocab_size=layer.vocab_size, block_size=4, mask_token_id=0,
                                       target_layer_ids=meta["aux_layer_ids"],
                                       draft_attn_impl="sdpa").float()
        ds = ArrowDataset(max_len=4096, datapath=path, on_missing="raise")
        collate = CollateFn(4096, meta["hidden_size"], len(meta["aux_layer_ids"]), torch.float32, None)
        batch = {k: v for k, v in collate([ds[i] for i in range(min(8, len(ds)))]).items() if torch.is_tensor(v)}
        kwargs, _ = cls.get_trainer_kwargs(loss_fn="ce" if name == "dflash" else "kl_div", loss_implementation="eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()
        losses[name] = []
        for _ in range(2):
            loss = model(**batch, **kwargs)[1]
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())

    # SpecForge's own model of each family, built as `specforge train -c` builds it from the run config and draft
    # config the export wrote (build_model_bundle: the draft from AutoDraftModel, the target's embeddings and LM head,
    # the mask token from the target's tokenizer, the family's Online*Model), stepped through the family's own train
    # strategy on a batch from its offline reader and collator: the loss it reports, before and after a step
    import yaml
    from specforge.config.schema import Config
    from specforge.training.assembly import build_model_bundle

    registry = builtin_algorithm_registry()
    for name in ("dflash", "dspark", "domino"):
        alg = registry.resolve(name)
        meta = json.loads((Path(exports[name]) / "draftdata_export.json").read_text())
        run = yaml.safe_load((Path(exports[name]) / "train_config.yaml").read_text())
        assert "draft_num_hidden_layers" not in run["model"]
        # float32 and sdpa: flex attention and bf16 training are the GPU run's settings, not the CPU's
        run["model"]["torch_dtype"] = "float32"
        run["training"] |= {"attention_backend": "sdpa", "num_anchors": 8}
        torch.manual_seed(0)
        bundle = build_model_bundle(Config.model_validate(run), algorithm=alg)
        assert bundle.capture_layers == meta["aux_layer_ids"], (name, bundle.capture_layers)
        strategy = alg.providers.step.build(bundle.model, **bundle.strategy_kwargs.options)
        provider = alg.providers.offline_for("text")
        refs = provider.build_reader(exports[name], run_id="t", ttt_length=1, max_len=BIG).read()
        batch = next(iter(FeatureDataLoader(LocalFeatureStore("t"), refs=refs, batch_size=8, drop_last=False,
                                            collate_fn=provider.build_collator(),
                                            per_sample_transform=provider.build_normalizer(BIG), strategy=name)))
        # the export holds bf16 states, as SpecForge's capture writes them; the model here is float32
        batch.tensors = {k: v.float() if v.is_floating_point() else v for k, v in batch.tensors.items()}
        # the optimizer holds the draft only, as SpecForge's trainer's does: the target's parts stay frozen
        opt = torch.optim.AdamW(bundle.draft_model.parameters(), lr=1e-3)
        bundle.model.train()
        losses["specforge_" + name] = []
        for _ in range(2):
            # the anchors are drawn at random: the same seed draws the same ones, so the two losses compare. No
            # step context: Domino's base-loss weight then stays 0 rather than decaying between the two steps
            torch.manual_seed(0)
            loss = strategy.forward_loss(batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses["specforge_" + name].append(loss.item())
    (out / "steps.json").write_text(json.dumps(losses))
""")


@pytest.mark.trainers
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with specforge and speculators"
)
def test_trainers_own_readers_load_every_block_family(captured_project, tmp_path):
    """One capture, exported for DFlash, DSpark and Domino (SpecForge) and DFlash, DFlash2, DSpark and MTP
    (speculators): every row the trainers' own data paths return holds the family's layers and the last state its
    trainer reads, exactly (MTP's through its CLI's own preprocess, `shift_batch_mtp`); each trainer's own model of
    each block family, built as its trainer builds it (SpecForge's from a run config through build_model_bundle),
    trains on its export: a finite loss that one optimizer step lowers. speculators' MTP model starts from the
    target's own MTP weights (`mtp.*`), which this target has not got: its rows are checked here, and it trains on a
    target that has them in the test below."""
    from test_export import exact_bf16, read_dump

    project = captured_project
    project.set("hidden_states.drafters", ["eagle3", "dflash", "dspark", "domino", "dflash2", "mtp"])
    project.run("hidden_states", "B3")
    dirs = {}
    for fmt, family in (("specforge", "dflash"), ("specforge", "dspark"), ("specforge", "domino")):
        dirs[family] = export(project, fmt, family, f"export.dir=export-{fmt}-{family}")
    for family in ("dflash", "dflash2", "dspark", "mtp"):
        dirs["speculators_" + family] = export(
            project, "speculators", family, f"export.dir=export-speculators-{family}"
        )
    hs = HiddenStates(project.data("B3") / "hidden_states")
    samples, h = kept(hs, True), hs.hidden_size
    (tmp_path / "readers.py").write_text(FAMILY_READERS)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    r = subprocess.run(
        [
            TRAINERS_PYTHON,
            str(tmp_path / "readers.py"),
            str(dumps),
            *(f"{k}={v}" for k, v in dirs.items()),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    for family in ("dflash", "dspark", "domino"):
        got = read_dump(dumps / f"specforge_{family}.safetensors")
        assert sorted(got) == list(range(len(samples))), family
        for i, s in enumerate(samples):
            g, n = got[i], s.input_ids.shape[0]
            assert torch.equal(g["input_ids"], s.input_ids[None]) and torch.equal(g["loss_mask"], s.loss_mask[None])
            assert torch.equal(g["hidden_states"][0].float(), s.aux.reshape(n, 5 * h)), (family, i)
            if family == "dspark":
                exact_bf16(g["target_last_hidden_states"][0], s.final_post_norm)
            else:
                assert "target_last_hidden_states" not in g
    for family in ("dflash", "dspark"):
        got = read_dump(dumps / f"speculators_{family}.safetensors")
        assert sorted(got) == list(range(len(samples))), family
        for i, s in enumerate(samples):
            g, n = got[i], s.input_ids.shape[0]
            assert torch.equal(g["input_ids"], s.input_ids) and torch.equal(g["loss_mask"], s.loss_mask)
            assert torch.equal(g["hidden_states"].float(), s.aux.reshape(n, 5 * h))
            assert torch.equal(g["verifier_last_hidden_states"].float(), s.final_pre_norm)
    # MTP's rows as its CLI trains them: every sample, its ids and loss mask, and the verifier's pre-norm last state as
    # the states (exactly: bf16 as stored, read as float32)
    got = read_dump(dumps / "speculators_mtp.safetensors")
    mtp = kept(hs, False)
    assert sorted(got) == list(range(len(mtp)))
    for i, s in enumerate(mtp):
        g = got[i]
        assert torch.equal(g["input_ids"], s.input_ids) and torch.equal(g["loss_mask"], s.loss_mask), i
        assert torch.equal(g["hidden_states"], s.final_pre_norm.to(torch.bfloat16).float()), i
    # each family's own model trains on its export: a finite loss that its optimizer's step lowers
    steps = json.loads((dumps / "steps.json").read_text())
    assert set(steps) == {"dflash", "dflash2", "dspark", "specforge_dflash", "specforge_dspark", "specforge_domino"}
    for family, (before, after) in steps.items():
        assert math.isfinite(before) and after < before, (family, before, after)


def test_mtp_alone_captures_the_last_state_with_no_aux_layer_and_exports_it(project):
    """MTP reads the last state alone: captured with an empty aux axis, stored and exported (speculators' MTP rows:
    the pre-norm last state only), not a crash on the first batch after DVC removed the outputs."""
    from safetensors.torch import load_file

    project.set("hidden_states.drafters", ["mtp"])
    # before any capture, SpecForge's lack of MTP is said first: capturing for it would be time lost
    with pytest.raises(ConfigError, match="export.family: specforge has no offline data path for mtp"):
        export(project, "specforge", "mtp")
    for stage in ("prompts", "generate", "tokenize", "hidden_states"):
        project.run(stage, "B3")
    hs = HiddenStates(project.data("B3") / "hidden_states")
    assert hs.layers["physical"] == [] and hs.families["mtp"]["positions"] == []
    out = export(project, "speculators", "mtp")
    samples = kept(hs, FAMILIES["mtp"].needs_adjacent)
    assert samples
    for i, s in enumerate(samples):
        assert s.aux.shape == (s.input_ids.shape[0], 0, hs.hidden_size)
        states = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"]
        assert states.shape == (s.input_ids.shape[0], 1, hs.hidden_size)
        assert torch.equal(states[:, -1], s.final_pre_norm.to(torch.bfloat16))


def test_two_families_exports_stand_side_by_side(captured_project):
    """One folder per format and family by default: exporting DFlash after EAGLE-3 leaves the EAGLE-3 export as it
    was."""
    eagle = export(captured_project, "speculators", "eagle3")
    before = {p.relative_to(eagle): p.read_bytes() for p in eagle.rglob("*") if p.is_file()}
    dflash = export(captured_project, "speculators", "dflash")
    assert eagle != dflash and eagle.name == "export-speculators-eagle3"
    assert {p.relative_to(eagle): p.read_bytes() for p in eagle.rglob("*") if p.is_file()} == before
    families = [json.loads((d / MARKER).read_text())["family"] for d in (eagle, dflash)]
    assert families == ["eagle3", "dflash"]


# Runs under DRAFTDATA_TRAINERS_PYTHON: speculators' MTPDraftModel, built as its CLI builds it (the verifier's own
# decoder config; from_training_args extracting the target's mtp.* weights with MTPConverter), trained two steps on a
# packed batch of our export read by its own ArrowDataset and CollateFn with the CLI's preprocess for MTP
# (shift_batch_mtp) and the CLI's step weights.
MTP_TRAINER = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import torch
    from safetensors import safe_open
    from speculators.models.mtp import MTPDraftModel, shift_batch_mtp
    from speculators.models.utils import get_verifier_config
    from speculators.train.data import ArrowDataset, CollateFn

    path = Path(sys.argv[1])
    meta = json.loads((path / "draftdata_export.json").read_text())
    verifier = meta["model"]["path"]
    torch.manual_seed(0)
    config = get_verifier_config(verifier)
    model = MTPDraftModel.from_training_args(verifier_config=config, verifier_name_or_path=verifier,
                                             num_speculative_steps=3).float()
    # from_training_args loads the head with strict=False: a misnamed key would stay random, so the values are checked
    with safe_open(str(Path(verifier) / "model.safetensors"), "pt") as f:
        loaded = [torch.equal(model.mtp_layers[0].input_proj.weight, f.get_tensor("mtp.fc.weight")),
                  torch.equal(model.mtp_layers[0].self_attn.q_proj.weight,
                              f.get_tensor("mtp.layers.0.self_attn.q_proj.weight")),
                  torch.equal(model.lm_head.weight, f.get_tensor("lm_head.weight"))]
    ds = ArrowDataset(max_len=4096, datapath=str(path), on_missing="raise")
    collate = CollateFn(4096, meta["hidden_size"], len(model.target_layer_ids), torch.float32, shift_batch_mtp)
    batch = {k: v for k, v in collate([ds[i] for i in range(len(ds))]).items() if torch.is_tensor(v)}
    kwargs, _ = MTPDraftModel.get_trainer_kwargs(num_speculative_steps=model.config.num_speculative_steps)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    losses = []
    for _ in range(2):
        loss = model(**batch, **kwargs)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(json.dumps({"losses": losses, "loaded": loaded, "target_layer_ids": model.target_layer_ids,
                      "tokens": int(batch["input_ids"].numel())}))
""")


@pytest.mark.trainers
@pytest.mark.timeout(600)
@pytest.mark.skipif(not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with speculators")
def test_speculators_mtp_trains_two_steps_on_our_export_of_a_target_with_native_mtp_weights(project, tmp_path):
    """A tiny random Qwen3 target with an MTP head in the checkpoint (tests/mtp_target.py): the whole chain runs on
    it for `mtp` alone, and speculators' MTP draft, started from the target's own head, takes two steps on our export
    with the loss falling."""
    from conftest import DEMO
    from mtp_target import build_mtp_target

    target = build_mtp_target(tmp_path / "mtp-target", DEMO)
    project.set("model.path", str(target))
    project.set("hidden_states.drafters", ["mtp"])
    for stage in ("prompts", "generate", "tokenize", "hidden_states"):
        project.run(stage, "B3")
    out = export(project, "speculators", "mtp")
    (tmp_path / "mtp.py").write_text(MTP_TRAINER)
    r = subprocess.run(
        [TRAINERS_PYTHON, str(tmp_path / "mtp.py"), str(out)],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [True, True, True]  # the head is the target's own, not a random one
    assert got["target_layer_ids"] == [4] and got["tokens"] > 1000  # the last layer of 4; the whole export
    before, after = got["losses"]
    assert math.isfinite(before) and after < before, got["losses"]
