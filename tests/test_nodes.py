"""Hidden states across nodes: two torchrun launches (`--nnodes 2`, a rendezvous over loopback, gloo, the tiny target)
stand for two nodes, each in its own directory with its own copy of samples.parquet. The states go to one shared
directory (`run.states_layout: shared`: manifests, no SQLite) or to each node's own store (`local`: rank 0 gathers
the other node's shards over the job's process group). In each layout node 1 is killed after its first shards, and
both nodes run again: the rerun computes only what no store holds, and node 0's output is one process's, bit for
bit in every sample (ids, loss mask, states). A node that differs from rank 0 (layers here) or two nodes on one
SQLite store are refused before anything is computed."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import ROOT, dataset_params, free_port

from draftdata.hidden.reader import HiddenStates

N_SAMPLES = 1200
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


@pytest.fixture(scope="module")
def samples(tmp_path_factory, tiny_model) -> Path:
    """A samples.parquet as tokenize writes it: random ids of the tiny target's vocabulary, 8 to 64 tokens each."""
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    ids = [[rng.randrange(vocab) for _ in range(rng.randint(8, 64))] for _ in range(N_SAMPLES)]
    table = pa.table(
        {
            "id": [f"s{i}" for i in range(N_SAMPLES)],
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array([[i % 2 for i in range(len(x))] for x in ids], pa.list_(pa.int8())),
        }
    )
    path = tmp_path_factory.mktemp("samples") / "samples.parquet"
    pq.write_table(table, path)
    return path


def node(root: Path, tiny_model: Path, samples: Path, states: Path, layout: str, **hidden) -> Path:
    """A node's project directory: params.yaml, its own samples.parquet and response store, the states at `states`."""
    (root / "data" / "B3").mkdir(parents=True)
    (root / "data" / "B3" / "samples.parquet").write_bytes(samples.read_bytes())
    params = {
        "model": {"path": str(tiny_model), "revision": None, "chat_template": None, "template_kwargs": {}},
        # a shard of about three samples: many shards, the first written soon. Each sample its own forward: a
        # sample's states then do not depend on the samples batched with it, and the nodes' output is one process's
        # bit for bit (batched, the two differ within rounding, as a run and its resume after a kill do)
        "hidden_states": {"layers": None, "dtype": "float32", "batch_tokens": 8, "shard_max_tokens": 96} | hidden,
        "run": {"store_path": str(root / "store.sqlite"), "states_path": str(states), "states_layout": layout},
        "datasets": {"B3": dataset_params("B3_magicoder", "magicoder_oss")},
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root


def launch(directory: Path, node_rank: int, port: int) -> subprocess.Popen:
    """One node of two: torchrun with one rank, its output in `node<r>.log` beside the directory."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank)]
    cmd += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd += ["-m", "stages.hidden_states", "dataset=B3"]
    log = open(directory.parent / f"{directory.name}.log", "w")
    return subprocess.Popen(cmd, cwd=directory, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_nodes(dirs: list[Path], kill_when=None) -> tuple[list[int], set[int]]:
    """Both nodes launched at once: their exit codes and node 1's process ids. `kill_when(node 1's pids)` true: node
    1's processes killed (SIGKILL)."""
    port = free_port()
    procs = [launch(d, r, port) for r, d in enumerate(dirs)]
    node_1: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            node_1.update(family(procs[1].pid))
            if kill_when is not None and procs[1].poll() is None and kill_when(node_1):
                kill_node(procs[1].pid)
                kill_when = None
            time.sleep(0.005)
        return [p.wait(timeout=30) for p in procs], node_1
    finally:
        for p in procs:
            if p.poll() is None:
                kill_node(p.pid)


def family(agent: int) -> list[int]:
    """A node's torchrun and its ranks (torchrun starts each rank in a session of its own)."""
    found = [agent]
    for pid in found:  # grows as it goes: children, then theirs
        children = Path(f"/proc/{pid}/task/{pid}/children")
        try:
            found += [int(c) for c in children.read_text().split()]
        except FileNotFoundError:
            pass
    return found


def kill_node(agent: int) -> None:
    """SIGKILL to a node's processes."""
    for pid in reversed(family(agent)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def log_of(directory: Path) -> str:
    return (directory.parent / f"{directory.name}.log").read_text()


def only_torchruns_tracebacks(log: str) -> bool:
    return all("elastic.multiprocessing.errors.ChildFailedError" in t for t in log.split("Traceback")[1:])


def states(out: Path) -> list:
    return [(s.id, s.input_ids, s.loss_mask, s.aux, s.final_pre_norm) for s in HiddenStates(out)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model, samples) -> list:
    """The output of one process (no torchrun), as the nodes' must equal it."""
    root = tmp_path_factory.mktemp("one")
    d = node(root / "p", tiny_model, samples, root / "states", "local")
    proc = subprocess.run(
        [sys.executable, "-m", "stages.hidden_states", "dataset=B3"], cwd=d, env=ENV, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Loading weights" not in proc.stderr  # off a terminal, no library's progress bar in the stage's log
    return states(d / "data" / "B3" / "hidden_states")


def manifest_keys(shared: Path, pids: set | None = None) -> int:
    """The samples the manifests name; with `pids`, only those these processes wrote."""
    docs = [json.loads(p.read_text()) for p in shared.glob("*/*.manifest.json")]
    return sum(len(d["keys"]) for d in docs if pids is None or d["writer"]["pid"] in pids)


def sqlite_keys(store: Path) -> int:
    if not (store / "index.sqlite").exists():
        return 0
    db = sqlite3.connect(store / "index.sqlite")
    try:
        return db.execute("SELECT COUNT(*) FROM states").fetchone()[0]
    except sqlite3.OperationalError:  # the index's tables are being made
        return 0
    finally:
        db.close()


def metrics(directory: Path) -> dict:
    return json.loads((directory / "data" / "B3" / "hidden_states_metrics.json").read_text())


def assert_same(nodes_out: list, one: list) -> None:
    assert len(nodes_out) == len(one) == N_SAMPLES
    for a, b in zip(nodes_out, one):
        assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
        assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4]), a[0]  # bit for bit


def test_two_nodes_on_a_shared_file_system(tmp_path, tiny_model, samples, one_process):
    shared = tmp_path / "nfs" / "states"
    dirs = [node(tmp_path / f"node{r}", tiny_model, samples, shared, "shared") for r in (0, 1)]
    # node 1 dies once it has written a shard's manifest; node 0 then fails at the job's next collective
    codes, node_1 = run_nodes(dirs, kill_when=lambda pids: manifest_keys(shared, pids) > 0)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, log_of(dirs[0])[-3000:]
    kept, by_node_1 = manifest_keys(shared), manifest_keys(shared, node_1)
    # node 1's share (about half the tokens) was cut short: some of it kept, the rest computed by the rerun
    assert 0 < by_node_1 < N_SAMPLES / 3 and kept < N_SAMPLES, (kept, by_node_1)
    assert run_nodes(dirs)[0] == [0, 0], log_of(dirs[0])[-3000:] + log_of(dirs[1])[-3000:]
    m = metrics(dirs[0])
    # only what no manifest named was computed again; every sample once in the output
    assert m["computed_samples"] == N_SAMPLES - kept and m["samples"] == N_SAMPLES and m["gathered_shards"] == 0
    assert not list(shared.rglob("*.sqlite*"))  # no database on the shared file system
    assert not (dirs[1] / "data" / "B3" / "hidden_states").exists()  # rank 0 writes the output
    assert_same(states(dirs[0] / "data" / "B3" / "hidden_states"), one_process)


def test_two_nodes_on_their_own_disks_gather_on_node_0(tmp_path, tiny_model, samples, one_process):
    local = [tmp_path / f"disk{r}" / "states" for r in (0, 1)]
    dirs = [node(tmp_path / f"node{r}", tiny_model, samples, local[r], "local") for r in (0, 1)]
    codes, _ = run_nodes(dirs, kill_when=lambda _: sqlite_keys(local[1]) > 0)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, log_of(dirs[0])[-3000:]
    kept = [sqlite_keys(s) for s in local]
    assert kept[0] > 0 and 0 < kept[1] and sum(kept) < N_SAMPLES, kept
    assert run_nodes(dirs)[0] == [0, 0], log_of(dirs[0])[-3000:] + log_of(dirs[1])[-3000:]
    m = metrics(dirs[0])
    assert m["computed_samples"] == N_SAMPLES - sum(kept) and m["samples"] == N_SAMPLES
    # node 1's share, all of it (kept before the kill and computed after), now in node 0's store too
    share1 = sqlite_keys(local[1])
    assert m["gathered_shards"] > 0 and sqlite_keys(local[0]) == N_SAMPLES and 0 < share1 < N_SAMPLES
    assert_same(states(dirs[0] / "data" / "B3" / "hidden_states"), one_process)
    # a third run computes and gathers nothing: node 0's store holds every sample
    assert run_nodes(dirs)[0] == [0, 0]
    m = metrics(dirs[0])
    assert (m["computed_samples"], m["gathered_shards"]) == (0, 0)


def test_a_node_that_differs_is_refused_before_anything_is_computed(tmp_path, tiny_model, samples):
    shared = tmp_path / "nfs" / "states"
    dirs = [node(tmp_path / "node0", tiny_model, samples, shared, "shared")]
    dirs.append(node(tmp_path / "node1", tiny_model, samples, shared, "shared", layers=[0, 2, 4]))
    assert all(c != 0 for c in run_nodes(dirs)[0])
    line = "has another layers than rank 0 (node 0"
    for d in dirs:
        # the one line, and no traceback but torchrun's own report that its rank failed
        assert line in log_of(d) and only_torchruns_tracebacks(log_of(d)), log_of(d)[-3000:]
    assert not list(shared.rglob("*.safetensors"))
    # two nodes on one SQLite store (a network file system taken for a local disk)
    dirs = [node(tmp_path / f"local{r}", tiny_model, samples, shared, "local") for r in (0, 1)]
    assert all(c != 0 for c in run_nodes(dirs)[0])
    assert "run.states_layout: nodes 0 and 1 share the state store" in log_of(dirs[0]), log_of(dirs[0])[-3000:]
    assert not list(shared.rglob("*.safetensors"))


def test_the_gather_bench_moves_every_byte_and_says_its_rate(tmp_path):
    out = tmp_path / "gather.json"
    cmd = [sys.executable, "-m", "bench.gather", "--gb", "0.05", "--shard-mb", "16", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    # every shard of rank 1's store gathered, as many bytes as copying its files moves
    assert r["gather"]["shards"] == 3 and r["gather"]["bytes"] == r["copy"]["bytes"] > 0.05 * 2**30 * 0.9
    # equal bytes: the ratio of the rates is that of the times
    assert abs(r["gather_over_copy"] - r["copy"]["seconds"] / r["gather"]["seconds"]) < 0.002
    assert "gather / copy" in proc.stdout
