"""The target model: where it lives, its limits (context, vocabulary) read from its config, loading it, and where it
keeps its decoder."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from draftdata.config.schema import ModelConfig
from draftdata.errors import ConfigError, UserError


def looks_local(path: str) -> bool:
    """Whether `model.path` names a local directory: a hub id is `name` or `org/name`; a path that starts with `.`,
    `/` or `~`, has more than one `/`, or whose first component is a directory here, is meant as a local one."""
    parts = Path(path).parts
    return (
        path.startswith((".", "/", "~"))
        or path.count("/") > 1
        or (len(parts) > 1 and Path(parts[0]).expanduser().is_dir())
    )


class ModelNotBuilt(ConfigError):
    """`model.path` is an output of a dvc.yaml stage that has not run yet (the demo's models/tiny-llama on a fresh
    clone)."""


def check_model_path(path: str) -> None:
    """A mistyped local path fails here, at once, instead of after the hub's retries (tens of seconds) with an
    error about connecting to it; so does a path a dvc.yaml stage makes, not made yet (it may look like a hub id:
    `models/tiny-llama` before `models/` exists)."""
    if Path(path).expanduser().exists():
        return
    stage = stage_making(path)
    if stage is not None:
        raise ModelNotBuilt(
            "model.path", f"{path} does not exist yet; dvc.yaml's stage {stage} makes it (dvc repro {stage})"
        )
    if near := nearest_directory(path):  # one letter off a directory beside it (models/...): a typo, not a hub id
        raise ConfigError("model.path", f"{path}: no such directory; did you mean {near}?")
    if looks_local(path):
        raise ConfigError("model.path", f"{path}: no such directory (a local path; a hub id is 'org/name')")


def nearest_directory(path: str) -> str | None:
    """The directory beside where `path` points whose name is nearest its own, as `path` spells its folder; None where
    its folder does not exist or holds none near."""
    import difflib

    where = Path(path).expanduser()
    if Path(path).parent == Path(".") or not where.parent.is_dir() or not where.name:
        return None  # a bare name is a hub id (gpt2), not a typo of a folder beside it
    names = [d.name for d in where.parent.iterdir() if d.is_dir()]
    near = difflib.get_close_matches(where.name, names, n=1, cutoff=0.8)
    return str(Path(path).parent / near[0]) if near else None


def check_tracked_model_path(path: str) -> None:
    """Under `dvc repro`, where dvc.yaml makes `${model.path}` a dependency of every stage that reads the target: a
    local directory, or one a stage makes. A hub id there is refused by check_params, since DVC would first delete
    the outputs of the stage it reruns, then fail on the missing dependency with an error that names no key."""
    try:
        check_model_path(path)
    except ModelNotBuilt:
        return  # a dvc.yaml stage makes it, before the stages that depend on it
    if not Path(path).expanduser().exists():
        name = path.rstrip("/").rsplit("/", 1)[-1]
        raise ConfigError(
            "model.path",
            f"{path} is a hub id, but the pipeline tracks model.path as a local directory (a DVC dependency of "
            f"every stage); download it (hf download {path} --local-dir models/{name}) and set "
            f"model.path: models/{name}",
        )


def stage_making(path: str, dvc_yaml: Path = Path("dvc.yaml")) -> str | None:
    """The stage of the project's dvc.yaml (stages run from the project's root) whose `outs` list `path`; an out
    such as `${packaged_model.path}` is read from params.yaml beside it, as DVC does."""
    import yaml

    try:
        stages = yaml.safe_load(dvc_yaml.read_text()).get("stages") or {}
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None  # no dvc.yaml here (a stage run elsewhere): nothing to point to
    try:
        params = yaml.safe_load((dvc_yaml.parent / "params.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        params = {}
    want = os.path.normpath(path)
    for name, stage in stages.items():
        for out in (stage or {}).get("outs") or []:  # an out is a path, or {path: options}
            paths = (_param(str(o), params) for o in (out if isinstance(out, dict) else [out]))
            if any(o is not None and os.path.normpath(o) == want for o in paths):
                return name
    return None


def _param(out: str, params: dict) -> str | None:
    """`out` with a whole-value `${a.b}` replaced by params.yaml's a.b (None when it is not there)."""
    m = re.fullmatch(r"\$\{([\w.]+)\}", out)
    if m is None:
        return out
    value: object = params
    for part in m.group(1).split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return None if value is None else str(value)


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded repos, by its own precedence (HF_HUB_CACHE, else HF_HOME/hub), read
    now rather than when huggingface_hub was imported."""
    from huggingface_hub import constants

    for var, sub in (("HF_HUB_CACHE", ""), ("HUGGINGFACE_HUB_CACHE", ""), ("HF_HOME", "hub")):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser() / sub
    return Path(constants.HF_HUB_CACHE)


def hub_snapshot(path: str, revision: str | None) -> tuple[Path, str]:
    """A hub id's snapshot folder in the local HF cache and its commit: a branch or tag (null: the default branch)
    through refs/<revision>, a commit hash directly. Nothing is downloaded; a repo or revision not cached here is
    refused in one line."""
    from huggingface_hub import snapshot_download

    rev = revision or "main"
    cache = hub_cache_dir()
    try:
        folder = Path(snapshot_download(path, revision=rev, cache_dir=cache, local_files_only=True))
    except (OSError, ValueError):  # LocalEntryNotFoundError (an OSError), HFValidationError (a ValueError)
        raise ConfigError(
            "model.path",
            f"hub id {path!r} at model.revision {rev!r} is not in the local HF cache ({cache}); the target is "
            f"identified by the files of that snapshot, so download it first: hf download {path} --revision {rev}",
        ) from None
    return folder, folder.name


@dataclass(frozen=True)
class ModelLimits:
    context: int | None  # max_position_embeddings of the text model
    vocab: int | None  # rows of its embedding matrix


def model_dir(model: ModelConfig) -> str:
    """Where the target's files are loaded from: a local path as given; for a hub id, its snapshot in the local HF
    cache at the commit `model.revision` resolves to, the one the fingerprint names, so that what is loaded is
    what the stores record (loading by the revision would fetch the hub's newer commit where there is a network)."""
    if looks_local(model.path) or Path(model.path).expanduser().is_dir():
        return model.path
    return str(hub_snapshot(model.path, model.revision)[0])


@dataclass(frozen=True)
class Located:
    """The target's files as a stage finds them, once: their directory (`model_dir`), the revision they are
    identified by (a hub id's commit; a local directory's `model.revision` as given), and its config.json (None:
    none there, a directory holding only the tokenizer of a model served elsewhere)."""

    dir: str
    revision: str | None
    config: dict | None

    @property
    def limits(self) -> ModelLimits:
        """The target's context length and vocabulary size, from its config alone (unknown without one)."""
        if self.config is None:
            return ModelLimits(None, None)
        conf = self.config.get("text_config") or self.config  # a multimodal wrapper's language model
        return ModelLimits(_context(conf), conf.get("vocab_size"))


def locate(model: ModelConfig) -> Located:
    """`model.path` found (a mistyped local path refused at once), a hub id at its cached snapshot, and its config
    read: what every later look at the target reads, without finding it again."""
    check_model_path(model.path)
    if looks_local(model.path) or Path(model.path).expanduser().is_dir():
        folder, revision = model.path, model.revision
    else:
        snapshot, revision = hub_snapshot(model.path, model.revision)
        folder = str(snapshot)
    return Located(folder, revision, read_config(folder))


def read_config(folder: str) -> dict | None:
    """A model directory's config.json, read (None: it has none)."""
    local = Path(folder).expanduser() / "config.json"
    return json.loads(local.read_text()) if local.is_file() else None


def load_error(e: Exception, what: str, path: str) -> ConfigError:
    if "trust_remote_code" in str(e):  # the checkpoint ships its own Python: run only when the user says so
        return ConfigError(
            "model.trust_remote_code",
            f"{path!r} ships its own code for {what}; set "
            "model.trust_remote_code: true if you trust it (it runs on this machine)",
        )
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ConfigError("model.path", f"cannot load {what} from {path!r}: {first}")


def model_limits(model: ModelConfig) -> ModelLimits:
    """The target's context length and vocabulary size, from its config alone (no weights). Unknown (None) where
    there is no config to read: a directory holding only the tokenizer, for a model that lives on the server."""
    return locate(model).limits


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


def load_model(model: ModelConfig, device_map: str | None = None, device: str | None = None):
    """The target's weights, in eval mode and their own dtype: spread over the GPUs by `device_map` (e.g. "auto")
    for a target bigger than one, else on `device`, by default the GPU when there is one."""
    import torch
    from transformers import AutoModelForCausalLM

    check_model_path(model.path)
    source = model_dir(model)
    try:
        net = AutoModelForCausalLM.from_pretrained(
            source,
            dtype="auto",
            trust_remote_code=model.trust_remote_code,
            **({"device_map": device_map} if device_map else {}),
        )
    except (OSError, ValueError) as e:
        raise load_error(e, "a model", model.path) from None
    if not device_map:
        net = net.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return net.eval()


def has_weights(directory: str) -> bool:
    """Whether a local directory holds weights `load_model` reads (.safetensors or PyTorch .bin files), not only a
    config and a tokenizer (a target served elsewhere)."""
    root = Path(directory).expanduser()
    return root.is_dir() and any(any(root.glob(f"*.{ext}")) for ext in ("safetensors", "bin"))


def model_skeleton(model: ModelConfig):
    """The target's modules as `load_model` builds them, from its config alone on the meta device: no weights read,
    no memory taken. What check_params inspects (`find_decoder`) before any stage loads the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    check_model_path(model.path)
    source = model_dir(model)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=model.trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise load_error(e, "a model", model.path) from None


def find_decoder(model):
    """The text decoder (its `layers` and final `norm`) through the model's own accessors, so a multimodal wrapper
    (a vision tower around a language model, as Kimi-K2.5's) is handled like a plain causal LM: transformers' models
    name it with get_decoder(), vLLM's with get_language_model() or a `language_model` attribute."""
    holders = []
    if hasattr(model, "get_decoder"):
        holders.append(model.get_decoder())
    if hasattr(model, "get_language_model"):
        holders.append(model.get_language_model())
    holders += [getattr(model, "language_model", None), model]
    for holder in filter(None, holders):
        for candidate in (holder, getattr(holder, "model", None)):
            if candidate is not None and hasattr(candidate, "layers") and hasattr(candidate, "norm"):
                return candidate
    raise UserError(f"model.path: cannot find the decoder layers and final norm of {type(model).__name__}")


TEXT_CONFIG_NAMES = ("text_encoder", "decoder", "generator", "text_config")  # PretrainedConfig.get_text_config's


def local_config(model: ModelConfig) -> dict | None:
    """The target's text config from a local config.json only (None otherwise): no hub, no network, no error for a
    model directory not built yet."""
    local = Path(model.path).expanduser() / "config.json"
    if not local.is_file():
        return None
    try:
        conf = json.loads(local.read_text())
    except (OSError, ValueError):
        return None
    # where transformers' get_text_config() finds it (what the stages read): a composite model's text part, by name
    nested = [conf[name] for name in TEXT_CONFIG_NAMES if isinstance(conf.get(name), dict)]
    return nested[0] if len(nested) == 1 else conf


def local_context(model: ModelConfig) -> int | None:
    """The target's context from a local config.json only (None otherwise)."""
    conf = local_config(model)
    return None if conf is None else _context(conf)
