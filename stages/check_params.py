"""Stage `check_params`: params.yaml checked whole (every dataset, every run-time key) whenever it changes.

Each chain stage checks the schema and its own dataset's values when it runs, and DVC reruns only the stages whose
declared params changed; so a typo in a run-time key (`concurency`) or a bad value in a dataset that nothing reruns
would pass `dvc repro` unnoticed until that stage next ran, perhaps hours into a run. This stage depends on
params.yaml itself, so DVC runs it on every edit; it loads the config as every stage does and checks the values of
every dataset (and that the backend sends each one's sampling), that a local model.path exists (or a dvc.yaml stage
makes it), and, where the target is on this disk, that its tokenizer fits its embeddings, that its chat template
ends the turn on a token the target stops on (and says which token that is), that every drafter family's layers
exist in it, that the hf engine finds its decoder (the model built on the meta device, where its weights are here)
and that each dataset's max_tokens leaves room for a prompt in its context; and that the response store
(run.store_path) opens; tests/test_refusals.py lists every refusal of a stage, and which of them this one makes. It
writes what each dataset's prompts are read from (a local file's content hash, a hub source's pin) to
data/sources_checked/<dataset>.json: each prompts stage depends on its own dataset's file, so an edit of one source
reruns that dataset's prompts alone.

Every other stage depends on its output, data/params_checked.json: a refused config stops `dvc repro` here, before
DVC removes the outputs of the stage asked for to rerun it. The file's bytes are the same whenever the check passes,
so it reruns nothing downstream.
"""

from __future__ import annotations

from pathlib import Path

from draftdata.config.load import cli
from draftdata.config.modes import mode_warnings
from draftdata.config.schema import (
    BackendKind,
    Config,
    EmptyThink,
    check_all,
    check_room,
    length_warnings,
    template_kwargs_of,
)
from draftdata.drafters.layers import family_layers
from draftdata.hidden.shared_store import check_states_path
from draftdata.model.compute import check_embedded_target, check_hf_cast, compute_dtype
from draftdata.model.load import (
    check_tracked_model_path,
    find_decoder,
    has_weights,
    local_config,
    local_context,
    model_skeleton,
)
from draftdata.model.think import block_of
from draftdata.model.tokenizer import check_local_target, has_tokenizer_files, load_tokenizer
from draftdata.sources.files import identity
from draftdata.util.files import write_json
from draftdata.util.log import log
from draftdata.util.sqlite import check_store_path

CHECKED = Path("data") / "params_checked.json"
SOURCES = Path("data") / "sources_checked"  # <dataset>.json: what its prompts are read from (dvc.yaml's prompts deps)


def main(cfg: Config) -> None:
    check_all(cfg)
    # a mistyped local path or a hub id, refused here rather than by the first stage that loads it (after DVC's
    # deletes); a path a stage of this pipeline makes (the demo's models) passes
    check_tracked_model_path(cfg.model.path)
    # a chat template that ends the turn where the target does not stop, under any dataset's (and mode's) kwargs
    kwargs = [template_kwargs_of(cfg, name) for name in cfg.datasets or [None]]
    kwargs += [
        {**template_kwargs_of(cfg, n), **m.template_kwargs} for n, ds in cfg.datasets.items() for m in ds.modes.values()
    ]
    check_local_target(cfg.model, kwargs)
    if cfg.tokenize.empty_think != EmptyThink.auto and has_tokenizer_files(cfg.model.path):
        tok = load_tokenizer(cfg.model)  # a template with no empty think block to act on is refused here
        for one in kwargs:
            block_of(tok, one, cfg.tokenize.empty_think)
    stored = any(ds.store_hidden_states for ds in cfg.datasets.values())
    check_engines(cfg, stored)
    context = local_context(cfg.model)
    for name, ds in cfg.datasets.items():  # generate's refusal, here before DVC deletes its outputs
        check_room(ds, f"datasets.{name}", context)
    check_store_path(cfg.run.store_path)  # a store that cannot open, refused here rather than by generate
    if stored:
        check_states_path(cfg.run)  # and the state store, rather than by hidden_states
    for line in mode_warnings(cfg):  # mode weights taken as shares: told, not refused
        log("check_params", warning=line)
    for line in length_warnings(cfg, context=context):  # samples tokenize may drop: told, not refused
        log("check_params", warning=line)
    write_json(CHECKED, {"checked": "params.yaml", "ok": True})
    for name, ds in cfg.datasets.items():
        write_json(SOURCES / f"{name}.json", identity(ds.source))
    log("check_params", datasets=len(cfg.datasets), ok=True)


def check_engines(cfg: Config, stored: bool) -> None:
    """What the engines would refuse of a target on this disk: a quantized one an in-process engine would cast, and
    where states are stored, every drafter family's layers and the decoder the hf engine hooks."""
    conf = local_config(cfg.model)
    if conf is None:
        return
    if cfg.backend.kind == BackendKind.embedded:
        check_embedded_target(cfg.model)  # generate's refusal
    if not stored:
        return
    if cfg.hidden_states.backend == "hf":  # the hf engine's, on this node (a GPU: its own dtype)
        check_hf_cast(cfg.model, compute_dtype(cfg.model, on_gpu=bool(cfg.hidden_states.device_map) or None))
    if "num_hidden_layers" in conf:
        # every drafter family's layers exist in the target (the hidden_states stage resolves them again)
        family_layers(cfg, conf["num_hidden_layers"])
    if cfg.hidden_states.backend == "hf" and has_weights(cfg.model.path):
        find_decoder(model_skeleton(cfg.model))  # the decoder the hf engine hooks, found in the model built on meta


if __name__ == "__main__":
    cli(main, need_dataset=False)
