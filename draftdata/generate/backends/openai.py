"""The `openai` backend: any OpenAI-compatible server (vLLM, SGLang's OpenAI API, `transformers serve`, hosted).

`backend.prompt_format` picks the endpoint:
- `ids`: `/v1/completions` with the token-id prompt (a list of ints; vLLM and SGLang take it), so the server sees
  exactly the training prompt tokens;
- `text`: `/v1/completions` with the prompt decoded to text, for servers whose completions take strings only
  (`transformers serve`); the server re-tokenizes, and a prompt-token count that differs from ours is reported in
  `GenResult.extra["prompt_tokens_drift"]`;
- `chat`: `/v1/chat/completions` with the messages and tools; the server applies its own chat template.
A request without prompt ids always goes to chat.

`backend.return_token_ids: true` asks vLLM (>= 0.10.2) for `prompt_token_ids` and per-choice `token_ids` (whole
lists in a plain answer, the new ids in each stream chunk). Servers that validate fields strictly reject it
(`transformers serve`: 422), and without it only text comes back. Token counts are `usage.completion_tokens`; a stream
asks for them with `stream_options.include_usage`. Stopping a request closes its connection, which vLLM treats as
an abort (`transformers serve` too, for streamed requests only).

A chat answer's parts that a server's parsers move out of `content` are kept with the response, so tokenize renders
the assistant message the model really wrote: a tool parser's (vLLM `--tool-call-parser`, SGLang's)
`message.tool_calls` (streamed: `delta.tool_calls` fragments keyed by `index`, the id and function name first, then
`arguments` string pieces) and a reasoning parser's thinking (`reasoning_content`, vLLM >= 0.10 `reasoning`). A
template that cannot render one of them refuses the run before any request (generate/run/preflight.py), or its answer
(`unrenderable`, not retried): a sample must not train on another answer than the model gave. Token ids, when the
server returns them, win over all of this in tokenize.

Every sampling field is sent, neutral values included (vLLM and SGLang fill an omitted one from the model's
generation_config.json), then `sampling.extra`; `backend.openai_fields_only` leaves out the fields OpenAI does not
have (checked neutral at validation), and `backend.extra_body` may name none of the fields set here.
"""

from __future__ import annotations

from draftdata.config.schema import sent
from draftdata.generate.backends.http import (
    Body,
    EventStream,
    Failure,
    HttpBackend,
    Server,
    engine_error,
    finish_or_discard,
    model_matches,
    response_shape,
    stream_cut,
)
from draftdata.generate.backends.protocol import GenRequest, GenResult, Partial

OPENAI_ABSENT = ("top_k", "min_p", "repetition_penalty")  # not OpenAI fields: `backend.openai_fields_only` omits them
ENDED_TURN = ("stop", "tool_calls", "function_call")  # OpenAI's finish reasons of a model that ended its turn


def finish_reason(value: str | None) -> str:
    """OpenAI's finish_reason (plus vLLM's abort) as stop | length | abort, or the Failure of an answer that is no
    response, not retried: `content_filter` (the server's filter withheld or cut the answer; the same prompt meets
    the same filter), and `bad_response` for a missing (null) or unknown finish reason, since nothing then says the
    answer is whole. A stream that ends without one never gets here: it is a cut stream (`stream_cut`), retried."""
    if value in ("length", "abort"):
        return value
    if value in ENDED_TURN:
        return "stop"
    if value == "content_filter":
        raise Failure("content_filter", "the server's content filter withheld or cut the answer")
    raise Failure(
        "bad_response",
        f"finish_reason {value!r} does not say how the answer ended (stop, length, tool_calls, function_call, abort)",
    )


# sampling.extra fields that apply to a request offering tools only (vLLM refuses tool_choice without tools)
TOOL_SETTINGS = ("tool_choice", "parallel_tool_calls")


class OpenAIBackend(HttpBackend):
    name = "openai"
    health_path = "/v1/models"

    def __init__(self, cfg, target):
        super().__init__(cfg, target)
        self.model_ids: dict[str, str] = {}  # server url -> the `model` to send, as that server lists it
        self.takes_token_ids = cfg.backend.takes_token_ids()
        # what the chat template drops from an answer; with token ids back the ids are the sample, not a rendering
        ids_back = self.bcfg.return_token_ids or target.tok is None
        self.template_kwargs = cfg.template_kwargs
        self.unrendered = set() if ids_back else set(target.unrendered)

    async def _served_models(self, url: str) -> list[str]:
        status, doc = await self._get_json(url + "/v1/models")
        if status != 200:
            raise Failure(f"http_{status}", f"/v1/models answered {status}")
        with response_shape("/v1/models"):
            entries = [(str(e["id"]), str(e.get("root") or "")) for e in doc["data"]]  # vLLM's root: the path
        for model_id, root in entries:
            if model_matches(self.expected_model, model_id) or (root and model_matches(self.expected_model, root)):
                self.model_ids[url] = model_id
                break
        return [name for entry in entries for name in entry if name]

    def _request(self, server: Server, req: GenRequest) -> tuple[str, dict]:
        s = req.sampling
        done = req.partial.completion_tokens  # > 0 only for a continuation, which needs the `ids` format
        # a server that was down at start-up and is tried in panic mode has not told its name: use another's
        model = self.model_ids.get(server.url) or next(iter(self.model_ids.values()))
        # Every sampling field, neutral ones included: vLLM and SGLang fill an omitted one from the model's
        # generation_config.json. top_k, min_p and repetition_penalty are vLLM's and SGLang's extra fields.
        sampling = sent(s)
        if self.bcfg.openai_fields_only:  # checked neutral at validation; the server's defaults apply to them
            for name in OPENAI_ABSENT:
                sampling.pop(name)
        body: dict = {"model": model, "max_tokens": req.max_tokens - done, **sampling, **s.get("extra", {})}
        seed = req.attempt_seed(done)
        if seed is not None:  # OpenAI's own field: vLLM seeds the request's sampler with it
            body["seed"] = seed
        fmt = self.bcfg.prompt_format if req.prompt_ids is not None else "chat"
        if fmt == "chat":
            path = "/v1/chat/completions"
            body["messages"] = req.messages
            if req.tools:
                body["tools"] = req.tools
            else:  # tool settings mean nothing without tools, and vLLM refuses tool_choice there (400)
                for name in TOOL_SETTINGS:
                    body.pop(name, None)
            if self.template_kwargs:
                body["chat_template_kwargs"] = dict(self.template_kwargs)
        else:
            path = "/v1/completions"
            body["prompt"] = self._input_ids(req) if fmt == "ids" else self.tokenizer.decode(req.prompt_ids)
        if self.bcfg.return_token_ids:
            body["return_token_ids"] = True
        if req.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        body.update(self.bcfg.extra_body)  # checked at validation: it names no field set above
        return path, body

    async def _attempt(self, server: Server, req: GenRequest, rid: str) -> GenResult:
        path, body = self._request(server, req)
        chat = path == "/v1/chat/completions"
        base = req.partial.completion_tokens
        async with self.post(server, path, req, body) as resp:
            # no abort endpoint (closing the connection is the abort): a stop's grace gets only what is on its way
            if req.stream:
                return await self._follow(server, req, EventStream(resp), chat, base)
            return await self._plain(req, Body(resp), path, chat, base)

    async def _plain(self, req: GenRequest, answer: Body, path: str, chat: bool, base: int) -> GenResult:
        doc = await answer.json()
        if isinstance(doc, dict) and "error" in doc:
            raise engine_error(doc)
        with response_shape(f"{path} answer"):
            choice = doc["choices"][0]
            # before the answer enters the partial: one that is no response is not parked, its tokens lost
            finish = finish_or_discard(
                req, finish_reason, choice.get("finish_reason"), (doc.get("usage") or {}).get("completion_tokens", 0)
            )
            ids = _output_ids(choice)
            if chat:
                message = choice["message"]
                self._take_answer(req, ids, message.get("content") or "")
                req.partial.reasoning += _reasoning(message)
                req.partial.tool_calls = [_call(c) for c in message.get("tool_calls") or []]
                self._check_rendered(req, (doc.get("usage") or {}).get("completion_tokens", 0))
            else:
                self._take_answer(req, ids, choice["text"])
            res = self._complete(
                req,
                base,
                int(doc["usage"]["completion_tokens"]),
                finish,
                int(doc["usage"]["prompt_tokens"]) - base,
                has_ids=ids is not None,
                prompt_ids=choice.get("prompt_token_ids") or doc.get("prompt_token_ids"),
            )
        return self._with_drift(req, res)

    async def _follow(self, server: Server, req: GenRequest, stream: EventStream, chat: bool, base: int) -> GenResult:
        """Read the stream into `req.partial` (after the `base` tokens it held when the attempt began)."""
        partial = req.partial
        text_at_base = len(partial.text)
        usage: dict | None = None
        finish: str | None = None
        prompt_ids: list | None = None
        pieces = 0  # text pieces counted so far
        with response_shape("stream chunk"):  # one guard for the whole stream, not one per chunk
            async for event in stream.events():
                if "error" in event:
                    raise engine_error(event)
                usage = event.get("usage") or usage
                prompt_ids = event.get("prompt_token_ids") or prompt_ids
                for choice in event.get("choices") or []:
                    piece, parsed = _delta(partial, choice.get("delta") or {}) if chat else (choice.get("text"), False)
                    if piece or parsed:  # a delta is one decode step, also when a parser took its text
                        partial.text += piece or ""
                        pieces += 1
                    elif choice.get("finish_reason") in ENDED_TURN:  # the end-of-turn step: a token with no text
                        pieces += 1
                    if ids := _output_ids(choice):
                        partial.output_ids.extend(map(int, ids))
                    prompt_ids = choice.get("prompt_token_ids") or prompt_ids
                    finish = choice.get("finish_reason") or finish
                _count(partial, base, pieces)
        if finish is None:
            raise stream_cut(server.url)
        with response_shape("stream usage"):
            new = int(usage["completion_tokens"]) if usage else partial.completion_tokens - base
            try:
                finish = finish_or_discard(req, finish_reason, finish, new)
                self._check_rendered(req, new)
            except Failure:  # the streamed answer is no response: back to what the attempt started from
                del partial.output_ids[base:]
                partial.text, partial.completion_tokens = partial.text[:text_at_base], base
                raise
            res = self._complete(
                req,
                base,
                new,
                finish,
                int(usage["prompt_tokens"]) - base if usage else None,
                has_ids=len(partial.output_ids) > base,
                prompt_ids=prompt_ids,
            )
        if usage is None:
            res.extra["completion_tokens_estimated"] = True
        return self._with_drift(req, res)

    def _check_rendered(self, req: GenRequest, new_tokens: int) -> None:
        """An answer with a part the chat template drops would be stored as another answer: refuse it, not retried
        (the next answer would meet the same template), its `new_tokens` thrown away."""
        found = {"reasoning": bool(req.partial.reasoning), "tool_calls": bool(req.partial.tool_calls)}
        dropped = sorted(part for part in self.unrendered if found[part])
        if dropped:
            req.discarded_tokens += int(new_tokens)
            raise Failure("unrenderable", unrenderable_detail(dropped))

    def _with_drift(self, req: GenRequest, res: GenResult) -> GenResult:
        """With a text prompt the server re-tokenizes: say so when its count differs from the exact prompt's."""
        if self.bcfg.prompt_format == "text" and req.prompt_ids is not None and res.prompt_tokens:
            drift = res.prompt_tokens - len(req.prompt_ids)
            if drift:
                res.extra["prompt_tokens_drift"] = drift
        return res


def _output_ids(choice: dict) -> list | None:
    """vLLM names them `token_ids`; SGLang's OpenAI API, asked the same, `response_token_ids`."""
    ids = choice.get("token_ids")
    return ids if ids is not None else choice.get("response_token_ids")


def _count(partial: Partial, base: int, pieces: int) -> None:
    """Exact when the server streams token ids; otherwise one text piece per decode step, which is what vLLM and
    `transformers serve` send (a guide for the budget while streaming; the final count is usage's)."""
    partial.completion_tokens = len(partial.output_ids) if len(partial.output_ids) > base else base + pieces


def _reasoning(message: dict) -> str:
    """The thinking a reasoning parser moved out of `content`: SGLang's and vLLM < 0.11's `reasoning_content`,
    newer vLLM's `reasoning`."""
    return message.get("reasoning_content") or message.get("reasoning") or ""


def _call(call: dict) -> dict:
    """One tool call as OpenAI's message carries it (arguments a JSON string), with nothing else of the server's."""
    fn = call["function"]
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}


def _delta(partial: Partial, delta: dict) -> tuple[str | None, bool]:
    """A chat stream's delta: (its `content`, whether it carried thinking or tool-call pieces, taken into the
    partial here). A call's pieces share its `index`: the id and name come first, then `arguments` fragments."""
    reasoning = _reasoning(delta)
    partial.reasoning += reasoning
    for piece in delta.get("tool_calls") or []:
        index = int(piece["index"])
        while len(partial.tool_calls) <= index:
            partial.tool_calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call, fn = partial.tool_calls[index], piece.get("function") or {}
        call["id"] = piece.get("id") or call["id"]
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    return delta.get("content"), bool(reasoning or delta.get("tool_calls"))


def unrenderable_detail(parts: list[str]) -> str:
    return (
        f"a server parser moved the answer's {' and '.join(parts)} out of its text and the chat template drops "
        "that from the assistant turn, so the sample would be another answer: serve without the parser, set "
        "model.chat_template to one that renders it, or set backend.return_token_ids"
    )
