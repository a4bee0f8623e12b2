"""The target model as the stages see it: its tokenizer with the configured chat template, how a prompt becomes
token ids, and a fingerprint that changes whenever the model or its tokenizer does."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from draftdata.config.schema import ModelConfig, chat_template_text
from draftdata.errors import ConfigError
from draftdata.model.load import ModelLimits, load_error, locate, model_limits

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def end_of_turn_ids(tok, model: ModelConfig | None, template_kwargs: dict | None = None) -> set[int]:
    """Every token that ends the target's turn: the tokenizer's eos and the generation config's `eos_token_id`
    (Llama 3.1: <|end_of_text|>, <|eom_id|>, <|eot_id|>; gpt-oss: <|return|>, <|endoftext|>, <|call|>), which is
    what vLLM and SGLang stop on. No list of names: gpt-oss's <|end|> closes a message (its reasoning channel), not
    the turn. The chat template must end an assistant turn with one of them, else it fails here (see
    check_template_end). Without a model (a tokenizer on its own, as the golden files have), the tokenizer's eos."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    if model is not None:
        ids |= _generation_config_eos(model)
    if template_kwargs is None:
        template_kwargs = dict(model.template_kwargs) if model is not None else {}
    check_template_end(tok, ids, model, template_kwargs)
    return ids


def end_of_turn_line(tok, model: ModelConfig | None, template_kwargs: dict) -> str:
    """Which token ends an assistant turn, and which ones generation stops on, as check_params and plan say it:
    `end of turn: '<|im_end|>' (2), as the chat template writes it; generation stops on '<|im_end|>' (2)`."""
    stops = end_of_turn_ids(tok, model, template_kwargs)  # refuses a template whose end the target does not stop on
    end = _template_end_token(tok, template_kwargs)
    names = ", ".join(f"{tok.convert_ids_to_tokens(i)!r} ({i})" for i in sorted(stops)) or "none"
    if end is None:
        return f"end of turn: none the chat template shows as a special token; generation stops on {names}"
    written = f"{tok.convert_ids_to_tokens(end)!r} ({end})"
    return f"end of turn: {written}, as the chat template writes it; generation stops on {names}"


def _generation_config_eos(model: ModelConfig) -> set[int]:
    local = Path(model.path).expanduser()
    if local.is_dir():  # read as the JSON it is: transformers' GenerationConfig imports torch (seconds per stage)
        try:
            eos = json.loads((local / "generation_config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):  # none (or unreadable): the tokenizer's eos is all there is
            return set()
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(
            model.path, revision=model.revision, trust_remote_code=model.trust_remote_code
        )
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's eos is all there is
        return set()
    eos = gen.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def check_template_end(tok, ends: set[int], model: ModelConfig | None, template_kwargs: dict) -> None:
    """A template that ends the turn with a special token the target does not stop on is refused in one line,
    before any request: servers would generate past it, and tokenize would train an end the target never makes."""
    end = _template_end_token(tok, template_kwargs)
    if end is None or end in ends:
        return
    key = "model.path" if model is not None and model.chat_template is None else "model.chat_template"
    names = ", ".join(f"{tok.convert_ids_to_tokens(i)!r} ({i})" for i in sorted(ends)) or "none"
    raise ConfigError(
        key,
        f"the chat template ends an assistant turn with {tok.convert_ids_to_tokens(end)!r} (id {end}), which is not "
        f"an end of turn of the target (its tokenizer's eos and generation_config.json's eos_token_id: {names}), so "
        f"servers would not stop on it; add {end} to eos_token_id in generation_config.json, or use a template "
        "that ends the turn with one of those",
    )


def _template_end_token(tok, template_kwargs: dict) -> int | None:
    """The first token the template writes after the final assistant message's content (a probe conversation), if
    it is a special token: what a turn ends with, in this template's own words. The probe's assistant message is
    the last one, as a training sample's response is: gpt-oss writes <|return|> there, <|end|> after earlier ones."""
    probe = "draftdata end-of-turn probe"
    user = [{"role": "user", "content": "Hello"}]
    try:
        prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False, **template_kwargs)
        full = tok.apply_chat_template(
            user + [{"role": "assistant", "content": probe}], tokenize=False, **template_kwargs
        )
    except Exception as e:  # noqa: BLE001 - whatever a template raises: it cannot render the plainest conversation
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            "model.chat_template",
            f"the chat template fails on a plain user and assistant turn ({type(e).__name__}: {first}) under "
            f"template_kwargs {template_kwargs}; its end of turn cannot be checked, nor any conversation rendered",
        ) from None
    at = full.find(probe, len(prompt) if full.startswith(prompt) else 0)
    if at < 0:
        return None
    suffix = full[at + len(probe) :]
    after = tok.backend_tokenizer.encode(suffix, add_special_tokens=False).ids
    if after and after[0] in set(tok.all_special_ids) | set(tok.added_tokens_decoder):
        return after[0]
    _refuse_foreign_marker(tok, suffix)
    return None


# What a chat template's end-of-turn marker looks like: <|eot_id|>, <end_of_turn>, </s>, [/INST]
_MARKER = re.compile(r"\s*(<\|[^|<>\s]{1,40}\|>|</?[A-Za-z_][^<>\s]{0,40}>|\[/?[A-Z_]{2,20}\])")


def _refuse_foreign_marker(tok, suffix: str) -> None:
    """A template whose turn ends on a marker this tokenizer does not hold as one token was written for another
    model (Llama 3's template on SmolLM2: `<|eot_id|>` encodes to 8 ordinary tokens): the target would never stop on
    it, and every sample would train those pieces as text."""
    match = _MARKER.match(suffix)
    if match is None:
        return
    marker = match.group(1)
    ids = tok.backend_tokenizer.encode(marker, add_special_tokens=False).ids
    if len(ids) > 1:
        raise ConfigError(
            "model.chat_template",
            f"the chat template ends an assistant turn with {marker!r}, which this tokenizer does not hold as one "
            f"token (it encodes to {len(ids)} ordinary tokens): a template written for another model? Use the "
            "target's own template (model.chat_template: null) or one that ends the turn with its end-of-turn token",
        )


# Model types whose tokenizer AutoTokenizer takes from tokenizer_config.json as it stands ("" : no config.json)
_HUB_TOKENIZER_CLASS_KEPT = ("llama", "")
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def plain_fast_tokenizer(path: str) -> bool:
    """Whether AutoTokenizer would load this local directory as transformers' generic Rust-backed tokenizer
    (`TokenizersBackend`), decided as AutoTokenizer decides for these files: a tokenizer.json, a generic class named
    in tokenizer_config.json, no code of its own (auto_map), no Mistral tekken file, and a model type that keeps the
    class the tokenizer config names (Llama's, or no config.json; AutoTokenizer overrides it for types such as
    qwen2). Then that class loads it directly: the same tokenizer without AutoTokenizer's reading of the model
    config, whose classes import torch (seconds of each CPU-only stage's start)."""
    root = Path(path).expanduser()
    try:
        tok_conf = json.loads((root / "tokenizer_config.json").read_text())
        conf = json.loads((root / "config.json").read_text()) if (root / "config.json").exists() else {}
    except (OSError, ValueError):
        return False
    return (
        (root / "tokenizer.json").is_file()
        and not (root / "tekken.json").exists()
        and isinstance(tok_conf, dict)
        and isinstance(conf, dict)
        and tok_conf.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
        and "auto_map" not in tok_conf
        and conf.get("model_type", "") in _HUB_TOKENIZER_CLASS_KEPT
    )


def load_tokenizer(model: ModelConfig, need_template: bool = True):
    return tokenizer_at(locate(model).dir, model, chat_template_text(model), need_template)


def tokenizer_at(source: str, model: ModelConfig, template: str | None, need_template: bool = True):
    """The target's tokenizer from its directory `source` (`model_dir`), with the chat template `template` (None:
    its own), which it must have where `need_template`."""
    try:
        if Path(source).expanduser().is_dir() and plain_fast_tokenizer(source):
            from transformers import PreTrainedTokenizerFast  # TokenizersBackend: what AutoTokenizer returns here

            tok = PreTrainedTokenizerFast.from_pretrained(source)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(source, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise load_error(e, "a tokenizer", model.path) from None
    if template is not None:
        tok.chat_template = template
    if need_template and not tok.chat_template:
        raise ConfigError("model.chat_template", f"the tokenizer at {model.path!r} has no chat template; set one")
    return tok


def check_tokenizer_fits(tok, model: ModelConfig, limits: ModelLimits) -> None:
    """A tokenizer with ids the model has no embedding for is another model's: refused before any work (the
    target would index past its embeddings, or a server would answer for ids that mean something else)."""
    if limits.vocab is not None and len(tok) > limits.vocab:
        raise ConfigError(
            "model.path",
            f"the tokenizer at {model.path!r} has {len(tok):,} tokens but the model's "
            f"embeddings only {limits.vocab:,}: they are not a pair (a tokenizer from another model?)",
        )


def has_tokenizer_files(directory: str) -> bool:
    root = Path(directory).expanduser()
    return (root / "tokenizer.json").is_file() or (root / "tokenizer_config.json").is_file()


def check_local_target(model: ModelConfig, template_kwargs: list[dict]) -> None:
    """What check_params can tell of a target whose tokenizer is on this disk already: it loads, has a chat
    template, fits the model's embeddings (generate's refusal), and that template ends the turn on a token the
    target stops on, under each of the datasets' `template_kwargs`. A hub id, or a directory a stage has not built
    yet, is checked by the stages that load it (generate before any request)."""
    if has_tokenizer_files(model.path):
        tok = load_tokenizer(model)
        check_tokenizer_fits(tok, model, model_limits(model))
        for line in sorted({end_of_turn_line(tok, model, kwargs) for kwargs in template_kwargs}):
            print(f"check_params {line}", flush=True)


def render_prompt_ids(tok, messages: list[dict], tools: list[dict] | None, template_kwargs: dict) -> list[int]:
    """The exact prompt tokens the target sees: chat template + generation prompt, no re-encoding later."""
    ids = tok.apply_chat_template(
        template_messages(messages),
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **template_kwargs,
    )
    return list(ids)


def prefix_stable(turns: list[tuple[list[int], list[int]]]) -> bool:
    """Whether one token sequence holds a conversation as the server saw each turn: every turn's prompt ids start
    with the previous turn's prompt and answer ids, exactly. `turns`: (prompt ids, output ids) in order."""
    return all(ids[: len(p) + len(o)] == p + o for (p, o), (ids, _) in zip(turns, turns[1:]))


def template_messages(messages: list[dict]) -> list[dict]:
    """HF chat templates expect tool-call arguments as a mapping; prompts keep OpenAI's JSON string."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[_call_with_mapping(c) for c in m["tool_calls"]])
        out.append(m)
    return out


def assistant_message(rec: dict) -> dict:
    """A response as the assistant turn a chat template renders: its text, and the thinking (HF templates read
    `reasoning_content`) and tool calls that a server's parsers moved out of that text."""
    message = {"role": "assistant", "content": rec["text"]}
    if rec.get("reasoning_content"):
        message["reasoning_content"] = rec["reasoning_content"]
    if rec.get("tool_calls"):
        message["tool_calls"] = rec["tool_calls"]
    return message


_PROBE_TOOL = "draftdata_probe"
_PROBE_ARGUMENT = "draftdata argument probe"
_PROBE_REASONING = "draftdata reasoning probe"


def unrendered_parts(tok, template_kwargs: dict) -> list[str]:
    """The parts of an answer ("reasoning", "tool_calls") the chat template leaves out of the last assistant turn:
    a probe answer carrying each is rendered, and what follows the prompt must show it."""
    user = [{"role": "user", "content": "Hello"}]
    tools = [{"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {"type": "object"}}}]
    arguments = json.dumps({"probe": _PROBE_ARGUMENT})
    call = {"id": "call_0", "type": "function", "function": {"name": _PROBE_TOOL, "arguments": arguments}}
    probes = {
        "reasoning": ({"text": "ok", "reasoning_content": _PROBE_REASONING}, [_PROBE_REASONING]),
        "tool_calls": ({"text": "ok", "tool_calls": [call]}, [_PROBE_TOOL, _PROBE_ARGUMENT]),
    }
    dropped = []
    for part, (rec, needles) in probes.items():
        try:
            prompt = tok.apply_chat_template(
                user, tools=tools, add_generation_prompt=True, tokenize=False, **template_kwargs
            )
            turns = template_messages(user + [assistant_message(rec)])
            full = tok.apply_chat_template(turns, tools=tools, tokenize=False, **template_kwargs)
        except Exception:  # noqa: BLE001 - a template that rejects the part cannot render it
            dropped.append(part)
            continue
        rest = full[len(prompt) :] if full.startswith(prompt) else ""
        if not all(needle in rest for needle in needles):
            dropped.append(part)
    return dropped


def _call_with_mapping(call: dict) -> dict:
    fn = call.get("function", {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # keep the string: the template renders it verbatim
    return dict(call, function=dict(fn, arguments=args))


def tokenizer_fingerprint(tok, model: ModelConfig, template_kwargs: dict) -> dict:
    """What a tokenized file records so that a changed tokenizer or template is detectable; `template_kwargs`: the
    dataset's, as it was rendered with (config.schema.template_kwargs_of)."""
    files = {}
    root = Path(model.path)
    if root.is_dir():
        for name in _TOKENIZER_FILES:
            if (root / name).exists():
                files[name] = hashlib.sha256((root / name).read_bytes()).hexdigest()[:16]
    return {
        "name_or_path": model.path,
        "revision": model.revision,
        "files_sha256": files,
        "chat_template_sha256": hashlib.sha256(tok.chat_template.encode()).hexdigest()[:16],
        "template_kwargs": dict(template_kwargs),
    }
