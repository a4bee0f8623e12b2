"""`draftdata export`: the hidden-states stage's output in SpecForge's and speculators' layouts.

The fast tests run the real stages on the tiny model (prompts → generate → tokenize → hidden_states, bf16 states),
export both formats and check every file against `HiddenStates`, sample by sample: SpecForge gets the post-norm final
state, speculators the pre-norm one, the aux layers in index order, bf16 values equal to the stored ones.

The `trainers` test loads the exports with the trainers' own readers, in a Python that has them
(`DRAFTDATA_TRAINERS_PYTHON`; they pin their own torch, so they live in a venv of their own:
`python -m venv .trainers && .trainers/bin/pip install torch==2.13.0 speculators==0.9.0 && .trainers/bin/pip
uninstall -y torchvision torchaudio && .trainers/bin/pip install specforge==0.2.0 --no-deps`), dumps what the
readers return and compares it value for value with `HiddenStates`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import dataset_params

from draftdata.errors import ConfigError, UserError
from draftdata.hidden.export import MARKER, SKIPPED, SPECFORGE_VOCAB, specforge_path
from draftdata.hidden.reader import HiddenStates
from draftdata.hidden.vocab import specforge_mapping, speculators_mapping

TRAINERS_PYTHON = os.environ.get("DRAFTDATA_TRAINERS_PYTHON")


@pytest.fixture
def states(project):
    """The project with data/B3/hidden_states/ built by the real stages."""
    for stage in ("prompts", "generate", "tokenize", "hidden_states"):
        project.run(stage, "B3")
    return project


@pytest.fixture
def chats(project):
    """Project with B6 (ultrachat) regenerated turn by turn, every answer trained, through tokenize only, with
    `store_hidden_states: false`: what online training needs."""
    project.params["datasets"]["B6"] = dataset_params(
        "B6_ultrachat", "messages", turns="all", store_hidden_states=False, token_budget=600
    )
    project.set("tokenize.train_on", "all_turns")
    for stage in ("prompts", "generate", "tokenize"):
        project.run(stage, "B6")
    return project


def export(project, fmt: str, *overrides: str, dataset: str = "B3") -> Path:
    project.run("export", dataset, f"export.format={fmt}", *overrides)
    family = next((o.split("=", 1)[1] for o in overrides if o.startswith("export.family=")), "eagle3")
    return project.data(dataset) / f"export-{fmt}-{family}"  # one folder per format and family


def samples_of(project, dataset: str) -> list[dict]:
    return pq.read_table(project.data(dataset) / "samples.parquet").to_pylist()


def masked_freq(rows: list[dict]) -> Counter:
    return Counter(t for r in rows for t, m in zip(r["input_ids"], r["loss_mask"]) if m)


def token_freq(hs: HiddenStates) -> Counter:
    freq: Counter = Counter()
    for s in hs:
        freq.update(s.input_ids[s.loss_mask.bool()].tolist())
    return freq


def exact_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """States stored in bf16 come back unchanged; a value computed in float32 (the post-norm state) is rounded once."""
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.to(torch.bfloat16))


# ---- fast: the files ------------------------------------------------------------------------------------------- #


def test_specforge_files_match_the_reader(states):
    out = export(states, "specforge")
    hs = HiddenStates(states.data("B3") / "hidden_states")
    k, h = len(hs.layers["physical"]), hs.hidden_size
    files = sorted(out.rglob("*.ckpt"))
    assert len(files) == len(hs) > 0
    for i, s in enumerate(hs):
        assert s.aux.shape[1] == k
        rec = torch.load(out / specforge_path(i), weights_only=True)
        assert set(rec) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        n = s.input_ids.shape[0]
        assert rec["input_ids"].dtype == rec["loss_mask"].dtype == torch.int64
        assert torch.equal(rec["input_ids"], s.input_ids) and torch.equal(rec["loss_mask"], s.loss_mask)
        assert rec["aux_hidden_state"].shape == (1, n, k * h) and rec["hidden_state"].shape == (1, n, h)
        # aux: the layers concatenated in index order, exactly the stored bf16 values
        for j in range(k):
            assert torch.equal(rec["aux_hidden_state"][0, :, j * h : (j + 1) * h].float(), s.aux[:, j])
        exact_bf16(rec["hidden_state"][0], s.final_post_norm)  # post-norm, not the stored pre-norm state
        assert not torch.equal(rec["hidden_state"][0].float(), s.final_pre_norm)
    meta = json.loads((out / MARKER).read_text())
    assert meta["format"] == "specforge" and meta["samples"] == len(hs) and meta["final_state"] == "post_norm"
    assert meta["aux_layer_ids"] == hs.layers["sglang_specforge"]
    assert not list(out.parent.glob(".export-specforge*")), "staging left behind"


def test_speculators_files_match_the_reader(states, monkeypatch):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from draftdata.util.files import FILE_MODE

    listings, scandir = [], os.scandir

    def listing(path="."):
        listings.append(Path(path))
        return scandir(path)

    with monkeypatch.context() as m:
        m.setattr(os, "scandir", listing)
        out = export(states, "speculators")
    hs = HiddenStates(states.data("B3") / "hidden_states")
    # every hs_<i> goes into one directory: listing it once a file (a sweep for a killed writer's temp files) would
    # make the export quadratic in the samples
    assert sum(p.name == "hidden_states" and p.parent.name.endswith(".partial") for p in listings) <= 1
    files = [*(out / "hidden_states").iterdir(), out / "token_freq.pt"]
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {oct(FILE_MODE)}  # safetensors makes them 0600
    k, h = len(hs.layers["physical"]), hs.hidden_size
    ds = load_from_disk(str(out))
    assert len(ds) == len(hs) > 0 and ds.format["type"] == "torch"
    assert set(ds.column_names) == {"input_ids", "loss_mask", "seq_len"}
    for i, s in enumerate(hs):
        row = ds[i]
        n = s.input_ids.shape[0]
        assert row["input_ids"].dtype == row["loss_mask"].dtype == torch.int64
        assert torch.equal(row["input_ids"], s.input_ids) and torch.equal(row["loss_mask"], s.loss_mask)
        assert int(row["seq_len"]) == n
        t = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        assert set(t) == {"token_ids", "hidden_states"}
        assert t["token_ids"].dtype == torch.int64 and torch.equal(t["token_ids"], s.input_ids)
        assert t["hidden_states"].shape == (n, k + 1, h) and t["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(t["hidden_states"][:, :k].float(), s.aux)  # aux layers, index order, exact
        assert torch.equal(t["hidden_states"][:, k].float(), s.final_pre_norm)  # last: the PRE-norm state
    assert torch.load(out / "token_freq.pt", weights_only=True) == dict(token_freq(hs))
    meta = json.loads((out / MARKER).read_text())
    assert meta["final_state"] == "pre_norm" and meta["aux_layer_ids"] == hs.layers["vllm_speculators"]


def test_rerun_replaces_an_export_and_a_custom_dir(states):
    out = export(states, "specforge")
    (out / "rows_0-2000" / "stale.ckpt").write_bytes(b"x")  # a leftover an earlier export never wrote
    export(states, "specforge")
    assert not (out / "rows_0-2000" / "stale.ckpt").exists() and (out / MARKER).exists()
    custom = states.path / "elsewhere" / "sf"
    states.run("export", "B3", "export.format=specforge", f"export.dir={custom}")
    assert (custom / MARKER).exists() and len(list(custom.rglob("*.ckpt"))) == len(list(out.rglob("*.ckpt")))


def test_an_interrupted_export_is_never_at_the_export_path(states, monkeypatch):
    import draftdata.hidden.export as export_mod

    def dies(hs, staging, tally, picked):
        (staging / "rows_0-2000").mkdir()
        (staging / "rows_0-2000" / "data_0.ckpt").write_bytes(b"half")
        raise KeyboardInterrupt

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setitem(export_mod.WRITERS, "specforge", dies)
        export(states, "specforge")
    assert not (states.data("B3") / "export-specforge-eagle3").exists()
    assert not list(states.data("B3").glob(".export-specforge*"))
    # a killed run's staging (no cleanup ran) is cleared by the next run, which completes
    staging = states.data("B3") / ".export-specforge-eagle3.partial"
    staging.mkdir()
    (staging / "junk.ckpt").write_bytes(b"")
    out = export(states, "specforge")
    assert (out / MARKER).exists() and not (out / "junk.ckpt").exists() and not staging.exists()


# ---- fast: online exports, no states ----------------------------------------------------------------------------- #


def test_store_hidden_states_false_loads_no_model_and_the_offline_export_says_why(chats, monkeypatch):
    import stages.hidden_states as stage

    with monkeypatch.context() as m:
        m.setattr(stage, "n_layers_of", lambda cfg: pytest.fail("a skipped dataset loaded the model"))
        chats.run("hidden_states", "B6")
    out = chats.data("B6") / "hidden_states"
    assert [p.name for p in out.iterdir()] == [SKIPPED]
    assert json.loads((chats.data("B6") / "hidden_states_metrics.json").read_text())["stored"] is False
    for fmt in ("specforge", "speculators"):
        with pytest.raises(ConfigError, match=r"^datasets\.B6\.store_hidden_states: false: no hidden states"):
            export(chats, fmt, dataset="B6")
    # set back, the stage stores the states and the marker goes
    chats.params["datasets"]["B6"]["store_hidden_states"] = True
    chats.save()
    chats.run("hidden_states", "B6")
    assert (out / "index.json").is_file() and not (out / SKIPPED).exists()
    assert len(HiddenStates(out)) == len(samples_of(chats, "B6"))


def test_speculators_online_is_the_samples_and_no_states(chats):
    from datasets import load_from_disk

    out = export(chats, "speculators_online", dataset="B6")
    rows = samples_of(chats, "B6")
    assert any(r["turn"] > 0 for r in rows), "no sample beyond a first turn: turns: all untested"
    ds = load_from_disk(str(out))
    assert ds.format["type"] == "torch" and len(ds) == len(rows) > 0
    assert set(ds.column_names) == {"input_ids", "loss_mask", "seq_len", "conversation", "turn"}
    for row, want in zip(ds, rows):
        assert row["input_ids"].dtype == row["loss_mask"].dtype == torch.int64
        assert row["input_ids"].tolist() == want["input_ids"] and row["loss_mask"].tolist() == want["loss_mask"]
        assert int(row["seq_len"]) == len(want["input_ids"])
        assert (row["conversation"], int(row["turn"])) == (want["conversation"], want["turn"])
    assert not (out / "hidden_states").exists()
    assert torch.load(out / "token_freq.pt", weights_only=True) == dict(masked_freq(rows))
    meta = json.loads((out / MARKER).read_text())
    assert meta["format"] == "speculators_online" and meta["samples"] == len(rows)
    assert meta["trained_tokens"] == sum(map(sum, (r["loss_mask"] for r in rows)))


def test_specforge_online_holds_the_samples_and_their_regenerated_conversations(chats):
    from draftdata.util.files import read_jsonl

    out = export(chats, "specforge_online", dataset="B6")
    rows = samples_of(chats, "B6")
    keys = ("id", "input_ids", "loss_mask", "conversation", "turn")
    assert list(read_jsonl(out / "prompts.jsonl")) == [{k: r[k] for k in keys} for r in rows]  # in order
    responses = {r["id"]: r for r in read_jsonl(chats.data("B6") / "responses.jsonl")}
    turns: dict[str, list[dict]] = {}
    for r in sorted(responses.values(), key=lambda r: r["turn"]):
        turns.setdefault(r["conversation"], []).append(r)
    convs = {c["id"]: c for c in read_jsonl(out / "conversations.jsonl")}
    assert set(convs) == {r["id"] for r in rows}
    skipped = skipped_by_text(chats)
    for row in rows:
        messages = convs[row["id"]]["conversations"]
        assert set().union(*map(set, messages)) <= {"role", "content", "tool_calls"}
        # every answer in it is the target's own, each turn's as regenerated, in order (the history keeps the special
        # tokens the tiny target writes mid-answer, which a response's text leaves out)
        answers = [without(m["content"], skipped) for m in messages if m["role"] == "assistant"]
        assert answers == [r["text"] for r in turns[row["conversation"]][: row["turn"] + 1]]
        assert messages[-1]["role"] == "assistant" and messages[0]["role"] in ("system", "user")
    assert json.loads((out / MARKER).read_text())["train_only_last_turn"] is False


def skipped_by_text(project) -> list[str]:
    """The added tokens a response's text leaves out: those the tokenizer's decoding with skip_special_tokens drops,
    longest first (so that one holding another is removed whole)."""
    from draftdata.config.schema import ModelConfig
    from draftdata.model.tokenizer import load_tokenizer

    tok = load_tokenizer(ModelConfig(path=project.params["model"]["path"]))
    added = tok.added_tokens_decoder
    skipped = [t.content for i, t in added.items() if not tok.decode([i], skip_special_tokens=True)]
    return sorted(skipped, key=len, reverse=True)


def without(text: str, tokens: list[str]) -> str:
    for token in tokens:
        text = text.replace(token, "")
    return text


def test_vocab_mapping_ties_and_fill_up_follow_each_trainer():
    freq = Counter({5: 3, 9: 2, 2: 2, 7: 1})
    d2t, t2d = speculators_mapping(freq, 2, 16)
    assert (d2t + torch.arange(2)).tolist() == [2, 5]  # a tie at the cut: the lower id
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [2, 5] and t2d.shape == (16,)
    d2t, _ = specforge_mapping(freq, {5: 0, 9: 0, 2: 1, 7: 1}, 2, 16)
    assert (d2t + torch.arange(2)).tolist() == [5, 9]  # the token its count met first
    assert (speculators_mapping(Counter({7: 1}), 3, 16)[0] + torch.arange(3)).tolist() == [0, 1, 7]
    assert (specforge_mapping(Counter({7: 1}), {7: 0}, 3, 16)[0] + torch.arange(3)).tolist() == [0, 1, 7]


def test_draft_vocab_size_writes_each_trainer_s_files(chats):
    import numpy as np

    rows, n = samples_of(chats, "B6"), 48
    vocab = json.loads((Path(chats.params["model"]["path"]) / "config.json").read_text())["vocab_size"]
    sp = export(chats, "speculators_online", "export.draft_vocab_size=48", dataset="B6")
    d2t, t2d = np.load(sp / f"d2t-{n}.npy"), np.load(sp / f"t2d-{n}.npy")
    freq = masked_freq(rows)
    top = sorted(freq, key=lambda t: (-freq[t], t))[:n]
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_ and t2d.shape == (vocab,)
    assert sorted((d2t + np.arange(n)).tolist()) == sorted(top) == np.flatnonzero(t2d).tolist()
    sf = export(chats, "specforge_online", "export.draft_vocab_size=48", dataset="B6")
    mapping = torch.load(sf / SPECFORGE_VOCAB, weights_only=True)
    assert set(mapping) == {"d2t", "t2d"} and mapping["t2d"].sum() == n
    meta = json.loads((sf / MARKER).read_text())["vocab_mapping"]
    assert meta == {"draft_vocab_size": n, "target_vocab_size": vocab, "files": [SPECFORGE_VOCAB]}
    with pytest.raises(ConfigError, match=r"^export\.draft_vocab_size: 4096 is more than the target's vocabulary"):
        export(chats, "speculators_online", "export.draft_vocab_size=4096", dataset="B6")


# ---- fast: the refusals ---------------------------------------------------------------------------------------- #


def test_refusals(project):
    with pytest.raises(ConfigError, match=r"^export\.format: .*'tensorflow'"):
        project.run("export", "B3", "export.format=tensorflow")
    with pytest.raises(UserError, match=r"hidden_states/index\.json: not found; run the hidden_states stage"):
        project.run("export", "B3", "export.format=specforge")
    with pytest.raises(UserError, match=r"B3/samples\.parquet: not found; run the tokenize stage"):
        project.run("export", "B3", "export.format=speculators_online")
    with pytest.raises(ConfigError, match=r"^export\.draft_vocab_size: must be a positive integer, got 0"):
        project.run("export", "B3", "export.format=speculators_online", "export.draft_vocab_size=0")


def test_refuses_a_file_or_a_foreign_directory(states):
    a_file = states.path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(ConfigError, match=r"^export\.dir: .*a_file is a file"):
        states.run("export", "B3", "export.format=speculators", f"export.dir={a_file}")
    foreign = states.path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=rf"^export\.dir: .*foreign is a non-empty directory without {MARKER}"):
        states.run("export", "B3", "export.format=specforge", f"export.dir={foreign}")
    assert a_file.read_text() == "mine" and (foreign / "notes.txt").read_text() == "mine"


def test_cli_reports_one_line(states):
    env = dict(
        os.environ,
        DRAFTDATA_PARAMS=str(states.path / "params.yaml"),
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
    )
    (states.path / "a_file").write_text("")
    r = subprocess.run(
        [sys.executable, "-m", "draftdata", "export", "dataset=B3", "export.format=specforge", "export.dir=a_file"],
        cwd=states.path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("error: export.dir: a_file is a file")


# ---- the real readers ------------------------------------------------------------------------------------------ #

# Runs under DRAFTDATA_TRAINERS_PYTHON: loads the exports with the trainers' own code and dumps what it returns.
READERS = textwrap.dedent("""
    import json, re, sys
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    sf_dir, sp_dir, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    BIG = 1 << 20  # max_len: no truncation

    def index(path):
        return int(re.search(r"data_(\\d+)\\.ckpt$", str(path)).group(1))

    def dump(name, items):
        save_file({f"{key}/{k}": v.contiguous() for key, d in items for k, v in d.items()
                   if isinstance(v, torch.Tensor)}, str(out / f"{name}.safetensors"))

    # SpecForge 0.2.0, what `specforge train` runs offline: the eagle3 provider's reader, normalizer and collator
    # over a LocalFeatureStore, through the FeatureDataLoader
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    eagle3 = builtin_algorithm_registry().resolve("eagle3")
    provider = eagle3.providers.offline_for("text")
    refs = provider.build_reader(sf_dir, run_id="t", ttt_length=1, max_len=BIG).read()
    path_of = {r.sample_id: r.feature_store_uri[len("file://"):] for r in refs}
    loader = FeatureDataLoader(LocalFeatureStore("t"), refs=refs, batch_size=1, drop_last=False,
                               collate_fn=provider.build_collator(),
                               per_sample_transform=provider.build_normalizer(BIG), strategy=eagle3.name)
    dump("specforge_loader", [(index(path_of[b.sample_ids[0]]), b.tensors) for b in loader])

    # SpecForge's dataset class (specforge.data.preprocessing), the same files
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    ds = build_offline_eagle3_dataset(sf_dir, max_len=BIG)
    dump("specforge_dataset", [(index(ds.datapaths[j]), ds[j]) for j in range(len(ds))])

    # SpecForge's own token count for its vocab mapping
    from specforge.training.vocab_mapping import count_effective_feature_tokens
    counts = {"specforge": dict(count_effective_feature_tokens(sf_dir))}

    # speculators 0.9.0: its ArrowDataset, item by item, and its train/val loaders (packed batches)
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    ds = ArrowDataset(max_len=BIG, datapath=sp_dir, on_missing="raise")
    dump("speculators_dataset", [(i, ds[i]) for i in range(len(ds))])
    # what its EAGLE-3 trainer makes of each item: shift_batch pairs position t's states with token t + 1
    from speculators.models.eagle3.data import shift_batch
    dump("speculators_shifted", [(i, shift_batch(ds[i])) for i in range(len(ds))])
    meta = json.loads((Path(sp_dir) / "draftdata_export.json").read_text())
    total = max(ds.approx_lengths) * 2
    train, val = create_train_val_loaders(
        data_path=sp_dir, total_seq_len=total, hidden_states_dtype=torch.bfloat16, vllm_endpoint="unused",
        on_missing="raise", verifier_name_or_path=None, request_timeout=1.0, max_retries=0,
        generation_validation_retries=0, max_consecutive_generation_failures=1, hidden_size=meta["hidden_size"],
        num_target_layers=len(meta["aux_layer_ids"]), num_workers=0, prefetch_factor=None, preprocess=None,
        train_data_ratio=0.5)
    dump("speculators_loader", [(b, batch) for b, batch in enumerate([*train, *val])])
    freq = torch.load(Path(sp_dir) / "token_freq.pt", weights_only=True)
    counts["speculators"] = freq
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size=32, target_vocab_size=4096)
    counts["speculators_d2t_size"] = int(d2t.shape[0])
    (out / "counts.json").write_text(json.dumps(counts))
""")


def run_readers(sf: Path, sp: Path, tmp_path: Path) -> Path:
    """READERS on a SpecForge and a speculators export, in the trainers' Python: the folder of what they returned."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (tmp_path / "readers.py").write_text(READERS)
    r = subprocess.run(
        [TRAINERS_PYTHON, str(tmp_path / "readers.py"), str(sf), str(sp), str(dumps)],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return dumps


def read_dump(path: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for key, t in load_file(path).items():
        item, name = key.split("/", 1)
        out.setdefault(int(item), {})[name] = t
    return out


@pytest.mark.trainers
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with specforge and speculators"
)
def test_trainers_own_readers_load_the_exports(states, tmp_path):
    sf, sp = export(states, "specforge"), export(states, "speculators")
    hs = HiddenStates(states.data("B3") / "hidden_states")
    samples = list(hs)
    k, h = len(hs.layers["physical"]), hs.hidden_size
    dumps = run_readers(sf, sp, tmp_path)

    # SpecForge, both paths: draft input = the aux layers concatenated, target = the post-norm state (bf16, exact),
    # loss mask with its last position zeroed (the reader's own rule), batch dim 1
    for name in ("specforge_loader", "specforge_dataset"):
        got = read_dump(dumps / f"{name}.safetensors")
        assert sorted(got) == list(range(len(samples))), name
        for i, s in enumerate(samples):
            g, n = got[i], s.input_ids.shape[0]
            assert torch.equal(g["input_ids"], s.input_ids[None]), (name, i)
            mask = s.loss_mask.clone()
            mask[-1] = 0
            assert torch.equal(g["loss_mask"], mask[None]) and torch.equal(g["attention_mask"], torch.ones(1, n).long())
            assert g["hidden_state"].shape == (1, n, k * h) and g["target"].shape == (1, n, h)
            assert torch.equal(g["hidden_state"][0].float(), s.aux.reshape(n, k * h)), (name, i)
            exact_bf16(g["target"][0], s.final_post_norm)

    # speculators' dataset, item by item: aux flattened in index order, the pre-norm state as the verifier's
    got = read_dump(dumps / "speculators_dataset.safetensors")
    assert sorted(got) == list(range(len(samples)))
    for i, s in enumerate(samples):
        g, n = got[i], s.input_ids.shape[0]
        assert torch.equal(g["input_ids"], s.input_ids) and torch.equal(g["loss_mask"], s.loss_mask)
        assert g["hidden_states"].dtype == g["verifier_last_hidden_states"].dtype == torch.bfloat16
        assert torch.equal(g["hidden_states"].float(), s.aux.reshape(n, k * h))
        assert torch.equal(g["verifier_last_hidden_states"].float(), s.final_pre_norm)
        assert torch.equal(g["lengths"], torch.tensor([n])) and torch.equal(g["position_ids"], torch.arange(n))

    # speculators' loaders: packed batches; every sample comes back once (train + val), found by its tokens
    by_ids = {tuple(s.input_ids.tolist()): s for s in samples}
    seen = []
    for b in read_dump(dumps / "speculators_loader.safetensors").values():
        docs = b["document_ids"][0]
        for d in range(int(docs.max()) + 1):
            rows = docs == d
            ids = b["input_ids"][0][rows]
            s = by_ids[tuple(ids.tolist())]
            n = ids.shape[0]
            assert torch.equal(b["loss_mask"][0][rows], s.loss_mask)
            assert torch.equal(b["hidden_states"][0][rows].float(), s.aux.reshape(n, k * h))
            assert torch.equal(b["verifier_last_hidden_states"][0][rows].float(), s.final_pre_norm)
            seen.append(tuple(ids.tolist()))
    assert sorted(seen) == sorted(tuple(s.input_ids.tolist()) for s in samples)

    # Every token of the difference between what the two trainers read and train, from their own conventions
    # (SpecForge #885): speculators pairs position t's states with token t + 1 (shift_batch: n - 1 positions, the
    # loss mask of token t + 1); SpecForge reads all n positions and gates the loss at t (whose target is token
    # t + 1) by the mask of token t, its last position zeroed. So SpecForge never trains an answer's first token,
    # trains the token after each answer's end instead, and reads one position more per sample.
    shifted = read_dump(dumps / "speculators_shifted.safetensors")
    sf_loader = read_dump(dumps / "specforge_loader.safetensors")
    sp_tokens = sum(int(shifted[i]["lengths"]) for i in range(len(samples)))
    sf_tokens = sum(sf_loader[i]["input_ids"].shape[1] for i in range(len(samples)))
    sp_trained = [
        {t + 1 for t in torch.nonzero(shifted[i]["loss_mask"]).flatten().tolist()} for i in range(len(samples))
    ]
    sf_trained = [
        {t + 1 for t in torch.nonzero(sf_loader[i]["loss_mask"][0]).flatten().tolist()} for i in range(len(samples))
    ]
    assert sf_tokens - sp_tokens == len(samples)
    first = after = 0
    for s, sp_targets, sf_targets in zip(samples, sp_trained, sf_trained):
        m = s.loss_mask.tolist()
        starts = {t for t in range(1, len(m)) if m[t] and not m[t - 1]}  # an answer's first token
        ends = {t + 1 for t in range(len(m) - 1) if m[t] and not m[t + 1]}  # the token after an answer
        assert sp_targets == {t for t in range(1, len(m)) if m[t]}  # exactly the trained tokens
        assert sf_targets == (sp_targets - starts) | ends  # and SpecForge's, by its rule
        first, after = first + len(starts), after + len(ends)
    assert sum(map(len, sp_trained)) - sum(map(len, sf_trained)) == first - after
    assert first > after  # every sample's last answer ends the sample: SpecForge trains fewer positions

    # token frequencies: SpecForge's own recount of the .ckpt files and speculators' token_freq.pt agree with ours
    counts = json.loads((dumps / "counts.json").read_text())
    want = {str(t): c for t, c in token_freq(hs).items()}
    assert counts["specforge"] == want and counts["speculators"] == want
    assert counts["speculators_d2t_size"] == 32
    # SpecForge's dataset class zeroes the last loss-mask entry in place on a memory-mapped load: the file keeps its
    # own (a private mapping)
    assert torch.equal(torch.load(sf / specforge_path(0), weights_only=True)["loss_mask"], samples[0].loss_mask)


# Runs under DRAFTDATA_TRAINERS_PYTHON: the online exports through the trainers' own online readers, and each
# trainer's own vocab mapping from each export beside ours.
ONLINE_READERS = textwrap.dedent("""
    import json, sys
    from argparse import Namespace
    from collections import Counter
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    sp_on, sf_on, sp_off, sf_off, out = sys.argv[1:6]
    n, vocab, model = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
    out, BIG, result = Path(out), 1 << 20, {}

    # speculators 0.9.0, online: its ArrowDataset finds no stored states and generates them (--on-missing generate,
    # the default); the vLLM request is stood in for by a function that writes the file vLLM's connector writes
    import speculators.train.data as data

    sent = []

    def vllm(client, model_name, item, **kwargs):
        sent.append(item)
        ids = torch.tensor(item["input_ids"], dtype=torch.long)
        path = out / f"generated_{len(sent)}.safetensors"
        save_file({"token_ids": ids, "hidden_states": torch.ones(len(ids), 4, 8, dtype=torch.bfloat16)}, str(path))
        return str(path), {"hidden_states_path": str(path)}

    data.generate_hidden_states = vllm
    ds = data.ArrowDataset(max_len=BIG, datapath=sp_on, on_missing="generate")
    ds.client, ds.model = object(), "target"  # no endpoint to ask for its model
    items = [ds[i] for i in range(len(ds))]
    result["speculators_online"] = {
        "sent": sent,
        "input_ids": [it["input_ids"].tolist() for it in items],
        "loss_mask": [it["loss_mask"].tolist() for it in items],
        "hidden_states": [list(it["hidden_states"].shape) for it in items],
        "lengths": ds.approx_lengths,
    }
    # ... and offline, the export with the conversation and turn columns
    ds = data.ArrowDataset(max_len=BIG, datapath=sp_off, on_missing="raise")
    result["speculators_offline_ids"] = [ds[i]["input_ids"].tolist() for i in range(len(ds))]

    # speculators' vocab mapping: its trainer finds our d2t-N/t2d-N files, and computes its own from token_freq.pt
    from speculators.train.cli import parse_vocab_mappings
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    for name, path in (("speculators_online", sp_on), ("speculators", sp_off)):
        args = Namespace(d2t_path=None, t2d_path=None, data_path=path, draft_vocab_size=n, token_freq_path=None,
                         verifier_name_or_path=model, trust_remote_code=False)
        found = parse_vocab_mappings(args)
        own = build_vocab_mappings_from_distribution(torch.load(Path(path) / "token_freq.pt"), n, vocab)
        result[f"{name}_vocab"] = found[2] == n and same(found[:2], own)

    # SpecForge 0.2.0, online: prompts.jsonl through its prompt preparation (data.prompts_path); its vocab mapping
    # from those rows (generate_vocab_mapping_file) and, offline, from the feature files, against ours
    from datasets import Dataset
    from specforge.data.preprocessing import generate_vocab_mapping_file, process_token_dict_to_mappings
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    tasks = prepare_prompt_tasks(Path(sf_on) / "prompts.jsonl", None, chat_template=None, max_length=BIG,
                                 is_preformatted=False, train_only_last_turn=False, cache_dir=None, cache_key=None,
                                 num_proc=None)
    payloads = [t["payload"] for t in tasks]
    result["specforge_online"] = payloads
    theirs = torch.load(generate_vocab_mapping_file(Dataset.from_list(payloads).with_format("torch"), vocab, n,
                                                    cache_dir=str(out / "sf_vocab")))
    ours = torch.load(Path(sf_on) / "vocab_mapping" / "vocab_mapping.pt")
    result["specforge_online_vocab"] = same((theirs["d2t"], theirs["t2d"]), (ours["d2t"], ours["t2d"]))
    theirs = process_token_dict_to_mappings(count_effective_feature_tokens(sf_off), n, vocab)
    ours = torch.load(Path(sf_off) / "vocab_mapping" / "vocab_mapping.pt")
    result["specforge_vocab"] = same(theirs, (ours["d2t"], ours["t2d"]))
    (out / "online.json").write_text(json.dumps(result))
""")


def tied_cut(freq: Counter, least: int = 32) -> int:
    """A draft vocabulary size at which tokens of equal count fall on both sides of the cut: the tie-break decides."""
    counts = sorted(freq.values(), reverse=True)
    return next(n for n in range(least, len(counts)) if counts[n - 1] == counts[n])


@pytest.mark.trainers
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with specforge and speculators"
)
def test_trainers_read_the_online_exports_and_compute_our_vocab_mappings(chats, tmp_path):
    rows = samples_of(chats, "B6")
    n = tied_cut(masked_freq(rows))
    vocab = json.loads((Path(chats.params["model"]["path"]) / "config.json").read_text())["vocab_size"]
    chats.params["datasets"]["B6"]["store_hidden_states"] = True
    chats.save()
    chats.run("hidden_states", "B6")
    dirs = [
        export(chats, fmt, f"export.draft_vocab_size={n}", dataset="B6")
        for fmt in ("speculators_online", "specforge_online", "speculators", "specforge")
    ]
    (tmp_path / "online.py").write_text(ONLINE_READERS)
    args = [*map(str, dirs), str(tmp_path), str(n), str(vocab), chats.params["model"]["path"]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([TRAINERS_PYTHON, str(tmp_path / "online.py"), *args], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads((tmp_path / "online.json").read_text())

    ids, masks = [r["input_ids"] for r in rows], [r["loss_mask"] for r in rows]
    sp = got["speculators_online"]
    assert sp["sent"] == [{"input_ids": i} for i in ids]  # what goes to vLLM: our ids, nothing to re-render
    assert sp["input_ids"] == ids and sp["loss_mask"] == masks and sp["lengths"] == [len(i) for i in ids]
    assert sp["hidden_states"] == [[len(i), 3 * 8] for i in ids]  # states from the stand-in, our mask beside them
    assert got["speculators_offline_ids"] == ids
    assert got["specforge_online"] == [{"input_ids": i, "loss_mask": m} for i, m in zip(ids, masks)]
    for name in ("speculators_online", "speculators", "specforge_online", "specforge"):
        assert got[f"{name}_vocab"] is True, name


@pytest.mark.trainers
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with specforge and speculators"
)
def test_specforge_re_tokenizes_the_conversations_with_our_check(chats):
    """scripts/check_specforge_tokens.py on the demo's ChatML target, with SpecForge's qwen headers and no default
    system prompt: where its ids begin with ours, its loss mask covers ours and one token more per answer (the
    newline its end-of-turn pattern takes after <|im_end|>); the tiny target's sampled tokens that are not its
    tokenizer's encoding of their text make the other samples differ, and the check says so (exit status 1)."""
    out = export(chats, "specforge_online", dataset="B6")
    template = {"assistant_header": "<|im_start|>assistant\n", "user_header": "<|im_start|>user\n"}
    template["end_of_turn_token"] = "<|im_end|>\n"
    r = subprocess.run(
        [
            TRAINERS_PYTHON,
            str(Path(__file__).resolve().parents[1] / "scripts" / "check_specforge_tokens.py"),
            str(out),
            "--model",
            chats.params["model"]["path"],
            "--chat-template",
            "chatml_no_system",
            "--template-json",
            json.dumps(template),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 1, r.stderr[-4000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["samples"] == len(samples_of(chats, "B6")) and report["same_ids"] == 0
    assert report["ours_prefix_of_theirs"] > 0
    t = report["trained_tokens"]
    assert t["ours_only"] == 0 and t["theirs_only"] == t["our_spans"] > 0 and t["theirs"] == t["ours"] + t["our_spans"]


def test_the_states_output_is_whole_on_its_own_and_says_which_engine_computed_each_sample(chats, tmp_path):
    """Copied alone to a training machine (no tokenize samples.parquet beside it), the hidden-states output still
    exports the conversation and turn of `turns: all`; each sample names the engine that computed it, and the
    metrics count them."""
    import sqlite3

    chats.params["datasets"]["B6"]["store_hidden_states"] = True
    chats.save()
    chats.run("hidden_states", "B6")
    src = chats.data("B6") / "hidden_states"
    rows = pq.read_table(src / "samples.parquet").to_pylist()
    assert {r["engine"] for r in rows} == {"hf:float32"} and any(r["turn"] > 0 for r in rows)
    metrics = json.loads((chats.data("B6") / "hidden_states_metrics.json").read_text())
    assert metrics["engines"] == {"hf:float32": len(rows)}

    alone = tmp_path / "elsewhere" / "hidden_states"
    shutil.copytree(src, alone)
    out = tmp_path / "exported"
    chats.run("export", "B6", "export.format=speculators", f"export.dir={out}")  # from the project, for comparison
    from datasets import load_from_disk

    want = load_from_disk(str(out)).to_list()
    hs = HiddenStates(alone)
    assert hs.carries_turns
    for s, row, w in zip(hs, rows, want):
        assert (s.conversation, s.turn) == (row["conversation"], row["turn"]) == (w["conversation"], w["turn"])

    # a store whose shards another engine computed: the same states serve, and the output says whose they are
    store = sqlite3.connect(chats.path / "states" / "index.sqlite")  # beside run.store_path
    store.execute("UPDATE shards SET engine = 'vllm:hook'")
    store.commit()
    store.close()
    chats.run("hidden_states", "B6")
    metrics = json.loads((chats.data("B6") / "hidden_states_metrics.json").read_text())
    assert metrics["computed_samples"] == 0 and metrics["engines"] == {"vllm:hook": len(rows)}


def test_a_sample_list_and_shards_of_two_runs_are_refused_by_the_reader(states):
    """The reader pairs each shard row with samples.parquet's mask: a length that differs is two runs mixed."""
    import pyarrow as pa

    src = states.data("B3") / "hidden_states"
    table = pq.read_table(src / "samples.parquet")
    masks = table.column("loss_mask").to_pylist()
    masks[1] = masks[1][:-1]
    broken = table.set_column(
        table.schema.get_field_index("loss_mask"), "loss_mask", pa.array(masks, table.schema.field("loss_mask").type)
    )
    (src / "samples.parquet").unlink()
    pq.write_table(broken, src / "samples.parquet")
    hs = HiddenStates(src)
    hs[0]
    with pytest.raises(ValueError, match=r"sample 1 .* loss mask of .* mixed from two runs"):
        hs[1]


# ---- online exports per drafter family --------------------------------------------------------------------------- #


def test_an_online_export_for_a_block_drafter_keeps_its_rows_and_names_its_layers(chats):
    """export.family on an online format: a block drafter's export leaves out the rows without two adjacent trained
    tokens (counted, never written) and names the layers its trainer is to capture, in that trainer's numbering;
    EAGLE-3's (the default) keeps every row."""
    from datasets import load_from_disk

    from draftdata.drafters.families import adjacent_supervised, block_default_layers
    from draftdata.drafters.layers import default_layers
    from draftdata.util.files import read_jsonl

    rows = samples_of(chats, "B6")
    # a row no block drafter can train on: its trained tokens none adjacent (one such row is enough to test the rule)
    rows[0]["loss_mask"] = [1 if i % 2 else 0 for i in range(len(rows[0]["loss_mask"]))]
    pq.write_table(pa.Table.from_pylist(rows), chats.data("B6") / "samples.parquet")
    n_layers = 8  # the tiny target's depth
    eagle = export(chats, "speculators_online", dataset="B6")
    meta = json.loads((eagle / MARKER).read_text())
    assert meta["family"] == "eagle3" and meta["skipped"] == {} and meta["samples"] == len(rows)
    assert meta["aux_layer_ids"] == [i + 1 for i in default_layers(n_layers)]  # vLLM's numbering

    export(chats, "speculators_online", "export.family=dflash", "export.dir=export-sp-dflash", dataset="B6")
    sp = chats.path / "export-sp-dflash"
    meta = json.loads((sp / MARKER).read_text())
    keep = [r for r in rows if adjacent_supervised(r["loss_mask"])]
    assert rows[0] not in keep and meta["samples"] == len(keep)
    assert meta["skipped"] == {"no_adjacent_supervised": len(rows) - len(keep)}
    assert [r["input_ids"].tolist() for r in load_from_disk(str(sp))] == [r["input_ids"] for r in keep]
    block = block_default_layers(n_layers, 5)
    assert meta["aux_layer_ids"] == [i + 1 for i in block]
    assert meta["draft_config_key"] == "aux_hidden_state_layer_ids"

    export(chats, "specforge_online", "export.family=domino", "export.dir=export-sf-domino", dataset="B6")
    sf = chats.path / "export-sf-domino"
    meta = json.loads((sf / MARKER).read_text())
    assert meta["aux_layer_ids"] == block and meta["aux_layer_numbering"] == "sglang_specforge"
    assert [r["id"] for r in read_jsonl(sf / "prompts.jsonl")] == [r["id"] for r in keep]
    assert {c["id"] for c in read_jsonl(sf / "conversations.jsonl")} == {r["id"] for r in keep}


@pytest.mark.parametrize(
    "fmt, family, words",
    [
        ("specforge_online", "dflash2", "specforge has no online mode for dflash2; export it as speculators_online"),
        ("specforge_online", "mtp", "specforge has no online mode for mtp; export it as speculators_online"),
        ("speculators_online", "domino", "speculators has no online mode for domino; export it as specforge_online"),
    ],
)
def test_an_online_family_the_trainer_cannot_train_is_refused_before_any_file(chats, fmt, family, words):
    with pytest.raises(ConfigError, match=f"^export.family: {re.escape(words)}"):
        export(chats, fmt, f"export.family={family}", dataset="B6")
    assert not (chats.data("B6") / f"export-{fmt}-{family}").exists()


def test_each_speculators_export_writes_its_command_and_says_where_the_default_layers_differ(chats, capsys):
    """`speculators train` reads layers [2, N//2, N-3] unless given --target-layer-ids, whatever the family: a block
    export trained without them trains on other layers than it holds, with the same loss curve. The export writes
    the command with its layers (train_command.sh, and a line of its log), and says so where the default differs."""
    import shlex

    from draftdata.hidden.trainer_command import COMMAND_FILE, speculators_default_layers

    n_layers = 8  # the tiny target's depth
    capsys.readouterr()
    for family in ("eagle3", "dflash"):
        out = export(chats, "speculators_online", f"export.family={family}", dataset="B6")
        meta = json.loads((out / MARKER).read_text())
        line = (out / COMMAND_FILE).read_text().splitlines()[-1]
        argv = shlex.split(line)
        assert argv[:4] == ["speculators", "train", "--speculator-type", family]
        held = argv[argv.index("--target-layer-ids") + 1 : argv.index("--vllm-endpoint")]
        assert [int(i) for i in held] == meta["aux_layer_ids"]
        assert argv[argv.index("--data-path") + 1] == str(out.relative_to(chats.path))  # from where it was run
        logged = capsys.readouterr().out
        assert f"export train_command={line}\n" in logged
        differs = meta["aux_layer_ids"] != speculators_default_layers(n_layers)
        warned = [x for x in logged.splitlines() if x.startswith("export warning=speculators train reads layers")]
        assert len(warned) == differs, (family, warned)
        if differs:
            assert f"[2, 4, 5] unless told (--target-layer-ids); this export holds {meta['aux_layer_ids']}" in warned[0]
    assert family == "dflash" and differs  # the block default of 5 layers is not speculators'


@pytest.mark.trainers
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with specforge and speculators"
)
def test_speculators_takes_the_written_command_with_the_export_s_layers(chats):
    """`speculators train` itself parses the command train_command.sh holds (`--dump-config`: the resolved run, no
    training), and resolves the layers the export holds, not its default."""
    import shlex

    import yaml

    from draftdata.hidden.trainer_command import COMMAND_FILE

    out = export(chats, "speculators_online", "export.family=dflash", dataset="B6")
    argv = shlex.split((out / COMMAND_FILE).read_text().splitlines()[-1])
    held = json.loads((out / MARKER).read_text())["aux_layer_ids"]
    speculators = str(Path(TRAINERS_PYTHON).parent / "speculators")
    r = subprocess.run(
        [speculators, *argv[1:], "--dump-config"], cwd=chats.path, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    train = yaml.safe_load(r.stdout)["train"]  # its run.yaml: the flags by section
    assert train["draft"]["target_layer_ids"] == held and train["speculator_type"] == "dflash", train
    assert train["data"]["data_path"] == str(out.relative_to(chats.path))
    assert train["generation"]["vllm_endpoint"] == "http://HOST:8000/v1"


@pytest.mark.trainers
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with specforge and speculators"
)
def test_specforge_takes_the_written_run_config(states):
    """`specforge train -c train_config.yaml --plan`: SpecForge's own schema takes the run config each export wrote,
    EAGLE-3's and a block drafter's with its draft config (it checks every key and the
    algorithm's rules, DSpark's need of a draft config among them; it opens no path)."""
    import shlex

    from draftdata.hidden.trainer_command import COMMAND_FILE

    both = "hidden_states.drafters=[eagle3,dspark]"
    states.run("hidden_states", "B3", both)
    specforge = str(Path(TRAINERS_PYTHON).parent / "specforge")
    for fmt, family in (("specforge", "eagle3"), ("specforge", "dspark")):
        out = export(states, fmt, f"export.family={family}", both)
        argv = shlex.split((out / COMMAND_FILE).read_text().splitlines()[-1])
        r = subprocess.run(
            [specforge, *argv[1:], "--plan"], cwd=states.path, capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0 and '"role": "all"' in r.stdout, (fmt, family, r.stdout[-2000:] + r.stderr[-3000:])


def test_a_specforge_online_export_says_what_its_run_config_needs(chats, capsys):
    """SpecForge trains online only disaggregated, over the user's own SGLang capture servers: no run config is
    written, and one line says which rows and layers to put in the user's."""
    capsys.readouterr()
    out = export(chats, "specforge_online", dataset="B6")
    logged = capsys.readouterr().out
    held = json.loads((out / MARKER).read_text())["aux_layer_ids"]
    rows = (out / "prompts.jsonl").relative_to(chats.path)
    assert f"set data.prompts_path: {rows} and model.aux_hidden_state_layer_ids: {held}" in logged
    assert not (out / "train_command.sh").exists()


def test_a_specforge_export_writes_its_run_config_and_says_what_specforge_would_read_wrong(states, capsys):
    """EAGLE-3: SpecForge's run config (the target, the states, the layers; the LM head's key on a tied target) and its
    command; a target without a safetensors index is named (SpecForge's eagle3 offline path needs one). A block
    drafter: the line that says SpecForge's model.draft_num_hidden_layers replaces the draft config's layers."""
    import yaml

    from draftdata.hidden.trainer_command import COMMAND_FILE, SPECFORGE_CONFIG, ties_lm_head

    target = Path(states.params["model"]["path"])
    capsys.readouterr()
    out = export(states, "specforge")
    meta = json.loads((out / MARKER).read_text())
    conf = yaml.safe_load((out / SPECFORGE_CONFIG).read_text())
    rel = str(out.relative_to(states.path))
    assert conf["model"]["target_model_path"] == str(target) and conf["data"] == {"hidden_states_path": rel}
    assert (
        conf["model"]["aux_hidden_state_layer_ids"] == meta["aux_layer_ids"]
        and conf["training"]["strategy"] == "eagle3"
    )
    assert ("lm_head_key" in conf["model"]) == ties_lm_head(target)
    command = (out / COMMAND_FILE).read_text().splitlines()[-1]
    assert command == f"specforge train -c {rel}/{SPECFORGE_CONFIG}"
    logged = capsys.readouterr().out
    assert f"export train_command={command}\n" in logged
    indexed = any(target.glob("*.index.json"))
    assert ("reads the target's LM head through a *.index.json" in logged) == (not indexed)

    both = "hidden_states.drafters=[eagle3,dflash]"
    states.run("hidden_states", "B3", both)
    export(states, "specforge", "export.family=dflash", both)
    logged = capsys.readouterr().out
    block = states.data("B3") / "export-specforge-dflash"
    held = json.loads((block / MARKER).read_text())["aux_layer_ids"]
    assert f"(draft_config.json: dflash_config.target_layer_ids {held}); leave model.draft_num_hidden_layers" in logged
    # the draft config: the target's shape, one draft layer per layer held, those layers; the run config names it
    # and leaves draft_num_hidden_layers out (set, SpecForge would replace the layers with its default)
    draft = json.loads((block / "draft_config.json").read_text())
    shape = json.loads((target / "config.json").read_text())
    assert draft["dflash_config"] == {"target_layer_ids": held} and draft["num_hidden_layers"] == len(held)
    assert draft["hidden_size"] == shape["hidden_size"] and draft["num_target_layers"] == shape["num_hidden_layers"]
    conf = yaml.safe_load((block / SPECFORGE_CONFIG).read_text())
    assert conf["model"] == {
        "target_model_path": str(target),
        "draft_model_config": f"{block.relative_to(states.path)}/draft_config.json",
    }
    assert conf["training"] == {"strategy": "dflash"}


@pytest.mark.trainers
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with specforge and speculators"
)
def test_an_fp8_capture_loads_in_both_trainers_readers_within_fp8_s_error(states, tmp_path):
    """`hidden_states.dtype=fp8` (e4m3 with a float32 scale per layer): both exports of it load in the trainers' own
    readers, which return the fp8 capture's values exactly (widened to bf16) and the bf16 capture's within fp8's
    error: a relative error per sample and layer under FP8_REL_ERR (e4m3 keeps 3 bits of mantissa: a value rounds
    by up to 2^-4 of itself, about 2^-4 / sqrt(3) in the mean square)."""
    FP8_REL_ERR = 0.05
    bf16 = list(HiddenStates(states.data("B3") / "hidden_states"))
    fp8 = "hidden_states.dtype=fp8"
    states.run("hidden_states", "B3", fp8)
    hs = HiddenStates(states.data("B3") / "hidden_states")
    assert hs.index["dtype"] == "fp8"
    samples = list(hs)
    export(states, "specforge", fp8, "export.dir=export-sf-fp8")
    export(states, "speculators", fp8, "export.dir=export-sp-fp8")
    sf, sp = states.path / "export-sf-fp8", states.path / "export-sp-fp8"
    dumps = run_readers(sf, sp, tmp_path)
    k, h = len(hs.layers["physical"]), hs.hidden_size

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.float() - want).norm() / want.norm())

    worst = 0.0
    sf_got = read_dump(dumps / "specforge_dataset.safetensors")
    sp_got = read_dump(dumps / "speculators_dataset.safetensors")
    for i, (s, b) in enumerate(zip(samples, bf16, strict=True)):
        n = s.input_ids.shape[0]
        assert torch.equal(s.input_ids, b.input_ids)
        for got in (sf_got[i]["hidden_state"][0], sp_got[i]["hidden_states"]):
            assert torch.equal(got, s.aux.reshape(n, k * h).to(torch.bfloat16))  # the fp8 capture's, exactly
            for layer in range(k):
                cols = slice(layer * h, (layer + 1) * h)
                worst = max(worst, rel(got[:, cols], b.aux[:, layer]))
        worst = max(worst, rel(sp_got[i]["verifier_last_hidden_states"], b.final_pre_norm))
    print(f"fp8 through the trainers' readers: worst relative error per sample and layer {worst:.4f}")
    assert 0 < worst < FP8_REL_ERR, worst
