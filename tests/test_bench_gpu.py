"""bench/gpu: the GPU run's bundle comes back whole from its chunks (and a damaged or missing one is refused before any
work), and the run itself, every size shrunk (`--dry`), goes end to end on the CPU through every part the GPU runs,
the embedded engine on the continuous-batching path a GPU takes, and goes on from where it stopped."""

from __future__ import annotations

import json
import os
import tarfile

import pytest
import torch

from bench.gpu import bundle, run

TRAINERS_PYTHON = os.environ.get("DRAFTDATA_TRAINERS_PYTHON")


def chunked(tmp_path, chunk_bytes: int) -> tuple:
    src = tmp_path / "bundle"
    (src / "site").mkdir(parents=True)
    for i in range(3):
        (src / "site" / f"w{i}.whl").write_bytes(os.urandom(5000 + i))
    tar = tmp_path / "b.tar"
    with tarfile.open(tar, "w") as t:
        t.add(src, arcname="bundle")
    home = tmp_path / "home"
    (home / "chunks").mkdir(parents=True)
    return bundle.split(tar, home / "chunks", chunk_bytes), home, src


def test_the_chunks_join_back_into_the_bundle(tmp_path):
    manifest, home, src = chunked(tmp_path, 7000)
    assert len(manifest["parts"]) > 2 and all(p["bytes"] <= 7000 for p in manifest["parts"])
    got = bundle.join(home)
    for f in (src / "site").iterdir():
        assert (got / "site" / f.name).read_bytes() == f.read_bytes()
    assert bundle.join(home) == got  # the same manifest again: kept, not unpacked twice


def test_a_damaged_or_missing_chunk_is_refused_by_name(tmp_path):
    manifest, home, _ = chunked(tmp_path, 7000)
    second = home / "chunks" / manifest["parts"][1]["name"]
    data = bytearray(second.read_bytes())
    data[10] ^= 1
    second.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=manifest["parts"][1]["name"]):
        bundle.join(home)
    second.unlink()
    with pytest.raises(SystemExit, match=f"{manifest['parts'][1]['name']} not on this machine"):
        bundle.join(home)


def test_each_call_carries_one_chunk_and_the_last_runs(tmp_path):
    out = bundle.ROOT / ".gpu-test-calls"
    manifest = {"parts": [{"name": "part-00"}, {"name": "part-01"}, {"name": "part-02"}]}
    calls = bundle.calls(manifest, out)
    assert [c["command"].split()[-1] for c in calls] == ["stash", "stash", "run"]
    assert [c["carry"][0] for c in calls] == [f".gpu-test-calls/chunks/part-0{i}" for i in range(3)]
    assert all(c["carry"][1] == ".gpu-test-calls/chunks/manifest.json" for c in calls)


def test_a_cut_proof_keeps_the_variants_that_finished(tmp_path):
    args = run.main.__globals__["argparse"].Namespace(dry=True, deadline_s=10.0, work=tmp_path, out=tmp_path / "o")
    args.parts = "model,proof"
    r = run.Run(args)
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "drafters0.json").write_text(json.dumps({"correct": {"runs": [1]}}))
    (tmp_path / "drafter" / "drafters1.json").write_text(json.dumps({"no_states": {"runs": [2]}}))
    (tmp_path / "o").mkdir()
    with pytest.raises(TimeoutError, match="correct"):
        run.partial_proof(r, tmp_path / "drafter")
    kept = json.loads((tmp_path / "o" / "drafter.json").read_text())
    assert kept["partial"] and set(kept["variants"]) == {"correct", "no_states"}


def test_the_gpu_run_without_a_gpu_stops_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="sees no GPU"):
        run.main(["--bundle", str(tmp_path), "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "w").exists()


@pytest.mark.skipif(not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON (the proof trains in its venv)")
def test_the_dry_run_goes_through_every_part_and_goes_on_where_it_stopped(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    run.main(["--dry", "--work", str(work), "--out", str(out)])
    r = json.loads((out / "gpu.json").read_text())
    parts = r["parts"]
    assert set(parts) == set(run.PARTS) and not [p for p in parts.values() if "error" in p], parts
    g = parts["greedy"]
    assert g["answers"] == run.DRY.greedy_prompts and g["identical"] == g["answers"], g
    s = parts["states"]
    assert s["rel_l2_float32"] < 1e-6 and s["pad_tokens_float32"] > 0  # one padded batch against one at a time
    t = parts["throughput"]
    assert set(t["by_concurrency"]) == {"1", "4"} and not t["not_measured"]
    assert all(x[e]["tok_s"] > 0 for x in t["by_concurrency"].values() for e in ("ours", "ours_cpu", "static"))
    assert t["backend"] == {"embedded_batching": "transformers"}  # the GPU's path, taken on the CPU
    assert 0 < t["by_concurrency"]["4"]["ours_of_limit"] < 1
    prof = parts["profile"]
    assert prof["in_flight"] == 4 and prof["thread_s"] > 0 and len(prof["top_by_own_time"]) > 5
    assert parts["capture"]["capture_vs_forward"] > 0 and (out / "hidden_states_cuda.json").is_file()
    drafter = json.loads((out / "drafter.json").read_text())
    assert set(drafter["variants"]) == {"correct", "no_states"}
    assert r["goals"]["greedy_all_identical"] and r["goals"]["states_float32"]
    run.main(["--dry", "--work", str(work), "--out", str(out)])  # again: every part kept, none run twice
    again = json.loads((out / "gpu.json").read_text())["parts"]
    assert all(p.get("kept") for p in again.values()), again
