"""The target model as the stages see it: its tokenizer with the configured chat template, how a prompt becomes
token ids, and a fingerprint that changes whenever the model or its tokenizer does."""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from stages.config import ConfigError, ModelConfig

# Files whose bytes define a local model's behaviour; weights over this size are fingerprinted by name and size
# only, so a 600 GB checkpoint is not read twice per run.
_HASH_FULL_BYTES = 64 << 20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def content_hash(obj: Any, n: int = 16) -> str:
    """Stable hash of a JSON-able value (key order and whitespace do not matter)."""
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


def load_tokenizer(model: ModelConfig):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model.path, revision=model.revision)
    except (OSError, ValueError) as e:
        raise ConfigError("model.path", f"cannot load a tokenizer from {model.path!r}: {e}") from None
    if model.chat_template is not None:
        path = Path(model.chat_template)
        if not path.exists():
            raise ConfigError("model.chat_template", f"file not found: {path}")
        tok.chat_template = path.read_text()
    if not tok.chat_template:
        raise ConfigError("model.chat_template", f"the tokenizer at {model.path!r} has no chat template; set one")
    return tok


def load_model(model: ModelConfig):
    """The target's weights on the GPU when there is one, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        net = AutoModelForCausalLM.from_pretrained(model.path, revision=model.revision)
    except (OSError, ValueError) as e:
        raise ConfigError("model.path", f"cannot load a model from {model.path!r}: {e}") from None
    return net.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def render_prompt_ids(tok, messages: list[dict], tools: Optional[list[dict]], template_kwargs: dict) -> list[int]:
    """The exact prompt tokens the target sees: chat template + generation prompt, no re-encoding later."""
    ids = tok.apply_chat_template(
        template_messages(messages), tools=tools, add_generation_prompt=True, tokenize=True,
        return_dict=False, **template_kwargs,
    )
    return list(ids)


def template_messages(messages: list[dict]) -> list[dict]:
    """HF chat templates expect tool-call arguments as a mapping; prompts keep OpenAI's JSON string."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[_call_with_mapping(c) for c in m["tool_calls"]])
        out.append(m)
    return out


def _call_with_mapping(call: dict) -> dict:
    fn = call.get("function", {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # keep the string: the template renders it verbatim
    return dict(call, function=dict(fn, arguments=args))


@lru_cache(maxsize=8)
def model_fingerprint(path: str, revision: Optional[str]) -> str:
    """Identity of the target for the response-store key: a local directory by its files, a hub id by revision."""
    root = Path(path)
    if not root.is_dir():
        return content_hash({"hub_id": path, "revision": revision})
    parts = {}
    for f in sorted(root.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        size = f.stat().st_size
        if size <= _HASH_FULL_BYTES:
            parts[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
        else:
            parts[f.name] = f"size:{size}"
    return content_hash({"files": parts, "revision": revision})


def tokenizer_fingerprint(tok, model: ModelConfig) -> dict:
    """What a tokenized file records so that a changed tokenizer or template is detectable."""
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
        "template_kwargs": dict(model.template_kwargs),
    }
