"""A trained EAGLE-3 drafter served by vLLM itself, so that its acceptance is vLLM's own figure, not an estimate or
bench/drafter_verify.py's re-implementation of the loop. Two modes, each run by the Python that has its library:

    <trainers python> -I bench/drafter_vllm.py export SPEC.json KEY RUNS_DIR CHECKPOINT_DIR
    <vllm python> -I bench/drafter_vllm.py [--max-tokens 64] [--draft-tokens 3] [--dtype float32]
        CHECKPOINT_DIR TARGET_DIR PROMPTS.json OUT.json

export: run KEY of SPEC.json (bench/drafter_train.py's spec and `<key>.pt` weights in RUNS_DIR) as a speculators
checkpoint: the drafter rebuilt as bench/drafter_train.py builds it (`build_drafter`: the target's embeddings and head
loaded into it), its trained weights loaded over it, then speculators' own `save_pretrained` (config.json with
`speculators_model_type: eagle3`, the layer ids in vLLM's numbering, the verifier's path; model.safetensors), the
format vLLM's speculators config reads (vllm/transformers_utils/configs/speculators).

serve: the target in vLLM offline with the checkpoint as its EAGLE-3 speculator, greedy, on PROMPTS.json (a JSON list
of token-id lists), each answer ended at the target's generation_config.json end ids (vLLM adds them to the stop ids
even without a tokenizer) or at --max-tokens. Writes OUT.json: vLLM's spec-decode counters (`LLM.get_metrics()`:
drafts, draft tokens, accepted tokens, accepted per position), the mean acceptance length by vLLM's convention
(1 + accepted / drafts: the accepted drafts plus the bonus token per verify step), the per-position acceptance rates
(accepted at position i / drafts), the generated ids and the wall time of the generation. Float32 by default, the
dtype the drafter trained and bench/drafter_verify.py judged it in; eager (no torch.compile: its start-up costs
minutes on a small CPU).
Set VLLM_CPU_KVCACHE_SPACE (GiB; 1 unless set) and OMP_NUM_THREADS as for any vLLM CPU run. Both modes run with -I:
this folder is not on sys.path then (bench/tokenize.py would hide the standard library's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


# export (the trainers' Python)


def _trainer():
    """bench/drafter_train.py, loaded by path (as bench/drafter_verify.py loads it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("drafter_train", Path(__file__).with_name("drafter_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def export(spec_path: str, key: str, runs_dir: str, out_dir: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    run = next((r for r in spec["runs"] if r["key"] == key), None)
    if run is None:
        raise SystemExit(f"drafter_vllm: no run {key} in {spec_path}")
    if run["variant"]["family"] != "eagle3":
        raise SystemExit(f"drafter_vllm: run {key} is a {run['variant']['family']} drafter; this serves EAGLE-3 only")
    if run["variant"]["final"] == "no_states":  # vLLM would feed it the target's states, never the zeros it knew
        raise SystemExit(f"drafter_vllm: run {key} trained on no states; vLLM cannot serve it as it was judged")
    model = _trainer().build_drafter(spec, run["seed"], run["variant"])
    missing, _ = model.load_state_dict(torch.load(Path(runs_dir) / f"{key}.pt"), strict=False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if set(missing) - frozen:  # only the verifier's own weights come from the target
        raise SystemExit(f"drafter_vllm: {key}.pt lacks {sorted(set(missing) - frozen)[:3]}")
    model.save_pretrained(out_dir)
    print(f"drafter_vllm: {key} -> {out_dir}")


# serve (vLLM's Python)


def spec_counts(metrics) -> dict:
    """vLLM's spec-decode counters from `LLM.get_metrics()`, summed over engines."""
    counts = {name: 0 for name in SPEC_METRICS.values()}
    per_pos: list[int] = []
    for m in metrics:
        if m.name in SPEC_METRICS:
            counts[SPEC_METRICS[m.name]] += m.value
        elif m.name == PER_POS:
            per_pos = [a + b for a, b in zip(per_pos, m.values)] if per_pos else list(m.values)
    return dict(counts, accepted_per_position=per_pos)


def acceptance(counts: dict) -> dict:
    """vLLM's own summary (as its spec-decode logger prints it): mean acceptance length 1 + accepted / drafts, and per
    position the share of drafts whose token there was accepted."""
    drafts = counts["drafts"]
    if not drafts:
        raise SystemExit("drafter_vllm: vLLM made no drafts (every answer ended at its first token?)")
    return {
        "mean_acceptance_length": 1 + counts["accepted_tokens"] / drafts,
        "acceptance_rate": counts["accepted_tokens"] / counts["draft_tokens"],
        "per_position_acceptance": [n / drafts for n in counts["accepted_per_position"]],
    }


def serve(checkpoint: str, target: str, prompts: list[list[int]], args) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=target,
        skip_tokenizer_init=True,  # ids in, ids out
        speculative_config={"method": "eagle3", "model": checkpoint, "num_speculative_tokens": args.draft_tokens},
        dtype=args.dtype,
        max_model_len=max(map(len, prompts)) + args.max_tokens + args.draft_tokens + 1,
        enforce_eager=True,
        disable_log_stats=False,  # LLM turns stats off by default; the spec-decode counters need them
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    counts = spec_counts(llm.get_metrics())
    generated = [list(o.outputs[0].token_ids) for o in outs]
    return {
        "checkpoint": checkpoint,
        "target": target,
        "draft_tokens": args.draft_tokens,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        **acceptance(counts),
        "counts": counts,
        "generate_wall_s": wall,
        "generated_tokens": sum(map(len, generated)),
        "generated": generated,
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["export"]:
        if len(argv) != 5:
            raise SystemExit(__doc__)
        export(*argv[1:])
        return 0
    p = argparse.ArgumentParser(description="An EAGLE-3 speculators checkpoint served by vLLM: its acceptance.")
    p.add_argument("checkpoint")
    p.add_argument("target")
    p.add_argument("prompts", help="JSON list of token-id lists")
    p.add_argument("out")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    prompts = json.loads(Path(args.prompts).read_text())
    result = serve(args.checkpoint, args.target, prompts, args)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    keys = ("mean_acceptance_length", "per_position_acceptance", "counts", "generate_wall_s", "generated_tokens")
    print(json.dumps({k: result[k] for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
