"""The bad inputs of the `inputs` suite, one `Case` each: prompt files, params at every level of params.yaml, model
directories, servers, and a disk that fills up while a stage writes."""

from __future__ import annotations

import gzip
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.reliability.inputs_check import Case
from bench.reliability.inputs_workspace import DATASET, Assets, SetupError, Workspace, jsonl, messages_row

D = f"datasets.{DATASET}"
GOOD = jsonl([messages_row(i) for i in range(2)])  # two good rows before the bad one
LONG = " ".join(f"item{i}" for i in range(1500))  # a prompt of some thousands of tokens: past the 512-token context
KEY = "sk-live-4f9a0c2e7b1d43aa9e5f"  # a made-up API key
NO_SPACE = ("No space left", "disk is full", "File too large")  # ENOSPC, SQLite's words, EFBIG (the fallback)


def source(rel: str, data: str | bytes, shape: str = "messages", **dataset: Any) -> Callable[[Workspace], None]:
    return lambda ws: ws.use_source(rel, data, shape, **dataset)


def param(name: str, stage: str, key: str, value: Any, *names, what: str = "", **kw) -> Case:
    """params.yaml with `key` set to `value`; the refusal must name `key` (or `names`)."""
    return Case(
        name,
        stage,
        what or f"params.yaml {key}: {value!r}",
        lambda ws: ws.set(key, value),
        refused=names or (key,),
        **kw,
    )


def prompt_file_cases() -> list[Case]:
    latin1 = '{"messages": [{"role": "user", "content": "Caf\xe9 prices?"}]}\n'.encode("latin-1")
    gz = gzip.compress((GOOD * 50).encode())
    skip = {"on_bad_record": "skip"}
    return [
        Case(
            "jsonl_malformed_line",
            "prompts",
            "line 3 of the prompt file is cut off mid-string",
            source("src.jsonl", GOOD + '{"messages": [{"role": "user", "content": "unterminated\n'),
            refused=("src.jsonl:3",),
        ),
        Case(
            "jsonl_malformed_line_skip",
            "prompts",
            "the same, under on_bad_record: skip",
            source("src.jsonl", GOOD + '{"messages": [{"role": "user", "content": "unterminated\n', **skip),
            counted={"prompts_metrics.json": {"dropped.bad_json": 1, "kept": 2}},
        ),
        Case(
            "jsonl_not_utf8",
            "prompts",
            "line 3 is Latin-1 (byte 0xe9), not UTF-8",
            source("src.jsonl", GOOD.encode() + latin1),
            refused=("src.jsonl:3",),
        ),
        Case(
            "jsonl_not_utf8_skip",
            "prompts",
            "the same, under on_bad_record: skip",
            source("src.jsonl", GOOD.encode() + latin1 + jsonl([messages_row(2), messages_row(3)]).encode(), **skip),
            counted={"prompts_metrics.json": {"dropped_total": 1, "kept": 4}},
        ),
        Case(
            "jsonl_gz_truncated",
            "prompts",
            "a .jsonl.gz file cut off mid-stream (an interrupted download)",
            source("src.jsonl.gz", gz[: len(gz) // 2]),
            refused=("src.jsonl.gz",),
        ),
        Case(
            "json_file_malformed",
            "prompts",
            "a .json prompt file with a syntax error on line 3",
            source("src.json", '[\n  {"messages": [{"role": "user", "content": "hi"}]},\n  {"messages": [}\n]\n'),
            refused=("src.json:3",),
        ),
        Case(
            "messages_not_a_list",
            "prompts",
            'line 3: {"messages": "hello"}',
            source("src.jsonl", GOOD + '{"messages": "hello"}\n'),
            refused=("src.jsonl:3", "'messages'"),
        ),
        Case(
            "content_not_a_string",
            "prompts",
            "line 3: a message whose content is the number 42",
            source("src.jsonl", GOOD + '{"messages": [{"role": "user", "content": 42}]}\n'),
            refused=("src.jsonl:3", "messages[0].content"),
        ),
        Case(
            "row_not_an_object",
            "prompts",
            "line 3: a JSON array where a row object belongs",
            source("src.jsonl", GOOD + "[1, 2]\n"),
            refused=("src.jsonl:3",),
        ),
        Case(
            "messages_empty",
            "prompts",
            'line 3: {"messages": []}',
            source("src.jsonl", GOOD + '{"messages": []}\n'),
            refused=("src.jsonl:3",),
        ),
        Case(
            "messages_empty_skip",
            "prompts",
            "the same, under on_bad_record: skip",
            source("src.jsonl", GOOD + '{"messages": []}\n', **skip),
            counted={"prompts_metrics.json": {"dropped.no_user_turn": 1, "kept": 2}},
        ),
        Case(
            "message_without_role",
            "prompts",
            'line 3: a message with no "role"',
            source("src.jsonl", GOOD + '{"messages": [{"content": "hi"}]}\n'),
            refused=("src.jsonl:3", "messages[0].role"),
        ),
        Case(
            "message_without_role_skip",
            "prompts",
            "the same, under on_bad_record: skip",
            source("src.jsonl", GOOD + '{"messages": [{"content": "hi"}]}\n', **skip),
            counted={"prompts_metrics.json": {"dropped.bad_turn_role": 1, "kept": 2}},
        ),
        Case(
            "sharegpt_turn_without_from",
            "prompts",
            'conversations shape, line 1: a turn with no "from"',
            source("src.jsonl", '{"conversations": [{"value": "hi"}]}\n', "conversations"),
            refused=("src.jsonl:1", "conversations[0]"),
        ),
        Case(
            "shape_does_not_fit_file",
            "prompts",
            "source shape glaive over a file of messages rows",
            source("src.jsonl", GOOD, "glaive"),
            refused=("src.jsonl:1",),
        ),
        Case(
            "prompt_over_max_prompt_tokens",
            "prompts",
            "one prompt over max_prompt_tokens: 128 (a filter)",
            source(
                "src.jsonl", GOOD + jsonl([{"messages": [{"role": "user", "content": LONG}]}]), max_prompt_tokens=128
            ),
            counted={"prompts_metrics.json": {"dropped.over_max_prompt_tokens": 1, "kept": 2}},
        ),
        Case(
            "prompt_longer_than_context",
            "generate",
            "prompt file line 3 is longer than the 512-token context (max_prompt_tokens: null); generate",
            _long_prompt,
            inputs=(),
            refused=(("src.jsonl:3", "prompts.jsonl:"),),
        ),
        param("source_shape_unknown", "prompts", f"{D}.source.shape", "csv_rows"),
        param("source_shape_misspelt", "prompts", f"{D}.source.shape", "magicoder-oss"),
    ]


def _long_prompt(ws: Workspace) -> None:
    ws.use_source("src.jsonl", GOOD + jsonl([{"messages": [{"role": "user", "content": LONG}]}]))
    ws.stage("prompts")


def params_cases(assets: Assets) -> list[Case]:
    url = assets.right.url
    port = url.rsplit(":", 1)[1]
    return [
        # top level
        param("top_unknown_key", "prompts", "modle", {"path": "models/x"}),
        param("top_datasets_not_a_mapping", "prompts", "datasets", [DATASET]),
        Case(
            "params_invalid_yaml",
            "prompts",
            "params.yaml with a tab-indented line",
            _tab_in_params,
            refused=(f"params.yaml:{_tab_line(assets.params())}",),
        ),
        Case(
            "dataset_unknown",
            "prompts",
            "dataset=C on the command line, params.yaml has only B",
            lambda ws: None,
            dataset="C",
            refused=("dataset:", "'C'"),
        ),
        Case(
            "command_line_unknown_key",
            "generate",
            "datasets.B.max_tokns=5 on the command line",
            lambda ws: None,
            overrides=(f"{D}.max_tokns=5",),
            refused=(f"{D}.max_tokns",),
        ),
        # model
        param("model_path_wrong_type", "generate", "model.path", ["models/a", "models/b"]),
        param("model_unknown_key", "generate", "model.revison", "main"),
        param("model_template_kwargs_wrong_type", "generate", "model.template_kwargs", "enable_thinking"),
        param("model_chat_template_missing", "generate", "model.chat_template", "templates/chatml.jinja"),
        # datasets.<D>
        param("dataset_token_budget_wrong_type", "generate", f"{D}.token_budget", "lots"),
        param("dataset_token_budget_negative", "generate", f"{D}.token_budget", -1),
        param("dataset_unknown_key", "generate", f"{D}.max_tokns", 64),
        param("dataset_on_bad_record_unknown", "prompts", f"{D}.on_bad_record", "ignore"),
        param("dataset_budget_unit_unknown", "generate", f"{D}.budget_unit", "tokens"),
        param(
            "dataset_max_tokens_over_context",
            "generate",
            f"{D}.max_tokens",
            100000,
            what="max_tokens 100000 for a 512-token context",
        ),
        # datasets.<D>.source
        param("source_path_missing", "prompts", f"{D}.source.path", "sources/no-such-file.jsonl"),
        Case(
            "source_path_unsupported_type",
            "prompts",
            "a .csv prompt file",
            source("src.csv", "problem,solution\nx,y\n"),
            refused=(f"{D}.source.path",),
        ),
        param(
            "source_path_and_hf_name",
            "prompts",
            f"{D}.source.hf_name",
            "org/name",
            f"{D}.source",
            what="source with both path and hf_name",
        ),
        param("source_unknown_key", "prompts", f"{D}.source.pth", "sources/x.jsonl"),
        # sampling
        param("sampling_temperature_negative", "generate", f"{D}.sampling.temperature", -0.5),
        param("sampling_top_k_wrong_type", "generate", f"{D}.sampling.top_k", "all"),
        param("sampling_top_k_out_of_range", "generate", f"{D}.sampling.top_k", -7),
        param("sampling_unknown_key", "generate", f"{D}.sampling.temprature", 0.7),
        # tokenize
        param("tokenize_max_seq_len_wrong_type", "tokenize", "tokenize.max_seq_len", "long"),
        param("tokenize_max_seq_len_zero", "tokenize", "tokenize.max_seq_len", 0),
        param("tokenize_on_too_long_unknown", "tokenize", "tokenize.on_too_long", "wrap"),
        param("tokenize_unknown_key", "tokenize", "tokenize.max_seq_length", 2048),
        Case(
            "tokenize_too_long_skip",
            "tokenize",
            "max_seq_len: 16, on_too_long: drop, max_skip_pct: 100 (every sample longer, skipping allowed)",
            _skip_all,
            counted={
                "tokenize_metrics.json": {"samples": 0, "skipped.over_max_seq_len": lambda: assets.base_responses}
            },
        ),
        param(
            "tokenize_too_long_over_max_skip",
            "tokenize",
            "tokenize.max_seq_len",
            16,
            "tokenize.max_skip_pct",
            what="max_seq_len: 16 drops every sample (over the default max_skip_pct)",
        ),
        # hidden_states
        param("hidden_states_dtype_unknown", "hidden_states", "hidden_states.dtype", "int4"),
        param("hidden_states_layers_out_of_range", "hidden_states", "hidden_states.layers", [1, 99]),
        param("hidden_states_layers_wrong_type", "hidden_states", "hidden_states.layers", "1,2,3"),
        param("hidden_states_unknown_key", "hidden_states", "hidden_states.layer", [1, 2, 3]),
        # backend
        param("backend_kind_unknown", "generate", "backend.kind", "vllm"),
        param("backend_urls_empty", "generate", "backend.urls", []),
        param("backend_urls_not_a_list", "generate", "backend.urls", url),
        param("backend_url_no_scheme", "generate", "backend.urls", [f"127.0.0.1:{port}"]),
        param("backend_url_one_slash", "generate", "backend.urls", [f"http:/127.0.0.1:{port}"]),
        param("backend_url_no_host", "generate", "backend.urls", ["http://"]),
        param("backend_url_port_out_of_range", "generate", "backend.urls", ["http://127.0.0.1:99999"]),
        param("backend_prompt_format_unknown", "generate", "backend.prompt_format", "tokens"),
        param("backend_max_retries_negative", "generate", "backend.max_retries", -1),
        param("backend_unknown_key", "generate", "backend.url", [url]),
        param(
            "backend_api_key_pasted",
            "generate",
            "backend.api_key_env",
            KEY,
            secret=KEY,
            what="the API key itself where the name of its environment variable belongs",
        ),
        # run
        param("run_fail_fast_after_negative", "generate", "run.fail_fast_after", -1),
        param("run_unknown_key", "generate", "run.store_pth", "store/x.sqlite"),
        param(
            "run_store_path_under_a_file",
            "generate",
            "run.store_path",
            "params.yaml/store.sqlite",
            what="run.store_path inside a regular file (params.yaml/store.sqlite)",
        ),
    ]


def _skip_all(ws: Workspace) -> None:
    ws.set("tokenize.max_seq_len", 16)
    ws.set("tokenize.max_skip_pct", 100)


def _tab_in_params(ws: Workspace) -> None:
    ws.write("params.yaml", yaml.safe_dump(ws.params, sort_keys=False) + "extra:\n\tkey: 1\n")


def _tab_line(params: dict) -> int:
    """The line of `_tab_in_params`'s tab: after the dumped params and the `extra:` line."""
    return len(yaml.safe_dump(params, sort_keys=False).splitlines()) + 2


def model_cases(assets: Assets) -> list[Case]:
    return [
        param("model_path_missing", "generate", "model.path", "/nonexistent/models/target", max_s=20),
        Case(
            "model_path_mistyped",
            "generate",
            "model.path ./models/tiny-lama beside ./models/tiny-llama",
            _mistyped("./models/tiny-lama"),
            refused=("model.path",),
            max_s=20,
        ),
        Case(
            "model_path_mistyped_no_dot",
            "generate",
            "model.path models/tiny-lama (a valid hub id's shape)",
            _mistyped("models/tiny-lama"),
            refused=("model.path",),
            max_s=20,
            timeout_s=300,
        ),
        Case(
            "tokenizer_without_chat_template",
            "generate",
            "a model directory whose tokenizer has no chat template",
            lambda ws: ws.set("model.path", str(assets.model_without_template)),
            refused=("model.chat_template",),
        ),
        Case(
            "tokenizer_vocab_mismatch",
            "generate",
            "tokenizer of 4096 tokens beside weights of 2054",
            lambda ws: ws.set("model.path", str(assets.model_with_bigger_vocab)),
            refused=("model.path",),
        ),
        Case(
            "tokenizer_vocab_mismatch_hidden_states",
            "hidden_states",
            "the same model directory; hidden_states",
            lambda ws: ws.set("model.path", str(assets.model_with_bigger_vocab)),
            refused=("model.path",),
        ),
        Case(
            "server_serves_other_model",
            "generate",
            f"the server's /v1/models lists only {assets.wrong.model_id}",
            lambda ws: ws.set("backend.urls", [assets.wrong.url]),
            refused=("model.path", assets.wrong.url),
        ),
    ]


def _mistyped(path: str) -> Callable[[Workspace], None]:
    def setup(ws: Workspace) -> None:
        (ws.path / "models").mkdir()
        (ws.path / "models" / "tiny-llama").symlink_to(ws.assets.model)
        ws.set("model.path", path)

    return setup


# ---- disk full ------------------------------------------------------------------------------------------------- #


def disk_cases() -> list[Case]:
    return [
        Case(
            "disk_full_prompts",
            "prompts",
            "data/ on a full file system; prompts rewrites prompts.jsonl",
            _full_prompts,
            inputs=(),
            refused=("prompts.jsonl", NO_SPACE),
            after=_no_temp("prompts.jsonl"),
        ),
        Case(
            "disk_full_generate_store",
            "generate",
            "the response store on a full file system; generate adds to it",
            _full_store,
            refused=(("store.sqlite", "run.store_path"), NO_SPACE),
            sends=True,
            may_change=("store/", f"data/{DATASET}/responses.jsonl", f"data/{DATASET}/generate_metrics.json"),
            after=_store_kept,
        ),
        Case(
            "disk_full_tokenize",
            "tokenize",
            "data/ on a full file system; tokenize rewrites samples.parquet",
            _full_tokenize,
            inputs=(),
            refused=("samples.parquet", NO_SPACE),
            after=_no_temp("samples.parquet"),
        ),
    ]


def _full_prompts(ws: Workspace) -> None:
    ws.small_fs("data", "1m")
    ws.use_source("small.jsonl", jsonl([messages_row(i) for i in range(10)]))
    ws.stage("prompts")
    ws.use_source("src.jsonl", ws.assets.source.read_text())  # 300 prompts: an output far over what is left
    ws.fill("data", leave=16 << 10)


def _full_store(ws: Workspace) -> None:
    ws.small_fs("store", "2m")
    ws.set(f"{D}.token_budget", 200)
    ws.stage("generate")
    ws.notes["stored"] = _stored(ws)  # what the store and the output held before the disk filled up
    if not ws.notes["stored"]:
        raise SetupError("the first generate stored nothing: no earlier responses to keep")
    ws.notes["output"] = _output_keys(ws)
    ws.set(f"{D}.token_budget", 100_000)  # every prompt: far more than fits
    ws.fill("store", leave=64 << 10)


def _full_tokenize(ws: Workspace) -> None:
    ws.small_fs("data", "2m")
    ws.copy_base("prompts.jsonl", "responses.jsonl")
    ws.stage("tokenize")
    ws.set("tokenize.max_seq_len", 512)  # changed params: the stage writes its output anew
    ws.fill("data", leave=(ws.data / "samples.parquet").stat().st_size // 2)


def _stored(ws: Workspace) -> dict[str, tuple]:
    db = sqlite3.connect(ws.path / "store" / "store.sqlite")
    try:
        return {k: (t, n) for k, t, n in db.execute("SELECT key, text, completion_tokens FROM responses")}
    finally:
        db.close()


def _output_keys(ws: Workspace) -> set[str]:
    out = ws.data / "responses.jsonl"
    return {json.loads(line)["key"] for line in out.read_text().splitlines()} if out.exists() else set()


def _store_kept(ws: Workspace) -> str | None:
    """Every response stored before the disk filled is still there, unchanged, and responses.jsonl, if rewritten,
    still holds the earlier ones (read once space is freed, as a user would)."""
    (ws.path / "store" / ".filler").unlink(missing_ok=True)
    try:
        now = _stored(ws)
    except sqlite3.Error as e:
        return f"store unreadable after the run: {e}"
    earlier = ws.notes["stored"]
    lost = [k for k, v in earlier.items() if now.get(k) != v]
    if lost:
        return f"{len(lost)} of {len(earlier)} stored responses lost"
    if not ws.notes["output"] <= _output_keys(ws):
        return "responses.jsonl lost earlier responses"
    return None


def _no_temp(name: str) -> Callable[[Workspace], str | None]:
    def check(ws: Workspace) -> str | None:
        left = sorted(p.name for p in Path(ws.data).glob(f".{name}.*.tmp"))
        return f"temp file left behind: {left[0]}" if left else None

    return check


def all_cases(assets: Assets) -> list[Case]:
    return prompt_file_cases() + params_cases(assets) + model_cases(assets) + disk_cases()
