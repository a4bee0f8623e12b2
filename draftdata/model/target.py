"""The target as a generate run uses it, found and checked once before any request: its tokenizer with the chat
template, what that template does (the tokens a turn ends on, the parts of an answer it leaves out), its context,
the dtype the in-process engine computes it in, and the fingerprints that its answers and renders are stored under.

One pass over the model's rooms, in order (model/load.py finds it, config/schema.py reads the template and checks
the room it leaves, model/tokenizer.py loads and checks the tokenizer, model/compute.py settles the arithmetic and
refuses a quantized checkpoint for the embedded engine before model/fingerprint.py hashes its files), each handed
what the one before found: nothing is found, read or hashed twice, and planning, the checks and the backends read the
result instead of asking the model again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftdata.config.schema import BackendKind, Config, chat_template_text, check_room
from draftdata.model.compute import (
    computed_fingerprint,
    config_dtype,
    config_quantization,
    embedded_on_gpu,
    refuse_quantized,
    resolve,
)
from draftdata.model.fingerprint import files_fingerprint
from draftdata.model.load import locate
from draftdata.model.tokenizer import (
    check_tokenizer_fits,
    end_of_turn_ids,
    tokenizer_at,
    tokenizer_fingerprint,
    unrendered_parts,
)
from draftdata.util.hashing import content_hash


@dataclass(frozen=True)
class Target:
    """What a generate run knows of its target (`load_target`)."""

    tok: object  # the tokenizer, with the configured chat template
    context: int | None  # the target's context (None: unknown)
    stop_ids: frozenset[int]  # every token that ends its turn (`end_of_turn_ids`): what the embedded engine stops on
    unrendered: tuple[str, ...]  # what the chat template leaves out of an answer (`unrendered_parts`)
    model_fp: str  # the target's fingerprint as the run computes it: part of every request key
    render_fp: str  # the render cache's (model, tokenizer files, template and kwargs, tokenizer libraries)
    compute_dtype: str | None  # the embedded engine's arithmetic (model/compute.py); None: a server computes
    on_gpu: bool  # the embedded engine computes on a GPU (transformers' batching where one is)


def load_target(cfg: Config, hashes: Path | None, tok=None) -> Target:
    """The dataset's target (`cfg` a dataset's config, a mode's where it has modes), refused before any request
    where it cannot be the target: ids past the model's embeddings, a chat template that ends the turn on a token
    the target does not stop on, a max_tokens that leaves no room in its context, a quantized checkpoint for the
    embedded engine. Its file hashes are cached in `hashes` (`hash_cache_path`, beside the store; None: not
    cached). `tok`: its tokenizer, loaded already (`draftdata plan` loads one for every dataset)."""
    import tokenizers
    import transformers

    model, kwargs = cfg.model, cfg.template_kwargs
    found = locate(model)
    template = chat_template_text(model) if tok is None else None
    check_room(cfg.ds, f"datasets.{cfg.dataset}", found.limits.context)
    if tok is None:
        tok = tokenizer_at(found.dir, model, template)
    check_tokenizer_fits(tok, model, found.limits)
    stop_ids, unrendered = frozenset(end_of_turn_ids(tok, model, kwargs)), tuple(unrendered_parts(tok, kwargs))
    tokenizer = tokenizer_fingerprint(tok, model, kwargs)
    dtype, on_gpu, weights = None, False, None
    if cfg.backend.kind == BackendKind.embedded:
        # a quantized checkpoint the engine would cast without its scales, refused before its weights are hashed
        refuse_quantized(model, config_quantization(found.config))
        weights, on_gpu = config_dtype(found.config), embedded_on_gpu(cfg)
        dtype = resolve(model.compute_dtype, weights, on_gpu)
    # the arithmetic the engine computes in is part of what its answers are: a dtype other than the weights' own
    # names its own fingerprint (model/compute.py); a server's (dtype None) is the weights' own
    model_fp = computed_fingerprint(files_fingerprint(found.dir, found.revision, hashes), dtype, weights)
    libraries = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    render_fp = content_hash({"model": model_fp, "tokenizer": tokenizer, **libraries}, n=32)
    return Target(tok, found.limits.context, stop_ids, unrendered, model_fp, render_fp, dtype, on_gpu)
