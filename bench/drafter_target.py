"""The target of `python -m bench.drafter`: the demo target trained on the demo corpus, so that it has structure a
drafter can learn.

The demo target (`draftdata.model.tiny`) has random weights: its samples are noise that no drafter predicts, and
even its argmax hangs on tiny logit differences. Here the same model (same tokenizer, shape and seed) is trained
with plain next-token cross-entropy on the demo corpus's conversations, each rendered whole with the target's own
chat template (answers and all, so it learns the chat format and ends its turns by itself). A few thousand token
batches on a CPU turn it into a small but real language model of that corpus.

`stats` is the check that it worked: mean loss, next-token entropy and top-1 probability on held-out
conversations (every 20th of each file, never trained on), before and after.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from draftdata.config.schema import TinyModelConfig
from draftdata.model.tiny import build_target
from draftdata.model.tokenizer import template_messages
from draftdata.sources.files import iter_local
from draftdata.sources.shapes import BadRecord, to_prompt

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT_EVERY = 20  # every 20th conversation of each demo file is kept out of the target's training


@dataclass(frozen=True)
class TargetSpec:
    hidden_size: int = 64
    num_layers: int = 8
    num_heads: int = 4
    steps: int = 1500  # bench.drafter's default
    seq_len: int = 256
    batch: int = 4
    lr: float = 3e-3
    seed: int = 0
    device: str = "cpu"


def demo_sources() -> list[tuple[str, Path]]:
    """(shape, path) of every demo file, as the project's params.yaml configures them."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    return [(ds["source"]["shape"], ROOT / ds["source"]["path"]) for ds in params["datasets"].values()]


def demo_prompts():
    """(row index in its file, Prompt) of every demo conversation, read by the project's own readers; a record they
    refuse is skipped, as the prompts stage skips it."""
    for shape, path in demo_sources():
        for i, row in enumerate(iter_local(path)):
            try:
                yield i, to_prompt(shape, row.value)
            except BadRecord:
                continue


def rendered_conversations(tok) -> tuple[list[list[int]], list[list[int]]]:
    """(train, held out): every demo conversation's token ids, rendered whole by the chat template."""
    train, held = [], []
    for i, p in demo_prompts():
        ids = tok.apply_chat_template(template_messages(p.conversation), tools=p.tools, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        (held if i % HELD_OUT_EVERY == 0 else train).append(ids)
    return train, held


def batches(stream: list[int], spec: TargetSpec, rng: random.Random):
    """Random windows of `seq_len + 1` tokens from the concatenated training conversations."""
    import torch

    while True:
        starts = [rng.randrange(len(stream) - spec.seq_len - 1) for _ in range(spec.batch)]
        yield torch.tensor([stream[s : s + spec.seq_len + 1] for s in starts], device=spec.device)


def stats(model, held: list[list[int]], max_len: int = 1024) -> dict:
    """Mean next-token loss, entropy (nats) and top-1 probability over the held-out conversations' tokens; and how
    alike neighbouring layers are (`adjacent_layer_cosine[l]`: the mean cosine of layer l's output and layer l+1's,
    per token): the more alike, the less a drafter given the neighbouring layer has to lose."""
    import torch

    loss = entropy = top1 = 0.0
    n = 0
    cosines = torch.zeros(model.config.num_hidden_layers - 2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for ids in held:
            x = torch.tensor([ids[:max_len]], device=model.device)
            out = model(input_ids=x, output_hidden_states=True)
            # hidden_states[l + 1] is layer l's output; the last entry has the final norm applied: left out
            hs = out.hidden_states[1:-1]
            cosines += torch.stack(
                [torch.cosine_similarity(a[0], b[0], dim=-1).sum() for a, b in zip(hs, hs[1:])]
            ).cpu()
            logp = out.logits[0, :-1].float().log_softmax(-1)
            p = logp.exp()
            loss -= logp.gather(1, x[0, 1:, None]).sum().item()
            entropy -= (p * logp).sum().item()
            top1 += p.max(-1).values.sum().item()
            n += x.shape[1] - 1
    return {
        "loss": round(loss / n, 4),
        "entropy_nats": round(entropy / n, 4),
        "top1_prob": round(top1 / n, 4),
        "uniform_entropy_nats": round(math.log(model.config.vocab_size), 4),
        "tokens": n,
        "adjacent_layer_cosine": [round(c, 4) for c in (cosines / (n + len(held))).tolist()],
    }


def train_target(out: Path, spec: TargetSpec, log=print) -> dict:
    """Build the demo target into `out`, train it on the demo corpus, save it there; its stats before and after."""
    import torch
    from transformers import AutoModelForCausalLM

    tm = TinyModelConfig(
        path=str(out),
        corpus_dir=str(ROOT / "sources" / "demo"),
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        seed=spec.seed,
    )
    tok = build_target(tm)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(spec.device)
    train, held = rendered_conversations(tok)
    before = stats(model, held)
    stream = [t for ids in train for t in ids]
    torch.manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.lr, total_steps=spec.steps, pct_start=0.05)
    model.train()
    t0 = time.perf_counter()
    for step, x in zip(range(spec.steps), batches(stream, spec, random.Random(spec.seed))):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            log(f"target step {step}/{spec.steps} loss {loss.item():.3f}")
    train_s = time.perf_counter() - t0
    after = stats(model, held)
    model.save_pretrained(out)
    return {
        "shape": {"hidden_size": spec.hidden_size, "num_layers": spec.num_layers, "vocab_size": len(tok)},
        "steps": spec.steps,
        "tokens_per_step": spec.batch * spec.seq_len,
        "train_tokens": len(stream),
        "held_out_conversations": len(held),
        "train_s": round(train_s, 1),
        "before": before,
        "after": after,
    }
