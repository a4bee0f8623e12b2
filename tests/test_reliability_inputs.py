"""A fast subset of `python -m bench.reliability inputs`: bad inputs run through the real stages as subprocesses,
and proofs that the checker can fail (a message without the expected name, a traceback, a request sent)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.reliability.inputs_cases import all_cases
from bench.reliability.inputs_check import Case, Outcome, judge, run_case
from bench.reliability.inputs_workspace import Assets

# One or two per kind: a prompt file's line, a count under on_bad_record: skip, params.yaml's own line, keys at
# several levels (top, source, dataset, backend, run), model directories, a malformed URL and a server serving
# another model.
FAST = [
    "jsonl_malformed_line",
    "message_without_role_skip",
    "params_invalid_yaml",
    "top_unknown_key",
    "source_shape_unknown",
    "dataset_token_budget_negative",
    "run_fail_fast_after_negative",
    "backend_url_no_scheme",
    "model_path_mistyped",
    "tokenizer_without_chat_template",
    "server_serves_other_model",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    built = Assets(tmp_path_factory.mktemp("inputs"))
    yield built
    built.close()


@pytest.fixture(scope="module")
def cases(assets) -> dict[str, Case]:
    return {c.name: c for c in all_cases(assets)}


@pytest.mark.parametrize("name", FAST)
def test_bad_input_is_handled_clearly(assets, cases, name):
    row = run_case(cases[name], assets)
    assert row["ok"], f"{name}: {row['problems']}; seen: {row['got']}"
    assert row["requests"] == 0


def test_checker_reports_a_message_without_the_expected_name(assets, cases):
    """The same real refusal, judged against a key it does not name, is unclear."""
    case = dataclasses.replace(
        cases["dataset_token_budget_negative"], name="wrong_name_expected", refused=("datasets.B.max_tokens",)
    )
    row = run_case(case, assets)
    assert not row["ok"]
    assert row["problems"] == ["does not name datasets.B.max_tokens"]
    assert "datasets.B.token_budget" in row["got"]


def _refusal() -> Case:
    return Case("synthetic", "generate", "a key", lambda ws: None, refused=("datasets.B.token_budget",))


@pytest.mark.parametrize(
    "outcome, problem",
    [
        (Outcome(2, "error: datasets.B.token_budget: must be a positive integer, got -1\n"), None),
        (Outcome(1, "Traceback (most recent call last):\n  ...\nValueError: datasets.B.token_budget\n"), "traceback"),
        (Outcome(2, "warning: slow\nerror: datasets.B.token_budget: bad\n"), "2 lines on stderr"),
        (Outcome(0, ""), "exit 0: not refused"),
        (Outcome(2, "error: datasets.B.token_budget: bad\n", requests=3), "3 requests reached the server"),
        (
            Outcome(2, "error: datasets.B.token_budget: bad\n", changed=["data/B/responses.jsonl"]),
            "changed or removed: data/B/responses.jsonl",
        ),
        (Outcome(None), "no answer within 180s"),
    ],
)
def test_judge_flags_each_way_of_failing(outcome, problem):
    problems = judge(_refusal(), outcome)
    if problem is None:
        assert problems == []
    else:
        assert problem in problems


def test_judge_checks_counts_and_speed():
    counted = Case(
        "synthetic", "prompts", "a row", lambda ws: None, counted={"prompts_metrics.json": {"dropped.bad_json": 1}}
    )
    assert judge(counted, Outcome(0, metrics={"prompts_metrics.json": {"dropped": {"bad_json": 1}}})) == []
    assert judge(counted, Outcome(0, metrics={"prompts_metrics.json": {"dropped": {}}})) == [
        "prompts_metrics.json: dropped.bad_json=None, expected 1"
    ]
    assert judge(counted, Outcome(0, metrics={})) == ["no prompts_metrics.json"]
    slow = dataclasses.replace(_refusal(), max_s=20)
    assert judge(slow, Outcome(2, "error: datasets.B.token_budget: bad\n", seconds=48.9)) == [
        "took 49s, not a fast failure (limit 20s)"
    ]


def test_judge_flags_a_shown_secret():
    case = dataclasses.replace(_refusal(), refused=("backend.api_key_env",), secret="sk-made-up")
    assert judge(case, Outcome(2, "error: backend.api_key_env: must be a variable's name\n")) == []
    assert judge(case, Outcome(2, "error: backend.api_key_env: 'sk-made-up' is not a name\n")) == [
        "shows the secret it was given"
    ]
