"""Speculative decoding itself, the half of `python -m bench.drafter`'s proof that estimates cannot give: each trained
EAGLE-3 drafter drafts for the real target in a greedy draft-and-verify loop on held-out prompts, and the target's
own output is checked token for token. Run by the trainers' Python (DRAFTDATA_TRAINERS_PYTHON), as
bench/drafter_train.py is; imports speculators, transformers and torch only, never the project.

    <trainers python> -I bench/drafter_verify.py SPEC.json RUNS_DIR

SPEC.json is the training spec (its target, layers, exports and draft vocabularies) with the runs to speculate with
(`runs`: key, variant, seed; their weights are `<key>.pt` in RUNS_DIR) and the loop's settings (`verify`: `prompts`,
token ids, each a held-out conversation's first turn as the template renders it; `draft_tokens`, `max_new_tokens`,
and `suffix`, the hash of those and this file). Keeps `<key>.verify-<suffix>.json` per run beside its weights, and
`greedy-<suffix>.json` once: the target's own greedy output per prompt (transformers' `generate`, do_sample=False); a
cut run goes on where it stopped; several processes share the runs, as bench/drafter_train.py's do.

The loop, as vLLM serves an EAGLE-3 drafter (greedy, one sequence):
- the target runs over the prompt (a KV cache kept), gives the next token and the states at the drafter's layers;
- the drafter drafts `draft_tokens` tokens: its own forward (`Eagle3DraftModel.forward`, the code it trained with)
  over the sequence so far, position t's states beside token t + 1 (`shift_batch`'s pairing), then one more of its
  test-time steps per draft, each fed the draft before it;
- the target verifies them in one forward of the last token and the drafts over its cache: the drafts it would
  have chosen itself are kept up to the first it would not, then its own token (the bonus); the cache is cut back to
  the tokens kept, and their states join the drafter's.
Accepted tokens per verify step (the drafts kept plus the bonus) is the figure vLLM reports as its mean acceptance
length. The output must equal the target's greedy output: where it does not, the first differing position and the
target's margin there (its top-two logit gap, float32) are kept, so a near tie between two batched computations is
told from a bug.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def _trainer():
    """bench/drafter_train.py, the drafters' own builder, loaded by path: run with -I, this folder is not on sys.path
    (where bench/tokenize.py would hide the standard library's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("drafter_train", Path(__file__).with_name("drafter_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dt = _trainer()


def load_target(spec: dict):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec["target"], dtype=torch.float32).eval()


def stop_ids(target) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


@torch.no_grad()
def greedy(target, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """The target's own greedy output per prompt: transformers' `generate`, do_sample=False, its end of turn kept."""
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new)
        out.append(y[0, len(ids) :].tolist())
    return out


def states_at(out, layers: list[int]) -> torch.Tensor:
    """The drafter's input states ([positions, n_aux * hidden]): physical layer i's output is transformers'
    hidden_states[i + 1] (index 0 is the embeddings), but for the last layer, whose entry there is after the final
    norm (the capture keeps it before)."""
    if max(layers) >= len(out.hidden_states) - 2:
        raise SystemExit(f"drafter_verify: layer {max(layers)} is the target's last; its state is not served here")
    return torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)


@torch.no_grad()
def draft(model, states: torch.Tensor, ids: list[int], k: int, zero: bool) -> list[int]:
    """k drafts after `ids` (x_0..x_n; `states` holds x_0..x_{n-1}'s): test-time step s at position n - 1 reads
    step s - 1's draft, which the forward feeds it as its teacher-forced token (the sequence's next id), so each call
    appends the drafts so far and runs one step more. Positions past n - 1 are padding no earlier position attends
    to."""
    n = states.shape[0]
    states = torch.zeros_like(states) if zero else states
    drafts: list[int] = []
    head = model.lm_head
    model.lm_head = At(head, n - 1)  # the draft head at the one position read: the rest is never looked at
    try:
        for step in range(1, k + 1):
            seq = torch.tensor([ids[1 : n + 1] + drafts])
            hs = torch.cat([states, states.new_zeros(step - 1, states.shape[1])])[None]
            tokens = model(hidden_states=hs, input_ids=seq, document_ids=torch.zeros_like(seq), ttt_steps=step)
            drafts.append(int(dt.to_target_ids(model, tokens[step - 1][0, 0])))
    finally:
        model.lm_head = head
    return drafts


class At(torch.nn.Module):
    """A head applied at one position only ([1, 1, vocab]): the forward's logits at every other position cost a
    draft head's matmul each and are never read."""

    def __init__(self, head, position: int):
        super().__init__()
        self.head, self.position = head, position

    def forward(self, x):
        return self.head(x[:, self.position : self.position + 1])


@torch.no_grad()
def speculate(model, target, prompt: list[int], layers: list[int], k: int, max_new: int, zero: bool) -> tuple:
    """(the output, accepted tokens per verify step): the draft-and-verify loop over one prompt."""
    from transformers import DynamicCache

    stops = stop_ids(target)
    cache = DynamicCache()
    out = target(torch.tensor([prompt]), past_key_values=cache, use_cache=True, output_hidden_states=True)
    states = states_at(out, layers)
    ids = prompt + [int(out.logits[0, -1].argmax())]
    per_step: list[int] = []
    while len(ids) - len(prompt) < max_new and ids[-1] not in stops:
        drafts = draft(model, states, ids, k, zero)
        out = target(
            torch.tensor([ids[-1:] + drafts]), past_key_values=cache, use_cache=True, output_hidden_states=True
        )
        chose = out.logits[0].argmax(-1).tolist()  # [j]: the target's token after the last one and j drafts
        a = 0
        while a < k and drafts[a] == chose[a] and drafts[a] not in stops:
            a += 1
        if a < k:  # the cache keeps the last token and the drafts kept; the bonus goes in with the next drafts
            cache.crop(a - k)
        states = torch.cat([states, states_at(out, layers)[: a + 1]])
        ids += drafts[:a] + [chose[a]]
        per_step.append(a + 1)
    new = ids[len(prompt) :]
    cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))  # as generate stops: its end of turn kept
    return new[: min(cut, max_new)], per_step


@torch.no_grad()
def margin_at(target, prompt: list[int], output: list[int], pos: int) -> float:
    """The target's top-two logit gap where the speculated output first differs from its greedy one."""
    logits = target(torch.tensor([prompt + output[:pos]])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def verify_run(spec: dict, vspec: dict, run: dict, runs_dir: Path, target, reference: list[list[int]]) -> dict:
    variant = run["variant"]
    model = dt.build_drafter(spec, run["seed"], variant)
    missing, _ = model.load_state_dict(torch.load(runs_dir / f"{run['key']}.pt"), strict=False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if set(missing) - frozen:  # only the verifier's own weights come from the target
        raise SystemExit(f"drafter_verify: {run['key']}.pt lacks {sorted(set(missing) - frozen)[:3]}")
    model.eval()
    zero = variant["final"] == "no_states"
    per_step, mismatches, t0 = [], [], time.perf_counter()
    k, max_new = vspec["draft_tokens"], vspec["max_new_tokens"]
    for i, (prompt, want) in enumerate(zip(vspec["prompts"], reference)):
        got, steps = speculate(model, target, prompt, spec["eval_layers"], k, max_new, zero)
        per_step += steps
        if got != want:
            pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            mismatches.append({"prompt": i, "position": pos, "margin": margin_at(target, prompt, want, pos)})
    if not per_step:  # every prompt's greedy answer ended at its first token: nothing was drafted
        raise SystemExit(f"drafter_verify: no verify step on {len(vspec['prompts'])} prompts; give other prompts")
    return {
        "seed": run["seed"],
        "accepted_per_step": sum(per_step) / len(per_step),
        "verify_steps": len(per_step),
        "tokens": sum(per_step),
        "prompts": len(vspec["prompts"]),
        "equals_greedy": not mismatches,
        "mismatches": mismatches,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main(spec_path: str, runs_dir: str) -> None:
    """Each run of the spec's `runs` (at `verify`'s settings, whose `suffix` names their results) that no other
    process has claimed: the target's greedy output first (one process makes it, the others wait for it)."""
    spec = json.loads(Path(spec_path).read_text())
    vspec, runs_dir = spec["verify"], Path(runs_dir)
    torch.set_num_threads(spec["threads"])
    done = {r["key"]: runs_dir / f"{r['key']}.verify-{vspec['suffix']}.json" for r in spec["runs"]}
    todo = [r for r in spec["runs"] if not done[r["key"]].exists()]
    if not todo:
        return
    target = load_target(spec)
    ref_path = runs_dir / f"greedy-{vspec['suffix']}.json"
    if dt.claim(runs_dir / f"greedy-{vspec['suffix']}.claim"):
        reference = greedy(target, vspec["prompts"], vspec["max_new_tokens"])
        dt.save_atomic(ref_path, json.dumps(reference).encode())
    while not ref_path.exists():
        time.sleep(5)
    reference = json.loads(ref_path.read_text())
    for run in todo:
        if not dt.claim(runs_dir / f"{run['key']}.verify.claim"):
            continue
        result = verify_run(spec, vspec, run, runs_dir, target, reference)
        dt.save_atomic(done[run["key"]], json.dumps(result, indent=1).encode())
        print(
            f"{run['variant']['name']} seed {run['seed']}: {result['accepted_per_step']:.3f} tokens a verify step, "
            f"equals greedy: {result['equals_greedy']}",
            flush=True,
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
