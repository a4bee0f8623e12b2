"""The drafter families one capture serves: which target layers each reads, what each trainer's offline data path
reads for it, and the rows it cannot train on.

One capture holds the union of the layers every family named in `hidden_states.drafters` reads, plus the last
decoder layer's output before the final norm (every capture keeps it, with the norm's parameters: the post-norm
state is made from it exactly). An export picks one family's layers out of it (`draftdata export export.family=F`).

What each family reads, as the trainers' own code has it (speculators 0.9.0, SpecForge 0.2.0):

- eagle3, peagle: k aux layers (EAGLE-3's default: outputs of layers 1, N//2 - 1, N - 4) and the last state, the
  target's logits over a draft vocabulary (d2t/t2d). speculators: `hs_<i>` files, aux then the PRE-norm last state
  (its `verifier_norm` applies the norm), config key `eagle_aux_hidden_state_layer_ids` in vLLM's numbering.
  SpecForge (eagle3 only; its peagle has no offline path): `aux_hidden_state` and the POST-norm `hidden_state`.
- dflash, dflash2, dspark, domino (block drafters): n target layers concatenated to [T, n·H], by default z-lab's
  `build_target_layer_ids(N, n)`: round(1 + i·(N - 4)/(n - 1)) for i < n, or [N // 2] when n = 1 (n: the draft's
  number of layers). They train on the token ids in blocks after sampled anchors: a row needs two adjacent
  supervised tokens (SpecForge's `has_consecutive_supervised_tokens` filters them; DFlash's anchor sampler fails
  without them). speculators (dflash, dflash2, dspark): the same `hs_<i>` files, config key
  `aux_hidden_state_layer_ids` in vLLM's numbering; dflash2's KL loss and dspark's distribution read the PRE-norm
  last state there. SpecForge (dflash, domino, dspark): `hidden_states` [1, T, n·H] and, for dspark,
  `target_last_hidden_states` [1, T, H] POST-norm; its `dflash_config.target_layer_ids` are physical ids.
- the draft vocabulary: speculators takes a mapping for every family (optional; its trainer builds one from
  `token_freq.pt` for `--draft-vocab-size`); SpecForge's eagle3 alone reads one (its block drafters take none).
- modelopt (nvidia-modelopt 0.47.0: eagle3, dflash, dspark, domino): one `.pt` per sample, `aux_hidden_states`
  [T, k·H] and the post-norm last state `hidden_states` [T, H] whatever the family (draftdata/hidden/modelopt.py);
  its layer ids are physical.
- mtp: the last state alone (speculators: `verifier_last_hidden_states`); the target must carry its own MTP weights
  (`mtp.*`), which speculators loads; SpecForge 0.2.0 has no MTP algorithm.
- online (the trainer computes the states as it trains, from the exported samples): speculators for each family its
  offline path serves (vLLM's extraction, `--target-layer-ids`); SpecForge for eagle3, peagle, dflash, dspark and
  domino (its server-streaming providers over SGLang's capture; none for dflash2 or mtp). A block drafter's rule on
  rows holds there too.

Numberings: physical id L (the output of decoder layer L, 0-based) is HF's hidden_states[L + 1], SGLang's, SpecForge's
and z-lab's id L, and vLLM's and speculators' id L + 1 (layers.py `layer_numberings`).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftdata.config.schema import DRAFTER_FAMILIES


@dataclass(frozen=True)
class Family:
    name: str
    layers: str  # "eagle": EAGLE-3's aux layers | "block": a block drafter's | "none": the last state alone
    # per trainer, what its offline files hold for this family; None: the trainer has no offline path for it
    specforge: str | None  # "eagle3" (aux + post-norm hidden_state) | "block" | "block_last" (+ post-norm last)
    speculators: str | None  # its config's key for the aux layer ids (vLLM numbering); "" for mtp (none)
    needs_adjacent: bool = False  # a row needs two adjacent supervised tokens (block drafters' anchors)
    specforge_online: bool = True  # SpecForge trains it online (its server-streaming provider over SGLang's capture)
    modelopt: str | None = None  # ModelOpt's recipe for it (its offline `.pt` files: aux + post-norm last state)


EAGLE_KEY, BLOCK_KEY = "eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids"
FAMILIES = {
    f.name: f
    for f in (
        Family("eagle3", "eagle", "eagle3", EAGLE_KEY, modelopt="eagle3"),
        Family("peagle", "eagle", None, EAGLE_KEY),
        Family("dflash", "block", "block", BLOCK_KEY, needs_adjacent=True, modelopt="dflash"),
        Family("dflash2", "block", None, BLOCK_KEY, needs_adjacent=True, specforge_online=False),
        Family("dspark", "block", "block_last", BLOCK_KEY, needs_adjacent=True, modelopt="dspark"),
        Family("domino", "block", "block", None, needs_adjacent=True, modelopt="domino"),
        Family("mtp", "none", None, "", specforge_online=False),
    )
}
assert tuple(FAMILIES) == DRAFTER_FAMILIES  # the config's names are these
TRAINERS = ("specforge", "speculators", "modelopt")


def block_default_layers(n_layers: int, n: int) -> list[int]:
    """z-lab's `build_target_layer_ids(num_target_layers, num_draft_layers)`, as SpecForge, speculators and SGLang
    copy it: n layers evenly spaced from 1 to N - 3, or the middle one for a one-layer draft."""
    if n == 1:
        return [n_layers // 2]
    start, end = 1, n_layers - 3
    return [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]


def trainers_of(f: Family) -> list[str]:
    """The trainers whose offline data path reads this family."""
    return [t for t in TRAINERS if getattr(f, t) is not None]


def online_trainers(f: Family) -> list[str]:
    """The trainers whose online mode trains this family: speculators' where its models have it (vLLM computes the
    states as it trains, `--on-missing generate`), SpecForge's where it has a server-streaming provider."""
    return [t for t, ok in (("specforge", f.specforge_online), ("speculators", f.speculators is not None)) if ok]


def unusable(f: Family, loss_mask: list[int]) -> str | None:
    """Why a row is one this family cannot train on (counted under that reason, never written), or None."""
    if f.needs_adjacent and not adjacent_supervised(loss_mask):
        return "no_adjacent_supervised"  # a block drafter's anchor needs the token after it
    return None


def last_state(f: Family, trainer: str) -> str | None:
    """The last state a trainer's files hold for this family: speculators' always carry the pre-norm one (its
    `verifier_last_hidden_states`); SpecForge's the post-norm one where its layout has one (eagle3's
    `hidden_state`, dspark's `target_last_hidden_states`), none for its dflash and domino; ModelOpt's the post-norm
    one for every family (`hidden_states`, with `hidden_states_prenorm` False)."""
    if trainer == "speculators":
        return "pre_norm"
    if trainer == "modelopt":  # its files always hold the last state; post-norm, as its own dump writes it
        return "post_norm"
    return None if f.specforge == "block" else "post_norm"


def adjacent_supervised(loss_mask: list[int]) -> bool:
    """Two adjacent supervised tokens (SpecForge's `has_consecutive_supervised_tokens`): what a block drafter's
    anchor sampler needs of a row."""
    return any(a and b for a, b in zip(loss_mask, loss_mask[1:]))
