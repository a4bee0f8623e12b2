"""`draftdata plan`: what the budgets will cost, read from the store and the model's config, nothing sent."""

from __future__ import annotations

import gzip
import json
import math
import os
import socket
import sqlite3
import subprocess
import sys
import threading

import pytest
from conftest import DEMO, ROOT, dataset_params

from draftdata.config.load import load_config
from draftdata.errors import ConfigError
from draftdata.util.files import read_jsonl


def plan(project, *overrides, opts=None):
    from draftdata.cli.plan import main

    cfg = load_config(None, list(overrides), params_path=project.path / "params.yaml", need_dataset=False)
    return main(cfg, opts)


def one(project, *overrides, opts=None):
    (p,) = plan(project, *overrides, opts=opts)
    return p


def stored_usable(project) -> list[int]:
    """Completion lengths of the complete, non-empty responses in the store (the test store holds B3 only)."""
    with sqlite3.connect(project.path / "store.sqlite") as db:
        rows = db.execute("SELECT completion_tokens, text FROM responses WHERE finish_reason IN ('stop', 'length')")
        return [n for n, text in rows if n > 0 and text.strip()]


def test_before_generation_every_token_is_still_to_generate(project, capsys):
    p = one(project)
    with gzip.open(DEMO / "B3_magicoder.jsonl.gz", "rt") as f:
        records = sum(1 for line in f if line.strip())
    assert (p.prompts, p.prompts_left) == (records, None) and "not run" in p.prompts_from
    assert (p.reusable, p.parked, p.to_generate) == (0, 0, 400)
    assert p.mean_completion_from == "max_tokens/2" and p.requests == math.ceil(400 / 24)
    assert "prompts stage not run" in capsys.readouterr().out

    project.run("prompts", "B3")
    n_prompts = len(list(read_jsonl(project.data("B3") / "prompts.jsonl")))
    p = one(project)
    assert (p.prompts, p.prompts_left, p.prompts_from) == (n_prompts, n_prompts, "prompts.jsonl")
    assert (p.reusable, p.to_generate) == (0, 400)
    assert p.tok_s is None and p.gpu_s is None  # nothing measured, nothing given
    assert not (project.path / "store.sqlite").exists()  # planning creates no store


def test_reusable_tokens_are_what_the_store_holds(project, capsys, tiny_model):
    project.set("datasets.B3.token_budget", 500)
    project.run("prompts", "B3")
    project.run("generate", "B3")
    gm = json.loads((project.data("B3") / "generate_metrics.json").read_text())
    lengths = stored_usable(project)
    held = sum(lengths)
    assert held >= 500 and gm["budget_met"]
    assert len(lengths) >= 16  # enough for the mean of the stored lengths (the controller's rule) to be used

    capsys.readouterr()  # the stages' own logs
    p = one(project)
    assert (p.reusable, p.reusable_responses, p.to_generate, p.requests) == (held, len(lengths), 0, 0)
    assert p.mean_completion_from == f"{len(lengths)} stored"
    assert p.mean_completion == round(held / len(lengths), 1)
    # the rate with the requests in flight it was read at (the tests' B3 runs 8 at most)
    assert (p.tok_s, p.tok_s_from, p.gpu_s) == (gm["new_tok_per_s"], "measured @8", 0.0)
    assert one(project, "datasets.B3.concurrency=2").tok_s_from == "measured @8, now 2"
    # disk: responses.jsonl measured; hidden states 2·(k+1)·H + the int32 id, k = 3 EAGLE-3 layers of the target
    hidden = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    per_token = (project.data("B3") / "responses.jsonl").stat().st_size / (
        gm["prompt_tokens"] + gm["completion_tokens"]
    )
    assert p.responses_from == "measured" and p.responses_bytes == round(p.sequence_tokens * per_token)
    assert p.hidden_bytes == p.sequence_tokens * (2 * 4 * hidden + 4)
    assert p.sequence_tokens > 500  # the prompts come along with a completion budget
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "plan: 1 dataset(s); nothing is sent to any server"
    assert max(len(line) for line in out if not line.startswith("target: ")) <= 120  # the path's line may not

    # a raised budget: what is stored counts, the difference is to generate
    project.set("datasets.B3.token_budget", held + 500)
    p = one(project, opts=_opts(tok_s=250.0))
    assert (p.reusable, p.to_generate) == (held, 500)
    assert p.requests == math.ceil(500 / (held / len(lengths)))
    assert (p.tok_s_from, p.gpu_s) == ("given", 2.0)
    # counted as prompt + completion: the rate is the completions', so the time is that of their share alone
    stored_total = one(project, "datasets.B3.budget_unit=total").reusable  # the stored answers' prompts count too
    total = one(
        project,
        "datasets.B3.budget_unit=total",
        f"datasets.B3.token_budget={stored_total + 2000}",
        opts=_opts(tok_s=250.0),
    )
    assert total.mean_prompt > 0 and total.to_generate == 2000
    share = total.mean_completion / (total.mean_completion + total.mean_prompt)
    assert total.gpu_s == pytest.approx(total.to_generate * share / 250.0, rel=0.01)
    assert total.gpu_s < total.to_generate / 250.0
    fp8 = one(project, "hidden_states.dtype=fp8")
    assert 0.5 < fp8.hidden_bytes / p.hidden_bytes < 0.55

    # far more than the prompts hold: said in a note; plan.out writes the same numbers as JSON
    project.set("datasets.B3.token_budget", 100_000)
    capsys.readouterr()
    p = one(project, opts=_opts(out=str(project.path / "plan.json")))
    assert p.requests > p.prompts_left
    assert f"B3: about {p.requests:,} requests needed, {p.prompts_left} prompts left" in capsys.readouterr().out
    doc = json.loads((project.path / "plan.json").read_text())
    assert doc["datasets"][0]["to_generate"] == doc["total"]["to_generate"] == 100_000 - held


def test_the_disk_per_trained_token_in_bf16_fp8_and_online(project, capsys, tiny_model):
    """The hidden states' bytes per token as stored, and per token the loss mask trains (÷ the trained share):
    estimated from the mean lengths before tokenize has run, counted by tokenize after; online training's is 0."""
    project.set("datasets.B3.token_budget", 300)
    project.run("prompts", "B3")
    project.run("generate", "B3")
    hidden = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    p = one(project)
    share = p.mean_completion / (p.mean_prompt + p.mean_completion)
    assert p.trained_share_from == "estimate" and p.trained_share == pytest.approx(
        share, abs=1e-3
    )  # of the rounded means
    project.run("tokenize", "B3")
    capsys.readouterr()
    p = one(project, opts=_opts(out=str(project.path / "plan.json")))
    tm = json.loads((project.data("B3") / "tokenize_metrics.json").read_text())
    assert p.trained_share_from == "measured" and p.trained_share == round(tm["trained_tokens"] / tm["tokens"], 4)
    # 3 EAGLE-3 layers + the final state: H values each, 2 bytes in bf16, 1 in fp8 with a float32 scale; the id
    # the target's top-20 policy alone (ModelOpt's k, where none is set): an int32 token and a float32 log-prob each
    bf16, fp8, policy = 4 * 2 * hidden + 4, 4 * (hidden + 4) + 4, 20 * 8 + 4
    doc = json.loads((project.path / "plan.json").read_text())
    assert doc["model"]["disk_per_token"] == {"bfloat16": bf16, "fp8": fp8, "policy": policy, "online": 0}
    per_trained = doc["datasets"][0]["hidden_bytes_per_trained_token"]
    assert per_trained == {
        d: round(n / p.trained_share) for d, n in (("bfloat16", bf16), ("fp8", fp8), ("policy", policy))
    } | {"online": 0}
    assert 1 < per_trained["bfloat16"] / bf16 == pytest.approx(1 / p.trained_share, rel=1e-3)
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("hidden states on disk: per token"))
    assert out[header + 1].startswith("policy: the target's top-20 (ModelOpt's k) next-token policy alone")
    assert out[header + 2].split() == [
        "dataset", "trained", "share", "share", "from", "bf16", "bf16/trained", "fp8", "fp8/trained", "policy",
        "policy/trained", "online",
    ]  # fmt: skip
    row = out[header + 3].split()
    assert row[:3] == ["B3", f"{p.trained_share:.3f}", "measured"] and row[-2:] == ["0", "B"]
    assert row[3:5] == [str(bf16), "B"] and row[7:9] == [str(fp8), "B"] and row[11:13] == [str(policy), "B"]
    assert max(len(line) for line in out if not line.startswith("target: ")) <= 120


def test_the_plan_renders_with_the_datasets_template_kwargs(project):
    """plan computes the keys generate computes: under a thinking template, what a dataset with thinking off stored
    counts toward it, and none of it for the same prompts with thinking on (other ids, so other keys)."""
    project.set("model.chat_template", str(ROOT / "conf" / "templates" / "qwen3_thinking.jinja"))
    project.set("datasets.B3.template_kwargs", {"enable_thinking": False})
    project.set("datasets.B3.token_budget", 100)
    project.run("prompts", "B3")
    project.run("generate", "B3")
    assert one(project).reusable == sum(stored_usable(project)) >= 100
    assert one(project, "datasets.B3.template_kwargs.enable_thinking=true").reusable == 0


def _opts(**kw):
    from draftdata.cli.plan import Options

    return Options(**kw)


class ConnectionCounter:
    """A loopback socket that accepts and counts every connection made to it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sock.close()


def test_the_plan_warns_of_samples_longer_than_max_seq_len(project, capsys):
    """max_prompt_tokens + max_tokens over tokenize.max_seq_len (the project's 1,024): tokenize would drop the
    longer samples after their tokens counted toward the budget; over the tiny target's context (4,096) too."""
    one(project)
    assert "warning:" not in capsys.readouterr().out  # 512 + 48 fit
    one(project, "datasets.B3.max_tokens=600", opts=_opts(out=str(project.path / "plan.json")))
    (warning,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert "datasets.B3.max_prompt_tokens + datasets.B3.max_tokens = 1,112 exceeds tokenize.max_seq_len" in warning
    assert json.loads((project.path / "plan.json").read_text())["warnings"] == [warning.removeprefix("warning: ")]
    one(project, "datasets.B3.max_tokens=3700")
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2 and "exceeds the target's context (4,096, model.path)" in warnings[1]
    one(project, "datasets.B3.max_prompt_tokens=null")
    (warning,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert "datasets.B3.max_prompt_tokens is null" in warning and "may exceed tokenize.max_seq_len" in warning


def test_nothing_is_sent_and_no_weights_are_loaded(project, monkeypatch):
    import transformers

    import draftdata.generate.embedded.backend
    import draftdata.model.load

    def no_weights(*args, **kwargs):
        raise AssertionError("the plan loaded the model's weights")

    for owner in (draftdata.model.load, draftdata.generate.embedded.backend):
        monkeypatch.setattr(owner, "load_model", no_weights)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    server = ConnectionCounter()
    try:
        project.params["backend"] = {"kind": "sglang", "urls": [server.url]}
        project.save()
        project.run("prompts", "B3")
        p = one(project, opts=_opts(tok_s=100.0))
        assert p.to_generate == 400 and p.gpu_s == 4.0
        assert server.connections == 0
        socket.create_connection(server.sock.getsockname(), timeout=5).close()  # the counter does count
        for _ in range(100):
            if server.connections:
                break
            threading.Event().wait(0.05)
        assert server.connections == 1
    finally:
        server.close()


def test_bad_params_stop_the_plan_with_one_line(project):
    project.params["datasets"]["B1"] = dataset_params("B1_glaive", "glaive", token_budget=-1)
    project.save()
    # checked whole: a bad value in a dataset that is not planned still stops it
    with pytest.raises(ConfigError, match=r"^datasets\.B1\.token_budget: must be a positive integer"):
        plan(project, "dataset=B3")

    project.params["datasets"]["B1"]["token_budget"] = 100
    project.params["datasets"]["B3"]["concurency"] = 8
    project.save()
    res = subprocess.run(
        [sys.executable, "-m", "draftdata", "plan", "plan.tok_s=100"],
        cwd=project.path,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("error: datasets.B3.concurency: unknown key") and res.stderr.count("\n") == 1


def test_a_template_ending_the_turn_where_the_target_does_not_stop_stops_the_plan(project, harmony_model, capsys):
    """gpt-oss's <|end|> closes a message, not the turn: a template that ends the final assistant message with it
    stops the plan in check_params' one line, also before the prompts stage (when no dataset loads the tokenizer)."""
    from conftest import HARMONY_TEMPLATE

    project.set("model.path", str(harmony_model))
    project.set("hidden_states.layers", [0, 1])  # two layers: too few for EAGLE-3's default
    assert one(project).to_generate == 400  # the target's own template ends the turn with <|return|>: planned
    closes_with_end = project.path / "closes_with_end.jinja"
    closes_with_end.write_text(HARMONY_TEMPLATE.replace("'<|return|>'", "'<|end|>'"))
    project.set("model.chat_template", str(closes_with_end))
    capsys.readouterr()
    with pytest.raises(ConfigError) as err:
        plan(project)
    message = str(err.value)
    assert message.startswith("model.chat_template: the chat template ends an assistant turn with '<|end|>'")
    assert "\n" not in message and "plan:" not in capsys.readouterr().out
    with pytest.raises(ConfigError) as check:
        project.run("check_params", None)
    assert str(check.value) == message


def test_an_unpinned_hub_source_is_a_warning_of_the_plan(project, capsys):
    """Checked whole, as check_params does: a hub source without a commit in a dataset not planned is named too."""
    source = {"shape": "glaive", "hf_name": "glaiveai/glaive-function-calling-v2", "revision": None}
    project.params["datasets"]["B1"] = dataset_params("B1_glaive", "glaive", source=source)
    project.save()
    plan(project, "dataset=B3")
    warned = [line for line in capsys.readouterr().out.splitlines() if "warning=" in line]
    assert len(warned) == 1 and "datasets.B1.source.revision is None, not a commit hash" in warned[0]

    project.params["datasets"]["B1"]["source"]["revision"] = "f" * 40
    project.save()
    plan(project, "dataset=B3")
    assert "warning=" not in capsys.readouterr().out


def test_plan_options_are_checked():
    from draftdata.cli.plan import parse_options, split_options

    raw, rest = split_options(["dataset=B3", "plan.tok_s=1500", "plan.out=p.json", "datasets.B3.max_tokens=9"])
    assert rest == ["dataset=B3", "datasets.B3.max_tokens=9"]
    assert parse_options(raw) == _opts(tok_s=1500.0, out="p.json")
    with pytest.raises(ConfigError, match=r"^plan\.tok_s: must be a positive number"):
        parse_options({"plan.tok_s": "0"})
    with pytest.raises(ConfigError, match=r"^plan\.tokens: unknown key"):
        parse_options({"plan.tokens": "1"})


def test_a_fresh_clone_plans_before_the_demo_target_is_built(tmp_path, monkeypatch, capsys):
    """The demo's target does not exist before `dvc repro packaged_model`, and it looks like a hub id then: the plan
    says which stage makes it and plans what it can, instead of trying huggingface.co."""
    import shutil

    from draftdata.cli.plan import main

    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("conf", "sources"):
        shutil.copytree(ROOT / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # were the hub asked, fail at once rather than after its retries
    cfg = load_config(None, [], params_path=tmp_path / "params.yaml", need_dataset=False)
    assert cfg.model.path == "models/smollm2-135m-instruct" and not (tmp_path / "models").exists()
    plans = main(cfg)
    out = capsys.readouterr().out
    assert "models/smollm2-135m-instruct does not exist yet; dvc.yaml's stage packaged_model makes it" in out
    assert "huggingface" not in out
    assert [p.dataset for p in plans] == list(cfg.datasets)
    assert all(p.prompts and p.prompts_from.startswith("source") and p.to_generate == p.budget for p in plans)


def test_turns_all_plans_every_turn_of_every_conversation(project, capsys):
    """With turns: all a request is a turn: the source turns are the prompt records' slots, and what the store holds
    is found by walking each conversation over its stored turns, as generate does (a conversation's later turns
    are keyed by the target's earlier answers, never by the source's last prompt)."""
    project.params["datasets"] = {"B6": dataset_params("B6_ultrachat", "messages", max_prompts=40, turns="all")}
    project.set("datasets.B6.token_budget", 300)
    project.run("prompts", "B6")
    records = list(read_jsonl(project.data("B6") / "prompts.jsonl"))
    turns = sum(len(r["slots"]) for r in records)
    assert turns > len(records)  # multi-turn: more requests to send than prompts

    p = one(project, opts=_opts(out=str(project.path / "plan.json")))
    assert (p.prompts, p.turns, p.prompts_left) == (len(records), turns, turns)
    assert p.requests == math.ceil(300 / 24) and p.turns_per_conversation == round(turns / len(records), 2)
    assert p.conversations_needed == math.ceil(300 / (24 * turns / len(records)))
    out = capsys.readouterr().out
    assert f"B6: turns: all: {len(records)} conversations of {turns / len(records):.2f} turns on average" in out
    assert json.loads((project.path / "plan.json").read_text())["datasets"][0]["turns"] == turns

    project.run("generate", "B6")
    gm = json.loads((project.data("B6") / "generate_metrics.json").read_text())
    assert gm["budget_met"] and gm["turns_regenerated"] > gm["conversations"]  # later turns were answered
    p = one(project)
    # every stored turn found (the output is what the walk reached, landed on the budget: a prefix of it)
    assert p.reusable >= gm["completion_tokens"] and p.to_generate == 0 and p.requests == 0
    assert p.prompts_left < turns - gm["turns_regenerated"] + 1


def test_the_plan_says_which_token_ends_a_turn(project, capsys):
    """Under the target line: the end of turn the chat template writes, and the ids generation stops on."""
    plan(project)
    out = capsys.readouterr().out.splitlines()
    target = next(i for i, line in enumerate(out) if line.startswith("target: "))
    assert out[target + 1] == (
        "end of turn: '<|im_end|>' (2), as the chat template writes it; generation stops on '<|im_end|>' (2)"
    )


def test_a_few_stored_lengths_are_said_beside_the_prior_they_do_not_yet_replace():
    """Fewer than the controller reads (MIN_OBSERVED): the mean is still max_tokens/2, and the line says how many
    lengths are stored, so a user who sees measured runs is not left to guess why they are not used."""
    from draftdata.cli.costs import mean_completion
    from draftdata.generate.run.budget.lengths import MIN_OBSERVED

    assert mean_completion([], 384) == (192.0, "max_tokens/2")
    assert mean_completion([10] * 5, 384) == (192.0, f"max_tokens/2 (5 stored, {MIN_OBSERVED} read)")
    assert mean_completion([10] * MIN_OBSERVED, 384) == (10.0, f"{MIN_OBSERVED} stored")
