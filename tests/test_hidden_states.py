"""The hidden_states stage on the tiny target: values against transformers' own forward, both final-state
conventions, the shard format, the state store (computed once, torn shards, kills), NaN checks, torchrun ranks,
layer choices and fp8."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT, Project, free_port

from draftdata.errors import ConfigError, UserError
from draftdata.hidden.reader import HiddenStates


@pytest.fixture(scope="module")
def samples_dir(tmp_path_factory, tiny_model) -> Path:
    """A project whose B3 chain has run up to samples.parquet (shared; each test copies it)."""
    from conftest import dataset_params

    root = tmp_path_factory.mktemp("chain")
    params = {
        "model": {"path": str(tiny_model), "revision": None, "chat_template": None, "template_kwargs": {}},
        "tokenize": {"max_seq_len": 1024, "on_too_long": "drop", "train_on": "last_turn"},
        "hidden_states": {"layers": None, "dtype": "float32", "batch_tokens": 2048, "shard_max_tokens": 2048},
        "run": {"store_path": "store/store.sqlite", "log_every_s": 5.0},
        "datasets": {"B3": dataset_params("B3_magicoder", "magicoder_oss", token_budget=1500, max_prompts=None)},
    }
    cwd = os.getcwd()
    os.chdir(root)
    try:
        project = Project(root, params)
        for stage in ("prompts", "generate", "tokenize"):
            project.run(stage, "B3")
    finally:
        os.chdir(cwd)
    return root


@pytest.fixture
def hs_project(samples_dir, tmp_path, monkeypatch) -> Project:
    shutil.copytree(samples_dir / "data", tmp_path / "data")
    shutil.copytree(samples_dir / "store", tmp_path / "store")  # the responses (no states yet)
    monkeypatch.chdir(tmp_path)
    params = json.loads(json.dumps(__import__("yaml").safe_load((samples_dir / "params.yaml").read_text())))
    params["run"]["store_path"] = str(tmp_path / "store" / "store.sqlite")
    return Project(tmp_path, params)


def hs_metrics(project: Project) -> dict:
    return json.loads((project.data("B3") / "hidden_states_metrics.json").read_text())


def read_all(path: Path) -> list:
    return [(s.id, s.input_ids, s.loss_mask, s.aux, s.final_pre_norm) for s in HiddenStates(path)]


def test_states_equal_transformers_and_both_conventions_are_exact(hs_project, tiny_model):
    from transformers import AutoModelForCausalLM

    hs_project.run("hidden_states", "B3")
    out = hs_project.data("B3") / "hidden_states"
    index = json.loads((out / "index.json").read_text())
    assert index["layers"] == {
        "physical": [1, 3, 4],
        "hf_hidden_states_index": [2, 4, 5],
        "sglang_specforge": [1, 3, 4],
        "vllm_speculators": [2, 4, 5],
    }
    assert index["final_state"] == "pre_norm" and index["model"]["hidden_size"] == 64
    samples = pq.read_table(hs_project.data("B3") / "samples.parquet").to_pylist()
    reader = HiddenStates(out)
    assert [s.id for s in reader] == [r["id"] for r in samples]  # the dataset's order
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    for row, s in list(zip(samples, reader))[:6]:
        assert s.input_ids.tolist() == row["input_ids"] and s.loss_mask.tolist() == row["loss_mask"]
        with torch.inference_mode():
            hs = model(input_ids=s.input_ids.unsqueeze(0), output_hidden_states=True).hidden_states
            own_norm = model.model.norm(s.final_pre_norm)
        expected = torch.stack([hs[layer + 1][0] for layer in (1, 3, 4)], dim=1)
        torch.testing.assert_close(s.aux, expected, atol=1e-5, rtol=1e-5)
        # hidden_states[-1] is the post-norm state: the stored pre-norm one plus the norm gives it back
        torch.testing.assert_close(s.final_post_norm, hs[-1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s.final_post_norm, own_norm, atol=1e-6, rtol=1e-6)  # the model's own norm


def test_the_policy_is_the_target_s_next_token_distribution_beside_unchanged_states(hs_project, tiny_model):
    """hidden_states.policy_top_k: row t holds the top k of the target's log-softmax at t (its policy for token
    t + 1), cut past the nucleus, from the same forward as the states, which are what they are without it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    first = pq.read_table(hs_project.data("B3") / "samples.parquet").column("input_ids")[0].as_py()
    with torch.inference_mode():
        probs = torch.softmax(model(input_ids=torch.tensor([first])).logits[0].float(), -1).topk(8).values
    # a top_p that half of the random target's rows reach within 7 of their 8 slots: rows cut short and whole rows
    top_p = round(float((probs[:, :7].sum(-1) / probs.sum(-1)).median()), 6)
    hs_project.set("hidden_states.policy_top_k", 8)
    hs_project.set("hidden_states.policy_top_p", top_p)
    hs_project.run("hidden_states", "B3")
    out = hs_project.data("B3") / "hidden_states"
    index, m = json.loads((out / "index.json").read_text()), hs_metrics(hs_project)
    assert index["policy"]["top_k"] == 8 and index["policy"]["top_p"] == top_p and index["states"] is True
    # float32 states here: 3 layers + the final, 64 wide, 4 bytes a value; the id; 8 slots of a token and a log-prob
    assert m["limit_bytes_per_token"] == 2 * 4 * 64 + 8 * 8 and m["bytes_per_token"] <= 1.02 * (4 * 4 * 64 + 4 + 64)
    cut = whole = 0
    for s in list(HiddenStates(out))[:4]:
        tokens, lps = s.policy
        assert tokens.shape == lps.shape == (len(s.input_ids), 8)
        with torch.inference_mode():
            got = model(input_ids=s.input_ids.unsqueeze(0), output_hidden_states=True)
        lp = torch.log_softmax(got.logits[0].float(), dim=-1)
        for t in range(len(s.input_ids)):
            kept = torch.isfinite(lps[t])
            n = int(kept.sum())
            assert kept[:n].all() and not kept[n:].any()  # the kept slots first, the cut ones after
            torch.testing.assert_close(lps[t, :n], lp[t, tokens[t, :n]], atol=1e-5, rtol=1e-5)
            best = lp[t].topk(8)
            torch.testing.assert_close(lps[t, :n], best.values[:n], atol=1e-5, rtol=1e-5)  # the likeliest, in order
            assert set(tokens[t].tolist()) == set(best.indices.tolist())  # the cut slots keep their tokens
            probs = (
                best.values.exp() / best.values.exp().sum()
            )  # top-k then top-p: the nucleus over the k, the crossing one in
            assert n == int(((probs.cumsum(0) - probs) < top_p).sum())
            assert torch.isneginf(lps[t, n:]).all()
            cut, whole = cut + (n < 8), whole + (n == 8)
        torch.testing.assert_close(s.aux[:, 0], got.hidden_states[2][0], atol=1e-5, rtol=1e-5)  # layer 1's output
    assert cut and whole  # the nucleus cut some rows short and left others whole: the test saw both
    assert verify_in(hs_project).ok  # verify recomputes the states beside the policy


def test_the_policy_alone_stores_no_states_and_a_states_export_says_so(hs_project):
    hs_project.set("hidden_states.drafters", [])
    hs_project.set("hidden_states.policy_top_k", 20)
    hs_project.run("hidden_states", "B3")
    out = hs_project.data("B3") / "hidden_states"
    m, index = hs_metrics(hs_project), json.loads((out / "index.json").read_text())
    assert index["states"] is False and index["layers"]["physical"] == []
    assert "final_hidden_states" not in index["tensors"]
    assert 164 <= m["bytes_per_token"] <= 1.1 * 164 and m["limit_bytes_per_token"] == 160  # the id + 20 slots of 8
    for shard in (out / "shards").iterdir():
        from safetensors import safe_open

        with safe_open(str(shard), framework="pt") as f:
            assert "final_hidden_states" not in f.keys() and f.get_slice("aux_hidden_states").get_shape()[1] == 0
    s = HiddenStates(out)[0]
    assert s.final_pre_norm is None and s.policy[0].shape == (len(s.input_ids), 20)
    with pytest.raises(UserError, match="holds the target's policy alone .*, no states to verify"):
        verify_in(hs_project)
    refused = "hidden_states.drafters: is empty for the states at .*: the capture holds the target.s policy alone"
    with pytest.raises(ConfigError, match=refused):
        hs_project.run("export", "B3", "export.format=speculators")


def test_fp8_halves_the_bytes_and_reports_its_error(hs_project):
    hs_project.set("hidden_states.dtype", "bfloat16")
    hs_project.run("hidden_states", "B3")
    bf16 = hs_metrics(hs_project)
    ref = read_all(hs_project.data("B3") / "hidden_states")
    hs_project.set("hidden_states.dtype", "fp8")
    hs_project.run("hidden_states", "B3")
    fp8 = hs_metrics(hs_project)
    assert fp8["computed_samples"] == fp8["samples"] == bf16["samples"]  # another dtype: other states
    assert fp8["bytes_per_token"] <= 0.55 * bf16["bytes_per_token"]
    assert bf16["bytes_per_token"] <= 1.02 * bf16["limit_bytes_per_token"]
    assert 0 < fp8["fp8_rel_err"] < 0.05
    for (_, _, _, aux, final), s in zip(ref, HiddenStates(hs_project.data("B3") / "hidden_states")):
        assert torch.linalg.vector_norm(s.aux - aux) / torch.linalg.vector_norm(aux) < 0.05
        assert torch.linalg.vector_norm(s.final_pre_norm - final) / torch.linalg.vector_norm(final) < 0.05
    # what a token of training signal costs on disk: the bytes per token as stored over the share the loss mask
    # trains, as stored and in bf16 and fp8 (3 layers + the final state, H = 64, the token's id); online: nothing
    masks = pq.read_table(hs_project.data("B3") / "samples.parquet", columns=["loss_mask"]).column(0).to_pylist()
    trained = sum(map(sum, masks))
    share = trained / fp8["tokens"]
    assert fp8["trained_tokens"] == bf16["trained_tokens"] == trained and 0 < share < 0.5
    expected = {"bfloat16": round((8 * 64 + 4) / share), "fp8": round((4 * 68 + 4) / share)}
    expected |= {"policy": round((20 * 8 + 4) / share), "online": 0}  # ModelOpt's top-20 policy alone
    assert fp8["per_trained_token"] == bf16["per_trained_token"] == expected
    for m in (bf16, fp8):
        assert m["bytes_per_trained_token"] == pytest.approx(m["bytes_per_token"] / share, abs=0.1)
    assert expected["bfloat16"] <= bf16["bytes_per_trained_token"] <= 1.02 * expected["bfloat16"]  # + headers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_shard_pack_unpack_round_trip(tmp_path, dtype):
    from draftdata.hidden.shards import SampleStates, ShardReader, torn, write

    g = torch.Generator().manual_seed(0)
    samples = [
        SampleStates(f"k{i}", list(range(n)), torch.randn(n, 3, 16, generator=g) * 5, torch.randn(n, 16, generator=g))
        for i, n in enumerate([3, 17, 1, 40])
    ]
    path = tmp_path / "s.safetensors"
    write(path, samples, dtype, {"x": 1})
    assert not torn(path)
    reader = ShardReader(path)
    assert reader.meta["keys"] == ["k0", "k1", "k2", "k3"] and reader.meta["settings"] == {"x": 1}
    tol = {"float32": 0.0, "bfloat16": 1e-2, "fp8": 7e-2}[dtype]
    for row, s in enumerate(samples):
        ids, aux, final = reader.sample(row)
        assert ids.tolist() == s.input_ids and aux.shape == s.aux.shape and final.shape == s.final.shape
        for got, want in ((aux, s.aux), (final, s.final)):
            assert torch.linalg.vector_norm(got - want) <= tol * torch.linalg.vector_norm(want)
    with open(path, "r+b") as f:  # cut short, as by a kill in the middle of a copy
        f.truncate(path.stat().st_size - 10)
    assert torn(path)


def shard_samples(lengths: list[int], seed: int = 0) -> list:
    from draftdata.hidden.shards import SampleStates

    g = torch.Generator().manual_seed(seed)
    return [
        SampleStates(
            f"k{i}", list(range(n)), torch.randn(n, 3, 16, generator=g).bfloat16(), torch.randn(n, 16, generator=g)
        )
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_a_shard_is_the_same_safetensors_file_with_o_direct_and_through_the_page_cache(tmp_path, monkeypatch, dtype):
    """The shard's image goes out with O_DIRECT where the file system takes it; where it refuses (EINVAL, as tmpfs
    does) the same bytes go through the page cache. Either file is what safetensors itself reads, with the same
    tensors as safetensors' own writer would have stored."""
    import errno
    import os

    from safetensors.torch import load_file, save_file

    from draftdata.hidden.shards import pack, torn, write

    samples = shard_samples([3, 17, 1, 40, 999])
    opened: list[int] = []
    real_open = os.open

    def recording_open(path, flags, *a):
        opened.append(flags)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", recording_open)
    write(tmp_path / "direct.safetensors", samples, dtype, {"x": 1})
    assert any(flags & os.O_DIRECT for flags in opened)  # tried first

    def refusing_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refusing_open)
    write(tmp_path / "cached.safetensors", samples, dtype, {"x": 1})
    direct, cached = (tmp_path / f"{n}.safetensors" for n in ("direct", "cached"))
    assert direct.read_bytes() == cached.read_bytes() and not torn(direct)
    monkeypatch.setattr(os, "open", real_open)
    theirs = {k: torch.cat(v) for k, v in pack(samples, dtype).items()}
    save_file(theirs, tmp_path / "theirs.safetensors")
    ours = load_file(direct)
    assert ours.keys() == theirs.keys()
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k].view(torch.uint8), t.view(torch.uint8)), k


def test_a_kept_buffer_writes_a_small_shard_after_a_big_one(tmp_path):
    """The writer keeps one buffer for every shard: a shard after a bigger one is cut to its own size, and none of
    the bigger one's bytes are in it."""
    from draftdata.hidden.shards import ShardBuffer, ShardReader, torn, write

    buffer = ShardBuffer()
    big, small = shard_samples([500, 700], seed=1), shard_samples([5, 9], seed=2)
    write(tmp_path / "big.safetensors", big, "bfloat16", {}, buffer=buffer)
    size = write(tmp_path / "small.safetensors", small, "bfloat16", {}, buffer=buffer)
    alone = write(tmp_path / "alone.safetensors", small, "bfloat16", {})
    buffer.close()
    assert (
        size == alone and (tmp_path / "small.safetensors").read_bytes() == (tmp_path / "alone.safetensors").read_bytes()
    )
    assert not torn(tmp_path / "small.safetensors")
    reader = ShardReader(tmp_path / "small.safetensors")
    for row, s in enumerate(small):
        ids, aux, _ = reader.sample(row)
        assert ids.tolist() == s.input_ids and torch.equal(aux.bfloat16(), s.aux)


def test_a_budget_round_trip_recomputes_nothing(hs_project):
    hs_project.run("hidden_states", "B3")
    first = hs_metrics(hs_project)
    assert first["computed_samples"] == first["samples"] > 5 and first["load_s"] > 0
    index = (hs_project.data("B3") / "hidden_states" / "index.json").read_bytes()
    # the budget goes down and back up: generate reuses its store, hidden_states its own
    before = read_all(hs_project.data("B3") / "hidden_states")
    hs_project.set("datasets.B3.token_budget", 600)  # fewer samples
    for stage in ("generate", "tokenize", "hidden_states"):
        hs_project.run(stage, "B3")
    lower = hs_metrics(hs_project)
    assert lower["computed_samples"] == 0 and 0 < lower["samples"] < first["samples"]
    assert lower["load_s"] == 0  # every state reused: the target was never loaded
    # the shards now hold more samples than this output uses: bytes per token is still the shards' own (up to the
    # headers' share where the output uses some of the shards), not the shards' bytes over the output's tokens
    assert lower["bytes_per_token"] == pytest.approx(first["bytes_per_token"], rel=1e-3)
    hs_project.set("datasets.B3.token_budget", 1500)  # and back
    for stage in ("generate", "tokenize", "hidden_states"):
        hs_project.run(stage, "B3")
    again = hs_metrics(hs_project)
    assert again["computed_samples"] == 0 and again["samples"] == first["samples"]
    after = read_all(hs_project.data("B3") / "hidden_states")
    for a, b in zip(before, after):
        assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))
    # the output holds hard links into the store: the states are on disk once
    shard = next((hs_project.data("B3") / "hidden_states" / "shards").iterdir())
    assert shard.stat().st_nlink >= 2
    # the same samples computed afresh in another store: the same index, shard names included (named by their
    # samples, not at random), so a second fresh run writes the same bytes
    hs_project.params["run"]["store_path"] = str(hs_project.path / "fresh" / "store.sqlite")
    hs_project.save()
    hs_project.run("hidden_states", "B3")
    assert hs_metrics(hs_project)["computed_samples"] == first["samples"]
    assert (hs_project.data("B3") / "hidden_states" / "index.json").read_bytes() == index


def store_shards(project: Project) -> int:
    db = project.path / "store" / "states" / "index.sqlite"
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db, timeout=1) as con:
            return con.execute("SELECT COUNT(*) FROM shards").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def stage_with_shards(project: Project, shards: int) -> subprocess.Popen:
    """The stage in a process of its own, once `shards` shards are in the store: a shard and a forward per sample,
    so that a signal sent now lands mid-run."""
    project.set("hidden_states.shard_max_tokens", 1)
    project.set("hidden_states.batch_tokens", 1)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stages.hidden_states", "dataset=B3"],
        cwd=project.path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while store_shards(project) < shards:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return proc


def test_kill_mid_run_then_resume(hs_project, samples_dir, tmp_path):
    proc = stage_with_shards(hs_project, 3)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    done = store_shards(hs_project)
    total = pq.read_metadata(hs_project.data("B3") / "samples.parquet").num_rows
    assert 3 <= done < total  # killed mid-run
    hs_project.run("hidden_states", "B3")
    m = hs_metrics(hs_project)
    assert m["computed_samples"] == total - done and m["reused_samples"] == done
    # equal to a run that was never killed
    (tmp_path / "clean").mkdir()
    clean = Project(tmp_path / "clean", json.loads(json.dumps(hs_project.params)))
    shutil.copytree(hs_project.path / "data", clean.path / "data", ignore=shutil.ignore_patterns("hidden_states*"))
    clean.params["run"]["store_path"] = str(clean.path / "store" / "store.sqlite")
    clean.save()
    os.chdir(clean.path)
    clean.run("hidden_states", "B3")
    for a, b in zip(read_all(hs_project.data("B3") / "hidden_states"), read_all(clean.data("B3") / "hidden_states")):
        assert a[0] == b[0] and all(torch.allclose(x.float(), y.float(), atol=1e-5) for x, y in zip(a[1:], b[1:]))


def store_samples(project: Project) -> int:
    with sqlite3.connect(project.path / "store" / "states" / "index.sqlite") as con:
        return con.execute("SELECT COUNT(*) FROM states").fetchone()[0]


def test_sigterm_keeps_every_sample_computed_before_it(hs_project, monkeypatch):
    """A real SIGTERM in the middle of the third forward: the two batches before it were in memory only (the shard
    was far from full), and are written and indexed on the way out; the rerun computes just the rest."""
    from draftdata.hidden.engines.hf import HFEngine

    hs_project.set("hidden_states.batch_tokens", 1)  # a forward per sample
    hs_project.set("hidden_states.shard_max_tokens", 10**9)  # no shard fills up: all would be in memory
    real, calls = HFEngine.forward, []

    def forward(self, batch):
        calls.append(len(batch))
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler interrupts this
        return real(self, batch)

    monkeypatch.setattr(HFEngine, "forward", forward)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        hs_project.run("hidden_states", "B3")
    assert signal.getsignal(signal.SIGTERM) is before  # the stage's handler does not outlive it
    assert store_samples(hs_project) == 2 and store_shards(hs_project) == 1
    monkeypatch.setattr(HFEngine, "forward", real)
    hs_project.run("hidden_states", "B3")
    m = hs_metrics(hs_project)
    assert m["reused_samples"] == 2 and m["computed_samples"] == m["samples"] - 2


def test_an_interrupted_stage_says_so_in_one_line(hs_project):
    """From the command line, SIGINT while the target computes: one line, exit status 130, what was computed kept."""
    proc = stage_with_shards(hs_project, 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("interrupted: ")
    assert "Traceback" not in err
    assert store_samples(hs_project) >= 2


def test_a_torn_shard_is_detected_and_redone(hs_project):
    hs_project.run("hidden_states", "B3")
    before = read_all(hs_project.data("B3") / "hidden_states")
    tear(sorted((hs_project.path / "store" / "states").rglob("*.safetensors"))[0])
    hs_project.run("hidden_states", "B3")
    m = hs_metrics(hs_project)
    assert m["torn_shards_redone"] == 1 and 0 < m["computed_samples"] < m["samples"]
    after = read_all(hs_project.data("B3") / "hidden_states")
    for a, b in zip(before, after):
        assert a[0] == b[0] and all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a[1:], b[1:]))


def test_non_finite_states_stop_with_the_sample_id(hs_project, monkeypatch):
    from draftdata.hidden.engines.hf import HFEngine

    real = HFEngine.forward

    def poisoned(self, batch):
        out = real(self, batch)
        out[-1][0][0, 0, 0] = float("nan")
        return out

    monkeypatch.setattr(HFEngine, "forward", poisoned)
    with pytest.raises(UserError) as err:
        hs_project.run("hidden_states", "B3")
    ids = set(pq.read_table(hs_project.data("B3") / "samples.parquet", columns=["id"]).column(0).to_pylist())
    message = str(err.value)
    assert "non-finite" in message and "\n" not in message
    assert any(f"sample {i}:" in message for i in ids)
    assert store_shards(hs_project) == 0  # nothing of that batch was written


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_non_finite_value_anywhere_is_found(dtype, bad):
    """The check reads min and max (NaN and inf carry through both): one bad value at the start, the middle or the
    end of a sample, or of one layer of a batch as the engine slices it, is found; an empty sample passes."""
    from draftdata.hidden.shards import SampleStates, StateError, check, finite

    g = torch.Generator().manual_seed(0)
    for n in (1, 33, 4097):
        for at in (0, n // 2, n - 1):
            batch = (torch.randn(2, n, 3, 17, generator=g) * 100).to(dtype)  # [B, W, k, H], as the engine stacks
            assert finite(batch[1])
            batch[1, at, 2, 16] = bad
            assert not finite(batch[1]) and not finite(batch[1, :, 2]) and finite(batch[1, :, 0]) and finite(batch[0])
            with pytest.raises(StateError, match="sample s1: non-finite values in its aux"):
                check([SampleStates("k1", list(range(n)), batch[1], batch[1, :, 0])], {"k1": "s1"})
    assert finite(torch.empty(0, 3, 17, dtype=dtype))


def torchrun_stage(project: Project, ranks: int = 2) -> subprocess.CompletedProcess:
    """The stage under torchrun, `ranks` processes on this machine (gloo on a CPU)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    cmd += ["--master_port", str(free_port()), "-m", "stages.hidden_states", "dataset=B3"]
    proc = subprocess.run(cmd, cwd=project.path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def tear(shard: Path) -> None:
    """Cut a store shard short in the store's place (the output's hard link keeps the old inode)."""
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data[: len(data) // 2])


def test_two_torchrun_ranks_equal_one_process(hs_project, samples_dir, tmp_path):
    proc = torchrun_stage(hs_project)
    # each rank's closing line, whole: both ranks write to one pipe, each line in one write
    closing = re.findall(
        r"^hidden_states dataset=B3 rank=(\d) samples=(\d+) computed=(\d+) reused=(-?\d+) ", proc.stdout, re.M
    )
    assert sorted(r for r, *_ in closing) == ["0", "1"], proc.stdout[-3000:]
    total = pq.read_metadata(hs_project.data("B3") / "samples.parquet").num_rows
    shares = [tuple(map(int, counts)) for _, *counts in closing]
    # disjoint halves, all covered; each rank computed its own share (an empty store) and reused none
    assert sum(s for s, _, _ in shares) == total and all(s == c > 0 and r == 0 for s, c, r in shares), closing
    # the metrics rank 0 writes count the whole job, not rank 0's half
    m = json.loads((hs_project.data("B3") / "hidden_states_metrics.json").read_text())
    assert m["samples"] == m["computed_samples"] == total and m["reused_samples"] == 0
    assert m["computed_tokens"] == m["tokens"]
    two = read_all(hs_project.data("B3") / "hidden_states")
    # a torn shard, met by both ranks (each checks every shard it finds, the other's samples' too): redone, and
    # counted once for the job
    tear(sorted((hs_project.path / "store" / "states").rglob("*.safetensors"))[0])
    torchrun_stage(hs_project)
    m = json.loads((hs_project.data("B3") / "hidden_states_metrics.json").read_text())
    assert m["torn_shards_redone"] == 1 and 0 < m["computed_samples"] < total
    for a, b in zip(two, read_all(hs_project.data("B3") / "hidden_states")):
        assert a[0] == b[0] and all(torch.allclose(x.float(), y.float(), atol=1e-5) for x, y in zip(a[1:], b[1:]))
    # one process, another store
    hs_project.params["run"]["store_path"] = str(tmp_path / "one" / "store.sqlite")
    hs_project.save()
    hs_project.run("hidden_states", "B3")
    one = read_all(hs_project.data("B3") / "hidden_states")
    assert len(one) == len(two) == total
    for a, b in zip(one, two):
        assert a[0] == b[0] and all(torch.allclose(x.float(), y.float(), atol=1e-5) for x, y in zip(a[1:], b[1:]))


ADD_UP = """
import json
from dataclasses import asdict
from draftdata.hidden.ranks import Rank, join_group, leave_group
from draftdata.hidden.tally import HiddenTally

rank = Rank.from_env()
join_group(rank, gpu=False)
r = rank.rank
mine = HiddenTally(owned=3 + r, computed=2 + r, computed_tokens=10 + r, pad_tokens=r, torn=1 + r, seconds=1.0 + r,
                   fp8_err_num=0.5, fp8_err_den=2.0)
print(json.dumps(asdict(rank.add_up(mine))))
leave_group()
"""


def test_the_jobs_tally_sums_every_count_of_every_rank():
    """Two real ranks (gloo, as torchrun's on a CPU) add up their tallies: every count summed, the torn shards each
    rank forgot among them, the time the longest rank's; both ranks get the same."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ADD_UP],
            env=dict(
                os.environ,
                PYTHONPATH=str(ROOT),
                CUDA_VISIBLE_DEVICES="",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                WORLD_SIZE="2",
                RANK=str(r),
                LOCAL_RANK=str(r),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    totals = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    assert totals[0] == totals[1]
    t = totals[0]
    assert (t["owned"], t["computed"], t["computed_tokens"], t["pad_tokens"], t["torn"]) == (7, 5, 21, 1, 3)
    assert (t["seconds"], t["fp8_err_num"], t["fp8_err_den"]) == (2.0, 1.0, 4.0)


def test_layers_from_a_draft_config_in_either_numbering(hs_project, tmp_path):
    from draftdata.config.load import load_config
    from draftdata.drafters.layers import resolve_layers

    def layers(doc: dict, numbering: str = "auto"):
        path = tmp_path / "draft.json"
        path.write_text(json.dumps(doc))
        cfg = load_config(
            "B3",
            [f"hidden_states.draft_config={path}", f"hidden_states.draft_numbering={numbering}"],
            params_path=hs_project.path / "params.yaml",
        )
        return resolve_layers(cfg, 8)

    speculators = {"speculators_config": {}, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    specforge = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    assert layers(speculators) == layers(specforge) == [1, 3, 4]  # vLLM numbering is physical + 1
    assert layers({"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}, "vllm") == [1, 3, 5]
    with pytest.raises(ConfigError, match="hidden_states.draft_numbering"):
        layers({"eagle_aux_hidden_state_layer_ids": [2, 4, 6]})
    with pytest.raises(ConfigError, match="out of range"):
        layers({"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}, "sglang")


def test_default_layers_that_collide_are_refused_about_the_model(hs_project):
    from draftdata.config.load import load_config
    from draftdata.drafters.layers import resolve_layers

    cfg = load_config("B3", [], params_path=hs_project.path / "params.yaml")
    with pytest.raises(UserError) as err:
        resolve_layers(cfg, 5)
    message = str(err.value)
    assert message.startswith("model.path:") and "5 decoder layers" in message and "hidden_states.layers" in message
    assert resolve_layers(cfg, 8) == [1, 3, 4]


def test_vllm_extraction_layer_ids_and_where_each_layer_is_read():
    """vLLM's extraction numbers a layer's output L + 1 and returns its layers in ascending order; the last layer's
    output (id N) is the pre-norm final state, asked for even when no aux layer is the last."""
    from draftdata.hidden.engines.vllm_worker import extract_layer_ids

    assert extract_layer_ids([1, 3, 4], 8) == [2, 4, 5, 8]
    assert extract_layer_ids([1, 3, 4, 7], 8) == [2, 4, 5, 8]  # the last layer is the final state: asked once
    assert extract_layer_ids([4, 1], 8) == [2, 5, 8]


def fake_vllm(monkeypatch, started: list):
    """A stand-in for the `vllm` module whose LLM records its arguments: for the path choice, which runs before
    anything of vLLM's model is touched."""
    import types

    class LLM:
        def __init__(self, **kwargs):
            started.append(kwargs)

        def collective_rpc(self, name, args=()):
            return [{"n_layers": 8, "mode": "aux", "rpc": name}]

    module = types.ModuleType("vllm")
    module.LLM = LLM
    monkeypatch.setitem(sys.modules, "vllm", module)


@pytest.mark.parametrize(
    "platform, forced, expect",
    [("cuda", False, None), ("cpu", True, None), ("cpu", False, "CPU build"), ("tpu", True, "platform is tpu")],
)
def test_auto_takes_vllms_extraction_only_where_its_own_connector_runs(monkeypatch, platform, forced, expect):
    """On the CPU build the extraction needs draftdata's connector (tied to vLLM's internals as they are): auto
    takes the hooks there, a forced extract still runs it."""
    import importlib.util
    import types

    from draftdata.hidden.engines import vllm_worker as w

    current = types.SimpleNamespace(
        is_cuda_alike=lambda: platform == "cuda", is_cpu=lambda: platform == "cpu", device_name=platform
    )
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=current))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # this vLLM has the method
    why = w.extract_unavailable(forced=forced)
    assert why is None if expect is None else expect in why


def test_vllm_auto_path_falls_back_to_the_hooks_and_says_why(monkeypatch, capsys):
    """auto: extract when vLLM can run it, the hook path (with the reason) when it cannot start or is absent;
    extract forced: one error with the reason; hook forced: the extraction is never tried."""
    from types import SimpleNamespace

    from draftdata.hidden.engines import vllm_worker as w

    started: list = []
    fake_vllm(monkeypatch, started)
    target = SimpleNamespace(max_model_len=4096, get_total_num_hidden_layers=lambda: 8)
    monkeypatch.setattr(w, "target_config", lambda settings: target)
    monkeypatch.setattr(w, "extract_unavailable", lambda forced=False: None)

    def extraction_fails(*args):
        raise RuntimeError("Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested")

    monkeypatch.setattr(w, "start_extract", extraction_fails)
    settings = {"model": "m", "layers": [1, 3], "tensor_parallel_size": 1, "max_batch_tokens": 512, "norm_file": "n"}
    run, info = w.start(dict(settings, path="auto"))
    assert isinstance(run, w.HookRun) and info["path"] == "hook" and info["rpc"] == "draftdata_install"
    assert "does not support EAGLE3" in info["fallback"] and "the hook path runs" in capsys.readouterr().err
    assert "speculative_config" not in started[-1]
    with pytest.raises(RuntimeError, match="does not support EAGLE3"):
        w.start(dict(settings, path="extract"))
    monkeypatch.setattr(w, "extract_unavailable", lambda forced=False: "this vLLM has no extract_hidden_states method")
    with pytest.raises(RuntimeError, match="vllm_path is extract, but this vLLM has no extract_hidden_states"):
        w.start(dict(settings, path="extract"))
    monkeypatch.setattr(
        w, "extract_unavailable", lambda forced=False: pytest.fail("hook must not consider the extraction")
    )
    run, info = w.start(dict(settings, path="hook"))
    assert info["path"] == "hook" and info["fallback"] is None
    with pytest.raises(ValueError, match=r"hidden_states.layers: layer ids \[8\] out of range for a 8-layer"):
        w.start(dict(settings, layers=[1, 8]))


def test_the_decoder_is_found_inside_a_multimodal_wrapper():
    """A vision-language wrapper (as large targets often are) exposes its text decoder through get_decoder(): its
    layers and final norm are found, and the norm's formula is checked against the module itself."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from draftdata.hidden.engines.hf import final_norm_of
    from draftdata.model.load import find_decoder

    text = LlamaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, vocab_size=512
    )
    vision = CLIPVisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=16
    )
    model = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision)).eval()
    decoder = find_decoder(model)
    assert len(decoder.layers) == 4 and decoder is model.get_decoder()
    norm = final_norm_of(decoder.norm)
    x = torch.randn(3, 64)
    torch.testing.assert_close(norm.apply(x), decoder.norm(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "module", ["qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm", "llama.modeling_llama.LlamaRMSNorm"]
)
def test_a_final_norm_scaled_by_one_plus_its_weight_is_read_as_such(module):
    """Qwen3-Next and Qwen3.5 (the targets that ship MTP weights) scale by 1 + weight, Llama by weight: each norm's
    parameters are read with the offset that reproduces the module, whatever its class is called."""
    import importlib

    path, name = module.rsplit(".", 1)
    norm = getattr(importlib.import_module(f"transformers.models.{path}"), name)(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64) * 0.1)
    from draftdata.hidden.engines.hf import final_norm_of

    spec = final_norm_of(norm)
    assert spec.weight_offset == (1.0 if "Qwen3Next" in name else 0.0)
    x = torch.randn(3, 64)
    torch.testing.assert_close(spec.apply(x), norm(x), atol=1e-6, rtol=1e-6)


def test_device_map_gives_the_same_states(tiny_model):
    """`hidden_states.device_map` (accelerate's dispatch, for a target bigger than one GPU) computes the same states;
    on the CPU "auto" places every layer there."""
    from draftdata.config.schema import ModelConfig
    from draftdata.hidden.engines.hf import HFEngine

    batch = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    plain = HFEngine(ModelConfig(path=str(tiny_model)), [1, 3, 4]).forward(batch)
    mapped = HFEngine(ModelConfig(path=str(tiny_model)), [1, 3, 4], device_map="auto").forward(batch)
    for (a, f), (b, g) in zip(plain, mapped):
        assert torch.equal(a, b) and torch.equal(f, g)


class OnAnotherDevice(torch.Tensor):
    """A tensor on torch's meta device (no data) whose copy to the host gives the values it stands for: a layer's
    output left on a second GPU, on a machine without one."""

    def cpu(self, *args, **kwargs):
        return self.host

    def to(self, *args, **kwargs):
        return self.host.to(*args, **kwargs)


def test_layers_captured_on_two_devices_are_returned_on_the_cpu(tiny_model):
    """`device_map: auto` over several GPUs leaves each captured layer's output on its layer's GPU: layer 3's faked
    onto another device here, the engine still stacks the layers and returns the same states, on the CPU."""
    from draftdata.config.schema import ModelConfig
    from draftdata.hidden.engines.hf import HFEngine

    batch = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    plain = HFEngine(ModelConfig(path=str(tiny_model)), [1, 3, 4]).forward(batch)
    engine = HFEngine(ModelConfig(path=str(tiny_model)), [1, 3, 4])

    def elsewhere(_module, _inputs):  # before the final norm: every layer has run, layer 3's output is kept
        host = engine._out[3]
        engine._out[3] = torch.Tensor._make_subclass(OnAnotherDevice, torch.empty_like(host, device="meta"))
        engine._out[3].host = host

    engine.decoder.norm.register_forward_pre_hook(elsewhere)
    split = engine.forward(batch)
    for (a, f), (b, g) in zip(plain, split):
        assert type(b) is torch.Tensor and b.device.type == "cpu"
        assert torch.equal(a, b) and torch.equal(f, g)


def test_unsorted_layers_are_stored_in_ascending_order(hs_project, tiny_model, capsys):
    """SGLang and vLLM collect the aux states in ascending layer order inside the forward, whatever order the ids
    come in: `hidden_states.layers: [5, 1, 3]` is stored and indexed as [1, 3, 5] (the list as given kept beside),
    with a line saying so; a draft config's unsorted ids likewise."""
    from transformers import AutoModelForCausalLM

    from draftdata.config.load import load_config
    from draftdata.drafters.layers import resolve_layers

    hs_project.set("hidden_states.layers", [5, 1, 3])
    hs_project.run("hidden_states", "B3")
    assert "hidden_states layers=[1, 3, 5] given=[5, 1, 3] note=hidden_states.layers sorted" in capsys.readouterr().out
    out = hs_project.data("B3") / "hidden_states"
    index = json.loads((out / "index.json").read_text())
    assert index["layers"]["physical"] == [1, 3, 5] and index["layers"]["vllm_speculators"] == [2, 4, 6]
    assert index["layers_as_given"] == [5, 1, 3]
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    for s in list(HiddenStates(out))[:3]:
        with torch.inference_mode():
            hs = model(input_ids=s.input_ids.unsqueeze(0), output_hidden_states=True).hidden_states
        expected = torch.stack([hs[layer + 1][0] for layer in (1, 3, 5)], dim=1)
        torch.testing.assert_close(s.aux, expected, atol=1e-5, rtol=1e-5)

    draft = hs_project.path / "draft.json"
    draft.write_text(json.dumps({"speculators_config": {}, "eagle_aux_hidden_state_layer_ids": [6, 2, 4]}))
    cfg = load_config(
        "B3",
        ["hidden_states.layers=null", f"hidden_states.draft_config={draft}"],
        params_path=hs_project.path / "params.yaml",
    )
    assert resolve_layers(cfg, 8) == [1, 3, 5]


def test_every_file_produced_gets_the_umask_mode(hs_project):
    """Outputs on a shared cluster must be readable by whoever the umask lets read them (temp files start 0600)."""
    from draftdata.util.files import FILE_MODE

    hs_project.run("hidden_states", "B3")
    umask = os.umask(0o022)
    os.umask(umask)
    assert FILE_MODE == 0o666 & ~umask
    files = [p for root in (hs_project.data("B3"), hs_project.path / "store") for p in root.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files) and any(p.name == "index.json" for p in files)
    wrong = {
        str(p.relative_to(hs_project.path)): oct(p.stat().st_mode & 0o777)
        for p in files
        if p.stat().st_mode & 0o777 != FILE_MODE
    }
    assert not wrong


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_temp_files_of_killed_writers_are_swept_where_they_are_written(tmp_path):
    """A kill mid-write leaves a temp file: the next write of that output removes it, and the state store removes
    the half-written shards in its settings folders, where shards are written; a live writer's are kept."""
    from draftdata.hidden.state_store import StateStore
    from draftdata.util.files import HOST, atomic_path

    dead, alive = dead_pid(), os.getpid()
    out = tmp_path / "responses.jsonl"
    left = tmp_path / f".responses.jsonl.{HOST}.{dead}.abc123.tmp"
    live = tmp_path / f".responses.jsonl.{HOST}.{alive}.def456.tmp"
    other = tmp_path / f".samples.parquet.{HOST}.{dead}.abc123.tmp"
    for f in (left, live, other):
        f.write_text("half")
    with atomic_path(out) as tmp:
        tmp.write_text("whole")
    assert out.read_text() == "whole" and not left.exists() and live.exists() and other.exists()

    root = tmp_path / "states"
    shards = root / "0123456789abcdef"  # StateStore.new_shard_name: <settings hash>/<hash of its keys>.safetensors
    shards.mkdir(parents=True)
    killed = shards / f".{'a' * 32}.safetensors.{HOST}.{dead}.x1y2z3.tmp"
    writing = shards / f".{'b' * 32}.safetensors.{HOST}.{alive}.x1y2z3.tmp"
    foreign = shards / f".{'c' * 32}.safetensors.otherhost.{alive}.x1y2z3.tmp"  # a shared disk's other host
    old = shards / f".{'d' * 32}.safetensors.otherhost.{alive}.x1y2z3.tmp"
    for f in (killed, writing, foreign, old):
        f.write_bytes(b"half")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    StateStore(root).close()
    assert not killed.exists() and writing.exists() and foreign.exists() and not old.exists()


class InterruptedAfterBegin:
    """A store's connection that takes a Ctrl-C as its next transaction begins: BEGIN runs, then KeyboardInterrupt,
    as when SIGINT lands between the statement and the next line (once seen killing a stage: exit 1, a traceback)."""

    def __init__(self, db: sqlite3.Connection):
        self.db, self.armed = db, True

    def execute(self, sql: str, *args):
        out = self.db.execute(sql, *args)
        if self.armed and sql.startswith("BEGIN"):
            self.armed = False
            raise KeyboardInterrupt
        return out

    def __getattr__(self, name: str):
        return getattr(self.db, name)


def test_a_ctrl_c_as_a_transaction_begins_leaves_both_stores_writable(tmp_path):
    from draftdata.generate.store import ResponseStore, StoredResponse
    from draftdata.hidden.state_store import StateStore

    states = StateStore(tmp_path / "states")
    real, states.db = states.db, InterruptedAfterBegin(states.db)
    with pytest.raises(KeyboardInterrupt):
        states.add_shard("h/a.safetensors", "h", ["k1"], [3], 10, "hf")
    assert not real.in_transaction
    states.add_shard("h/a.safetensors", "h", ["k1"], [3], 10, "hf")  # on the way out: what was written is indexed
    assert set(states.lookup(["k1"])) == {"k1"}

    responses = ResponseStore(tmp_path / "store.sqlite")
    real, responses.db = responses.db, InterruptedAfterBegin(responses.db)
    with pytest.raises(KeyboardInterrupt):
        responses.put_many([StoredResponse("r1", "D", "p1", "hi", 2, 2, "stop", "s", 0.1, [1, 2], [3, 4])])
    assert not real.in_transaction
    responses.put_many([StoredResponse("r1", "D", "p1", "hi", 2, 2, "stop", "s", 0.1, [1, 2], [3, 4])])
    assert set(responses.get_many(["r1"])) == {"r1"}


def test_a_ctrl_c_while_a_shard_is_indexed_keeps_it_for_the_way_out(tmp_path):
    """The writer's shard in flight stays pending when Ctrl-C lands as it is indexed: `close` indexes it."""
    from draftdata.hidden.state_store import StateStore
    from draftdata.hidden.writer import ShardWriter

    store = StateStore(tmp_path / "states")
    store.db = InterruptedAfterBegin(store.db)
    writer = ShardWriter(store, {"x": 1}, "bfloat16", background=True)
    samples = shard_samples([4, 7])
    writer.submit(samples, "hf")
    with pytest.raises(KeyboardInterrupt):
        writer.wait()
    writer.close()
    found = store.lookup([s.key for s in samples])
    assert set(found) == {"k0", "k1"} and store.path(found["k0"].shard).exists()


def test_a_ctrl_c_as_the_shard_buffer_is_closed_leaves_it_usable_on_the_way_out():
    """Growing the shard buffer closes the old map; a Ctrl-C as that close returns must not leave the closed map
    held, or the way out (which writes the shard buffered so far) fails on it (once seen: exit 1, a traceback)."""
    from draftdata.hidden.shards import ShardBuffer

    class InterruptedClose:  # the old map, closed, then the interrupt
        def __init__(self, m):
            self.m = m

        def __len__(self):
            return len(self.m)  # ValueError once closed, as the map's own

        def close(self):
            self.m.close()
            raise KeyboardInterrupt

    buffer = ShardBuffer()
    buffer._map = InterruptedClose(buffer.get(1))
    with pytest.raises(KeyboardInterrupt):
        buffer.get(1 << 20)
    assert len(buffer.get(1 << 16)) >= 1 << 16
    buffer.close()


def test_writers_of_one_file_never_delete_each_others_temp_files(tmp_path):
    """torchrun's ranks all write <hash>/final_norm.safetensors and target.json: a writer that starts while another
    holds its temp file must leave it, or the other dies renaming a file that is gone."""
    from draftdata.util.files import atomic_path

    out = tmp_path / "target.json"
    writer = f"from draftdata.util.files import write_json; write_json({str(out)!r}, {{'rank': 1}})"
    with atomic_path(out) as tmp:
        tmp.write_text('{"rank": 0}')
        subprocess.run([sys.executable, "-c", writer], check=True, cwd=ROOT)  # the other rank, meanwhile
        assert tmp.exists()
    assert json.loads(out.read_text()) == {"rank": 0} and not list(tmp_path.glob(".*.tmp"))


def test_an_output_is_held_whole_at_its_temp_name_only_by_the_kill_suite(tmp_path):
    """The kill suite's seam (bench/reliability/held.py): a stage run through it holds every output whole at its
    temp name before the rename; the product itself never waits."""
    from bench.reliability.held import publishes
    from draftdata.util import files

    assert "sleep" not in inspect.getsource(files.atomic_path)
    with files.atomic_path(tmp_path / "a.json") as tmp:  # what it holds: atomic_path's renames, no other
        tmp.write_text("{}")
        assert publishes(tmp, tmp_path / "a.json") and not publishes(tmp, tmp_path / "b.json")
    assert not publishes(tmp_path / ".export.partial", tmp_path / "export")
    probe = textwrap.dedent(
        f"""
        import json, os, sys, time
        from pathlib import Path
        from draftdata.util import files
        seen = []
        replace = os.replace
        def watch(src, dst, **kwargs):
            seen.append((json.loads(Path(src).read_text()), Path(dst).exists()))
            replace(src, dst, **kwargs)
        os.replace = watch
        t0 = time.monotonic()
        files.write_json({str(tmp_path / "out.json")!r}, {{"a": 1}})
        print(json.dumps([seen, time.monotonic() - t0]))
        """
    )
    (tmp_path / "probe.py").write_text(probe)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    held = subprocess.run(
        [sys.executable, "-m", "bench.reliability.held", "0.3", "probe"], env=env, capture_output=True, text=True
    )
    seen, seconds = json.loads(held.stdout.splitlines()[-1])
    assert seen == [[{"a": 1}, False]] and seconds >= 0.3  # whole at its temp name, the output not there yet


def test_hf_index_in_index_json_names_the_state_hf_returns(tiny_model):
    """Each HF index index.json gives for a captured layer is that layer's output in transformers' own
    hidden_states; the last layer's output (kept before the final norm) is none of them, so it gets none."""
    from transformers import AutoModelForCausalLM

    from draftdata.drafters.layers import layer_numberings

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    decoder = model.model.layers
    n = len(decoder)
    outputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(
            lambda _m, _i, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i, layer in enumerate(decoder)
    ]
    try:
        with torch.inference_mode():
            hs = model(input_ids=torch.tensor([[5, 17, 42, 99, 7]]), output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    layers = [0, 1, n - 2, n - 1]
    index = layer_numberings(layers, n)["hf_hidden_states_index"]
    assert index[-1] is None
    assert not torch.allclose(hs[n], outputs[n - 1])  # HF's last entry is post-norm: not the layer's output
    for layer, i in zip(layers[:-1], index[:-1]):
        torch.testing.assert_close(hs[i], outputs[layer])


# ---- draftdata verify: stored states recomputed and compared ------------------------------------------------------ #


def verify_in(project: Project, *overrides: str):
    from draftdata.cli.verify import main
    from draftdata.config.load import load_config

    return main(load_config("B3", list(overrides), params_path=project.path / "params.yaml"))


def verify_cli(project: Project, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "draftdata", "verify", "dataset=B3", *overrides]
    return subprocess.run(cmd, cwd=project.path, env=env, capture_output=True, text=True, timeout=300)


def test_spread_takes_the_shortest_the_longest_and_between():
    from draftdata.hidden.verify import spread

    lengths = [5, 1, 3, 9, 7, 3]
    assert spread(lengths, 3) == [1, 5, 3]  # 1, the median (3, tie to the later one by order), 9
    assert spread(lengths, 2) == [1, 3] and spread(lengths, 1) == [5]
    assert spread(lengths, 10) == [1, 2, 5, 0, 4, 3]  # all, shortest first


def test_a_damaged_value_is_an_infinite_error_not_a_small_one():
    from draftdata.hidden.verify import LayerError, row_errors

    fresh = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]])
    stored = torch.tensor([[3.0, 4.5], [float("nan"), 0.0], [0.0, 2.0]])
    errors = row_errors(stored, fresh)
    assert errors.tolist() == pytest.approx([0.1, float("inf"), 0.0])  # |(0, 0.5)| / |(3, 4)|
    layer = LayerError("layer 1")
    layer.add("s", errors)
    assert layer.max == float("inf") and layer.worst == "sample s, token 1"


def test_in_16_bits_a_sample_off_fails_verify_where_a_stray_token_does_not():
    """bf16 forwards leave single tokens far off in either engine (8 % between vLLM and hf on SmolLM2-135M), so
    verify judges each sample's mean error there, within eps x sqrt(depth): a sample 5 % off in a layer fails, one
    stray token does not. Float32 forwards judge each token: there the stray token fails."""
    from draftdata.hidden.verify import LayerError, Report, layer_tolerance

    def report(forward_dtype: str, errors) -> Report:
        layer = LayerError("layer 14", layer_tolerance(2e-2, forward_dtype, 15))
        layer.add("s", errors)
        return Report(Path("out"), "vllm", 1, "bfloat16", "float32", forward_dtype, 2e-2, 1, [("s", 300)], [layer])

    stray = torch.full((300,), 0.013)
    stray[42] = 0.08
    assert report("bfloat16", stray).ok
    assert report("bfloat16", stray).layers[0].tolerance == pytest.approx(2**-7 * 15**0.5)  # 0.030: 15 layers deep
    assert not report("bfloat16", torch.full((300,), 0.05)).ok
    assert not report("float32", stray).ok and report("float32", stray).layers[0].tolerance == 2e-2


def test_the_dtype_each_engine_computes_in():
    """hf computes in the dtype its shards name (model.compute_dtype, resolved), else the one it would compute in
    here; vLLM in its dtype option, by default the weights' but 16 bits for float32."""
    from draftdata.hidden.verify import forward_dtype

    assert forward_dtype("hf", "float32", {"dtype": "bfloat16"}) == "float32"  # vllm_kwargs are vLLM's alone
    assert forward_dtype("hf:float32", "bfloat16", {}) == "float32"  # a bf16 model computed in float32
    assert forward_dtype("hf", "bfloat16", {}, hf="float32") == "float32"
    assert forward_dtype("vllm", "float32", {}) == "bfloat16"  # auto: 16 bits for float32 weights
    assert forward_dtype("vllm:hook", "float32", {"dtype": "auto"}) == "bfloat16"
    assert forward_dtype("vllm", "float32", {"dtype": "float"}) == "float32"
    assert forward_dtype("vllm:extract", "bfloat16", {"dtype": "half"}) == "float16"
    assert forward_dtype("vllm", "bfloat16", {}) == forward_dtype("hf", "float8_e4m3fn", {}) == "bfloat16"


def test_verify_passes_on_the_stored_states(hs_project, capsys):
    """bf16 states computed by the stage in batches of up to 2048 padded tokens; hf recomputes three of them (the
    shortest, the median and the longest) one at a time: every layer within bf16's rounding."""
    hs_project.set("hidden_states.dtype", "bfloat16")
    hs_project.run("hidden_states", "B3")
    capsys.readouterr()
    report = verify_in(hs_project)
    lengths = pq.read_table(hs_project.data("B3") / "samples.parquet", columns=["n_tokens"]).column(0).to_pylist()
    assert [n for _, n in report.checked] == [min(lengths), sorted(lengths)[(len(lengths) - 1) // 2], max(lengths)]
    assert (
        report.ok
        and report.tolerance == 2e-2
        and (report.stored_dtype, report.computed_dtype)
        == (
            "bfloat16",
            "float32",
        )
    )
    assert [e.name for e in report.layers] == ["layer 1", "layer 3", "layer 4", "final (pre-norm)"]
    for e in report.layers:  # bf16 rounds each value by at most 2^-9: above zero, below that
        assert 0 < e.mean <= e.max < 2**-9 and e.tokens == sum(n for _, n in report.checked)
    out = capsys.readouterr().out
    print(out)
    assert f"3 of {len(lengths)} samples recomputed by hf at batch size 1 (returned as float32)" in out
    assert f"samples: {report.checked[0][0]} ({min(lengths)} tokens), " in out and "verify: ok:" in out
    # another batch size, every sample: the same verdict
    assert verify_in(hs_project, "verify.batch_size=4", "verify.samples=1000").ok
    out = capsys.readouterr().out
    print(out)
    assert f"{len(lengths)} of {len(lengths)} samples" in out and f" and {len(lengths) - 6} more\n" in out


def corrupt(project: Project, sample_index: int, layer: int, factor: float) -> str:
    """Scale one captured layer's states of one stored sample in its shard (a file of the right size and
    format, with wrong numbers); returns the sample's id."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = project.data("B3") / "hidden_states"
    row = pq.read_table(out / "samples.parquet").slice(sample_index, 1).to_pylist()[0]
    path = out / "shards" / row["shard"]
    with safe_open(str(path), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    a, b = int(tensors["offsets"][row["row"]]), int(tensors["offsets"][row["row"] + 1])
    tensors["aux_hidden_states"][a:b, layer] *= factor
    save_file(tensors, str(path), metadata=meta)
    return row["id"]


def test_verify_fails_on_wrong_numbers_in_one_layer_of_one_sample(hs_project):
    from draftdata.hidden.verify import spread

    hs_project.set("hidden_states.dtype", "bfloat16")
    hs_project.run("hidden_states", "B3")
    lengths = pq.read_table(hs_project.data("B3") / "samples.parquet", columns=["n_tokens"]).column(0).to_pylist()
    longest = spread(lengths, 3)[-1]  # the longest sample verify recomputes: of several that long, the last stored
    assert lengths[longest] == max(lengths)
    victim = corrupt(hs_project, longest, 1, 1.05)  # 5 % off in layer 3: plausible values, wrong
    proc = verify_cli(hs_project)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]  # after the model's loading bar
    assert "Traceback" not in proc.stderr and line.startswith("error: verify: data/B3/hidden_states: layer 3 is off")
    off = re.search(rf"off by (\S+) relative at sample {victim}, token \d+, above the tolerance 0.02", line)
    assert off and 0.04 < float(off.group(1)) <= 0.05  # 5 %, less what rounding to bf16 took back
    rows = {r.split()[1]: r.split()[2:4] for r in proc.stdout.splitlines() if r.startswith("layer ")}
    assert float(rows["3"][0]) > 2e-2 and all(float(rows[k][0]) < 2**-9 for k in ("1", "4"))


def test_verify_of_a_dataset_that_stores_no_states_says_so(hs_project, monkeypatch):
    """store_hidden_states: false leaves skipped.json, not states: verify says why there is nothing to check, rather
    than sending the user to run a stage that has run."""
    from draftdata.hidden import verify

    hs_project.params["datasets"]["B3"]["store_hidden_states"] = False
    hs_project.save()
    hs_project.run("hidden_states", "B3")
    with monkeypatch.context() as m, pytest.raises(UserError, match="store_hidden_states is false") as err:
        m.setattr(verify, "make_engine", lambda *a: pytest.fail("the model was loaded"))
        verify_in(hs_project)
    assert "\n" not in str(err.value)


def test_verify_names_a_shard_cut_short_before_loading_the_model(hs_project, monkeypatch):
    from draftdata.hidden import verify

    hs_project.run("hidden_states", "B3")
    shard = next((hs_project.data("B3") / "hidden_states" / "shards").iterdir())
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with monkeypatch.context() as m, pytest.raises(UserError) as err:
        m.setattr(verify, "make_engine", lambda *a: pytest.fail("the model was loaded"))
        verify_in(hs_project)
    message = str(err.value)
    assert message.startswith(f"{Path('data/B3/hidden_states/shards') / shard.name}: missing or cut short")
    assert "\n" not in message and "dvc repro hidden_states@B3" in message
    # the stage finds the same file torn in its store and computes that shard's samples again
    hs_project.run("hidden_states", "B3")
    assert hs_metrics(hs_project)["torn_shards_redone"] == 1
    assert verify_in(hs_project).ok


def test_a_rank_checks_only_the_shards_of_its_own_samples(tmp_path):
    """A torn shard that holds another rank's samples is that rank's to forget and write again under the same name:
    a rank that also deleted it could delete the file its owner has just rewritten."""
    import pyarrow as pa

    from draftdata.hidden.compute import _compute_windows
    from draftdata.hidden.state_store import StateStore, state_key
    from draftdata.hidden.tally import HiddenTally

    src = tmp_path / "samples.parquet"
    rows = [[1, 2, i] for i in range(4)]
    pq.write_table(pa.table({"id": [f"s{i}" for i in range(4)], "input_ids": rows, "loss_mask": rows}), src)

    class Computer:  # what the window pass asks of the engine: the settings' hash, and the samples to compute
        settings_hash = "h"

        def __init__(self):
            self.names, self.asked = {}, []

        def run(self, missing):
            self.asked += [k for k, _ in missing]

    def torn_store(where):
        store = StateStore(where)
        name = store.new_shard_name("h", [state_key("h", rows[3])])
        store.path(name).parent.mkdir(parents=True, exist_ok=True)
        store.path(name).write_bytes(b"\x08")  # cut short
        store.add_shard(name, "h", [state_key("h", rows[3])], [3], 1, "hf")
        return store, name

    store, name = torn_store(tmp_path / "a")
    tally, computer = HiddenTally(), Computer()
    _compute_windows(src, 4, computer, store, range(0, 2), tally)  # rows 2 and 3 are another rank's
    assert tally.torn == 0 and store.path(name).exists() and store.lookup([state_key("h", rows[3])])
    assert computer.asked == [state_key("h", r) for r in rows[:2]]

    store, name = torn_store(tmp_path / "b")
    tally, computer = HiddenTally(), Computer()
    _compute_windows(src, 4, computer, store, range(2, 4), tally)  # its owner forgets it and computes it again
    assert tally.torn == 1 and not store.path(name).exists() and not store.lookup([state_key("h", rows[3])])
    assert computer.asked == [state_key("h", r) for r in rows[2:]]
