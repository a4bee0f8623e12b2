"""Stage `tokenize@D`: responses → `data/<D>/samples.parquet`, token-exact.

Where the server returned ids, a sample is `prompt_ids + output_ids` and the loss mask is 0 over the prompt and 1
over what the target generated, its end-of-turn token included — no re-encoding, no regex. Where only text came
back, the renderer's own rule finds the boundary: the prompt rendered with the generation prompt must be a prefix
of the whole conversation rendered with the response (else the sample is skipped as
`template_not_prefix_stable`); the whole text is encoded once and the boundary falls at a token edge. The mask
then runs to the first end-of-turn token, and what the template adds after it is not part of the sample (so
both paths give the same sample). The drift between the re-encoded completion length and the server's count is
measured. Every skipped response is counted by reason.

A conversation regenerated turn by turn (`turns: all`: its lines share a `conversation` id and number their
`turn`) is decided from its turns' ids (each turn's prompt and answer, from either path): where every turn's prompt
starts with the previous turn's prompt and answer (`prefix_stable`), one sample holds the whole conversation, the
last turn's prompt and answer, with every answer trained (`train_on: all_turns`) or the last; where it does not (a
template that drops earlier reasoning), each turn is its own sample, exactly the ids that turn was sent. Under
`on_too_long: drop` the turns too long go and the conversation keeps the others.
"""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from jinja2.exceptions import TemplateError

from draftdata.config.modes import by_recorded_mode
from draftdata.config.schema import Config, EmptyThink, OnTooLong, TokenizeConfig, TrainOn
from draftdata.errors import UserError
from draftdata.model.think import block_of
from draftdata.model.tokenizer import (
    assistant_message,
    end_of_turn_ids,
    load_tokenizer,
    prefix_stable,
    template_messages,
)
from draftdata.tokenize.think import mark_empty_think
from draftdata.util.rejected import TURN, Tally

# Every reason a response is skipped for (template_error:<type> adds the exception's name); the skips plot lists
# them all, zeros included, so runs line up.
SKIP_REASONS = (
    "empty_output",
    "over_max_seq_len",
    "no_trained_tokens_after_truncation",
    "template_not_prefix_stable",
    "template_alters_response",
    "no_end_of_turn",
    "text_before_end_of_turn",
)
# Above this many text-path records, on a machine with this many cores, rendering (Python-bound Jinja) is spread
# over processes (see text_samples_parallel).
PARALLEL_MIN_RECORDS = 4000
PARALLEL_MIN_CPUS = 4


@dataclass
class Tokenized:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    conversation: str | None = None  # a regenerated conversation's id (`turns: all`)
    turn: int | None = None  # the turn of its last trained answer
    mode: str | None = None  # its generation mode (datasets.<D>.modes)
    responses: int = 1  # the responses whose answers it trains (what a skip of it counts)


class Skip(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def from_ids(prompt_ids: list[int], output_ids: list[int]) -> tuple[list[int], list[int]]:
    """The exact tokens the target saw and produced; the mask is built with the ids."""
    return prompt_ids + output_ids, [0] * len(prompt_ids) + [1] * len(output_ids)


def ids_sample(rec: dict, ends: set[int]) -> tuple[list[int], list[int]] | Skip:
    """A response with its ids as a sample, or the Skip that says why not: one the server says the target ended
    (`stop`) must end on an end-of-turn id, else the sample would never train the end of the turn (a server that
    stopped on a stop string, say): `no_end_of_turn`, as the text path says of it."""
    if _ended(rec) and (not rec["output_ids"] or rec["output_ids"][-1] not in ends):
        return Skip("no_end_of_turn")
    return from_ids(rec["prompt_ids"], rec["output_ids"])


def render_texts(tok, rec: dict, template_kwargs: dict) -> tuple[str, str]:
    """(prompt with the generation prompt, whole conversation with the response), as the template renders them."""
    return _render(tok, rec, assistant_message(rec), template_kwargs)


def _render(tok, rec: dict, answer: dict, template_kwargs: dict) -> tuple[str, str]:
    messages, tools = rec["messages"], rec.get("tools")
    prompt = tok.apply_chat_template(
        template_messages(messages), tools=tools, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    full = tok.apply_chat_template(
        template_messages(messages + [answer]), tools=tools, tokenize=False, **template_kwargs
    )
    return prompt, full


def check_rendering(prompt: str, full: str, text: str) -> str:
    """The renderer's rule, and what follows the response; returns the text the template writes after it."""
    if not full.startswith(prompt):
        raise Skip("template_not_prefix_stable")
    rest = full[len(prompt) :]
    if not rest.startswith(text):  # e.g. a template that strips or rewrites the last assistant turn
        raise Skip("template_alters_response")
    return rest[len(text) :]


_MARK = "draftdata response mark"


def rendered_answer(tok, rec: dict, template_kwargs: dict) -> tuple[str, str, str]:
    """(rendered prompt, the response as the template writes it, the template's text after the response). A
    response with parts a server's parsers took out of the text (thinking, tool calls) is the whole rendered
    assistant turn up to what the template writes after any answer (found by rendering a marker answer): the
    tokens the model wrote, in the template's own words."""
    prompt, full = render_texts(tok, rec, template_kwargs)
    if not (rec.get("reasoning_content") or rec.get("tool_calls")):
        return prompt, rec["text"], check_rendering(prompt, full, rec["text"])
    if not full.startswith(prompt):
        raise Skip("template_not_prefix_stable")
    marked = _render(tok, rec, {"role": "assistant", "content": _MARK}, template_kwargs)[1]
    at = marked.find(_MARK)
    suffix = marked[at + len(_MARK) :]
    response = full[len(prompt) : len(full) - len(suffix)]
    if at < 0 or not full.endswith(suffix) or not _shows_parts(response, rec):
        raise Skip("template_alters_response")
    return prompt, response, suffix


def _shows_parts(response: str, rec: dict) -> bool:
    """The rendered turn holds the text, the thinking and every call's name (a template may drop a part)."""
    calls = [c["function"]["name"] for c in rec.get("tool_calls") or []]
    return all(part in response for part in [rec["text"], rec.get("reasoning_content") or "", *calls])


def assemble(
    prompt_ids: list[int], text_ids: list[int], suffix_ids: list[int], end_ids: set[int], ended: bool
) -> tuple[list[int], list[int]]:
    """prompt + response + its end-of-turn token, each encoded on its own as a server would (a prompt's trailing
    whitespace tokenizes differently when text follows it). `ended`: the target ended its turn (finish_reason
    stop); a response cut by max_tokens or the budget never produced the end-of-turn token, so it is left out."""
    if not suffix_ids or not any(t in end_ids for t in suffix_ids):
        raise Skip("no_end_of_turn")
    end = suffix_ids[0]
    if end not in end_ids:  # the template writes something between the response and its end of turn: that text
        raise Skip("text_before_end_of_turn")  # is neither in the response nor a token the target ends with
    out = text_ids + ([end] if ended else [])
    return prompt_ids + out, [0] * len(prompt_ids) + [1] * len(out)


def _ended(rec: dict) -> bool:
    return rec.get("finish_reason", "stop") == "stop"


def from_text(tok, rec: dict, template_kwargs: dict, ends: set[int] | None = None) -> tuple[list[int], list[int]]:
    """One record through the text path; raises the Skip that explains a record it cannot use. `ends`: the target's
    end-of-turn ids; by default the tokenizer's eos, for a tokenizer without a model directory (the golden files');
    the stage passes the model's (text_samples_parallel)."""
    ends = ends if ends is not None else end_of_turn_ids(tok, None, template_kwargs)
    result = text_samples(tok, [rec], template_kwargs, ends)[0]
    if isinstance(result, Skip):
        raise result
    return result


def rendered_parts(tok, recs: list[dict], template_kwargs: dict) -> list:
    """Per record: (rendered prompt, response, the template's text after it), or the Skip that explains it."""
    out: list = []
    for rec in recs:
        try:
            out.append(rendered_answer(tok, rec, template_kwargs))
        except Skip as e:
            out.append(e)
        except TemplateError as e:  # the template refuses this conversation (e.g. a role it does not accept);
            out.append(Skip(f"template_error:{type(e).__name__}"))  # any other exception is a bug: it stops here
    return out


def text_samples(tok, recs: list[dict], template_kwargs: dict, ends: set[int], parts: list | None = None) -> list:
    """Encode prompts, responses and suffixes in three batches (the Rust tokenizer uses every core) and assemble.
    Returns, per record, (ids, mask) or the Skip that explains it."""
    out = parts if parts is not None else rendered_parts(tok, recs, template_kwargs)
    ok = [i for i, r in enumerate(out) if not isinstance(r, Skip)]
    if not ok:
        return out
    backend = tok.backend_tokenizer
    prompts = backend.encode_batch([out[i][0] for i in ok], add_special_tokens=False)
    texts = backend.encode_batch([out[i][1] for i in ok], add_special_tokens=False)
    suffixes = backend.encode_batch([out[i][2] for i in ok], add_special_tokens=False)
    for i, prompt, text, suffix in zip(ok, prompts, texts, suffixes):
        try:
            out[i] = assemble(prompt.ids, text.ids, suffix.ids, ends, _ended(recs[i]))
        except Skip as e:
            out[i] = e
    return out


_worker_tok = None
RENDERED_KEYS = ("messages", "tools", "text", "reasoning_content", "tool_calls")  # what rendering a record reads


def _init_worker(model_cfg) -> None:
    global _worker_tok
    _worker_tok = load_tokenizer(model_cfg)


def _worker_render(args) -> list:
    recs, kwargs = args
    return rendered_parts(_worker_tok, recs, kwargs)


def text_samples_parallel(tok, recs: list[dict], cfg: Config) -> list:
    """Large inputs render (Python-bound Jinja) in worker processes, which send back only the rendered strings;
    encoding stays one batch here, where the Rust tokenizer already uses every core."""
    kwargs = cfg.template_kwargs
    ends = end_of_turn_ids(tok, cfg.model, kwargs)
    workers = min(os.cpu_count() or 1, 16)
    # With few cores the Rust encode already fills them and rendering is ~10 % of the work: a pool's start-up and
    # pickling cost more than it saves (measured with bench/tokenize.py on 2 cores). With many, rendering in one
    # process becomes the bottleneck.
    if len(recs) < PARALLEL_MIN_RECORDS or workers < PARALLEL_MIN_CPUS:
        return text_samples(tok, recs, kwargs, ends)
    size = -(-len(recs) // (workers * 4))
    chunks = [
        ([{k: r.get(k) for k in RENDERED_KEYS} for r in recs[i : i + size]], kwargs) for i in range(0, len(recs), size)
    ]
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(cfg.model,)) as pool:
        parts = [p for part in pool.map(_worker_render, chunks) for p in part]
    return text_samples(tok, recs, kwargs, ends, parts)


def limit_length(s: Tokenized, max_len: int, policy: OnTooLong) -> Tokenized:
    if len(s.input_ids) <= max_len:
        return s
    if policy == OnTooLong.drop:
        raise Skip("over_max_seq_len")
    s = replace(s, input_ids=s.input_ids[:max_len], loss_mask=s.loss_mask[:max_len])
    if not any(s.loss_mask):  # the prompt alone fills max_seq_len: nothing left to train on
        raise Skip("no_trained_tokens_after_truncation")
    return s


@dataclass
class TokenizeTally:
    skipped: Counter
    text_path: int = 0
    drift: int = 0  # text-path samples whose re-encoded completion length differs from the server's count
    truncated: int = 0
    conversations: int = 0  # regenerated conversations (`turns: all`) with a sample
    per_turn: int = 0  # of which not prefix-stable: one sample per turn
    why: dict = field(default_factory=dict)  # response id -> why it was skipped
    why_sample: dict = field(default_factory=dict)  # a sample's row (conversation or response id) -> why it went

    def skip(self, rec: dict, reason: str) -> None:
        self.skipped[reason] += 1
        self.why[rec["id"]] = reason


def response_groups(recs: list[dict]) -> list[list[dict]]:
    """In response order: a record on its own, or the records of one conversation in turn order (at its first)."""
    groups: list[list[dict]] = []
    conversations: dict[str, list[dict]] = {}
    for rec in recs:
        if rec.get("conversation") is None:
            groups.append([rec])
        elif rec["conversation"] in conversations:
            conversations[rec["conversation"]].append(rec)
        else:
            conversations[rec["conversation"]] = [rec]
            groups.append(conversations[rec["conversation"]])
    for turns in conversations.values():
        turns.sort(key=lambda r: r["turn"])
    return groups


class Built(NamedTuple):
    """A response built on its own: its prompt and answer ids, the loss mask 0 over the prompt and 1 over the answer."""

    rec: dict
    ids: list[int]
    mask: list[int]

    @property
    def prompt_len(self) -> int:
        return len(self.ids) - sum(self.mask)

    def sample(self) -> Tokenized:
        rec = self.rec
        return Tokenized(rec["id"], self.ids, self.mask, rec.get("conversation"), rec.get("turn"), mode=rec.get("mode"))


def conversation_samples(turns: list[Built], train_on: TrainOn) -> tuple[list[Tokenized], bool]:
    """The samples of one conversation's turns, and whether it is prefix-stable (one sample holds it)."""
    trained = turns if train_on == TrainOn.all_turns else turns[-1:]
    if not prefix_stable([(t.ids[: t.prompt_len], t.ids[t.prompt_len :]) for t in turns]):
        return [t.sample() for t in trained], False  # each turn alone, as it was sent
    last = turns[-1]
    mask = [0] * len(last.ids)
    for t in trained:  # each answer sits in the later turns' prompts where it stood in its own sample
        mask[t.prompt_len : len(t.ids)] = t.mask[t.prompt_len :]
    return [replace(last.sample(), loss_mask=mask, responses=len(trained))], True


def build_samples(recs: list[dict], tok, cfg: Config) -> tuple[list[Tokenized], TokenizeTally]:
    tally = TokenizeTally(Counter())
    usable = []
    for rec in recs:
        if rec["completion_tokens"] == 0 or not (
            rec["text"].strip() or rec.get("reasoning_content") or rec.get("tool_calls")
        ):
            tally.skip(rec, "empty_output")
        else:
            usable.append(rec)
    built: dict[str, object] = {}
    # each mode's rows under its own template_kwargs (datasets.<D>.modes): the end of a turn and a re-render
    for sub, rows in by_recorded_mode(cfg, usable, "responses.jsonl"):
        by_ids = [r for r in rows if r.get("prompt_ids") is not None and r.get("output_ids") is not None]
        by_text = [r for r in rows if r.get("prompt_ids") is None or r.get("output_ids") is None]
        ends = end_of_turn_ids(tok, sub.model, sub.template_kwargs) if by_ids else set()
        how = cfg.tokenize.empty_think
        block = block_of(tok, sub.template_kwargs, how) if rows else None
        built.update((r["id"], _marked(ids_sample(r, ends), block, how)) for r in by_ids)
        for rec, result in zip(by_text, text_samples_parallel(tok, by_text, sub)):
            if not isinstance(result, Skip):
                tally.text_path += 1
                tally.drift += int(sum(result[1]) != rec["completion_tokens"])
            built[rec["id"]] = _marked(result, block, how)
    samples = []
    for group in response_groups(usable):
        turns = []
        for rec in group:  # a turn that cannot be built is skipped; its answer stays context of the later ones
            result = built[rec["id"]]
            if isinstance(result, Skip):
                tally.skip(rec, result.reason)
            else:
                turns.append(Built(rec, *result))
        if turns:
            samples += _within_length(_group_samples(turns, cfg.tokenize, tally), cfg, tally)
    return samples, tally


def _marked(result, block: list[int] | None, how: EmptyThink):
    """A built answer with its empty think block trained or not (tokenize.empty_think; think.py)."""
    if isinstance(result, Skip) or not block:
        return result
    ids, mask = result
    return ids, mark_empty_think(ids, mask, block, how)


def _group_samples(turns: list[Built], cfg: TokenizeConfig, tally: TokenizeTally) -> list[Tokenized]:
    if turns[0].rec.get("conversation") is None:  # a response on its own (`turns: last`)
        return [turns[0].sample()]
    if cfg.on_too_long == OnTooLong.drop:  # the turns too long go; a shorter conversation is still a valid sample
        fit = [t for t in turns if len(t.ids) <= cfg.max_seq_len]
        if len(fit) < len(turns):
            for t in turns:
                if len(t.ids) > cfg.max_seq_len:
                    tally.skip(t.rec, "over_max_seq_len")
            if not fit:
                return []
            turns = fit
    samples, stable = conversation_samples(turns, cfg.train_on)
    tally.conversations += 1
    tally.per_turn += int(not stable)
    return samples


def _within_length(samples: list[Tokenized], cfg: Config, tally: TokenizeTally) -> list[Tokenized]:
    out = []
    for s in samples:
        try:
            kept = limit_length(s, cfg.tokenize.max_seq_len, cfg.tokenize.on_too_long)
        except Skip as e:
            tally.skipped[e.reason] += s.responses
            tally.why_sample[s.conversation or s.id] = e.reason
            continue
        tally.truncated += int(len(kept.input_ids) < len(s.input_ids))
        out.append(kept)
    return out


def check_skips(skipped: Counter, responses: int, max_pct: float) -> None:
    """Too many skips stop the stage before anything is written, naming the top reason."""
    n = sum(skipped.values())
    if responses and 100.0 * n / responses > max_pct:
        reason, count = skipped.most_common(1)[0]
        raise UserError(
            f"tokenize: {n} of {responses} responses skipped ({100.0 * n / responses:.1f} % > "
            f"tokenize.max_skip_pct {max_pct:g}); top reason: {reason} ({count}); see the reasons in "
            "docs/outputs.md, or raise tokenize.max_skip_pct"
        )


def reject_rows(rejected: Tally, recs: list[dict], samples: list[Tokenized], tally: TokenizeTally) -> int:
    """The rejection ledger's lines (util/rejected.py): each response row (a conversation, `turns: all`) no sample
    holds, with why, and each turn skipped in a conversation a sample still holds. Returns the rows kept."""
    kept = {s.conversation or s.id for s in samples}
    for group in response_groups(recs):
        row = group[0].get("conversation") or group[0]["id"]
        skipped = [r for r in group if r["id"] in tally.why]
        if row not in kept:
            reason = tally.why_sample.get(row) or (tally.why[skipped[0]["id"]] if skipped else "no_sample")
            rejected.add(reason, id=row)
            continue
        for r in skipped:
            rejected.add(tally.why[r["id"]], unit=TURN, id=r["id"], conversation=row, turn=r.get("turn"))
    return len(kept)
