"""The target model as the stages see it: its tokenizer with the configured chat template, how a prompt becomes
token ids, and a fingerprint that changes whenever the model or its tokenizer does."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from stages.artifacts import atomic_path, log
from stages.config import ConfigError, ModelConfig

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_CHUNK_BYTES = 8 << 20  # hashlib releases the GIL on updates this big, so threads read and hash in parallel
_HASH_THREADS = 4
_LOG_ABOVE_BYTES = 1 << 30
# huggingface_hub trusts its download metadata while the file's mtime is within 1 s of the recorded timestamp
# (stat times may be imprecise); the same slack applies here, to ctime.
_METADATA_SLACK_S = 1.0
# A file changed less than this before it was read may be changed again with the same stat times (filesystems
# with coarse timestamps), so its hash is not cached ("racily clean", as git calls it). Covers 2 s FAT times.
_RACY_NS = 2_000_000_000
_HASH_CACHE_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def content_hash(obj: Any, n: int = 16) -> str:
    """Stable hash of a JSON-able value (key order and whitespace do not matter)."""
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


def looks_local(path: str) -> bool:
    """Whether `model.path` names a local directory: a hub id is `name` or `org/name`; a path that starts with `.`,
    `/` or `~`, has more than one `/`, or whose first component is a directory here, is meant as a local one."""
    parts = Path(path).parts
    return (
        path.startswith((".", "/", "~"))
        or path.count("/") > 1
        or (len(parts) > 1 and Path(parts[0]).expanduser().is_dir())
    )


def check_model_path(path: str) -> None:
    """A mistyped local path fails here, at once, instead of after the hub's retries (tens of seconds) with an
    error about connecting to it."""
    if looks_local(path) and not Path(path).expanduser().exists():
        raise ConfigError("model.path", f"{path}: no such directory (a local path; a hub id is 'org/name')")


# Tokens that end an assistant turn in the templates of common targets (ChatML, Llama 3 incl. 3.1's ipython
# <|eom_id|>, Phi, gpt-oss's <|return|> and <|call|>, Gemma); counted only where the vocabulary has them.
KNOWN_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>")


def end_of_turn_ids(tok, model: ModelConfig | None, template_kwargs: dict | None = None) -> set[int]:
    """Every token that ends the target's turn: the tokenizer's eos, the generation config's eos list (Llama 3.1
    lists <|end_of_text|>, <|eom_id|> and <|eot_id|>), the token the chat template writes right after an assistant
    message, and the known end-of-turn specials the vocabulary has. Without a model, no generation config."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    if model is not None:
        ids |= _generation_config_eos(model)
    template_end = _template_end_token(tok, template_kwargs or {})
    if template_end is not None:
        ids.add(template_end)
    for token in KNOWN_END_OF_TURN:
        tid = tok.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tok.unk_token_id:
            ids.add(tid)
    return ids


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


def _template_end_token(tok, template_kwargs: dict) -> int | None:
    """The first token the template writes after an assistant message's content (a probe conversation), if it is
    a special token: what a turn ends with, in this template's own words."""
    probe = "draftdata end-of-turn probe"
    user = [{"role": "user", "content": "Hello"}]
    try:
        prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False, **template_kwargs)
        full = tok.apply_chat_template(
            user + [{"role": "assistant", "content": probe}], tokenize=False, **template_kwargs
        )
    except Exception:  # noqa: BLE001 - a template that rejects the probe says nothing about its end token
        return None
    at = full.find(probe, len(prompt) if full.startswith(prompt) else 0)
    if at < 0:
        return None
    after = tok.backend_tokenizer.encode(full[at + len(probe) :], add_special_tokens=False).ids
    if after and after[0] in set(tok.all_special_ids) | set(tok.added_tokens_decoder):
        return after[0]
    return None


def load_error(e: Exception, what: str, path: str) -> ConfigError:
    if "trust_remote_code" in str(e):  # the checkpoint ships its own Python: run only when the user says so
        return ConfigError(
            "model.trust_remote_code",
            f"{path!r} ships its own code for {what}; set "
            "model.trust_remote_code: true if you trust it (it runs on this machine)",
        )
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ConfigError("model.path", f"cannot load {what} from {path!r}: {first}")


@dataclass(frozen=True)
class ModelLimits:
    context: int | None  # max_position_embeddings of the text model
    vocab: int | None  # rows of its embedding matrix


def model_limits(model: ModelConfig) -> ModelLimits:
    """The target's context length and vocabulary size, from its config alone (no weights). Unknown (None) where
    there is no config to read: a directory holding only the tokenizer, for a model that lives on the server."""
    check_model_path(model.path)
    local = Path(model.path).expanduser() / "config.json"
    if local.is_file():
        conf = json.loads(local.read_text())
        conf = conf.get("text_config") or conf  # a multimodal wrapper's language model
        return ModelLimits(_context(conf), conf.get("vocab_size"))
    if looks_local(model.path) or Path(model.path).expanduser().is_dir():
        return ModelLimits(None, None)
    from transformers import AutoConfig

    try:  # a hub id: its config is cached beside the tokenizer just loaded
        conf = AutoConfig.from_pretrained(
            model.path, revision=model.revision, trust_remote_code=model.trust_remote_code
        ).get_text_config()
    except (OSError, ValueError):
        return ModelLimits(None, None)
    return ModelLimits(_context(conf.to_dict()), getattr(conf, "vocab_size", None))


def _context(conf: dict) -> int | None:
    """The context a server gives the target: max_position_embeddings, times the RoPE scaling factor where the
    config scales the length it states (Qwen's YaRN: factor 4 over original_max_position_embeddings equal to it);
    Llama 3.1 states the scaled length already (131,072 over an original 8,192)."""
    n = conf.get("max_position_embeddings")
    scaling = conf.get("rope_scaling") or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if n and factor and scaling.get("original_max_position_embeddings", n) == n:
        return int(n * factor)
    return n


def check_tokenizer_fits(tok, model: ModelConfig, limits: ModelLimits) -> None:
    """A tokenizer with ids the model has no embedding for is another model's: refused before any work (the
    target would index past its embeddings, or a server would answer for ids that mean something else)."""
    if limits.vocab is not None and len(tok) > limits.vocab:
        raise ConfigError(
            "model.path",
            f"the tokenizer at {model.path!r} has {len(tok):,} tokens but the model's "
            f"embeddings only {limits.vocab:,}: they are not a pair (a tokenizer from another model?)",
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
    config, whose classes import torch (about 2.5 s of each CPU-only stage's start)."""
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
    check_model_path(model.path)
    try:
        if Path(model.path).expanduser().is_dir() and plain_fast_tokenizer(model.path):
            from transformers import PreTrainedTokenizerFast  # TokenizersBackend: what AutoTokenizer returns here

            tok = PreTrainedTokenizerFast.from_pretrained(model.path)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(
                model.path, revision=model.revision, trust_remote_code=model.trust_remote_code
            )
    except (OSError, ValueError) as e:
        raise load_error(e, "a tokenizer", model.path) from None
    if model.chat_template is not None:
        path = Path(model.chat_template)
        if not path.exists():
            raise ConfigError("model.chat_template", f"file not found: {path}")
        tok.chat_template = path.read_text()
    if need_template and not tok.chat_template:
        raise ConfigError("model.chat_template", f"the tokenizer at {model.path!r} has no chat template; set one")
    return tok


def load_model(model: ModelConfig, device_map: str | None = None):
    """The target's weights, in eval mode and their own dtype: spread over the GPUs by `device_map` (e.g. "auto")
    for a target bigger than one, else on the GPU when there is one."""
    import torch
    from transformers import AutoModelForCausalLM

    check_model_path(model.path)
    try:
        net = AutoModelForCausalLM.from_pretrained(
            model.path,
            revision=model.revision,
            dtype="auto",
            trust_remote_code=model.trust_remote_code,
            **({"device_map": device_map} if device_map else {}),
        )
    except (OSError, ValueError) as e:
        raise load_error(e, "a model", model.path) from None
    if not device_map:
        net = net.to("cuda" if torch.cuda.is_available() else "cpu")
    return net.eval()


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
def model_fingerprint(path: str, revision: str | None, cache_path: Path | None = None) -> str:
    """Identity of the target for the response-store key: a local directory by the sha256 of every top-level file,
    a hub id by revision.

    Every byte counts (two fine-tunes of one base have equal file names and sizes), yet a 600 GB checkpoint stays
    cheap: in an HF cache snapshot, or a directory written by `hf download --local-dir` and untouched since, the
    sha256 of each weight file is already on disk and nothing is read. Otherwise each file is read once, the same
    price DVC already pays to hash `model.path` as a dependency, and its hash is kept in `cache_path` until the
    file's size, mtime, ctime or inode changes. Without a `cache_path` such files are read on every call."""
    check_model_path(path)  # a mistyped local path must not pass for a hub id
    root = Path(path)
    if not root.is_dir():
        return content_hash({"hub_id": path, "revision": revision})
    files = [f for f in sorted(root.iterdir()) if f.is_file() and not f.name.startswith(".")]
    # The same formula as when every file was read in full, so existing response stores keep their keys.
    return content_hash({"files": _files_sha256(root, files, cache_path), "revision": revision})


def _files_sha256(root: Path, files: list[Path], cache_path: Path | None) -> dict[str, str]:
    """File name -> sha256 hex of its content, from the cheapest source that is known to be current."""
    known: dict[str, str] = {}
    unknown: list[Path] = []
    for f in files:
        sha = _hub_blob_sha256(f) or _download_metadata_sha256(root, f)
        if sha is None:
            unknown.append(f)
        else:
            known[f.name] = sha
    if unknown:
        known.update(_read_sha256(unknown, cache_path))
    return known


def _hub_blob_sha256(f: Path) -> str | None:
    """The HF hub cache stores LFS files as blobs/<sha256 of the content>, linked from snapshots/<rev>/."""
    if not f.is_symlink():
        return None
    target = f.resolve()
    if target.parent.name == "blobs" and _SHA256_HEX.fullmatch(target.name):
        return target.name
    return None


def _download_metadata_sha256(root: Path, f: Path) -> str | None:
    """The etag `hf download --local-dir` recorded for `f`, if it is a sha256 (LFS files) and `f` is unchanged since.

    huggingface_hub's metadata file holds three lines: commit hash, etag, time.time() when written (after the file
    was moved into place). ctime, not mtime, decides "unchanged": `cp -p` or `touch -d` can set mtime back, nothing
    sets ctime back."""
    meta = root / ".cache" / "huggingface" / "download" / f"{f.name}.metadata"
    try:
        lines = meta.read_text().splitlines()
        etag, written_at = lines[1].strip(), float(lines[2])
        changed_at = f.stat().st_ctime
    except (OSError, IndexError, ValueError):
        return None  # no metadata, or not huggingface_hub's format: read the file instead
    if not _SHA256_HEX.fullmatch(etag) or changed_at - _METADATA_SLACK_S > written_at:
        return None
    return etag


def _read_sha256(files: list[Path], cache_path: Path | None) -> dict[str, str]:
    """sha256 of each file by reading it, unless `cache_path` holds a hash taken at the file's current stat."""
    cache = _load_hash_cache(cache_path)
    out: dict[str, str] = {}
    todo: list[tuple[Path, os.stat_result]] = []
    for f in files:
        st = f.stat()
        entry = cache.get(_cache_key(f))
        if entry is not None and entry.get("stat") == _stat_id(st):
            out[f.name] = entry["sha256"]
        else:
            todo.append((f, st))
    if not todo:
        return out
    total = sum(st.st_size for _, st in todo)
    if total > _LOG_ABOVE_BYTES:
        log(
            "fingerprint",
            hashing_files=len(todo),
            gb=round(total / 1e9, 1),
            note="one-time; cached by size/mtime/ctime/inode",
        )
    started_ns = time.time_ns()
    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, len(todo))) as pool:
        hashes = list(pool.map(_hash_file, [f for f, _ in todo]))
    for (f, st), sha in zip(todo, hashes):
        out[f.name] = sha
        if _settled(f, st, started_ns):
            cache[_cache_key(f)] = {"stat": _stat_id(st), "sha256": sha}
    _save_hash_cache(cache_path, cache)
    return out


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _stat_id(st: os.stat_result) -> list[int]:
    """What must be unchanged for a cached hash to hold; ctime moves on any write, rename or utime."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _cache_key(f: Path) -> str:
    return os.path.abspath(f)


def _settled(f: Path, before: os.stat_result, started_ns: int) -> bool:
    """Whether the hash just read may be cached: the file did not change while it was read, nor shortly before."""
    try:
        after = f.stat()
    except OSError:
        return False
    return _stat_id(after) == _stat_id(before) and before.st_ctime_ns < started_ns - _RACY_NS


def _load_hash_cache(cache_path: Path | None) -> dict[str, dict]:
    """A missing, unreadable or foreign cache is an empty one: it only ever saves a re-read."""
    if cache_path is None:
        return {}
    try:
        data = json.loads(Path(cache_path).read_text())
        files = data["files"] if data.get("version") == _HASH_CACHE_VERSION else {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if _valid_entry(v)}


def _valid_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("sha256"), str)
        and bool(_SHA256_HEX.fullmatch(entry["sha256"]))
        and isinstance(entry.get("stat"), list)
    )


def _save_hash_cache(cache_path: Path | None, cache: dict[str, dict]) -> None:
    """Replace the cache atomically; a concurrent writer's entries may be lost, which costs only a re-read."""
    if cache_path is None:
        return
    try:
        with atomic_path(cache_path) as tmp:
            tmp.write_text(json.dumps({"version": _HASH_CACHE_VERSION, "files": cache}, sort_keys=True))
    except OSError:
        pass  # a read-only place: the fingerprint is still right, the next run reads the files again


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
