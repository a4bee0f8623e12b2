"""Throughput of the tokenize stage on its slow path (text only) against the raw `tokenizers` batch encode.

    python -m bench.tokenize [--samples 5000]

Synthetic multi-turn conversations with lengths like the real data: prompts of 50-2,000 tokens (system, user,
an earlier assistant turn, user), completions lognormal with mean ≈ 3.5k tokens capped at 10k. The demo
tokenizer and ChatML template (draftdata/target/tiny.py) render them. Side by side, in one run:

- stage, text path: `draftdata.tokenize.samples.build_samples` on responses that carry text only (render prompt and
  conversation, encode, find the boundary, build the mask, count drift);
- raw: `tokenizers`' batch encode of the same full conversation texts (what any pipeline must at least pay);
- stage, id path: the same responses with server token ids (no re-encoding at all).

Writes bench/results/tokenize.json: stage_tok_s, raw_tok_s, ratio (stage/raw), id_path_tok_s, samples/s.
Goal: ratio >= 0.7.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DEMO = Path(__file__).resolve().parents[1] / "sources" / "demo"


def build_tokenizer_dir(out: Path):
    from draftdata.target.tiny import build_tokenizer, iter_demo_texts

    tok = build_tokenizer(iter_demo_texts(DEMO), 2048)
    tok.save_pretrained(out)
    return tok


def word_pool(tok) -> tuple[list[str], float]:
    """Words from the demo texts and the tokens one word costs on average."""
    from draftdata.target.tiny import iter_demo_texts

    words = [w for text in iter_demo_texts(DEMO) for w in text.split()][:200_000]
    sample = " ".join(words[:20_000])
    return words, len(tok.encode(sample, add_special_tokens=False)) / 20_000


def text_of(rng: random.Random, words: list[str], tokens: int, per_word: float) -> str:
    start = rng.randrange(len(words) - 1)
    n = max(1, round(tokens / per_word))
    out = []
    while len(out) < n:
        chunk = words[start : start + n - len(out)]
        out += chunk
        start = 0
    return " ".join(out)


def make_records(tok, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words, per_word = word_pool(tok)
    mu = math.log(3500) - 0.8**2 / 2
    recs = []
    for i in range(n):
        prompt_tokens = rng.randint(50, 2000)
        parts = [max(5, int(prompt_tokens * f)) for f in (0.1, 0.4, 0.2, 0.3)]
        messages = [
            {"role": "system", "content": text_of(rng, words, parts[0], per_word)},
            {"role": "user", "content": text_of(rng, words, parts[1], per_word)},
            {"role": "assistant", "content": text_of(rng, words, parts[2], per_word)},
            {"role": "user", "content": text_of(rng, words, parts[3], per_word)},
        ]
        text = text_of(rng, words, min(10_000, max(1, round(rng.lognormvariate(mu, 0.8)))), per_word)
        served = len(tok.backend_tokenizer.encode(text, add_special_tokens=False).ids) + 1  # + end of turn
        recs.append(
            {
                "id": f"s{i}",
                "messages": messages,
                "text": text,
                "completion_tokens": served,
                "finish_reason": "stop",
                "prompt_ids": None,
                "output_ids": None,
            }
        )
    return recs


def main() -> None:
    from draftdata.config.schema import Config, ModelConfig, TokenizeConfig
    from draftdata.target.tokenizer import render_prompt_ids
    from draftdata.tokenize.samples import build_samples, render_texts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=5000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer_dir(Path(tmp))
        cfg = Config(model=ModelConfig(path=tmp), tokenize=TokenizeConfig(max_seq_len=1 << 20))
        recs = make_records(tok, args.samples, seed=0)
        fulls = [render_texts(tok, r, {})[1] for r in recs]

        t0 = time.perf_counter()
        raw = tok.backend_tokenizer.encode_batch(fulls, add_special_tokens=False)  # the Rust tokenizer, all cores
        raw_s = time.perf_counter() - t0
        raw_tokens = sum(len(e.ids) for e in raw)
        del raw  # 5k Encodings held alive would tax the stage's allocations below

        t0 = time.perf_counter()
        samples, tally = build_samples(recs, tok, cfg)
        stage_s = time.perf_counter() - t0
        stage_tokens = sum(len(s.input_ids) for s in samples)
        assert len(samples) == len(recs), dict(tally.skipped)

        # The id path: the same samples as the server would have returned them.
        for rec, s in zip(recs, samples):
            rec["prompt_ids"] = render_prompt_ids(tok, rec["messages"], None, {})
            rec["output_ids"] = s.input_ids[len(rec["prompt_ids"]) :]
        t0 = time.perf_counter()
        id_samples, _ = build_samples(recs, tok, cfg)
        id_s = time.perf_counter() - t0
        assert [s.input_ids for s in id_samples] == [s.input_ids for s in samples]  # both paths agree

    result = {
        "samples": len(samples),
        "stage_tok_s": round(stage_tokens / stage_s),
        "stage_samples_s": round(len(samples) / stage_s, 1),
        "raw_tok_s": round(raw_tokens / raw_s),
        "ratio": round((stage_tokens / stage_s) / (raw_tokens / raw_s), 3),
        "id_path_tok_s": round(stage_tokens / id_s),
        "drift_pct": round(100.0 * tally.drift / tally.text_path, 3),
        "mean_tokens_per_sample": round(stage_tokens / len(samples)),
        "wall_s": {"stage": round(stage_s, 2), "raw": round(raw_s, 2), "id_path": round(id_s, 2)},
    }
    result["goals"] = {"ratio_ge_0.7": result["ratio"] >= 0.7}
    print(f"{'path':<14} {'tokens/s':>12} {'wall s':>8}")
    print(f"{'stage (text)':<14} {result['stage_tok_s']:>12,} {stage_s:>8.2f}")
    print(f"{'raw encode':<14} {result['raw_tok_s']:>12,} {raw_s:>8.2f}")
    print(f"{'stage (ids)':<14} {result['id_path_tok_s']:>12,} {id_s:>8.2f}")
    print(
        f"ratio (stage/raw) = {result['ratio']}  drift_pct = {result['drift_pct']}  "
        f"samples = {len(samples)}, {result['mean_tokens_per_sample']} tokens each"
    )
    print("goals: " + ", ".join(f"{k}={'ok' if v else 'MISSED'}" for k, v in result["goals"].items()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tokenize.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS / 'tokenize.json'}")


if __name__ == "__main__":
    main()
