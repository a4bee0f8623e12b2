"""The end-to-end measure of the data: train drafters on our export with the trainers' own models and losses
(speculators' EAGLE-3, P-EAGLE and block drafters DFlash, DFlash2 and DSpark; SpecForge's Domino), and report their
acceptance on held-out samples.

    python -m bench.drafter [--seeds 3] [--steps 1000] [--max-len 512] [--target-steps 1500] [--jobs 2] [--workdir D]
    python -m bench.drafter --device cuda [--hidden 256] [--layers 16] [--concurrency 128] ...     (on a GPU)
    python -m bench.drafter --target DIR ...                                  (a given model as the target)
    python -m bench.drafter --target models/smollm2-135m-instruct --jobs 2 --max-anchors 128 --curve 150,400 \
        --workdir W --out bench/results/drafter_smollm2.json                      (the proof on a real target, hours)

Resumable: every run (a variant at a seed and a number of steps) is kept in the workdir's `runs/` as it ends, keyed
by everything its figures depend on (bench/drafter_runs.py), and the results file is written as runs end, with every
finished run by key. The same command goes on where a cut one stopped; in another workdir (another machine) it makes
the data again and takes from the results file every run whose key it finds there.

A given --target (a real model) trains by default the variants the proof reads (`GIVEN_VARIANTS`): ours against the
source's answers (regeneration), against no states, at three nested budgets (the data-scaling curve, its slope per
doubling fitted over every seed), against the pre-norm state given as post-norm and the aux layers off by one, and a
block drafter (DSpark) on the same data; and its EAGLE-3 drafters of `correct`, `source_answers` and `no_states` then
speculate for the target in a real draft-and-verify loop (bench/drafter_verify.py) on held-out prompts, beside
speculators' teacher-forced estimate, their output checked against the target's greedy output token for token.

Needs DRAFTDATA_TRAINERS_PYTHON: a Python with speculators 0.9.0 and SpecForge 0.2.0 (scripts/test_envs.sh builds
it); the drafter is trained there, by bench/drafter_train.py in a subprocess. Everything else runs here, with the
project's own code:

1. the target: the demo target (same tokenizer, shape and seed) trained on the demo corpus (bench/drafter_target.py).
   The demo target's random weights make noise that no drafter predicts, so acceptance would mean nothing. With
   `--device cuda` the target is wider and deeper (`--hidden`, `--layers`; EAGLE-3's layers follow the depth) and it
   and the drafters train on the GPU; the stages take the GPU by themselves;
2. the data, by the project's own stages run in a temp workdir with its own params.yaml (prompts → generate with the
   embedded backend, which decodes with the target in-process → tokenize → hidden_states → `draftdata export`
   format speculators, family eagle3, peagle, dflash, dflash2 or dspark), from every demo conversation (the eight
   sources' ~1,800, read by the project's own readers into one `messages` file; one file's ~230 left the drafter so
   little data that the seeds' spread hid the errors' costs) at temperature 0.3, so that the target's answers follow
   its own likeliest tokens: `all` (every turn regenerated, the main set), `mid` and `small` (the same at smaller
   budgets: where does acceptance flatten?) and `last` (the last turn only, at `small`'s budget); and `source`
   (`source_answers`), which skips regeneration: the same conversations with the source's own answers, at `all`'s
   budget, through tokenize and hidden_states (the target's states over answers it did not write). The hidden_states
   stage serves every family here and keeps every layer a variant reads (`captured_layers`: EAGLE-3's, which P-EAGLE
   reads too, the block drafters' and each one above), so each convention error below is cut from the same states;
   `all` is exported for each family but EAGLE-3 too (`all_peagle`, `all_dflash`, `all_dflash2`, `all_dspark`: its
   layers, the rows it can train on), and captured a second time in fp8;
3. the split: by source conversation (its file:line), the same conversations held out of every training set; the
   held-out samples of `all` (bf16) judge every variant;
4. the drafters: one per variant and seed, the same steps of the same packed tokens each, under speculators' own
   optimizer and schedule (bench/drafter_train.py); EAGLE-3's and P-EAGLE's samples shifted as its CLI shifts them
   (`shift_batch`: position t's states beside token t + 1, as vLLM serves the drafter), in training and when judged.
   A target whose vocabulary is large (over 32k tokens: SmolLM2's 49,152) gets EAGLE-3's draft vocabulary
   (`--draft-vocab`, 8,192 by default): each training set's most frequent trained tokens (speculators' rule, from its
   training rows only) as `d2t`/`t2d`, its drafts judged as the target's ids against the target's argmax over its
   whole vocabulary, and how much of the trained tokens it covers reported, on the training rows and on the held-out
   ones. `no_states` (zeros for states, in training and when judged) is the scale: what the states are worth to this
   drafter, against which the convention errors' costs read;
5. the block drafters: speculators' `DFlashDraftModel` (`dflash`), `DFlash2DraftModel` (`dflash2`) and
   `DSparkDraftModel` (`dspark`) on their family's export, each beside its own convention error, with the same seeds,
   steps, packs and schedule: `dflash_layers_off_by_one` and `dflash2_layers_off_by_one` are the same drafter given
   the layers one above its own (vLLM's and speculators' numbering, physical + 1, taken for the physical one),
   `dspark_post_norm_as_pre` the verifier's last state already through the target's final norm where speculators
   expects it before the norm. They are judged on the held-out samples of `all` served right (their own layers, the
   pre-norm last state) by the model's own forward, a block anchored at every trained position, by speculators' own
   expected accepted length. DFlash2 drafts over the target's whole vocabulary (speculators refuses it a draft
   vocabulary), so a run with a draft vocabulary refuses it before any work;
6. P-EAGLE: speculators' `PEagleDraftModel` (`peagle`) on its family's export (EAGLE-3's layers), beside
   `peagle_post_norm_as_pre` (EAGLE-3's `post_norm_as_pre` for it), judged on the same held-out samples served right,
   each trained position drafting every one of its parallel depths, by the accepted length as EAGLE-3's is counted;
7. Domino: SpecForge's `DominoDraftModel` (`domino`; speculators has none) on DFlash's export (its layers and rows,
   which SpecForge's own Domino export holds too), beside `domino_layers_off_by_one` (DFlash's error for it), judged on
   the same held-out samples served right, each block drafting what SpecForge's decoding loop drafts.

Writes bench/results/drafter.json: per variant, the accepted length (vLLM's convention) and speculators' per-step
(EAGLE-3) or per-position (block drafters, P-EAGLE's depths) accuracies, mean and spread (max - min) over the seeds,
each run's figures, and the goals: each family's correct export (`correct`, `peagle`, `dflash`, `dflash2`, `dspark`,
`domino`) beats each of its convention errors by more than 3 times the larger of the two spreads, and beside them the
paired differences (the same seed, hence the same initial weights and order of packs, with and without the error)
and, for the final-state errors, what they do to the targets the drafter is fitted to (`target_shift`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from draftdata.drafters.families import FAMILIES, block_default_layers, unusable
from draftdata.drafters.layers import default_layers

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]  # the repository
TRAIN_SCRIPT = Path(__file__).resolve().parent / "drafter_train.py"
VERIFY_SCRIPT = Path(__file__).resolve().parent / "drafter_verify.py"
VLLM_SCRIPT = Path(__file__).resolve().parent / "drafter_vllm.py"
HELD_OUT_EVERY = 5  # every 5th source conversation (by its line in the file) is held out
SCHEDULE = "speculators' own: AdamW, linear warm-up over 1 % of the steps, linear decay to zero"
CUDA_SHAPE = {"hidden": 256, "layers": 16}  # --device cuda's target unless --hidden / --layers say otherwise
DRAFT_VOCAB, LARGE_VOCAB = 8192, 32768  # --draft-vocab's default, for a target vocabulary over LARGE_VOCAB
# --steps and --budgets by default: a trained toy target's (and a GPU's), and a given --target's on a CPU: 1,000
# steps of 512 tokens (about one epoch of `all`'s training rows at 300k completion tokens; a drafter step at SmolLM2's
# width, an 8,192-token draft head, 3 TTT steps, takes about 1.3 s on one core), three budgets 3x apart under the
# demo conversations' ceiling. Block drafters cost more a step on a CPU (the toy's: DFlash about 19x EAGLE-3's at 512
# anchors, DSpark about 7x; at 128, DFlash2 about EAGLE-3's and P-EAGLE about half): --max-anchors 128 on a CPU
DEFAULTS = {"toy": (1000, "120000,40000,13000"), "given_cpu": (1000, "300000,100000,33000")}
# answers' length by default: the toy's, and a real target's (SmolLM2's answers run to a few hundred tokens; the demo's
# conversations give it about 314k completion tokens at 256, every turn regenerated, the largest budget's ceiling)
MAX_TOKENS = {"toy": 128, "given": 256}
# a given --target's variants by default: what the proof on a real model needs (regeneration, the states' worth,
# the data-scaling curve, the two errors that decide close calls, and a block family on the same data)
GIVEN_VARIANTS = (
    "correct",
    "no_states",
    "source_answers",
    "matched_budget",
    "mid_budget",
    "small_budget",
    "pre_norm_as_post",
    "aux_off_by_one",
    "dspark",
)
# the datasets whose budgets nest inside `all`'s (the same conversations in the same order, a smaller budget): their
# samples are `all`'s first ones, so they train on those rows of `all`'s export, with no capture of their own
NESTED = ("mid", "small", "matched")


def variants_for(n_layers: int) -> dict:
    """name -> (training export, layers in the order the drafter sees them (physical ids), how the final state
    reaches the loss, the drafter family), for a target of `n_layers` layers: EAGLE-3's default aux layers for the
    EAGLE-3 and P-EAGLE variants, the block drafters' default target layers (`block_layers`) for the others."""
    eagle3, block = default_layers(n_layers), block_layers(n_layers)
    return {
        "correct": ("all", eagle3, "pre", "eagle3"),
        "aux_off_by_one": ("all", [i + 1 for i in eagle3], "pre", "eagle3"),
        "aux_reversed": ("all", eagle3[::-1], "pre", "eagle3"),
        "post_norm_as_pre": ("all", eagle3, "post", "eagle3"),
        "pre_norm_as_post": ("all", eagle3, "pre_as_post", "eagle3"),
        "fp8": ("all_fp8", eagle3, "pre", "eagle3"),
        "mid_budget": ("mid", eagle3, "pre", "eagle3"),
        "small_budget": ("small", eagle3, "pre", "eagle3"),
        "last_turn": ("last", eagle3, "pre", "eagle3"),
        # no regeneration: the target's states over the source's answers
        "source_answers": ("source", eagle3, "pre", "eagle3"),
        # ours cut to the source's trained tokens (a nested budget of them): regeneration at the same trained tokens
        "matched_budget": ("matched", eagle3, "pre", "eagle3"),
        "no_states": ("all", eagle3, "no_states", "eagle3"),  # the scale: what the states are worth to this drafter
        "dflash": ("all_dflash", block, "pre", "dflash"),
        # vLLM's and speculators' ids (physical + 1) taken for physical ones: each layer one above
        "dflash_layers_off_by_one": ("all", [i + 1 for i in block], "pre", "dflash"),
        "dflash2": ("all_dflash2", block, "pre", "dflash2"),
        "dflash2_layers_off_by_one": ("all", [i + 1 for i in block], "pre", "dflash2"),
        "dspark": ("all_dspark", block, "pre", "dspark"),
        "dspark_post_norm_as_pre": ("all_dspark", block, "post", "dspark"),
        # SpecForge's Domino on DFlash's export (its layers and rows: SpecForge's own Domino export holds the same,
        # tests/test_families.py), and its error as DFlash's
        "domino": ("all_dflash", block, "pre", "domino"),
        "domino_layers_off_by_one": ("all", [i + 1 for i in block], "pre", "domino"),
        "peagle": ("all_peagle", eagle3, "pre", "peagle"),
        "peagle_post_norm_as_pre": ("all_peagle", eagle3, "post", "peagle"),
    }


# the block drafters' target layers: z-lab's rule for speculators' default block draft of 5 layers (the drafters here
# have one layer, see bench/drafter_train.py, but read the layers a default run's data holds)
BLOCK_TARGET_LAYERS = 5


def block_layers(n_layers: int) -> list[int]:
    return block_default_layers(n_layers, BLOCK_TARGET_LAYERS)


N_LAYERS = 8  # the demo target's depth, the default
VARIANTS = variants_for(N_LAYERS)
ERRORS = (
    "aux_off_by_one",
    "aux_reversed",
    "post_norm_as_pre",
    "pre_norm_as_post",
    "dflash_layers_off_by_one",
    "dflash2_layers_off_by_one",
    "dspark_post_norm_as_pre",
    "peagle_post_norm_as_pre",
    "domino_layers_off_by_one",
)
# the families the hidden_states stage serves (draftdata/drafters/families.py) that no variant here trains, and why:
# the report says so beside the figures
UNTRAINED = {
    "mtp": "speculators' `MTPDraftModel` starts from the target's own MTP weights (`mtp.*`, which its `MTPConverter` "
    "reads) and builds Qwen3-family layers alone (qwen3, qwen3_next, qwen3_5); the bench's target is a Llama-family "
    "toy without MTP weights",
}
# each family's variant that its errors are judged against: the same drafter on the states served right
CORRECT = {f: f for f in ("peagle", "dflash", "dflash2", "dspark", "domino")} | {"eagle3": "correct"}
BLOCK_FAMILIES = ("dflash", "dflash2", "dspark")
# the families trained on their own export of `all` (EAGLE-3's is `all` itself)
OWN_EXPORT = ("peagle", *BLOCK_FAMILIES)
# an export cut from another dataset's states: name -> (that dataset, the family exported)
CUT_FROM = {"all_fp8": ("all", "eagle3")} | {f"all_{f}": ("all", f) for f in OWN_EXPORT}


def correct_for(name: str) -> str:
    """The variant a variant is judged against: its family's correct one."""
    return CORRECT[VARIANTS[name][3]]


def captured_layers(n_layers: int, chosen: list[str] | None = None) -> list[int]:
    """The layers the hidden_states stage keeps: every one a variant reads (EAGLE-3's, the block drafters' and each
    one above; of `chosen` alone where given), so that each convention error is cut from the same states; not all of
    a deep target's (30 layers of SmolLM2's 576 values would be 35 KB a token)."""
    table = variants_for(n_layers)
    names = chosen if chosen is not None else list(table)
    return sorted({i for n in names for i in table[n][1]} | set(default_layers(n_layers)))


def captured_families(chosen: list[str] | None = None) -> list[str]:
    """The families the capture serves: EAGLE-3 (whose held-out samples judge every variant) and each family a
    `chosen` variant trains on its own export of (every one where none are given)."""
    exports = {VARIANTS[n][0] for n in (chosen if chosen is not None else VARIANTS)}
    return ["eagle3", *(f for f in OWN_EXPORT if f"all_{f}" in exports)]


def conversations(work: Path) -> Path:
    """Every demo conversation (`demo_prompts`: the eight sources' shapes read by the project's own readers, tool
    calls, tools and system turns kept) in one `messages` file in the workdir, so that the drafter trains and is
    judged on ~1,800 conversations of the target's corpus, not one file's ~230. Written on every run: the same
    sources give the same file, and edited ones are never read stale."""
    from bench.drafter_target import demo_prompts

    path = work / "conversations.jsonl"
    lines = (json.dumps({"messages": p.conversation, "tools": p.tools}, ensure_ascii=False) for _, p in demo_prompts())
    path.write_text("\n".join(lines) + "\n")
    return path


def dataset(
    source: Path, turns: str, budget: int, max_tokens: int, concurrency: int = 32, temperature: float = 0.3
) -> dict:
    return {
        "source": {"shape": "messages", "path": str(source)},
        "max_prompt_tokens": 512,
        "shuffle_seed": 0,
        "token_budget": budget,
        "budget_unit": "completion",
        "max_tokens": max_tokens,
        "sampling": {"temperature": temperature, "top_p": 1.0, "top_k": -1},
        "turns": turns,
        "concurrency": concurrency,
    }


# on a GPU the embedded engine is transformers' continuous batching: a KV cache for every request in flight (4,096
# pages of 32 tokens; the default 256 holds a dozen of the data's conversations) and wider prefill batches
GPU_BACKEND = {"num_blocks": 4096, "max_batch_tokens": 4096}


def params(work: Path, target: Path, budgets: dict, args, gpu: bool = False, chosen: list[str] | None = None) -> dict:
    """`budgets`: completion tokens of `all`, `mid` and `small`; the answers' length, concurrency and temperature and
    the target's depth from `args`; the capture serves the `chosen` variants (every one where none are given)."""
    source = conversations(work)

    def ds(turns: str, budget: int) -> dict:
        return dataset(source, turns, budget, args.max_tokens, args.concurrency, args.temperature)

    return {
        "model": {"path": str(target)},
        "tokenize": {"max_seq_len": 2048, "on_too_long": "drop", "train_on": "all_turns"},
        # `layers` is EAGLE-3's list (the union, which holds its own), P-EAGLE's too; the block families read their
        # default layers
        "hidden_states": {
            "layers": captured_layers(args.layers, chosen),
            "drafters": captured_families(chosen),
            "block_draft_layers": BLOCK_TARGET_LAYERS,
            "dtype": "bfloat16",
        },
        "backend": {"kind": "embedded", "embedded_batching": args.embedded_batching} | (GPU_BACKEND if gpu else {}),
        "run": {"store_path": str(work / "store.sqlite"), "log_every_s": 60.0, "progress": False},
        "datasets": {
            "all": ds("all", budgets["all"]),
            "mid": ds("all", budgets["mid"]),
            "small": ds("all", budgets["small"]),
            "last": ds("last", budgets["small"]),  # beside `small`: one budget, both binding
            "source": ds("all", budgets["all"]),  # written by source_answers, not generated
            # the source's trained tokens once its samples are made (`matched_budget`); `all`'s until then
            "matched": ds("all", budgets["all"]),
        },
    }


@contextlib.contextmanager
def inside(path: Path):
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def run_stage(work: Path, module: str, name: str, *overrides: str) -> None:
    """A stage (or the export command) in-process, as `python -m stages.X dataset=name` would run it in `work`."""
    import importlib

    from draftdata.config.load import load_config

    with inside(work):
        cfg = load_config(name, list(overrides), params_path=work / "params.yaml")
        importlib.import_module(module).main(cfg)


def make_data(work: Path, needed: set[str]) -> dict:
    """The datasets the variants train on (and `all`, which holds the held-out samples) through the stages and
    exported; `all_<family>` is `all`'s states exported for that family (before `all_fp8`, which is `all` captured
    again in fp8, replaces them). name -> export dir."""
    exports = {}
    for name in ("all", "mid", "small", "last"):
        if name == "all" or name in needed:
            nested = name in NESTED
            for stage in ("prompts", "generate", "tokenize") + (() if nested else ("hidden_states",)):
                run_stage(work, f"stages.{stage}", name)
            exports[name] = exports["all"] if nested else export(work, name, name)
    for family in OWN_EXPORT:
        if f"all_{family}" in needed:
            exports[f"all_{family}"] = export(work, "all", f"all_{family}", family)
    if "source" in needed or "matched" in needed:
        source_answers(work)
        for stage in ("tokenize", "hidden_states"):
            run_stage(work, f"stages.{stage}", "source", "tokenize.max_skip_pct=100")
        exports["source"] = export(work, "source", "source")
    if "matched" in needed:
        match_source(work)
        for stage in ("prompts", "generate", "tokenize"):
            run_stage(work, f"stages.{stage}", "matched")
        exports["matched"] = exports["all"]
    if "all_fp8" in needed:
        run_stage(work, "stages.hidden_states", "all", "hidden_states.dtype=fp8")
        exports["all_fp8"] = export(work, "all", "all_fp8")
    return exports


def match_source(work: Path) -> None:
    """`matched`'s budget: the trained tokens of the source's samples. Fewer than the source's completion tokens
    where the tokenize stage leaves out conversations the target's template renders otherwise than the source wrote
    them (`skipped_template_alters_response`), so ours at `all`'s budget would train on more tokens than the source's
    answers do; cut to this budget (the first samples of `all`: budgets nest), ours trains on as many."""
    import pyarrow.parquet as pq

    masks = pq.read_table(work / "data" / "source" / "samples.parquet", columns=["loss_mask"])["loss_mask"]
    path = work / "params.yaml"
    p = yaml.safe_load(path.read_text())
    p["datasets"]["matched"]["token_budget"] = sum(sum(m) for m in masks.to_pylist())
    path.write_text(yaml.safe_dump(p, sort_keys=False))


def source_answers(work: Path) -> None:
    """The `source` dataset, which skips regeneration: `all`'s conversations in `all`'s order, each assistant turn
    `all` regenerates answered by the source's own answer instead, written as a server's text-only responses (one
    line per turn, `conversation` and `turn`, as `turns: all` writes them), turn after turn until their completion
    tokens reach `all`'s budget, as the generate stage fills it. The tokenize stage then renders each conversation
    whole with the target's template, and the hidden_states stage runs the target over it: the states a team that
    trains on the dataset's own answers would have."""
    import shutil

    from draftdata.config.load import load_config
    from draftdata.model.tokenizer import load_tokenizer

    cfg = load_config("source", [], params_path=work / "params.yaml")
    tok = load_tokenizer(cfg.model)
    src, dst = work / "data" / "all", work / "data" / "source"
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "prompts.jsonl", dst / "prompts.jsonl")  # the conversations' ids and source lines
    lines, total = [], 0
    for rec in map(json.loads, (src / "prompts.jsonl").read_text().splitlines()):
        conv = rec["conversation"]
        for turn, slot in enumerate(rec["slots"]):
            if slot >= len(conv):  # a conversation that ends on the user's turn: the source has no answer to it
                break
            answer = conv[slot]
            text = answer.get("content") or ""
            n = len(tok(text, add_special_tokens=False)["input_ids"]) + 1  # and its end of turn
            line = {"id": f"{rec['id']}-{turn}", "messages": conv[:slot], "tools": rec.get("tools"), "text": text}
            if answer.get("tool_calls"):
                line["tool_calls"] = answer["tool_calls"]
            lines.append(
                line | {"completion_tokens": n, "finish_reason": "stop", "conversation": rec["id"], "turn": turn}
            )
            total += n
            if total >= cfg.ds.token_budget:
                break
        if total >= cfg.ds.token_budget:
            break
    (dst / "responses.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))


def export(work: Path, name: str, out: str, family: str = "eagle3") -> Path:
    """`name`'s states exported for `family` to exports/<out>, unless an earlier run exported the same samples and
    capture there (a stamp beside it: their hashes; a rerun of a cut bench skips minutes of copying GBs)."""
    from draftdata.util.files import sha256_of

    path = work / "exports" / out
    states = work / "data" / name / "hidden_states"
    made = {n: sha256_of(states / n) for n in ("samples.parquet", "index.json")} | {"family": family}
    stamp = path.with_name(out + ".stamp.json")
    if (path / "draftdata_export.json").exists() and stamp.exists() and json.loads(stamp.read_text()) == made:
        return path
    stamp.unlink(missing_ok=True)
    overrides = ("export.format=speculators", f"export.family={family}", f"export.dir={path}")
    run_stage(work, "draftdata.cli.export", name, *overrides)
    stamp.write_text(json.dumps(made))
    return path


def marker(path: Path) -> dict:
    return json.loads((path / "draftdata_export.json").read_text())


def export_layers(path: Path) -> list[int]:
    """The layers an export holds, in the order its states hold them, as physical ids (its marker names them in
    speculators' numbering, physical + 1)."""
    m = marker(path)
    if m["aux_layer_numbering"] != "vllm_speculators":
        raise SystemExit(f"bench.drafter: {path}: layers numbered {m['aux_layer_numbering']}, not speculators'")
    return [i - 1 for i in m["aux_layer_ids"]]


def source_lines(work: Path, name: str, family: str = "eagle3") -> list[str]:
    """Row i of the export -> the source line (file:line) of its conversation: a response names its prompt record by
    `conversation` (`turns: all`), else by the prompt's own id (`turns: last`). A block family's export leaves out
    the samples it cannot train on (no two adjacent trained tokens), so its rows are the others, in order."""
    import pyarrow.parquet as pq

    from draftdata.sources.select import prompt_id

    data = work / "data" / name
    where = {rec["id"]: rec["where"] for rec in map(json.loads, (data / "prompts.jsonl").read_text().splitlines())}
    by_response = {}
    for rec in map(json.loads, (data / "responses.jsonl").read_text().splitlines()):
        prompt = rec.get("conversation") or prompt_id(rec["messages"], rec.get("tools"))
        by_response[rec["id"]] = where[prompt]
    samples = pq.read_table(data / "hidden_states" / "samples.parquet", columns=["id", "loss_mask"]).to_pylist()
    f = FAMILIES[family]
    return [by_response[s["id"]] for s in samples if unusable(f, s["loss_mask"]) is None]


def held_out(where: str) -> bool:
    return int(where.rsplit(":", 1)[1]) % HELD_OUT_EVERY == 0


def nested_rows(work: Path, name: str) -> tuple[list[int], int]:
    """(rows of `all`'s export that hold `name`'s samples, how many of its samples `all` does not hold): a smaller
    budget's output is the start of a larger one's, so every sample but the conversation its budget cut short is
    `all`'s too (under `turns: all`, that last conversation has fewer turns in the smaller set)."""
    import pyarrow.parquet as pq

    ids = pq.read_table(work / "data" / "all" / "hidden_states" / "samples.parquet", columns=["id"])["id"].to_pylist()
    row = {i: r for r, i in enumerate(ids)}
    mine = pq.read_table(work / "data" / name / "samples.parquet", columns=["id"])["id"].to_pylist()
    rows = [row[i] for i in mine if i in row]
    if len(mine) - len(rows) > 1:  # budgets that do not nest: the data's promise is broken, not the bench's input
        raise SystemExit(f"bench.drafter: {len(mine) - len(rows)} of {name}'s samples are not all's")
    return rows, len(mine) - len(rows)


def split(work: Path, exports: dict) -> tuple[dict, list[int], dict]:
    """(train rows per export, held-out rows of `all`, per nested set the samples `all` does not hold): no
    conversation is in both."""
    train, outside = {}, {}
    lines_all = source_lines(work, "all")
    for name, path in exports.items():
        if name in NESTED:
            rows, outside[name] = nested_rows(work, name)
            train[name] = [r for r in rows if not held_out(lines_all[r])]
            continue
        lines = source_lines(work, *CUT_FROM.get(name, (name, "eagle3")))
        if len(lines) != marker(path)["samples"]:  # the rows would be matched to the wrong conversations
            raise SystemExit(f"bench.drafter: {path} holds {marker(path)['samples']} rows, not {len(lines)}")
        train[name] = [i for i, w in enumerate(lines) if not held_out(w)]
    held = [i for i, w in enumerate(lines_all) if held_out(w)]
    return train, held, outside


def data_stats(path: Path, rows: list[int]) -> dict:
    """Samples, tokens and trained tokens of an export's rows (from its marker and dataset)."""
    from datasets import load_from_disk

    ds = load_from_disk(str(path)).with_format(None)
    masks = ds.select(rows)["loss_mask"]
    return {"samples": len(rows), "tokens": sum(len(m) for m in masks), "trained_tokens": sum(map(sum, masks))}


def trained_counts(path: Path, rows: list[int]):
    """Counter of the trained (loss-masked) token ids of an export's rows."""
    from collections import Counter

    from datasets import load_from_disk

    ds = load_from_disk(str(path)).with_format(None).select(rows)
    counts: Counter = Counter()
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        counts.update(t for t, m in zip(ids, mask) if m)
    return counts


def vocab_mappings(work: Path, exports: dict, train_rows: dict, eval_rows: list[int], n: int, vocab: int):
    """EAGLE-3's draft vocabulary for a large target vocabulary, per training export as its trainer would choose it:
    the `n` most frequent trained tokens of its training rows (speculators' own rule, `speculators_mapping`), saved
    for drafter_train. Also how much of the trained tokens each covers: of its own training rows, and of the
    held-out rows of `all` that judge every drafter (out of sample: a held-out token outside the draft vocabulary is
    one no drafter trained on it can propose). ({export: path}, {export: coverage})."""
    import torch

    from draftdata.hidden.vocab import speculators_mapping

    held = trained_counts(exports["all"], eval_rows)
    paths, coverage = {}, {}
    (work / "vocab").mkdir(exist_ok=True)
    for name, path in exports.items():
        counts = trained_counts(path, train_rows[name])
        d2t, t2d = speculators_mapping(counts, n, vocab)
        paths[name] = str(work / "vocab" / f"{name}-{n}.pt")
        torch.save({"d2t": d2t, "t2d": t2d}, paths[name])
        inside = set(torch.nonzero(t2d).flatten().tolist())
        coverage[name] = {
            "distinct_trained_tokens": len(counts),
            "train": round(sum(c for t, c in counts.items() if t in inside) / sum(counts.values()), 5),
            "held_out": round(sum(c for t, c in held.items() if t in inside) / sum(held.values()), 5),
        }
    return paths, coverage


def shape_from(args, ap) -> None:
    """--hidden and --layers: a given target's own (from its config.json, before any work), else the defaults."""
    if args.target is None:
        big = args.device == "cuda"
        args.hidden = args.hidden or (CUDA_SHAPE["hidden"] if big else 64)
        args.layers = args.layers or (CUDA_SHAPE["layers"] if big else N_LAYERS)
        if args.draft_vocab:  # the trained target's vocabulary is the demo tokenizer's few thousand tokens
            ap.error("--draft-vocab: for a given --target with a large vocabulary")
        args.draft_vocab, args.vocab_size = 0, None
        return
    if args.hidden or args.layers:
        ap.error("--target: its shape comes from its config; leave out --hidden and --layers")
    from transformers import AutoConfig

    args.target = args.target.resolve()
    try:
        cfg = AutoConfig.from_pretrained(args.target).get_text_config()
    except (OSError, ValueError) as e:
        ap.error(f"--target {args.target}: not a transformers model directory ({str(e).splitlines()[0]})")
    args.hidden, args.layers = cfg.hidden_size, cfg.num_hidden_layers
    draft_vocab(args, ap, cfg.vocab_size)


def draft_vocab(args, ap, vocab: int) -> None:
    """--draft-vocab: 0 = the target's whole vocabulary; unset = DRAFT_VOCAB for a vocabulary over LARGE_VOCAB (as
    EAGLE-3 drafts for Llama 3's 128k over 32k tokens), else the whole."""
    if args.draft_vocab is None:
        args.draft_vocab = DRAFT_VOCAB if vocab > LARGE_VOCAB else 0
    if args.draft_vocab < 0 or args.draft_vocab > vocab:
        ap.error(f"--draft-vocab {args.draft_vocab}: between 1 and the target's vocabulary ({vocab}), or 0 for all")
    args.vocab_size = vocab


def budgets_arg(text: str) -> dict:
    """--budgets ALL,MID,SMALL: three budgets, largest first."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: three whole numbers, e.g. 120000,40000,13000") from None
    if len(values) != 3 or not values[0] > values[1] > values[2] > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: three budgets, largest first, each above 0")
    return dict(zip(("all", "mid", "small"), values))


def check_variants(ap, chosen: list[str]) -> None:
    """Before any work: known names, `correct` among them (the report reads every variant against it), and each
    error's family's correct variant, which it is judged against."""
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: {unknown}; give correct and any of {', '.join(VARIANTS)}")
    missing = sorted(({"correct"} | {correct_for(v) for v in chosen}) - set(chosen))
    if missing:
        ap.error(f"--variants: also give {', '.join(missing)}, which the others are judged against")


def check_vocab(ap, chosen: list[str], draft_vocab: int) -> None:
    """Before any work: speculators' DFlash2 drafts over the target's whole vocabulary (`DFlash2DraftModel.__init__`
    raises on a draft vocabulary), which a large one's default --draft-vocab would give it."""
    dflash2 = [v for v in chosen if VARIANTS[v][3] == "dflash2"]
    if dflash2 and draft_vocab:
        ap.error(
            f"--variants {','.join(dflash2)} with --draft-vocab {draft_vocab}: speculators' DFlash2 requires the "
            "target's whole vocabulary; give --draft-vocab 0 or leave them out"
        )


def steps_arg(text: str) -> list[int]:
    """--curve S1,S2,...: steps, each above 0."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: whole numbers of steps, e.g. 150,400") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each number of steps at least 1")
    return values


def check_verify(ap, args) -> None:
    """Before any work: the draft-and-verify loop speculates with EAGLE-3 drafters of the variants trained here."""
    bad = [v for v in args.verify if v not in args.variants or VARIANTS[v][3] != "eagle3"]
    if bad:
        ap.error(f"--verify {','.join(bad)}: give EAGLE-3 variants among --variants ({','.join(args.variants)})")
    if min(args.verify_prompts, args.verify_tokens, args.draft_tokens) < 1:
        ap.error("--verify-prompts, --verify-tokens and --draft-tokens: at least 1")


def check_depth(ap, n_layers: int) -> None:
    """Before any work: the capture serves the block drafters' default layers, distinct only from 8 layers up (the
    hidden_states stage would stop on them)."""
    layers = block_layers(n_layers)
    if len(set(layers)) != BLOCK_TARGET_LAYERS:
        ap.error(f"a target of {n_layers} layers: the block drafters' default layers {layers} are not distinct (8 up)")


def check_device(device: str) -> None:
    """Before any work: `--device cuda` without a GPU would fail later, in a stage or in the trainers' Python."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.drafter: --device cuda: torch sees no GPU here (torch.cuda.is_available() is False)")


def trainers_python() -> str:
    py = os.environ.get("DRAFTDATA_TRAINERS_PYTHON")
    if not py:
        sys.exit(
            "bench.drafter: set DRAFTDATA_TRAINERS_PYTHON to a Python with speculators 0.9.0 and SpecForge 0.2.0 "
            "(see --help)"
        )
    return py


def trainers(work: Path, spec: dict, runs: list[dict], jobs: int, script: Path, *extra: str, poll=None) -> None:
    """`jobs` processes of the trainers' Python running `script` over the same runs, each taking the next one no
    other has claimed (`runs/<key>.claim`): the same figures whatever `jobs` is, and no process idles while another
    has runs left. `poll()` is called every half minute while they run (the results file is written as runs end)."""
    runs_dir = work / "runs"
    runs_dir.mkdir(exist_ok=True)
    for claim in runs_dir.glob("*.claim"):  # a cut run's: nothing is running now
        claim.unlink()
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(dict(spec, runs=runs), indent=1))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
    # -I: not the script's folder first on sys.path, where bench/tokenize.py would hide the standard library's
    cmd = [trainers_python(), "-I", str(script), str(spec_path), str(runs_dir), *extra]
    procs = [subprocess.Popen(cmd, env=env) for _ in range(jobs)]
    while any(p.poll() is None for p in procs):
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[0].wait(timeout=30) if procs[0].poll() is None else time.sleep(30)
        if poll is not None:
            poll()
    failed = [p.args for p in procs if p.returncode != 0]
    if failed:
        sys.exit(f"bench.drafter: the drafters' training failed: {' '.join(map(str, failed[0]))}")


def goals(results: dict) -> dict:
    """Each family's correct export beats each of its convention errors by more than 3x the larger spread of the
    two: `<correct>_beats_<error>`."""
    out = {}
    for name in ERRORS:
        if name in results:
            c, e = results[correct_for(name)]["accepted_length"], results[name]["accepted_length"]
            out[f"{correct_for(name)}_beats_{name}"] = c["mean"] - e["mean"] > 3 * max(c["spread"], e["spread"])
    return out


def paired(results: dict) -> dict:
    """Per convention error, its family's correct export's lead seed by seed (the same seed: the same initial
    weights and order of packs) and whether every seed shows it: a check beside the goals, which compare means and
    spreads."""
    out = {}
    for name in ERRORS:
        if name in results:
            by_seed = {r["seed"]: r["accepted_length"] for r in results[correct_for(name)]["runs"]}
            diffs = [round(by_seed[r["seed"]] - r["accepted_length"], 4) for r in results[name]["runs"]]
            out[name] = {"per_seed": diffs, "mean": round(statistics.fmean(diffs), 4), "every_seed": min(diffs) > 0}
    return out


def spec_for(
    args, target: Path, exports: dict, train_rows: dict, eval_rows: list[int], variants: list[str], mappings: dict
) -> dict:
    table = variants_for(args.layers)
    keys = ("export", "layers", "final", "family")
    return {
        "target": str(target),
        "vocab_mappings": mappings,
        "hidden_size": args.hidden,
        "exports": {n: {"path": str(p), "layers": export_layers(p)} for n, p in exports.items()},
        "train_rows": train_rows,
        "eval": {"export": "all", "rows": eval_rows},
        "eval_layers": default_layers(args.layers),
        "block_layers": block_layers(args.layers),  # the block families' own, as they are judged
        "variants": [{"name": v, **dict(zip(keys, table[v]))} for v in variants],
        "seeds": list(range(args.seeds)),
        "steps": args.steps,
        "max_len": args.max_len,
        "lr": args.lr,
        "max_anchors": args.max_anchors,
        "threads": args.threads,
        "device": args.device,
    }


def final_norm_weight(model) -> dict:
    """The spread of the target's final-norm weights: the post-norm state normalized a second time differs from
    the right one by about these weights over their mean, so the nearer alike they are, the less that error costs."""
    from draftdata.model.load import find_decoder

    w = find_decoder(model).norm.weight.detach().float()
    return {"mean": round(w.mean().item(), 4), "std": round(w.std().item(), 4)}


def load_target(path: Path, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="float32").to(device).eval()


def given_target(path: Path, device: str) -> dict:
    """A target given by --target (a transformers model directory with its tokenizer and chat template): its shape
    from its config, its figures on the demo's held-out conversations (what a trained target reports after
    training) and nothing trained."""
    from transformers import AutoTokenizer

    from bench.drafter_target import rendered_conversations, stats

    model = load_target(path, device)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config.get_text_config()
    shape = {"hidden_size": cfg.hidden_size, "num_layers": cfg.num_hidden_layers, "vocab_size": len(tok)}
    after = stats(model, rendered_conversations(tok)[1])
    return {
        "given": path.name,
        "shape": shape,
        "train_s": 0.0,
        "after": after,
        "final_norm_weight": final_norm_weight(model),
    }


def same_target(info: dict, spec) -> bool:
    """Whether a trained target kept in --workdir is the one asked for."""
    shape = info["shape"]
    return (info["steps"], shape["hidden_size"], shape["num_layers"]) == (spec.steps, spec.hidden_size, spec.num_layers)


def capture_index(work: Path, name: str) -> Path:
    """The index of the capture an export was cut from (`all`'s for its family exports and nested sets)."""
    dataset = "all" if name in NESTED else CUT_FROM.get(name, (name,))[0]
    return work / "data" / dataset / "hidden_states" / "index.json"


def held_out_prompts(path: Path, rows: list[int], n: int) -> list[list[int]]:
    """The first `n` held-out samples' prompts: each one's ids before its first trained token (its first turn as the
    template renders it, up to the assistant's header), a conversation the drafter never saw."""
    from datasets import load_from_disk

    ds = load_from_disk(str(path)).with_format(None).select(rows[:n])
    return [ids[: mask.index(1)] for ids, mask in zip(ds["input_ids"], ds["loss_mask"])]


def machine() -> dict:
    """The CPU the figures come from, and its cores (the bench's wall time is this machine's)."""
    import platform

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "flags": sorted(f for f in flags if f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2")),
    }


def prepare(args) -> dict:
    """Everything before the drafters: the target (trained, or given), the data through the stages, the split, the
    draft vocabularies and the runs planned. Returns what `train` and `assemble` read."""
    import torch

    from bench import drafter_runs as dr
    from bench.drafter_target import TargetSpec, train_target

    trainers_python()  # fail before any work
    torch.set_num_threads(args.jobs * args.threads)  # the data's stages: every core the drafters will use
    work = Path(args.workdir or tempfile.mkdtemp(prefix="draftdata-drafter-"))
    work.mkdir(parents=True, exist_ok=True)
    target = work / "target"
    spec = TargetSpec(hidden_size=args.hidden, num_layers=args.layers, steps=args.target_steps, device=args.device)
    # a rerun in the same --workdir keeps the trained target; its figures (and training time) beside it, not in its
    # folder, whose every file is the target's fingerprint (the data's keys: the same target, the same data)
    info = work / "bench_target.json"
    if args.target:
        target, target_info = args.target, None  # its figures after the data: see below
    elif info.exists() and same_target(json.loads(info.read_text()), spec):
        target_info = json.loads(info.read_text())
    else:
        target_info = train_target(target, spec, log=lambda m: print(m, flush=True))
        info.write_text(json.dumps(target_info, indent=1))
    variants = args.variants
    p = params(work, target, args.budgets, args, args.device == "cuda", variants)
    (work / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    t_data = time.perf_counter()
    exports = make_data(work, {VARIANTS[v][0] for v in variants})  # which export: the same at any depth
    data_s = time.perf_counter() - t_data
    p = yaml.safe_load((work / "params.yaml").read_text())  # as the stages ran it (`matched`'s budget set there)
    if target_info is None:
        # a given target's figures once the stages have run: torch work in this main thread before the embedded
        # engine's own thread starts would halve that thread's speed (draftdata/generate/embedded)
        target_info = given_target(target, args.device)
    if "final_norm_weight" not in target_info:  # a trained target: small, loaded again to read it
        target_info["final_norm_weight"] = final_norm_weight(load_target(target))
    train_rows, eval_rows, outside = split(work, exports)
    mappings, coverage = {}, {}
    if args.draft_vocab:
        mappings, coverage = vocab_mappings(work, exports, train_rows, eval_rows, args.draft_vocab, args.vocab_size)
    tspec = spec_for(args, target, exports, train_rows, eval_rows, variants, mappings)
    fingerprints = {n: dr.export_fingerprint(path, capture_index(work, n)) for n, path in exports.items()}
    runs = dr.plan(tspec, args.curve, fingerprints, dr.trainers_versions(trainers_python()))
    loop = {"draft_tokens": args.draft_tokens, "max_new_tokens": args.verify_tokens}
    loop["prompts"] = held_out_prompts(exports["all"], eval_rows, args.verify_prompts) if args.verify else []
    suffix, vllm_suffix = dr.verify_suffix(loop), dr.verify_suffix(loop, VLLM_SCRIPT)
    (work / "runs").mkdir(exist_ok=True)
    adopted = dr.adopt(args.out, work / "runs", runs, {"verify": suffix, "vllm": vllm_suffix})
    if adopted:
        print(f"bench.drafter: {adopted} runs taken from {args.out}", flush=True)
    to_verify = verify_runs(runs, tspec["steps"], args.verify)
    again = dr.unverifiable(work / "runs", to_verify, suffix)
    if again:
        print(f"bench.drafter: {again} runs to speculate with have no weights here: trained again", flush=True)
    datasets = {n: data_stats(exports[n], rows) for n, rows in train_rows.items()}
    datasets["held_out"] = data_stats(exports["all"], eval_rows)
    for name, n in outside.items():
        datasets[name]["samples_outside_all"] = n
    return {
        "work": work,
        "params": p,
        "target_info": target_info,
        "spec": tspec,
        "runs": runs,
        "verify": loop | {"suffix": suffix, "vllm_suffix": vllm_suffix},
        "datasets": datasets,
        "coverage": coverage,
        "data_s": round(data_s, 1),
    }


def verify_runs(runs: list[dict], steps: int, verify: list[str]) -> list[dict]:
    """The runs the draft-and-verify loop speculates with: the `verify` variants' at the spec's steps, every seed of
    `correct` and the first of the others (a loop costs a drafter's training time again on a CPU; the others'
    gaps to ours are wide)."""
    first = min((r["seed"] for r in runs), default=0)
    chosen = [r for r in runs if r["variant"]["name"] in verify and r["steps"] == steps]
    return [r for r in chosen if r["variant"]["name"] == "correct" or r["seed"] == first]


def vllm_runs(runs: list[dict]) -> list[dict]:
    """Of those, the ones vLLM can serve as they were judged: not `no_states` (vLLM feeds a drafter the target's
    states, never the zeros it trained on)."""
    return [r for r in runs if r["variant"]["final"] != "no_states"]


def serve_vllm(prep: dict, runs: list[dict], threads: int) -> None:
    """Each run's drafter served by vLLM's CPU build (DRAFTDATA_VLLM_PYTHON) as the target's EAGLE-3 speculator, on the
    loop's prompts (bench/drafter_vllm.py): its own acceptance counters, kept as `runs/<key>.vllm-<suffix>.json`.
    Without that Python, nothing (the report says vLLM did not run)."""
    python = os.environ.get("DRAFTDATA_VLLM_PYTHON")
    work, loop = prep["work"], prep["verify"]
    todo = [r for r in runs if not (work / "runs" / f"{r['key']}.vllm-{loop['vllm_suffix']}.json").exists()]
    if not python or not todo:
        return
    spec_path, prompts = work / "spec-vllm.json", work / f"prompts-{loop['suffix']}.json"
    spec_path.write_text(json.dumps(dict(prep["spec"], runs=todo)))
    prompts.write_text(json.dumps(loop["prompts"]))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for run in todo:
        ckpt, out = work / "vllm" / run["key"], work / "runs" / f"{run['key']}.vllm-{loop['vllm_suffix']}.json"
        tmp = out.with_name(out.name + ".tmp")
        export = [trainers_python(), "-I", str(VLLM_SCRIPT), "export", str(spec_path), run["key"], str(work / "runs")]
        serve = [python, "-I", str(VLLM_SCRIPT), "--max-tokens", str(loop["max_new_tokens"])]
        serve += ["--draft-tokens", str(loop["draft_tokens"]), str(ckpt), prep["spec"]["target"]]
        serve += [str(prompts), str(tmp)]
        for cmd in ([*export, str(ckpt)], serve):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:  # the figures stand without vLLM's; the report says it did not serve them
                print(f"bench.drafter: vLLM did not serve {run['key']}: {done.stderr.strip()[-2000:]}", flush=True)
                break
        else:
            tmp.replace(out)


def assemble(args, prep: dict, wall: dict) -> dict:
    """The results file from the runs kept so far (`complete` once every planned run and its draft-and-verify loop
    are): per variant its figures over the seeds, the comparisons the proof reads, the learning curve, the scaling
    curve and the draft-and-verify figures beside the estimates; every finished run by key (`runs`), which a rerun
    elsewhere takes instead of training it again."""
    from bench import drafter_runs as dr

    spec, loop = prep["spec"], prep["verify"]
    done = dr.finished(prep["work"] / "runs", prep["runs"], {"verify": loop["suffix"], "vllm": loop["vllm_suffix"]})
    results = dr.by_variant(done, spec["steps"])
    to_verify = {r["key"] for r in verify_runs(prep["runs"], spec["steps"], args.verify)}
    verified = {e["key"] for e in done if "verify" in e}
    settings = {k: v for k, v in vars(args).items() if k not in ("workdir", "out", "target")}
    out = {
        "complete": len(done) == len(prep["runs"]) and to_verify <= verified,
        "runs_planned": len(prep["runs"]),
        "runs_done": len(done),
        "settings": settings
        | {
            "eagle3_layers": default_layers(args.layers),
            "block_layers": block_layers(args.layers),
            "captured_layers": captured_layers(args.layers, args.variants),
            "schedule": SCHEDULE,
            "dataset_params": copy.deepcopy(prep["params"]["datasets"]),
        },
        "machine": machine(),
        "target": prep["target_info"],
        "datasets": prep["datasets"],
        "draft_vocab": {"size": args.draft_vocab or "the target's", "target_vocab": args.vocab_size}
        | ({"coverage": prep["coverage"]} if prep["coverage"] else {"coverage": "the whole vocabulary"}),
        "variants": results,
        "goals": goals(results),
        "paired": paired(results),
        "proof": proof(results, prep["datasets"]),
        "learning_curve": learning_curve(done),
        "speculation": speculation(done, results, args.verify, loop, greedy(prep["work"], loop)),
        "wall_s": wall,
        "runs": done,
    }
    for ds in out["settings"]["dataset_params"].values():  # no path of this machine in the results
        ds["source"]["path"] = Path(ds["source"]["path"]).name  # conversations(): the workdir's own file
    return out


# the scaling curve's points: the variant trained on each budget's rows of `all`, and the dataset it trains on
SCALING = (("small_budget", "small"), ("mid_budget", "mid"), ("correct", "all"))


def proof(results: dict, datasets: dict) -> dict:
    """What the proof reads: regeneration (ours against the source's answers at the same budget), the states (against
    none), and the data-scaling curve (accepted length against trained tokens, its slope per doubling fitted over every
    seed's point)."""
    from bench import drafter_runs as dr

    points = [
        {
            "variant": v,
            "trained_tokens": datasets[d]["trained_tokens"],
            "accepted_length": results[v]["accepted_length"],
            "per_seed": [r["accepted_length"] for r in results[v]["runs"]],
        }
        for v, d in SCALING
        if v in results and d in datasets
    ]
    fit = dr.slope_per_doubling([(p["trained_tokens"], y) for p in points for y in p["per_seed"]])
    return {
        # at the same trained tokens (ours cut to the source's), and at the same budget of completion tokens
        "regeneration": dr.compare(results, "matched_budget", "source_answers"),
        "regeneration_same_budget": dr.compare(results, "correct", "source_answers"),
        "states": dr.compare(results, "correct", "no_states"),
        "scaling": {"points": points, "per_doubling": fit},
    }


def learning_curve(done: list[dict]) -> list[dict]:
    """`correct`'s first seed at each number of steps it was trained for (each its own run, the schedule fitted to
    its steps): where it levels off."""
    seed = min((e["seed"] for e in done if e["variant"] == "correct"), default=None)
    points = [e for e in done if e["variant"] == "correct" and e["seed"] == seed]
    return [
        {"steps": e["steps"], "accepted_length": e["result"]["accepted_length"], "train_s": e["result"]["train_s"]}
        for e in sorted(points, key=lambda e: e["steps"])
    ]


def mean_spread(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "spread": max(xs) - min(xs)}


def greedy(work: Path, loop: dict) -> list[list[int]] | None:
    """The target's greedy output per prompt, as the draft-and-verify loop kept it (None before it ran)."""
    path = work / "runs" / f"greedy-{loop['suffix']}.json"
    return json.loads(path.read_text()) if path.exists() else None


def speculation(done: list[dict], results: dict, verify: list[str], loop: dict, reference=None) -> dict:
    """Per verified variant, the draft-and-verify loop's accepted tokens per verify step over its seeds, beside the
    teacher-forced estimate of the same drafters and whether every output equalled the target's greedy one; and,
    where vLLM served them, its own mean acceptance length over the same seeds and whether its outputs equal the
    target's greedy ones (`reference`)."""
    out = {}
    for name in verify:
        runs = [e for e in done if e["variant"] == name and "verify" in e and name in results]
        if not runs:
            continue
        out[name] = {
            "accepted_per_step": mean_spread([e["verify"]["result"]["accepted_per_step"] for e in runs]),
            "estimate": mean_spread([e["result"]["accepted_length"] for e in runs]),
            "seeds": [e["seed"] for e in runs],
            "equals_greedy": all(e["verify"]["result"]["equals_greedy"] for e in runs),
            "mismatches": [m | {"seed": e["seed"]} for e in runs for m in e["verify"]["result"]["mismatches"]],
            "verify_steps": sum(e["verify"]["result"]["verify_steps"] for e in runs),
        }
        served = [e for e in runs if "vllm" in e]
        if served:
            out[name]["vllm"] = {
                "mean_acceptance_length": mean_spread([e["vllm"]["result"]["mean_acceptance_length"] for e in served]),
                "seeds": [e["seed"] for e in served],
                "equals_greedy": reference is not None
                and all(e["vllm"]["result"]["generated"] == reference for e in served),
                "generate_wall_s": sum(e["vllm"]["result"]["generate_wall_s"] for e in served),
            }
    if out:
        out["loop"] = {
            "prompts": len(loop["prompts"]),
            "draft_tokens": loop["draft_tokens"],
            "max_new_tokens": loop["max_new_tokens"],
        }
    return out


def unrooted(text: str, work: Path) -> str:
    """The results' text with this machine's folders taken out of the paths it holds (a served checkpoint's, the
    target's): relative to the workdir or the repository, as the command was given them."""
    for root in (work.resolve(), ROOT):
        text = text.replace(json.dumps(f"{root}/")[1:-1], "")
    return text


def run(args) -> dict:
    t0 = time.perf_counter()
    prep = prepare(args)
    t_train = time.perf_counter()
    wall = {"target": prep["target_info"]["train_s"], "data": prep["data_s"]}

    def write() -> dict:
        wall.update(drafters=round(time.perf_counter() - t_train, 1), all=round(time.perf_counter() - t0, 1))
        out = assemble(args, prep, dict(wall))
        args.out.write_text(unrooted(json.dumps(out, indent=1), prep["work"]) + "\n")
        return out

    trainers(prep["work"], prep["spec"], prep["runs"], args.jobs, TRAIN_SCRIPT, poll=write)
    to_verify = verify_runs(prep["runs"], prep["spec"]["steps"], args.verify)
    if to_verify:
        vspec = dict(prep["spec"], verify=prep["verify"])
        trainers(prep["work"], vspec, to_verify, args.jobs, VERIFY_SCRIPT, poll=write)
        serve_vllm(prep, vllm_runs(to_verify), args.jobs * args.threads)
    return write()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.drafter", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument(
        "--steps",
        type=int,
        help="drafter steps (packs of --max-len tokens) per run (default 1000)",
    )
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3, help="speculators' default is 1e-3, for runs of many epochs")
    ap.add_argument(
        "--max-anchors",
        type=int,
        default=512,
        help="the block drafters' blocks per pack in training (speculators' own default; on a CPU their dense "
        "attention mask makes a step's time grow with its square)",
    )
    ap.add_argument("--target-steps", type=int, default=1500)
    ap.add_argument(
        "--target",
        type=Path,
        help="a transformers model directory (with its tokenizer and chat template) to take as the target instead of "
        "training one: --hidden and --layers come from its config",
    )
    ap.add_argument("--hidden", type=int, default=None, help=f"default 64 ({CUDA_SHAPE['hidden']} with --device cuda)")
    ap.add_argument(
        "--layers", type=int, default=None, help=f"default {N_LAYERS} ({CUDA_SHAPE['layers']} with --device cuda)"
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the target trains and the drafters train and are judged (the stages take a GPU where one is)",
    )
    ap.add_argument(
        "--budgets",
        type=budgets_arg,
        help="completion tokens of `all`, `mid` and `small` (and `last`), largest first (default: 120000,40000,13000; "
        "300000,100000,33000 for a given --target on a CPU)",
    )
    ap.add_argument("--max-tokens", type=int, help="the answers' length (default 128; 256 for a given --target)")
    ap.add_argument(
        "--concurrency", type=int, default=32, help="the data's requests in flight (the same data at any: seeded)"
    )
    ap.add_argument(
        "--temperature", type=float, default=0.3, help="the data's sampling (low: the target's likeliest tokens)"
    )
    ap.add_argument(
        "--embedded-batching",
        choices=("auto", "slots", "transformers"),
        default="auto",
        help="the data's engine (backend.embedded_batching): slots runs on the CPU even beside a GPU",
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help=f"the drafter's vocabulary: its N most frequent trained tokens (EAGLE-3's d2t/t2d); 0: the target's "
        f"whole. Default: {DRAFT_VOCAB} for a vocabulary over {LARGE_VOCAB:,} tokens, else the whole",
    )
    ap.add_argument(
        "--variants",
        help=f"comma-separated, of {', '.join(VARIANTS)}; or all (the default; for a given --target: "
        f"{','.join(GIVEN_VARIANTS)})",
    )
    ap.add_argument(
        "--curve",
        type=steps_arg,
        default=[],
        help="`correct`'s learning curve: its first seed trained again at each of these steps (comma-separated)",
    )
    ap.add_argument(
        "--verify",
        default=None,
        help="the EAGLE-3 variants whose drafters also speculate for the target in a draft-and-verify loop "
        "(comma-separated; default: correct,source_answers,no_states for a given --target, none for the trained one)",
    )
    ap.add_argument("--verify-prompts", type=int, default=50, help="held-out prompts the loop speculates on")
    ap.add_argument("--verify-tokens", type=int, default=64, help="new tokens per prompt in the loop")
    ap.add_argument("--draft-tokens", type=int, default=3, help="drafts per verify step (EAGLE-3's test-time steps)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument(
        "--jobs", type=int, default=1, help="processes training drafters at once (up to the machine's cores / threads)"
    )
    ap.add_argument(
        "--workdir",
        help="keep the target, data, exports and finished variants here, for a rerun to go on from (default: temp)",
    )
    ap.add_argument(
        "--out", type=Path, help="default bench/results/drafter.json (drafter_<target dir>.json with --target)"
    )
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.concurrency < 1 or args.max_anchors < 1:
        ap.error(f"--jobs {args.jobs}, --concurrency {args.concurrency}, --max-anchors {args.max_anchors}: at least 1")
    check_device(args.device)
    shape_from(args, ap)
    check_depth(ap, args.layers)
    steps, budgets = DEFAULTS["given_cpu" if args.target and args.device == "cpu" else "toy"]
    args.steps = args.steps or steps
    args.budgets = args.budgets or budgets_arg(budgets)
    args.max_tokens = args.max_tokens or MAX_TOKENS["given" if args.target else "toy"]
    default = GIVEN_VARIANTS if args.target else list(VARIANTS)
    args.variants = list(default) if args.variants in (None, "all") else args.variants.split(",")
    check_variants(ap, args.variants)
    check_vocab(ap, args.variants, args.draft_vocab)
    if args.verify is None:
        args.verify = (
            [v for v in ("correct", "source_answers", "no_states") if v in args.variants] if args.target else []
        )
    else:
        args.verify = [v for v in args.verify.split(",") if v]
    check_verify(ap, args)
    args.out = args.out or RESULTS / (f"drafter_{args.target.name}.json" if args.target else "drafter.json")
    out = run(args)
    print(
        json.dumps({"complete": out["complete"], "goals": out["goals"], "proof": out["proof"], "wall_s": out["wall_s"]})
    )


if __name__ == "__main__":
    main()
