"""The training half of `python -m bench.drafter`, run by the trainers' Python (DRAFTDATA_TRAINERS_PYTHON): it imports
speculators, SpecForge (for Domino) and torch only, never the project.

    <trainers python> bench/drafter_train.py SPEC.json RUNS_DIR

The library's own parts: the data path (`speculators.train.data.ArrowDataset` reads our export, `CollateFn` packs it),
the drafter (`Eagle3DraftModel.from_training_args`, its draft decoder config from `create_transformer_layer_config`,
the verifier's embeddings, LM head and final norm loaded from the target), its samples shifted as its CLI shifts
them (`shift_batch`), its training-time-test forward with its KL loss and per-step accuracies (`full_acc_k`,
`cond_acc_k`), and the accepted-length count
(`speculators.models.metrics.compute_accepted_length_counts`, vLLM's convention: the leading run of correct draft
tokens plus the verifier's bonus token). Also the library's: the optimizer
(`build_optimizers`: AdamW with its weight decay) and its Trainer's default schedule (linear warm-up over 1 % of the
steps, then linear decay to zero). Ours: the loop below (gradient clipping at 1.0 as its Trainer does, float32 on a
CPU where its Trainer moves batches to a GPU), the variants, and the blocks the accepted length is counted over.

The block drafters (a variant's `family`: dflash, dflash2, dspark) are the library's too: `DFlashDraftModel`,
`DFlash2DraftModel` and `DSparkDraftModel.from_training_args`, their forward (anchored blocks, the family's loss and
per-position weight from `get_trainer_kwargs`; DFlash2's candidate selector beside its KL loss) and its metrics, whose
expected accepted length (`eal`) and per-position accuracies judge them; the same loop, optimizer, schedule, packs and
seeds train them. So is P-EAGLE (`peagle`): `PEagleDraftModel.from_training_args` on EAGLE-3's layers, its samples
shifted as its CLI shifts them (`shift_batch`), its forward (COD-sampled parallel depths, KL loss) in training; judged
by its own forward over every depth of a rollout at every trained position (`evaluate_peagle`). Domino (`domino`),
which speculators has not got, is SpecForge's: `DominoDraftModel` in its `OnlineDominoModel`, built by its own
`build_model_bundle`, trained through its Domino train strategy's loss (the base-loss weight decaying with the step)
on batches its own collator pads, in the same loop, optimizer, schedule and seeds; judged by that forward as its own
decoding loop drafts (`evaluate_domino`).

A variant trains on an export's states as some pipeline might have got them wrong: which of the captured layers feed the
drafter (`layers`, physical ids, in that order), and how the final state reaches the loss (`final`: `pre` as speculators
expects; `post` = the target's final norm applied already, so the trainer normalizes twice; `pre_as_post` = a trainer
that expects the post-norm state, as SpecForge's does, and applies the LM head alone, given the pre-norm one;
`no_states` = zeros where the states go, in training and when judged: what the states are worth to the drafter, not an
error). Every other variant is judged on the same held-out samples served the right way: its family's layers in
index order (EAGLE-3's, or the block drafters'), the pre-norm state through the target's own norm and head, as vLLM
would serve the drafter.
"""

from __future__ import annotations

import functools
import io
import json
import os
import sys
import time
from pathlib import Path

import torch

TTT_STEPS = 3
# The block drafters as speculators' trainer builds them by default (train/config/schema.py: `_DEFAULT_LOSS_FN`,
# `_DEFAULT_BLOCK_SIZE`, the per-position weight), but with one draft layer, as the EAGLE-3 drafter here: its default
# of 5 for these families makes a step too slow for the CPU bench.
# DFlash2's is DSpark's recipe (schema.py `_resolve_derived_defaults`: "keeping block_size=8, fixed exponential
# position weights, and KL loss for direct comparison with DSpark"); its selector's knobs are left at the defaults
# that `DFlash2DraftModel.from_training_args` and `get_trainer_kwargs` share with its CLI (`DFlash2Args`).
BLOCK = {
    "dflash": {"loss_fn": "ce", "block_size": 16, "per_position_loss_weight": "dpace"},
    "dflash2": {"loss_fn": "kl_div", "block_size": 8, "per_position_loss_weight": "fixed-exp-decay"},
    "dspark": {"loss_fn": "kl_div", "block_size": 8, "per_position_loss_weight": "fixed-exp-decay"},
}
BLOCK_DRAFT_LAYERS = 1
# P-EAGLE as its CLI trains it by default (schema.py `PEagleArgs`; `_DEFAULT_LOSS_FN` has no entry for it: kl_div):
# 8 parallel depths, the COD sampler's geometric keep ratio and its floor
PEAGLE = {"loss_fn": "kl_div", "num_depths": 8, "down_sample_ratio": 0.7, "down_sample_ratio_min": 0.2}
# Domino (SpecForge's alone) as SpecForge's own recipe trains it (configs/qwen3-8b-domino.json: a block of 16, its
# labels shifted one on, one pure-draft prefix position, an embedding a sixteenth and a GRU a quarter of the target's
# width: 256 and 1,024 at 4,096), with one draft layer as the others here; its base-loss weight decays as its train
# strategy decays it (`linear_lambda_base`: from 1 to 0 over the first half of the steps)
DOMINO = {"block_size": 16, "shift_label": True, "pure_draft_prefix_len": 1, "emb_width": 1 / 16, "gru_width": 1 / 4}


def block_class(family: str):
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dflash2 import DFlash2DraftModel
    from speculators.models.dspark import DSparkDraftModel

    return {"dflash": DFlashDraftModel, "dflash2": DFlash2DraftModel, "dspark": DSparkDraftModel}[family]


@functools.cache
def call_kwargs(family: str = "eagle3", max_anchors: int = 512) -> dict:
    """The forward's arguments as speculators' CLI builds them (`get_trainer_kwargs`): EAGLE-3's defaults (KL loss,
    no decay over the steps), a block family's (its loss and per-position weight, `max_anchors` blocks sampled per
    pack), P-EAGLE's (KL loss, its depths and COD ratios, `max_anchors` rollouts per pack); the losses' eager
    implementation, as the fused ones need Triton."""
    if family == "peagle":
        from speculators.models.peagle import PEagleDraftModel

        train_kwargs, _ = PEagleDraftModel.get_trainer_kwargs(
            **PEAGLE, loss_implementation="eager", max_anchors=max_anchors
        )
        return train_kwargs
    if family != "eagle3":
        train_kwargs, _ = block_class(family).get_trainer_kwargs(
            loss_fn=BLOCK[family]["loss_fn"],
            loss_implementation="eager",
            per_position_loss_weight=BLOCK[family]["per_position_loss_weight"],
            max_anchors=max_anchors,
        )
        return train_kwargs
    from speculators.models.eagle3 import Eagle3DraftModel

    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=TTT_STEPS, ttt_step_loss_decay=1.0
    )
    return train_kwargs


class Select:
    """CollateFn's `preprocess`: a variant's aux layers (and final state) from an export's sample; with `zero`,
    zeros in their place (the drafter sees no states)."""

    def __init__(self, idx: list[int], hidden: int, n_aux: int, norm=None, zero: bool = False):
        self.idx, self.hidden, self.n_aux, self.norm, self.zero = idx, hidden, n_aux, norm, zero

    def __call__(self, item: dict) -> dict:
        hs = item["hidden_states"].reshape(-1, self.n_aux, self.hidden)[:, self.idx].flatten(1)
        item = dict(item, hidden_states=torch.zeros_like(hs) if self.zero else hs)
        if self.norm is not None:
            with torch.no_grad():
                item["verifier_last_hidden_states"] = self.norm(item["verifier_last_hidden_states"].float())
        return item


# the families speculators' CLI shifts (cli.py `main`, `preprocess_fns`: `shift_batch` for eagle3 and peagle; the
# block drafters take the samples unshifted, their anchors read the ids)
SHIFTED = ("eagle3", "peagle")


def preprocess(family: str, select: Select):
    """CollateFn's `preprocess` for a family: the variant's states, then for EAGLE-3 and P-EAGLE their CLI's own
    `shift_batch`, which pairs position t's states with token t + 1 and the target's state there: the drafter sees
    the token the target chose after t beside the states that chose it, and predicts the next, as vLLM serves it.
    Unshifted, its first step would predict the token the same position's states already encode."""
    if family not in SHIFTED:
        return select
    from speculators.models.eagle3.data import shift_batch

    return lambda item: shift_batch(select(item))


def load_export(path: str, max_len: int):
    from speculators.train.data import ArrowDataset

    return ArrowDataset(max_len=max_len, datapath=path, on_missing="raise", hidden_states_dtype=torch.float32)


def packs(ds, rows: list[int], max_len: int) -> list[list[int]]:
    """Rows grouped into packs of at most `max_len` tokens, in the given order."""
    out, cur, n = [], [], 0
    for r in rows:
        length = min(ds.approx_lengths[r], max_len)
        if cur and n + length > max_len:
            out.append(cur)
            cur, n = [], 0
        cur.append(r)
        n += length
    return out + ([cur] if cur else [])


def vocab_mapping(spec: dict, export: str) -> tuple:
    """(t2d, d2t) of the draft vocabulary bench.drafter chose from `export`'s training rows (speculators' own rule),
    or (None, None): the drafter predicts over the target's whole vocabulary."""
    path = spec.get("vocab_mappings", {}).get(export)
    if not path:
        return None, None
    m = torch.load(path)
    return m["t2d"], m["d2t"]


def build_drafter(spec: dict, seed: int, variant: dict):
    """The variant's family's drafter, its initial weights from `seed`, its vocabulary the one chosen from its
    training export (or the target's whole; Domino drafts over the target's whole, with its LM head)."""
    torch.manual_seed(seed)
    if variant["family"] == "domino":
        return build_domino(spec).float().to(spec.get("device", "cpu"))
    t2d, d2t = vocab_mapping(spec, variant["export"])
    build = {"eagle3": build_eagle3, "peagle": build_peagle}.get(variant["family"], build_block)
    return build(spec, variant["family"], t2d, d2t).float().to(spec.get("device", "cpu"))


def layer_config(spec: dict, family: str):
    """The draft decoder's config as speculators' CLI makes it: one layer, of its default architecture for the
    family (llama for EAGLE-3, qwen3 for the others: schema.py `_resolve_derived_defaults`, P-EAGLE included)."""
    from speculators.train.cli import create_transformer_layer_config

    return create_transformer_layer_config(
        verifier_name_or_path=spec["target"],
        num_layers=1 if family == "eagle3" else BLOCK_DRAFT_LAYERS,
        draft_arch="llama" if family == "eagle3" else "qwen3",
        hidden_act=None,
        sliding_window=spec["max_len"],
        full_attention_indices=[0],
    )


def eagle_kwargs(spec: dict, family: str, t2d, d2t) -> dict:
    """What EAGLE-3's and P-EAGLE's `from_training_args` are given alike: the draft decoder's config, the target,
    the draft vocabulary (EAGLE-3's for a large one: its head and loss over the tokens the data uses; else all),
    EAGLE-3's layers in vLLM's numbering (id L is layer L-1's output), eager attention."""
    config = layer_config(spec, family)
    return {
        "verifier_config": config,
        "verifier_name_or_path": spec["target"],
        "draft_vocab_size": int(t2d.sum()) if t2d is not None else config.vocab_size,
        "t2d": t2d,
        "d2t": d2t,
        "target_layer_ids": [i + 1 for i in spec["eval_layers"]],
        "draft_attn_impl": "eager",
    }


def build_eagle3(spec: dict, family: str, t2d, d2t):
    from speculators.models.eagle3 import Eagle3DraftModel

    return Eagle3DraftModel.from_training_args(
        **eagle_kwargs(spec, family, t2d, d2t),
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
        ttt_steps=TTT_STEPS,
    )


def build_peagle(spec: dict, family: str, t2d, d2t):
    """speculators' P-EAGLE drafter (`PEagleDraftModel.from_training_args`) with what its CLI passes a non-eagle3
    type by default (schema.py `DraftArgs`, `_resolve_derived_defaults`): norm before the residual, no norm before the
    fc and none on the output, its embeddings trained (`PEagleSpeculatorConfig.embed_requires_grad`); its mask token
    (the depths past the first) by its trainer's rule; EAGLE-3's layers; eager attention, as the EAGLE-3 drafter's."""
    from speculators.models.peagle import PEagleDraftModel
    from speculators.train.utils import resolve_mask_token_id

    kwargs = eagle_kwargs(spec, family, t2d, d2t)
    return PEagleDraftModel.from_training_args(
        **kwargs,
        norm_before_residual=True,
        norm_before_fc=False,
        fc_norm=False,
        norm_output=False,
        num_depths=PEAGLE["num_depths"],
        mask_token_id=resolve_mask_token_id(spec["target"], kwargs["verifier_config"].vocab_size),
    )


def build_block(spec: dict, family: str, t2d, d2t):
    """speculators' DFlash, DFlash2 or DSpark drafter (`from_training_args`, as its trainer builds it), its mask token
    by its trainer's own rule (`resolve_mask_token_id`); sdpa attention, as its default flex attention wants a GPU.
    DFlash2 drafts over the target's whole vocabulary (its `__init__` refuses a draft vocabulary; bench.drafter
    refuses the pair before any work)."""
    from speculators.train.utils import resolve_mask_token_id

    config = layer_config(spec, family)
    return block_class(family).from_training_args(
        verifier_config=config,
        verifier_name_or_path=spec["target"],
        draft_vocab_size=int(t2d.sum()) if t2d is not None else config.vocab_size,
        t2d=t2d,
        d2t=d2t,
        block_size=BLOCK[family]["block_size"],
        mask_token_id=resolve_mask_token_id(spec["target"], config.vocab_size),
        target_layer_ids=[i + 1 for i in spec["block_layers"]],  # vLLM's numbering, as the EAGLE-3 drafter's
        draft_attn_impl="sdpa",
    )


def build_domino(spec: dict):
    """SpecForge's Domino as `specforge train` builds it: a run config naming the family and its draft config, then
    `build_model_bundle` (the draft from its registry, the target's embeddings and LM head, the mask token by its
    rule, `OnlineDominoModel` around them). The draft config is the one SpecForge derives for DFlash from the target
    (Domino's backbone; SpecForge derives none for Domino itself), with Domino's architecture and head (`DOMINO`),
    one layer, and the block layers as its target layers (SpecForge numbers layers as HF does: the physical ids).
    Float32 and sdpa attention: flex attention and bf16 are its GPU run's settings. Returns the training model, its
    train strategy (`strategy`); its draft (`draft_model`) is what the optimizer holds, as SpecForge's trainer's."""
    import tempfile

    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.config.schema import Config
    from specforge.training.assembly import build_model_bundle
    from specforge.training.model_loading import resolve_draft_config

    registry = builtin_algorithm_registry()
    alg = registry.resolve("domino")

    def config(strategy: str, **model) -> Config:
        return Config(
            model={"target_model_path": spec["target"], "torch_dtype": "float32", **model},
            data={"hidden_states_path": spec["exports"][spec["eval"]["export"]]["path"]},
            training={"strategy": strategy, "attention_backend": "sdpa", "num_anchors": spec["max_anchors"]},
        )

    derived = resolve_draft_config(config("dflash"), provider=registry.resolve("dflash").providers.model.draft_config)
    width = derived.hidden_size
    head = {"projector_type": "domino", "shift_label": DOMINO["shift_label"]}
    head |= {"pure_draft_prefix_len": DOMINO["pure_draft_prefix_len"]}
    head |= {"emb_dim": int(width * DOMINO["emb_width"]), "gru_hidden_dim": int(width * DOMINO["gru_width"])}
    draft = derived.to_dict() | {
        "architectures": [alg.providers.model.draft_config.architecture],
        "num_hidden_layers": BLOCK_DRAFT_LAYERS,
        "layer_types": ["full_attention"] * BLOCK_DRAFT_LAYERS,
        "block_size": DOMINO["block_size"],
        "dflash_config": {"target_layer_ids": spec["block_layers"], **head},
    }
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "draft.json"
        path.write_text(json.dumps(draft))
        bundle = build_model_bundle(config("domino", draft_model_config=str(path)), algorithm=alg)
    model = bundle.model
    model.strategy = alg.providers.step.build(model, **bundle.strategy_kwargs.options)
    return model


def optimizers(model, spec: dict) -> tuple[list, list]:
    """speculators' own optimizer (`build_optimizers`: AdamW, its weight decay) and learning-rate schedule, as its
    Trainer sets them up for a run of `steps` steps: linear warm-up over its default 1 % of the steps, then linear
    decay to zero (`_resolve_scheduler_steps`, `get_linear_schedule_with_warmup`)."""
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps
    from transformers import get_linear_schedule_with_warmup

    config = TrainerConfig(lr=spec["lr"], num_epochs=1, save_path="", max_steps=spec["steps"])
    opts = build_optimizers(model, config)
    warmup, total = _resolve_scheduler_steps(config, spec["steps"])
    return opts, [get_linear_schedule_with_warmup(o, warmup, total) for o in opts]


def train(model, variant: dict, spec: dict, seed: int) -> float:
    ds = EXPORTS[variant["export"]]
    n_aux = len(spec["exports"][variant["export"]]["layers"])
    idx = [spec["exports"][variant["export"]]["layers"].index(i) for i in variant["layers"]]
    norm = model.verifier_norm if variant["final"] == "post" else None
    select = Select(idx, spec["hidden_size"], n_aux, norm, zero=variant["final"] == "no_states")
    rows = spec["train_rows"][variant["export"]]
    if variant["family"] == "domino":
        collate, loss_of, trained, rows = domino_step(model, spec, select, ds, rows)
    else:
        collate, loss_of, trained = speculators_step(model, variant, spec, select, len(idx))
    gen = torch.Generator().manual_seed(seed)
    true_norm = getattr(model, "verifier_norm", None)
    if variant["final"] == "pre_as_post":
        model.verifier_norm = torch.nn.Identity()
    opts, schedulers = optimizers(trained, spec)
    model.train()
    step, t0 = 0, time.perf_counter()
    while step < spec["steps"]:
        order = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
        for pack in packs(ds, order, spec["max_len"]):
            batch = collate([ds[r] for r in pack])
            batch = {k: v.to(spec.get("device", "cpu")) for k, v in batch.items() if isinstance(v, torch.Tensor)}
            loss = loss_of(batch, step)
            for opt in opts:
                opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for opt, sched in zip(opts, schedulers):
                opt.step()
                sched.step()
            step += 1
            if step == spec["steps"]:
                break
    if variant["final"] == "pre_as_post":
        model.verifier_norm = true_norm
    return time.perf_counter() - t0


def speculators_step(model, variant: dict, spec: dict, select: Select, n_layers: int) -> tuple:
    """(collate, loss of a batch at a step, what the optimizer holds) for speculators' drafters: its CollateFn packs
    the samples into one row (its document ids keep them apart), the family's forward with its CLI's arguments."""
    from speculators.train.data import CollateFn

    family = variant["family"]
    collate = CollateFn(spec["max_len"], spec["hidden_size"], n_layers, torch.float32, preprocess(family, select))

    def loss_of(batch: dict, _step: int):
        if family == "peagle":
            batch = unpadded(batch)
        return model(**batch, **call_kwargs(family, spec["max_anchors"]))[1]

    return collate, loss_of, model


def domino_step(model, spec: dict, select: Select, ds, rows: list[int]) -> tuple:
    """(collate, loss of a batch at a step, what the optimizer holds, the rows it trains on) for SpecForge's Domino:
    the rows its reader keeps (`has_consecutive_supervised_tokens`, its loss-mask filter: an anchor needs two
    adjacent trained tokens), a pack's samples padded into rows by its own collator (its blocks attend to everything
    before them in a row, so samples are never packed into one), its train strategy's loss with the step's context
    (Domino's base-loss weight decays with it); the optimizer holds the draft alone, as its trainer's does."""
    from specforge.algorithms.common.dflash_family_data import build_collator
    from specforge.data.loss_mask import has_consecutive_supervised_tokens
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import StepContext

    pad = build_collator()

    def collate(items: list[dict]) -> dict:
        feats = []
        for item in map(select, items):
            n = min(item["input_ids"].shape[0], spec["max_len"])
            feats.append({k: item[k][None, :n] for k in ("input_ids", "loss_mask", "hidden_states")})
            feats[-1]["hidden_states"] = feats[-1]["hidden_states"].float()  # stored bf16; the drafter trains in fp32
        return pad(feats)

    def loss_of(batch: dict, step: int):
        tb = TrainBatch(sample_ids=[], strategy="domino", tensors=batch)
        return model.strategy.forward_loss(tb, StepContext(global_step=step, total_steps=spec["steps"])).loss

    masks = ds.data.select(rows)["loss_mask"]  # the export's table alone: no state file read to filter rows
    keep = [r for r, mask in zip(rows, masks) if has_consecutive_supervised_tokens(mask[: spec["max_len"]])]
    return collate, loss_of, model.draft_model, keep


def held_out(spec: dict, family: str, layers_key: str, device, zero: bool = False):
    """The held-out samples of `all` one at a time (no block crosses a sample) as the family is served: the layers
    `spec[layers_key]` in order, shifted where its CLI shifts them, cut to a pack, on `device`: (row, batch)."""
    from speculators.train.data import CollateFn

    ev = spec["eval"]
    ds = EXPORTS[ev["export"]]
    layers = spec["exports"][ev["export"]]["layers"]
    idx = [layers.index(i) for i in spec[layers_key]]
    select = Select(idx, spec["hidden_size"], len(layers), zero=zero)
    collate = CollateFn(spec["max_len"], spec["hidden_size"], len(idx), torch.float32, preprocess(family, select))
    for r in ev["rows"]:
        item = ds[r]
        n = min(item["input_ids"].shape[0] - (family in SHIFTED), spec["max_len"])  # shift_batch drops a position
        batch = collate([item])
        yield r, {k: v[:, :n].to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}


def unpadded(batch: dict) -> dict:
    """A pack without the padding after its samples (document id -1). P-EAGLE's mask gives a padded position no key
    (peagle/attention.py `create_peagle_mask_mod`: `is_not_padding`): flex attention, its trainer's on a GPU, outputs
    zeros there, eager attention NaN, which its loss's masked sum carries into every step. Every other position sees
    the same keys either way."""
    n = int((batch["document_ids"][0] >= 0).sum())
    return {k: v[:, :n] for k, v in batch.items()}


def evaluate(model, spec: dict, variant: dict) -> dict:
    if variant["family"] == "eagle3":
        return evaluate_eagle3(model, spec, zero=variant["final"] == "no_states")
    if variant["family"] == "peagle":
        return evaluate_peagle(model, spec)
    if variant["family"] == "domino":
        return evaluate_domino(model, spec)
    return evaluate_block(model, spec, variant["family"])


@torch.no_grad()
def evaluate_eagle3(model, spec: dict, zero: bool = False) -> dict:
    """Held-out samples one at a time (no block crosses a sample), served right (shifted as in training; with
    `zero`, with no states, as the drafter was trained): the library's per-step accuracies, and the accepted length
    of a block starting at every position."""
    from speculators.models.metrics import compute_accepted_length_counts

    model.eval()
    sums: dict[str, float] = {}
    accepted, blocks = 0.0, 0.0
    for _, batch in held_out(spec, "eagle3", "eval_layers", model.device, zero=zero):
        n = batch["input_ids"].shape[1]
        drafts, _, metrics = model(**batch, **call_kwargs())
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        # the verifier's token: its argmax over its whole vocabulary, as it would serve it (a draft vocabulary's
        # restricted head would accept a draft the target would not have chosen)
        target = (model.verifier_norm(batch["verifier_last_hidden_states"]) @ full_head(spec).T).argmax(-1)[0].cpu()
        mask = batch["loss_mask"][0].bool().cpu()
        correct = torch.zeros(n, TTT_STEPS, dtype=torch.bool)
        valid = torch.zeros(n, TTT_STEPS, dtype=torch.bool)
        for k, d in enumerate(drafts):  # step k's draft at position t is the token after t + k
            d = to_target_ids(model, d[0, : n - k]).cpu()
            correct[: n - k, k] = d == target[k:]
            valid[: n - k, k] = mask[k:]
        a, b = compute_accepted_length_counts(correct, valid)
        accepted, blocks = accepted + float(a), blocks + float(b)
    out = {"accepted_length": accepted / blocks, "blocks": int(blocks)}
    for k in range(TTT_STEPS):
        out[f"full_acc_{k}"] = sums[f"full_acc_{k}_sum"] / sums[f"full_acc_{k}_total"]
        out[f"cond_acc_{k}"] = sums[f"cond_acc_{k}_sum"] / max(1.0, sums[f"cond_acc_{k}_total"])
    return out


@torch.no_grad()
def evaluate_block(model, spec: dict, family: str) -> dict:
    """Held-out samples one at a time, served right (the block layers, the pre-norm last state), through the model's
    own forward in eval mode, a block anchored at every position its anchor sampler allows (a trained token, not
    in the last block of the sample: no block crosses a sample). The accepted length is speculators' own (`eal`):
    a block's leading run of tokens equal to the target's argmax plus the verifier's bonus token, vLLM's convention
    as the EAGLE-3 figure (over a draft vocabulary, the target's argmax within it); and its per-position
    accuracies."""
    block = BLOCK[family]["block_size"]
    model.eval()
    sums: dict[str, float] = {}
    for r, batch in held_out(spec, family, "block_layers", model.device):
        n = batch["input_ids"].shape[1]
        anchors = int(batch["loss_mask"][0, : max(0, n - block)].sum())  # select_anchors' candidates, every one
        if anchors == 0:
            continue
        torch.manual_seed(r)  # its anchors are drawn at random: the same ones at every run
        _, _, metrics = model(**batch, **(call_kwargs(family) | {"max_anchors": anchors}))
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    out = {"accepted_length": sums["eal_sum"] / sums["eal_total"], "blocks": int(sums["eal_total"])}
    out["full_acc"] = sums["full_acc_sum"] / sums["full_acc_total"]
    for k in sorted((k for k in sums if k.startswith("position_") and k.endswith("_acc_sum")), key=position):
        out[k.removesuffix("_sum")] = sums[k] / max(1.0, sums[k.replace("_sum", "_total")])
    return out


@torch.no_grad()
def evaluate_domino(model, spec: dict) -> dict:
    """Held-out samples one at a time, served right (the block layers), through SpecForge's own `OnlineDominoModel`
    forward in eval mode with no base-loss weight, a block anchored at every position its anchor rule allows (this
    token and the next trained) whose drafts lie in the sample, as the other block drafters are judged. A block
    drafts what SpecForge's own decoding loop drafts (`spec_generate`, `_sample_draft_tokens`): its block size less
    one tokens after the anchor, greedily, the GRU reading the anchor and then each earlier draft. Judged against
    the target's argmax over its whole vocabulary (its final norm and head over the pre-norm last state) as
    speculators' block drafters are, a block is accepted up to its first draft that differs from the target's
    choice, so up to there every earlier draft is the target's choice: the GRU is given those (`teacher`), and the
    leading run of matching drafts is the greedy sampler's. Counted by speculators' own rule
    (`compute_accepted_length_counts`: the leading run plus the verifier's bonus token); and the per-position
    accuracies."""
    from speculators.models.metrics import compute_accepted_length_counts

    drafts = DOMINO["block_size"] - 1
    model.eval()
    accepted = blocks = 0.0
    right, total = torch.zeros(drafts), torch.zeros(drafts)
    for _, batch in held_out(spec, "domino", "block_layers", spec.get("device", "cpu")):
        mask, ids = batch["loss_mask"][0].bool(), batch["input_ids"][0]
        anchors = torch.nonzero(mask[:-1] & mask[1:])[:, 0]
        anchors = anchors[anchors + drafts < len(ids)]
        if len(anchors) == 0:
            continue
        chose = target_argmax(spec, batch["verifier_last_hidden_states"][0])  # [t]: the target's token after t
        slot = anchors[:, None] + torch.arange(1, drafts + 1, device=ids.device)[None]  # the token each drafts
        finals = judge_domino(model, batch, anchors, teacher(model, ids, anchors, chose))
        correct = (finals[:, :drafts].argmax(-1) == chose[slot - 1]).cpu()
        valid = mask[slot].cpu()
        a, b = compute_accepted_length_counts(correct, valid)
        accepted, blocks = accepted + float(a), blocks + float(b)
        right += (correct & valid).sum(0)
        total += valid.sum(0)
    out = {"accepted_length": accepted / blocks, "blocks": int(blocks), "full_acc": float(right.sum() / total.sum())}
    for k in range(drafts):
        out[f"position_{k}_acc"] = float(right[k] / max(1.0, float(total[k])))
    return out


def teacher(model, ids, anchors, chose):
    """The tokens Domino's GRU reads in each block ([blocks, block size]): the anchor, then the target's choices
    after it (with its labels shifted, position j reads the token before the one it drafts)."""
    block = model.block_size
    offsets = torch.arange(block - 1, device=ids.device)[None]
    return torch.cat([ids[anchors][:, None], chose[(anchors[:, None] + offsets).clamp(max=len(chose) - 1)]], dim=1)


def judge_domino(model, batch: dict, anchors, prev_ids):
    """Domino's final logits ([blocks, block size, vocab]) through its own forward: the anchors given (its sampler
    replaced), the GRU reading `prev_ids`, the logits read as its head computes them (in chunks, in order)."""
    from unittest import mock

    if not model.shift_label:
        raise SystemExit("drafter_train: Domino is judged with its labels shifted (DOMINO['shift_label'])")
    finals: list = []
    head, inputs = model.draft_model.apply_logits_head, model._build_domino_head_inputs

    def record(*args, **kwargs):
        finals.append(head(*args, **kwargs))
        return finals[-1]

    def given(**kwargs):
        hidden, _ = inputs(**kwargs)
        return hidden, prev_ids[None]

    keep = torch.ones_like(anchors[None], dtype=torch.bool)
    with (
        mock.patch.object(model, "_sample_anchor_positions", lambda *_: (anchors[None], keep)),
        mock.patch.object(model, "_build_domino_head_inputs", given),
        mock.patch.object(model.draft_model, "apply_logits_head", record),
    ):
        model(batch["input_ids"], batch["hidden_states"], batch["loss_mask"], lambda_base=0.0)
    return torch.cat(finals, dim=1)[0]


def full_rollouts(seq_length: int, loss_mask, num_depths: int) -> tuple:
    """P-EAGLE's sample indices (`generate_cod_sample_indices`' (anchor_pos, depth)) with nothing dropped: every
    position at depth 0 (the context, as its sampler keeps it), then at each depth d every rollout anchored at a
    trained position (its sampler's seeds) whose slot a + d is in the sample. In training the COD sampler keeps a
    shrinking random share of each depth; served, every depth of a rollout is drafted."""
    anchors = torch.nonzero(loss_mask.squeeze(0) == 1).flatten()
    pos, depth = [torch.arange(seq_length)], [torch.zeros(seq_length, dtype=torch.long)]
    for d in range(1, num_depths):
        a = anchors[anchors + d < seq_length]
        pos.append(a)
        depth.append(torch.full_like(a, d))
    return torch.cat(pos).to(loss_mask.device), torch.cat(depth).to(loss_mask.device)


@torch.no_grad()
def evaluate_peagle(model, spec: dict) -> dict:
    """Held-out samples one at a time, served right (EAGLE-3's layers, the pre-norm last state), shifted as in
    training, through the model's own forward in eval mode over every rollout (`full_rollouts`): each trained
    position drafts its `num_depths` tokens in parallel (depth d: the token d after the first), as vLLM serves
    P-EAGLE. The accepted length is a rollout's leading run of drafts equal to the target's argmax over its whole
    vocabulary, plus the verifier's bonus token, by speculators' own count (`compute_accepted_length_counts`, as the
    EAGLE-3 and block drafters' figures); the per-depth accuracies are its own metrics' (peagle/metrics.py
    `compute_metrics`)."""
    model.eval()
    sums: dict[str, float] = {}
    accepted, blocks = 0.0, 0.0
    for _, batch in held_out(spec, "peagle", "eval_layers", model.device):
        metrics, a, b = judge_rollouts(model, spec, batch)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        accepted, blocks = accepted + a, blocks + b
    out = {"accepted_length": accepted / blocks, "blocks": int(blocks)}
    out["full_acc"] = sums["full_acc_sum"] / sums["full_acc_total"]
    for k in sorted((k for k in sums if k.startswith("position_") and k.endswith("_acc_sum")), key=position):
        out[k.removesuffix("_sum")] = sums[k] / max(1.0, sums[k.replace("_sum", "_total")])
    return out


def judge_rollouts(model, spec: dict, batch: dict) -> tuple[dict, float, float]:
    """One sample's every rollout through P-EAGLE's own forward (its sampler replaced by `full_rollouts`, its
    drafts read off its draft head): (its metrics, the accepted lengths' sum, the rollouts counted)."""
    from unittest import mock

    import speculators.models.peagle.core as peagle_core
    from speculators.models.metrics import compute_accepted_length_counts

    depths, mask = PEAGLE["num_depths"], batch["loss_mask"][0].bool()
    anchor, depth = full_rollouts(mask.shape[0], batch["loss_mask"], depths)
    logits: list = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out))
    try:
        with mock.patch.object(peagle_core, "generate_cod_sample_indices", lambda **_: (anchor, depth)):
            _, _, metrics = model(**batch, **call_kwargs("peagle"))
    finally:
        hook.remove()
    draft = to_target_ids(model, logits[-1][0].argmax(-1))
    # the verifier's token: its argmax over its whole vocabulary, as in evaluate_eagle3
    target = (model.verifier_norm(batch["verifier_last_hidden_states"]) @ full_head(spec).T).argmax(-1)[0]
    anchors = torch.nonzero(mask).flatten()
    rollout = torch.full_like(mask, -1, dtype=torch.long)
    rollout[anchors] = torch.arange(len(anchors), device=mask.device)
    keep = rollout[anchor] >= 0  # depth 0 holds every position: the anchored ones open a rollout
    row, col, slot = rollout[anchor[keep]], depth[keep], (anchor + depth)[keep]
    correct = torch.zeros(len(anchors), depths, dtype=torch.bool, device=mask.device)
    valid = torch.zeros_like(correct)
    correct[row, col] = draft[keep] == target[slot]
    valid[row, col] = mask[slot]
    a, b = compute_accepted_length_counts(correct, valid)
    return metrics, float(a), float(b)


def position(key: str) -> int:
    """`position_<k>_acc_sum` -> k."""
    return int(key.split("_")[1])


FULL_HEAD: dict = {}


def target_weights(spec: dict) -> dict:
    """The target's LM head over its whole vocabulary (`head`: [vocab, hidden], float32; its tied embedding where it
    has no head of its own) and its final norm's weight (`norm`), read from its safetensors once."""
    if not FULL_HEAD:
        from safetensors import safe_open

        found = {}
        for f in sorted(Path(spec["target"]).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for key in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
                    if key in st.keys():
                        found[key] = st.get_tensor(key).float().to(spec.get("device", "cpu"))
        w = found.get("lm_head.weight", found.get("model.embed_tokens.weight"))
        if w is None or "model.norm.weight" not in found:
            raise SystemExit(f"drafter_train: no LM head or final norm (model.norm.weight) in {spec['target']}")
        FULL_HEAD.update(head=w, norm=found["model.norm.weight"])
    return FULL_HEAD


def full_head(spec: dict):
    return target_weights(spec)["head"]


def target_argmax(spec: dict, last):
    """The target's token after each position ([t]) from its pre-norm last state ([t, hidden]): its final RMS norm
    (as transformers' Llama and Qwen norms compute it, in float32, with the epsilon of its config) and its head."""
    eps = json.loads((Path(spec["target"]) / "config.json").read_text()).get("rms_norm_eps", 1e-6)
    x = last.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return ((target_weights(spec)["norm"] * x) @ full_head(spec).T).argmax(-1)


def to_target_ids(model, draft):
    """Draft-vocabulary ids as the target's (EAGLE-3's d2t holds each draft token's offset); unchanged without one."""
    d2t = getattr(model, "d2t", None)
    return draft if d2t is None else draft + d2t[draft]


@torch.no_grad()
def target_shift(model, spec: dict, final: str) -> dict:
    """What an error in the final state does to the drafter's training targets, on the held-out samples' trained
    positions: the mean KL (nats) of the right distribution to the wrong one, and the share whose argmax token
    changes. Where the KL is near zero the drafter is fitted to the same targets, so the error cannot cost it
    anything measurable; a large KL (targets flattened or sharpened) can cost much even where the argmax rarely
    changes, as the KL loss fits whole distributions."""
    ds = EXPORTS[spec["eval"]["export"]]
    head, norm = model.verifier_lm_head, model.verifier_norm
    wrong = {"post": lambda x: head(norm(norm(x))), "pre_as_post": head}[final]
    flips = kl = n = 0.0
    for r in spec["eval"]["rows"]:
        item = ds[r]
        mask = item["loss_mask"][: spec["max_len"]].bool()
        x = item["verifier_last_hidden_states"][: spec["max_len"]][mask].float().to(model.device)
        right, bad = head(norm(x)).log_softmax(-1), wrong(x).log_softmax(-1)
        flips += (right.argmax(-1) != bad.argmax(-1)).sum().item()
        kl += (right.exp() * (right - bad)).sum().item()
        n += x.shape[0]
    return {"argmax_changed": flips / n, "kl_nats": kl / n, "positions": int(n)}


EXPORTS: dict = {}


def main(spec_path: str, runs_dir: str) -> None:
    """Train and judge each run the spec lists (`runs`: a variant, a seed, its steps and the key of everything its
    figures depend on) that no other process has claimed, each kept in `runs_dir` as it ends: `<key>.json` (its
    figures) and, for EAGLE-3, `<key>.pt` (its trained weights, which bench/drafter_verify.py speculates with). A run
    whose file is there is not trained again: a cut run goes on where it stopped."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    runs_dir = Path(runs_dir)
    todo = [r for r in spec["runs"] if not (runs_dir / f"{r['key']}.json").exists()]
    for name in {r["variant"]["export"] for r in todo} | ({spec["eval"]["export"]} if todo else set()):
        EXPORTS[name] = load_export(spec["exports"][name]["path"], spec["max_len"])
    for run in todo:
        if not claim(runs_dir / f"{run['key']}.claim"):  # another process has it
            continue
        variant, seed = run["variant"], run["seed"]
        model = build_drafter(spec, seed, variant)
        train_s = train(model, variant, dict(spec, steps=run["steps"]), seed)
        result = dict(evaluate(model, spec, variant), seed=seed, steps=run["steps"], train_s=round(train_s, 1))
        result |= built(variant, spec)
        if variant["family"] in SHIFTED:  # said in the results: those from before the shift were not
            result["samples"] = "shifted"
        if variant["final"] in ("post", "pre_as_post") and seed == min(spec["seeds"]):  # the target's, any seed
            result["target_shift"] = target_shift(model, spec, variant["final"])
        if variant["family"] == "eagle3":
            buf = io.BytesIO()
            torch.save(trained_weights(model), buf)
            save_atomic(runs_dir / f"{run['key']}.pt", buf.getvalue())
        save_atomic(runs_dir / f"{run['key']}.json", json.dumps(result, indent=1).encode())
        print(f"{variant['name']} seed {seed}: accepted length {result['accepted_length']:.4f}", flush=True)


def claim(path: Path) -> bool:
    """Whether this process is the first to take the run (bench.drafter clears the claims before it starts any)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def save_atomic(path: Path, data: bytes) -> None:
    """`data` to a temp file beside `path`, then renamed: a cut run leaves no half-written result."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def trained_weights(model) -> dict:
    """What training changed (the optimizer's parameters) and the draft vocabulary's maps: with the verifier's own
    weights, which `build_drafter` loads from the target, the whole drafter."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in names or k in ("t2d", "d2t")}


def built(variant: dict, spec: dict) -> dict:
    """A block or P-EAGLE drafter's recipe, for the report: the model and the settings it was trained with."""
    family = variant["family"]
    if family == "eagle3":
        return {}
    if family == "peagle":
        recipe = {"model": "PEagleDraftModel", "draft_layers": 1, **PEAGLE}
    elif family == "domino":
        recipe = {"model": "DominoDraftModel", "draft_layers": BLOCK_DRAFT_LAYERS, **DOMINO}
    else:
        recipe = {"model": block_class(family).__name__, "draft_layers": BLOCK_DRAFT_LAYERS, **BLOCK[family]}
    return {"drafter": recipe | {"max_anchors": spec["max_anchors"]}}


if __name__ == "__main__":
    main(*sys.argv[1:3])
