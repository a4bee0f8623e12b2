"""A change that leaves the store's answers behind is said before any request, with what regenerating costs; with
run.confirm_regenerate it stops the run there, sending nothing and touching no output."""

from __future__ import annotations

import sqlite3

import pytest

from draftdata.errors import UserError


def stored(project, complete: bool = False) -> list[tuple[str, str]]:
    """The store's (prompt id, key) rows for B3; `complete`: its answers alone (no parked partial)."""
    sql = "SELECT prompt_id, key FROM responses WHERE dataset = 'B3'"
    with sqlite3.connect(project.path / "store.sqlite") as db:
        return sorted(db.execute(sql + (" AND finish_reason IN ('stop', 'length')" if complete else "")))


@pytest.mark.slow
def test_a_sampling_change_is_announced_with_its_cost_or_stops_the_run(project, capsys):
    project.run("prompts", "B3")
    project.run("generate", "B3")
    first = stored(project)
    output = (project.data("B3") / "responses.jsonl").read_bytes()
    assert "no longer match" not in capsys.readouterr().out  # a first run: nothing left behind

    change = "datasets.B3.sampling.temperature=0.5"
    with pytest.raises(UserError) as refused:
        project.run("generate", "B3", change, "run.confirm_regenerate=true")
    answered = len({pid for pid, _ in stored(project, complete=True)})  # a partial parked at the budget: not one
    assert f"{answered:,} stored answers for these prompts no longer match" in str(refused.value)
    assert "run.confirm_regenerate: false" in str(refused.value) and "nothing was sent" in str(refused.value)
    assert stored(project) == first  # nothing sent
    assert (project.data("B3") / "responses.jsonl").read_bytes() == output  # nothing written

    project.run("generate", "B3", change)
    lines = [line for line in capsys.readouterr().out.splitlines() if "no longer match" in line]
    assert len(lines) == 1 and lines[0].startswith("generate dataset=B3 warning=")
    assert f"{answered:,} stored answers" in lines[0] and "regenerating costs 400 tokens" in lines[0]
    assert " tok/s" in lines[0]  # the first run's rate, from its generate_metrics.json
    assert len(stored(project)) > len(first)  # then regenerated under the new keys

    project.run("generate", "B3")  # the change undone: the first answers found again, nothing announced
    assert "no longer match" not in capsys.readouterr().out
