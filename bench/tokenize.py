"""Throughput of the tokenize stage on its slow path (text only) against the raw `tokenizers` batch encode, under
two chat templates, and the drift the text path brings where token ids came from a generation.

    python -m bench.tokenize [--samples 1000] [--generated 64] [--bigram 1000]

Synthetic conversations with lengths like the real data: prompts of 50-2,000 tokens, completions lognormal with
mean ≈ 3.5k tokens capped at 10k, rendered by the demo tokenizer (draftdata/model/tiny.py) under

- `chatml`: the demo's 20-line ChatML template; system, user, an earlier assistant turn, user;
- `qwen3_tools`: Qwen3's chat template (bench/templates/qwen3.jinja, as Qwen/Qwen3-0.6B ships it): half the
  conversations carry tool definitions, an assistant turn with its reasoning and a tool call, and the tool's
  result; the other half are plain multi-turn with the reasoning of earlier turns (which the template drops);
  every completion is `<think>` reasoning `</think>` and an answer, some ending in a tool call.

Side by side, in one run, per template (text path and raw take turns on 4 slices, so a shared machine's changing
speed hits both alike):

- stage, text path: `draftdata.tokenize.samples.build_samples` on responses that carry text only (render prompt and
  conversation, encode, find the boundary, build the mask, count drift);
- raw: `tokenizers`' batch encode of the same full conversation texts (what any pipeline must at least pay);
- stage, id path: the same responses with token ids (no re-encoding at all).

Drift, on responses whose ids a model sampled (short prompts, up to 256 new tokens, temperature 1), stored as text
(decoded without special tokens, as the backends store it) and re-encoded by the text path. Two samplers: the demo
target itself (random weights: it draws tokens with no regard for how the tokenizer would merge them, the worst
case) and a bigram model counted on the canonical encoding of the demo texts (it emits what the tokenizer emits,
token after token, as a trained model mostly does). Per sampler:

- samples_differ_pct: share of text-path samples whose completion ids differ from the generated ids;
- tokens_differ_pct: share of the generated tokens the re-encoded completion does not reproduce (generated tokens
  outside difflib's matching blocks between the two sequences);
- stage_drift_pct: what the stage's own `drift_pct` reports for them (re-encoded length ≠ the generated count);
- the id path on the same responses must rebuild every sample as exactly the prompt ids + the generated ids, its
  mask 0 over the prompt and 1 over the generated ids (asserted).

Writes bench/results/tokenize.json. Goal: text path ÷ raw >= 0.7 under each template.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from difflib import SequenceMatcher
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DEMO = Path(__file__).resolve().parents[1] / "sources" / "demo"
QWEN3_TEMPLATE = Path(__file__).parent / "templates" / "qwen3.jinja"
MAX_NEW_TOKENS = 256


def build_tokenizer_dir(out: Path):
    from draftdata.model.tiny import build_tokenizer, iter_demo_texts

    tok = build_tokenizer(iter_demo_texts(DEMO), 2048)
    tok.save_pretrained(out)
    return tok


def word_pool(tok) -> tuple[list[str], float]:
    """Words from the demo texts and the tokens one word costs on average. Words holding a think tag are left out:
    inside a generated turn, Qwen3's template would read them as the turn's reasoning markers."""
    from draftdata.model.tiny import iter_demo_texts

    words = [w for text in iter_demo_texts(DEMO) for w in text.split() if "think>" not in w][:200_000]
    sample = " ".join(words[:20_000])
    return words, len(tok.encode(sample, add_special_tokens=False)) / 20_000


class Texts:
    """Runs of demo words of about a given number of tokens, drawn from one seeded generator."""

    def __init__(self, tok, seed: int):
        self.rng = random.Random(seed)
        self.words, self.per_word = word_pool(tok)
        self.mu = math.log(3500) - 0.8**2 / 2

    def of(self, tokens: int) -> str:
        start = self.rng.randrange(len(self.words) - 1)
        n = max(1, round(tokens / self.per_word))
        out = []
        while len(out) < n:
            out += self.words[start : start + n - len(out)]
            start = 0
        return " ".join(out)

    def completion_tokens(self) -> int:
        return min(10_000, max(1, round(self.rng.lognormvariate(self.mu, 0.8))))

    def prompt_parts(self, shares: tuple[float, ...]) -> list[int]:
        prompt_tokens = self.rng.randint(50, 2000)
        return [max(5, int(prompt_tokens * f)) for f in shares]


def record(i: int, messages: list[dict], text: str, tools: list[dict] | None = None) -> dict:
    return {
        "id": f"s{i}",
        "messages": messages,
        "tools": tools,
        "text": text,
        "completion_tokens": 1,  # not known without re-encoding; only the drift count reads it
        "finish_reason": "stop",
        "prompt_ids": None,
        "output_ids": None,
    }


def chatml_records(tok, n: int, seed: int) -> list[dict]:
    t = Texts(tok, seed)
    recs = []
    for i in range(n):
        parts = t.prompt_parts((0.1, 0.4, 0.2, 0.3))
        roles = ("system", "user", "assistant", "user")
        messages = [{"role": role, "content": t.of(k)} for role, k in zip(roles, parts)]
        recs.append(record(i, messages, t.of(t.completion_tokens())))
    return recs


def tool(name: str, description: str, **params: str) -> dict:
    props = {p: {"type": "string", "description": d} for p, d in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(params)[:1]},
        },
    }


TOOLS = [
    tool("search_web", "Search the web and return the top results with titles, links and snippets.", query="terms"),
    tool("read_file", "Read a text file of the repository.", path="relative path", encoding="text encoding"),
    tool("run_python", "Run Python code in a sandbox and return stdout, stderr and the exit code.", code="source"),
    tool("get_weather", "Current weather for a place.", city="city name", unit="celsius or fahrenheit"),
    tool("sql_query", "Run a read-only SQL query against the analytics database.", sql="the query"),
    tool("send_email", "Send an email.", to="address", subject="subject line", body="plain-text body"),
    tool("calendar_add", "Add an event to the user's calendar.", title="title", start="ISO time", end="ISO time"),
    tool("translate", "Translate text between languages.", text="text", target="language code"),
]


def think(t: Texts, reasoning: int, answer: int) -> str:
    """A thinking model's turn as it generates it: reasoning inside <think>, then the answer."""
    return f"<think>\n{t.of(reasoning)}\n</think>\n\n{t.of(answer)}"


def tool_call(t: Texts, fn: dict) -> dict:
    args = {p: t.of(6) for p in fn["function"]["parameters"]["properties"]}
    return {"type": "function", "function": {"name": fn["function"]["name"], "arguments": json.dumps(args)}}


def qwen3_records(tok, n: int, seed: int) -> list[dict]:
    t = Texts(tok, seed)
    recs = []
    for i in range(n):
        sys_k, user_k, hist_k, last_k = t.prompt_parts((0.1, 0.4, 0.2, 0.3))
        messages = [{"role": "system", "content": t.of(sys_k)}, {"role": "user", "content": t.of(user_k)}]
        tools = None
        if i % 2 == 0:  # an agent turn: reason, call a tool, read its result
            tools = t.rng.sample(TOOLS, t.rng.randint(2, 6))
            call = tool_call(t, t.rng.choice(tools))
            messages += [
                {"role": "assistant", "content": think(t, hist_k // 2, hist_k // 2), "tool_calls": [call]},
                {"role": "tool", "content": json.dumps({"result": t.of(last_k)})},
            ]
        else:  # plain multi-turn: the earlier turn's reasoning is dropped by the template
            messages += [
                {"role": "assistant", "content": think(t, hist_k // 2, hist_k // 2)},
                {"role": "user", "content": t.of(last_k)},
            ]
        k = t.completion_tokens()
        text = think(t, max(1, k * 3 // 5), max(1, k * 2 // 5))
        if tools and t.rng.random() < 0.3:  # the answer ends in another call, written as the model writes it
            fn = tool_call(t, t.rng.choice(tools))["function"]
            text += f'\n\n<tool_call>\n{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}\n</tool_call>'
        recs.append(record(i, messages, text, tools))
    return recs


def timed_raw(tok, texts: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    raw = tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)  # the Rust tokenizer, all cores
    return time.perf_counter() - t0, sum(len(e.ids) for e in raw)


def timed_stage(tok, cfg, recs: list[dict]) -> tuple[float, list]:
    from draftdata.tokenize.samples import build_samples

    t0 = time.perf_counter()
    samples, tally = build_samples(recs, tok, cfg)
    seconds = time.perf_counter() - t0
    assert len(samples) == len(recs), dict(tally.skipped)
    return seconds, samples


def time_paths(tok, cfg, recs: list[dict], rounds: int = 4) -> dict:
    """Text path, raw encode and id path on the same responses; the id path must give the text path's samples.
    Text path and raw take turns on each of `rounds` slices (which goes first alternates), so a shared machine's
    changing speed hits both alike; the per-round ratios show how much it moved."""
    from draftdata.model.tokenizer import render_prompt_ids
    from draftdata.tokenize.samples import build_samples, render_texts

    fulls = [render_texts(tok, r, {})[1] for r in recs]
    size = -(-len(recs) // rounds)
    raw_s = stage_s = 0.0
    raw_tokens, samples, per_round = 0, [], []
    for k, i in enumerate(range(0, len(recs), size)):
        if k % 2:
            s_s, chunk = timed_stage(tok, cfg, recs[i : i + size])
            r_s, r_tokens = timed_raw(tok, fulls[i : i + size])
        else:
            r_s, r_tokens = timed_raw(tok, fulls[i : i + size])
            s_s, chunk = timed_stage(tok, cfg, recs[i : i + size])
        s_tokens = sum(len(s.input_ids) for s in chunk)
        per_round.append(round((s_tokens / s_s) / (r_tokens / r_s), 3))
        raw_s, stage_s, raw_tokens, samples = raw_s + r_s, stage_s + s_s, raw_tokens + r_tokens, samples + chunk
    stage_tokens = sum(len(s.input_ids) for s in samples)

    id_recs = []
    for rec, s in zip(recs, samples):
        prompt_ids = render_prompt_ids(tok, rec["messages"], rec["tools"], {})
        assert s.input_ids[: len(prompt_ids)] == prompt_ids
        id_recs.append(dict(rec, prompt_ids=prompt_ids, output_ids=s.input_ids[len(prompt_ids) :]))
    t0 = time.perf_counter()
    id_samples, _ = build_samples(id_recs, tok, cfg)
    id_s = time.perf_counter() - t0
    assert [s.input_ids for s in id_samples] == [s.input_ids for s in samples]
    assert [s.loss_mask for s in id_samples] == [s.loss_mask for s in samples]
    return {
        "samples": len(samples),
        "mean_tokens_per_sample": round(stage_tokens / len(samples)),
        "stage_tok_s": round(stage_tokens / stage_s),
        "stage_samples_s": round(len(samples) / stage_s, 1),
        "raw_tok_s": round(raw_tokens / raw_s),
        "ratio": round((stage_tokens / stage_s) / (raw_tokens / raw_s), 3),
        "ratio_per_round": per_round,
        "id_path_tok_s": round(stage_tokens / id_s),
        "wall_s": {"stage": round(stage_s, 2), "raw": round(raw_s, 2), "id_path": round(id_s, 2)},
    }


# ---- drift: ids from a generation, stored as text, re-encoded --------------------------------------------------- #


def short_prompts(tok, n: int, seed: int) -> list[dict]:
    from draftdata.model.tokenizer import render_prompt_ids

    t = Texts(tok, seed)
    recs = []
    for i in range(n):
        sys_k, user_k = (t.rng.randint(10, 60), t.rng.randint(20, 150))
        messages = [{"role": "system", "content": t.of(sys_k)}, {"role": "user", "content": t.of(user_k)}]
        recs.append(dict(record(i, messages, ""), prompt_ids=render_prompt_ids(tok, messages, None, {})))
    return recs


def sample_tiny_model(tok, prompts: list[list[int]], ends: set[int], seed: int, batch: int = 64) -> list[list[int]]:
    """The demo target's own draws (draftdata/model/tiny.py's model, seed 0), temperature 1, until an end-of-turn
    token or MAX_NEW_TOKENS. A plain KV-cached loop: for a model this small, `generate`'s own work per step costs
    far more than the forward on a CPU."""
    import torch

    from draftdata.config.schema import TinyModelConfig
    from draftdata.model.tiny import build_model

    model = build_model(TinyModelConfig(), len(tok), tok.eos_token_id, tok.pad_token_id)
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        out += _sample_batch(model, prompts[i : i + batch], torch.tensor(sorted(ends)), gen, tok.pad_token_id)
    return out


def _sample_batch(model, prompts: list[list[int]], stop, gen, pad: int) -> list[list[int]]:
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left-padded, the pads masked
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    outs: list[list[int]] = [[] for _ in prompts]
    cache = None
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            o = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, logits_to_keep=1)
            cache = o.cache
            nxt = torch.multinomial(o.logits[:, -1].float().softmax(-1), 1, generator=gen)[:, 0]
            for j in (~done).nonzero()[:, 0].tolist():
                outs[j].append(int(nxt[j]))
            done |= torch.isin(nxt, stop)
            if bool(done.all()):
                break
            ids, pos = nxt[:, None], pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return outs


def sample_bigram(tok, n: int, ends: set[int], seed: int) -> list[list[int]]:
    """Draws from next-token counts over the canonical encoding of the demo texts (each text followed by the end of
    turn), from the end-of-turn token on, until an end-of-turn token or MAX_NEW_TOKENS."""
    import numpy as np

    from draftdata.model.tiny import iter_demo_texts

    texts = [x for x in iter_demo_texts(DEMO) if len(x) >= 200]
    eos = tok.eos_token_id
    counts = np.zeros((len(tok), len(tok)))
    for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        seq = [eos, *enc.ids, eos]
        np.add.at(counts, (seq[:-1], seq[1:]), 1)
    cdf = np.cumsum(counts, 1)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids, prev = [], eos
        while len(ids) < MAX_NEW_TOKENS and (not ids or ids[-1] not in ends):
            prev = int(np.searchsorted(cdf[prev], rng.random() * cdf[prev, -1], side="right"))
            ids.append(prev)
        out.append(ids)
    return out


def drift(tok, cfg, recs: list[dict], generated: list[list[int]]) -> dict:
    """`recs` carry their prompt ids; `generated[i]` is what the model produced for recs[i], its end-of-turn token
    included where it ended. Stored as text (as a backend stores it), then through both paths."""
    from draftdata.model.tokenizer import end_of_turn_ids
    from draftdata.tokenize.samples import build_samples

    ends = end_of_turn_ids(tok, None, {})
    stored = []
    for rec, ids in zip(recs, generated):
        stored.append(
            dict(
                rec,
                text=tok.decode(ids, skip_special_tokens=True),
                completion_tokens=len(ids),
                finish_reason="stop" if ids[-1] in ends else "length",
            )
        )
    expected = {r["id"]: (r["prompt_ids"], ids) for r, ids in zip(recs, generated)}

    text_samples, tally = build_samples([dict(r, prompt_ids=None) for r in stored], tok, cfg)
    differ = prompt_differ = tokens = unmatched = 0
    for s in text_samples:
        prompt, ids = expected[s.id]
        cut = s.loss_mask.index(1)
        prompt_differ += s.input_ids[:cut] != prompt
        got = s.input_ids[cut:]
        differ += got != ids
        tokens += len(ids)
        matched = sum(b.size for b in SequenceMatcher(None, ids, got, autojunk=False).get_matching_blocks())
        unmatched += len(ids) - matched

    # The id path must give back exactly what was generated, prompt and completion.
    id_samples, id_tally = build_samples([dict(r, output_ids=ids) for r, ids in zip(stored, generated)], tok, cfg)
    assert set(id_tally.skipped) <= {"empty_output"}, dict(id_tally.skipped)
    assert len(id_samples) + id_tally.skipped["empty_output"] == len(recs)
    for s in id_samples:
        prompt, ids = expected[s.id]
        assert s.input_ids == prompt + ids and s.loss_mask == [0] * len(prompt) + [1] * len(ids), s.id

    n = len(text_samples)
    return {
        "responses": len(recs),
        "mean_generated_tokens": round(sum(map(len, generated)) / len(generated), 1),
        "ended_pct": round(100.0 * sum(ids[-1] in ends for ids in generated) / len(generated), 1),
        "text_path_samples": n,
        "text_path_skipped": dict(sorted(tally.skipped.items())),
        "samples_differ_pct": round(100.0 * differ / n, 2),
        "tokens_differ_pct": round(100.0 * unmatched / tokens, 2),
        "stage_drift_pct": round(100.0 * tally.drift / tally.text_path, 2),
        "prompts_differ": prompt_differ,
        "id_path_samples": len(id_samples),
        "id_path_exact": True,  # asserted above
    }


def print_timing(name: str, r: dict) -> None:
    print(f"{name}: {r['samples']} samples, {r['mean_tokens_per_sample']} tokens each")
    for label, key, wall in (("stage (text)", "stage_tok_s", "stage"), ("raw encode", "raw_tok_s", "raw")):
        print(f"  {label:<14} {r[key]:>12,} tok/s {r['wall_s'][wall]:>8.2f} s")
    print(f"  {'stage (ids)':<14} {r['id_path_tok_s']:>12,} tok/s {r['wall_s']['id_path']:>8.2f} s")
    print(f"  ratio (stage/raw) = {r['ratio']} (per round: {', '.join(map(str, r['ratio_per_round']))})")


def main() -> None:
    from draftdata.config.schema import Config, ModelConfig, TokenizeConfig
    from draftdata.model.tokenizer import end_of_turn_ids

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1000, help="conversations timed under each template")
    ap.add_argument("--generated", type=int, default=64, help="responses the demo target generates for the drift")
    ap.add_argument("--bigram", type=int, default=1000, help="responses the bigram model generates for the drift")
    args = ap.parse_args()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer_dir(Path(tmp))
        big = TokenizeConfig(max_seq_len=1 << 20)
        chatml_cfg = Config(model=ModelConfig(path=tmp), tokenize=big)
        qwen3_cfg = Config(model=ModelConfig(path=tmp, chat_template=str(QWEN3_TEMPLATE)), tokenize=big)
        templates = {"chatml": time_paths(tok, chatml_cfg, chatml_records(tok, args.samples, seed=0))}
        print_timing("chatml", templates["chatml"])
        chatml = tok.chat_template
        tok.chat_template = QWEN3_TEMPLATE.read_text()  # what load_tokenizer does with model.chat_template
        templates["qwen3_tools"] = time_paths(tok, qwen3_cfg, qwen3_records(tok, args.samples, seed=0))
        print_timing("qwen3_tools", templates["qwen3_tools"])

        tok.chat_template = chatml
        ends = end_of_turn_ids(tok, None, {})
        recs = short_prompts(tok, max(args.generated, args.bigram), seed=1)
        t0 = time.perf_counter()
        tiny = sample_tiny_model(tok, [r["prompt_ids"] for r in recs[: args.generated]], ends, seed=0)
        generate_s = time.perf_counter() - t0
        drifts = {
            "tiny_model": drift(tok, chatml_cfg, recs[: args.generated], tiny),
            "bigram": drift(tok, chatml_cfg, recs[: args.bigram], sample_bigram(tok, args.bigram, ends, seed=0)),
        }
    for name, d in drifts.items():
        print(
            f"drift, {name}: {d['samples_differ_pct']} % of samples, {d['tokens_differ_pct']} % of tokens differ; "
            f"the stage's drift_pct says {d['stage_drift_pct']} %; id path exact on {d['id_path_samples']}"
        )
    result = {
        "templates": templates,
        "drift": drifts,
        "settings": {
            "samples": args.samples,
            "generated": {"tiny_model": args.generated, "bigram": args.bigram},
            "max_new_tokens": MAX_NEW_TOKENS,
            "tiny_model_generate_s": round(generate_s, 1),
            "wall_s": round(time.perf_counter() - t_start, 1),
        },
        "goals": {f"{name}_ratio_ge_0.7": r["ratio"] >= 0.7 for name, r in templates.items()},
    }
    print("goals: " + ", ".join(f"{k}={'ok' if v else 'MISSED'}" for k, v in result["goals"].items()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tokenize.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS / 'tokenize.json'}")


if __name__ == "__main__":
    main()
