"""prompts@D: readers for every supported file type and HF datasets, bad rows, dedup, order, filters."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftdata.sources.select import BadInput
from draftdata.util.files import read_jsonl


def problems(n: int) -> list[dict]:
    return [{"problem": f"Write a function number {i} that adds {i} to its input.", "solution": "x"} for i in range(n)]


def write_jsonl_gz(path, rows, extra_lines=()):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


def use_source(project, path, **over):
    project.params["datasets"]["B3"]["source"] = {"shape": "magicoder_oss", "path": str(path)}
    project.params["datasets"]["B3"].update(over)
    project.save()


def output(project) -> list[dict]:
    return list(read_jsonl(project.data("B3") / "prompts.jsonl"))


def metrics(project) -> dict:
    return json.loads((project.data("B3") / "prompts_metrics.json").read_text())


def test_malformed_line_fails_with_file_and_line(project):
    src = project.path / "src.jsonl.gz"
    write_jsonl_gz(src, problems(2), extra_lines=['{"problem": "unterminated'])
    use_source(project, src)
    with pytest.raises(BadInput, match=r"src\.jsonl\.gz:3: .*invalid JSON.*reason=bad_json"):
        project.run("prompts", "B3")
    assert not (project.data("B3") / "prompts.jsonl").exists()


def test_bad_rows_are_counted_when_skipped(project):
    src = project.path / "src.jsonl"
    rows = problems(5) + [{"solution": "no problem column"}, {"problem": "   "}]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    use_source(project, src, on_bad_record="skip", max_prompt_tokens=None)
    project.run("prompts", "B3")
    m = metrics(project)
    assert m["kept"] == 5 and m["rows_read"] == 8
    assert m["dropped"] == {"bad_json": 1, "missing_field": 1, "no_user_turn": 1} or m["dropped"] == {
        "bad_json": 1,
        "missing_field": 1,
        "empty_prompt": 1,
    }


def test_a_line_that_is_not_utf8_is_one_bad_row(project):
    src = project.path / "src.jsonl"
    good = "\n".join(json.dumps(r) for r in problems(3)).encode()
    src.write_bytes(good + b'\n{"problem": "Caf\xe9 au lait"}\n' + json.dumps(problems(5)[4]).encode() + b"\n")
    use_source(project, src)
    with pytest.raises(BadInput, match=r"src\.jsonl:4: not UTF-8 .*reason=not_utf8"):
        project.run("prompts", "B3")
    use_source(project, src, on_bad_record="skip", max_prompt_tokens=None)
    project.run("prompts", "B3")
    assert metrics(project)["dropped"] == {"not_utf8": 1} and len(output(project)) == 4  # the line after it too


@pytest.mark.parametrize("kind", ["jsonl.gz", "json.gz", "parquet"])
def test_a_file_cut_short_is_one_line_naming_it(project, kind):
    """Rows read before the cut are not taken as the whole file: the stage stops, the earlier output intact."""
    from draftdata.sources.files import SourceError

    whole = project.path / f"whole.{kind}"
    rows = problems(400)
    if kind == "jsonl.gz":
        write_jsonl_gz(whole, rows)
    elif kind == "json.gz":
        with gzip.open(whole, "wt", encoding="utf-8") as f:
            json.dump(rows, f)
    else:
        pq.write_table(pa.Table.from_pylist(rows), whole)
    use_source(project, whole, max_prompt_tokens=None)
    project.run("prompts", "B3")
    before = (project.data("B3") / "prompts.jsonl").read_bytes()
    cut = project.path / f"cut.{kind}"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    use_source(project, cut, max_prompt_tokens=None)
    with pytest.raises(SourceError) as err:
        project.run("prompts", "B3")
    assert str(cut) in str(err.value) and "\n" not in str(err.value)
    assert (project.data("B3") / "prompts.jsonl").read_bytes() == before


def test_json_parquet_and_hf_datasets_agree_with_jsonl(project, monkeypatch):
    rows = problems(40)
    write_jsonl_gz(project.path / "a.jsonl.gz", rows)
    (project.path / "a.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), project.path / "a.parquet")
    hf_dir = project.path / "hf_local"
    hf_dir.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), hf_dir / "train-00000-of-00001.parquet")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    results = {}
    for name in ("a.jsonl.gz", "a.json", "a.parquet"):
        use_source(project, project.path / name)
        project.run("prompts", "B3")
        results[name] = [(r["id"], r["messages"]) for r in output(project)]
    project.params["datasets"]["B3"]["source"] = {"shape": "magicoder_oss", "hf_name": str(hf_dir), "split": "train"}
    project.save()
    project.run("prompts", "B3")
    results["hf"] = [(r["id"], r["messages"]) for r in output(project)]
    first = results["a.jsonl.gz"]
    assert len(first) == 40
    assert all(v == first for v in results.values())


def test_dedup_order_and_filters(project):
    rows = problems(30)
    rows += rows[:3]  # exact duplicates
    rows.append({"problem": "word " * 2000, "solution": "x"})  # far over max_prompt_tokens
    src = project.path / "src.jsonl.gz"
    write_jsonl_gz(src, rows)
    use_source(project, src, max_prompt_tokens=200)
    project.run("prompts", "B3")
    m = metrics(project)
    assert m["dropped"] == {"duplicate": 3, "over_max_prompt_tokens": 1} and m["kept"] == 30
    order = [r["id"] for r in output(project)]
    assert all(r["prompt_tokens"] <= 200 for r in output(project))

    # The order depends on the seed, not on the source's row order.
    write_jsonl_gz(src, list(reversed(rows)))
    project.run("prompts", "B3")
    assert [r["id"] for r in output(project)] == order
    project.set("datasets.B3.shuffle_seed", 1)
    project.run("prompts", "B3")
    assert sorted(r["id"] for r in output(project)) == sorted(order)
    assert [r["id"] for r in output(project)] != order

    project.set("datasets.B3.max_prompts", 10)
    project.run("prompts", "B3")
    dropped = metrics(project)["dropped"]
    assert len(output(project)) == 10
    # the long prompt is either reached (token filter) or not (max_prompts): every row is accounted for once
    assert dropped["over_max_prompts"] + dropped.get("over_max_prompt_tokens", 0) == 21


class Listed:
    """A rejection tally that keeps each line's reason and id."""

    def __init__(self):
        from draftdata.util.rejected import Tally

        self.tally, self.lines = Tally(), []
        self.counts = self.tally.counts

    def add(self, reason: str, **row) -> None:
        self.tally.add(reason)
        self.lines.append((reason, row.get("id")))

    @property
    def rows(self) -> int:
        return self.tally.rows


def _sorted_selection(records, seed, max_prompts, max_prompt_tokens, count_tokens, drops):
    """The selection as a full sort of the source and a walk in its order: what the bounded one must equal."""
    from draftdata.util.hashing import content_hash

    kept = []
    for rec in sorted(records, key=lambda r: content_hash([seed, r["id"]])):
        if max_prompts is not None and len(kept) >= max_prompts:
            drops.add("over_max_prompts", id=rec["id"])
            continue
        if max_prompt_tokens is not None:
            n = count_tokens(rec)
            if n > max_prompt_tokens:
                drops.add("over_max_prompt_tokens", id=rec["id"])
                continue
            rec["prompt_tokens"] = n
        kept.append(rec)
    return kept


def _records(n: int, dup_every: int = 7):
    """n source records (every dup_every-th repeats an earlier id, with another `where`)."""
    from draftdata.sources.select import prompt_id

    for i in range(n):
        j = i // 2 if i % dup_every == dup_every - 1 else i
        messages = [{"role": "user", "content": f"prompt {j}"}]
        yield {"id": prompt_id(messages, None), "messages": messages, "where": f"src:{i}"}


def _length(rec: dict) -> int:
    return int(rec["id"][:2], 16)  # 0..255, fixed by the prompt


@pytest.mark.parametrize(
    "n,max_prompts,max_prompt_tokens",
    [(500, 50, None), (500, 50, 60), (300, 280, 200), (300, 400, 100), (200, None, 128), (1000, 1, 30), (50, 50, 10)],
)
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_bounded_selection_equals_the_full_sort(seed, n, max_prompts, max_prompt_tokens):
    """The same prompts kept, and the same rows rejected for the same reasons (the rejection ledger's lines)."""
    from draftdata.sources.select import dedup, select_prompts

    want_drops, got_drops = Listed(), Listed()
    want = _sorted_selection(
        list(dedup(_records(n), want_drops)), seed, max_prompts, max_prompt_tokens, _length, want_drops
    )
    got = select_prompts(dedup(_records(n), got_drops), seed, max_prompts, max_prompt_tokens, _length, got_drops)
    assert got == want and dict(got_drops.counts) == dict(want_drops.counts)
    assert sorted(got_drops.lines) == sorted(want_drops.lines)
    assert len(got) + got_drops.rows == n


def test_selection_holds_at_most_max_prompts_records():
    """The source streams through the selection: records it did not keep are freed as it goes (5M rows to keep
    100k must not all be held and sorted)."""
    import weakref

    from draftdata.sources.select import dedup, select_prompts
    from draftdata.util.rejected import Tally

    class Rec(dict):  # a dict that can be watched for being freed
        pass

    alive: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    most = 0

    def source():
        nonlocal most
        for rec in _records(3000):
            most = max(most, len(alive))
            r = Rec(rec)
            alive[id(r)] = r
            yield r

    kept = select_prompts(dedup(source(), Tally()), 3, 40, 200, _length, Tally())
    assert len(kept) == 40
    assert most <= 40 + 2  # the kept ones, plus the one in hand and the one before it (iterators may hold them)
