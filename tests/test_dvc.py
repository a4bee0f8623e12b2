"""Real DVC in a temp git repo: the shipped dvc.yaml runs end to end, a second repro is a no-op, and editing one
dataset's budget reruns only that dataset's chain."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

KEEP = ("B1_glaive", "B3_magicoder", "B6_ultrachat")
COPY = [
    "conf",
    "stages",
    "draftdata",
    "sources",
    "dvc.yaml",
    "params.yaml",
    "pyproject.toml",
    ".dvc/config",
    ".dvc/.gitignore",
    ".dvcignore",
    ".gitignore",
]


def sh(args: list[str], cwd: Path) -> str:
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@t",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@t",
        DVC_NO_ANALYTICS="1",
    )
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def dvc(*args: str, cwd: Path) -> str:
    return sh([sys.executable, "-m", "dvc", *args], cwd)


def ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("dvc") / "repo"
    for rel in COPY:
        src, dst = ROOT / rel, repo / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["datasets"] = {k: v for k, v in params["datasets"].items() if k in KEEP}
    params["model"]["path"] = params["tiny_model"]["path"]  # the fast profile: DVC's behaviour, not the model's
    for ds in params["datasets"].values():  # small, so the test stays quick on 2 cores
        ds.update(token_budget=300, max_tokens=48, max_prompts=60)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh(["git", "init", "-q"], repo)
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-qm", "init"], repo)
    return repo


@pytest.mark.slow
def test_repro_noop_and_budget_edit_reruns_one_chain(repo):
    first = dvc("repro", cwd=repo)
    chain = ("prompts", "generate", "tokenize", "hidden_states", "summary")
    expected = {"check_params", "packaged_model", "tiny_model"} | {f"{s}@{d}" for s in chain for d in KEEP}
    assert ran(first) == expected
    for d in KEEP:
        assert (repo / "data" / d / "samples.parquet").exists()
        index = json.loads((repo / "data" / d / "hidden_states" / "index.json").read_text())
        assert set(index["families"]) == {"eagle3", "dflash", "dspark"}  # the demo's one capture serves three
    assert not (repo / "outputs").exists() and not (repo / ".hydra").exists()

    second = dvc("repro", cwd=repo)
    assert ran(second) == set()

    # the hidden states are on disk once: the output's shards, the state store's and DVC's cache share an inode
    for shard in (repo / "data" / "B1_glaive" / "hidden_states" / "shards").iterdir():
        in_store = list((repo / ".draftdata" / "states").rglob(shard.name))
        assert len(in_store) == 1 and in_store[0].stat().st_ino == shard.stat().st_ino
        assert shard.stat().st_nlink == 3

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["datasets"]["B3_magicoder"]["token_budget"] = 500
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = dvc("status", cwd=repo)
    changed = set(re.findall(r"^(\S+):\s*$", status, flags=re.M))
    assert changed == {"check_params", "generate@B3_magicoder"}, status

    third = dvc("repro", cwd=repo)
    assert ran(third) == {
        "check_params",
        "generate@B3_magicoder",
        "tokenize@B3_magicoder",
        "hidden_states@B3_magicoder",
        "summary@B3_magicoder",
    }

    # one source file's bytes change (its content does not: gzip's header time): that dataset's prompts rerun alone,
    # write the same prompts, and nothing after them reruns; the tiny target trains its tokenizer on the demo folder
    src = repo / "sources" / "demo" / "B1_glaive.jsonl.gz"
    src.write_bytes(gzip.compress(gzip.decompress(src.read_bytes()), mtime=1))
    assert ran(dvc("repro", cwd=repo)) == {"check_params", "tiny_model", "prompts@B1_glaive"}

    shown = dvc("metrics", "show", cwd=repo)
    for d in KEEP:  # the summaries only: the detailed metrics are outputs, not DVC metrics
        assert f"data/{d}/summary.json" in shown and "generate_metrics.json" not in shown
    assert max(len(line) for line in shown.splitlines()) <= 120, shown

    # the plots page: three plots per dataset, titled with it, on vega libraries current browsers run
    dvc("plots", "show", "-o", str(repo / "page"), cwd=repo)
    html = (repo / "page" / "index.html").read_text()
    assert "/* vega 5.33.1," in html and "vega@5.20.2" not in html  # carried by the page, a version browsers run
    assert html.count("vegaEmbed('#") == 3 * len(KEEP)
    for d in KEEP:
        assert f"{d}: completion lengths" in html and f"{d}: budget fill" in html and f"{d}: responses kept" in html


@pytest.mark.slow
def test_run_time_knob_reruns_nothing(repo):
    dvc("repro", cwd=repo)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["datasets"]["B1_glaive"]["concurrency"] = 3
    params["backend"] = {"kind": "embedded", "request_timeout_s": 5.0}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert ran(dvc("repro", cwd=repo)) == {"check_params"}  # checked, nothing recomputed


def repro_with(repo: Path, edit, *stages: str) -> subprocess.CompletedProcess:
    """`dvc repro [stages]` with params.yaml edited by `edit(params)`, put back afterwards whatever happened."""
    good = (repo / "params.yaml").read_text()
    params = yaml.safe_load(good)
    edit(params)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        argv = [sys.executable, "-m", "dvc", "repro", *stages]
        env = dict(os.environ, DVC_NO_ANALYTICS="1")
        return subprocess.run(argv, cwd=repo, capture_output=True, text=True, env=env)
    finally:
        (repo / "params.yaml").write_text(good)


@pytest.mark.slow
def test_a_typo_in_a_run_time_key_stops_repro_even_when_nothing_reruns(repo):
    dvc("repro", cwd=repo)
    proc = repro_with(repo, lambda p: p["datasets"]["B1_glaive"].__setitem__("concurency", 3))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "datasets.B1_glaive.concurency" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not ran(proc.stdout + proc.stderr) - {"check_params"}  # stopped before any chain stage


@pytest.mark.slow
def test_a_refused_config_leaves_every_output_in_place(repo):
    """A typo'd or bad key, whichever stage is asked for: check_params, upstream of every stage, refuses it in one
    line naming the key before DVC removes the outputs of the stage it was asked to rerun (it used to remove them,
    then fail)."""
    dvc("repro", cwd=repo)
    d = repo / "data" / "B3_magicoder"
    outputs = ["prompts.jsonl", "prompts_metrics.json", "responses.jsonl", "hidden_states_metrics.json"]
    outputs += [str(p.relative_to(d)) for p in (d / "hidden_states").rglob("*") if p.is_file()]
    before = {name: (d / name).read_bytes() for name in outputs}

    def rename(key, new):
        return lambda p: p["datasets"]["B3_magicoder"].__setitem__(new, p["datasets"]["B3_magicoder"].pop(key))

    cases = [
        (rename("shuffle_seed", "shuffle_sed"), "prompts@B3_magicoder", "datasets.B3_magicoder.shuffle_sed"),
        (
            lambda p: p["hidden_states"].__setitem__("dtype", "bf16"),
            "hidden_states@B3_magicoder",
            "hidden_states.dtype",
        ),
        (rename("token_budget", "token_budgt"), "generate@B3_magicoder", "datasets.B3_magicoder.token_budgt"),
        (rename("max_tokens", "max_tokns"), "summary@B3_magicoder", "datasets.B3_magicoder.max_tokns"),
        # what a stage refused only once it ran (after DVC's deletes), check_params' twins now refuse first
        (lambda p: p["model"].__setitem__("path", p["model"]["path"] + "-typo"), "prompts@B3_magicoder", "model.path"),
        # a hub id: DVC deleted the outputs, then failed on the missing `${model.path}` dependency, naming no key
        (
            lambda p: p["model"].__setitem__("path", "HuggingFaceTB/SmolLM2-135M-Instruct"),
            "generate@B3_magicoder",
            "model.path",
        ),
        (
            lambda p: p["hidden_states"].__setitem__("layers", [1, 2, 40]),
            "hidden_states@B3_magicoder",
            "hidden_states.layers",
        ),
        (
            lambda p: p["datasets"]["B3_magicoder"].__setitem__("max_tokens", 10**6),
            "generate@B3_magicoder",
            "datasets.B3_magicoder.max_tokens",
        ),
        (
            lambda p: p["run"].__setitem__("store_path", "params.yaml/store.sqlite"),
            "generate@B3_magicoder",
            "run.store_path",
        ),
        # sampling the embedded backend would not send: refused by generate as it loaded its config (after DVC's
        # deletes), and a mode's only once it connected
        (
            lambda p: p["datasets"]["B3_magicoder"]["sampling"].__setitem__("min_p", 0.1),
            "generate@B3_magicoder",
            "datasets.B3_magicoder.sampling.min_p",
        ),
        (
            lambda p: p["datasets"]["B3_magicoder"].__setitem__("modes", {"m": {"sampling": {"min_p": 0.1}}}),
            "generate@B3_magicoder",
            "datasets.B3_magicoder.modes.m.sampling.min_p",
        ),
    ]
    for edit, stage, key in cases:
        proc = repro_with(repo, edit, stage)
        assert proc.returncode != 0, stage
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {key}"), proc.stderr[-3000:]
        assert "dvc.yaml" not in proc.stderr and not ran(proc.stdout + proc.stderr) - {"check_params"}
        assert {name: (d / name).read_bytes() for name in outputs} == before, stage
    assert ran(dvc("repro", cwd=repo)) <= {"check_params"}  # back as it was: nothing to redo


class _Divs(HTMLParser):
    """Each chart div of a page's DOM (a top-level element with an id): its attributes, the classes of the elements
    inside it, and the text of its axis labels."""

    def __init__(self):
        super().__init__()
        self.divs: dict[str, dict] = {}
        self._open: list[tuple[str, str | None, str]] = []  # (tag, the chart div it is in, its class)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        inside = self._open[-1][1] if self._open else None
        if tag == "div" and attrs.get("id") and inside is None:
            inside = attrs["id"]
            self.divs[inside] = {"attrs": attrs, "classes": [], "axis_labels": []}
        if inside is not None:
            self.divs[inside]["classes"].append(attrs.get("class") or "")
        if tag not in ("br", "img", "meta", "link", "input"):  # elements with a closing tag (SVG ones too)
            self._open.append((tag, inside, attrs.get("class") or ""))

    def handle_endtag(self, tag):
        while self._open and self._open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        inside = self._open[-1][1] if self._open else None
        if inside is not None and data.strip() and any("role-axis-label" in c for _, _, c in self._open):
            self.divs[inside]["axis_labels"].append(data.strip())


def chromium() -> str | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None and os.environ.get("DRAFTDATA_REQUIRE_SUITES"):
        pytest.fail("DRAFTDATA_REQUIRE_SUITES is set but no chromium is on the PATH (Debian: apt-get install chromium)")
    return browser


@pytest.mark.slow
def test_the_plots_page_draws_every_chart_offline(repo, tmp_path):
    """`dvc plots show`'s page, opened in headless Chromium kept off the network: every chart of every dataset
    draws marks of data (a dataset whose run only reused the store too: its fill is one point), the fill charts
    their budget line, the count axes whole numbers."""
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium on the PATH")
    dvc("repro", cwd=repo)
    # a lowered budget: B1's generate reruns on the store's answers alone, its fill chart one point
    proc = repro_with(repo, lambda p: p["datasets"]["B1_glaive"].__setitem__("token_budget", 200), "generate@B1_glaive")
    assert proc.returncode == 0, proc.stderr[-3000:]
    fill = (repo / "data" / "B1_glaive" / "plots" / "budget_fill.csv").read_text().splitlines()
    assert len(fill) == 2, fill  # header and one point
    dvc("plots", "show", "-o", str(tmp_path / "page"), cwd=repo)
    page = tmp_path / "page" / "index.html"
    assert "<script src=" not in page.read_text()  # nothing loaded from elsewhere
    argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--proxy-server=http://127.0.0.1:9"]
    argv += ["--virtual-time-budget=30000", "--dump-dom", page.as_uri()]
    dom = subprocess.run(argv, capture_output=True, text=True, timeout=180).stdout
    parser = _Divs()
    parser.feed(dom)
    charts = {k: v for k, v in parser.divs.items() if "vega-embed" in (v["attrs"].get("class") or "")}
    assert len(charts) == 3 * len(KEEP), sorted(parser.divs)  # lengths, fill, kept and skipped: per dataset
    for name, chart in charts.items():
        assert int(chart["attrs"].get("data-marks", 0)) > 0, name
        if "budget_fill" in name:
            assert any("mark-rule role-mark" in c for c in chart["classes"]), name  # the budget line
        else:  # counts: no tick between two whole numbers (shown as such, or rounded to a label shown twice)
            labels = chart["axis_labels"]
            assert labels and not [t for t in labels if re.fullmatch(r"\d+\.\d+", t)], (name, labels)
            assert len(labels) == len(set(labels)), (name, labels)
    # scripts/screenshot_plots.py's PNG holds the whole page (a fixed 2,400 px cut off seven of eight datasets)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from screenshot_plots import page_height, screenshot
    finally:
        sys.path.pop(0)
    png = tmp_path / "plots.png"
    height = screenshot(page, png, 1600)
    tall = page_height(page, 1600)
    assert tall > 900 and height == tall + 20
    assert int.from_bytes(png.read_bytes()[20:24], "big") == height  # the PNG's IHDR: its height in pixels


def test_the_summary_ends_the_chain_and_exports_are_not_committed(repo):
    """`dvc repro summary@D` builds the whole chain (the summary depends on the states), and `draftdata export`'s
    default folder is ignored by git, so the README's `git add -A` does not commit a trainer's copy."""
    spec = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]["summary"]["do"]
    assert "data/${key}/hidden_states_metrics.json" in spec["deps"]
    export = repo / "data" / "B3_magicoder" / "export-specforge-eagle3"
    export.mkdir(parents=True, exist_ok=True)
    (export / "rows_0").write_text("x")
    assert sh(["git", "check-ignore", str(export / "rows_0")], repo).strip()


@pytest.mark.slow
def test_temp_experiment_shares_the_workspace_store(repo):
    """`dvc exp run --temp` runs in a copy under .dvc/tmp/exps; its responses must land in the workspace's store."""
    import sqlite3

    dvc("repro", cwd=repo)
    store = repo / ".draftdata" / "store.sqlite"

    def count() -> int:
        with sqlite3.connect(store) as db:
            return db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    # above the repo's budget, whatever the fixture or an earlier test left it at: the experiment must generate
    budget = yaml.safe_load((repo / "params.yaml").read_text())["datasets"]["B3_magicoder"]["token_budget"] + 600
    before = count()
    out = dvc("exp", "run", "--temp", "-S", f"datasets.B3_magicoder.token_budget={budget}", cwd=repo)
    assert "generate@B3_magicoder" in out
    assert count() > before
    assert not list((repo / ".dvc" / "tmp").rglob("store.sqlite"))
    # the experiment's states went to the workspace's state store too: here, the same budget computes nothing
    # (DVC restores the stages from its run cache; forced, the stage finds every state in the store)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["datasets"]["B3_magicoder"]["token_budget"] = budget
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc("repro", cwd=repo)
    assert "hidden_states@B3_magicoder" in ran(dvc("repro", "-s", "-f", "hidden_states@B3_magicoder", cwd=repo))
    metrics = yaml.safe_load((repo / "data" / "B3_magicoder" / "hidden_states_metrics.json").read_text())
    assert metrics["computed_samples"] == 0 and metrics["samples"] > 0

    # the sweep at a glance: one short row per experiment, in 120 columns
    shown = sh([sys.executable, "-m", "draftdata", "compare", "dataset=B3_magicoder"], repo)
    lines = shown.strip().splitlines()
    assert lines[0] == "B3_magicoder" and lines[1].split()[:3] == ["experiment", "budget", "tokens"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    shown_budget = f"{budget:,}"  # compare writes thousands with commas
    assert rows["workspace"][0] == shown_budget and len(rows) >= 2 and max(map(len, lines)) <= 120
    assert any(r[0] == shown_budget for name, r in rows.items() if name != "workspace")  # the experiment's own row


def stage_imports(module: str) -> set[Path]:
    """The project files a stage's code can load: `module` and every `stages.*` or `draftdata.*` module it imports,
    anywhere in its code (also inside functions), or runs (`python -m draftdata.x` in a string), transitively; a
    module counts with the __init__ of each package above it."""
    import ast

    def is_module(n: str) -> bool:
        p = ROOT / Path(*n.split("."))
        return n.split(".")[0] in ("stages", "draftdata") and (p.is_dir() or p.with_suffix(".py").exists())

    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b.c runs a and a.b first
        path = ROOT / Path(*parts)
        src = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for node in ast.walk(ast.parse(src.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = re.findall(r"^(?:stages|draftdata)(?:\.\w+)+$", node.value)
            todo += [n for n in names if is_module(n)]
    files = set()
    for name in seen:
        path = ROOT / Path(*name.split("."))
        files.add((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(ROOT))
    return files


# package markers that hold a docstring only (checked below): editing them changes no output
MARKERS = (Path("stages/__init__.py"), Path("draftdata/__init__.py"))
STAGES = ["packaged_model", "tiny_model", "prompts", "generate", "tokenize", "hidden_states", "check_params", "summary"]


def code_deps(stage: str) -> list[Path]:
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]
    deps = [Path(d) for d in (spec.get("do", spec)["deps"])]
    return [d for d in deps if d.parts[0] in ("stages", "draftdata")]


@pytest.mark.parametrize("stage", STAGES)
def test_every_module_a_stage_imports_is_a_dependency(stage):
    """Editing any module a stage's code imports must rerun the stage: dvc.yaml lists the stage's script and one
    directory per concern of the library it reaches (draftdata/<step>/, target/, config/, util/, errors.py)."""
    deps = code_deps(stage)
    missing = sorted(
        str(f)
        for f in stage_imports(f"stages.{stage}")
        if f not in MARKERS
        if not any(f == d or d in f.parents for d in deps)
    )
    assert not missing, f"dvc.yaml stage {stage} lacks deps: {missing}"


@pytest.mark.parametrize("stage", STAGES)
def test_no_stage_depends_on_code_it_does_not_import(stage):
    """The reverse: a listed concern the stage never reaches would rerun it for nothing (editing the shard format
    must not rerun prompts)."""
    files = stage_imports(f"stages.{stage}")
    unused = [str(d) for d in code_deps(stage) if not any(f == d or d in f.parents for f in files)]
    assert not unused, f"dvc.yaml stage {stage} depends on code it never imports: {unused}"
    concerns = [d for d in code_deps(stage) if d.parts[0] == "draftdata"]
    assert all(d.is_dir() or d == Path("draftdata/errors.py") for d in concerns)  # one directory per concern


def test_the_package_markers_hold_no_code():
    import ast

    for marker in MARKERS:
        body = ast.parse((ROOT / marker).read_text()).body
        assert all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body), marker


def test_the_import_walk_finds_lazy_imports():
    """The walk above must see imports inside functions, or the test would pass on a stage that lacks them."""
    files = stage_imports("stages.hidden_states")
    assert Path("draftdata/hidden/engines/vllm.py") in files  # imported only inside make_engine
    assert Path("draftdata/hidden/engines/vllm_worker.py") in files  # run as `python -m draftdata....vllm_worker`
    assert Path("draftdata/cli/export.py") not in files  # nothing the stage runs imports it
    assert not any(f.parts[:2] == ("draftdata", "generate") for f in files)  # a sibling step


@pytest.mark.slow
def test_two_repros_at_once_the_second_stops_on_dvc_s_lock(repo):
    dvc("repro", cwd=repo)
    responses = repo / "data" / "B1_glaive" / "responses.jsonl"
    before = responses.read_bytes()
    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    first = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro", "-f", "-s", "generate@B1_glaive"],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in first.stdout:  # DVC holds its lock from here until the stage is done
            if "Running stage" in line:
                break
        second = subprocess.run(
            [sys.executable, "-m", "dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        rest, _ = first.communicate(timeout=300)
    assert first.returncode == 0, rest
    assert responses.read_bytes() == before  # its budget met, the forced rerun generates nothing and writes the same
    assert second.returncode != 0 and "lock" in (second.stdout + second.stderr).lower()
    assert "Traceback" not in second.stderr
    # nothing was left half-done: only the summary of the regenerated dataset is behind (its metrics changed)
    assert ran(dvc("repro", cwd=repo)) <= {"summary@B1_glaive"}
    assert ran(dvc("repro", cwd=repo)) == set()


@pytest.mark.slow
def test_an_interrupted_generate_leaves_its_outputs_in_place(repo):
    """Ctrl-C in generate: DVC removed responses.jsonl before the stage ran, so until the rerun the samples and the
    hidden states stood without the responses they came from. Its outputs persist (`persist: true`, each rewritten
    by an atomic replace): the last run's stand, as dvc.lock records them."""
    import signal

    dvc("repro", cwd=repo)
    d = repo / "data" / "B3_magicoder"
    names = ["responses.jsonl", "generate_rejected.jsonl", "generate_metrics.json", "plots/budget_fill.csv"]
    before = {name: (d / name).read_bytes() for name in names}
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["generate@B3_magicoder"]
    good = (repo / "params.yaml").read_text()
    params = yaml.safe_load(good)
    params["datasets"]["B3_magicoder"]["token_budget"] = 2_500  # more than the run gets to before the signal
    params["run"]["log_every_s"] = 0.2
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    argv = [sys.executable, "-m", "dvc", "repro", "generate@B3_magicoder"]
    run = subprocess.Popen(
        argv, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        seen = []
        for line in run.stdout:  # a request in flight: the stage is generating
            seen.append(line)
            if line.startswith("generate B3_magicoder: ") and " generating (" in line:
                break
        else:
            pytest.fail("the stage ended before it was interrupted:\n" + "".join(seen[-20:]))
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole process group
        rest, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        (repo / "params.yaml").write_text(good)
    assert run.returncode != 0, rest
    assert {name: (d / name).read_bytes() for name in names} == before
    assert yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["generate@B3_magicoder"] == lock
    # the workspace is the last run's, as dvc.lock says: only the check of the params edited and put back reruns
    assert ran(dvc("repro", cwd=repo)) == {"check_params"}


@pytest.mark.slow
def test_store_hidden_states_false_reruns_that_stage_alone_and_stores_nothing(repo):
    """Online training needs no states: the flag reruns hidden_states@D and nothing upstream (the summary after it,
    which reads its metrics, reruns too); the stage writes its marker (no model loaded) and nothing else; set back,
    the states come back from the state store, computed 0 times."""
    dvc("repro", cwd=repo)
    good = (repo / "params.yaml").read_text()
    params = yaml.safe_load(good)
    params["datasets"]["B3_magicoder"]["store_hidden_states"] = False
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = repo / "data" / "B3_magicoder"
    try:
        changed = set(re.findall(r"^(\S+):\s*$", dvc("status", cwd=repo), flags=re.M))
        # the summary is not listed yet: its input, hidden_states' metrics, changes when that stage reruns
        assert changed == {"check_params", "hidden_states@B3_magicoder"}
        assert ran(dvc("repro", cwd=repo)) == {"check_params", "hidden_states@B3_magicoder", "summary@B3_magicoder"}
        assert [p.name for p in (out / "hidden_states").iterdir()] == ["skipped.json"]
        assert json.loads((out / "hidden_states_metrics.json").read_text())["stored"] is False
        assert ran(dvc("repro", cwd=repo)) == set()
        sh(
            [sys.executable, "-m", "draftdata", "export", "dataset=B3_magicoder", "export.format=speculators_online"],
            repo,
        )
        assert (out / "export-speculators_online-eagle3" / "token_freq.pt").is_file()
    finally:
        (repo / "params.yaml").write_text(good)
    dvc("repro", cwd=repo)  # DVC may restore the states from its run cache; forced, the stage computes none
    assert (out / "hidden_states" / "index.json").is_file() and not (out / "hidden_states" / "skipped.json").exists()
    assert "hidden_states@B3_magicoder" in ran(dvc("repro", "-s", "-f", "hidden_states@B3_magicoder", cwd=repo))
    metrics = json.loads((out / "hidden_states_metrics.json").read_text())
    assert metrics["samples"] > 0 and metrics["computed_samples"] == 0
