"""The configuration reference: every key of the schema (draftdata/config/schema.py) in one markdown table.

    draftdata reference            # print the table
    draftdata reference --write    # rewrite docs/configuration.md's block between the config-reference markers

Names, types and defaults come from the dataclasses; the meaning of a key from the comments in
draftdata/config/schema.py that sit on its line or on the lines right above it (a one- or two-word section header such
as `# prompts` is not a meaning), followed by the entry for it in MEANINGS below, where the source has no comment or
says too little. Which keys are DVC params comes from dvc.yaml's `params:` lists; every other key is read at run
time and changing it reruns nothing. A key without a meaning stops the generator, so a new key cannot reach the docs
undocumented.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import re
import sys
import tokenize
import typing
from enum import Enum
from pathlib import Path

import yaml

from draftdata.config import schema as config
from draftdata.util.blocks import between, replace_between

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"  # the page whose block `--write` rewrites
START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
ANY_DATASET = "<name>"

# Meanings for keys whose comment in draftdata/config/schema.py is missing or says too little (appended to the comment).
MEANINGS = {
    "model.revision": "The revision (branch, tag or commit; null: `main`) to load when `model.path` is a hub id; "
    "resolved to its commit in the local HF cache, whose snapshot's files are the target's fingerprint and are "
    "what every stage loads (a hub id not downloaded there is refused).",
    "tiny_model.path": "Where the `tiny_model` stage writes the tiny target (the tests' and the fast profile's).",
    "tiny_model.corpus_dir": "The prompt files the tiny target's tokenizer and weights are fitted to.",
    "tiny_model.seed": "Seed of the tiny target's random weights.",
    "tiny_model.vocab_size": "Vocabulary size of the tiny target's tokenizer.",
    "tiny_model.hidden_size": "Hidden size of the tiny target.",
    "tiny_model.num_layers": "Decoder layers of the tiny target.",
    "tiny_model.num_heads": "Attention heads of the tiny target.",
    "tiny_model.max_position_embeddings": "Longest sequence the tiny target takes.",
    "tiny_model.mean_response_tokens": "Mean length of the tiny target's responses before it ends its turn.",
    "datasets.<name>.source.shape": "How a row of the source becomes a prompt: `glaive`, `opencodeinstruct`, "
    "`magicoder_oss`, `magicoder_evol`, `messages`, `conversations` or `swe_agent` (draftdata/sources/shapes.py).",
    "datasets.<name>.source.hf_name": "A dataset on the HF hub (or a local dataset directory), read with "
    "`datasets.load_dataset(..., streaming=True)`.",
    "datasets.<name>.source.hf_config": "The HF dataset's configuration (subset); null for its default.",
    "datasets.<name>.source.split": "The HF dataset's split.",
    "datasets.<name>.source.revision": "The HF dataset's revision; pin a commit so that the prompts cannot change "
    "under DVC (the hub is not a DVC dependency): check_params and plan warn while it is not a commit hash.",
    "datasets.<name>.source.data_files": "Only these files of the HF dataset.",
    "datasets.<name>.source.keep_system": "Keep the source's system prompts; false drops them (the target answers "
    "in its own style).",
    "datasets.<name>.source.user_template": "A wrapper for the first user turn, containing `{content}`; null sends "
    "the turn as it is.",
    "datasets.<name>.max_prompts": "Prompts kept after the seeded shuffle (null: all); the budget stops "
    "generation earlier when it is met. The source streams through: at most this many prompts are held (plus the "
    "ids seen, for dedup).",
    "datasets.<name>.max_prompt_tokens": "Prompts longer than this under the target's chat template are dropped "
    "(null: no limit).",
    "datasets.<name>.shuffle_seed": "Seed of the prompt order (a sort by hash of seed and prompt id).",
    "datasets.<name>.on_bad_record": "A source row that cannot become a prompt: `fail` stops with its file:line, "
    "`skip` counts it by reason in prompts_metrics.json.",
    "datasets.<name>.token_budget": "Tokens of this dataset's output, counted as `budget_unit` says.",
    "datasets.<name>.budget_unit": "`completion`: the budget counts generated tokens; `total`: the tokens the "
    "samples hold, prompt + completion, each once (what the hidden states' size follows; a conversation regenerated "
    "turn by turn counts its sample once, not each turn's history again).",
    "datasets.<name>.max_tokens": "Most tokens generated for one response.",
    "datasets.<name>.on_budget": "At the budget, `cancel` keeps complete responses only and parks the cut ones "
    "in the store; `keep_partial` keeps the server full and puts the cut responses in the output.",
    "datasets.<name>.on_truncation": "Responses that hit `max_tokens`: `keep` them in the output or `drop` them.",
    "datasets.<name>.turns": "`last` regenerates the source's last assistant turn (earlier ones stay as the "
    "source wrote them); `all` regenerates every assistant turn in order, each request holding the target's own "
    "earlier answers.",
    "datasets.<name>.on_tool_divergence": "With `turns: all`, a regenerated turn that calls other tools than the "
    "source's (or answers in text where it called): `stop` ends the conversation there; `keep_source` gives it "
    "the source's tool results anyway and goes on.",
    "datasets.<name>.concurrency": "Requests in flight at once for this dataset, over all servers; unset: "
    "`backend.concurrency_per_server` for each server.",
    "datasets.<name>.sampling.temperature": "Sampling temperature (0: greedy).",
    "datasets.<name>.sampling.top_p": "Nucleus sampling: the smallest set of tokens with this much probability.",
    "datasets.<name>.sampling.top_k": "Sample among the k likeliest tokens; -1: off.",
    "datasets.<name>.sampling.min_p": "Drop tokens below this share of the likeliest one's probability; 0.0: off.",
    "datasets.<name>.sampling.repetition_penalty": "Penalty on tokens already in the prompt or output; 1.0: off.",
    "datasets.<name>.sampling.presence_penalty": "OpenAI's presence penalty (sglang, openai); 0.0: off.",
    "datasets.<name>.sampling.frequency_penalty": "OpenAI's frequency penalty (sglang, openai); 0.0: off.",
    "model.path": "The target model.",
    "tokenize.max_seq_len": "Longest sample, prompt and response together, in tokens.",
    "tokenize.on_too_long": "A longer sample is dropped (`drop`) or cut to `max_seq_len` (`truncate`).",
    "tokenize.train_on": "The answers the loss mask covers: every regenerated one (`all_turns`) or the last.",
    "hidden_states.tensor_parallel_size": "GPUs one vLLM engine spans (tensor parallelism).",
    "hidden_states.data_parallel_size": "Independent vLLM engines, each on its own share of `CUDA_VISIBLE_DEVICES`.",
    "export.format": "The trainer whose layout `draftdata export` writes.",
    "export.dir": "Where the export is written.",
    "backend.kind": "Where generation runs; it also selects the preset in conf/backend/ whose defaults apply.",
    "backend.urls": "The servers' base URLs (sglang, openai), balanced by least outstanding requests.",
    "backend.request_timeout_s": "Longest wait for one request's answer.",
    "backend.backoff_base_s": "Base delay of the retry backoff (see `max_retries`).",
    "backend.backoff_max_s": "Longest delay between two retries (see `max_retries`).",
    "backend.connect_timeout_s": "Longest wait to connect to a server.",
    "run.store_path": "The response store (SQLite); the hidden-state store sits beside it in `states/` unless "
    "`run.states_path` says otherwise. Local disk, on the project's file system; `DRAFTDATA_STORE` overrides it.",
    "run.log_every_s": "Seconds between two progress lines when no terminal shows the progress bar.",
    "run.progress": "Show a progress bar on a terminal.",
}


@dataclasses.dataclass(frozen=True)
class Key:
    path: str
    type: str
    default: str
    dvc: str  # "DVC param (stages...)" or "run-time"
    meaning: str


# ---- comments in the schema's source --------------------------------------------------------------------------- #

_PRAGMA = re.compile(r"#\s*(type:\s*ignore(\[[^\]]*\])?|noqa(:[\w, ]*)?)")
_SECTION_HEADER = re.compile(r"[\w-]+( [\w-]+)?")


def _clean(comment: str) -> str:
    text = _PRAGMA.sub("", comment)
    return " ".join(text.replace("#", " ").split())


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment on the field's line(s), after the comment lines right above it."""
    comments = {
        tok.start[0]: tok.string
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    out: dict[tuple[str, str], str] = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above = []
            line = stmt.lineno - 1
            while line in comments and lines[line - 1].strip().startswith("#"):
                above.insert(0, _clean(comments[line]))
                line -= 1
            if len(above) == 1 and _SECTION_HEADER.fullmatch(above[0]):
                above = []  # `# prompts`: names a group of keys, explains none
            beside = [_clean(comments[n]) for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
            text = _sentences(" ".join(above), *beside)
            if text:
                out[(cls.name, stmt.target.id)] = text
    return out


# ---- DVC params ------------------------------------------------------------------------------------------------ #


def dvc_params(dvc_yaml: Path) -> dict[str, list[str]]:
    """Each param dvc.yaml declares (`${key}` as `<name>`) -> the stages that declare it, in dvc.yaml's order."""
    doc = yaml.safe_load(dvc_yaml.read_text())
    out: dict[str, list[str]] = {}
    for stage, body in doc["stages"].items():
        body = body.get("do", body)
        for entry in body.get("params", []):
            names = [entry] if isinstance(entry, str) else [k for keys in entry.values() for k in keys]
            for name in names:
                out.setdefault(name.replace("${key}", ANY_DATASET), []).append(stage)
    return out


def dvc_column(path: str, params: dict[str, list[str]]) -> str:
    stages = [
        s for param, declared in params.items() if path == param or path.startswith(param + ".") for s in declared
    ]
    return f"DVC param ({', '.join(dict.fromkeys(stages))})" if stages else "run-time"


# ---- types and defaults ---------------------------------------------------------------------------------------- #


def type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        rest = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in rest) + (" or null" if len(rest) < len(args) else "")
    if origin in (list, list):
        return f"list of {type_name(args[0])}"
    if origin in (dict, dict):
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, Enum):
        values = [f"`{m.value}`" for m in tp]
        return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]
    if tp is typing.Any:
        return "any"
    return tp.__name__


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value == "???":
        return "required"
    if isinstance(value, Enum):
        value = value.value
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


# ---- the walk -------------------------------------------------------------------------------------------------- #


def keys(
    schema: type = config.Config,
    source: str | None = None,
    meanings: dict[str, str] | None = None,
    dvc_yaml: Path | None = None,
) -> list[Key]:
    """Every leaf key of `schema` (by default the project's: `config.Config`, draftdata/config/schema.py, MEANINGS,
    dvc.yaml), in the schema's order."""
    comments = field_comments(source if source is not None else Path(config.__file__).read_text())
    meanings = MEANINGS if meanings is None else meanings
    params = dvc_params(dvc_yaml or ROOT / "dvc.yaml")
    out: list[Key] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path, tp = f"{prefix}{f.name}", hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, path + ".")
                continue
            value_type = typing.get_args(tp)[1] if typing.get_origin(tp) in (dict, dict) else None
            if value_type is not None and dataclasses.is_dataclass(value_type):
                walk(value_type, f"{path}.{ANY_DATASET}.")
                continue
            meaning = _sentences(comments.get((cls.__name__, f.name)), meanings.get(path))
            if not meaning:
                raise SystemExit(
                    f"error: {path} has no meaning: write a comment beside the field in "
                    f"draftdata/config/schema.py or an entry in draftdata/cli/reference.py's MEANINGS"
                )
            out.append(Key(path, type_name(tp), default_text(f), dvc_column(path, params), meaning))

    walk(schema, "")
    unknown = sorted(set(meanings) - {k.path for k in out})
    if unknown:
        raise SystemExit(
            f"error: MEANINGS in draftdata/cli/reference.py names keys the schema lacks: {', '.join(unknown)}"
        )
    return out


def _sentences(*parts: str | None) -> str:
    """The parts joined as sentences: each ends with a full stop unless it ends with other punctuation."""
    return " ".join(p if p[-1] in ".!?" else p + "." for p in parts if p)


def _cell(text: str) -> str:
    """A table cell: pipes escaped; outside code spans `<` and `>` too, which markdown would take for HTML."""
    spans = text.replace("|", "\\|").split("`")
    return "`".join(s if i % 2 else s.replace("<", "&lt;").replace(">", "&gt;") for i, s in enumerate(spans))


def render(rows: list[Key] | None = None) -> str:
    """The markdown table."""
    lines = ["| key | type | default | DVC | meaning |", "| --- | --- | --- | --- | --- |"]
    for k in rows if rows is not None else keys():
        lines.append("| " + " | ".join(_cell(c) for c in (f"`{k.path}`", k.type, k.default, k.dvc, k.meaning)) + " |")
    return "\n".join(lines) + "\n"


def replace_block(text: str, table: str) -> str:
    """`text` with the part between the markers replaced by `table`."""
    return replace_between(text, START, END, table, str(DOC.relative_to(ROOT)))


def block(text: str) -> str:
    """What stands between the markers (the table, as `replace_block` writes it)."""
    return between(text, START, END)


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="draftdata reference", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the block in {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    table = render()
    if not args.write:
        sys.stdout.write(table)
        return
    text = DOC.read_text()
    new = replace_block(text, table)
    if new != text:
        DOC.write_text(new)
    print(f"{DOC.relative_to(ROOT)}: configuration reference {'updated' if new != text else 'already up to date'}")
