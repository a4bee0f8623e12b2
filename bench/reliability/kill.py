"""SIGKILL at random moments in every stage, restart it, and check nothing was lost, duplicated or left stale.

    python -m bench.reliability kill [--trials 93] [--seed 0] [--scenarios generate,hidden_states] [--workdir DIR]

Every trial is one real stage process (`python -m stages.<stage> dataset=D`, as dvc.yaml runs it) in a project
directory of its own: a demo-like dataset (150 magicoder prompts, a 600-token budget) on the tiny demo target,
built once per run, with the stage's inputs copied from a clean run and its stores empty, as DVC leaves a stage
it reruns. The process gets SIGKILL at a seeded random moment, is restarted and runs to completion, and then:

- every SQLite file (the response store, the state store's index) passes `PRAGMA integrity_check` and holds no key
  twice, after the kill and after the restart;
- no half-written file is taken as done: every output present at its final name after the kill reads completely,
  and every sample the state store indexes points at a whole shard that holds it;
- nothing committed is lost: every response stored before the kill is still there, unchanged, after the restart;
  on a server, every answer the server delivered before the kill is stored or was in flight (a logging proxy in
  front of a real `transformers serve` sees the wire); in process, the restart's metrics account for the store
  (it reused everything stored, and what it says it generated landed);
- the final outputs equal the clean (never killed) run's: prompts.jsonl, samples.parquet and the hidden states
  value for value; responses.jsonl is exactly the store's selection, and every stored response has the clean
  run's tokens for its key (sampling is seeded per request; which prompts fill the budget depends on which
  requests were in flight when it was reached, so the clean run's own reruns differ in a row or two, by design).
  On the server the responses are text sampled without a per-request seed, so there the store itself is the
  reference.

Scenarios (one table row each): per stage, one aimed at its work and one at the writing of its outputs; generate on
the server; generate with `turns: all` (below); and the stages with kill moments uniform over a run's duration (they
land mostly in start-up). The work:
from the first sign of it (generate, hidden_states: the first commit to the store, a response or a sample, so kills
fall between and during commits; prompts, tokenize, which have no store: the line each logs as its work begins) to
the line the stage logs as the writing of its outputs begins. The writing: from that line until every output was in
place (prompts: prompts.jsonl, prompts_metrics.json; generate: responses.jsonl after its last response and the
metrics; tokenize: samples.parquet, plots/skips.csv, tokenize_metrics.json; hidden_states: the second pass that
links the shards and writes samples.parquet and index.json). An aimed kill waits for the line that starts its
window, then falls uniformly within the lower quartile of the window's lengths measured so far: the clean run's,
every restart's for the phases it went through whole (the writing always; the work and the run when the kill left
nothing stored), the work of a run aimed at its writing, and a run's that ended before its kill moment (such a draw
is drawn again, up to MAX_DRAWS). How long a phase takes changes with the machine's load, by a factor or two: within
the lower quartile a moment falls within the phase of at least 3 runs in 4. Every stage run here holds each output
whole at its temp name for HOLD_S before renaming it (bench/reliability/held.py): the writing, milliseconds
otherwise, lasts long enough to be aimed at, and a kill in it lands with a temp file whole or half-written and the
outputs renamed so far beside the ones not yet (the temp files are never read; their order is the stage's). The
default rotation (ROTATION) gives the aimed kills of prompts and tokenize, seconds each, five turns, the writing of
generate and hidden_states two, the conversations of `turns: all` two, and leaves out the uniform kills of generate
and hidden_states (nearly all land while the model loads); `--scenarios` names any of them, a name twice for two
turns.

`turns: all` (generate_turns): 48 multi-turn chats of the demo (TURNS_SOURCE), every assistant turn regenerated in
order against the fake SGLang server (bench/fake_server.py, its greedy model: a turn's answer, hence the next turn's
key, is the same in every run), killed in its work (after the first turn committed, while conversations are between
turns) and restarted. The server runs in this process and logs every request by its store key (its rid), so no
kill hides one: no turn stored before the kill is requested again, none is answered twice in a run, every stored
turn was answered by the server, and the restart's output equals the clean run's line for line (same keys,
conversations, turns and answers; the budget is more than the conversations hold, so every run finishes all of
them). Each trial counts the conversations the kill cut between turns (`conversations_resumed`).

Figures: kill_trials (trials whose kill landed), kill_effective (those that landed while the stage worked or wrote
its outputs: the ones that could lose anything), kill_lost, kill_duplicated, kill_stale (problems of each kind,
summed over trials; bench/reliability/kill_checks.py says what each kind covers). Goal: all three 0 over at least
GOAL_EFFECTIVE (50) effective kills, at least GOAL_WRITING (4) of them in every stage's writing, and no trial
failed (a restart that exited non-zero, a check that could not run). The tables say where the kills landed (before
any work showed, working, writing outputs, or after the outputs were complete) per scenario and per stage, trials
missed (the run ended before each kill moment drawn: no kill, nothing to check), trials failed, and the temp files
the killed writes left behind (never read as outputs, never removed either).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.reliability import kill_checks as checks
from bench.reliability.kill_checks import Delivery, Problem
from bench.servers import transformers_serve

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "sources" / "demo"
DATASET = "D"
BUDGET = 600
# How often a run is looked at: often enough to see the writing of a small output (a few ms) begin.
POLL_S = 0.0005
WORK_POLL_S = 0.01  # how often the store is read for the first commit
# How long every output is held whole at its temp name before its rename (bench/reliability/held.py): a stage writes
# its outputs in milliseconds, less than a loaded machine may take to schedule this process after the stage's line
# that its writing begins; held, the writing of 2 to 4 outputs lasts a tenth of a second or more.
HOLD_S = 0.05
MAX_DRAWS = 5  # kill moments drawn for one trial before it counts as a failure (each past the end of its run)
RESTART_TIMEOUT_S = 600  # a restart that hangs is a failure, not a stuck suite
# turns: all: the first conversations of the demo's multi-turn chats (1 to 3 assistant turns each), every turn
# regenerated by the fake SGLang server's greedy model (deterministic: a turn's answer, hence the next turn's key,
# is the same in every run). The budget is more than they hold, so every run ends with every conversation finished
# and its output does not depend on what a kill interrupted. A token every TURN_TOKEN_DELAY_S: a turn takes about
# 0.1 s, so a run's conversations go through several rounds of turns after the first commit.
TURNS_SOURCE = DEMO / "B6_ultrachat.jsonl.gz"
TURNS_PROMPTS = 48
TURNS_BUDGET = 1_000_000
TURN_TOKEN_DELAY_S = 0.01

# Per stage: its input (copied from the clean run), its outputs, and the one whose appearance (or temp file) marks
# the start of its writing.
INPUTS = {
    "prompts": [],
    "generate": ["prompts.jsonl"],
    "tokenize": ["responses.jsonl"],
    "hidden_states": ["samples.parquet"],
}
OUTPUTS = {
    "prompts": ["prompts.jsonl", "prompts_metrics.json"],
    "generate": ["responses.jsonl", "generate_metrics.json"],
    "tokenize": ["samples.parquet", "tokenize_metrics.json"],
    "hidden_states": ["hidden_states", "hidden_states_metrics.json"],
}
DONE_MARK = {
    "prompts": "prompts.jsonl",
    "generate": "responses.jsonl",
    "tokenize": "samples.parquet",
    "hidden_states": "hidden_states/index.json",
}
# The store a stage's work goes to (relative to the project): its first commit marks the start of that work.
WORK_MARK = {"generate": ".draftdata/store.sqlite", "hidden_states": ".draftdata/states/index.sqlite"}
# The stages without a store: the line each logs as its work begins (prompts: reading the source; tokenize:
# tokenizing the responses it read, its tokenizer loaded) marks it.
LOG_MARK = {"prompts": f"prompts dataset={DATASET} reading=", "tokenize": f"tokenize dataset={DATASET} responses="}
# Every stage: the line it logs as the writing of its outputs begins (before the first temp file; hidden_states names
# its rank first).
WRITE_MARK = {
    "prompts": f"prompts dataset={DATASET} writing=",
    "generate": f"generate dataset={DATASET} writing=",
    "tokenize": f"tokenize dataset={DATASET} writing=",
    "hidden_states": f"hidden_states dataset={DATASET} rank=0 writing=",
}
MARKS = (*LOG_MARK.values(), *WRITE_MARK.values())
PHASES = ("before", "working", "writing", "written")
GOAL_EFFECTIVE = 50  # kills that land while a stage works or writes its outputs
GOAL_WRITING = 4  # kills that land while each stage writes its outputs
EFFECTIVE = ("working", "writing")  # the phases in which a kill can lose, duplicate or leave something stale


@dataclass(frozen=True)
class Scenario:
    name: str
    stage: str
    # embedded | openai (a real `transformers serve` behind the logging proxy) | sglang (the fake SGLang server, in
    # this process: it logs every request by its store key)
    backend: str = "embedded"
    # run: over the clean run's duration | work: from the creation of its store to its first output | write: over
    # its writing of outputs
    moment: str = "run"
    turns: str = "last"  # all: the multi-turn dataset (TURNS_SOURCE), every assistant turn regenerated

    @property
    def label(self) -> str:
        what = self.stage + ("" if self.stage != "generate" else f"/{self.backend}")
        what += ", turns: all" if self.turns == "all" else ""
        return what + {"run": "", "work": " (working)", "write": " (writing outputs)"}[self.moment]


SCENARIOS = [
    Scenario("prompts", "prompts"),
    Scenario("prompts_work", "prompts", moment="work"),
    Scenario("prompts_write", "prompts", moment="write"),
    Scenario("generate", "generate"),
    Scenario("generate_openai", "generate", backend="openai"),
    Scenario("generate_work", "generate", moment="work"),
    Scenario("generate_write", "generate", moment="write"),
    Scenario("generate_turns", "generate", backend="sglang", moment="work", turns="all"),
    Scenario("tokenize", "tokenize"),
    Scenario("tokenize_work", "tokenize", moment="work"),
    Scenario("tokenize_write", "tokenize", moment="write"),
    Scenario("hidden_states", "hidden_states"),
    Scenario("hidden_states_work", "hidden_states", moment="work"),
    Scenario("hidden_states_write", "hidden_states", moment="write"),
]


# The default turn of scenarios (three turns: 93 kills): the cheap aimed kills of prompts and tokenize, seconds each,
# five times; the writing of generate and hidden_states twice (a trial of either takes 15-25 s); the conversations
# of turns: all twice (a trial takes about 8 s); once each the work of generate and hidden_states, the server, and
# the uniform kills of prompts and tokenize (mostly in start-up). The uniform kills of generate and hidden_states are
# left out (nearly all land while the model loads). The work of generate and hidden_states comes first: its restart
# measures the writing before a kill is aimed at it.
CHEAP = ("prompts_work", "prompts_write", "tokenize_work", "tokenize_write")
ROTATION = (
    *CHEAP,
    "generate_work",
    "generate_turns",
    *CHEAP,
    "hidden_states_work",
    *CHEAP,
    "generate_write",
    "hidden_states_write",
    "generate_openai",
    "generate_turns",
    *CHEAP,
    "generate_write",
    "hidden_states_write",
    "prompts",
    *CHEAP,
    "tokenize",
)
TRIALS = 3 * len(ROTATION)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=TRIALS, help="kills in all, spread over the scenarios in turn")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    p.add_argument(
        "--scenarios",
        default=",".join(ROTATION),
        help="comma-separated, taken in turn (a name given twice gets twice the kills): "
        + ", ".join(s.name for s in SCENARIOS),
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the projects here (default: a temp directory, removed at the end)",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="the demo target, already built as the tests build it (default: built here)",
    )


# ---- projects and runs ------------------------------------------------------------------------------------------ #


class Project:
    """A project directory: params.yaml, data/D/, and the stores under .draftdata/ (run.store_path's default)."""

    def __init__(self, path: Path):
        self.path = path
        self.data = path / "data" / DATASET
        self.store = path / ".draftdata" / "store.sqlite"
        self.states = path / ".draftdata" / "states"
        self.log = path / "stage.log"
        self._looked_at = float("-inf")
        self._run_from = 0  # where the latest run's lines begin in the log (a restart appends to the killed run's)
        self._log_read = 0  # how much of the log was looked at for the marks
        self._marked: set[str] = set()  # the marks the latest run logged

    def create(self, params: dict) -> Project:
        self.data.mkdir(parents=True, exist_ok=True)
        (self.path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        return self

    def spawn(self, stage: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ("DRAFTDATA_STORE", "DRAFTDATA_PARAMS")}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # 2 cores: threads would only contend
        self.new_run()
        with open(self.log, "a") as log:  # every output held whole at its temp name (bench/reliability/held.py)
            return subprocess.Popen(
                [sys.executable, "-m", "bench.reliability.held", str(HOLD_S), f"stages.{stage}", f"dataset={DATASET}"],
                cwd=self.path,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def new_run(self) -> None:
        """The lines logged from now on are the next run's: a restart's marks are its own, not the killed run's."""
        self._run_from = self._log_read = self.log.stat().st_size if self.log.exists() else 0
        self._marked = set()

    def writing(self, stage: str) -> bool:
        """Whether the stage has begun writing its outputs: it logged the line it writes just before (a look at a
        log that has not grown is one stat)."""
        return self.logged(WRITE_MARK[stage])

    def working(self, stage: str) -> bool:
        """Whether the stage's work shows: its store holds a committed response (generate) or indexed sample
        (hidden_states), or its log the line it writes as its work begins (prompts, tokenize). The store's mere
        creation comes seconds earlier, before the model is loaded. A store is looked up at most every WORK_POLL_S
        (a SQLite read each time)."""
        if stage in LOG_MARK:
            return self.logged(LOG_MARK[stage])
        if not (self.path / WORK_MARK[stage]).exists():
            return False
        now = time.monotonic()
        if now - self._looked_at < WORK_POLL_S:
            return False
        self._looked_at = now
        return stored(self, stage) > 0

    def logged(self, mark: str) -> bool:
        """Whether a line the latest run logged begins with `mark`; the log is read again only when it has grown."""
        if mark not in self._marked:
            size = self.log.stat().st_size if self.log.exists() else 0
            if size != self._log_read:
                self._log_read = size
                with open(self.log, "rb") as f:
                    f.seek(self._run_from)
                    text = f.read().decode(errors="replace")
                self._marked.update(m for m in MARKS if text.startswith(m) or f"\n{m}" in text)
        return mark in self._marked

    def written(self, stage: str) -> bool:
        """Whether every output of the stage is in place."""
        return (self.data / DONE_MARK[stage]).exists() and all((self.data / n).exists() for n in OUTPUTS[stage])

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""


def dataset_params() -> dict:
    return {
        "source": {"shape": "magicoder_oss", "path": str(DEMO / "B3_magicoder.jsonl.gz")},
        "max_prompts": 150,
        "max_prompt_tokens": 512,
        "shuffle_seed": 0,
        "on_bad_record": "fail",
        "token_budget": BUDGET,
        "budget_unit": "completion",
        "max_tokens": 48,
        "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": -1},
        "on_budget": "cancel",
        "on_truncation": "keep",
        "concurrency": 8,
    }


def turns_dataset_params() -> dict:
    return dataset_params() | {
        "source": {"shape": "messages", "path": str(TURNS_SOURCE)},
        "max_prompts": TURNS_PROMPTS,
        "token_budget": TURNS_BUDGET,
        "max_tokens": 64,
        "turns": "all",
    }


def project_params(model: Path, backend: dict | None = None, dataset: dict | None = None) -> dict:
    params = {
        "model": {"path": str(model), "revision": None, "chat_template": None, "template_kwargs": {}},
        "tokenize": {"max_seq_len": 1024, "on_too_long": "drop", "train_on": "last_turn"},
        # a forward per sample and several shards: the compute pass commits shard by shard, and every sample's
        # arithmetic is the same whichever samples a restart has left to compute
        "hidden_states": {"layers": None, "dtype": "bfloat16", "batch_tokens": 256, "shard_max_tokens": 512},
        "run": {"log_every_s": 5.0},
        "datasets": {DATASET: dataset or dataset_params()},
    }
    if backend:
        params["backend"] = backend
    return params


def build_model(out: Path) -> Path:
    """The demo target as the tests build it (shorter responses than the demo's, so a run takes seconds)."""
    from draftdata.config.schema import TinyModelConfig
    from draftdata.model.tiny import build_target

    build_target(TinyModelConfig(path=str(out), corpus_dir=str(DEMO), mean_response_tokens=24))
    return out


@dataclass
class Timing:
    """A clean run's duration, how long it worked (from its first commit to the first sign of its main output) and
    how long it wrote (from there until every output was in place)."""

    seconds: float
    work_s: float
    write_s: float


def clean_run(project: Project, stage: str) -> Timing:
    proc = project.spawn(stage)
    timing = watch(project, stage, proc, RESTART_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"clean run of {stage} failed ({proc.returncode}): {project.tail()}")
    return timing


def watch(project: Project, stage: str, proc: subprocess.Popen, timeout: float) -> Timing:
    """Follow a run to its end (killed past `timeout`) and time its phases."""
    t0 = time.monotonic()
    work_at = write_at = done_at = None
    while proc.poll() is None:
        now = time.monotonic() - t0
        if now > timeout:
            proc.kill()
            proc.wait()
            break
        if work_at is None and project.working(stage):
            work_at = now
        if write_at is None and project.writing(stage):
            write_at = now
        if write_at is not None and done_at is None and project.written(stage):
            done_at = now
        time.sleep(POLL_S)
    seconds = time.monotonic() - t0
    write_at = seconds if write_at is None else write_at  # written between two looks just before the exit
    work_at = write_at if work_at is None else work_at
    return Timing(seconds, max(POLL_S, write_at - work_at), max(POLL_S, (done_at or seconds) - write_at))


# ---- the server ------------------------------------------------------------------------------------------------- #


# ---- the bench: what every trial shares -------------------------------------------------------------------------- #


@dataclass
class Clean:
    """The clean run's outputs, read once."""

    prompts: list
    prompts_metrics: dict
    responses: list
    store: dict
    samples: list
    samples_meta: dict
    tokenize_metrics: dict
    hs_dir: Path
    hs_samples: list
    hs_index: dict
    hs_norm: bytes


class Bench:
    def __init__(self, root: Path, scenarios: list[Scenario], stack: ExitStack, model: Path | None = None):
        self.root = root
        self.model = model or build_model(root / "model")
        self.base = Project(root / "clean").create(project_params(self.model))
        self.timing: dict[str, Timing] = {}
        for stage in ("prompts", "generate", "tokenize", "hidden_states"):
            self.timing[stage] = clean_run(self.base, stage)
        self.clean = read_clean(self.base)
        self.proxy = None
        self.openai: dict | None = None  # the backend params of the server scenario
        self.key_of_seed: dict[int, str] = {}
        self.fake = None  # the fake SGLang server of the turns: all scenario
        self.sglang: dict | None = None
        self.turns_base: Project | None = None  # its clean run
        self.clean_turns: CleanTurns | None = None
        # per timing key and field of Timing, every length measured since the clean run
        self.measured: dict[str, dict[str, list[float]]] = {}
        if any(s.backend == "openai" for s in scenarios):
            self._start_server(stack)
        if any(s.turns == "all" for s in scenarios):
            self._start_turns(stack)

    def _start_server(self, stack: ExitStack) -> None:
        from bench.reliability.kill_proxy import LoggingProxy

        url = stack.enter_context(transformers_serve(self.model, self.root / "serve.log", timeout=180.0))
        self.proxy = LoggingProxy(url)
        proxy_url = self.proxy.start()
        stack.callback(self.proxy.stop)
        self.key_of_seed = seeds_to_keys(self.base)
        # text back, no ids: `transformers serve` takes string prompts and rejects unknown fields
        self.openai = {
            "kind": "openai",
            "urls": [proxy_url],
            "prompt_format": "chat",
            "return_token_ids": False,
            "openai_fields_only": True,
            "request_timeout_s": 60.0,
        }
        on_server = next(s for s in SCENARIOS if s.backend == "openai")
        self.timing["generate_openai"] = clean_run(self.new_project("clean_openai", on_server), "generate")

    def _start_turns(self, stack: ExitStack) -> None:
        """The fake SGLang server (a thread of this process, so its log outlives every kill) and the clean run of
        the multi-turn dataset on it."""
        from transformers import AutoTokenizer

        from bench.fake_server import FakeServer, GreedyModel

        model = GreedyModel(AutoTokenizer.from_pretrained(self.model))
        self.fake = FakeServer(model=model, model_path=str(self.model), token_delay_s=TURN_TOKEN_DELAY_S).start()
        stack.callback(self.fake.stop)
        self.sglang = {"kind": "sglang", "urls": [self.fake.url], "request_timeout_s": 60.0}
        on_fake = next(s for s in SCENARIOS if s.turns == "all")
        self.turns_base = Project(self.root / "clean_turns").create(self.params_of(on_fake))
        clean_run(self.turns_base, "prompts")
        self.timing["generate_turns"] = clean_run(self.turns_base, "generate")
        self.clean_turns = CleanTurns(
            responses=read_jsonl(self.turns_base.data / "responses.jsonl"),
            store=checks.stored_responses(self.turns_base.store),
        )

    def params_of(self, scenario: Scenario) -> dict:
        backend = {"openai": self.openai, "sglang": self.sglang}.get(scenario.backend)
        return project_params(self.model, backend, turns_dataset_params() if scenario.turns == "all" else None)

    def new_project(self, name: str, scenario: Scenario) -> Project:
        """A fresh project for one run of `scenario`'s stage: its inputs from the clean run, empty stores."""
        path = self.root / name
        if path.exists():
            shutil.rmtree(path)
        project = Project(path).create(self.params_of(scenario))
        base = self.turns_base if scenario.turns == "all" else self.base
        for name in INPUTS[scenario.stage]:
            shutil.copy(base.data / name, project.data / name)
        return project

    def clear_wire(self) -> None:
        """Forget the requests the servers saw: a run's are logged from here."""
        if self.proxy:
            self.proxy.clear()
        if self.fake:
            self.fake.log.clear()

    def deliveries(self, scenario: Scenario) -> list[Delivery]:
        """The requests `scenario`'s server saw since `clear_wire`, by store key: the proxy's by the seed they
        carried, the fake SGLang server's by their rid (the key, then a suffix per attempt)."""
        if scenario.backend == "openai":
            return checks.deliveries(self.proxy.exchanges(), self.key_of_seed)
        if scenario.backend == "sglang":
            return [
                Delivery(a.rid.rsplit("-", 1)[0], a.finish in checks.COMPLETE) for a in list(self.fake.log) if a.rid
            ]
        return []

    def timing_of(self, scenario: Scenario) -> Timing:
        """The windows a kill of `scenario` is drawn in: each the lower quartile of the lengths measured so far
        (the clean run's, then the runs since). How long a phase takes changes from run to run with the machine's
        load, by a factor or two: one measurement, the clean run's or the latest, is too long as often as not, and a
        moment drawn within a window longer than the run's falls after it. Within the lower quartile, a moment
        falls within the phase of at least 3 runs in 4 and covers most of it."""
        key = timing_key(scenario)
        clean, seen = self.timing[key], self.measured.get(key, {})
        return Timing(**{f: lower_quartile([getattr(clean, f), *seen.get(f, [])]) for f in WINDOW.values()})

    def measure(self, scenario: Scenario, **lengths: float) -> None:
        """Take a run's `seconds`, `work_s` or `write_s` into the scenario's windows."""
        seen = self.measured.setdefault(timing_key(scenario), {})
        for field, length in lengths.items():
            seen.setdefault(field, []).append(length)


def lower_quartile(lengths: list[float]) -> float:
    return statistics.quantiles(lengths, n=4, method="inclusive")[0] if len(lengths) > 1 else lengths[0]


def timing_key(scenario: Scenario) -> str:
    if scenario.turns == "all":
        return "generate_turns"
    return "generate_openai" if scenario.backend == "openai" else scenario.stage


@dataclass
class CleanTurns:
    """The clean run of the multi-turn dataset: its output and its store."""

    responses: list
    store: dict


def read_clean(base: Project) -> Clean:
    import pyarrow.parquet as pq

    d = base.data
    hs = d / "hidden_states"
    return Clean(
        prompts=read_jsonl(d / "prompts.jsonl"),
        prompts_metrics=read_json(d / "prompts_metrics.json"),
        responses=read_jsonl(d / "responses.jsonl"),
        store=checks.stored_responses(base.store),
        samples=pq.read_table(d / "samples.parquet").to_pylist(),
        samples_meta=pq.read_schema(d / "samples.parquet").metadata,
        tokenize_metrics=read_json(d / "tokenize_metrics.json"),
        hs_dir=hs,
        hs_samples=hs_sample_list(hs),
        hs_index=read_json(hs / "index.json"),
        hs_norm=(hs / "final_norm.safetensors").read_bytes(),
    )


def seeds_to_keys(base: Project) -> dict[int, str]:
    """Every request's sampling seed -> its store key: the seed a request carries on the wire names its response."""
    from draftdata.config.load import load_config
    from draftdata.generate.backends.protocol import seed_of
    from draftdata.generate.plan.planning import plan_requests
    from draftdata.model.target import load_target
    from draftdata.util.sqlite import hash_cache_path

    # the model's file hashes are cached beside the store, not in this process's directory
    cfg = load_config(DATASET, [], params_path=base.path / "params.yaml")
    target = load_target(cfg, hash_cache_path(Path(base.store)))
    plan = plan_requests(cfg, read_jsonl(base.data / "prompts.jsonl"), target)
    return {seed_of(p.key): p.key for p in plan}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def hs_sample_list(hs: Path) -> list[dict]:
    """The hidden-state output's sample list, less where each sample sits (shard names are random per run)."""
    import pyarrow.parquet as pq

    return [
        {k: v for k, v in r.items() if k not in ("shard", "row")}
        for r in pq.read_table(hs / "samples.parquet").to_pylist()
    ]


# ---- one trial -------------------------------------------------------------------------------------------------- #


# The window each kind of moment is drawn in (a field of Timing).
WINDOW = {"run": "seconds", "work": "work_s", "write": "write_s"}


@dataclass
class Shot:
    """One kill attempt: when the kill was sent (seconds from the start; None when the run ended before it), how
    long the window drawn in really lasted in a run that ended first (from its start to the exit), and, aimed at
    the writing, how long the work before it lasted."""

    moment: float | None
    ran_s: float | None = None
    work_s: float | None = None


def kill_once(project: Project, scenario: Scenario, timing: Timing, rng: random.Random) -> Shot:
    """Start the stage and SIGKILL it at a moment drawn in the scenario's window."""
    t0 = time.monotonic()
    proc = project.spawn(scenario.stage)
    start, work_at = t0, None
    if scenario.moment != "run":
        started = project.working if scenario.moment == "work" else project.writing
        while not started(scenario.stage) and proc.poll() is None:
            if work_at is None and project.working(scenario.stage):  # aimed at the writing: the work went by whole
                work_at = time.monotonic()
            time.sleep(POLL_S)
        start = time.monotonic()
    work_s = start - work_at if work_at is not None and proc.poll() is None else None
    deadline = start + rng.uniform(0.0, getattr(timing, WINDOW[scenario.moment]))
    while proc.poll() is None and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(POLL_S, left))
    if proc.poll() is not None:
        return Shot(None, ran_s=time.monotonic() - start, work_s=work_s)
    proc.kill()
    proc.wait()
    return Shot(round(deadline - t0, 4), work_s=work_s)


def phase_at_kill(project: Project, stage: str) -> str:
    """Where the kill landed: before any work showed, working (a store held some, or the log said the work had
    begun), writing outputs, or after the output was complete (on the way out)."""
    if project.written(stage):
        return "written"
    if project.writing(stage):
        return "writing"
    if stored(project, stage) or (stage in LOG_MARK and project.logged(LOG_MARK[stage])):
        return "working"
    return "before"


def stored(project: Project, stage: str) -> int:
    """What the stage's store holds: responses (generate) or indexed samples (hidden_states)."""
    if stage == "generate":
        return count_rows(project.store, "responses")
    if stage == "hidden_states":
        return count_rows(project.states / "index.sqlite", "states")
    return 0


def listing(data: Path) -> list[str]:
    """The dataset's files (temp files included) and the hidden-state output's, less its shards."""
    return sorted(str(p.relative_to(data)) for p in data.rglob("*") if p.is_file() and p.parent.name != "shards")


def count_rows(path: Path, table: str) -> int:
    import sqlite3

    if not path.exists():
        return 0
    con = sqlite3.connect(path)
    try:  # killed before the schema was created: nothing stored yet
        return con.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] if checks.has_table(con, table) else 0
    finally:
        con.close()


def store_problems(project: Project) -> list[Problem]:
    return (
        checks.sqlite_problems(project.store, {"responses": "key"})
        + checks.sqlite_problems(project.states / "index.sqlite", {"states": "key", "shards": "name"})
        + checks.state_store_problems(project.states)
    )


def outputs_of(project: Project, stage: str) -> list[Path]:
    return [project.data / name for name in OUTPUTS[stage]]


def after_restart(
    bench: Bench, project: Project, scenario: Scenario, snapshot: dict, killed: list, restart: list
) -> list[Problem]:
    problems = store_problems(project) + checks.file_problems(outputs_of(project, scenario.stage))
    missing = [p.name for p in outputs_of(project, scenario.stage) if not p.exists()]
    if missing:
        return problems + [Problem("lost", len(missing), f"no {', '.join(missing)} after the restart")]
    if problems:
        return problems  # a store or an output that does not read: comparing it would only fail to read it again
    compare = {
        "prompts": compare_prompts,
        "generate": compare_generate,
        "tokenize": compare_tokenize,
        "hidden_states": compare_hidden_states,
    }[scenario.stage]
    try:
        return compare(bench, project, scenario, snapshot, killed, restart)
    except Exception as e:  # an output the comparisons cannot read (a missing column, a broken link) is wrong too
        return [Problem("stale", 1, f"outputs unreadable: {type(e).__name__}: {e}")]


def compare_prompts(bench: Bench, project: Project, *_) -> list[Problem]:
    c = bench.clean
    return checks.compare_rows(
        "prompts.jsonl", read_jsonl(project.data / "prompts.jsonl"), c.prompts, "id"
    ) + checks.compare_json("prompts_metrics.json", read_json(project.data / "prompts_metrics.json"), c.prompts_metrics)


def compare_tokenize(bench: Bench, project: Project, *_) -> list[Problem]:
    import pyarrow.parquet as pq

    c, path = bench.clean, project.data / "samples.parquet"
    problems = checks.compare_rows("samples.parquet", pq.read_table(path).to_pylist(), c.samples, "id")
    if pq.read_schema(path).metadata != c.samples_meta:
        problems.append(Problem("stale", 1, "samples.parquet: metadata differs from the clean run's"))
    return problems + checks.compare_json(
        "tokenize_metrics.json", read_json(project.data / "tokenize_metrics.json"), c.tokenize_metrics
    )


def compare_hidden_states(bench: Bench, project: Project, *_) -> list[Problem]:
    c, hs = bench.clean, project.data / "hidden_states"
    problems = checks.compare_rows("hidden_states/samples.parquet", hs_sample_list(hs), c.hs_samples, "id")
    # shard names are random per run: the rest of the index is the clean run's
    problems += checks.compare_json(
        "hidden_states/index.json", read_json(hs / "index.json"), c.hs_index, ignore=("shards",)
    )
    if (hs / "final_norm.safetensors").read_bytes() != c.hs_norm:
        problems.append(Problem("stale", 1, "final_norm.safetensors differs from the clean run's"))
    return problems + checks.compare_states(hs, c.hs_dir)


def compare_generate(
    bench: Bench, project: Project, scenario: Scenario, snapshot: dict, killed: list, restart: list
) -> list[Problem]:
    rows = read_jsonl(project.data / "responses.jsonl")
    final = checks.stored_responses(project.store)
    if scenario.turns == "all":
        return compare_turns(bench, project, snapshot, killed, restart, rows, final)
    problems = checks.output_vs_store(rows, bench.clean.prompts, final, DATASET, BUDGET)
    problems += checks.committed_kept(snapshot, final)
    if scenario.backend == "openai":
        return problems + checks.wire_problems(killed, restart, snapshot, final)
    problems += checks.same_as_clean(final, bench.clean.store)
    problems += checks.compare_common("responses.jsonl", rows, bench.clean.responses, "key")
    return problems + checks.accounting(snapshot, final, read_json(project.data / "generate_metrics.json"))


def compare_turns(
    bench: Bench, project: Project, snapshot: dict, killed: list, restart: list, rows: list, final: dict
) -> list[Problem]:
    """turns: all: no turn requested again once stored, nothing stored lost, and every conversation's turns, keys
    and answers those of the clean run (the next turn's key is built from the answers before it)."""
    c = bench.clean_turns
    return (
        checks.committed_kept(snapshot, final)
        + checks.delivery_problems(killed, restart, snapshot, final)
        + checks.unknown_keys(final, c.store)
        + checks.same_as_clean(final, c.store)
        + checks.compare_rows("responses.jsonl", rows, c.responses, "key")
        + checks.accounting(snapshot, final, read_json(project.data / "generate_metrics.json"))
    )


def trial(bench: Bench, scenario: Scenario, index: int, rng: random.Random) -> dict:
    t0 = time.monotonic()
    row = {
        "trial": index,
        "scenario": scenario.name,
        "stage": scenario.stage,
        "backend": scenario.backend,
        "moment": scenario.moment,
        "turns": scenario.turns,
        "killed": False,
        "kill_s": None,
        "window_s": None,  # the window the (last) moment was drawn in
        "draws": 0,
        "phase": None,
        "missed": False,  # the run ended before each of MAX_DRAWS kill moments: no kill landed
        "failure": None,  # the restart failed, or a check could not run
        "problems": [],
        "tmp_left": 0,
        "conversations_resumed": None,  # turns: all: conversations the kill cut between turns
        **dict.fromkeys(checks.KINDS, 0),
    }
    for draw in range(1, MAX_DRAWS + 1):
        project = bench.new_project(f"trial_{index:03d}", scenario)
        bench.clear_wire()
        window = bench.timing_of(scenario)
        shot = kill_once(project, scenario, window, rng)
        row["draws"], row["kill_s"] = draw, shot.moment
        row["window_s"] = round(getattr(window, WINDOW[scenario.moment]), 4)
        if shot.work_s is not None:
            bench.measure(scenario, work_s=shot.work_s)
        if shot.moment is not None:
            break
        # the run ended before its moment: the window drawn in was longer than this run's, which bounds it
        bench.measure(scenario, **{WINDOW[scenario.moment]: shot.ran_s})
    else:
        row["missed"] = True
        return row
    row["killed"] = True
    try:
        problems = restart_and_check(bench, project, scenario, row)
    except Exception as e:  # a check that cannot read what the kill left: the trial says so, the suite goes on
        row["failure"] = f"check failed: {type(e).__name__}: {e}"
        problems = []
    row.update(checks.tally(problems))
    row["problems"] = [str(p) for p in problems]
    row["tmp_left"] = len(checks.temp_files(project.path))
    row["seconds"] = round(time.monotonic() - t0, 1)
    return row


def restart_and_check(bench: Bench, project: Project, scenario: Scenario, row: dict) -> list[Problem]:
    """What the kill left, then the restart to completion and what it left."""
    row["phase"] = phase_at_kill(project, scenario.stage)
    row["files_at_kill"] = listing(project.data)
    row["stored_at_kill"] = stored(project, scenario.stage)
    problems = store_problems(project) + checks.file_problems(outputs_of(project, scenario.stage))
    snapshot = checks.stored_responses(project.store) if scenario.stage == "generate" else {}
    killed = bench.deliveries(scenario)
    bench.clear_wire()
    row["delivered_before_kill"] = sum(d.complete for d in killed)
    proc = project.spawn(scenario.stage)
    timing = watch(project, scenario.stage, proc, RESTART_TIMEOUT_S)
    rc = proc.returncode
    if rc == 0:
        bench.measure(scenario, **anew(timing, row["stored_at_kill"]))
    if rc != 0:
        row["failure"] = f"restart exited {rc}: {project.tail()[-300:]}"
    restart = bench.deliveries(scenario)
    if scenario.turns == "all" and rc == 0:
        rows = read_jsonl(project.data / "responses.jsonl")
        row["conversations_resumed"] = checks.resumed_conversations(rows, snapshot)
    return problems + after_restart(bench, project, scenario, snapshot, killed, restart)


def anew(restart: Timing, stored_at_kill: int) -> dict[str, float]:
    """What a restart measured of the phases it went through whole: the writing always (every output is written
    anew), the work and the run when the kill had left nothing in the store (else the restart reused it)."""
    if stored_at_kill:
        return {"write_s": restart.write_s}
    return {"seconds": restart.seconds, "work_s": restart.work_s, "write_s": restart.write_s}


# ---- the suite -------------------------------------------------------------------------------------------------- #


def run(args) -> dict:
    chosen = [s for name in args.scenarios.split(",") for s in SCENARIOS if s.name == name.strip()]
    if not chosen:
        raise SystemExit(f"--scenarios: none of {args.scenarios!r}; choose from {[s.name for s in SCENARIOS]}")
    rng = random.Random(args.seed)
    with ExitStack() as stack:
        root = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="draftdata-kill-")))
        root.mkdir(parents=True, exist_ok=True)
        bench = Bench(root, chosen, stack, args.model)
        rows = []
        for i in range(args.trials):
            rows.append(trial(bench, chosen[i % len(chosen)], i, rng))
            print_row(rows[-1])
        timing = {k: rounded(t) for k, t in bench.timing.items()}
        windows = {timing_key(s): rounded(bench.timing_of(s)) for s in chosen}  # as the last kills were drawn
        measured = {k: {f: [round(x, 4) for x in xs] for f, xs in seen.items()} for k, seen in bench.measured.items()}
    summary = summarise(rows, chosen)
    by_stage = summarise_stages(rows)
    print_table(summary)
    print_stages(by_stage)
    figures = {"kill_trials": sum(r["killed"] for r in rows), "kill_effective": effective(rows)}
    figures.update({f"kill_{k}": sum(r[k] for r in rows) for k in checks.KINDS})
    return {
        "figures": figures,
        "rows": rows,
        "goal_met": goal_met(figures, rows, by_stage),
        "summary": summary,
        "by_stage": by_stage,
        "clean_runs": timing,
        "windows": windows,
        "windows_measured": measured,
        "seed": args.seed,
        "dataset": dataset_params(),
    }


def rounded(t: Timing) -> dict[str, float]:
    return {"seconds": round(t.seconds, 2), "work_s": round(t.work_s, 3), "write_s": round(t.write_s, 3)}


def goal_met(figures: dict, rows: list[dict], by_stage: list[dict]) -> bool:
    """GOAL_EFFECTIVE kills that landed while a stage worked or wrote, every stage's writing hit GOAL_WRITING times,
    no restart or check that failed, and nothing lost, duplicated or stale."""
    return (
        figures["kill_effective"] >= GOAL_EFFECTIVE
        and {s["stage"] for s in by_stage if s["phases"]["writing"] >= GOAL_WRITING} == set(INPUTS)
        and not any(r["failure"] for r in rows)
        and not any(figures[f"kill_{k}"] for k in checks.KINDS)
    )


def effective(rows: list[dict]) -> int:
    """Kills that landed while the stage worked or wrote its outputs: the only ones that could lose anything."""
    return sum(r["killed"] and r["phase"] in EFFECTIVE for r in rows)


def phase_counts(rows: list[dict]) -> dict[str, int]:
    phases = Counter(r["phase"] for r in rows if r["killed"])
    return {p: phases[p] for p in PHASES}


def summarise(rows: list[dict], scenarios: list[Scenario]) -> list[dict]:
    out = []
    for s in dict.fromkeys(scenarios):  # a scenario named twice in --scenarios runs twice as often
        mine = [r for r in rows if r["scenario"] == s.name]
        out.append(
            {
                "scenario": s.name,
                "label": s.label,
                "trials": sum(r["killed"] for r in mine),
                "effective": effective(mine),
                **{k: sum(r[k] for r in mine) for k in checks.KINDS},
                "missed": sum(r["missed"] for r in mine),
                "failures": sum(r["failure"] is not None for r in mine),
                "tmp_left": sum(r["tmp_left"] for r in mine),
                "conversations_resumed": sum(r.get("conversations_resumed") or 0 for r in mine),
                "phases": phase_counts(mine),
            }
        )
    return out


def summarise_stages(rows: list[dict]) -> list[dict]:
    """Per stage (every scenario of it together): where its kills landed, and how many could lose anything."""
    stages = [st for st in INPUTS if any(r["stage"] == st for r in rows)]
    return [
        {
            "stage": st,
            "trials": sum(r["killed"] for r in rows if r["stage"] == st),
            "effective": effective([r for r in rows if r["stage"] == st]),
            "phases": phase_counts([r for r in rows if r["stage"] == st]),
        }
        for st in stages
    ]


def print_row(r: dict) -> None:
    counts = " ".join(f"{k}={r[k]}" for k in checks.KINDS)
    print(
        f"kill trial={r['trial']} scenario={r['scenario']} window_s={r['window_s']} kill_s={r['kill_s']} "
        f"phase={r['phase']} {counts}"
        + (f" missed: the run ended before each of {MAX_DRAWS} kill moments" if r["missed"] else "")
        + (f" failure={r['failure']!r}" if r["failure"] else "")
        + "".join(f"\n  {p}" for p in r["problems"]),
        flush=True,
    )


def print_table(summary: list[dict]) -> None:
    counted = ("trials", "effective", *checks.KINDS, "missed", "failures")
    head = ["stage/backend", *counted, "killed: before/working/writing/written", "temp files left"]
    lines = [
        [s["label"], *(s[k] for k in counted), "/".join(str(n) for n in s["phases"].values()), s["tmp_left"]]
        for s in summary
    ]
    total = [
        "all",
        *(sum(s[k] for s in summary) for k in counted),
        "/".join(str(sum(s["phases"][p] for s in summary)) for p in summary[0]["phases"]),
        sum(s["tmp_left"] for s in summary),
    ]
    print_lines([head, *lines, total])


def print_stages(by_stage: list[dict]) -> None:
    head = ["stage", "trials", *(f"killed {p}" for p in PHASES), "effective"]
    lines = [[s["stage"], s["trials"], *s["phases"].values(), s["effective"]] for s in by_stage]
    total = ["all", *(sum(line[i] for line in lines) for i in range(1, len(head)))]
    print()
    print_lines([head, *lines, total])


def print_lines(lines: list[list]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(*lines)]
    for line in lines:
        print("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(line, widths))))
