"""NVIDIA Model-Optimizer's offline layouts: `export.format=modelopt` (the states, for its EAGLE-3, DFlash, DSpark and
Domino) and `export.format=modelopt_policy` (the target's top-k policy, for its external draft).

modelopt (`<dir>/rows_<g>-<g+2000>/sample_<i>.pt`, sample i of the dataset; its trainer takes every `*.pt` under
`data.offline_data_path`, folders included):
  one `torch.save` dict per sample: `input_ids` int64 [T], `hidden_states` bf16 [T, H] AFTER the target's final norm
  (computed exactly from the stored pre-norm state), `hidden_states_prenorm` False (the key that says so),
  `aux_hidden_states` bf16 [T, k*H] (the family's layers concatenated, ascending), `loss_mask` int64 [T] (the trained
  tokens, read under `training.answer_only_loss=true`), `conversation_id` (the sample's id).

modelopt_policy (`<dir>/policy-000-<s>.jsonl.gz`, 2,000 records a shard): one JSON line per contiguous run of
trained tokens of a sample: `id`, `prompt_ids` (everything before the run), `gen_ids` (the run), and per gen token j
`topk_tok[j]`, `topk_lp[j]`: the policy gen_ids[j] is drawn from, i.e. the target's logits at position
len(prompt_ids) + j - 1. The stored policy's row t predicts token t + 1 (draftdata/hidden/policy.py), so record row j
is stored row first + j - 1: without that shift a draft still trains, against the wrong target. Log-probabilities are
renormalised over the kept slots (each row sums to 1); cut slots keep their place with -inf (JSON `-Infinity`).

facts checked in nvidia-modelopt 0.47.0 (the wheel) and its repository's examples:
- modelopt/torch/speculative/eagle/utils.py `OfflineSupervisedDataset`: `torch.load(weights_only=True)`, keys
  input_ids, hidden_states, aux_hidden_states, optional loss_mask (used only with answer_only_loss; else all ones)
  and hidden_states_prenorm (default False: post-norm; True makes the trainer apply the base's final norm);
  `EagleOfflineDataCollator` pads to `training.training_seq_len`. DFlash, DSpark and Domino read the same files.
- plugins/hf_eagle.py `default_eagle_aux_layer_ids(n)` = sorted({1, n//2 - 1, n - 4}); ids are 0-based decoder
  layers (id L = HF hidden_states[L + 1]), the capture's physical ids. plugins/hf_dflash.py: explicit
  `dflash_architecture_config.target_layer_ids` win, one per draft layer (`num_hidden_layers` must equal their count).
- modelopt_recipes/general/speculative_decoding/eagle3.yaml sets `training.answer_only_loss: false` (every token
  trained, the prompts' included); dflash/dspark/domino.yaml set it true.
- the external draft's sparse-policy reader and producer are not in the 0.47.0 wheel: their layout is that of the
  repository's `modelopt/torch/speculative/external/sparse_data.py` (`SparsePolicyDataset`) and
  `examples/speculative_decoding/collect_hidden_states/compute_sparse_policy_hf.py` (`deployment_policy`,
  `policy_record`, `scored_spans`), where row j is the policy gen_ids[j] was drawn from.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from draftdata.errors import ConfigError
from draftdata.hidden.reader import HiddenStates, Sample
from draftdata.hidden.tally import count
from draftdata.util.files import staged_path

GROUP = 2000  # samples per folder, records per policy shard
POLICY_FORMAT = "modelopt_policy"
# per family, ModelOpt's recipe and the run-config key its layer ids go under
RECIPES = {
    "eagle3": ("eagle3", "eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids"),
    "dflash": ("dflash", "dflash.dflash_architecture_config.target_layer_ids"),
    "dspark": ("dspark", "dflash.dflash_architecture_config.target_layer_ids"),
    "domino": ("domino", "dflash.dflash_architecture_config.target_layer_ids"),
}


def modelopt_path(i: int) -> str:
    g = i // GROUP * GROUP
    return f"rows_{g}-{g + GROUP}/sample_{i}.pt"


def modelopt_record(s: Sample, picked) -> dict:
    """Keys, dtypes and shapes as ModelOpt's own dump writes them, with the last state post-norm and said to be."""
    import torch

    n = s.input_ids.shape[0]
    return {
        "input_ids": s.input_ids.to(torch.int64),
        "hidden_states": s.final_post_norm.to(torch.bfloat16),
        "hidden_states_prenorm": False,
        "aux_hidden_states": picked.aux(s).reshape(n, -1).to(torch.bfloat16),
        "loss_mask": s.loss_mask.to(torch.int64),
        "conversation_id": s.id,
    }


def save_records(hs: HiddenStates, staging: Path, tally, picked, path_of, record_of) -> None:
    """One `torch.save` dict per sample the family can train on, at `path_of(i)` (SpecForge's layout and ModelOpt's
    alike); counted in path order, the order SpecForge's own count meets the files in."""
    import torch

    i = 0
    for s in hs:
        if not picked.trainable(s, tally):
            continue
        with staged_path(staging / path_of(i)) as path:
            torch.save(record_of(s, picked), path)
        count(s.input_ids, s.loss_mask, tally, path_of(i))
        i += 1


def write_modelopt(hs: HiddenStates, staging: Path, tally, picked) -> None:
    save_records(hs, staging, tally, picked, modelopt_path, modelopt_record)


# ---- the policy ------------------------------------------------------------------------------------------------ #


def check_policy(hs: HiddenStates) -> dict:
    """The capture's policy settings, refused in one line where it kept none."""
    policy = hs.index.get("policy")
    if not policy:
        raise ConfigError(
            "hidden_states.policy_top_k",
            f"is 0 for the states at {hs.path}: no policy was kept; set it (ModelOpt's external draft: 20) and "
            "dvc repro (with drafters: [] the policy alone is stored, no states)",
        )
    return policy


def spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """The contiguous runs of trained tokens, half-open; one record each (a conversation's turns are apart)."""
    out, start = [], None
    for t, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            out.append((start, t))
            start = None
    return out


def policy_records(s: Sample) -> list[dict]:
    """A sample's records: per trained run [first, end), gen token j's policy is stored row first + j - 1 (the logits
    before it), renormalised over its kept slots. A run at token 0 has no context to draw it from: it starts at 1."""
    import torch

    tokens, lps = s.policy
    ids = s.input_ids.tolist()
    out = []
    for k, (first, end) in enumerate(spans(s.loss_mask.tolist())):
        first = max(first, 1)
        if first >= end:
            continue
        rows = slice(first - 1, end - 1)
        lp = lps[rows].float()
        lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)  # over the kept slots: each row sums to 1
        out.append(
            {
                "id": s.id if k == 0 else f"{s.id}-{k}",
                "prompt_ids": ids[:first],
                "gen_ids": ids[first:end],
                "topk_tok": tokens[rows].tolist(),
                "topk_lp": lp.tolist(),  # -inf where cut: JSON's -Infinity, which ModelOpt's reader takes as 0
            }
        )
    return out


def write_policy(hs: HiddenStates, staging: Path, tally) -> int:
    """The records, GROUP to a gzipped shard; returns how many."""
    n, shard, out = 0, 0, None
    try:
        for s in hs:
            for record in policy_records(s):
                if n % GROUP == 0:
                    if out is not None:
                        out.close()
                    out = gzip.open(staging / f"policy-000-{shard:05d}.jsonl.gz", "wt")
                    shard += 1
                out.write(json.dumps(record) + "\n")
                n += 1
            count(s.input_ids, s.loss_mask, tally, n)
    finally:
        if out is not None:
            out.close()
    return n


def modelopt_argv(family: str, model: str, out: Path, ids: list[int], dataset: str) -> list[str]:
    """ModelOpt's training launch (run from its examples/speculative_decoding, so every path is absolute) on an
    export: the family's recipe, the export's layers, and answer_only_loss on (EAGLE-3's recipe has it off: every
    token, the prompts' too)."""
    recipe, key = RECIPES[family]
    argv = [
        "./launch_train.sh",
        "--config",
        f"../../modelopt_recipes/general/speculative_decoding/{recipe}.yaml",
        f"model.model_name_or_path={absolute(model)}",
        f"data.offline_data_path={out.resolve()}",
        f"training.output_dir={Path('checkpoints', f'{dataset}-modelopt-{family}').resolve()}",
        "training.answer_only_loss=true",
        f"{key}=[{','.join(map(str, ids))}]",
    ]
    if family != "eagle3":  # one target layer per draft layer, or ModelOpt refuses the ids
        argv.append(f"dflash.dflash_architecture_config.num_hidden_layers={len(ids)}")
    return argv


def policy_argv(model: str, out: Path, policy: dict) -> list[str]:
    """ModelOpt's external-draft training on the policy (its examples' main.py; DRAFT: the user's own small model)."""
    return [
        "python",
        "main.py",
        "--config",
        "../../modelopt_recipes/general/speculative_decoding/external_draft.yaml",
        f"model.model_name_or_path={absolute(model)}",
        "draft_model_name_or_path=DRAFT",
        f"data.sparse_data_path={out.resolve()}",
        "external.external_loss=tvd",
        f"external.external_top_k={policy['top_k']}",
        f"external.external_top_p={policy['top_p']}",
    ]


def absolute(model: str) -> str:
    """A local model folder as an absolute path (the command runs elsewhere); a hub id as it is."""
    return str(Path(model).resolve()) if Path(model).exists() else model
