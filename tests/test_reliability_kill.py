"""The kill suite (bench/reliability/kill.py) on four trials: a SIGKILL while generate generates, one while
tokenize tokenizes, one while hidden_states writes its outputs and one while generate regenerates multi-turn
conversations (`turns: all`), each restarted, leave nothing lost, duplicated or stale (`python -m bench.reliability
kill` runs 50+ that land while a stage works or writes).

The checks are then shown able to fail: each is given a planted problem in a copy of the real artifacts the trials
left (a key stored twice, a corrupt store, half-written outputs, a torn shard the index points at, an output that
is not the store's, states that differ, an answer delivered and dropped, a response generated twice, a stored turn
requested again), and the logging proxy tells an answer that ended from one cut short."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sqlite3
import subprocess
import sys

import pytest

from bench.reliability import kill
from bench.reliability import kill_checks as checks
from bench.reliability.kill_proxy import Exchange


@pytest.fixture(scope="module")
def suite(tmp_path_factory, tiny_model):
    """Kills while generate generates (one run of single turns, one of conversations), while tokenize tokenizes
    and while hidden_states writes its outputs; the projects are kept."""
    root = tmp_path_factory.mktemp("kill")
    parser = argparse.ArgumentParser()
    kill.add_arguments(parser)
    args = parser.parse_args(
        [
            "--trials",
            "4",
            "--seed",
            "1",
            "--scenarios",
            "generate_work,tokenize_work,hidden_states_write,generate_turns",
            "--workdir",
            str(root),
            "--model",
            str(tiny_model),
        ]
    )
    return kill.run(args), kill.Project(root / "clean")


def test_killed_stages_restart_with_nothing_lost_duplicated_or_stale(suite):
    res, _ = suite
    figures = {k: v for k, v in res["figures"].items() if k != "kill_effective"}
    assert figures == {"kill_trials": 4, "kill_lost": 0, "kill_duplicated": 0, "kill_stale": 0}, res["rows"]
    assert [r["failure"] for r in res["rows"]] == [None, None, None, None]
    assert not res["goal_met"]  # the goal asks for 50 kills that land while a stage works or writes


def test_the_stages_without_a_store_log_the_start_of_their_work(suite):
    """prompts and tokenize log a line as their work begins, before their closing line: the mark their aimed kills
    wait for."""
    _, clean = suite
    lines = clean.log.read_text().splitlines()
    for stage, closing in (("prompts", "prompts dataset=D rows="), ("tokenize", "tokenize dataset=D samples=")):
        starts = [i for i, line in enumerate(lines) if line.startswith(kill.LOG_MARK[stage])]
        ends = [i for i, line in enumerate(lines) if line.startswith(closing)]
        assert len(starts) == len(ends) == 1 and starts[0] < ends[0], lines


def test_the_stages_log_the_start_of_their_writing(suite):
    """Every stage logs a line as the writing of its outputs begins, once, after the line of its work (prompts,
    tokenize) and before its closing line: the mark the aimed kills of the writing wait for."""
    _, clean = suite
    lines = clean.log.read_text().splitlines()
    closing = {"prompts": "rows=", "generate": "responses=", "tokenize": "samples=", "hidden_states": "samples="}
    for stage, mark in kill.WRITE_MARK.items():
        starts = [i for i, line in enumerate(lines) if line.startswith(mark)]
        ends = [i for i, line in enumerate(lines) if line.startswith(stage) and f" {closing[stage]}" in line]
        works = [i for i, line in enumerate(lines) if stage in kill.LOG_MARK and line.startswith(kill.LOG_MARK[stage])]
        assert len(starts) == len(ends) == 1 and starts[0] < ends[0], (stage, lines)
        assert all(w < starts[0] for w in works), (stage, lines)


def test_where_a_kill_landed_is_told_by_the_log_and_the_files(tmp_path):
    """Before the work line: before; after it: working; after the writing line: writing (its first temp file comes
    next); every output: written."""
    project = kill.Project(tmp_path)
    project.data.mkdir(parents=True)
    project.log.write_text("Loading weights: 100%\n")
    assert kill.phase_at_kill(project, "tokenize") == "before"
    with project.log.open("a") as log:
        log.write("tokenize dataset=D responses=59\n")
    assert kill.phase_at_kill(project, "tokenize") == "working"
    with project.log.open("a") as log:
        log.write("tokenize dataset=D writing=data/D/samples.parquet\n")
    assert kill.phase_at_kill(project, "tokenize") == "writing"
    for name in kill.OUTPUTS["tokenize"]:
        (project.data / name).write_text("{}")
    assert kill.phase_at_kill(project, "tokenize") == "written"


def test_a_restarts_marks_are_its_own(tmp_path):
    """The restart appends to the killed run's log: the lines the killed run logged do not mark the restart's
    phases (else its work and writing would be timed from its start)."""
    project = kill.Project(tmp_path)
    project.log.write_text("tokenize dataset=D responses=59\ntokenize dataset=D writing=data/D/samples.parquet\n")
    assert project.working("tokenize") and project.writing("tokenize")
    project.new_run()
    assert not project.working("tokenize") and not project.writing("tokenize")
    with project.log.open("a") as log:
        log.write("Loading tokenizer\ntokenize dataset=D responses=59\n")
    assert project.working("tokenize") and not project.writing("tokenize")


def bare_bench(**timing: kill.Timing) -> kill.Bench:
    bench = object.__new__(kill.Bench)  # only its timings
    bench.timing, bench.measured, bench.proxy, bench.fake = dict(timing), {}, None, None
    return bench


def scenario(name: str) -> kill.Scenario:
    return next(s for s in kill.SCENARIOS if s.name == name)


def test_kills_are_drawn_in_the_lower_quartile_of_the_windows_measured():
    """A phase takes as long as the machine's load lets it: an aimed kill is drawn within the lower quartile of the
    windows measured so far, the clean run's until there are others."""
    bench = bare_bench(hidden_states=kill.Timing(seconds=10.0, work_s=1.0, write_s=1.3))
    aimed = scenario("hidden_states_write")
    assert bench.timing_of(aimed).write_s == 1.3
    for write_s in (0.2, 0.3, 0.4, 0.5):
        bench.measure(aimed, write_s=write_s)
    assert bench.timing_of(aimed) == kill.Timing(seconds=10.0, work_s=1.0, write_s=0.3)
    bench.measure(aimed, seconds=6.0, work_s=0.5)
    assert bench.timing_of(aimed) == kill.Timing(seconds=7.0, work_s=0.625, write_s=0.3)
    assert bench.timing == {"hidden_states": kill.Timing(seconds=10.0, work_s=1.0, write_s=1.3)}  # the clean run's
    # a restart after a kill that left responses stored reused them: only its writing was whole
    restart = kill.Timing(seconds=3.0, work_s=0.1, write_s=0.15)
    assert kill.anew(restart, stored_at_kill=12) == {"write_s": 0.15}
    assert kill.anew(restart, stored_at_kill=0) == {"seconds": 3.0, "work_s": 0.1, "write_s": 0.15}


class QuickProject(kill.Project):
    """A 'stage' that exits at once."""

    def spawn(self, stage):
        self.new_run()
        return subprocess.Popen([sys.executable, "-c", "pass"])


def test_a_run_that_ends_before_its_kill_moment_bounds_the_window(tmp_path):
    """A moment drawn past the end of the run: no kill; the run's own length bounds the window drawn in."""
    shot = kill.kill_once(
        QuickProject(tmp_path), scenario("prompts"), kill.Timing(60.0, 1.0, 1.0), random.Random(0)
    )  # the first draw of seed 0: 51 s
    assert shot.moment is None and 0 < shot.ran_s < 30


def test_a_trial_whose_runs_all_end_first_is_missed_not_failed(monkeypatch):
    """Each miss is a measured window; after MAX_DRAWS the trial is missed (no kill, nothing to check), which is not
    a failed trial (a restart or a check that failed)."""
    bench = bare_bench(prompts=kill.Timing(seconds=4.0, work_s=2.0, write_s=0.01))
    bench.new_project = lambda name, s: None
    ran = iter([3.0, 2.5, 2.0, 1.5, 1.0])
    drawn_in = []

    def ends_first(project, s, timing, rng):
        drawn_in.append(timing.seconds)
        return kill.Shot(None, ran_s=next(ran))

    monkeypatch.setattr(kill, "kill_once", ends_first)
    row = kill.trial(bench, scenario("prompts"), 0, random.Random(0))
    assert drawn_in == [4.0, 3.25, 2.75, 2.375, 2.0]
    assert (row["missed"], row["killed"], row["failure"], row["draws"]) == (True, False, None, kill.MAX_DRAWS)
    assert bench.timing_of(scenario("prompts")).seconds == 1.625


def test_effective_kills_are_counted_per_scenario_and_stage():
    """Only kills that landed while a stage worked or wrote count toward the goal."""
    landed = [("prompts", "before"), ("prompts", "writing"), ("prompts", "written"), ("tokenize", "working")]
    rows = [
        {"scenario": st, "stage": st, "killed": True, "phase": phase, "missed": False, "failure": None, "tmp_left": 0}
        | dict.fromkeys(checks.KINDS, 0)
        for st, phase in landed
    ]
    rows.append(dict(rows[-1], killed=False, phase=None, missed=True))
    assert kill.effective(rows) == 2
    by_stage = {s["stage"]: s for s in kill.summarise_stages(rows)}
    assert by_stage["prompts"]["phases"] == {"before": 1, "working": 0, "writing": 1, "written": 1}
    assert (by_stage["prompts"]["effective"], by_stage["tokenize"]["effective"]) == (1, 1)
    scenarios = [s for s in kill.SCENARIOS if s.name in ("prompts", "tokenize")]
    summary = kill.summarise(rows, scenarios + scenarios)  # a scenario named twice is one row
    assert [(s["scenario"], s["trials"], s["effective"]) for s in summary] == [("prompts", 3, 1), ("tokenize", 1, 1)]
    assert [(s["missed"], s["failures"]) for s in summary] == [(0, 0), (1, 0)]


def test_the_goal_asks_for_every_stages_writing_and_no_failed_trial():
    def row(stage, phase, failure=None):
        return {"stage": stage, "killed": True, "phase": phase, "failure": failure, "missed": False}

    figures = {"kill_effective": 60} | {f"kill_{k}": 0 for k in checks.KINDS}
    rows = [row(st, "writing") for st in kill.INPUTS for _ in range(kill.GOAL_WRITING)]
    assert kill.goal_met(figures, rows, kill.summarise_stages(rows))
    short = rows[1:]  # prompts' writing hit 3 times
    assert not kill.goal_met(figures, short, kill.summarise_stages(short))
    failed = rows + [row("tokenize", "working", failure="restart exited 1")]
    assert not kill.goal_met(figures, failed, kill.summarise_stages(failed))
    assert not kill.goal_met(figures | {"kill_effective": 49}, rows, kill.summarise_stages(rows))


def kinds(problems) -> dict:
    return {k: v for k, v in checks.tally(problems).items() if v}


def copy_store(src, dest):
    """A consistent copy of a live SQLite file (its WAL included)."""
    with sqlite3.connect(src) as a, sqlite3.connect(dest) as b:
        a.backup(b)
    return dest


def test_a_key_stored_twice_is_found(suite, tmp_path):
    _, clean = suite
    store = copy_store(clean.store, tmp_path / "store.sqlite")
    assert checks.sqlite_problems(store, {"responses": "key"}) == []
    with sqlite3.connect(store) as db:  # the same table without its primary key, one row twice
        db.executescript(
            "CREATE TABLE plain AS SELECT * FROM responses; DROP TABLE responses; "
            "ALTER TABLE plain RENAME TO responses; "
            "INSERT INTO responses SELECT * FROM responses LIMIT 1;"
        )
    assert kinds(checks.sqlite_problems(store, {"responses": "key"})) == {"duplicated": 1}


def test_a_corrupt_store_is_found(suite, tmp_path):
    _, clean = suite
    store = copy_store(clean.store, tmp_path / "store.sqlite")
    data = bytearray(store.read_bytes())
    data[4096 : 3 * 4096] = b"\xff" * (2 * 4096)  # pages 2 and 3 overwritten
    store.write_bytes(bytes(data))
    assert kinds(checks.sqlite_problems(store, {"responses": "key"})) == {"lost": 1}


def test_half_written_outputs_are_found(suite, tmp_path):
    _, clean = suite
    outputs = [clean.data / "responses.jsonl", clean.data / "samples.parquet", clean.data / "hidden_states"]
    assert checks.file_problems(outputs) == []
    cut = tmp_path / "cut"
    shutil.copytree(clean.data, cut)
    planted = [
        cut / "responses.jsonl",
        cut / "samples.parquet",
        cut / "hidden_states" / "samples.parquet",
        next((cut / "hidden_states" / "shards").iterdir()),
    ]
    for path in planted:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2].rstrip(b"\n"))  # cut inside a line, not after one
    found = checks.file_problems([cut / "responses.jsonl", cut / "samples.parquet", cut / "hidden_states"])
    assert kinds(found) == {"stale": len(planted)}


def test_an_index_entry_for_a_torn_shard_is_found(suite, tmp_path):
    _, clean = suite
    states = tmp_path / "states"
    shutil.copytree(clean.states, states)
    assert checks.state_store_problems(states) == []
    shard = next(states.glob("*/*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    assert kinds(checks.state_store_problems(states)) == {"stale": 1}


def test_an_output_that_is_not_the_stores_selection_is_found(suite):
    _, clean = suite
    rows = kill.read_jsonl(clean.data / "responses.jsonl")
    prompts = kill.read_jsonl(clean.data / "prompts.jsonl")
    store = checks.stored_responses(clean.store)
    assert checks.output_vs_store(rows, prompts, store, kill.DATASET, kill.BUDGET) == []
    # written from an older state of the store: the last response is missing
    assert kinds(checks.output_vs_store(rows[:-1], prompts, store, kill.DATASET, kill.BUDGET)) == {"lost": 1}
    # a row whose text is not the stored one
    changed = [dict(rows[0], text=rows[0]["text"] + "!")] + rows[1:]
    assert kinds(checks.output_vs_store(changed, prompts, store, kill.DATASET, kill.BUDGET)) == {"stale": 1}


def test_responses_that_differ_from_the_clean_run_are_found(suite):
    _, clean = suite
    store = checks.stored_responses(clean.store)
    assert checks.same_as_clean(store, store) == []
    key = next(k for k, r in store.items() if r["finish_reason"] in checks.COMPLETE)
    other = dict(store, **{key: dict(store[key], output_ids=store[key]["output_ids"][:-1] + [-1])})
    assert kinds(checks.same_as_clean(other, store)) == {"stale": 1}
    # a response committed before a kill and gone after the restart, another rewritten
    before, after = store, dict(other)
    del after[next(k for k in store if k != key and store[k]["finish_reason"] in checks.COMPLETE)]
    assert kinds(checks.committed_kept(before, after)) == {"lost": 1, "stale": 1}


def test_hidden_states_that_differ_from_the_clean_run_are_found(suite, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    _, clean = suite
    hs = tmp_path / "hidden_states"
    shutil.copytree(clean.data / "hidden_states", hs)  # copies: the store's shards stay as they are
    assert checks.compare_states(hs, clean.data / "hidden_states") == []
    shard = next((hs / "shards").iterdir())
    with safe_open(str(shard), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(shard))
    tensors["final_hidden_states"][0, 0] += 1  # the first sample of the shard, one value
    shard.unlink()
    save_file(tensors, str(shard), metadata=meta)
    assert kinds(checks.compare_states(hs, clean.data / "hidden_states")) == {"stale": 1}


def test_the_restarts_accounting_is_checked(suite):
    _, clean = suite
    store = checks.stored_responses(clean.store)
    usable = sum(checks.usable(r) for r in store.values())
    assert checks.accounting(store, store, {"reused_from_store": usable, "newly_generated": 0}) == []
    # a restart that sent two stored responses again, and one that says it generated a response that never landed
    assert kinds(checks.accounting(store, store, {"reused_from_store": usable - 2, "newly_generated": 0})) == {
        "duplicated": 2
    }
    assert kinds(checks.accounting(store, store, {"reused_from_store": usable, "newly_generated": 1})) == {"lost": 1}


def test_the_wire_is_checked_against_the_store():
    """Answers a and b delivered before the kill (a first), c during the restart."""
    keys = {1: "a", 2: "b", 3: "c"}
    row = {"finish_reason": "stop"}
    killed = [Exchange("/v1/chat/completions", 1, 0.0, 200, 10.0), Exchange("/v1/chat/completions", 2, 0.0, 200, 11.0)]
    restart = [Exchange("/v1/chat/completions", 3, 20.0, 200, 21.0)]

    def wire_problems(killed, restart, snapshot, final):  # the exchanges named by their seeds' keys
        return checks.wire_problems(checks.deliveries(killed, keys), checks.deliveries(restart, keys), snapshot, final)

    # b was still in flight (delivered after the last commit): a restart that generated it again is fine
    ok = wire_problems(
        killed,
        restart + [Exchange("/v1/chat/completions", 2, 20.0, 200, 22.0)],
        {"a": row},
        {"a": row, "b": row, "c": row},
    )
    assert ok == []
    # a was delivered before b, which was committed: a was no longer in flight, and it is gone
    assert kinds(
        wire_problems(
            killed,
            restart + [Exchange("/v1/chat/completions", 1, 20.0, 200, 22.0)],
            {"b": row},
            {"a": row, "b": row, "c": row},
        )
    ) == {"lost": 1}
    # the restart asked again for a, stored before the kill; c delivered but never stored
    assert kinds(
        wire_problems(
            killed,
            restart + [Exchange("/v1/chat/completions", 1, 20.0, 200, 22.0)],
            {"a": row, "b": row},
            {"a": row, "b": row},
        )
    ) == {"duplicated": 1, "lost": 1}
    # a stored response no server delivered
    assert kinds(wire_problems(killed, restart, {"a": row, "b": row}, {"a": row, "b": row, "c": row, "d": row})) == {
        "stale": 1
    }


def test_rows_against_the_clean_run():
    want = [{"id": i, "x": i} for i in range(4)]
    assert checks.compare_rows("out", list(want), want, "id") == []
    assert kinds(checks.compare_rows("out", want[:3], want, "id")) == {"lost": 1}
    assert kinds(checks.compare_rows("out", want + want[:1], want, "id")) == {"duplicated": 1}
    assert kinds(checks.compare_rows("out", [want[1], want[0], *want[2:]], want, "id")) == {"stale": 2}
    assert kinds(checks.compare_json("m", json.loads('{"a": 1}'), {"a": 2})) == {"stale": 1}


def test_the_proxy_marks_an_answer_delivered_only_when_it_ended():
    """A streamed answer that ends with a finish reason is delivered; one cut short is not; the seed is read."""
    import asyncio
    import socket
    import threading
    import urllib.request

    from aiohttp import web

    from bench.reliability.kill_proxy import LoggingProxy

    async def answer(request):
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n')
        if request.path == "/ended":
            await resp.write(b'data: {"choices": [{"text": "b", "finish_reason": "stop"}]}\n\n')
        return resp

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = LoggingProxy(f"http://127.0.0.1:{sock.getsockname()[1]}")
    url = proxy.start()
    try:
        for path, seed in (("/ended", 7), ("/cut", 8)):
            req = urllib.request.Request(url + path, data=json.dumps({"seed": seed}).encode(), method="POST")
            urllib.request.urlopen(req).read()
    finally:
        proxy.stop()  # every request's handler has finished
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    assert [(e.path, e.seed, e.status, e.complete) for e in proxy.exchanges()] == [
        ("/ended", 7, 200, True),
        ("/cut", 8, 200, False),
    ]


# ---- turns: all ------------------------------------------------------------------------------------------------ #


def test_conversations_killed_mid_run_resume_with_every_turn_asked_once(suite):
    """The kill fell after turns were committed; the restart asked the fake server only for the turns the store
    lacked, and its output is the clean run's, conversation by conversation."""
    res, _ = suite
    row = next(r for r in res["rows"] if r["scenario"] == "generate_turns")
    assert (row["killed"], row["phase"], row["problems"], row["failure"]) == (True, "working", [], None), row
    assert row["stored_at_kill"] > 0 and row["delivered_before_kill"] >= row["stored_at_kill"]
    assert isinstance(row["conversations_resumed"], int)
    turns = next(s for s in res["summary"] if s["scenario"] == "generate_turns")
    assert turns["label"] == "generate/sglang, turns: all (working)"


def clean_turns(suite) -> tuple[list[dict], dict[str, dict]]:
    """The clean run of the multi-turn dataset: responses.jsonl and the store."""
    _, clean = suite
    base = kill.Project(clean.path.parent / "clean_turns")
    return kill.read_jsonl(base.data / "responses.jsonl"), checks.stored_responses(base.store)


def test_a_stored_turn_requested_again_is_found(suite):
    """A kill after every conversation's first turn: the restart asks for the later turns only. Asking again for a
    turn stored before the kill, or answering one twice, is a turn regenerated; a stored turn the server never
    answered is stale."""
    rows, store = clean_turns(suite)
    first = {r["key"] for r in rows if r["turn"] == 0}
    later = [r["key"] for r in rows if r["turn"] > 0]
    assert first and later  # conversations of more than one turn
    snapshot = {k: store[k] for k in first}
    killed = [checks.Delivery(k, True) for k in first]
    restart = [checks.Delivery(k, True) for k in later]
    assert checks.delivery_problems(killed, restart, snapshot, store) == []
    assert checks.resumed_conversations(rows, snapshot) == len({r["conversation"] for r in rows if r["turn"] > 0})
    assert checks.resumed_conversations(rows, store) == 0
    asked_again = restart + [checks.Delivery(rows[0]["key"], False)]  # turn 0, stored: even unanswered
    assert kinds(checks.delivery_problems(killed, asked_again, snapshot, store)) == {"duplicated": 1}
    answered_twice = restart + [checks.Delivery(later[0], True)]
    assert kinds(checks.delivery_problems(killed, answered_twice, snapshot, store)) == {"duplicated": 1}
    assert kinds(checks.delivery_problems(killed, restart[1:], snapshot, store)) == {"stale": 1}
    dropped = {k: r for k, r in store.items() if k != later[0]}  # answered during the restart, not stored
    assert kinds(checks.delivery_problems(killed, restart, snapshot, dropped)) == {"lost": 1}


def test_conversations_that_are_not_the_clean_runs_are_found(suite):
    """A turn missing from the output, a line that names another turn, or a stored turn the clean run never asked
    (one built on another history)."""
    rows, store = clean_turns(suite)
    assert checks.compare_rows("responses.jsonl", rows, list(rows), "key") == []
    assert kinds(checks.compare_rows("responses.jsonl", rows[1:], rows, "key")) == {"lost": 1}
    moved = [dict(rows[0], turn=rows[0]["turn"] + 1), *rows[1:]]
    assert kinds(checks.compare_rows("responses.jsonl", moved, rows, "key")) == {"stale": 1}
    assert checks.unknown_keys(store, store) == []
    other = dict(store, elsewhere=next(iter(store.values())))
    assert kinds(checks.unknown_keys(other, store)) == {"stale": 1}


def test_the_expected_selection_lands_as_the_stage_does():
    """The shortest run of responses in prompt order that reaches the budget (landing exact, the default): 6 and 8
    reach 10, whatever comes after. The check's own code agrees with the stage's `exact_landing` on random
    lengths."""
    from draftdata.generate.land.selection import exact_landing

    def store_of(lengths):
        return {
            f"k{i}": {"key": f"k{i}", "prompt_id": f"p{i}", "dataset": "D", "finish_reason": "stop", "text": "a"}
            | {"completion_tokens": n}
            for i, n in enumerate(lengths)
        }

    prompts = [{"id": f"p{i}"} for i in range(40)]
    assert checks.expected_selection(prompts, store_of([6, 8, 4, 3]), "D", 10) == ["k0", "k1"]
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 48) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(1, 600)
        want = [f"k{i}" for i in exact_landing(lengths, budget)]
        assert checks.expected_selection(prompts, store_of(lengths), "D", budget) == want, (lengths, budget)
